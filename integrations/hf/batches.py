"""Hugging Face style micro-batches: one dict per micro-batch, split into (inputs, labels).

``{"input_ids", "attention_mask", "labels"}`` (padded; labels unshifted, as Hugging Face
models take them, ``-100`` where no loss is taken) becomes ``(inputs, labels)``, the pair
the engine's data iterator yields: the first stage reads every key but ``labels``, the last
stage reads ``labels``. :func:`pipeline_module` sets this as the module's ``batch_fn``, so
``engine.train_batch(iter(dicts))`` takes the dicts as they are. Packed rows
(``position_ids`` restarting at each document, :mod:`pipekernel.hf.packing`) are checked
here, where the labels and the positions are both at hand.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipekernel.errors import DataError

from pipekernel.hf import packing

__all__ = ["split_batch"]


def split_batch(batch: Any, refuse_packed: str | None = None) -> tuple[dict[str, Any], Any]:
    """``{"input_ids", "attention_mask"?, "position_ids"?, "labels"?, flash keys?}`` ->
    ``(inputs without labels, labels or None)``; an ``(inputs, labels)`` pair passes as is.

    :param refuse_packed: why the model's packed rows are not reproduced
        (:func:`~pipekernel.hf.probe.probe_packed`, set by :func:`pipeline_module`): a
        packed micro-batch is then refused.
    :raises DataError: neither a dict with ``"input_ids"`` nor a pair; a packed row that
        :func:`pipekernel.hf.packing.check` refuses, or one the model cannot train.
    """
    if isinstance(batch, Mapping):
        if "input_ids" not in batch:
            raise DataError(f"a micro-batch dict needs 'input_ids', got keys {sorted(batch)}",
                            hint="yield {'input_ids': ..., 'attention_mask': ..., 'labels': ...}"
                                 " per micro-batch")
        packing.check(batch)
        if refuse_packed is not None and packing.is_packed(batch):
            raise DataError(f"packed rows (position_ids restarting inside a row) are not "
                            f"trained for this model: {refuse_packed}",
                            hint="train unpacked rows (one document per row, padded, with an "
                                 "attention_mask), or write the model as LayerSpecs; see "
                                 "docs/sequences.md")
        return {k: v for k, v in batch.items() if k != "labels"}, batch.get("labels")
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise DataError(f"a micro-batch is a {type(batch).__name__}, expected a dict with "
                    "'input_ids' (and 'labels' to train)",
                    hint="yield {'input_ids': ..., 'attention_mask': ..., 'labels': ...} per "
                         "micro-batch")
