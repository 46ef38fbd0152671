"""Large-model interop, measured: ZeRO-1 optimizer-state bytes per rank.

    python benchmarks/large_model.py [--width 512] [--layers 8] [--micro-batches 4] [--steps 2]

ZeRO-1: one stage and two stages of ``layers`` x Linear(width, width) + tanh, bf16
masters, AdamW, at D = 1, 2, 4 (D x stages <= 4 processes): bytes of optimizer state
(AdamW's moments and step), of fp32 masters and of bf16 weights per rank (the largest
rank), counted from the tensors themselves.
All on local gloo processes (CPU). (The bytes on the wire with and without partitioned
activations went with them, issue 45.)
"""
from __future__ import annotations

import argparse

import torch
from torch import nn

import pipekernel as pk
from pipekernel.grid.zero import optimizer_state_bytes


def _mlp(width: int, layers: int, stages: int) -> pk.PipelineModule:
    specs = []
    for _ in range(layers):
        specs += [pk.LayerSpec(nn.Linear, width, width), torch.tanh]
    return pk.PipelineModule(specs, loss_fn=nn.MSELoss(), num_stages=stages,
                             partition="uniform", seed=0)


def _data(width: int, micro_batches: int, batch: int, step: int, replica: int):
    g = torch.Generator().manual_seed(1000 * step + replica)
    return [(torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g))
            for _ in range(micro_batches)]


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


def zero_worker(stages, dp, zero, width, layers, micro_batches, steps):
    engine = pk.PipelineEngine(_mlp(width, layers, stages), micro_batches=micro_batches,
                               optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4),
                               precision="bf16", data_parallel_size=dp, zero_stage=zero,
                               timeout=120)
    for step in range(steps):
        engine.train_batch(iter(_data(width, micro_batches, 8, step, engine.data_parallel_rank)))
    masters = engine.precision.optimizer_parameters(engine.module)
    return {"state": optimizer_state_bytes(engine.optimizer), "masters": _bytes(masters),
            "weights": _bytes(engine.module.parameters())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    a = parser.parse_args()
    print(f"ZeRO-1, bf16 masters, AdamW, {a.layers} x Linear({a.width}, {a.width}); bytes per "
          "rank (largest rank)\n")
    print("| stages | D | zero_stage | optimizer state | x D=1 | fp32 masters | bf16 weights |")
    print("|---|---|---|---:|---:|---:|---:|")
    for stages in (1, 2):
        base = None
        for dp, zero in ((1, 0), (2, 0), (2, 1), (4, 1)):
            if stages * dp > 4:
                continue
            rows = pk.launch(zero_worker, stages * dp, (stages, dp, zero, a.width, a.layers,
                                                        a.micro_batches, a.steps), threads=1)
            state = max(r["state"] for r in rows)
            base = base or state
            print(f"| {stages} | {dp} | {zero} | {state:,} | {state / base:.3f} | "
                  f"{max(r['masters'] for r in rows):,} | {max(r['weights'] for r in rows):,} |")


if __name__ == "__main__":
    main()
