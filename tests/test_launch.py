"""pipekernel.launch: workers that returned their result may finish their clean-up."""
from __future__ import annotations

import multiprocessing.util
import time
from pathlib import Path

from pipekernel.launch import launch


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
    assert launch(_worker_with_slow_cleanup, 2, (str(tmp_path),), timeout=120) == [0, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]
