"""Packed rows: several documents in one row, told apart by ``position_ids``.

What Hugging Face's ``DataCollatorWithFlattening`` (and TRL's padding-free and packing
collators) yield: documents concatenated into a row, ``position_ids`` restarting at every
document, the first label of each document ``-100``, no ``attention_mask``, and with
``return_flash_attn_kwargs=True`` the flash-attention keys ``cu_seq_lens_q/k`` and
``max_length_q/k``. transformers reads a document start where ``position_ids`` do not go
on by one (``masking_utils.find_packed_sequence_indices``) and, when no ``attention_mask``
is given and no cache is used, masks attention within documents; a flash-attention kernel
reads the boundaries from ``cu_seq_lens_*`` instead. Nothing here changes what travels:
every key reaches the base model's ``forward`` (the prologue runs it, ``use_cache=False``
as HF's ``Trainer`` and TRL train), so each stage's layers get the mask and rotary
positions the model builds. What this module adds is the check of the data (:func:`check`):
a label that makes the loss predict a document's first token from the previous document,
or flash keys that disagree with the ``position_ids``, is a :class:`DataError` with the fix.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from pipekernel.errors import DataError

__all__ = ["FLASH_KEYS", "document_starts", "is_packed", "check"]

#: The flash-attention keys a packing collator adds (``return_flash_attn_kwargs=True``).
FLASH_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
_IGNORE = -100
_FIX = ("set labels to -100 at the first token of every document (DataCollatorWithFlattening "
        "does; see docs/sequences.md)")


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """``(rows, length)`` booleans: True where a document starts after the first token of its
    row, where ``position_ids`` do not go on by one (transformers' rule)."""
    ids = position_ids if position_ids.dim() == 2 else position_ids.reshape(1, -1)
    starts = torch.zeros(ids.shape, dtype=torch.bool, device=ids.device)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1] + 1
    return starts


def is_packed(inputs: Any) -> bool:
    """The micro-batch's inputs hold a row of several documents (host tensors only: a
    device tensor is not read, no synchronisation)."""
    pos = inputs.get("position_ids") if isinstance(inputs, Mapping) else None
    if not isinstance(pos, torch.Tensor) or pos.device.type != "cpu" or pos.shape[-1] < 2:
        return False
    return bool(document_starts(pos).any())


def check(batch: Mapping[str, Any]) -> None:
    """Refuse a packed micro-batch whose labels or flash keys disagree with its
    ``position_ids`` (host tensors only: data still on a device is not read).

    :raises DataError: ``position_ids`` of another length than ``input_ids``; a document
        start whose label is not ``-100`` (the loss would predict the next document's first
        token from the previous document); ``cu_seq_lens_*``/``max_length_*`` that are not
        the documents ``position_ids`` say.
    """
    pos = batch.get("position_ids")
    if not isinstance(pos, torch.Tensor) or pos.device.type != "cpu":
        return
    ids = batch.get("input_ids")
    if isinstance(ids, torch.Tensor) and pos.shape[-1] != ids.shape[-1]:
        raise DataError(f"position_ids have {pos.shape[-1]} positions per row and input_ids "
                        f"{ids.shape[-1]}", hint="give one position per token")
    starts = document_starts(pos)
    labels = batch.get("labels")
    if isinstance(labels, torch.Tensor) and labels.device.type == "cpu" and starts.any():
        if starts.shape[0] == 1 and labels.dim() == 2:
            starts = starts.expand(labels.shape[0], -1)
        bad = (starts & (labels != _IGNORE)).nonzero()
        if len(bad):
            row, token = (int(v) for v in bad[0])
            raise DataError(f"position_ids restart at token {token} of row {row} (a new "
                            f"document) but labels[{row}, {token}] is "
                            f"{int(labels[row, token])}, not -100: the loss would predict "
                            "that document's first token from the end of the one before it "
                            f"({len(bad)} such token(s) in this micro-batch)", hint=_FIX)
    _check_flash(batch, starts)


def _check_flash(batch: Mapping[str, Any], starts: torch.Tensor) -> None:
    """``cu_seq_lens_*`` and ``max_length_*`` are the documents of the rows flattened, as
    ``position_ids`` say (a value on a device is not read)."""
    given = {k: batch[k] for k in FLASH_KEYS if batch.get(k) is not None
             and not (isinstance(batch[k], torch.Tensor) and batch[k].device.type != "cpu")}
    if not given:
        return
    begins = starts.clone()
    begins[:, 0] = True
    flat = begins.reshape(-1)
    cu = torch.cat([flat.nonzero().reshape(-1), torch.tensor([flat.numel()])]).tolist()
    expected = {"cu_seq_lens": cu, "max_length": max(b - a for a, b in zip(cu, cu[1:]))}
    for key, value in given.items():
        want = expected[key[:-2]]
        got = value.tolist() if isinstance(value, torch.Tensor) else value
        if got != want:
            raise DataError(f"{key} is {got} but position_ids say {want}: a flash-attention "
                            "kernel would split the documents differently from the mask "
                            "the other attention implementations build",
                            hint="compute the flash keys from the same position_ids "
                                 "(DataCollatorWithFlattening(return_flash_attn_kwargs=True))")
