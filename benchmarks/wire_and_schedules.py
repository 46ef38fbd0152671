"""Foundation benchmark: 1F1B vs GPipe, and the cost of automatic metadata exchange.

Runs, side by side in one launch (2 gloo processes, 2 stages), rounds that
alternate between configurations so machine noise hits all of them alike:

* ``1f1b`` vs ``gpipe`` on the same model and data (seconds per step, peak
  live activation buffers per stage as reported by the schedule);
* fixed sequence length (64, and 68) vs a length that changes on every
  micro-batch (64..71), so every transfer re-sends its metadata (the wire
  protocol's worst case); 68 is about the same work with no metadata exchange.

    python benchmarks/wire_and_schedules.py [--rounds 5] [--steps 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import pipekernel as pk

VOCAB, DIM = 256, 256


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, h):
        return h + self.lin2(torch.relu(self.lin1(h)))


def loss_fn(logits, labels):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def module():
    layers = [pk.LayerSpec(nn.Embedding, VOCAB, DIM), *[pk.LayerSpec(Block) for _ in range(6)],
              pk.LayerSpec(nn.Linear, DIM, VOCAB)]
    return pk.PipelineModule(layers, loss_fn=loss_fn, num_stages=2, seed=0)


def data(micro_batches, vary, step):
    """``vary``: False = 64 tokens; True = 64..71 (mean 67.5), new on every micro-batch;
    "68" = a fixed 68, the same work as varying without any metadata exchange."""
    g = torch.Generator().manual_seed(step)
    for m in range(micro_batches):
        length = 68 if vary == "68" else 64 + ((step * micro_batches + m) % 8 if vary else 0)
        ids = torch.randint(0, VOCAB, (8, length + 1), generator=g)
        yield ids[:, :-1], ids[:, 1:]


def worker(rounds, steps, micro_batches):
    engines = {name: pk.PipelineEngine(module(), optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
                                       micro_batches=micro_batches, schedule=name)
               for name in ("1f1b", "gpipe")}
    cases = [("1f1b", False), ("gpipe", False), ("1f1b", "68"), ("1f1b", True)]
    times = {case: [] for case in cases}
    for r in range(rounds):
        for name, vary in cases:
            engine = engines[name]
            engine.train_batch(data(micro_batches, vary, 10_000 + r))  # warm-up
            start = time.perf_counter()
            for step in range(steps):
                engine.train_batch(data(micro_batches, vary, step))
            times[(name, vary)].append((time.perf_counter() - start) / steps)
    buffers = {name: e._program(e.schedule_cls).num_buffers for name, e in engines.items()}
    label = {False: "", "68": " length 68", True: " length 64..71"}
    return {f"{n}{label[v]}": statistics.median(t)
            for (n, v), t in times.items()}, buffers


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--micro-batches", type=int, default=8)
    args = parser.parse_args()
    results = pk.launch(worker, 2, (args.rounds, args.steps, args.micro_batches), timeout=1800)
    base = results[0][0]["1f1b"]
    print(f"2 stages, {args.micro_batches} micro-batches of 8 x 64 tokens, median of "
          f"{args.rounds} rounds x {args.steps} steps (rank 0's clock)")
    print(f"{'case':<24} {'s/step':>8} {'x 1f1b':>7}")
    for case, seconds in results[0][0].items():
        print(f"{case:<24} {seconds:8.4f} {seconds / base:7.3f}")
    for rank, (_, buffers) in enumerate(results):
        print(f"stage {rank} activation buffers: " +
              ", ".join(f"{n} {b}" for n, b in buffers.items()))


if __name__ == "__main__":
    main()
