"""Small models and deterministic data shared by the multi-process tests."""
from __future__ import annotations

import torch
from torch import nn

import pipekernel as pk


def mlp(num_stages=None, partition="parameters", loss=True, depth=8, width=16):
    layers = [pk.LayerSpec(nn.Linear, 8, width)]
    for _ in range(depth - 2):
        layers += [pk.LayerSpec(nn.Linear, width, width), torch.tanh]
    layers.append(pk.LayerSpec(nn.Linear, width, 4))
    return pk.PipelineModule(layers, loss_fn=nn.MSELoss() if loss else None,
                             num_stages=num_stages, partition=partition, seed=1234)


def mlp_data(step, replica, micro_batches, batch=4):
    g = torch.Generator().manual_seed(10_000 * step + 100 * replica)
    return [(torch.randn(batch, 8, generator=g), torch.randn(batch, 4, generator=g))
            for _ in range(micro_batches)]


class MakeMasked(nn.Module):
    """float -> (float hidden, bool mask, int64 ids): mixed dtypes across the boundary."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 16)

    def forward(self, x):
        h = self.proj(x)
        return h, h > 0, (h.detach() * 3).round().long()


class UseMasked(nn.Module):
    """(float, bool, int64) -> same structure; uses the mask and the ids."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, inputs):
        h, mask, ids = inputs
        h = torch.tanh(self.lin(h)) * mask + 0.01 * ids.float()
        return h, mask, ids


def masked(num_stages=None):
    layers = [pk.LayerSpec(MakeMasked), *[pk.LayerSpec(UseMasked) for _ in range(3)],
              lambda t: t[0], pk.LayerSpec(nn.Linear, 16, 4)]
    return pk.PipelineModule(layers, loss_fn=nn.MSELoss(), num_stages=num_stages,
                             partition="uniform", seed=7)


class MakeDict(nn.Module):
    """float -> {"hidden": float, "mask": bool, "pos": int64}: a dict across the boundary."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 16)

    def forward(self, x):
        h = self.proj(x)
        return {"hidden": h, "mask": h > 0, "pos": torch.arange(h.shape[-1]).expand_as(h)}


class UseDict(nn.Module):
    """dict -> dict with the same keys; uses the mask and the positions."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, inputs):
        h = torch.tanh(self.lin(inputs["hidden"])) * inputs["mask"] + 0.01 * inputs["pos"]
        return {"hidden": h, "mask": inputs["mask"], "pos": inputs["pos"]}


def dicts(num_stages=None):
    layers = [pk.LayerSpec(MakeDict), *[pk.LayerSpec(UseDict) for _ in range(6)],
              lambda d: d["hidden"], pk.LayerSpec(nn.Linear, 16, 4)]
    return pk.PipelineModule(layers, loss_fn=nn.MSELoss(), num_stages=num_stages,
                             partition="uniform", seed=11)


VOCAB, DIM = 13, 8


class Block(nn.Module):
    def __init__(self, dim=DIM):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, h):
        return h + torch.tanh(self.lin(h))


def _head(embedding, h):
    return h @ embedding.weight.t()


def _token_loss(logits, labels):
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def tied_lm(num_stages=None, depth=4):
    layers = [pk.TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM),
              *[pk.LayerSpec(Block) for _ in range(depth)],
              pk.TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM, forward_fn=_head)]
    return pk.PipelineModule(layers, loss_fn=_token_loss, num_stages=num_stages,
                             partition="uniform", seed=99)


def token_data(step, replica, micro_batches, batch=3, vary=False):
    g = torch.Generator().manual_seed(7_000 * step + 10 * replica)
    items = []
    for m in range(micro_batches):
        length = 5 + (step + m) % 4 if vary else 6
        ids = torch.randint(0, VOCAB, (batch, length + 1), generator=g)
        items.append((ids[:, :-1], ids[:, 1:]))
    return items


@pk.skippable(stash=["enc", "mask", "near"])
class Encoder(nn.Module):
    """Stashes its output for the decoder (3 stages on), a bool mask for layer 5 and a
    tensor the next layer of the same stage pops."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 16)

    def forward(self, x):
        h = self.proj(x)
        pk.stash("enc", h)
        pk.stash("mask", h > 0)
        pk.stash("near", torch.tanh(h))
        return h * 0.5


@pk.skippable(pop=["near"])
class PopNear(Block):
    def forward(self, h):
        return super().forward(h) + pk.pop("near")


class PopMask(Block):  # declared per entry with pk.Skip
    def forward(self, h):
        return super().forward(h) * pk.pop("mask")


@pk.skippable(pop=["enc"])
class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.gate = nn.Linear(16, 16)

    def forward(self, h):
        enc = pk.pop("enc")
        return self.lin(h) + torch.sigmoid(self.gate(enc)) * enc


def skips(num_stages=None):
    """8 layers, 2 per part: part 0 stashes for part 3 ("enc") and part 2 ("mask", bool)
    and for itself ("near")."""
    layers = [pk.LayerSpec(Encoder), pk.LayerSpec(PopNear, 16), pk.LayerSpec(Block, 16),
              pk.LayerSpec(Block, 16), pk.LayerSpec(Block, 16),
              pk.Skip(pk.LayerSpec(PopMask, 16), pop=["mask"]), pk.LayerSpec(Decoder),
              pk.LayerSpec(nn.Linear, 16, 4)]
    return pk.PipelineModule(layers, loss_fn=nn.MSELoss(), num_stages=num_stages,
                             partition="uniform", seed=5)


MODELS = {"mlp": (mlp, mlp_data), "masked": (masked, mlp_data), "dicts": (dicts, mlp_data),
          "skips": (skips, mlp_data), "tied": (tied_lm, token_data),
          "varlen": (tied_lm, lambda s, r, m: token_data(s, r, m, vary=True))}


class FeedForward(nn.Module):
    """A residual two-layer block whose ``fc1`` / ``fc2`` take a column / row tensor-parallel
    plan (:func:`ff_plan`)."""

    def __init__(self, dim=16, hidden=32):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, h):
        return h + self.fc2(torch.tanh(self.fc1(h)))


def ff_model(num_stages=None, hidden=32, depth=4, seed=4321):
    """``depth`` :class:`FeedForward` blocks between an 8 -> 16 input and a 16 -> 4 head
    (inputs and labels of :func:`mlp_data`)."""
    layers = [pk.LayerSpec(nn.Linear, 8, 16),
              *[pk.LayerSpec(FeedForward, 16, hidden) for _ in range(depth)],
              pk.LayerSpec(nn.Linear, 16, 4)]
    return pk.PipelineModule(layers, loss_fn=nn.MSELoss(), num_stages=num_stages,
                             partition="uniform", seed=seed)


def ff_plan(extra=None):
    """The DTensor plan of :func:`ff_model`'s blocks (plus ``extra`` entries)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    return {"*.fc1": ColwiseParallel(), "*.fc2": RowwiseParallel(), **(extra or {})}


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def adam(params):
    return torch.optim.AdamW(params, lr=1e-2)
