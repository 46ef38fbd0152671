"""What the run-time sentinel (``check_every``) costs, as a fraction of step time, measured
inside the same processes (a loaded machine slows both alike), and a long clean run.

Each rank trains a transformer-like MLP (2 stages x 2 replicas on gloo, AdamW) with the
checks off, timing ``train_batch`` (median of ``--steps``), then times ``--checks`` checked
steps: the batch with its transfers hashed (what a checked step's batch does; its median
minus the plain one's is the hashing's cost, within the noise on a loaded machine), then
``engine.sentinel.check()`` alone. The overhead of ``check_every=K`` is
``(check + hashing) / (K * step)``.

With ``--clean N`` it then runs the mutation suite's clean runs (tests/mutations.py: packed
rows with ``position_ids``, tied layers, token loss) for ``N`` steps each, ``check_every=1``
and ``engine.verify_batch`` before every ``--verify-every``-th step, under 1f1b, zbv and
dualpipev, with two replicas and with four stages, and reports that none raised.

Usage::

    python benchmarks/sentinel_cost.py [--dim 256] [--blocks 8] [--batch 8] [--seq 64]
        [--micro-batches 4] [--steps 10] [--checks 10] [--clean 0] [--verify-every 10]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

import pipekernel as pk
from pipekernel.engine.sentinel import DEFAULT_CHECK_EVERY, Sentinel
from pipekernel.testing import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.mutations


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def _engine(args: argparse.Namespace, schedule: str, check_every: int | None) -> pk.PipelineEngine:
    module = pk.PipelineModule([pk.LayerSpec(Block, args.dim) for _ in range(args.blocks)],
                               loss_fn=nn.MSELoss(), num_stages=2, partition="uniform", seed=1)
    return pk.PipelineEngine(module, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4),
                             micro_batches=args.micro_batches, schedule=schedule,
                             transport="gloo", data_parallel_size=2, timeout=120,
                             check_every=check_every)


def _data(args: argparse.Namespace, step: int, replica: int) -> list:
    g = torch.Generator().manual_seed(1000 * step + replica)
    return [(torch.randn(args.batch, args.seq, args.dim, generator=g),
             torch.randn(args.batch, args.seq, args.dim, generator=g))
            for _ in range(args.micro_batches)]


def _cost(args: argparse.Namespace) -> dict:
    engine = _engine(args, "1f1b", None)
    steps, checks, hashed = [], [], []
    sentinel = Sentinel(engine, 1)
    for step in range(args.steps + args.checks):
        if step < args.steps:
            start = time.perf_counter()
            engine.train_batch(iter(_data(args, step, engine.data_parallel_rank)))
            steps.append(time.perf_counter() - start)
        else:
            start = time.perf_counter()
            engine.runtime.transfer_sums = sentinel.transfer_sums()  # as a checked step
            engine.train_batch(iter(_data(args, step, engine.data_parallel_rank)))
            hashed.append(time.perf_counter() - start)
            start = time.perf_counter()
            sentinel.check()
            checks.append(time.perf_counter() - start)
    params = sum(p.numel() for p in engine.module.parameters())
    engine.close()
    step = statistics.median(steps[1:])
    return {"step": step, "check": statistics.median(checks[1:]),
            "hashing": statistics.median(hashed[1:]) - step, "params": params}


def _clean(args: argparse.Namespace) -> dict:
    from tests.mutations import LAYOUTS, SCHEDULES, run_case

    return {f"{schedule}/{layout}": run_case(None, schedule, layout, args.clean,
                                             args.verify_every)
            for schedule in SCHEDULES for layout in LAYOUTS}


def _worker(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    out = _cost(args)
    if args.clean:
        out["clean"] = _clean(args)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("dim", 256), ("blocks", 8), ("batch", 8), ("seq", 64),
                          ("micro-batches", 4), ("steps", 10), ("checks", 10), ("clean", 0),
                          ("verify-every", 10)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    results = run_ranks(_worker, 4, args, timeout=3600)
    for rank, r in enumerate(results):
        ratio = (r["check"] + max(r["hashing"], 0.0)) / r["step"]
        print(f"rank {rank}: {r['params']} parameters, step {r['step'] * 1e3:.1f} ms, "
              f"check {r['check'] * 1e3:.2f} ms + transfer hashing "
              f"{r['hashing'] * 1e3:+.2f} ms = {100 * ratio:.2f}% of a step; "
              f"check_every={DEFAULT_CHECK_EVERY}: {100 * ratio / DEFAULT_CHECK_EVERY:.4f}%"
              + (f"; clean steps checked: {r['clean']}" if "clean" in r else ""))


if __name__ == "__main__":
    main()
