"""Layers that are not safe to recompute, split or reorder, and a clean model with dropout,
for the replay check's tests (tests/test_replay.py, tests/test_mutations.py)."""
from __future__ import annotations

import torch
from torch import nn

import pipekernel as pk
from tests.models import DIM, VOCAB, Block, _head, _token_loss


class CallCounter(nn.Module):
    """Its forward depends on how often it ran: the count lives in a list attribute (no
    buffer, no plain attribute the recompute guard could see)."""

    def __init__(self, dim=DIM):
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.calls = [0]

    def forward(self, h):
        self.calls[0] += 1
        return h + torch.tanh(self.lin(h)) * (1.0 + 0.1 * self.calls[0])


class OwnRandom(nn.Module):
    """Dropout drawn from its own generator: the engine's RNG handling cannot replay it."""

    def __init__(self, dim=DIM):
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.gen = torch.Generator().manual_seed(5)

    def forward(self, h):
        keep = (torch.rand(h.shape, generator=self.gen) > 0.5).to(h.dtype)
        return h + torch.tanh(self.lin(h)) * keep * 2.0


class InPlaceInput(nn.Module):
    """Works in place on its input."""

    def __init__(self, dim=DIM):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, h):
        h.mul_(0.5)
        return h + torch.tanh(self.lin(h))


class Dropped(nn.Module):
    """A clean layer with dropout from torch's default generator."""

    def __init__(self, dim=DIM):
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.drop = nn.Dropout(0.3)

    def forward(self, h):
        return h + self.drop(torch.tanh(self.lin(h)))


def lm(bad=None, depth=6, num_stages=2, checkpoint=0, at=4):
    """Embedding, ``depth`` blocks (global layer ``at`` replaced by ``bad``, a layer
    class; layer 2 has dropout), a tied head; seeds fixed."""
    blocks = [pk.LayerSpec(Block) for _ in range(depth)]
    blocks[1] = pk.LayerSpec(Dropped)
    if bad is not None:
        blocks[at - 1] = pk.LayerSpec(bad)
    layers = [pk.TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM), *blocks,
              pk.TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM, forward_fn=_head)]
    return pk.PipelineModule(layers, loss_fn=_token_loss, num_stages=num_stages,
                             partition="uniform", seed=3,
                             activation_checkpoint_interval=checkpoint)
