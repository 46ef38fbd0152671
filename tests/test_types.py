"""The type checker over the product (issue 45, item 5): ``mypy`` with the configuration in
pyproject.toml (``[tool.mypy]``) over ``pipekernel/``, ``plugins/`` and ``transports/`` as the
packages they install as (``pipekernel``, ``pipekernel.plugins``, ``pipekernel.transports``),
and the views a plugin reads holding a plugin to their contract.

mypy cannot follow pyproject's ``package-dir`` mapping (nor an editable install's import
hook), so the tests check a tree of symbolic links shaped like the installed package, kept
(with mypy's cache) in one temporary folder per checkout: a second run rechecks only what
changed. Errors are reported with the checkout's own paths.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.system  # starts another program (mypy)

ROOT = Path(__file__).resolve().parent.parent
#: the folders checked, and where each sits in the installed package
CHECKED = {"pipekernel": ROOT / "pipekernel", "pipekernel/plugins": ROOT / "plugins",
           "pipekernel/transports": ROOT / "transports"}


def _tree() -> Path:
    """The linked tree (``<work>/src/pipekernel/...``), rebuilt: one link per entry of
    ``pipekernel/``, and ``plugins``/``transports`` where they install."""
    work = Path(tempfile.gettempdir()) / \
        f"pipekernel-mypy-{hashlib.sha1(str(ROOT).encode()).hexdigest()[:10]}"
    package = work / "src" / "pipekernel"
    package.mkdir(parents=True, exist_ok=True)
    for entry in package.iterdir():  # links only: nothing of the checkout is touched
        entry.unlink()
    for entry in CHECKED["pipekernel"].iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for name, folder in CHECKED.items():
        if name != "pipekernel":
            (work / "src" / name).symlink_to(folder)
    return work


def _mypy(*targets: str) -> subprocess.CompletedProcess:
    work = _tree()
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
         "--cache-dir", str(work / "cache"), "--no-error-summary", *targets],
        cwd=work / "src", env={**os.environ, "MYPYPATH": str(work / "src")},
        capture_output=True, text=True, timeout=1800)
    out = proc.stdout + proc.stderr
    for name, folder in sorted(CHECKED.items(), key=lambda kv: -len(kv[0])):
        out = out.replace(f"{name}/", f"{folder.relative_to(ROOT)}/")
    proc.stdout = out
    return proc


def test_the_product_type_checks():
    proc = _mypy("-p", "pipekernel")
    assert proc.returncode == 0, "mypy finds (fix them; a `# type: ignore[code]` needs its " \
        "reason beside it):\n" + proc.stdout


def test_a_plugin_is_held_to_the_views(tmp_path):
    """A plugin annotating ``engine: EngineView`` may read what the view lists, typed, and
    neither assign it nor pass the wrong thing: mypy says so."""
    plugin = tmp_path / "pk_typed_plugin.py"
    plugin.write_text(
        "from pipekernel.plugin import EngineView, LoadMicroBatch\n"
        "def fine(engine: EngineView) -> int:\n"
        "    engine.runtime.inputs_of(LoadMicroBatch(0))\n"
        "    return engine.global_steps + engine.rank\n"
        "def assigns(engine: EngineView) -> None:\n"
        "    engine.global_steps = 3\n"
        "def misreads(engine: EngineView) -> str:\n"
        "    return engine.stage\n"
        "def wrong_argument(engine: EngineView) -> None:\n"
        "    engine.runtime.inputs_of('F0')\n")
    proc = _mypy(str(plugin))
    lines = [line for line in proc.stdout.splitlines() if ": error:" in line]
    where = sorted(int(line.split(":")[1]) for line in lines)
    assert where == [6, 8, 10], proc.stdout  # none in `fine`, one in each other function
    assert "read-only" in lines[0] and "int" in lines[1], proc.stdout


def test_the_configuration_stays_strict():
    """What makes the check matter is in pyproject.toml; relaxing it fails here."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        config = tomllib.load(f)["tool"]["mypy"]
    for key in ("check_untyped_defs", "no_implicit_optional", "warn_unused_ignores"):
        assert config.get(key) is True, key
    typed = [o for o in config["overrides"] if o.get("disallow_untyped_defs")]
    assert any({"pipekernel.extend.views", "pipekernel.extend.hookspecs"} <= set(o["module"])
               for o in typed)
    skipped = {m for o in config["overrides"] if o.get("ignore_errors") for m in o["module"]}
    assert not {m for m in skipped if m.startswith("pipekernel.") and
                not m.startswith(("pipekernel.schedules.", "pipekernel.stage.runtime",
                                  "pipekernel.grid.", "pipekernel.engine."))}, skipped
