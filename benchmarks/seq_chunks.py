"""Seq1F1B (``seq_chunks=k``) against 1F1B at few micro-batches (issue 44, item 3).

The built-in GPT (width ``--dim``, ``--layers`` blocks, 4 heads), ``--stages`` stages over
gloo on the CPU, one thread per rank, ``--micro-batches`` micro-batches of 2 sequences of
``--length`` bytes; for each ``k`` of ``--chunks`` it trains ``--steps`` steps (the first,
which builds the programs, untimed) and reports the median step time, the simulator's
predicted makespan for the same ``k`` (forward 1, backward 2 per micro-batch, so ``1/k`` and
``2/k`` per chunk; attention's growth with the prefix is not in it), and both relative to
``k = 1``. Every rank waits for the others before each step (a barrier, untimed).

Usage::

    python benchmarks/seq_chunks.py [--stages 4] [--micro-batches 1] [--chunks 1 2 4]
                                    [--dim 128] [--layers 8] [--length 512] [--steps 6]

The machine's load (``uptime``) is printed: on a shared machine the times move with it.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import pipekernel as pk
from pipekernel.apps.gpt import gpt_module
from pipekernel.schedules import OneFOneB, simulate
from pipekernel.schedules.instructions import Backward, Forward
from pipekernel.schedules.sequence import Seq1F1B
from pipekernel.testing import run_ranks


def predicted(stages: int, m: int, k: int) -> float:
    cls = OneFOneB if k == 1 else Seq1F1B.with_chunks(k)
    return simulate(cls, stages, m, costs={Forward: 1 / k, Backward: 2 / k}).makespan


def _steps(args: argparse.Namespace, k: int) -> list[float]:
    torch.set_num_threads(1)
    module = gpt_module(args.dim, args.layers, 4, args.length, num_stages=args.stages,
                        seed=0, partition="uniform")
    engine = pk.PipelineEngine(module, optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
                               micro_batches=args.micro_batches, seq_chunks=k, timeout=600)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (args.micro_batches, 2, args.length + 1), generator=g)
    batch = [(ids[i, :, :-1], ids[i, :, 1:]) for i in range(args.micro_batches)]
    times = []
    try:
        for step in range(args.steps):
            torch.distributed.barrier()
            start = time.perf_counter()
            engine.train_batch(iter(batch))
            if step:
                times.append(time.perf_counter() - start)
    finally:
        engine.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    print(f"uptime: {os.popen('uptime').read().strip()}")
    print(f"{args.stages} stages, m={args.micro_batches}, GPT dim {args.dim} x {args.layers} "
          f"blocks, 2 x {args.length} tokens per micro-batch, gloo, 1 thread per rank")
    print(f"{'k':>3} {'step s (median)':>16} {'vs k=1':>8} {'simulated':>10} {'vs k=1':>8}")
    base = None
    for k in args.chunks:
        ranks = run_ranks(_steps, args.stages, args, k, timeout=1800)
        step = statistics.median(max(times) for times in zip(*ranks))  # the slowest rank
        sim = predicted(args.stages, args.micro_batches, k)
        base = base or (step, sim)
        print(f"{k:>3} {step:>16.3f} {step / base[0]:>8.2f} {sim:>10.3f} "
              f"{sim / base[1]:>8.2f}")


if __name__ == "__main__":
    main()
