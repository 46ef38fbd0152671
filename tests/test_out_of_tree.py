"""A third-party package, built and installed by this test, publishes a transport and a
monitor plugin through entry points; pipekernel finds, selects, disables and lists them."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from models import mlp, mlp_data, sgd
from plugins_for_tests import flat

import pipekernel as pk
from pipekernel.testing import check_transport
from pipekernel.testing import run_ranks

PACKAGE = Path(__file__).resolve().parent.parent / "examples" / "plugin_package"
STEPS, MICRO = 3, 4


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True, capture_output=True,
                   env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """Build the package from a fresh copy and install it into a directory of its own, put
    on this process's path (which the ranks' workers take) and on ``PYTHONPATH`` (the CLI's).
    The environment is never changed: tests running beside this one (``pytest -n``) never
    see the package, and nothing is left to uninstall."""
    root = tmp_path_factory.mktemp("oot")
    source, target = root / "pk-oot-demo", str(root / "site")
    shutil.copytree(PACKAGE, source, ignore=shutil.ignore_patterns("*.egg-info", "build"))
    _pip("install", "--no-build-isolation", "--no-deps", "--no-index", "--quiet",
         "--target", target, str(source))
    before = os.environ.get("PYTHONPATH")
    sys.path.insert(0, target)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [target, before]))
    try:
        yield
    finally:
        sys.path.remove(target)
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


def train_worker(transport):
    engine = pk.PipelineEngine(mlp(num_stages=2), optimizer=sgd, micro_batches=MICRO,
                               transport=transport, timeout=60)
    losses = [engine.train_batch(iter(mlp_data(s, 0, MICRO))).item() for s in range(STEPS)]
    monitor = engine.pm.get_plugin("oot_monitor")
    expected = flat(pk.schedules.OneFOneB(2, engine.stage, MICRO).steps()) * STEPS
    report = {"losses": losses, "transport": type(engine.transport).__name__,
              "messages": getattr(engine.transport, "messages", None),
              "seen": monitor.seen if monitor else None, "batches": monitor and monitor.batches,
              "expected": expected, "imported": "pk_oot_demo.monitor" in sys.modules}
    engine.close()
    return report


def test_training_selects_the_transport_by_name_and_the_monitor_sees_everything(installed):
    counted = run_ranks(train_worker, 2, "counting")
    plain = run_ranks(train_worker, 2, "gloo", env={"PIPEKERNEL_DISABLE_PLUGINS": "oot_monitor"})
    for with_oot, without in zip(counted, plain):
        assert with_oot["transport"] == "CountingTransport" and with_oot["messages"] > 0
        assert with_oot["losses"] == without["losses"]  # bit-identical to gloo
        assert with_oot["seen"] == with_oot["expected"] and with_oot["batches"] == STEPS
        # disabled through the environment: never imported, never called
        assert without["seen"] is None and not without["imported"]


def test_the_third_party_transport_passes_the_conformance_suite(installed):
    assert check_transport("counting", nprocs=2, timeout_check=0.5)[-1] == "timeout"


def _plugins(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "pipekernel.apps.cli", "plugins", *args],
                          check=True, capture_output=True, text=True).stdout


def test_pipekernel_plugins_lists_both_with_distribution_and_version(installed, capsys):
    found = json.loads(_plugins("--json"))
    transport = next(e for e in found["transports"] if e["name"] == "counting")
    assert (transport["distribution"], transport["version"]) == ("pk-oot-demo", "0.3.1")
    assert transport["provider"] == "pk_oot_demo.transport:CountingTransport"
    monitor = next(e for e in found["plugins"] if e["name"] == "oot_monitor")
    assert (monitor["distribution"], monitor["version"], monitor["status"]) == \
        ("pk-oot-demo", "0.3.1", "")
    text = _plugins()
    assert "counting" in text and "pk-oot-demo 0.3.1" in text
    from pipekernel.apps.cli import main  # in this process too: the package is visible at once

    assert main(["plugins", "--no-autoload"]) == 0
    no_autoload = capsys.readouterr().out.split("schedules:")[0]
    assert "oot_monitor" in no_autoload and "[not loaded (autoload off)]" in no_autoload
    assert main(["plugins", "--disable", "oot_monitor"]) == 0
    # columns are as wide as the longest name installed (the built-ins grow): any run of spaces
    assert re.search(r"oot_monitor +pk-oot-demo 0\.3\.1 +pk_oot_demo\.monitor:InstructionMonitor"
                     r" +\[disabled\]", capsys.readouterr().out)


def test_autoload_off_keeps_third_party_plugins_out(installed):
    from pipekernel.extend.manager import make_plugin_manager

    assert make_plugin_manager().get_plugin("oot_monitor") is not None
    first, second = make_plugin_manager(), make_plugin_manager()
    assert first.get_plugin("oot_monitor") is not second.get_plugin("oot_monitor")
    assert make_plugin_manager(autoload=False).get_plugin("oot_monitor") is None
    assert make_plugin_manager(autoload=False).get_plugin("precision") is not None
