"""The one walker of nested tensor containers (bottom level: imports only torch).

Values that cross a stage boundary, micro-batches from a data iterator, checkpoint
payloads and layer outputs are tensors or tuples, lists and dicts of them nested to any
depth, with other values (``None``, numbers, strings) among them. Every part of
pipekernel that transforms or lists such values goes through these two functions, so
they all agree on what a container is: tuples and lists keep their type (a namedtuple
keeps its class), dicts keep their keys and order, anything else is a leaf kept as is.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["map_tensors", "tensors_of", "tensors_to", "describe"]


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """``obj`` with every tensor ``t`` replaced by ``fn(t)``: tuples, lists and dicts
    keep their type and keys, other values are kept as they are."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        items = [map_tensors(fn, item) for item in obj]
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
            return type(obj)(*items)
        return type(obj)(items)
    if isinstance(obj, dict):
        return {key: map_tensors(fn, item) for key, item in obj.items()}
    return obj


def tensors_of(obj: Any) -> list[torch.Tensor]:
    """Every tensor in ``obj``, depth first, in the order :func:`map_tensors` visits them."""
    found: list[torch.Tensor] = []
    map_tensors(found.append, obj)
    return found


def tensors_to(obj: Any, device: Any) -> Any:
    """``obj`` with every tensor moved to ``device`` (``Tensor.to``: a no-op where it is)."""
    return map_tensors(lambda t: t.to(device), obj)


def describe(obj: Any) -> str:
    """A short picture of a nested value for error messages: tensors by shape and dtype,
    containers by their items, anything else by its type (``(tensor(2, 3) torch.float32,
    int)``)."""
    if isinstance(obj, torch.Tensor):
        return f"tensor{tuple(obj.shape)} {obj.dtype}"
    if isinstance(obj, (tuple, list)):
        return "(" + ", ".join(describe(o) for o in obj) + ")"
    if isinstance(obj, dict):
        return "{" + ", ".join(f"{k!r}: {describe(o)}" for k, o in obj.items()) + "}"
    return type(obj).__name__
