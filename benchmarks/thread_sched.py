"""Where each engine's wall time goes at the OS level: per thread, the CPU time it ran, the
time it waited for a core while runnable, and how often it was scheduled (issue 29, item 6).

    python benchmarks/thread_sched.py [--size 64] [--rounds 4] [--steps N]
                                      [--pk-schedule 1f1b] [--torch-schedule 1F1B]

A sampling profile (``benchmarks/profile_engines.py``) says where a rank's *busy* time goes;
it cannot see time a rank spends not running: blocked on a peer, or runnable but waiting for
a core while another thread holds it. On a machine with fewer cores than busy threads that
time decides the step, so this benchmark reads Linux's scheduler statistics instead
(``/proc/<pid>/task/<tid>/schedstat``: nanoseconds on a CPU, nanoseconds runnable on a run
queue, number of time slices) for every thread of each rank, before and after a block of
steady steps, and prints them per step, side by side for both engines.

The model, data and engines are those of ``benchmarks/vs_torch.py`` (imported, not copied):
2 gloo processes, 2 stages, 8 micro-batches of 4 sequences, AdamW, fp32, one intra-op thread
per process. Each round launches fresh workers for pipekernel, then for torch (the order
rotated by the round); each warms up 3 steps, then times ``--steps``. Per rank and engine
the table gives the median over rounds of:

* ``wall``: the step's wall time (both ranks' blocks sit between two barriers);
* ``main run`` / ``main queue``: the main thread's CPU time and its time runnable without a
  core; ``main idle`` = wall - run - queue: blocked (on a peer, a lock, a sleep);
* ``helper run``: other Python threads (pipekernel's waiter thread);
* ``gloo run`` / ``gloo queue``: gloo's threads (its socket loop and work queue);
* ``slices``: times the threads of each kind were put on a CPU, per step (each wake-up is
  one), as main / helper / gloo / other.

Linux only (it reads ``/proc``). Run it on an otherwise idle machine: the load average is
printed before and after.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import pipekernel as pk

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_torch  # noqa: E402  (the benchmark's model, data and engines)

#: thread kinds, in the order they are printed
KINDS = ("main", "helper", "gloo", "other")
#: OS thread names (``comm``) of the threads gloo and torch.distributed start
GLOO_THREADS = ("gloo_tcp_loop", "pt_gloo_runloop")


def snapshot(pid: int | None = None) -> dict[int, tuple[str, int, int, int]]:
    """``{tid: (os name, ns on a CPU, ns runnable on a run queue, time slices)}`` for every
    thread of ``pid`` (default: this process) that still exists when it is read."""
    pid = os.getpid() if pid is None else pid
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        base = f"/proc/{pid}/task/{tid}"
        try:
            with open(f"{base}/comm") as f:
                name = f.read().strip()
            with open(f"{base}/schedstat") as f:
                run, queued, slices = (int(x) for x in f.read().split()[:3])
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile
            continue
        out[int(tid)] = (name, run, queued, slices)
    return out


def kind_of(tid: int, name: str, main_tid: int, python_tids: set[int]) -> str:
    """Which of :data:`KINDS` a thread is: the main thread, another Python thread (a
    pipekernel waiter), one of gloo's, or anything else (the store's, the allocator's)."""
    if tid == main_tid:
        return "main"
    if tid in python_tids:
        return "helper"
    if name in GLOO_THREADS:
        return "gloo"
    return "other"


def per_kind(before: dict, after: dict, main_tid: int, python_tids: set[int],
             steps: int) -> dict[str, tuple[float, float, float]]:
    """``{kind: (ms on a CPU, ms on a run queue, slices)}`` per step between two
    :func:`snapshot` s, summed over the threads of each kind that exist in both (a thread
    started in between has no baseline: it is left out rather than counted from zero)."""
    totals = {kind: [0, 0, 0] for kind in KINDS}
    for tid, (name, run, queued, slices) in after.items():
        if tid not in before:
            continue
        _, run0, queued0, slices0 = before[tid]
        row = totals[kind_of(tid, name, main_tid, python_tids)]
        row[0] += run - run0
        row[1] += queued - queued0
        row[2] += slices - slices0
    return {kind: (run / 1e6 / steps, queued / 1e6 / steps, slices / steps)
            for kind, (run, queued, slices) in totals.items()}


def worker(engine: str, schedule: str, d: int, seq: int, steps: int) -> dict:
    """One rank: build ``engine`` as vs_torch does, warm up, then time ``steps`` steps
    with a scheduler snapshot on each side."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(minutes=30))
    rank = dist.get_rank()
    config = (vs_torch.PK if engine == "pk" else vs_torch.Torch)(schedule, d, seq, rank)
    for s in range(3):
        config.step(s)
    dist.barrier()
    before, start = snapshot(), time.perf_counter()
    for s in range(3, 3 + steps):
        config.step(s)
    dist.barrier()
    wall, after = (time.perf_counter() - start) / steps, snapshot()
    python_tids = {t.native_id for t in threading.enumerate()}
    kinds = per_kind(before, after, threading.main_thread().native_id, python_tids, steps)
    if hasattr(config, "close"):
        config.close()
    return {"wall": wall * 1e3, "kinds": kinds}


def _row(label: str, results: list[dict]) -> str:
    med = statistics.median
    wall = med(r["wall"] for r in results)
    k = {kind: [med(r["kinds"][kind][i] for r in results) for i in range(3)]
         for kind in KINDS}
    run, queue = k["main"][0], k["main"][1]
    slices = "/".join(f"{k[kind][2]:.0f}" for kind in KINDS)
    return (f"| {label} | {wall:.1f} | {run:.1f} | {queue:.1f} | {wall - run - queue:.1f} | "
            f"{k['helper'][0]:.2f} | {k['gloo'][0]:.2f} | {k['gloo'][1]:.2f} | {slices} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(vs_torch.SIZES), default="64")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per launch (default: 40 at d=64, 6 at d=256)")
    parser.add_argument("--pk-schedule", default="1f1b")
    parser.add_argument("--torch-schedule", default="1F1B")
    args = parser.parse_args(argv)
    d, seq, _ = vs_torch.SIZES[args.size]
    steps = args.steps or (40 if d == 64 else 6)
    engines = [("pk", args.pk_schedule), ("torch", args.torch_schedule)]
    print(f"torch {torch.__version__}, load before {os.getloadavg()}; d={d}, sequence {seq}, "
          f"{steps} steps per launch, {args.rounds} rounds")
    results: dict[str, list[list[dict]]] = {e: [] for e, _ in engines}
    for r in range(args.rounds):
        for engine, schedule in engines[r % 2:] + engines[:r % 2]:
            results[engine].append(pk.launch(worker, 2, args=(engine, schedule, d, seq, steps)))
    print("\n| engine, rank | wall ms | main run | main queue | main idle | helper run "
          "| gloo run | gloo queue | slices main/helper/gloo/other |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for engine, schedule in engines:
        for rank in (0, 1):
            print(_row(f"{engine} {schedule} r{rank}", [out[rank] for out in results[engine]]))
    print(f"\n(ms per step, median over rounds) load after {os.getloadavg()}")


if __name__ == "__main__":
    main()
