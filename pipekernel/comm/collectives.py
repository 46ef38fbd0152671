"""The protocol's reduction names as ``torch.distributed`` ops."""
from __future__ import annotations

import torch.distributed as dist

__all__ = ["TORCH_REDUCE_OPS"]

#: The protocol's reduction names (``all_reduce(tensor, op)``) as ``torch.distributed`` ops,
#: for transports built on ``torch.distributed`` (gloo, nccl).
TORCH_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                    "min": dist.ReduceOp.MIN}
