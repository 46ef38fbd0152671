"""DualPipeV (DeepSeek-V3's DualPipe folded into a V; layer 0: no torch).

DualPipe (DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024) runs a forward and a
backward of *different* micro-batches as one pair, so that one's communication
hides behind the other's compute; DualPipeV ("cut-in-half" DualPipe, the
open-source DualPipe repository's ``DualPipeV``, torch's ``ScheduleDualPipeV``)
needs only one copy of the model: two chunks per rank in the ``"v"`` placement
(the same as ZB-V: rank ``s`` holds positions ``s`` and ``2 S - 1 - s``).

pipekernel runs each pair as one step with one ``ForwardBackward`` instruction
(receives of both halves, the pair, then both sends — DualPipe's
``_forward_backward_chunk``), the same pairs as the reference: every pair of phase 4
and 5 but the first (F chunk 0, B chunk 1) of the last rank, which the reference runs
apart "to further reduce bubble size". The stage's paired executor
(:mod:`pipekernel.stage.paired`) runs it: by default the forward then the backward,
exactly as two steps would; a model may overlap them (DualPipe's
``overlapped_forward_backward``). Besides the overlap, the pairing orders: in the steady state each rank alternates the two chunks' forward and
backward, so both of its links carry traffic in both directions all the time, and
its warm-up and cool-down use the zero-bubble split (``BackwardInput`` /
``BackwardWeight``) to fill the bubbles. Rank ``r`` of ``S``, chunks 0 (going
down) and 1 (coming back), ``M >= 2 S`` micro-batches, in eight phases:

1. ``2 (S - r - 1)`` forwards of chunk 0;
2. ``r + 1`` times: a forward of chunk 0, a forward of chunk 1;
3. ``S - r - 1`` times: I of chunk 1, the oldest pending W, a forward of chunk 1;
4. ``M - 2 S + r + 1`` times: the pairs (F chunk 0, B chunk 1), (F chunk 1, B chunk 0);
5. ``S - r - 1`` times: B of chunk 1, the pair (F chunk 1, B chunk 0);
6. ``r + 1`` times: a backward of chunk 1, then of chunk 0 — full backwards for the
   first half, the split I from the middle on (so that their W fill phase 7 and 8);
7. ``S - r - 1`` times: the oldest pending W, a backward of chunk 0 (split if phase
   6 switched);
8. the remaining W.

Micro-batches enter each chunk's forward and backward in ascending order; a full
backward ``B`` frees its part at once, a split one at its W. The simulator proves
the result like every schedule (tests/test_schedules_zb.py).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from functools import cached_property

from pipekernel.errors import ConfigError
from pipekernel.schedules.ordered import Op, OrderedSchedule

__all__ = ["DualPipeV", "dualpipev_order", "dualpipev_pairs"]


class _Order:
    """A rank's order under construction: per-chunk counters and the pending W queue."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.next_f = [0, 0]
        self.next_b = [0, 0]
        self.pending: deque[tuple[int, int]] = deque()
        self.paired: set[int] = set()  # indices of ops whose F runs with the next op's B

    def pair(self, f_chunk: int, b_chunk: int) -> None:
        """A forward of ``f_chunk`` and a full backward of ``b_chunk``, as one pair."""
        self.paired.add(len(self.ops))
        self.forward(f_chunk)
        self.backward(b_chunk, split=False)

    def forward(self, chunk: int) -> None:
        self.ops.append(("F", chunk, self.next_f[chunk]))
        self.next_f[chunk] += 1

    def backward(self, chunk: int, split: bool) -> None:
        mb = self.next_b[chunk]
        self.next_b[chunk] += 1
        self.ops.append(("I" if split else "B", chunk, mb))
        if split:
            self.pending.append((chunk, mb))

    def weight(self) -> None:
        if self.pending:
            chunk, mb = self.pending.popleft()
            self.ops.append(("W", chunk, mb))


def dualpipev_order(num_stages: int, rank: int, micro_batches: int) -> tuple[Op, ...]:
    """Rank ``rank``'s DualPipeV order (see the module docstring); ``micro_batches``
    must be at least ``2 * num_stages``."""
    return tuple(_build(num_stages, rank, micro_batches).ops)


def dualpipev_pairs(num_stages: int, rank: int, micro_batches: int) -> frozenset[int]:
    """Indices ``i`` of :func:`dualpipev_order` whose forward runs with the backward at
    ``i + 1`` as one ``ForwardBackward`` (DualPipe's ``_forward_backward_chunk``)."""
    return frozenset(_build(num_stages, rank, micro_batches).paired)


def _build(num_stages: int, rank: int, micro_batches: int) -> _Order:
    S, r, M = num_stages, rank, micro_batches
    o = _Order()
    for _ in range(2 * (S - r - 1)):                 # 1. fill chunk 0
        o.forward(0)
    for _ in range(r + 1):                           # 2. both chunks
        o.forward(0)
        o.forward(1)
    for _ in range(S - r - 1):                       # 3. zero-bubble on chunk 1
        o.backward(1, split=True)
        o.weight()
        o.forward(1)
    for i in range(M - 2 * S + r + 1):               # 4. the paired steady state
        if i == 0 and r == S - 1:  # as the reference: not overlapped, a smaller bubble
            o.forward(0)
            o.backward(1, split=False)
        else:
            o.pair(0, 1)
        o.pair(1, 0)
    for _ in range(S - r - 1):                       # 5. chunk 0's forwards are done
        o.backward(1, split=False)
        o.pair(1, 0)
    split = False
    half = (r + 1) // 2
    for i in range(r + 1):                           # 6. drain, split from the middle on
        if i == half and r % 2 == 1:
            split = True
        o.backward(1, split)
        if i == half and r % 2 == 0:
            split = True
        o.backward(0, split)
    for _ in range(S - r - 1):                       # 7. W fill the wait for chunk 0
        o.weight()
        o.backward(0, split)
    while o.pending:                                 # 8. the remaining W
        o.weight()
    return o


class DualPipeV(OrderedSchedule):
    """DualPipeV: V placement (two chunks per rank, like ``zbv``), forwards and
    backwards of different micro-batches paired in the steady state, zero-bubble
    splits in the warm-up and the drain (see :mod:`pipekernel.schedules.dualpipe`).

    Exactly 2 chunks; ``micro_batches >= 2 * num_stages`` (as torch's
    ``ScheduleDualPipeV``). Rank ``s`` holds positions ``s`` and ``2 S - 1 - s``.
    """

    name = "dualpipev"
    placement = "v"
    trains = True
    min_chunks = max_chunks = default_chunks = 2

    def __init__(self, num_stages: int, stage: int, micro_batches: int, chunks: int = 2) -> None:
        super().__init__(num_stages, stage, micro_batches, chunks)
        if micro_batches < 2 * num_stages:
            raise ConfigError(
                f"dualpipev with {num_stages} stage(s) needs micro_batches >= "
                f"{2 * num_stages} (2 x num_stages), got {micro_batches}",
                hint=f"pass micro_batches={2 * num_stages} or more, or use schedule='zbv' "
                     "(the same V placement, any micro-batch count)", stage=stage)

    @cached_property
    def _order(self) -> _Order:
        """This rank's order and pairs, made once (both are read by each build)."""
        return _build(self.num_stages, self.stage, self.micro_batches)

    def order(self) -> Sequence[Op]:
        return tuple(self._order.ops)

    def pairs(self) -> frozenset[int]:
        return frozenset(self._order.paired)
