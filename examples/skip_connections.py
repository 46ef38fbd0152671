"""A small U-Net-shaped model on two pipeline stages: dicts between layers, and skip
connections from the encoder (stage 0) straight to the decoder (stage 1).

    python examples/skip_connections.py

trains it on two local CPU processes and checks the losses against one process.
"""
from __future__ import annotations

import torch
from torch import nn

import pipekernel as pk
from pipekernel.testing import reference_train

WIDTH, STEPS, MICRO_BATCHES = 16, 3, 4


class Down(nn.Module):
    """Encodes, stashes its output under ``name`` for the matching ``Up``, and passes a
    dict on: the hidden state and a bool mask."""

    def __init__(self, name: str, width: int = WIDTH) -> None:
        super().__init__()
        self.name, self.lin = name, nn.Linear(width, width)

    def forward(self, x):
        h = torch.tanh(self.lin(x["hidden"] if isinstance(x, dict) else x))
        pk.stash(self.name, h)
        return {"hidden": h, "mask": h > 0}


class Middle(nn.Module):
    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return {"hidden": torch.tanh(self.lin(x["hidden"])) * x["mask"], "mask": x["mask"]}


class Up(nn.Module):
    """Decodes and adds what the ``Down`` of the same name stashed."""

    def __init__(self, name: str, width: int = WIDTH) -> None:
        super().__init__()
        self.name, self.lin = name, nn.Linear(width, width)

    def forward(self, x):
        return {"hidden": torch.tanh(self.lin(x["hidden"])) + pk.pop(self.name),
                "mask": x["mask"]}


def build() -> pk.PipelineModule:
    # one class serves two names, so each entry declares its own with pk.Skip
    layers = [pk.Skip(pk.LayerSpec(Down, "e1"), stash=["e1"]),
              pk.Skip(pk.LayerSpec(Down, "e2"), stash=["e2"]),
              pk.LayerSpec(Middle),
              pk.Skip(pk.LayerSpec(Up, "e2"), pop=["e2"]),
              pk.Skip(pk.LayerSpec(Up, "e1"), pop=["e1"]),
              lambda x: x["hidden"].sum(-1)]
    return pk.PipelineModule(layers, loss_fn=nn.MSELoss(), num_stages=2, partition="uniform",
                             seed=3)


def data(step: int) -> list:
    g = torch.Generator().manual_seed(step)
    return [(torch.randn(4, WIDTH, generator=g), torch.randn(4, generator=g))
            for _ in range(MICRO_BATCHES)]


def worker() -> list[float]:
    torch.set_num_threads(1)
    engine = pk.PipelineEngine(build(), optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
                               micro_batches=MICRO_BATCHES, schedule="1f1b")
    losses = [engine.train_batch(iter(data(step))).item() for step in range(STEPS)]
    assert engine.skip_edges == [(0, 1)]  # e1 and e2 both go from stage 0 to stage 1
    engine.close()
    return losses


def reference() -> list[float]:
    losses, _ = reference_train(build(), lambda p: torch.optim.SGD(p, lr=0.01),
                                [[data(step)] for step in range(STEPS)], MICRO_BATCHES)
    return losses


if __name__ == "__main__":
    pipelined = pk.launch(worker, 2)[0]
    print("pipeline:", [f"{x:.6f}" for x in pipelined])
    print("one process:", [f"{x:.6f}" for x in reference()])
