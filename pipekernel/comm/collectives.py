"""Collectives the :class:`~pipekernel.comm.transport.Transport` protocol does not require,
built on the ones it does when a transport lacks them."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_gather", "TORCH_REDUCE_OPS"]

#: The protocol's reduction names (``all_reduce(tensor, op)``) as ``torch.distributed`` ops,
#: for transports built on ``torch.distributed`` (gloo, nccl).
TORCH_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                    "min": dist.ReduceOp.MIN}


def all_gather(transport: Any, tensor: torch.Tensor, group: Any, rank: int,
               size: int) -> torch.Tensor:
    """Every member's equally shaped ``tensor``, stacked: shape ``(size, *tensor.shape)``.

    Uses the transport's optional ``all_gather(out, tensor, group)`` (one all-gather);
    without it, an all-reduce of a zero-padded buffer (exact: adding zeros; ``size``
    times the bytes). Collective over ``group``, in which this process is ``rank``.
    """
    tensor = tensor.contiguous()
    if size == 1:
        return tensor.unsqueeze(0).clone()
    gather_fn = getattr(transport, "all_gather", None)
    if gather_fn is not None:
        out = tensor.new_empty((size, *tensor.shape))
        gather_fn(out, tensor, group)
        return out
    out = tensor.new_zeros((size, *tensor.shape))
    out[rank].copy_(tensor)
    transport.all_reduce(out, "sum", group)
    return out
