"""Errors through the Python API: pipekernel's words first (what, where, how to fix), the
backend's text after them in a few lines; every ``ConfigError`` in the code has a fix."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
from torch import nn

import pipekernel as pk
from pipekernel.errors import TransportError, shorten

ROOT = Path(__file__).resolve().parent.parent

# gloo's text when a peer vanished during the rendezvous, as long as it comes
GLOO_TEXT = ("[../third_party/gloo/gloo/transport/tcp/pair.cc:144] connectFullMesh failed, "
             "Connection refused\n" + "\n".join(f"  frame #{i}: 0x{i:08x} in libtorch_cpu.so"
                                                for i in range(36)) + "\nGLHF! \U0001F3D6\ufe0f")


def test_shorten_keeps_a_few_lines_and_says_how_many_it_left_out():
    assert shorten(GLOO_TEXT) == (
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:144] connectFullMesh failed, "
        "Connection refused\n  frame #0: 0x00000000 in libtorch_cpu.so\n"
        "  frame #1: 0x00000001 in libtorch_cpu.so\n... (35 more lines)")
    assert shorten("one line") == "one line"
    assert shorten("x" * 500, width=50) == "x" * 47 + "..."
    assert shorten("a\n\n\nb", lines=1) == "a\n... (1 more line)"


def test_a_backend_error_comes_after_pipekernels_words():
    err = TransportError("rank 1 failed to receive from rank 0", rank=1,
                         hint="look at rank 0's log").add_cause(RuntimeError(GLOO_TEXT), "gloo")
    lines = str(err).splitlines()
    assert lines[0] == "[rank 1] rank 1 failed to receive from rank 0"
    assert lines[1] == "  how to fix: look at rank 0's log"
    assert lines[2].startswith("  gloo said: [../third_party/gloo/gloo/transport/tcp/pair.cc:144] "
                               "connectFullMesh failed")
    assert lines[-1].strip() == "... (35 more lines)" and len(lines) == 6
    assert isinstance(err.cause, RuntimeError)


def _fails_with_gloo_text():
    import os

    if os.environ["RANK"] == "1":
        try:
            raise RuntimeError(GLOO_TEXT)
        except RuntimeError as err:
            raise TransportError("rank 1 could not start the gloo process group", rank=1,
                                 hint="check that every rank started").add_cause(err, "gloo") \
                from None
    return "ok"


def test_a_rank_failure_through_launch_starts_with_pipekernels_words():
    with pytest.raises(pk.RankError) as info:
        pk.launch(_fails_with_gloo_text, 2)
    text = str(info.value)
    lines = text.splitlines()
    assert lines[0] == "rank 1 failed: [rank 1] rank 1 could not start the gloo process group"
    assert lines[1] == "  how to fix: check that every rank started"
    assert lines[2].startswith("  gloo said: [../third_party/gloo")
    assert "GLHF" not in text and text.count("frame #") <= 4  # shortened, traceback included
    assert len(lines) < 30, text


def _engine_on_a_missing_interface():
    layers = [pk.LayerSpec(nn.Linear, 4, 8), pk.LayerSpec(nn.Linear, 8, 2)]
    module = pk.PipelineModule(layers, loss_fn=nn.MSELoss(), num_stages=2, partition="uniform")
    pk.PipelineEngine(module, micro_batches=2, timeout=30)


def test_a_process_group_that_cannot_start_says_so_first():
    with pytest.raises(pk.RankError) as info:
        pk.launch(_engine_on_a_missing_interface, 2, env={"GLOO_SOCKET_IFNAME": "pk-nope0"})
    first, fix, said = str(info.value).splitlines()[:3]
    assert first.startswith(f"rank {info.value.rank} failed: [rank {info.value.rank}] rank "
                            f"{info.value.rank} of 2 could not start the gloo process group")
    assert fix.startswith("  how to fix: check that every rank started")
    assert "GLOO_SOCKET_IFNAME" in fix
    assert said.startswith("  gloo said: ") and "pk-nope0" in said


def test_zero_micro_batches_names_the_rank_and_the_fix(monkeypatch):
    for key, value in {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)  # a launcher's world; refused before any connection
    module = pk.PipelineModule([nn.Linear(2, 2)] * 4, loss_fn=nn.MSELoss(), num_stages=4)
    with pytest.raises(pk.ConfigError) as info:
        pk.PipelineEngine(module, micro_batches=0)
    assert str(info.value).startswith("[rank 3] micro_batches must be a positive int, got 0\n"
                                      "  how to fix: pass micro_batches=N")


def test_every_config_error_in_the_code_base_has_a_fix_line():
    missing = []
    names = {"ConfigError", "UnknownNameError", "PluginLoadError"}
    for folder in ("pipekernel", "plugins", "transports", "apps", "integrations"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                func = getattr(node, "func", None)
                name = getattr(func, "id", None) or getattr(func, "attr", None)
                if isinstance(node, ast.Call) and name in names and not any(
                        k.arg in ("hint", None) for k in node.keywords):
                    missing.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert missing == [], "ConfigError without hint= (how to fix):\n" + "\n".join(missing)

