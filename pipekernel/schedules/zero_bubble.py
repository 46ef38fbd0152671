"""Zero-bubble schedules: ZB-H1, ZB-H2 and ZB-V (Qi et al., "Zero Bubble Pipeline
Parallelism", ICLR 2024). Layer 0: no torch.

All split each backward into ``BackwardInput`` (I: the gradient of the part's
inputs, sent upstream at once) and ``BackwardWeight`` (W: the gradient of its
weights, which nothing downstream waits for). W can then be moved into what
would otherwise be pipeline bubbles.

``zb-h1`` and ``zb-h2`` are the paper's handcrafted schedules (its section 3,
Table 1), one chunk per stage; :func:`handcrafted` builds a stage's order from two
numbers, its warm-up forwards and its in-flight cap (a part counts from its F to
its W). At equal costs (``T_F = T_I = T_W``) the simulator measures the paper's
times exactly:

* ``zb-h1``: warm-up ``S - s``, cap ``S`` on every stage (the peak of 1F1B, which
  1F1B reaches only on stage 0): iteration time ``M (F+I+W) + (S-1)(F+I-W)``, a
  third of 1F1B's bubble (at ``T_I = T_W = T_F / 2``, a half). Later stages hold up to ``S`` parts and defer their W
  into the tail, so every stage ends together.
* ``zb-h2``: warm-up ``2 S - 1 - 2 s``, cap ``2 S - 1``: the warm-up fills the bubble
  before the first I and the tail's W turn the trapezoid into a parallelogram —
  each stage computes without a gap from its first F to its last W
  (``SimulationResult.spans`` = ``M (F+I+W) + (S-1)(F+I-2W)``, whose bubble term is zero
  at equal costs, when ``M >= 2 S - 1``; with fewer micro-batches stage 0 cannot fill
  the warm-up).
  The batch's makespan adds the pipeline's fill ``(S-1) F``: pipekernel ends every
  batch with a synchronising optimizer step, which the paper removes
  ("post-validation"); back to back without it, stage ``s`` would start the next
  batch ``s F`` late and the parallelogram would tile.

``zbv`` is planned by :func:`list_schedule`, a list scheduler that plays the whole
pipeline forward in unit time (F = I = W = 1) and lets every idle stage pick, in
this order of preference:

1. the next ``I`` whose output gradient has arrived (deepest chunk first);
2. the next ``F`` whose input has arrived, if the stage has room for one more
   live part (its memory cap) and, at position 0, fewer than ``num_stages``
   micro-batches are between their forward and their backward-input there;
3. the oldest pending ``W``.

Parts are forwarded, and their ``I`` run, in ascending micro-batch order per
chunk; a stage takes messages from one peer in the order that peer sent them
(one FIFO per pair of ranks, as NCCL matches point-to-point operations), so
every send meets its receive in order. The memory cap counts parts whose ``W``
has not run, i.e. buffers: the same count the simulator reports. The admission
limit at position 0 keeps the plan from ever being stuck: a stage that lacks a
slot for a forward of an admitted micro-batch always holds a pending ``W``.
``zbv`` caps ``min(2 S, 2 M)`` parts of half a stage each — the activation
memory of 1F1B's first stage, on every rank.

**zbv's pairs** (issue 30: one ``ForwardBackward`` for a paired executor, as
``dualpipev``'s). The plan has no full backward, so :func:`pair_forwards` makes them
where the plan puts a forward of one chunk right before a backward-input of the other
chunk, with at most weight passes between: that I becomes a full ``B`` (its ``W``
dropped from later in the order), the pair ``(F, B)`` is one step, and the weight
passes that stood between go just before it. Only weight passes move, and they touch
no transfer, so every send and receive keeps its place in each lane's order; what the
pair changes is what any ``ForwardBackward`` changes (both halves' receives before
the forward, its sends after the backward). The pairs are those ``dualpipev`` makes:
a forward and a backward of *different chunks* (so of different micro-batches). Two
parts of one chunk are never paired: the forward's activation goes to the very peer
the backward's gradient comes from, and where that peer runs its forward first the
pair waits on a gradient that waits on its own activation — a deadlock the simulator
finds at ``S = 3, M = 2`` already. Nor are they
useful: :func:`~pipekernel.stage.paired.overlap_all_to_all` overlaps only two chunks'
lanes. The warm-up holds no such neighbours; how many pairs the steady state has
depends on the sizes (at ``S = 2``: from ``M = 4``, on rank 1; at ``S = 4``: from
``M = 7``; rank 0, which computes the loss, has none in the sizes tested).

Without an overlapping executor a stage runs the plan itself, unpaired
(:meth:`ZBV.unpaired_steps`: ``I`` and ``W`` apart, exactly as before pairs existed).
With one it runs the paired plan, which gives up part of the zero-bubble property (a
merged ``W`` no longer fills a bubble, and each pair holds the forward's sends until
after its backward): only an overlap that makes the pair cheaper than ``F + B`` buys
that back; ``simulate(ZBV, ..., paired=True)`` (or a ``ForwardBackward`` cost) measures
the paired plan. The simulator proves the paired plans for ``2 <= S <= 8`` stages and
``1 <= M <= 32`` micro-batches (tests/test_paired.py); other sizes are not proven.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from functools import cached_property, lru_cache

from pipekernel.errors import ScheduleError
from pipekernel.schedules.instructions import Instruction
from pipekernel.schedules.ordered import Op, OrderedSchedule
from pipekernel.schedules.placement import locate, position

__all__ = ["ZBH1", "ZBH2", "ZBV", "list_schedule", "handcrafted", "pair_forwards"]


@lru_cache(maxsize=256)
def list_schedule(num_stages: int, micro_batches: int, chunks: int, placement: str,
                  caps: tuple[int, ...], admit: int,
                  chunk_priority: tuple[int, ...] | None = None) -> tuple[tuple[Op, ...], ...]:
    """Every stage's order of ``F``/``I``/``W`` operations (see the module docstring).

    :param caps: per stage, the most live parts (forwarded, ``W`` not yet run).
    :param chunk_priority: chunks in the order a stage prefers them when several
        are ready (default: the deepest position first).
    """
    return _ListScheduler(num_stages, micro_batches, chunks, placement, caps, admit,
                          chunk_priority).play()


class _ListScheduler:
    """:func:`list_schedule`'s play of the whole pipeline in unit time, one tick at a time."""

    def __init__(self, S: int, M: int, C: int, placement: str, caps: tuple[int, ...],
                 admit: int, chunk_priority: tuple[int, ...] | None) -> None:
        self.S, self.M, self.C, self.placement = S, M, C, placement
        self.caps, self.admit = caps, admit
        self.last = S * C - 1
        pos = self.pos = [[position(s, c, S, placement) for c in range(C)] for s in range(S)]
        if chunk_priority is None:
            self.order = [sorted(range(C), key=pos[s].__getitem__, reverse=True)
                          for s in range(S)]
        else:
            self.order = [list(chunk_priority) for _ in range(S)]
        self.done: dict[tuple[str, int, int], int] = {}   # (kind, position, mb) -> end time
        self.next_f = [[0] * C for _ in range(S)]
        self.next_i = [[0] * C for _ in range(S)]
        self.pending_w: list[deque[tuple[int, int]]] = [deque() for _ in range(S)]
        self.live = [0] * S
        self.admitted = self.finished = 0  # micro-batches that entered position 0 / left it
        self.busy_until = [0] * S
        self.ops: list[list[Op]] = [[] for _ in range(S)]
        # messages in flight between two different ranks, in send order: (src, dst) -> deque
        self.wire: dict[tuple[int, int], deque[tuple[str, int, int]]] = {}

    def play(self) -> tuple[tuple[Op, ...], ...]:
        total, t = self.S * self.C * self.M * 3, 0
        while sum(len(o) for o in self.ops) < total:
            moved = False
            for s in range(self.S):
                if self.busy_until[s] > t:
                    moved = True
                    continue
                choice = self._input(s, t) or self._forward(s, t) or self._weight(s)
                if choice is not None:
                    self._take(s, *choice, t)
                    moved = True
            if not moved:
                raise ScheduleError(
                    f"zero-bubble planner is stuck at time {t} for {self.S} stage(s) x "
                    f"{self.M} micro-batch(es) with memory caps {list(self.caps)}",
                    hint="raise the memory caps (this is a bug in the schedule's caps)")
            t += 1
        return tuple(tuple(o) for o in self.ops)

    def _input(self, s: int, t: int) -> tuple[str, int, int] | None:
        """1. the next backward-input whose output gradient has arrived."""
        pos = self.pos[s]
        for c in self.order[s]:
            mb = self.next_i[s][c]
            ready = pos[c] == self.last or self._arrived("I", pos[c], mb, t)
            if mb < self.next_f[s][c] and ready \
                    and self.done.get(("F", pos[c], mb), t + 1) <= t:
                return ("I", c, mb)
        return None

    def _forward(self, s: int, t: int) -> tuple[str, int, int] | None:
        """2. the next forward whose input has arrived, when there is room for it."""
        for c in self.order[s]:
            mb, p = self.next_f[s][c], self.pos[s][c]
            if mb >= self.M or not (p == 0 or self._arrived("F", p, mb, t)):
                continue
            if p == 0 and self.admitted - self.finished >= self.admit:
                continue
            if self.live[s] >= self.caps[s]:
                continue
            return ("F", c, mb)
        return None

    def _weight(self, s: int) -> tuple[str, int, int] | None:
        """3. the oldest pending weight pass."""
        if not self.pending_w[s]:
            return None
        c, mb = self.pending_w[s].popleft()
        return ("W", c, mb)

    def _arrived(self, kind: str, p: int, mb: int, t: int) -> bool:
        """The message a part at position ``p`` waits for has arrived by ``t``."""
        src = p - 1 if kind == "F" else p + 1
        end = self.done.get(("F" if kind == "F" else "I", src, mb))
        if end is None or end > t:
            return False
        me, peer = locate(p, self.S, self.placement)[0], locate(src, self.S, self.placement)[0]
        if me == peer:
            return True
        queue = self.wire.get((peer, me))
        return queue is not None and len(queue) > 0 and queue[0] == (kind, p, mb)

    def _take(self, s: int, kind: str, c: int, mb: int, t: int) -> None:
        p = self.pos[s][c]
        if kind == "F":
            self.next_f[s][c] += 1
            self.live[s] += 1
            self.admitted += p == 0
        elif kind == "I":
            self.next_i[s][c] += 1
            self.finished += p == 0
            self.pending_w[s].append((c, mb))
        else:
            self.live[s] -= 1
        if kind in ("F", "I"):
            self._message(s, kind, p, mb)
        self.done[(kind, p, mb)] = t + 1
        self.busy_until[s] = t + 1
        self.ops[s].append((kind, c, mb))

    def _message(self, s: int, kind: str, p: int, mb: int) -> None:
        """``F``/``I`` at position ``p`` takes its message off the wire and sends the next."""
        src = p - 1 if kind == "F" else p + 1
        if 0 <= src <= self.last:
            peer = locate(src, self.S, self.placement)[0]
            if peer != s:
                self.wire[(peer, s)].popleft()
        dst = p + 1 if kind == "F" else p - 1
        if 0 <= dst <= self.last:
            peer = locate(dst, self.S, self.placement)[0]
            if peer != s:
                self.wire.setdefault((s, peer), deque()).append((kind, dst, mb))


@lru_cache(maxsize=256)
def pair_forwards(order: tuple[Op, ...]) -> tuple[tuple[Op, ...], frozenset[int]]:
    """``order`` (a ``zbv`` plan) with its pairs made, and the indices of their forwards
    (see the module docstring): each ``F`` followed, after weight passes only, by an
    ``I`` of the other chunk pairs with it, the ``I`` made a full ``B``, its ``W``
    dropped, the weight passes between moved before the ``F``."""
    out: list[Op] = []
    pairs: set[int] = set()
    merged: set[tuple[int, int]] = set()  # (chunk, micro_batch) whose W went into a B
    i = 0
    while i < len(order):
        op = order[i]
        j = i + 1
        while op[0] == "F" and j < len(order) and order[j][0] == "W":
            j += 1
        if op[0] == "F" and j < len(order) and order[j][0] == "I" and order[j][1] != op[1]:
            out.extend(w for w in order[i + 1:j] if (w[1], w[2]) not in merged)
            pairs.add(len(out))
            out += [op, ("B", order[j][1], order[j][2])]
            merged.add((order[j][1], order[j][2]))
            i = j + 1
            continue
        if not (op[0] == "W" and (op[1], op[2]) in merged):
            out.append(op)
        i += 1
    return tuple(out), frozenset(pairs)


def handcrafted(micro_batches: int, warmup: int, cap: int) -> tuple[Op, ...]:
    """One stage's order of a one-chunk zero-bubble schedule (``zb-h1``, ``zb-h2``).

    ``warmup`` forwards (at most ``micro_batches``), then for each micro-batch in
    order: its ``I``; then, while forwards are left, the next ``F`` — preceded by the
    oldest pending ``W`` when the stage already holds ``cap`` parts — and once they
    are all done, the oldest pending ``W``; the remaining ``W`` last. The stage never
    holds more than ``max(cap, warmup)`` parts (counted from F to W).
    """
    M = micro_batches
    ops: list[Op] = [("F", 0, k) for k in range(min(warmup, M))]
    next_f = live = len(ops)
    pending: deque[int] = deque()
    for k in range(M):
        ops.append(("I", 0, k))
        pending.append(k)
        if next_f < M:
            if live >= cap:
                ops.append(("W", 0, pending.popleft()))
                live -= 1
            ops.append(("F", 0, next_f))
            next_f += 1
            live += 1
        else:
            ops.append(("W", 0, pending.popleft()))
            live -= 1
    ops.extend(("W", 0, k) for k in pending)
    return tuple(ops)


class _ZeroBubble(OrderedSchedule):
    trains = True

    def caps(self) -> tuple[int, ...]:
        raise NotImplementedError

    def order(self) -> Sequence[Op]:
        return list_schedule(self.num_stages, self.micro_batches, self.chunks, self.placement,
                             self.caps(), self.num_stages)[self.stage]


class ZBH1(OrderedSchedule):
    """ZB-H1 (the paper's handcrafted schedule): 1F1B's peak memory, a third of its bubble
    at equal costs ``T_F = T_I = T_W`` (``pipekernel schedule --backward-cost 2``).

    One chunk, ``"loop"`` placement, any sizes. Stage ``s`` runs ``min(S - s, M)``
    warm-up forwards and holds at most ``min(S, M)`` parts (counting a part until
    its W) — the peak of 1F1B, which 1F1B reaches on stage 0 only. At equal costs
    a batch takes ``M (F+I+W) + (S-1)(F+I-W)`` (see the module docstring).
    """

    name = "zb-h1"
    placement = "loop"
    trains = True

    def order(self) -> Sequence[Op]:
        S, s = self.num_stages, self.stage
        return handcrafted(self.micro_batches, S - s, S)


class ZBH2(OrderedSchedule):
    """ZB-H2 (the paper's handcrafted schedule): no bubble inside a stage at equal costs
    ``T_F = T_I = T_W``, ``2 S - 1`` parts in flight.

    One chunk, ``"loop"`` placement, any sizes. Stage ``s`` runs
    ``min(2 S - 1 - 2 s, M)`` warm-up forwards and holds at most ``min(2 S - 1, M)``
    parts. With ``M >= 2 S - 1`` every stage computes without a gap from its first
    F to its last W (a parallelogram; see the module docstring for what the
    end-of-batch synchronisation adds).
    """

    name = "zb-h2"
    placement = "loop"
    trains = True

    def order(self) -> Sequence[Op]:
        S, s = self.num_stages, self.stage
        return handcrafted(self.micro_batches, 2 * S - 1 - 2 * s, 2 * S - 1)


class ZBV(_ZeroBubble):
    """ZB-V: two chunks per rank in a V, backward split into I and W.

    ``"v"`` placement, exactly 2 chunks, any sizes: rank ``s`` holds positions
    ``s`` (chunk 0) and ``2 S - 1 - s`` (chunk 1), so rank 0 loads the inputs and
    computes the loss, and the turn of the V (``S - 1 -> S``) is a local hand-off
    on the last rank. Each rank holds at most ``min(2 S, 2 M)`` parts.

    :meth:`steps` pair a forward with a full backward of the other chunk where the plan
    puts them side by side (``ForwardBackward``, for a paired executor; see the module
    docstring); :meth:`unpaired_steps`, what a stage runs without one, are the plan.
    """

    name = "zbv"
    placement = "v"
    min_chunks = max_chunks = default_chunks = 2

    def __init__(self, num_stages: int, stage: int, micro_batches: int, chunks: int = 2) -> None:
        super().__init__(num_stages, stage, micro_batches, chunks)

    def caps(self) -> tuple[int, ...]:
        S, M = self.num_stages, self.micro_batches
        return tuple(min(2 * S, 2 * M) for s in range(S))

    def plan_order(self) -> Sequence[Op]:
        """The zero-bubble plan of this stage (:func:`list_schedule`), without pairs."""
        return super().order()

    @cached_property
    def _paired_plan(self) -> tuple[tuple[Op, ...], frozenset[int]]:
        return pair_forwards(tuple(self.plan_order()))

    def order(self) -> Sequence[Op]:
        """The plan with its pairs made (:func:`pair_forwards`)."""
        return self._paired_plan[0]

    def pairs(self) -> frozenset[int]:
        return self._paired_plan[1]

    @cached_property
    def _plan_built(self) -> tuple[list[list[Instruction]], int]:
        return self._build(list(self.plan_order()), frozenset())

    def unpaired_steps(self) -> list[list[Instruction]]:
        """The plan itself, ``I`` and ``W`` apart (the pairs' ``W`` back where the plan
        put them): what a stage runs without an overlapping executor."""
        return list(map(list, self._plan_built[0]))  # fresh lists, copied in C

    def num_buffers(self) -> int:
        """The plan's peak of live parts: the paired order frees each part as early or
        earlier (a pair's ``B`` frees it at once, moved weight passes run earlier)."""
        return self._plan_built[1]
