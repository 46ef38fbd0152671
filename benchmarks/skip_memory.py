"""A model with skip connections on 2 stages: each stage's memory measured and predicted.

The ``skips`` model of ``tests/models.py`` shape (an encoder stashing for a decoder three
parts on and a mask for a later part), fp32 Adam, MSE loss, gloo ranks; each cell trains
two batches with ``plugins=[MemoryMeter()]`` and compares the second step's categories at
the peak with :func:`pipekernel.schedules.sim_memory.stage_memory` fed the profiler's
per-layer bytes and each skip edge's stash bytes (:func:`skip_bytes`).

Usage::

    python benchmarks/skip_memory.py [--schedules 1f1b gpipe] [--micro-batches 4]
"""
from __future__ import annotations

import argparse

import torch
from torch import nn

import pipekernel as pk
from pipekernel.plugins.memory import MemoryMeter
from pipekernel.plugins.partition import measure_layer_times
from pipekernel.schedules.sim_memory import SkipBytes, part_bytes, stage_memory
from pipekernel.testing import run_ranks

CATEGORIES = ("params", "grads", "optimizer", "saved", "buffers")
BATCH, IN, DIM, OUT = 8, 8, 16, 4
CHUNKS = {"interleaved": 2, "zbv": 2, "dualpipev": 2, "v-half": 2, "v-min": 2}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


@pk.skippable(stash=["enc", "mask"])
class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(IN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        pk.stash("enc", h)
        pk.stash("mask", h > 0)
        return h * 0.5


@pk.skippable(pop=["mask"])
class PopMask(Block):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return super().forward(h) * pk.pop("mask")


@pk.skippable(pop=["enc"])
class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.gate = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        enc = pk.pop("enc")
        return self.lin(h) + torch.sigmoid(self.gate(enc)) * enc


#: the one edge of :func:`module` (position 0 -> 1 on 2 stages): "enc" (fp32, requires grad)
#: and "mask" (bool) cross as one message, their gradient (of "enc") as another: each a
#: 16-byte header and the tensors 16-byte aligned (pipekernel.comm.wire); autograd saves
#: neither where they are stashed (the profiler counts them as the encoder's: ``held``)
SKIPS = {(0, 1): SkipBytes(values=16 + BATCH * DIM * 4 + BATCH * DIM,
                           grads=16 + BATCH * DIM * 4, held=BATCH * DIM * 4 + BATCH * DIM,
                           popped=BATCH * DIM * 4 + BATCH * DIM)}


def module(stages: int, chunks: int) -> pk.PipelineModule:
    """Encoder, blocks, the mask's pop, more blocks, the decoder, a head: 4 layers a part."""
    parts = stages * chunks
    layers = [pk.LayerSpec(Encoder), *[pk.LayerSpec(Block) for _ in range(2 * parts - 2)],
              pk.LayerSpec(PopMask), *[pk.LayerSpec(Block) for _ in range(2 * parts - 3)],
              pk.LayerSpec(Decoder), pk.LayerSpec(nn.Linear, DIM, OUT)]
    return pk.PipelineModule(layers, loss_fn=nn.MSELoss(), partition="uniform", seed=3,
                             num_stages=stages)


def measure(schedule: str, stages: int, m: int) -> dict:
    chunks = CHUNKS.get(schedule, 1)
    meter = MemoryMeter()
    engine = pk.PipelineEngine(module(stages, chunks),
                               optimizer=lambda p: torch.optim.Adam(p, lr=1e-3),
                               micro_batches=m, schedule=schedule,
                               chunks=chunks if chunks > 1 else None, transport="gloo",
                               plugins=[meter], timeout=120)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        data = [(torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g))
                for _ in range(m)]
        engine.train_batch(iter(data))
    bounds, cls = list(engine.partition_report.bounds), engine.schedule_cls
    edges = list(engine.skip_edges)
    engine.close()
    return {**meter.last, "bounds": bounds, "placement": getattr(cls, "placement", "loop"),
            "edges": edges}


def predict(schedule: str, stages: int, m: int, bounds: list, placement: str,
            skips=None) -> list[dict]:
    from pipekernel.extend.manager import make_plugin_manager, registered_schedules
    from pipekernel.schedules.placement import locate

    chunks = CHUNKS.get(schedule, 1)
    mod = module(stages, chunks)
    outputs: list = []
    states: list = []
    _, _, static, saved = measure_layer_times(
        mod, torch.randn(BATCH, IN), time_it=False, outputs=outputs, weight_states=states,
        optimizer=lambda p: torch.optim.Adam(p, lr=1e-3))
    parts = part_bytes(bounds, stages, chunks, placement, saved=saved, outputs=outputs,
                       weight_states=states, input_bytes=BATCH * IN * 4,
                       label_bytes=BATCH * OUT * 4,
                       grads=[4.0 * c for c in mod.parameter_counts()])
    cls = registered_schedules(make_plugin_manager())[schedule]
    peaks = stage_memory(cls, stages, m, chunks, parts, skips=skips) if skips is not None \
        else stage_memory(cls, stages, m, chunks, parts)
    fixed = [0.0] * stages
    for q in range(stages * chunks):
        stage, chunk = locate(q, stages, placement)
        fixed[stage] += sum(static[bounds[q]:bounds[q + 1]]) - parts[(stage, chunk)].grads
    return [{"static": fixed[s], **peaks[s]} for s in range(stages)]


def worker(cells: list) -> list:
    torch.set_num_threads(1)
    return [measure(*cell) for cell in cells]


def compare(cells: list, stages: int, skips=None) -> list[tuple]:
    ranks = run_ranks(worker, stages, cells, timeout=600)
    rows = []
    for k, cell in enumerate(cells):
        first = ranks[0][k]
        pred = predict(*cell, first["bounds"], first["placement"], skips=skips)
        for stage in range(stages):
            rows.append((cell, stage, ranks[stage][k], pred[stage]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "gpipe"])
    parser.add_argument("--micro-batches", nargs="+", type=int, default=[4])
    args = parser.parse_args()
    cells = [(s, 2, m) for s in args.schedules for m in args.micro_batches]
    for cell, stage, got, pred in compare(cells, 2, skips=SKIPS):
        print(cell, stage, {c: got[f"memory_{c}_bytes"] for c in CATEGORIES},
              "peak", got["memory_peak_bytes"], "bounds", got["bounds"], "| predicted", pred)


if __name__ == "__main__":
    main()
