"""How micro-batch losses become the batch's loss and gradient (``loss_reduction=``).

``"mean"`` (the default): ``loss_fn`` returns a scalar per micro-batch; the batch's
gradient is that of the mean over micro-batches and data-parallel replicas.

``"tokens"``: ``loss_fn`` returns ``(loss_sum, token_count)`` per micro-batch (e.g.
``cross_entropy(..., reduction="sum", ignore_index=-100)`` and the number of labels
that are not padding); the batch's gradient is that of ``Σ loss_sum / Σ token_count``
over every micro-batch of every replica, and the returned loss is that token mean.

The global token count is only known once every micro-batch's loss was computed, and
those are interleaved with backwards. pipekernel does not count tokens up front: it
backwards ``loss_sum / micro_batches`` (the same constant factor on every replica and
stage), lets the gradients accumulate and reduce as usual, and divides them by
``Σ token_count / (micro_batches × replicas)`` right before the optimizer step (after
fp16 unscaling, before clipping). The count travels in the one small all-reduce the
step already does for overflow flags and the gradient norm, so it costs nothing
extra, needs no labels before the first backward, and works with every schedule
(split backwards included). See ``docs/loss.md``.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pipekernel.errors import ConfigError, DataError
from pipekernel.nested import describe

__all__ = ["LOSS_REDUCTIONS", "TokenLoss", "check_loss_reduction"]

#: The values ``PipelineEngine(loss_reduction=...)`` accepts.
LOSS_REDUCTIONS = ("mean", "tokens")


def check_loss_reduction(value: Any) -> str:
    """``value`` if it is a known reduction, else ``ConfigError``."""
    if value not in LOSS_REDUCTIONS:
        raise ConfigError(f"loss_reduction must be one of {', '.join(map(repr, LOSS_REDUCTIONS))}"
                          f", got {value!r}",
                          hint="loss_reduction='tokens' with a loss_fn returning "
                               "(loss_sum, token_count)")
    return value


class TokenLoss:
    """Wraps a ``loss_fn`` returning ``(loss_sum, token_count)``: calls check that and
    return ``(loss_sum, count)``, the count a 0-dim float64 tensor (no device sync). It
    keeps nothing: the stage runtime records each count with its loss in the batch's
    :class:`~pipekernel.step.optimizer_step.BatchLosses`, which the batch step owns.

    :param loss_fn: ``loss_fn(outputs, labels) -> (loss_sum, token_count)``.
    """

    def __init__(self, loss_fn: Callable[[Any, Any], Any]) -> None:
        self.loss_fn = loss_fn

    def __call__(self, outputs: Any, labels: Any) -> tuple[torch.Tensor, torch.Tensor]:
        result = self.loss_fn(outputs, labels)
        if not (isinstance(result, (tuple, list)) and len(result) == 2
                and isinstance(result[0], torch.Tensor) and result[0].numel() == 1):
            raise DataError(f"with loss_reduction='tokens' loss_fn must return (loss_sum, "
                            f"token_count), got {describe(result)}",
                            hint="return e.g. (F.cross_entropy(logits, labels, "
                                 "reduction='sum', ignore_index=-100), (labels != -100).sum())")
        loss_sum, count = result
        count = torch.as_tensor(count, device=loss_sum.device)
        if count.numel() != 1:
            raise DataError(f"token_count must be one number, got {describe(count)}",
                            hint="return the number of tokens the loss sum covers")
        return loss_sum, count.detach().reshape(()).to(torch.float64)
