"""The expert gradients' reduction (see :mod:`pipekernel.grid.expert_parallel`): summed
over the expert-data-parallel group, then divided by the data-parallel size, beside the
dense reducer over the whole data-parallel group."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from pipekernel.grid.expert_parallel import ExpertParallelGroup
from pipekernel.step.grad_reduce import GradReducer

__all__ = ["ExpertGradReducer", "ReducerPair"]


class ExpertGradReducer:
    """The expert gradients' reduction: summed over the expert-data-parallel group, then
    divided by the data-parallel size (see :mod:`pipekernel.grid.expert_parallel`). Offers the calls of a
    :class:`~pipekernel.step.grad_reduce.GradReducer` (``arm``, ``backward_done``,
    ``finish``) so the engine drives both alike."""

    def __init__(self, params: Iterable[torch.Tensor], transport: Any, ep: ExpertParallelGroup,
                 bucket_bytes: int, master: Any, names: Sequence[str]) -> None:
        self.params, self.ep, self.master = list(params), ep, master
        self.bucket_bytes = bucket_bytes
        self.reducer = (GradReducer(self.params, transport, ep.data_handle, ep.data_size,
                                    bucket_bytes, master=master, names=list(names))
                        if len(ep.data_ranks) > 1 and self.params else None)

    def arm(self, final: Iterable[torch.Tensor] = ()) -> None:
        if self.reducer is not None:
            self.reducer.arm(final)

    def backward_done(self) -> None:
        if self.reducer is not None:
            self.reducer.backward_done()

    def finish(self) -> None:
        if self.reducer is not None:
            self.reducer.finish()  # divides by ep.data_size
            return
        scale = 1.0 / self.ep.data_size  # the E members' tokens are summed already
        for p in self.params:
            grad = self.master(p).grad
            if grad is not None:
                grad.mul_(scale)


class ReducerPair:
    """The dense reducer and the expert reducer as one (what the engine calls)."""

    def __init__(self, dense: Any, experts: ExpertGradReducer) -> None:
        self.parts = [r for r in (dense, experts) if r is not None]
        self.bucket_bytes = max(r.bucket_bytes for r in self.parts)

    def arm(self, final: Iterable[torch.Tensor] = ()) -> None:
        final = list(final)
        for r in self.parts:
            r.arm(final)

    def backward_done(self) -> None:
        for r in self.parts:
            r.backward_done()

    def finish(self) -> None:
        for r in self.parts:
            r.finish()
