"""The layer vocabulary of the differential fuzzer (tests/fuzzing.py).

Every layer maps the hidden state ``h`` of shape ``(batch, length, width)`` to the same, or
is one half of a pair whose halves pass a tuple, a dict or a nested structure between them
(so a stage boundary may fall between the halves). Built by :func:`build_layers` from the
drawn list of kind names.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

import pipekernel as pk

#: one layer each; "tuple", "dict" and "nested" are pairs of layers
KINDS = ("linear", "layernorm", "tuple", "dict", "nested", "tied", "stash", "pop", "buffer",
         "inplace", "relu_input", "dropout", "function", "frozen", "unused", "view",
         "running")


class Block(nn.Module):
    """``h + tanh(lin(h))``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.lin(h))


class ToTuple(Block):
    """h -> (h, bool mask, int64 ids, h in another float dtype): mixed dtypes on the wire."""

    def __init__(self, dim: int, dtype: str = "float64") -> None:
        super().__init__(dim)
        self.dtype = getattr(torch, dtype)

    def forward(self, h):
        h = super().forward(h)
        # a bf16 tensor with grad would round the gradient at the scale the loss reduction
        # backwards: under loss_reduction="tokens" that is another scale than one
        # process's (docs/loss.md), a bf16-sized difference no fp32 bound holds: no grad
        other = h * 0.5 if self.dtype.itemsize >= 4 else h.detach() * 0.5
        return h, h > 0, (h.detach() * 3).round().long(), other.to(self.dtype)


class FromTuple(Block):
    def forward(self, inputs):
        h, mask, ids, other = inputs
        return super().forward(h) * mask + 0.01 * ids.float() + other.float()


class ToDict(Block):
    """h -> {"hidden": h, "gate": a float tensor with grad, "pos": int64}."""

    def forward(self, h):
        h = super().forward(h)
        pos = torch.arange(h.shape[1]).view(1, -1, 1).expand(h.shape[0], -1, 1)
        return {"hidden": h, "gate": torch.sigmoid(h.mean(-1, keepdim=True)), "pos": pos}


class FromDict(Block):
    def forward(self, d):
        return super().forward(d["hidden"]) * d["gate"] + 0.01 * d["pos"].float()


class ToNested(Block):
    """h -> (h, {"pair": [h * 0.5, bool mask], "ids": int64}): nesting on the wire."""

    def forward(self, h):
        h = super().forward(h)
        return h, {"pair": [h * 0.5, h < 0], "ids": (h.detach() * 2).round().long()}


class FromNested(Block):
    def forward(self, inputs):
        h, rest = inputs
        half, mask = rest["pair"]
        return super().forward(h) + half * mask + 0.01 * rest["ids"].float()


def _tied_forward(module: nn.Linear, h: torch.Tensor) -> torch.Tensor:
    return h + torch.tanh(module(h))


@pk.skippable(stash=["skip"])
class Stash(Block):
    def forward(self, h):
        h = super().forward(h)
        pk.stash("skip", torch.tanh(h))
        return h


class Pop(Block):  # names per entry with pk.Skip
    def forward(self, h):
        return super().forward(h) + pk.pop("skip")


class Buffered(Block):
    """Uses a persistent and a non-persistent buffer (both constant)."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, dim))
        self.register_buffer("shift", torch.full((dim,), 0.1), persistent=False)

    def forward(self, h):
        return super().forward(h) * self.scale + self.shift


class InPlace(nn.Module):
    """In-place ops on its own intermediate results."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, h):
        out = self.lin(h)  # addmm saves its inputs, not its output: in place on it is legal
        out.mul_(0.5).add_(h)
        return torch.relu_(out)


class ReluInput(nn.Module):
    """In-place on its *input* (``nn.ReLU(inplace=True)`` after a residual copy), then a
    Linear: the input may be the activation a stage received."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, h):
        h = h * 1.0 + 0.1  # a fresh tensor: in place on it is legal anywhere
        return self.lin(torch.relu_(h))


class KeyedDropout(nn.Module):
    """Dropout whose mask comes from a generator seeded by the layer's key and the input's
    shape: one process and the pipeline draw the same masks (a mask from the process's
    generator is drawn in another order by each stage, so it cannot be compared with one
    process; see docs/fuzzing.md)."""

    def __init__(self, dim: int, key: int, p: float = 0.3) -> None:
        super().__init__()
        self.lin, self.key, self.p = nn.Linear(dim, dim), key, p

    def forward(self, h):
        h = self.lin(h)
        if not self.training:
            return h
        g = torch.Generator().manual_seed(self.key * 1_000 + h.shape[0] * 31 + h.shape[1])
        keep = (torch.rand(h.shape, generator=g) >= self.p).to(h.dtype)
        return h * keep / (1 - self.p)


class CubeFn(torch.autograd.Function):
    """A custom autograd Function: ``x + 0.1 x^3``, saving its input and a Python scalar."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.save_for_backward(x)
        ctx.scale = scale
        return x + scale * x ** 3

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * (1 + 3 * ctx.scale * x ** 2), None


class Cube(Block):
    def forward(self, h):
        return CubeFn.apply(torch.tanh(self.lin(h)), 0.1) + h


class Frozen(Block):
    """A Linear whose weight does not train (``requires_grad=False``); its bias does."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.lin.weight.requires_grad_(False)


class Unused(Block):
    """Holds a parameter no forward uses: its gradient stays ``None``."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.spare = nn.Linear(dim, dim)


class ToView(Block):
    """h -> (a transposed view, a broadcast view with stride 0): non-contiguous tensors
    with grad on the wire."""

    def forward(self, h):
        h = super().forward(h)
        return h.transpose(1, 2), h[:, :1, :].expand(-1, h.shape[1], -1)


class FromView(Block):
    def forward(self, inputs):
        transposed, first = inputs
        return super().forward(transposed.transpose(1, 2)) + 0.5 * first


class Running(Block):
    """A running mean updated by every training forward (a BatchNorm-like buffer): it
    depends on how often and in which order the forwards ran, and a recompute
    (activation checkpointing) must leave it as the forward left it."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.register_buffer("mean", torch.zeros(dim))

    def forward(self, h):
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.9).add_(0.1 * h.mean((0, 1)))
        return super().forward(h - self.mean)


def _one(kind: str, dim: int, index: int, wire_dtype: str, replicas: int) -> list[Any]:
    simple = {"linear": Block, "layernorm": nn.LayerNorm, "buffer": Buffered,
              "inplace": InPlace, "relu_input": ReluInput, "function": Cube,
              "frozen": Frozen, "unused": Unused,
              # each replica's running mean sees its own micro-batches only, one process
              # sees every replica's: comparable with one replica
              "running": Running if replicas == 1 else Buffered}
    if kind in simple:
        return [pk.LayerSpec(simple[kind], dim)]
    pairs = {"dict": (ToDict, FromDict), "nested": (ToNested, FromNested),
             "view": (ToView, FromView)}
    if kind in pairs:
        return [pk.LayerSpec(pairs[kind][0], dim), pk.LayerSpec(pairs[kind][1], dim)]
    if kind == "tuple":
        return [pk.LayerSpec(ToTuple, dim, wire_dtype), pk.LayerSpec(FromTuple, dim)]
    if kind == "tied":
        return [pk.TiedLayerSpec("tied", nn.Linear, dim, dim, forward_fn=_tied_forward)]
    if kind == "dropout":
        return [pk.LayerSpec(KeyedDropout, dim, index)]
    raise ValueError(f"unknown layer kind {kind!r}")


def build_layers(kinds: list[str], dim: int, wire_dtype: str = "float64",
                 replicas: int = 1) -> list[Any]:
    """The middle layers for ``kinds``: the first "stash" with a "pop" after it pairs with
    the next "pop" (one skip connection per model: each name is stashed once); any other
    "stash" or "pop" is a plain :class:`Block`."""
    layers: list[Any] = []
    pops = [i for i, k in enumerate(kinds) if k == "pop"]
    open_stash = used = False
    for i, kind in enumerate(kinds):
        if kind == "stash" and not used and any(p > i for p in pops):
            layers.append(pk.LayerSpec(Stash, dim))
            open_stash = used = True
        elif kind == "pop" and open_stash:
            layers.append(pk.Skip(pk.LayerSpec(Pop, dim), pop=["skip"]))
            open_stash = False
        elif kind in ("stash", "pop"):
            layers.append(pk.LayerSpec(Block, dim))
        else:
            layers.extend(_one(kind, dim, i, wire_dtype, replicas))
    return layers
