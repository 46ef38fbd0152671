"""Full backward vs the zero-bubble split (backward_input + backward_weight).

One stage of 8 ``nn.TransformerEncoderLayer`` (d_model d, 4 heads, feed-forward 4d,
dropout 0, batch_first), a micro-batch of 4 sequences, one intra-op thread. Each rep runs a
fresh forward (not timed), then times either ``torch.autograd.backward(out, grad)`` or
``backward_input`` (B, graph planning included) followed by ``backward_weight`` (W); the two
cases alternate within each rep so drift hits both alike. Reported: medians over reps.

Usage::

    python benchmarks/split_backward.py [--dims 64 256] [--seqs 32 128] [--reps 15]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from pipekernel.stage.split_backward import backward_input, backward_weight


def stack(dim: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.TransformerEncoderLayer(dim, 4, dim_feedforward=4 * dim,
                                                      dropout=0.0, batch_first=True)
                           for _ in range(8)])


def full(model, x, g) -> tuple[float, float, float]:
    out = model(x)
    t0 = time.perf_counter()
    torch.autograd.backward(out, g)
    t1 = time.perf_counter()
    return t1 - t0, 0.0, 0.0


def split(model, x, g) -> tuple[float, float, float]:
    out = model(x)
    params = list(model.parameters())
    t0 = time.perf_counter()
    _, state = backward_input([out], [g], [x], params)
    t1 = time.perf_counter()
    backward_weight(state)
    t2 = time.perf_counter()
    return t2 - t0, t1 - t0, t2 - t1


def measure(dim: int, seq: int, reps: int) -> dict:
    model = stack(dim)
    x = torch.randn(4, seq, dim).requires_grad_()
    g = torch.randn(4, seq, dim)
    for fn in (full, split):  # warm-up
        fn(model, x, g)
    times = {"full": [], "split": [], "B": [], "W": []}
    for _ in range(reps):
        times["full"].append(full(model, x, g)[0])
        total, b, w = split(model, x, g)
        times["split"].append(total)
        times["B"].append(b)
        times["W"].append(w)
        model.zero_grad(set_to_none=True)
        x.grad = None
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--seqs", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, 8 x TransformerEncoderLayer, batch 4, "
          f"median of {args.reps} reps (ms)\n")
    print("| d | seq | full backward | B + W | x full | B | W | B share |")
    print("|---|---|---|---|---|---|---|---|")
    for dim in args.dims:
        for seq in args.seqs:
            r = measure(dim, seq, args.reps)
            print(f"| {dim} | {seq} | {r['full']:.2f} | {r['split']:.2f} | "
                  f"{r['split'] / r['full']:.3f} | {r['B']:.2f} | {r['W']:.2f} | "
                  f"{r['B'] / r['split']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
