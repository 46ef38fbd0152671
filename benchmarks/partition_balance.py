"""How well each partition method balances a language-model-like layer list.

Embedding, N transformer-like blocks and a large output head (the shape that
makes DeepSpeed's first/last stages slow and full). Each method's partition is
scored with the same independent measurements (``measure_layers``: median
forward + backward seconds per layer; parameter/grad/Adam-state bytes plus
activation bytes × micro-batches in flight under 1F1B). Lower max-stage numbers
are better; the pipeline's step time is set by the slowest stage and its memory
by the fullest.

Usage::

    python benchmarks/partition_balance.py [--stages 4] [--blocks 8] [--vocab 16000]
"""
from __future__ import annotations

import argparse

import torch
from torch import nn

import pipekernel as pk
from pipekernel.plugins.partition import measure_layers, stage_costs


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    layers = [pk.LayerSpec(nn.Embedding, args.vocab, args.dim),
              *[pk.LayerSpec(Block, args.dim) for _ in range(args.blocks)],
              pk.LayerSpec(nn.Linear, args.dim, args.vocab)]
    sample = torch.randint(0, args.vocab, (args.batch, args.seq))
    stages = args.stages
    in_flight = [stages - s for s in range(stages)]  # 1F1B with >= stages micro-batches
    score_module = pk.PipelineModule(layers, seed=0)
    seconds, static, act = measure_layers(score_module, sample, repeats=7, warmup=2)
    methods = {"uniform": "uniform", "parameters": "parameters", "type:Block": "type:Block",
               "profile": pk.profile(sample, repeats=7, warmup=2), "memory": pk.memory(sample)}
    print(f"{len(layers)} layers (embedding, {args.blocks} blocks, head {args.dim}x{args.vocab}), "
          f"{stages} stages, batch {args.batch} x seq {args.seq}, CPU, torch {torch.__version__}")
    print("| method | bounds | max-stage s | vs uniform | time imbalance | max-stage MiB "
          "| vs uniform | memory imbalance |")
    print("|---|---|---|---|---|---|---|---|")
    base = None
    for name, method in methods.items():
        module = pk.PipelineModule(layers, seed=0, partition=method)
        bounds = module.partition(stages)
        t = stage_costs(bounds, seconds)
        m = stage_costs(bounds, static, act, in_flight)
        row = (max(t), max(t) / (sum(t) / stages), max(m), max(m) / (sum(m) / stages))
        base = base or row
        print(f"| {name} | {bounds} | {row[0]:.4f} | {row[0] / base[0]:.2f} | {row[1]:.2f} "
              f"| {row[2] / 2**20:.1f} | {row[2] / base[2]:.2f} | {row[3]:.2f} |")


if __name__ == "__main__":
    main()
