"""Hugging Face style micro-batches: one dict per micro-batch, split into (inputs, labels).

``{"input_ids", "attention_mask", "labels"}`` (padded; labels unshifted, as Hugging Face
models take them, ``-100`` where no loss is taken) becomes ``(inputs, labels)``, the pair
the engine's data iterator yields: the first stage reads every key but ``labels``, the last
stage reads ``labels``. :func:`pipeline_module` sets this as the module's ``batch_fn``, so
``engine.train_batch(iter(dicts))`` takes the dicts as they are.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipekernel.errors import DataError

__all__ = ["split_batch"]


def split_batch(batch: Any) -> tuple[dict[str, Any], Any]:
    """``{"input_ids", "attention_mask"?, "position_ids"?, "labels"?}`` ->
    ``(inputs without labels, labels or None)``; an ``(inputs, labels)`` pair passes as is.

    :raises DataError: neither a dict with ``"input_ids"`` nor a pair.
    """
    if isinstance(batch, Mapping):
        if "input_ids" not in batch:
            raise DataError(f"a micro-batch dict needs 'input_ids', got keys {sorted(batch)}",
                            hint="yield {'input_ids': ..., 'attention_mask': ..., 'labels': ...}"
                                 " per micro-batch")
        return {k: v for k, v in batch.items() if k != "labels"}, batch.get("labels")
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise DataError(f"a micro-batch is a {type(batch).__name__}, expected a dict with "
                    "'input_ids' (and 'labels' to train)",
                    hint="yield {'input_ids': ..., 'attention_mask': ..., 'labels': ...} per "
                         "micro-batch")
