"""pipekernel.launcher.launch: workers that returned their result may finish their clean-up."""
from __future__ import annotations

import multiprocessing.util
import sys
import time
from pathlib import Path

import pytest

from pipekernel.launcher.launch import launch


def _write_later(path: str) -> None:
    time.sleep(1.0)
    Path(path).write_text("clean exit")


def _worker_with_slow_cleanup(directory: str) -> int:
    import os
    rank = int(os.environ["RANK"])
    # runs at the worker's normal exit, after its result was sent (like a library's lock
    # or file being released); a worker killed right after returning never gets there
    multiprocessing.util.Finalize(None, _write_later, args=(f"{directory}/rank{rank}",),
                                  exitpriority=10)
    return rank


def test_workers_that_returned_exit_on_their_own(tmp_path):
    assert launch(_worker_with_slow_cleanup, 2, (str(tmp_path),), timeout=300) == [0, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]


def _engines_one_after_another(rounds: int) -> list[float]:
    import torch

    import pipekernel as pk
    from tests.models import mlp, mlp_data
    losses = []
    for r in range(rounds):  # each engine creates, then destroys, its own process group
        engine = pk.PipelineEngine(mlp(num_stages=2), micro_batches=2, timeout=30,
                                   optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
        losses.append(engine.train_batch(iter(mlp_data(r, 0, 2))))
        engine.close()
    return losses


def test_an_engine_after_a_closed_one_gets_a_new_process_group():
    # the second process group must not rendezvous on the first one's store file: its
    # keys (gloo's addresses) are stale once that group is destroyed, and a rank that
    # starts early would read them and time out connecting
    results = launch(_engines_one_after_another, 2, (3,), timeout=300)
    assert results[0] == results[1] and len(results[0]) == 3


def test_preload_joins_the_environment_and_the_list_and_leaves_out_what_is_missing(
        monkeypatch):
    from pipekernel.launcher import launch as module
    monkeypatch.setenv("PIPEKERNEL_PRELOAD", " json , no_such_module_xyz,")
    monkeypatch.setattr(module, "PRELOAD", ["json", "csv", "no_such_pkg_xyz.sub"])
    assert module._preload() == ["json", "csv"]
    # asking does not import: the server imports it, once
    monkeypatch.setattr(module, "PRELOAD", ["wsgiref.simple_server"])
    for name in [n for n in sys.modules if n.partition(".")[0] == "wsgiref"]:
        monkeypatch.delitem(sys.modules, name)
    assert module._preload() == ["json", "wsgiref.simple_server"]
    assert "wsgiref" not in sys.modules
    monkeypatch.setattr(module, "PRELOAD", ["json", "csv", "no_such_pkg_xyz.sub"])
    monkeypatch.delenv("PIPEKERNEL_PRELOAD")
    assert module._preload() == ["json", "csv"]


def test_the_suite_preloads_without_exporting_it_to_the_programs_it_starts():
    """The suite's fork server preloads transformers and Lightning through the list; the
    environment would hand the list to every CLI, example and docs program a system test
    runs, and each of their fork servers would import both (~8 s of CPU) for nothing."""
    import os
    import conftest
    from pipekernel.launcher import launch as module
    if conftest.CALLER_PRELOAD:
        pytest.skip("PIPEKERNEL_PRELOAD was set by the caller")
    assert "PIPEKERNEL_PRELOAD" not in os.environ
    assert "transformers.modeling_utils" in module.PRELOAD
