"""Planning at scale: how long the simulator takes to prove and time a plan, per (schedule,
stages, micro-batches), and how that grows (issue 29, item 7: a 64-stage x 256-micro-batch
plan in <= 1 s, linear in the instructions).

Each row is one ``simulate(...)`` of a fresh plan (rendezvous semantics, the plan the runtime
runs), best of ``--repeat`` runs of CPU time; the schedule's own construction is included
except zero-bubble's planner, whose per-size result is cached after the first run. Columns:
the instructions proved (every stage's stream), seconds, microseconds per instruction, and
the growth against the row above with half the micro-batches (x2 instructions: ~2.0 is
linear), and ``build``: the share of those seconds that building every stage's steps takes
(the schedule objects and their unpaired steps, what ``simulate`` asks of the schedule before
it proves anything; timed alone, best of ``--repeat``). ``--grid`` also times
``format_grid`` (what ``pipekernel schedule`` prints).

    python benchmarks/planner_scale.py [--schedules 1f1b,interleaved,zbv] [--stages 16,32,64]
                                       [--micro-batches 64,128,256] [--repeat 3] [--grid]

Run it on an idle machine: the figures are CPU time, but a loaded machine slows them too.
"""
from __future__ import annotations

import argparse
import gc
import time

from pipekernel.schedules import BUILTIN_SCHEDULES, format_grid, simulate
from pipekernel.schedules.ordered import unpaired_steps


def build(cls, stages: int, micro_batches: int, chunks: int) -> None:
    """What ``simulate`` asks of the schedule: every stage's object and unpaired steps, with
    the cyclic collector off as ``simulate`` has it (its scans would be counted otherwise)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        for stage in range(stages):
            unpaired_steps(cls(stages, stage, micro_batches, chunks))
    finally:
        if enabled:
            gc.enable()


def measure(cls, stages: int, micro_batches: int, repeat: int, grid: bool) -> dict:
    chunks = cls.default_chunks
    best = grid_best = built = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        result = simulate(cls, stages, micro_batches, chunks)
        best = min(best, time.process_time() - start)
        start = time.process_time()
        build(cls, stages, micro_batches, chunks)
        built = min(built, time.process_time() - start)
        if grid:
            start = time.process_time()
            format_grid(result)
            grid_best = min(grid_best, time.process_time() - start)
    count = sum(len(step) for steps in result.steps for step in steps)
    return {"instructions": count, "seconds": best, "grid": grid_best if grid else None,
            "bubble": result.bubble_fraction, "build": built / best if best > 0 else 0.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schedules", default="1f1b,interleaved,zbv")
    p.add_argument("--stages", default="16,32,64")
    p.add_argument("--micro-batches", default="64,128,256")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--grid", action="store_true", help="also time format_grid")
    args = p.parse_args()
    header = (f"{'schedule':<12} {'p':>4} {'m':>5} {'instructions':>12} {'seconds':>8} "
              f"{'us/instr':>8} {'growth':>7} {'build':>6}"
              + (f" {'grid s':>7}" if args.grid else ""))
    print(header)
    print("-" * len(header))
    for name in args.schedules.split(","):
        cls = BUILTIN_SCHEDULES[name]
        for stages in map(int, args.stages.split(",")):
            previous = None
            for micro_batches in map(int, args.micro_batches.split(",")):
                row = measure(cls, stages, micro_batches, args.repeat, args.grid)
                growth = (f"{row['seconds'] / previous['seconds']:7.2f}"
                          if previous and previous["seconds"] > 0 else f"{'':>7}")
                line = (f"{name:<12} {stages:>4} {micro_batches:>5} {row['instructions']:>12} "
                        f"{row['seconds']:8.3f} "
                        f"{1e6 * row['seconds'] / row['instructions']:8.2f} {growth} "
                        f"{row['build']:6.0%}")
                if args.grid:
                    line += f" {row['grid']:7.3f}"
                print(line, flush=True)
                previous = row
    print("growth: seconds against the row above (twice the micro-batches, about twice the "
          "instructions); ~2.0 is linear. build: the share of the seconds spent building "
          "the steps")


if __name__ == "__main__":
    main()
