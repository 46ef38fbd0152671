"""Peak activation memory and step time with activation_checkpoint_interval = 0, 1, 2, 4, ...

One stage holding transformer-like MLP blocks (LayerNorm, Linear 4x, GELU, dropout),
forward + backward of one micro-batch. Memory:

* CPU (always): ``pipekernel.testing.TensorBytes`` — peak bytes of the tensors
  operators create during forward + backward (activations, recomputed activations,
  gradients); parameters and inputs made before are not counted.
* GPU (when CUDA is available): ``torch.cuda.max_memory_allocated`` minus the
  memory allocated before the forward (parameters, inputs).

Usage::

    python benchmarks/activation_checkpoint.py [--blocks 16] [--batch 8] [--seq 128]
        [--dim 256] [--intervals 0 1 2 4 8] [--repeats 3] [--devices cpu cuda]

``--devices`` defaults to the CPU plus CUDA when it is available; ``--devices cuda``
measures the GPU alone (what ``gpu/check.sh`` runs) and fails without CUDA.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import pipekernel as pk
from pipekernel.testing import TensorBytes


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(nn.functional.gelu(self.up(self.norm(x)))))


def stage(blocks: int, dim: int, interval: int, device: torch.device) -> nn.Module:
    module = pk.PipelineModule([pk.LayerSpec(Block, dim) for _ in range(blocks)], seed=0,
                               activation_checkpoint_interval=interval)
    return module.build_stage(0, [0, blocks]).to(device)


def step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).float().pow(2).mean().backward()


def measure(args: argparse.Namespace, interval: int, device: torch.device) -> dict:
    model = stage(args.blocks, args.dim, interval, device)
    x = torch.randn(args.batch, args.seq, args.dim, device=device)
    step(model, x)  # warm-up (allocator, kernels)
    model.zero_grad(set_to_none=True)
    with TensorBytes() as counter:
        step(model, x)
    model.zero_grad(set_to_none=True)
    result = {"interval": interval, "cpu_counter_peak": counter.peak}
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step(model, x)
        torch.cuda.synchronize()
        result["cuda_peak"] = torch.cuda.max_memory_allocated() - base
        model.zero_grad(set_to_none=True)
    times = []
    for _ in range(args.repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step(model, x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    result["seconds"] = statistics.median(times)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--intervals", type=int, nargs="+", default=[0, 1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--devices", nargs="+", choices=["cpu", "cuda"], default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.devices is None:
        args.devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    if "cuda" in args.devices and not torch.cuda.is_available():
        parser.error("--devices cuda: torch.cuda.is_available() is False on this machine")
    devices = [torch.device(d) for d in args.devices]
    mib = 2 ** 20
    for device in devices:
        results = [measure(args, k, device) for k in args.intervals]
        plain = results[0]
        print(f"device {device}: {args.blocks} blocks, batch {args.batch} x seq {args.seq} x "
              f"dim {args.dim}, torch {torch.__version__}")
        header = "| interval | counter peak MiB | vs k=%d |" % plain["interval"]
        if device.type == "cuda":
            header += " cuda peak MiB | vs k=%d |" % plain["interval"]
        header += " step s | vs k=%d |" % plain["interval"]
        print(header)
        print("|" + "---|" * (header.count("|") - 1))
        for r in results:
            row = (f"| {r['interval']} | {r['cpu_counter_peak'] / mib:.1f} | "
                   f"{r['cpu_counter_peak'] / plain['cpu_counter_peak']:.2f} |")
            if device.type == "cuda":
                row += f" {r['cuda_peak'] / mib:.1f} | {r['cuda_peak'] / plain['cuda_peak']:.2f} |"
            row += f" {r['seconds']:.4f} | {r['seconds'] / plain['seconds']:.2f} |"
            print(row)
        print()


if __name__ == "__main__":
    main()
