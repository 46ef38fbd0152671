"""Precision policies side by side: seconds per step, bytes between stages, bytes of
weights + masters + optimizer state per stage. One run, same model and data for all.

    python benchmarks/precision.py [--width 512] [--layers 8] [--micro-batches 8] [--steps 6]

Two stages on two local gloo processes (CPU). Bytes are counted at the transport.
"""
from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch
from torch import nn

import pipekernel as pk


class _Counting:
    def __init__(self, inner):
        self.inner, self.sent = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def isend(self, tensor, dst):
        self.sent += tensor.numel() * tensor.element_size()
        return self.inner.isend(tensor, dst)


class _CountingPlugin:
    @pk.hookimpl
    def pipekernel_make_transport(self, name, options):
        if name == "counting":
            from pipekernel.transports.gloo import GlooTransport
            return _Counting(GlooTransport(**options))
        return None


def _model(width: int, layers: int) -> pk.PipelineModule:
    specs = []
    for _ in range(layers):
        specs += [pk.LayerSpec(nn.Linear, width, width), torch.tanh]
    return pk.PipelineModule(specs, loss_fn=nn.MSELoss(), num_stages=2, seed=0)


def _state_bytes(engine) -> int:
    tensors = {id(t): t for t in engine.module.parameters()}
    tensors.update({id(p): p for p in engine.precision.optimizer_parameters(engine.module)})
    for state in engine.optimizer.state.values():
        tensors.update({id(v): v for v in state.values() if torch.is_tensor(v)})
    return sum(t.numel() * t.element_size() for t in tensors.values())


def worker(precision, width, layers, micro_batches, steps, batch):
    engine = pk.PipelineEngine(_model(width, layers), micro_batches=micro_batches,
                               optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4),
                               precision=precision, transport="counting",
                               plugins=[_CountingPlugin()], timeout=600)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g))
            for _ in range(micro_batches)]
    engine.train_batch(iter(data))  # warm-up (and metadata exchange)
    sent0, times = engine.transport.sent, []
    for _ in range(steps):
        start = time.perf_counter()
        engine.train_batch(iter(data))
        times.append(time.perf_counter() - start)
    return (statistics.median(times), (engine.transport.sent - sent0) / steps, _state_bytes(engine))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    rows = collections.OrderedDict()
    for precision in ("fp32", "bf16", "fp16", "amp-bf16"):
        results = pk.launch(worker, 2, (precision, args.width, args.layers, args.micro_batches,
                                        args.steps, args.batch), threads=1, timeout=1200)
        seconds = max(r[0] for r in results)
        rows[precision] = (seconds, sum(r[1] for r in results), sum(r[2] for r in results))
    base = rows["fp32"]
    print("| precision | s/step | x fp32 | wire bytes/step | x fp32 | state bytes | x fp32 |")
    print("|---|---|---|---|---|---|---|")
    for name, (sec, wire, state) in rows.items():
        print(f"| {name} | {sec:.3f} | {sec / base[0]:.2f} | {wire:,.0f} | {wire / base[1]:.3f} "
              f"| {state:,} | {state / base[2]:.2f} |")


if __name__ == "__main__":
    main()
