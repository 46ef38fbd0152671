"""pipekernel.engine.launch: workers that returned their result may finish their clean-up."""
from __future__ import annotations

import multiprocessing.util
import time
from pathlib import Path

from pipekernel.engine.launch import launch


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
