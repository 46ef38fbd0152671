"""Data-parallel gradient reduction: buckets started during the last backward vs one flat
all-reduce at ``ReduceGrads``.

2 stages x 2 replicas (4 gloo processes, one thread each), an MLP of ``--layers``
``Linear(width, width)`` + tanh (default 4 x 1024: 4.2M parameters, 2.1M per stage),
SGD. One engine per ``grad_bucket_mb`` value in the same processes; rounds alternate
between them so machine noise hits all alike. Reports the median seconds per step
(rank 0's clock) and, per configuration, where the buckets started.

    python benchmarks/grad_overlap.py [--rounds 5] [--steps 4] [--buckets 0,1,4,25]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import pipekernel as pk


def module(width, layers):
    specs = []
    for _ in range(layers):
        specs += [pk.LayerSpec(nn.Linear, width, width), torch.tanh]
    return pk.PipelineModule(specs, loss_fn=nn.MSELoss(), num_stages=2, seed=0)


def data(width, micro_batches, batch, step, replica):
    g = torch.Generator().manual_seed(1000 * step + replica)
    return [(torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g))
            for _ in range(micro_batches)]


def worker(buckets, rounds, steps, width, layers, micro_batches, batch):
    engines = {mb: pk.PipelineEngine(module(width, layers),
                                     optimizer=lambda p: torch.optim.SGD(p, lr=1e-3),
                                     micro_batches=micro_batches, data_parallel_size=2,
                                     grad_bucket_mb=mb)
               for mb in buckets}
    times = {mb: [] for mb in buckets}
    for r in range(rounds):
        for mb, engine in engines.items():
            replica = engine.data_parallel_rank
            engine.train_batch(iter(data(width, micro_batches, batch, 10_000 + r, replica)))
            start = time.perf_counter()
            for step in range(steps):
                engine.train_batch(iter(data(width, micro_batches, batch, step, replica)))
            times[mb].append((time.perf_counter() - start) / steps)
    launches = {mb: e.grad_reducer.last_launches for mb, e in engines.items()}
    params = sum(p.numel() for p in next(iter(engines.values())).module.parameters())
    return {mb: statistics.median(t) for mb, t in times.items()}, launches, params


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--buckets", default="0,1,4,25",
                        help="grad_bucket_mb values (0: no overlap)")
    args = parser.parse_args()
    buckets = [float(b) for b in args.buckets.split(",")]
    results = pk.launch(worker, 4, (buckets, args.rounds, args.steps, args.width, args.layers,
                                    args.micro_batches, args.batch), timeout=3600)
    times, _, _ = results[0]
    base = times[buckets[0]]
    print(f"2 stages x 2 replicas, {args.layers} x Linear({args.width}, {args.width}) "
          f"({sum(r[2] for r in results[:2]):,} parameters), {args.micro_batches} micro-batches "
          f"of {args.batch}, median of {args.rounds} rounds x {args.steps} steps (rank 0)")
    print(f"{'grad_bucket_mb':>14} {'s/step':>8} {'x first':>8}  buckets started (stage 0, 1)")
    for mb in buckets:
        where = [_count(results[rank][1][mb]) for rank in (0, 1)]
        print(f"{mb:14g} {times[mb]:8.4f} {times[mb] / base:8.3f}  {where[0]}; {where[1]}")


def _count(launches):
    return ", ".join(f"{launches.count(w)} {w}" for w in ("backward", "after_backward", "finish")
                     if w in launches)


if __name__ == "__main__":
    main()
