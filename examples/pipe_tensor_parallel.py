"""Pipeline x tensor parallelism with Megatron-style blocks, and its single-process oracle.

    python examples/pipe_tensor_parallel.py            # 2 stages x 2 tensor-parallel ranks

Each block reaches its tensor-parallel group while the engine builds it (``tp.group()``
inside the layers' ``__init__``); the column-parallel layer keeps its slice of the
output features, the row-parallel one its slice of the input features and sums the
partial products over the group. Activations cross stages as 1/T slices. The same
layer list built outside an engine is the whole model: :func:`reference` trains it on
one process, and the losses agree to fp32 round-off.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import pipekernel as pk
from pipekernel import tensor_parallel as tp

WIDTH, BLOCKS, MICRO_BATCHES, STEPS = 32, 4, 4, 5


class ParallelMLP(nn.Module):
    """``x + W2 gelu(W1 norm(x))`` with ``W1`` split by columns and ``W2`` by rows."""

    def __init__(self, width: int) -> None:
        super().__init__()
        group = tp.group()  # this rank's group: .rank, .size (size 1 in one process)
        self.norm = nn.LayerNorm(width)
        self.up = tp.ColumnParallelLinear(width, 4 * width)    # 4*width / T outputs here
        self.down = tp.RowParallelLinear(4 * width, width)     # summed over the group
        self.shards = group.size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def model() -> pk.PipelineModule:
    layers = [pk.LayerSpec(nn.Linear, 8, WIDTH),
              *[pk.LayerSpec(ParallelMLP, WIDTH) for _ in range(BLOCKS)],
              pk.LayerSpec(nn.Linear, WIDTH, 4)]
    return pk.PipelineModule(layers, loss_fn=nn.MSELoss(), partition="uniform", seed=0)


def batches(step: int, replica: int = 0) -> list:
    g = torch.Generator().manual_seed(100 * step + replica)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g))
            for _ in range(MICRO_BATCHES)]


def optimizer(params):
    return torch.optim.AdamW(params, lr=3e-3)


def train(tensor_parallel_size: int = 2, zero_stage: int = 0) -> dict:
    """One rank's part of the run (call on every rank, e.g. through ``pk.launch``)."""
    engine = pk.PipelineEngine(model(), optimizer=optimizer, micro_batches=MICRO_BATCHES,
                               tensor_parallel_size=tensor_parallel_size, zero_stage=zero_stage)
    losses = [engine.train_batch(iter(batches(s, engine.data_parallel_rank))).item()
              for s in range(STEPS)]
    shards = {m.shards for m in engine.module.modules() if isinstance(m, ParallelMLP)}
    return {"losses": losses, "stage": engine.stage, "tp_rank": engine.topology.model_rank,
            "shards": shards}


def reference() -> list[float]:
    """The same layers, whole, on one process with gradient accumulation."""
    from pipekernel.testing import reference_train
    losses, _ = reference_train(model(), optimizer, [[batches(s)] for s in range(STEPS)],
                                MICRO_BATCHES)
    return losses


if __name__ == "__main__":
    results = pk.launch(train, 4)
    print("rank: stage, tp rank:", [(r["stage"], r["tp_rank"]) for r in results])
    print("pipeline x tensor parallel:", [f"{x:.5f}" for x in results[-1]["losses"]])
    print("one process:               ", [f"{x:.5f}" for x in reference()])
