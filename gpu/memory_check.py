"""The GPU check's memory step (issue 46 item 6): each stage's predicted peak against
``torch.cuda.max_memory_allocated``, and offload's saving against its step-time cost.

``--stages`` stages (default 4) share one GPU through ``transport="staged"`` (a process
each); for each schedule
(default ``1f1b zbv v-half``) the residual MLP of ``benchmarks/memory_table.py`` (widened
by ``--dim`` and ``--batch``) trains ``--steps`` batches of ``--micro-batches``; the last
step's peak is read from the allocator (reset before that step) beside the memory meter's
exact storage count and the planner's prediction (:mod:`pipekernel.schedules.sim_memory`).
Then ``1f1b`` runs again with ``offload=True``: its peak and mean step time (CUDA
synchronised, after the warm-up steps) against the run without. The last line is one
summary (``MEMORY CHECK: ...``).

Without CUDA it prints that it skipped and exits 0. ``--dry-run`` runs the same code path on
CPU (gloo, the memory meter's storage counts in place of the allocator's, offload through
:class:`pipekernel.ModelMover`): a check of the script, not a measurement.

Usage: ``python gpu/memory_check.py [--dry-run] [--schedules 1f1b zbv v-half]
[--stages 4] [--micro-batches 8] [--dim 512] [--batch 256] [--steps 4]``
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import memory_table as table  # noqa: E402

import pipekernel as pk  # noqa: E402
from pipekernel.plugins.memory import MemoryMeter  # noqa: E402
from pipekernel.testing import run_ranks  # noqa: E402


def _size(args: argparse.Namespace) -> None:
    table.DIM, table.BATCH = args.dim, args.batch


def measure(schedule: str, args: argparse.Namespace, offload: bool) -> dict:
    """One schedule on this rank: the allocator's and the meter's peaks, the step time."""
    _size(args)
    torch.set_num_threads(1)
    cuda = not args.dry_run
    chunks = table.CHUNKS.get(schedule, 1)
    meter = MemoryMeter()
    option = None
    if offload:
        option = True if cuda else pk.Offload(mover=pk.ModelMover())
    engine = pk.PipelineEngine(table._module(args.stages, chunks, 0),
                               optimizer=lambda p: torch.optim.Adam(p, lr=1e-3),
                               micro_batches=args.micro_batches, schedule=schedule,
                               chunks=chunks if chunks > 1 else None,
                               transport="staged" if cuda else "gloo", plugins=[meter],
                               timeout=120, offload=option)
    device = engine.transport.device
    g = torch.Generator().manual_seed(0)
    times = []
    allocated = 0
    for step in range(args.steps):
        data = [(torch.randn(table.BATCH, table.IN, generator=g),
                 torch.randn(table.BATCH, table.OUT, generator=g))
                for _ in range(args.micro_batches)]
        if cuda:
            torch.cuda.synchronize(device)
            if step == args.steps - 1:
                torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        engine.train_batch(iter(data))
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
        if cuda and step == args.steps - 1:
            allocated = torch.cuda.max_memory_allocated(device)
    bounds, cls = list(engine.partition_report.bounds), engine.schedule_cls
    offloaded = engine.runtime.offload
    moved = sum(offloaded.moved.values()) if offloaded is not None else 0
    engine.close()
    warm = times[1:] or times
    return {**meter.last, "allocated": allocated or meter.last["memory_peak_bytes"],
            "step_s": sum(warm) / len(warm), "bounds": bounds, "moved": moved,
            "placement": getattr(cls, "placement", "loop")}


def worker(args: argparse.Namespace) -> list:
    out = [measure(s, args, False) for s in args.schedules]
    out.append(measure("1f1b", args, True))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, gloo and the model mover: check the script, measure nothing")
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "zbv", "v-half"])
    parser.add_argument("--stages", type=int, default=4,
                        help="stages (processes), all on one GPU")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        print("MEMORY CHECK: skipped (no CUDA device; --dry-run runs the CPU path)")
        return 0
    if "1f1b" not in args.schedules:  # offload is compared with 1f1b without it
        args.schedules.append("1f1b")
    if args.dry_run:
        args.dim, args.batch, args.steps = min(args.dim, 16), min(args.batch, 8), 2
    ranks = run_ranks(worker, args.stages, args, timeout=600)
    _size(args)
    what = "allocator" if not args.dry_run else "meter(CPU)"
    print(f"{'schedule':<10}{'stage':>6}{'predicted':>12}{'meter':>12}  {what:>10}"
          f"{'pred/meas':>10}")
    summary = []
    for k, schedule in enumerate(args.schedules):
        got = ranks[0][k]
        pred = table.predict(schedule, args.stages, args.micro_batches, 0, got["bounds"],
                             got["placement"])
        worst = 0.0
        for stage in range(args.stages):
            row = ranks[stage][k]
            guess = sum(pred[stage].values())
            ratio = guess / row["allocated"]
            worst = max(worst, abs(ratio - 1))
            print(f"{schedule:<10}{stage:>6}{guess:>12.0f}{row['memory_peak_bytes']:>12}  "
                  f"{row['allocated']:>10}{ratio:>10.3f}")
        summary.append(f"{schedule} worst |pred/meas-1| {worst:.3f}")
    base, moved = ranks[0][args.schedules.index("1f1b")], ranks[0][-1]
    saving = 1 - moved["allocated"] / base["allocated"]
    cost = moved["step_s"] / base["step_s"] - 1
    print(f"offload (1f1b, stage 0, min_distance 2, prefetch 1): peak {base['allocated']} -> {moved['allocated']} bytes "
          f"({saving:+.1%} saved), step {base['step_s'] * 1e3:.2f} -> "
          f"{moved['step_s'] * 1e3:.2f} ms ({cost:+.1%}); {moved['moved']} bytes moved out "
          f"and back per step"
          + (" [dry run: CPU model, not timings]" if args.dry_run else ""))
    summary.append(f"offload saves {saving:.1%} of stage 0's peak for {cost:+.1%} step time")
    print("MEMORY CHECK: " + "; ".join(summary) + (" (dry run)" if args.dry_run else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
