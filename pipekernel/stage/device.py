"""Moving micro-batches from the host to the stage's device.

:func:`to_device` is what the runtime calls on every loaded micro-batch. To a
CUDA device a CPU tensor goes through pinned (page-locked) memory with
``non_blocking=True``: the copy is queued on the current stream and the host
goes on queueing the forward instead of waiting for it.

The non-blocking copy reads its source when the stream gets to it, later than the
call returns, so the source must stay untouched until then. The pinned source is
therefore always a buffer of torch's caching host allocator made for this copy
(which keeps the block until the copy's stream passed it), never the caller's
tensor: an unpinned tensor is pinned into a fresh buffer (``pin_memory()`` copies),
and a tensor the caller pinned already (a ``DataLoader(pin_memory=True)`` batch,
whose buffer the loader may refill at once) is first copied into a fresh pinned
buffer — a host memcpy, instead of a race with the loader. Anything else (CPU to
CPU, a tensor already on the device) is ``tensor.to(device)``: a no-op when it is
there.
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["to_device"]


def to_device(tensor: Any, device: torch.device) -> Any:
    """``tensor`` on ``device``; CPU -> CUDA copies pinned and non-blocking.

    A caller may rely on: the result is ordered before any later work on the
    current stream (a non-blocking copy is queued there), so the forward that
    reads it sees the data; the source tensor may be reused (overwritten) at once,
    pinned or not.
    """
    if getattr(device, "type", None) == "cuda" and tensor.device.type == "cpu":
        return _pinned_copy(tensor).to(device, non_blocking=True)
    return tensor.to(device)


def _pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A pinned copy of ``tensor`` that belongs to this transfer alone."""
    if not tensor.is_pinned():
        return tensor.pin_memory()  # a new pinned buffer holding a copy
    staging = tensor.new_empty(tensor.shape, pin_memory=True)
    return staging.copy_(tensor)
