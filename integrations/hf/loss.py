"""The causal-LM loss as Hugging Face computes it, token-weighted across micro-batches.

Position ``t``'s logits predict label ``t + 1`` (labels are unshifted, as Hugging Face
models take them); labels ``-100`` take no loss. With ``loss_reduction="tokens"`` the engine
divides the summed losses of every micro-batch and replica by the summed counts: the loss
of the whole batch, whatever the padding (see ``docs/loss.md``).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from pipekernel.errors import DataError

__all__ = ["IGNORE_INDEX", "causal_lm_loss", "causal_lm_mean_loss"]

#: Labels with this value take no loss (Hugging Face's and PyTorch's convention).
IGNORE_INDEX = -100
#: The key of already shifted labels (sequence chunks; :mod:`pipekernel.hf.prefix`).
SHIFTED = "shifted_labels"


def causal_lm_loss(logits: torch.Tensor, labels: Any
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of the shifted token losses, number of labelled tokens)``, in fp32.

    :param logits: ``(batch, sequence, vocabulary)``.
    :param labels: ``(batch, sequence)``, unshifted, ``-100`` where no loss is taken; or
        ``{"shifted_labels": ...}``, the label each position predicts (already shifted: what
        a micro-batch cut into sequence chunks carries, so that a chunk's last position
        predicts the next chunk's first token, :func:`pipekernel.hf.prefix.shift_labels`).
    """
    if labels is None:
        raise DataError("the micro-batch has no 'labels', and training needs them",
                        hint="add 'labels' to each micro-batch dict (usually input_ids with "
                             "-100 where attention_mask is 0)")
    if isinstance(labels, Mapping) and SHIFTED in labels:
        shifted = labels[SHIFTED].reshape(-1)
        logits = logits.reshape(-1, logits.shape[-1]).float()
    else:
        shifted = labels[..., 1:].reshape(-1)
        logits = logits[..., :-1, :].reshape(-1, logits.shape[-1]).float()
    loss_sum = F.cross_entropy(logits, shifted.to(logits.device), ignore_index=IGNORE_INDEX,
                               reduction="sum")
    return loss_sum, (shifted != IGNORE_INDEX).sum()


def causal_lm_mean_loss(logits: torch.Tensor, labels: Any) -> torch.Tensor:
    """The mean of the shifted token losses of one micro-batch (fp32): the ``loss`` a Hugging
    Face causal LM's forward returns, which :func:`pipeline_module` uses with a router
    auxiliary loss (``loss_reduction="mean"``: the mean over micro-batches of the model's
    own loss, as gradient accumulation of ``model(**batch).loss`` computes it)."""
    loss_sum, count = causal_lm_loss(logits, labels)
    return loss_sum / count
