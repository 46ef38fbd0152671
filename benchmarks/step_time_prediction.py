"""The planner's predicted step time beside the measured one, for two models and several schedules.

Models: the ``pipekernel train`` GPT (byte-level, width 96, 4 blocks, context 64, 4
micro-batches of 16 sequences) and the tutorial's (docs/tutorial.md: width 32, 4 blocks,
16 tokens, 4 micro-batches of 8 rows). For each schedule, one engine on 2 gloo ranks (one
thread each) with ``schedule=pk.auto(schedules=[name], chunks=[c])`` (the planner profiles the
layers, times the link and the runtime's own costs, and predicts), then ``--steps`` timed
steps after two warm-up steps; "measured" is the median step (rank 0's wall clock around
``train_batch``). ``pred`` is the planner's prediction (``plan.predicted_step_s``), the sum
of its terms (``plan.breakdown``); ``pipeline`` the simulated makespan alone (without the
optimizer step, as the planner predicted before).

    python benchmarks/step_time_prediction.py [--steps 10] [--models train tutorial]
        [--schedules 1f1b gpipe zb-h1 interleaved zbv]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import pipekernel as pk
from pipekernel.apps.gpt import gpt_module
from pipekernel.testing import run_ranks

CHUNKS = {"interleaved": 2, "zbv": 2, "dualpipev": 2, "v-half": 2, "v-min": 2}
VOCAB, DIM, SEQ, LAYERS, ROWS = 64, 32, 16, 4, 8  # the tutorial's


class Block(nn.Module):  # the tutorial's
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(dim), nn.Linear(dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(self.norm(h))


def _tutorial_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def _model(name: str, chunks: int):
    """``(module, data(step) -> micro-batches, sample inputs)`` of a model."""
    m = 4
    if name == "train":
        module = gpt_module(96, 4, 4, 64, num_stages=2, seed=0)
        rows, ctx, vocab = 16, 64, 256
    else:
        layers = [pk.LayerSpec(nn.Embedding, VOCAB, DIM),
                  *[pk.LayerSpec(Block, DIM) for _ in range(LAYERS)],
                  pk.LayerSpec(nn.Linear, DIM, VOCAB)]
        module = pk.PipelineModule(layers, loss_fn=_tutorial_loss, num_stages=2, seed=1234)
        rows, ctx, vocab = ROWS, SEQ, VOCAB

    def data(step: int) -> list:
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, vocab, (m, rows, ctx + 1), generator=g)
        return [(x[:, :-1], x[:, 1:]) for x in ids]
    return module, data, data(10 ** 6)[0][0], m


def worker(cells: list, steps: int) -> list:
    torch.set_num_threads(1)
    out = []
    for model, schedule in cells:
        chunks = CHUNKS.get(schedule, 1)
        module, data, sample, m = _model(model, chunks)
        try:
            engine = pk.PipelineEngine(
                module, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), micro_batches=m,
                schedule=pk.auto(sample=sample, schedules=[schedule], chunks=[chunks]),
                transport="gloo", check_data_steps=0, timeout=300)
        except pk.ConfigError as err:
            out.append({"refused": str(err).splitlines()[0]})
            continue
        times = []
        for step in range(steps + 2):
            batch = data(step)
            start = time.perf_counter()
            engine.train_batch(iter(batch))
            times.append(time.perf_counter() - start)
        plan = engine.plan
        engine.close()
        out.append({"measured": statistics.median(times[2:]), "predicted":
                    plan.predicted_step_s, "breakdown": dict(plan.breakdown),
                    "bounds": list(plan.bounds)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--models", nargs="+", default=["train", "tutorial"])
    parser.add_argument("--schedules", nargs="+",
                        default=["1f1b", "gpipe", "zb-h1", "interleaved", "zbv"])
    args = parser.parse_args()
    cells = [(model, s) for model in args.models for s in args.schedules]
    ranks = run_ranks(worker, 2, cells, args.steps, timeout=3600)
    print(f"{'model':<9} {'schedule':<12} {'pred ms':>8} {'meas ms':>8} {'meas/pred':>9} "
          f"{'pipeline':>9} {'meas/pipe':>9}  terms (ms)")
    worst = 1.0
    for k, (model, schedule) in enumerate(cells):
        row = ranks[0][k]
        if "refused" in row:
            print(f"{model:<9} {schedule:<12} refused: {row['refused']}")
            continue
        pred, meas, parts = row["predicted"], row["measured"], row["breakdown"]
        ratio = meas / pred
        worst = max(worst, ratio, 1 / ratio)
        terms = ", ".join(f"{k} {1e3 * v:.1f}" for k, v in parts.items())
        print(f"{model:<9} {schedule:<12} {1e3 * pred:8.1f} {1e3 * meas:8.1f} {ratio:9.2f} "
              f"{1e3 * parts['pipeline']:9.1f} {meas / parts['pipeline']:9.2f}  {terms}")
    print(f"worst factor between predicted and measured: {worst:.2f}x")


if __name__ == "__main__":
    main()
