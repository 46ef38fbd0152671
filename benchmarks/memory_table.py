"""Each stage's memory by category, measured and predicted, for every built-in schedule.

A small residual MLP (uneven: ``3 p c + 1`` blocks between an input and an output layer
over ``p c`` parts), fp32 Adam, MSE loss, ``p`` gloo ranks; each cell trains two batches
with ``plugins=[MemoryMeter()]`` and prints the second step's peak and each category's
bytes at it (exact storage counts: the same on every run, but for gradient sends, which
count until the step's end). Beside it, the planner's memory model
(:mod:`pipekernel.schedules.sim_memory`, from the profiler's per-layer bytes) and the
ratio predicted / measured of the peak (``ratio``) and of its dynamic part, saved +
buffers (``dyn``).

Usage::

    python benchmarks/memory_table.py [--stages 2 4] [--schedules 1f1b gpipe ...]
        [--micro-batches 1 2 4] (multiples of the stage count) [--checkpoint 0 1 1,0]

``--checkpoint`` takes the module's interval (``0``, ``1``: every stage) or one interval per
stage (``1,0``: the engine's ``recompute``, cells of that many stages only).
"""
from __future__ import annotations

import argparse

import torch
from torch import nn

import pipekernel as pk
from pipekernel.plugins.memory import MemoryMeter
from pipekernel.plugins.partition import measure_layer_times
from pipekernel.schedules.sim_memory import part_bytes, stage_memory
from pipekernel.testing import run_ranks

SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb-h1", "zb-h2", "zbv", "dualpipev", "v-half",
             "v-min")
CHUNKS = {"interleaved": 2, "zbv": 2, "dualpipev": 2, "v-half": 2, "v-min": 2}
CATEGORIES = ("params", "grads", "optimizer", "saved", "buffers")
DIM, BATCH, IN, OUT = 16, 64, 8, 4


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


def _module(stages: int, chunks: int, interval: int | tuple) -> pk.PipelineModule:
    layers = [pk.LayerSpec(nn.Linear, IN, DIM),
              *[pk.LayerSpec(Block, DIM) for _ in range(3 * stages * chunks + 1)],
              pk.LayerSpec(nn.Linear, DIM, OUT)]
    return pk.PipelineModule(layers, loss_fn=nn.MSELoss(), partition="uniform", seed=3,
                             activation_checkpoint_interval=interval
                             if isinstance(interval, int) else 0, num_stages=stages)


def measure(schedule: str, stages: int, m: int, interval: int | tuple) -> dict:
    """One cell on this rank: the meter's metrics and the partition's bounds. ``interval``:
    the module's checkpoint interval, or a tuple, one per stage (the engine's
    ``recompute``)."""
    chunks = CHUNKS.get(schedule, 1)
    meter = MemoryMeter()
    try:
        engine = pk.PipelineEngine(_module(stages, chunks, interval),
                                   optimizer=lambda p: torch.optim.Adam(p, lr=1e-3),
                                   micro_batches=m, schedule=schedule,
                                   chunks=chunks if chunks > 1 else None, transport="gloo",
                                   plugins=[meter], timeout=120,
                                   recompute=None if isinstance(interval, int) else interval)
    except pk.ConfigError as err:  # e.g. too few micro-batches for the schedule
        return {"refused": str(err).splitlines()[0]}
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        data = [(torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g))
                for _ in range(m)]
        engine.train_batch(iter(data))
    bounds, cls = list(engine.partition_report.bounds), engine.schedule_cls
    engine.close()
    return {**meter.last, "bounds": bounds, "placement": getattr(cls, "placement", "loop")}


def predict(schedule: str, stages: int, m: int, interval: int | tuple, bounds: list,
            placement: str) -> list[dict]:
    """Per stage ``{"static", "grads", "saved", "buffers"}``: the planner's model of the
    cell (static: parameters and optimizer state)."""
    from pipekernel.extend.manager import make_plugin_manager, registered_schedules

    chunks = CHUNKS.get(schedule, 1)
    module = _module(stages, chunks, interval)
    outputs: list = []
    states: list = []
    _, _, static, saved = measure_layer_times(
        module, torch.randn(BATCH, IN), time_it=False, outputs=outputs, weight_states=states,
        optimizer=lambda p: torch.optim.Adam(p, lr=1e-3))
    parts = part_bytes(bounds, stages, chunks, placement, saved=saved, outputs=outputs,
                       weight_states=states, input_bytes=BATCH * IN * 4,
                       label_bytes=BATCH * OUT * 4, checkpoint_interval=interval,
                       grads=[4.0 * c for c in module.parameter_counts()])
    cls = registered_schedules(make_plugin_manager())[schedule]
    peaks = stage_memory(cls, stages, m, chunks, parts)
    from pipekernel.schedules.placement import locate
    fixed = [0.0] * stages
    for q in range(stages * chunks):
        stage = locate(q, stages, placement)[0]
        fixed[stage] += sum(static[bounds[q]:bounds[q + 1]])
        fixed[stage] -= parts[(stage, locate(q, stages, placement)[1])].grads
    return [{"static": fixed[s], **peaks[s]} for s in range(stages)]


def worker(cells: list) -> list:
    torch.set_num_threads(1)
    return [measure(*cell) for cell in cells]


def compare(cells: list, stages: int) -> list[tuple]:
    """``(cell, stage, measured metrics, predicted categories)`` for every cell and stage
    (measured on ``stages`` gloo ranks; predicted here)."""
    ranks = run_ranks(worker, stages, cells, timeout=1800)
    rows = []
    for k, cell in enumerate(cells):
        first = ranks[0][k]
        pred = None if "refused" in first else predict(*cell, first["bounds"],
                                                       first["placement"])
        for stage in range(stages):
            rows.append((cell, stage, ranks[stage][k], pred and pred[stage]))
    return rows


def ratios(measured: dict, predicted: dict) -> tuple[float, float]:
    """``(peak predicted / measured, (saved + buffers) predicted / measured)``."""
    dynamic = measured["memory_saved_bytes"] + measured["memory_buffers_bytes"]
    guess = predicted["saved"] + predicted["buffers"]
    return sum(predicted.values()) / measured["memory_peak_bytes"], guess / dynamic


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    parser.add_argument("--micro-batches", nargs="+", type=int, default=[1, 2, 4],
                        help="multiples of the stage count")
    parser.add_argument("--checkpoint", nargs="+", default=["0", "1"],
                        help="intervals: one for every stage (0, 1) or one per stage (1,0)")
    args = parser.parse_args()
    print(f"{'schedule':<12}{'p':>2}{'m':>3}{'ckpt':>5}{'stage':>6}"
          + "".join(f"{c:>10}" for c in CATEGORIES) + f"{'peak':>10}{'pred':>10}"
          + f"{'ratio':>7}{'dyn':>7}")
    worst = 0.0
    for p in args.stages:
        intervals = [int(i) if "," not in i else tuple(int(v) for v in i.split(","))
                     for i in args.checkpoint]
        cells = [(s, p, k * p, i) for s in args.schedules for k in args.micro_batches
                 for i in intervals if isinstance(i, int) or len(i) == p]
        for (schedule, _, m, interval), stage, got, pred in compare(cells, p):
            shown = interval if isinstance(interval, int) else ",".join(map(str, interval))
            head = f"{schedule:<12}{p:>2}{m:>3}{shown:>5}{stage:>6}"
            if pred is None:
                print(f"{head}  refused: {got['refused']}")
                continue
            ratio, dynamic = ratios(got, pred)
            worst = max(worst, abs(ratio - 1))
            print(head + "".join(f"{got[f'memory_{c}_bytes']:>10}" for c in CATEGORIES)
                  + f"{got['memory_peak_bytes']:>10}{sum(pred.values()):>10.0f}"
                  + f"{ratio:>7.3f}{dynamic:>7.3f}")
    print(f"worst |predicted / measured - 1| of a stage's peak: {worst:.4f}")


if __name__ == "__main__":
    main()
