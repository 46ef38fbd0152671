"""The numbers a train step decides on, gathered on the device and read by the host once.

A step needs, from every rank: whether fp16 unscaling overflowed, the squared gradient
norm (clipping), whether a loss was NaN/inf (``nonfinite="skip"``), the token count
(``loss_reduction="tokens"``), and, for the batch's loss, the loss sum, the sum and
count of the auxiliary losses (:mod:`pipekernel.model.aux_loss`, any stage) and which
micro-batches and ranks had a non-finite loss or aux loss (``nonfinite="error"``). Each is a 0-dim
tensor on the device. :class:`StepStats` writes them into one float64 vector **on the
device** (copies between device tensors: no host synchronisation), the caller
all-reduces that vector over the world once, and :meth:`StepStats.read` reads it with
one ``tolist()`` — the step's only host synchronisation (on a GPU the host waits there
for the backward and the all-reduce). Every decision after it uses Python floats.

The layout (``StepStats.OVERFLOW`` ... ``StepStats.FLAGS``)::

    [overflow, norm², bad loss, tokens, loss sum, aux sum, aux count,
     bad per micro-batch (m) ..., bad per rank (world) ...]

The per-micro-batch and per-rank flags exist only when asked for (``flags=True``).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["StepStats", "nonfinite_flag"]


def nonfinite_flag(losses: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """A 0-dim bool tensor on the losses' device: any of ``losses`` NaN/inf (``None``
    when there are none). No host synchronisation."""
    if not losses:
        return None
    return (~torch.isfinite(torch.stack(list(losses)).float())).any()


class StepStats:
    """One step's statistics as one device vector (see the module docstring).

    :param device: where the vector lives (the transport's device).
    :param micro_batches: the batch's micro-batch count (``m``).
    :param world: the world size (ranks of the all-reduce).
    :param flags: keep per-micro-batch and per-rank non-finite-loss flags.
    """

    OVERFLOW, NORM_SQ, BAD, TOKENS, LOSS, AUX, AUX_COUNT, FLAGS = 0, 1, 2, 3, 4, 5, 6, 7

    def __init__(self, device: Any, micro_batches: int, world: int, flags: bool) -> None:
        self.micro_batches, self.world, self.flags = micro_batches, world, flags
        size = self.FLAGS + (micro_batches + world if flags else 0)
        self.vec = torch.zeros(size, dtype=torch.float64, device=device)

    def put(self, index: int, value: torch.Tensor | float | bool | None) -> None:
        """``vec[index] = value``: a tensor is copied on the device (no sync); a Python
        number is a fill; ``None`` leaves the zero."""
        if value is None:
            return
        if isinstance(value, torch.Tensor):
            self.vec[index].copy_(value.detach().reshape(()))
        else:
            self.vec[index].fill_(float(value))

    def put_losses(self, losses: Sequence[torch.Tensor], micro_batches: Sequence[int],
                   rank: int) -> None:
        """The loss sum, and with ``flags`` which micro-batches (of ``losses``, computed
        for ``micro_batches``) and which rank (``rank``) had a NaN/inf loss."""
        if not losses:
            return
        stacked = torch.stack(list(losses)).detach()
        # the float32 sum is kept as the reference computes it; float64 on the wire
        self.vec[self.LOSS].copy_(stacked.sum())
        self._flag(stacked, micro_batches, rank)

    def put_aux(self, values: Sequence[torch.Tensor], micro_batches: Sequence[int],
                rank: int) -> None:
        """The auxiliary losses' sum and count, flagged like :meth:`put_losses`."""
        if not values:
            return
        stacked = torch.stack(list(values)).detach()
        self.vec[self.AUX].copy_(stacked.sum())
        self.vec[self.AUX_COUNT].fill_(len(values))
        self._flag(stacked, micro_batches, rank)

    def _flag(self, stacked: torch.Tensor, micro_batches: Sequence[int], rank: int) -> None:
        if not self.flags:
            return
        bad = (~torch.isfinite(stacked.float())).to(torch.float64)
        m, vec = self.micro_batches, self.vec
        # the index is host data: a non-blocking copy, never a synchronising one
        index = torch.tensor(list(micro_batches), dtype=torch.int64).to(
            vec.device, non_blocking=True)
        vec[self.FLAGS:self.FLAGS + m].index_add_(0, index, bad.to(vec.device))
        at = vec[self.FLAGS + m + rank]
        at.copy_(torch.maximum(at, bad.max()))

    def read(self) -> list[float]:
        """The (all-reduced) vector as Python floats: the one host synchronisation."""
        return self.vec.tolist()

    def bad_micro_batches(self, values: Sequence[float]) -> list[int]:
        """Micro-batches flagged non-finite in the read ``values``."""
        return [i for i in range(self.micro_batches) if values[self.FLAGS + i] > 0]

    def bad_ranks(self, values: Sequence[float]) -> list[int]:
        """Ranks flagged non-finite in the read ``values``."""
        base = self.FLAGS + self.micro_batches
        return [r for r in range(self.world) if values[base + r] > 0]
