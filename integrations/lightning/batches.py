"""A Lightning batch ``(inputs, labels)`` cut into the engine's micro-batches.

The Trainer's dataloader yields whole batches; the engine reads one micro-batch per
``LoadMicroBatch``. Cutting along the batch dimension (dimension 0 of every tensor,
nested tuples, lists, named tuples and dicts followed) gives ``micro_batches`` equal
parts, so the loss of the batch is the mean of the micro-batch losses exactly as in a
one-process run with gradient accumulation.
"""
from __future__ import annotations

from typing import Any

import torch

from pipekernel.errors import DataError

__all__ = ["split_batch", "batch_size"]


def _leaves(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for value in obj.values() for t in _leaves(value)]
    if isinstance(obj, (tuple, list)):
        return [t for value in obj for t in _leaves(value)]
    return []


def batch_size(batch: Any, what: str) -> int:
    """The common size of dimension 0 of every tensor in ``batch``.

    :raises DataError: no tensor, a 0-dim tensor, or tensors of different batch sizes.
    """
    leaves = _leaves(batch)
    if not leaves:
        raise DataError(f"{what}: the batch holds no tensor",
                        hint="the dataloader must yield (inputs, labels) tensors, batch first")
    sizes = sorted({t.shape[0] if t.dim() else -1 for t in leaves})
    if -1 in sizes or len(sizes) > 1:
        shapes = [tuple(t.shape) for t in leaves]
        raise DataError(f"{what}: the tensors of the batch do not share one batch dimension "
                        f"(shapes {shapes})",
                        hint="every tensor of (inputs, labels) must have the batch dimension first")
    return sizes[0]


def _narrow(obj: Any, start: int, length: int) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.narrow(0, start, length)
    if isinstance(obj, dict):
        return type(obj)((k, _narrow(v, start, length)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return type(obj)(*(_narrow(v, start, length) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_narrow(v, start, length) for v in obj)
    return obj  # non-tensor leaves (flags, strings) go to every micro-batch


def split_batch(batch: Any, micro_batches: int, what: str = "train_batch"
                ) -> list[tuple[Any, Any]]:
    """``micro_batches`` items ``(inputs, labels)``, consecutive equal slices of ``batch``.

    :param batch: ``(inputs, labels)`` (a tuple or list of two), each a tensor or a nested
        structure of tensors with the batch dimension first.
    :param what: the caller, named in errors.
    :raises DataError: not a pair, or a batch size that ``micro_batches`` does not divide.
    """
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        kind = type(batch).__name__ + (f" of {len(batch)}" if isinstance(batch, (tuple, list))
                                       else "")
        raise DataError(f"{what}: the batch must be a pair (inputs, labels), got a {kind}",
                        hint="make the dataset/collate_fn yield (inputs, labels); the first "
                             "stage reads the inputs, the last stage the labels")
    size = batch_size(batch, what)
    if size % micro_batches:
        raise DataError(f"{what}: the batch holds {size} samples, which micro_batches="
                        f"{micro_batches} does not divide into equal micro-batches",
                        hint=f"use DataLoader(batch_size=<a multiple of {micro_batches}>, "
                             "drop_last=True), or another PipelineStrategy(micro_batches=...)")
    length = size // micro_batches
    inputs, labels = batch
    return [(_narrow(inputs, i * length, length), _narrow(labels, i * length, length))
            for i in range(micro_batches)]
