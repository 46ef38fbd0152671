"""Packed rows for pipekernel's own models: several documents per row, kept apart.

A packed micro-batch is a dict ``{"input_ids", "position_ids"}`` (:func:`pack` makes one
with its labels): ``position_ids`` restart at 0 at every document, so the boundaries are
where they do not go on by one (Hugging Face's rule, so its collators' rows read alike).
Layers pass the boundaries on with the activations — a dict crosses stages like a tensor,
the wire carrying its keys and changing shapes — e.g. the first layer returns
``{"hidden": h, "documents": document_ids(position_ids)}`` and every attention layer masks
with :func:`document_mask`. Labels of a packed row are next-token targets, ``-100`` at each
document's last token (its next token belongs to another document) and on padding, so
``loss_reduction="tokens"`` counts exactly the tokens each document predicts of itself.
See ``docs/sequences.md``.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from pipekernel.errors import DataError

__all__ = ["pack", "document_ids", "document_mask", "IGNORE_INDEX"]

#: Labels with this value take no loss (PyTorch's ``cross_entropy`` default).
IGNORE_INDEX = -100


def pack(documents: Sequence[torch.Tensor], width: int, rows: int, *, pad: int = 0
         ) -> dict[str, torch.Tensor]:
    """Documents (1-D token tensors) packed in order into ``rows`` rows of ``width`` tokens:
    ``{"input_ids", "position_ids", "labels"}``, each ``(rows, width)`` int64.

    A document goes in the current row if it fits, else starts the next; one longer than
    ``width`` is cut into pieces of ``width`` (each piece its own document). Documents that
    do not fit in ``rows`` rows are left out. Padding: token ``pad``, position 0, label -100.

    :raises DataError: ``width`` or ``rows`` below 1, or a document that is not 1-D.
    """
    if width < 1 or rows < 1:
        raise DataError(f"pack: width={width} and rows={rows} must be at least 1",
                        hint="pass the sequence length and the rows per micro-batch")
    ids = torch.full((rows, width), pad, dtype=torch.long)
    pos = torch.zeros((rows, width), dtype=torch.long)
    labels = torch.full((rows, width), IGNORE_INDEX, dtype=torch.long)
    row, used = 0, 0
    for i, doc in enumerate(documents):
        if doc.dim() != 1:
            raise DataError(f"pack: document {i} has shape {tuple(doc.shape)}, not 1-D",
                            hint="pass each document as a 1-D tensor of token ids")
        for piece in doc.long().split(width):
            if used + len(piece) > width:
                row, used = row + 1, 0
            if row == rows:
                return {"input_ids": ids, "position_ids": pos, "labels": labels}
            end = used + len(piece)
            ids[row, used:end] = piece
            pos[row, used:end] = torch.arange(len(piece))
            labels[row, used:end - 1] = piece[1:]
            used = end
    return {"input_ids": ids, "position_ids": pos, "labels": labels}


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """``(rows, length)`` int64: which document of its row each token is in (0, 1, ...),
    a new one wherever ``position_ids`` do not go on by one. No host synchronisation."""
    starts = torch.zeros_like(position_ids, dtype=torch.long)
    starts[:, 1:] = (position_ids[:, 1:] != position_ids[:, :-1] + 1).long()
    return starts.cumsum(-1)


def document_mask(documents: torch.Tensor) -> torch.Tensor:
    """``(rows, 1, length, length)`` bools for ``scaled_dot_product_attention``'s
    ``attn_mask``: token ``i`` attends to ``j <= i`` of its own document."""
    length = documents.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=documents.device).tril()
    return (documents[:, :, None] == documents[:, None, :])[:, None] & causal
