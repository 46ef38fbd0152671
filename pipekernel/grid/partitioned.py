"""Partitioned activations and gradients between stages (tensor parallelism, T > 1).

Between stages, Megatron-style layers leave activations (and their gradients)
*replicated* over the tensor-parallel group: the ``T`` ranks of stage ``s`` would each
send the same tensor to their peers of stage ``s+1``. With partitioning each sends
only its ``1/T`` slice of every floating-point tensor (a
:class:`~pipekernel.comm.wire.Partitioned`, whose wire metadata carries the full shape and
``T``), and the receiver all-gathers the slices over its own tensor-parallel group:
bytes on the wire per rank drop by ``T`` (plus at most ``T - 1`` elements of
padding); the all-gather runs on the links the tensor-parallel group already uses.
Integer and bool tensors (masks, ids) travel whole. The receiver rebuilds each tensor
as a new leaf with the sender's ``requires_grad``, so the stage's input gradients are
whole tensors, partitioned in turn on their way back.

Assumes what tensor parallelism guarantees at a stage boundary: every rank of the
group holds the same values (turn it off with ``partition_activations=False`` for
layers that hand sharded tensors across stages).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from pipekernel.comm.wire import Partitioned

__all__ = ["ActivationPartitioner"]


class ActivationPartitioner:
    """``split`` before sending, ``join`` after receiving (the runtime's ``wire=``).

    :param group: this rank's :class:`~pipekernel.grid.tensor_parallel.TensorParallelGroup`.
    """

    def __init__(self, group: Any) -> None:
        self.group = group

    def split(self, obj: Any) -> Any:
        """``obj`` with each floating-point tensor replaced by this rank's slice."""
        if isinstance(obj, torch.Tensor):
            return self._slice(obj) if obj.is_floating_point() else obj
        if isinstance(obj, (tuple, list)):
            return type(obj)(self.split(item) for item in obj)
        if isinstance(obj, dict):  # keys and their order travel in the metadata
            return {key: self.split(item) for key, item in obj.items()}
        return obj

    def join(self, obj: Any) -> Any:
        """``obj`` with each :class:`~pipekernel.comm.wire.Partitioned` gathered whole
        (collective over the tensor-parallel group, in the order of the tensors)."""
        if isinstance(obj, Partitioned):
            return self._gather(obj)
        if isinstance(obj, (tuple, list)):
            return type(obj)(self.join(item) for item in obj)
        if isinstance(obj, dict):
            return {key: self.join(item) for key, item in obj.items()}
        return obj

    def _slice(self, t: torch.Tensor) -> Partitioned:
        parts, rank = self.group.size, self.group.rank
        flat = t.detach().reshape(-1)
        n = -(-flat.numel() // parts)
        if n * parts != flat.numel():
            flat = F.pad(flat, (0, n * parts - flat.numel()))
        part = flat[rank * n:(rank + 1) * n].clone().requires_grad_(t.requires_grad)
        return Partitioned(part, tuple(t.shape), parts)

    def _gather(self, p: Partitioned) -> torch.Tensor:
        numel = 1
        for size in p.shape:
            numel *= size
        whole = self.group.all_gather(p.part.detach()).reshape(-1)[:numel]
        return whole.view(p.shape).requires_grad_(p.part.requires_grad)
