"""benchmarks/thread_sched.py: how scheduler snapshots become per-step figures per kind of
thread (issue 29, item 6)."""
from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import thread_sched as ts  # noqa: E402

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").exists(),
                                reason="reads Linux's /proc")


def test_threads_are_sorted_by_kind_and_counted_per_step():
    before = {1: ("python", 0, 0, 0), 2: ("python", 10, 0, 1), 3: ("gloo_tcp_loop", 0, 5, 2),
              4: ("pt_gloo_runloop", 0, 0, 0), 5: ("pt_tcpstore_uv", 0, 0, 0)}
    after = {1: ("python", 4_000_000, 2_000_000, 8), 2: ("python", 2_000_010, 0, 5),
             3: ("gloo_tcp_loop", 1_000_000, 3_000_005, 6), 4: ("pt_gloo_runloop", 1_000_000, 0, 2),
             5: ("pt_tcpstore_uv", 0, 0, 0),
             6: ("gloo_tcp_loop", 9_000_000, 9_000_000, 9)}  # started in between: no baseline
    kinds = ts.per_kind(before, after, main_tid=1, python_tids={1, 2}, steps=2)
    assert kinds["main"] == (2.0, 1.0, 4.0)
    assert kinds["helper"] == (1.0, 0.0, 2.0)
    assert kinds["gloo"] == (1.0, 1.5, 3.0)  # both gloo threads, the new one left out
    assert kinds["other"] == (0.0, 0.0, 0.0)


def test_a_live_python_thread_is_found_and_named_helper():
    stop = threading.Event()
    worker = threading.Thread(target=lambda: stop.wait(5.0))
    worker.start()
    try:
        snap = ts.snapshot()
        main = threading.main_thread().native_id
        assert main in snap and worker.native_id in snap
        python = {t.native_id for t in threading.enumerate()}
        assert ts.kind_of(worker.native_id, snap[worker.native_id][0], main, python) == "helper"
        assert ts.kind_of(main, snap[main][0], main, python) == "main"
    finally:
        stop.set()
        worker.join()
