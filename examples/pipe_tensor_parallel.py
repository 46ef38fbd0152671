"""Pipeline x tensor parallelism with Megatron-style blocks (torch's DTensor), and its
single-process oracle.

    python examples/pipe_tensor_parallel.py            # 2 stages x 2 tensor-parallel ranks

The blocks are plain ``nn.Linear`` layers; the plan (:data:`PLAN`) tells the engine which
to split: ``up`` by output features (``ColwiseParallel``), ``down`` by input features
(``RowwiseParallel``, its partial products summed over the group). The engine applies it
to each stage over ``mesh["tp"]`` after building the layers whole, so the same layer list
built outside an engine is the whole model: :func:`reference` trains it on one process,
and the losses agree to fp32 round-off. Activations cross stages whole.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import pipekernel as pk

WIDTH, BLOCKS, MICRO_BATCHES, STEPS = 32, 4, 4, 5


class MLP(nn.Module):
    """``x + W2 gelu(W1 norm(x))``: ``W1`` split by columns and ``W2`` by rows under
    :data:`PLAN`."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def plan() -> dict:
    """The tensor-parallel plan: module-name patterns relative to the stage (whose children
    are the global layer indices) to torch ParallelStyles."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    return {"*.up": ColwiseParallel(), "*.down": RowwiseParallel()}


def model() -> pk.PipelineModule:
    layers = [pk.LayerSpec(nn.Linear, 8, WIDTH),
              *[pk.LayerSpec(MLP, WIDTH) for _ in range(BLOCKS)],
              pk.LayerSpec(nn.Linear, WIDTH, 4)]
    return pk.PipelineModule(layers, loss_fn=nn.MSELoss(), partition="uniform", seed=0)


def batches(step: int, replica: int = 0) -> list:
    g = torch.Generator().manual_seed(100 * step + replica)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g))
            for _ in range(MICRO_BATCHES)]


def optimizer(params):
    return torch.optim.AdamW(params, lr=3e-3)


def train(tensor_parallel_size: int = 2) -> dict:
    """One rank's part of the run (call on every rank, e.g. through ``pk.launch``)."""
    engine = pk.PipelineEngine(model(), optimizer=optimizer, micro_batches=MICRO_BATCHES,
                               tensor_parallel_size=tensor_parallel_size,
                               tensor_parallel_plan=plan() if tensor_parallel_size > 1 else None)
    losses = [engine.train_batch(iter(batches(s, engine.data_parallel_rank))).item()
              for s in range(STEPS)]
    shards = {m.up.out_features // m.up.weight.to_local().shape[0]
              for m in engine.module.modules() if isinstance(m, MLP)}
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
