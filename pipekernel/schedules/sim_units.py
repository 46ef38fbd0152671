"""The full simulation's transfers (:mod:`pipekernel.schedules.sim_rendezvous`): each posted
point-to-point operation (:class:`_Op`) and the units a rank's lane orders them in
(:class:`_Unit`, :func:`_units`) — what its event loop completes and its deadlock report walks.
Layer 0: no torch."""
from __future__ import annotations

from pipekernel.schedules.instructions import MicroBatchInstruction


class _Op:
    """One posted (or to be posted) point-to-point operation."""

    __slots__ = ("rank", "peer", "lane", "index", "step", "ins", "send", "mate", "unit", "done",
                 "cost_send", "cost_recv")

    mate: _Op | None
    unit: _Unit | None
    done: float | None

    def __init__(self, rank: int, peer: int, lane: int | None, index: int, step: int,
                 ins: MicroBatchInstruction, send: bool) -> None:
        self.rank, self.peer, self.index, self.step, self.ins = rank, peer, index, step, ins
        self.lane, self.send = lane, send
        self.mate = self.unit = self.done = None  # unit: set when posted
        # the transfer's duration: its two ends' costs, added in this order (set when matched)
        self.cost_send = self.cost_recv = 0.0

    def name(self) -> str:
        return f"stage {self.rank}'s {self.ins}"

    def where(self) -> str:
        return f"stage {self.rank} step {self.step} ({self.ins})"


class _Unit:
    """A group's operations of one rank on one lane, to any peers: they progress together,
    after every earlier unit of that rank on that lane (one ordered stream per rank).

    Built once before the run (:func:`_units`): ``lane`` is the rank's dense lane number,
    ``next`` the unit posted after it on that lane (the lane's order is the stream's, fixed
    before the batch starts), ``heads`` and ``ends`` the rank's per-lane lists of the unit
    heading each lane and the time its last unit ended. ``post`` is ``None`` until posted."""

    __slots__ = ("ops", "post", "start", "end", "left", "active", "lane", "next", "heads",
                 "ends")

    post: float | None
    next: _Unit | None

    def __init__(self, ops: list[_Op], lane: int, heads: list, ends: list) -> None:
        self.ops, self.lane, self.heads, self.ends = ops, lane, heads, ends
        self.post = self.next = None
        self.start = self.end = 0.0
        self.left, self.active = len(ops), False


def _units(groups: dict[int, list[_Op]], n: int) -> tuple[list, list, list]:
    """Per stream index, the units posted there (one per lane of its group, whatever the
    peers, each unit's ops in stream order; ``()`` where nothing is posted), and the rank's
    per-lane heads and ends (:class:`_Unit`), lanes numbered densely as first met."""
    at: list = [()] * n
    dense: dict[int | None, int] = {}
    chains: list[list[_Unit]] = []  # per lane, its units in posting order
    heads: list[_Unit | None] = []
    ends: list[float] = []
    for g in sorted(groups):
        group = groups[g]
        if len(group) == 1:  # nearly all: one op, one lane
            op = group[0]
            k = dense.get(op.lane)
            if k is None:
                k = _new_lane(dense, op.lane, chains, heads, ends)
            unit = op.unit = _Unit(group, k, heads, ends)
            chains[k].append(unit)
            at[g] = (unit,)
            continue
        group.sort(key=lambda op: op.index)
        split: dict[int | None, list[_Op]] = {}
        for op in group:
            split.setdefault(op.lane, []).append(op)
        units = []
        for lane, ops in split.items():
            k = dense.get(lane)
            if k is None:
                k = _new_lane(dense, lane, chains, heads, ends)
            unit = _Unit(ops, k, heads, ends)
            for op in ops:
                op.unit = unit
            chains[k].append(unit)
            units.append(unit)
        at[g] = tuple(units)
    for k, chain in enumerate(chains):
        heads[k] = chain[0]
        for unit, following in zip(chain, chain[1:]):
            unit.next = following
    return at, heads, ends


def _new_lane(dense: dict, lane: int | None, chains: list, heads: list, ends: list) -> int:
    """Number ``lane`` (the next dense number) and make room for it."""
    k = dense[lane] = len(chains)
    chains.append([])
    heads.append(None)
    ends.append(0.0)
    return k
