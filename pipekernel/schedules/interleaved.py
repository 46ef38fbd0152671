"""Interleaved 1F1B (Narayanan et al. 2021; Megatron-LM's interleaved schedule).

Layer 0: no torch. Each stage holds ``chunks = v`` parts with the ``"loop"``
placement: chunk ``c`` of stage ``s`` is pipeline position ``c * S + s``.
"""
from __future__ import annotations

from pipekernel.errors import ConfigError
from pipekernel.schedules.ordered import Op, OrderedSchedule

__all__ = ["Interleaved1F1B"]


class Interleaved1F1B(OrderedSchedule):
    """Interleaved 1F1B over ``v`` chunks per stage.

    Micro-batches go through the chunks in groups of ``S`` (the number of
    stages): the ``k``-th forward of a stage is chunk ``(k // S) % v`` of
    micro-batch ``(k // (S * v)) * S + k % S``; the ``k``-th backward is the same
    with the chunks in reverse order. Stage ``s`` runs
    ``min((S - s - 1) * 2 + (v - 1) * S, M * v)`` warm-up forwards (all of them
    when ``M <= S``), then alternates one forward and one backward, then runs
    the remaining backwards.

    With ``chunks > 1``, ``micro_batches`` must be a multiple of ``num_stages``
    (as in Megatron-LM) or at most ``num_stages`` (one group of ``M``
    micro-batches; every forward then runs before the first backward, so a
    stage holds all ``M * v`` parts). With ``chunks=1`` this is plain 1F1B and
    any count works.
    """

    name = "interleaved"
    trains = True
    placement = "loop"
    min_chunks = 1
    max_chunks = 8
    default_chunks = 2

    def __init__(self, num_stages: int, stage: int, micro_batches: int, chunks: int = 2) -> None:
        super().__init__(num_stages, stage, micro_batches, chunks)
        S, M = num_stages, micro_batches
        if chunks > 1 and M > S and M % S:
            valid = ", ".join(str(S * k) for k in range(1, 4))
            raise ConfigError(
                f"interleaved with {S} stages needs micro_batches to be a multiple of {S} "
                f"(got {M}): use {valid}, ...",
                hint=f"pass micro_batches as a multiple of num_stages={S}, or chunks=1, "
                     "or schedule='1f1b' / 'zb-h1'", stage=stage)

    def _forward_op(self, k: int) -> Op:
        group = min(self.num_stages, self.micro_batches)
        return "F", (k // group) % self.chunks, (k // (group * self.chunks)) * group + k % group

    def _backward_op(self, k: int) -> Op:
        _, chunk, mb = self._forward_op(k)
        return "B", self.chunks - 1 - chunk, mb

    def warmup(self) -> int:
        """Forwards before the first backward."""
        S, v, M, s = self.num_stages, self.chunks, self.micro_batches, self.stage
        total = M * v
        if v == 1:
            return min(S - s - 1, M)
        if M <= S:
            return total
        return min((S - s - 1) * 2 + (v - 1) * S, total)

    def order(self) -> list[Op]:
        total, warmup = self.micro_batches * self.chunks, self.warmup()
        ops = [self._forward_op(k) for k in range(warmup)]
        for k in range(total - warmup):
            ops.append(self._forward_op(warmup + k))
            ops.append(self._backward_op(k))
        ops.extend(self._backward_op(k) for k in range(total - warmup, total))
        return ops
