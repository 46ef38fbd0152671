"""Full backward vs the zero-bubble split (backward_input + backward_weight), pipekernel's
beside torch.distributed.pipelining's own (``stage_backward_input`` / ``stage_backward_weight``).

One stage of 8 ``nn.TransformerEncoderLayer`` (d_model d, 4 heads, feed-forward 4d,
dropout 0, batch_first), a micro-batch of 4 sequences, one intra-op thread. Each rep runs a
fresh forward (not timed), then times ``torch.autograd.backward(out, grad)``, pipekernel's
``backward_input`` (B, graph planning included) followed by ``backward_weight`` (W), and
torch's split the way its schedules call it (B: ``stage_backward_input``, which plans the
graph and writes ``x.grad``; W: ``stage_backward_weight``); the three cases alternate
within each rep so drift hits all alike. Reported: medians over reps, and the median of
the per-rep ratios (pk split / full, pk split / torch split). ``--clock cpu`` times with
the process's CPU time instead of the wall clock: on a loaded machine it leaves out the
time the process waited for a core (not the slowdown of sharing caches).

Usage::

    python benchmarks/split_backward.py [--dims 64 256] [--seqs 32 128] [--reps 15]
                                        [--clock wall|cpu]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from pipekernel.stage.split_backward import backward_input, backward_weight


def stack(dim: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.TransformerEncoderLayer(dim, 4, dim_feedforward=4 * dim,
                                                      dropout=0.0, batch_first=True)
                           for _ in range(8)])


clock = time.perf_counter


def full(model, x, g) -> tuple[float, float, float]:
    out = model(x)
    t0 = clock()
    torch.autograd.backward(out, g)
    t1 = clock()
    return t1 - t0, 0.0, 0.0


def split(model, x, g) -> tuple[float, float, float]:
    out = model(x)
    params = list(model.parameters())
    t0 = clock()
    _, state = backward_input([out], [g], [x], params)
    t1 = clock()
    backward_weight(state)
    t2 = clock()
    return t2 - t0, t1 - t0, t2 - t1


def torch_split(model, x, g) -> tuple[float, float, float]:
    out = model(x)
    t0 = clock()
    _, groups = stage_backward_input([out], [g], [x], model.parameters())
    t1 = clock()
    stage_backward_weight(model.parameters(), groups)
    t2 = clock()
    return t2 - t0, t1 - t0, t2 - t1


def measure(dim: int, seq: int, reps: int) -> dict:
    model = stack(dim)
    x = torch.randn(4, seq, dim).requires_grad_()
    g = torch.randn(4, seq, dim)
    cases = {"full": full, "pk": split, "torch": torch_split}
    for fn in cases.values():  # warm-up
        fn(model, x, g)
        model.zero_grad(set_to_none=True)
        x.grad = None
    times: dict[str, list[float]] = {}
    for rep in range(reps):
        order = list(cases.items())
        if rep % 2:
            order.reverse()
        for name, fn in order:
            total, b, w = fn(model, x, g)
            for key, value in ((name, total), (name + " B", b), (name + " W", w)):
                times.setdefault(key, []).append(value)
            model.zero_grad(set_to_none=True)
            x.grad = None
    out = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    out["pk/full"] = statistics.median(p / f for p, f in zip(times["pk"], times["full"]))
    out["torch/full"] = statistics.median(t / f for t, f in zip(times["torch"], times["full"]))
    out["pk/torch"] = statistics.median(p / t for p, t in zip(times["pk"], times["torch"]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--seqs", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = parser.parse_args()
    global clock
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, 8 x TransformerEncoderLayer, batch 4, "
          f"median of {args.reps} reps (ms, {args.clock} clock)\n")
    print("| d | seq | full backward | pk B + W | pk / full | pk B | pk W | torch B + W | "
          "torch / full | torch B | torch W | pk / torch |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for dim in args.dims:
        for seq in args.seqs:
            r = measure(dim, seq, args.reps)
            print(f"| {dim} | {seq} | {r['full']:.2f} | {r['pk']:.2f} | {r['pk/full']:.3f} | "
                  f"{r['pk B']:.2f} | {r['pk W']:.2f} | {r['torch']:.2f} | "
                  f"{r['torch/full']:.3f} | {r['torch B']:.2f} | {r['torch W']:.2f} | "
                  f"{r['pk/torch']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
