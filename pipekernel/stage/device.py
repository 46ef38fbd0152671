"""Moving micro-batches from the host to the stage's device.

:func:`to_device` is what the runtime calls on every loaded micro-batch. To a
CUDA device a CPU tensor goes through pinned (page-locked) memory with
``non_blocking=True``: the copy is queued on the current stream and the host
goes on queueing the forward instead of waiting for it. The pinned buffer comes
from torch's caching host allocator, which keeps it until the copy finished.
Already pinned tensors are not copied twice; anything else (CPU to CPU, a tensor
already on the device) is ``tensor.to(device)``: a no-op when it is there.
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["to_device"]


def to_device(tensor: Any, device: torch.device) -> Any:
    """``tensor`` on ``device``; CPU -> CUDA copies pinned and non-blocking.

    A caller may rely on: the result is ordered before any later work on the
    current stream (a non-blocking copy is queued there), so the forward that
    reads it sees the data; the source tensor may be reused at once.
    """
    if getattr(device, "type", None) == "cuda" and tensor.device.type == "cpu":
        source = tensor if tensor.is_pinned() else tensor.pin_memory()
        return source.to(device, non_blocking=True)
    return tensor.to(device)
