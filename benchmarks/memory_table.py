"""Each stage's measured memory by category, for every built-in training schedule.

A small residual MLP (uneven: 7 blocks over the stages), fp32 Adam, two gloo ranks;
each cell trains two batches with ``plugins=[MemoryMeter()]`` and prints the second
step's peak and each category's bytes at it (exact storage counts, not an allocator's
figure: the same on every run, but for send buffers, which count until their transfer
completes and so depend on when the peer receives). ``live`` is the simulator's count of
micro-batches a stage holds at once (``num_buffers``), the planner's multiplier.

Usage::

    python benchmarks/memory_table.py [--schedules 1f1b gpipe ...] [--micro-batches 2 4 8]
        [--dim 64] [--batch 8]
"""
from __future__ import annotations

import argparse

import torch
from torch import nn

import pipekernel as pk
from pipekernel.plugins.memory import MemoryMeter
from pipekernel.testing import run_ranks

SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb-h1", "zbv", "dualpipev", "v-half", "v-min")
CHUNKS = {"interleaved": 2, "zbv": 2, "dualpipev": 2, "v-half": 2, "v-min": 2}
CATEGORIES = ("params", "grads", "optimizer", "saved", "buffers")


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


def _cell(schedule: str, micro_batches: int, interval: int, dim: int, batch: int) -> dict:
    meter = MemoryMeter()
    chunks = CHUNKS.get(schedule, 1)
    layers = [pk.LayerSpec(nn.Linear, 8, dim), *[pk.LayerSpec(Block, dim) for _ in range(7)],
              pk.LayerSpec(nn.Linear, dim, 4)]
    module = pk.PipelineModule(layers, loss_fn=nn.MSELoss(), partition="uniform", seed=3,
                               activation_checkpoint_interval=interval, num_stages=2)
    try:
        engine = pk.PipelineEngine(module, optimizer=lambda p: torch.optim.Adam(p, lr=1e-3),
                                   micro_batches=micro_batches, schedule=schedule,
                                   chunks=chunks if chunks > 1 else None, transport="gloo",
                                   plugins=[meter], timeout=120)
    except pk.ConfigError as err:  # e.g. too few micro-batches for the schedule
        return {"refused": str(err).splitlines()[0]}
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        data = [(torch.randn(batch, 8, generator=g), torch.randn(batch, 4, generator=g))
                for _ in range(micro_batches)]
        engine.train_batch(iter(data))
    row = dict(meter.last)
    engine.close()
    return row


def worker(cells: list, dim: int, batch: int) -> list:
    torch.set_num_threads(1)
    return [_cell(s, m, i, dim, batch) for s, m, i in cells]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    parser.add_argument("--micro-batches", nargs="+", type=int, default=[2, 4, 8])
    parser.add_argument("--checkpoint", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    cells = [(s, m, i) for s in args.schedules for m in args.micro_batches
             for i in args.checkpoint]
    ranks = run_ranks(worker, 2, cells, args.dim, args.batch, timeout=1200)
    print(f"{'schedule':<12}{'m':>3}{'ckpt':>5}{'stage':>6}"
          + "".join(f"{c:>11}" for c in CATEGORIES) + f"{'peak':>11}")
    for k, (schedule, m, interval) in enumerate(cells):
        for stage, rows in enumerate(ranks):
            row = rows[k]
            if "refused" in row:
                print(f"{schedule:<12}{m:>3}{interval:>5}{stage:>6}  refused: {row['refused']}")
                continue
            print(f"{schedule:<12}{m:>3}{interval:>5}{stage:>6}"
                  + "".join(f"{row.get(f'memory_{c}_bytes', '-'):>11}" for c in CATEGORIES)
                  + f"{row['memory_peak_bytes']:>11}")


if __name__ == "__main__":
    main()
