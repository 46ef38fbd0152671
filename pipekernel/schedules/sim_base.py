"""The simulator's core (:mod:`pipekernel.schedules.simulator`), shared by its full and its fast
path: the result and its grid, the one table of what each instruction class does
(:func:`role`), the per-stage state, the instructions' semantics (buffers, forwards and
backwards, micro-batch checks), costs, and the world collectives' rule (:class:`_World`).
Layer 0: no torch."""
from __future__ import annotations

import math
from fractions import Fraction
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import chain
from operator import itemgetter, sub
from typing import NamedTuple

from pipekernel.schedules.instructions import (
    Backward, BackwardInput, BackwardWeight, Forward, ForwardBackward, Instruction, LoadMicroBatch,
    MicroBatchInstruction, OptimizerStep, RecvActivation, RecvGrad, RecvSkip, RecvSkipGrad,
    ReduceTiedGrads, SendActivation, SendGrad, SendSkip, SendSkipGrad, SkipInstruction,
)
from pipekernel.schedules.comm import P2P, SENDS, peer_of
from pipekernel.schedules.skips import skip_edge_of

#: Instruction classes that count as compute (in the timeline and the bubble). A
#: ``ForwardBackward`` is compute too: it runs as its two halves, one after the other on
#: the timeline, and costs what they cost unless ``costs`` names it (issue 30's paired
#: cost), then that split over the halves in their ratio.
COMPUTE = (Forward, Backward, BackwardInput, BackwardWeight)
PAIRED = ForwardBackward
#: Unit costs; every instruction class not listed costs 0.
DEFAULT_COSTS: Mapping[type, float] = {cls: 1.0 for cls in COMPUTE}
#: Communication semantics :func:`simulate` understands (the strictest any transport has).
SEMANTICS = ("rendezvous",)
#: Instructions every stage must enter together under rendezvous semantics.
WORLD_COLLECTIVES = (ReduceTiedGrads, OptimizerStep)

_BACKWARDS = (Backward, BackwardInput, BackwardWeight)
_WRITES = (LoadMicroBatch, RecvActivation, Forward)
_END = "the end-of-batch loss all-reduce"


@dataclass(frozen=True)
class SimulationResult:
    """What :func:`simulate` found for a valid schedule.

    * ``makespan``: time at which the last stage finishes.
    * ``bubble_fraction``: ``1 - total compute time / (num_stages * makespan)``.
    * ``buffers``: per stage, the peak number of buffers holding a live
      micro-batch at the same time (micro-batches in flight).
    * ``timeline``: per stage, ``(start, end, instruction)`` of each compute
      instruction (:data:`COMPUTE`), in execution order.
    * ``steps``: per stage, the steps the schedule produced.
    * ``waits``: per stage, the time it spent blocked (receives, collectives,
      the final wait for its sends).
    * ``semantics``: the communication semantics simulated.
    """

    num_stages: int
    micro_batches: int
    chunks: int
    makespan: float
    bubble_fraction: float
    buffers: tuple[int, ...]
    timeline: tuple[tuple[tuple[float, float, Instruction], ...], ...]
    steps: tuple[tuple[tuple[Instruction, ...], ...], ...]
    waits: tuple[float, ...] = ()
    semantics: str = "rendezvous"

    @property
    def spans(self) -> tuple[float, ...]:
        """Per stage, the time from the start of its first compute instruction to the end
        of its last: the stage's own iteration time, bubbles inside it included, without
        the pipeline's fill before it and the wait for the end-of-batch synchronisation
        after it (what the zero-bubble paper counts when batches follow one another
        without that synchronisation). ``0`` for a stage that computes nothing."""
        return tuple(events[-1][1] - events[0][0] if events else 0.0
                     for events in self.timeline)


def format_grid(result: SimulationResult) -> str:
    """An ASCII grid: one row per stage, one column per time unit.

    A cell shows the compute instruction running in that unit (``F3``, ``B3``,
    ``F3c1`` ...) or ``.`` when the stage is idle. Rows are labelled
    ``stage N |``; cells are padded to the same width and separated by a space.
    When instructions last a fraction of a unit (the zero-bubble schedules' B and W
    halves), a column is that fraction and a first line says so: no instruction is
    ever hidden behind another in one cell.
    """
    return _grid(result.timeline, result.makespan)


def _quantum(timeline) -> Fraction:
    """The largest column width (a unit fraction, at most 1) on which every start and
    end falls; ``0`` if none up to 1/16 does (then cells list what overlaps them)."""
    times = [Fraction(x).limit_denominator(1 << 20) for events in timeline
             for start, end, _ in events for x in (start, end)]
    denominator = 1
    for x in times:
        denominator = math.lcm(denominator, x.denominator)
    return Fraction(1, denominator) if denominator <= 16 else Fraction(0)


def _grid(timeline, makespan: float) -> str:
    q = _quantum(timeline)
    step = q or Fraction(1)
    columns = math.ceil(Fraction(makespan).limit_denominator(1 << 20) / step)
    rows = [_row(events, step, columns) for events in timeline]
    width = max((len(cell) for row in rows for cell in row), default=1)
    label = len(f"stage {len(rows) - 1}")
    lines = [f"{f'stage {s}':<{label}} | " + " ".join(c.ljust(width) for c in row).rstrip()
             for s, row in enumerate(rows)]
    if step != 1:
        lines.insert(0, f"(one column = {step} time unit)")
    return "\n".join(lines)


def _row(events, step: Fraction, columns: int) -> list[str]:
    """One stage's cells: column ``t`` (``[t * step, (t + 1) * step)``) lists, in timeline
    order, every instruction with ``start < (t + 1) * step`` and ``end > t * step`` (exact
    comparisons, as floats are exact fractions) — found per instruction from its own start
    and end, so a row costs its columns plus the columns its instructions cover."""
    cells: list[list[str]] = [[] for _ in range(columns)]
    for start, end, instruction in events:
        first = max(math.floor(Fraction(start) / step), 0)
        last = min(math.ceil(Fraction(end) / step), columns)  # one past the last column
        if first < last:
            text = str(instruction)
            for t in range(first, last):
                cells[t].append(text)
    return ["+".join(inside) or "." for inside in cells]


def _kind(instruction: Instruction) -> str:
    """What a point-to-point instruction carries: ``"activation"``, ``"grad"``, ``"skip"`` or
    ``"skip grad"``."""
    kind = role(type(instruction)).kind
    assert kind is not None, f"{instruction} is not a point-to-point instruction"  # callers' duty
    return kind


# What a built-in micro-batch instruction class does, by exact class (:attr:`Role.code`): the
# fast path's checks and entries branch on it (:mod:`~pipekernel.schedules.sim_fast`), the full
# simulation on the handler of the same class (:data:`_HANDLERS`). ``code <= FORWARD`` writes
# its buffer.
LOAD, RECV_ACT, FORWARD, SEND_ACT, RECV_GRAD, BACKWARD, B_INPUT, B_WEIGHT, SEND_GRAD, \
    SKIP_SEND, SKIP_RECV = range(11)
_CODES: dict[type, int] = {LoadMicroBatch: LOAD, RecvActivation: RECV_ACT, Forward: FORWARD,
          SendActivation: SEND_ACT, RecvGrad: RECV_GRAD, Backward: BACKWARD,
          BackwardInput: B_INPUT, BackwardWeight: B_WEIGHT, SendGrad: SEND_GRAD,
          SendSkip: SKIP_SEND, SendSkipGrad: SKIP_SEND, RecvSkip: SKIP_RECV,
          RecvSkipGrad: SKIP_RECV}


class Role(NamedTuple):
    """What the simulator needs to know about an instruction class (:func:`role`)."""

    instruction: bool
    micro_batch: bool
    p2p: bool
    send: bool
    compute: bool
    world: bool
    writes: bool
    kind: str | None
    handler: object
    paired: bool = False
    code: int | None = None


def _role(cls: type) -> Role:
    """The :class:`Role` of instruction class ``cls`` (by ``issubclass``, as the
    simulator's ``isinstance`` tests read it; ``handler`` and ``code`` by exact class),
    worked out once per class: the one table both paths read."""
    p2p = issubclass(cls, P2P)
    return Role(instruction=issubclass(cls, Instruction),
                micro_batch=issubclass(cls, MicroBatchInstruction), p2p=p2p,
                send=issubclass(cls, SENDS), compute=issubclass(cls, COMPUTE),
                world=issubclass(cls, WORLD_COLLECTIVES), writes=issubclass(cls, _WRITES),
                kind=_kind_of_class(cls) if p2p else None, handler=_HANDLERS.get(cls),
                paired=issubclass(cls, ForwardBackward), code=_CODES.get(cls))


#: :func:`_role`, worked out once per class. Bound with its type spelled out: mypy reads a frozen
#: dataclass's class object as unhashable (the generated ``__hash__`` seen unbound), so calls
#: through the bare ``lru_cache`` wrapper with an instruction class would not check.
role: Callable[[type], Role] = lru_cache(maxsize=None)(_role)


def _kind_of_class(cls: type) -> str:
    if issubclass(cls, SkipInstruction):
        return "skip" if issubclass(cls, (SendSkip, RecvSkip)) else "skip grad"
    return "activation" if issubclass(cls, (SendActivation, RecvActivation)) else "grad"


class _Where(tuple):
    """``"stage S step N (INSTRUCTION)"``, formatted only when a problem is reported:
    ``_Where((stage, index, instruction))`` (a tuple: made once per instruction run, at the
    cost of a tuple)."""

    __slots__ = ()
    stage = property(itemgetter(0))
    index = property(itemgetter(1))
    instruction = property(itemgetter(2))

    def __str__(self) -> str:
        return f"stage {self.stage} step {self.index} ({self.instruction})"

    __format__ = lambda self, spec: format(str(self), spec)  # noqa: E731


@dataclass(slots=True)
class _Progress:
    """What has happened to one micro-batch on one (stage, chunk)."""

    recv_act: int = 0
    forward: int = 0
    recv_grad: int = 0
    backward: int = 0
    b_input: int = 0
    b_weight: int = 0
    sent_act: int = 0


@dataclass(slots=True)
class _StageState:
    stream: list[tuple[int, Instruction]]
    num_buffers: int | None
    pc: int = 0
    clock: float = 0.0
    wait: float = 0.0
    slots: dict[int, tuple[int, int]] = field(default_factory=dict)  # buffer -> (chunk, mb)
    peak: int = 0
    timeline: list[tuple[float, float, Instruction]] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.pc >= len(self.stream)


class _World:
    """The world collectives of one batch, the rule both paths run: every stage enters each
    (``ReduceTiedGrads``, ``OptimizerStep``, then the end-of-batch loss all-reduce,
    :data:`_END`) in the same order, and it is released when its last member arrives, plus
    the costliest member's cost. ``mismatch(k, members)`` is called at a release whose members
    are not all the same collective; ``woken``, when given, gets the members of each release
    (the stages that may run again)."""

    __slots__ = ("size", "costs", "mismatch", "woken", "members", "released", "entered",
                 "arrived")

    def __init__(self, size: int, costs: Mapping[type, float], mismatch,
                 woken: list | None = None) -> None:
        self.size, self.costs, self.mismatch, self.woken = size, costs, mismatch, woken
        self.members: list[dict[int, tuple]] = []  # k -> {stage: (arrival, instruction, where)}
        self.released: list[float | None] = []  # k -> its release time, once released
        self.entered = [0] * size  # per stage, the collectives it is through
        self.arrived = [False] * size  # per stage, waiting in its next one

    def enter(self, stage: int, clock: float, instruction: object,
              where: object = None) -> float | None:
        """Enter (or keep waiting in) ``stage``'s next collective at ``clock``; its release
        time once it is released (the stage is then through it), else ``None``."""
        k = self.entered[stage]
        if not self.arrived[stage]:
            self.arrived[stage] = True
            if k == len(self.members):
                self.members.append({})
                self.released.append(None)
            members = self.members[k]
            members[stage] = (clock, instruction, where)
            if len(members) == self.size:
                self._release(k, members)
        when = self.released[k]
        if when is not None:
            self.arrived[stage] = False
            self.entered[stage] = k + 1
        return when

    def waiting(self, stage: int) -> bool:
        """Whether ``stage`` is inside a collective not yet released."""
        return self.arrived[stage] and self.entered[stage] < len(self.members)

    def _release(self, k: int, members: dict[int, tuple]) -> None:
        if len({type(i) if i is not _END else _END for _, i, _ in members.values()}) > 1:
            self.mismatch(k, members)
        cost = max((self.costs.get(type(i), 0.0) for _, i, _ in members.values()
                    if i is not _END), default=0.0)
        self.released[k] = max(t for t, _, _ in members.values()) + cost
        if self.woken is not None:
            self.woken += members  # every member waits in it but the last to arrive


def trains_of(programs) -> bool:
    """Whether a plan trains: its stages' programs' ``trains`` when they agree, else whether
    any of their instructions is a backward."""
    flags = {program.trains for program in programs}
    if len(flags) == 1:
        return flags.pop()
    return any(isinstance(i, (*_BACKWARDS, ForwardBackward))
               for program in programs for i in program.stream)


class _Simulation:
    """What the full and the fast path share: setup, instruction checks, buffers, costs,
    final checks. Each stage runs its :class:`~pipekernel.schedules.program.Program`."""

    semantics = "rendezvous"
    #: ``{(stage, chunk): {class: cost}}`` overriding ``costs`` for compute (simulate's
    #: ``stage_costs``), and ``{(stage, forward chunk, backward chunk): {ForwardBackward:
    #: cost}}`` pricing a stage's pairs of those chunks
    stage_costs: dict[tuple[int, ...], dict[type, float]] = {}
    #: ``{class: seconds}`` a transfer occupies its stage (simulate's ``host_costs``)
    host_costs: dict[type, float] = {}
    #: the skip edges (simulate's ``skips``), sorted
    skips: list[tuple[int, int]] = []

    def __init__(self, num_stages, micro_batches, chunks, costs, programs, placement) -> None:
        self.S, self.M, self.C = num_stages, micro_batches, chunks
        self.placement, self.programs = placement, programs
        self.costs = costs
        self.problems: list[str] = []
        self.steps = tuple(program.steps for program in programs)
        self.stages = [_StageState(self._flatten(s), program.num_buffers)
                       for s, program in enumerate(programs)]
        self.trains = trains_of(programs)
        self.progress: dict[tuple[int, int, int], _Progress] = {}
        self.deadlocked = False
        self._peers: dict[tuple[int, int, int], tuple[int, int] | None] = {}

    # -- setup -------------------------------------------------------------------------

    def _flatten(self, stage: int) -> list[tuple[int, Instruction]]:
        """``(step index, instruction)`` of the stage's program stream; an item that is not an
        instruction is reported (and then runs as nothing)."""
        program = self.programs[stage]
        stream = list(zip(program.step_of, program.stream))
        if not all(role(cls).instruction for cls in set(map(type, program.stream))):
            self.problems += [f"stage {stage} step {index}: {item!r} is not an Instruction"
                              for index, item in stream if not role(type(item)).instruction]
        return stream

    def _peer(self, stage: int, chunk: int, delta: int) -> tuple[int, int] | None:
        """(stage, chunk) of pipeline position ``p + delta``, or None past either end."""
        key = (stage, chunk, delta)
        if key not in self._peers:
            probe = SendActivation(0, 0, chunk) if delta > 0 else SendGrad(0, 0, chunk)
            self._peers[key] = peer_of(probe, stage, self.S, self.C, self.placement)
        return self._peers[key]

    def _peer_of(self, stage: int, i: MicroBatchInstruction) -> tuple[int, int] | None:
        if isinstance(i, SkipInstruction):
            if skip_edge_of(i, stage, self.S, self.placement) not in self.skips:
                return None
            return peer_of(i, stage, self.S, self.C, self.placement)
        return self._peer(stage, i.chunk, 1 if isinstance(i, (SendActivation, RecvGrad)) else -1)

    def _channel(self, stage: int, i: MicroBatchInstruction) -> object:
        """What a transfer is matched within: its kind, and a skip's edge."""
        if isinstance(i, SkipInstruction):
            return (_kind(i), skip_edge_of(i, stage, self.S, self.placement))
        return _kind(i)

    def _no_peer(self, where: _Where, i: MicroBatchInstruction) -> None:
        kind = _kind(i)
        if isinstance(i, SkipInstruction):
            producer, consumer = skip_edge_of(i, where.stage, self.S,
                                              self.placement)
            self.problems.append(f"{where}: no skip edge {producer} -> {consumer} was "
                                 f"declared (edges: {self.skips})")
            return
        if isinstance(i, SENDS):
            end = "last" if kind == "activation" else "first"
            self.problems.append(f"{where}: the {end} pipeline position has no peer to send "
                                 f"the {kind} to")
        else:
            end = "first" if kind == "activation" else "last"
            self.problems.append(f"{where}: the {end} pipeline position has no peer to "
                                 f"receive the {kind} from")

    @staticmethod
    def _where(stage: int, index: int, instruction: object) -> _Where:
        return _Where((stage, index, instruction))

    def _compute_cost(self, stage: int, instruction: Instruction) -> float:
        if isinstance(instruction, ForwardBackward):
            return sum(self._pair_costs(stage, instruction))
        table = self.stage_costs.get((stage, getattr(instruction, "chunk", 0)))
        if table is not None and type(instruction) in table:
            return table[type(instruction)]
        return self.costs.get(type(instruction), 0.0)

    def _pair_costs(self, stage: int, pair: ForwardBackward) -> tuple[float, float]:
        """What each half of ``pair`` occupies: its own cost, or the pair's cost split in
        the halves' ratio: ``stage_costs[(stage, forward chunk, backward chunk)]``'s
        ``ForwardBackward`` where given, else ``costs``' (when it names one)."""
        f, b = (self._compute_cost(stage, half) for half in pair.halves)
        table = self.stage_costs.get((stage, pair.forward.chunk, pair.backward.chunk))
        whole = table.get(ForwardBackward) if table is not None else None
        if whole is None:
            whole = self.costs.get(ForwardBackward)
        if whole is None or f + b == 0:
            return f, b
        return whole * f / (f + b), whole * b / (f + b)

    def _tick(self, stage: int, start: float, instruction: Instruction,
              cost: float | None = None) -> float:
        st = self.stages[stage]
        if isinstance(instruction, ForwardBackward) and cost is None:
            f, b = self._pair_costs(stage, instruction)
            st.timeline += [(start, start + f, instruction.forward),
                            (start + f, start + f + b, instruction.backward)]
            st.clock = start + f + b
            return st.clock
        end = start + (self._compute_cost(stage, instruction) if cost is None else cost)
        if isinstance(instruction, COMPUTE):
            st.timeline.append((start, end, instruction))
        st.clock = end
        return end

    def _in_range(self, stage: int, where: _Where, instruction: MicroBatchInstruction) -> bool:
        i, ok = instruction, True
        if not 0 <= i.micro_batch < self.M:
            self.problems.append(f"{where}: micro-batch {i.micro_batch} is outside 0..{self.M - 1}")
            ok = False
        if not 0 <= i.chunk < self.C:
            self.problems.append(f"{where}: chunk {i.chunk} is outside 0..{self.C - 1}")
            ok = False
        limit = self.stages[stage].num_buffers
        if limit is not None and not 0 <= i.buffer < limit:
            self.problems.append(f"{where}: buffer {i.buffer} is outside the {limit} buffer(s) "
                                 "num_buffers() declares")
        return ok

    # -- instruction semantics -----------------------------------------------------------

    def _run(self, stage: int, where: _Where, i: Instruction) -> None:
        if isinstance(i, ForwardBackward):  # its halves, in order, at the pair's place
            for half in i.halves:
                if self._in_range(stage, where, half):
                    self._run(stage, where, half)
            return
        if not isinstance(i, MicroBatchInstruction):
            return
        p = self.progress.setdefault((stage, i.chunk, i.micro_batch), _Progress())
        if isinstance(i, _WRITES):
            self._write_buffer(stage, where, i)
        handler = _HANDLERS.get(type(i))
        if handler is not None:
            handler(self, stage, where, i, p)

    def _on_recv_act(self, stage, where, i, p) -> None:
        p.recv_act += 1

    def _on_forward(self, stage, where, i, p) -> None:
        if self._peer(stage, i.chunk, -1) is not None and not p.recv_act:
            self.problems.append(f"{where}: forward before its RecvActivation")
        p.forward += 1
        if not self.trains and self._peer(stage, i.chunk, 1) is None:
            self._release(stage, i)

    def _on_send_act(self, stage, where, i, p) -> None:
        if not p.forward:
            self.problems.append(f"{where}: sends an activation before its Forward")
        self._read_buffer(stage, where, i)
        p.sent_act += 1
        if not self.trains:
            self._release(stage, i)

    def _on_recv_grad(self, stage, where, i, p) -> None:
        self._read_buffer(stage, where, i)
        p.recv_grad += 1

    def _on_backward(self, stage, where, i, p) -> None:
        self._check_backward_inputs(stage, where, i, p)
        if isinstance(i, Backward):
            p.backward += 1
        elif isinstance(i, BackwardInput):
            p.b_input += 1
        else:
            p.b_weight += 1
            if not p.b_input:
                self.problems.append(f"{where}: BackwardWeight before its BackwardInput")
        if p.backward or (p.b_input and p.b_weight):
            self._release(stage, i)

    def _check_backward_inputs(self, stage, where, i, p) -> None:
        if not self.trains:
            self.problems.append(f"{where}: backward in a schedule that does not train")
        if not p.forward:
            self.problems.append(f"{where}: backward before its Forward")
        if self._peer(stage, i.chunk, 1) is not None and not p.recv_grad:
            self.problems.append(f"{where}: backward before its RecvGrad")
        self._read_buffer(stage, where, i)

    def _on_send_grad(self, stage, where, i, p) -> None:
        if not (p.backward or p.b_input):
            self.problems.append(f"{where}: sends a gradient before its Backward")

    # -- buffers -------------------------------------------------------------------------

    def _write_buffer(self, stage: int, where: _Where, i: MicroBatchInstruction) -> None:
        st, owner = self.stages[stage], (i.chunk, i.micro_batch)
        held = st.slots.get(i.buffer)
        if held is not None and held != owner:
            until = "backward" if self.trains else "forward and send"
            self.problems.append(f"{where}: overwrites buffer {i.buffer}, which still holds "
                                 f"micro-batch {held[1]} chunk {held[0]} whose {until} has "
                                 "not finished")
        st.slots[i.buffer] = owner
        st.peak = max(st.peak, len(st.slots))

    def _read_buffer(self, stage: int, where: _Where, i: MicroBatchInstruction) -> None:
        held = self.stages[stage].slots.get(i.buffer)
        if held != (i.chunk, i.micro_batch):
            what = "is empty" if held is None else f"holds micro-batch {held[1]} chunk {held[0]}"
            self.problems.append(f"{where}: buffer {i.buffer} {what}")

    def _release(self, stage: int, i: MicroBatchInstruction) -> None:
        slots = self.stages[stage].slots
        if slots.get(i.buffer) == (i.chunk, i.micro_batch):
            del slots[i.buffer]

    # -- final checks --------------------------------------------------------------------

    def _grid_so_far(self) -> str:
        timeline = tuple(tuple(st.timeline) for st in self.stages)
        makespan = max((st.clock for st in self.stages), default=0.0)
        grid = _grid(timeline, makespan) if makespan else "(nothing ran)"
        return "\n    grid so far:\n" + "\n".join(f"      {row}" for row in grid.splitlines())

    def _check_micro_batches(self, only_excess: bool = False) -> None:
        for s in range(self.S):
            for c in range(self.C):
                for m in range(self.M):
                    self._check_micro_batch(s, c, m, only_excess)

    def _check_micro_batch(self, stage: int, chunk: int, m: int, only_excess: bool) -> None:
        p = self.progress.get((stage, chunk, m), _Progress())
        where = f"stage {stage} chunk {chunk} micro-batch {m}"
        if p.forward > 1 or (p.forward != 1 and not only_excess):
            self.problems.append(f"{where}: forwarded {p.forward} times, expected once")
        if not self.trains:
            return
        once = (p.backward, p.b_input, p.b_weight) in ((1, 0, 0), (0, 1, 1))
        excess = p.backward > 1 or p.b_input > 1 or p.b_weight > 1 or (
            p.backward and (p.b_input or p.b_weight))
        if excess or (not once and not only_excess):
            self.problems.append(f"{where}: backwarded {p.backward} times (plus {p.b_input} "
                                 f"BackwardInput, {p.b_weight} BackwardWeight), expected one "
                                 "Backward or one BackwardInput + one BackwardWeight")

    def makespan(self) -> float:
        return max(st.clock for st in self.stages)

    def result(self) -> SimulationResult:
        return self._result_of(self.makespan(), [st.timeline for st in self.stages],
                               [st.peak for st in self.stages],
                               [st.wait for st in self.stages])

    def _result_of(self, makespan: float, timeline: list, peaks: list,
                   waits: list) -> SimulationResult:
        """The result from per-stage timelines, buffer peaks and waits (the fast path's
        too: the bubble summed in the same order, so the same float)."""
        events = list(chain.from_iterable(timeline))
        # end - start of each, summed in the same order as a generator would (the same
        # float), with no Python frame per event
        busy = sum(map(sub, map(itemgetter(1), events), map(itemgetter(0), events)))
        bubble = 1.0 - busy / (self.S * makespan) if makespan > 0 else 0.0
        return SimulationResult(
            num_stages=self.S, micro_batches=self.M, chunks=self.C, makespan=makespan,
            bubble_fraction=bubble, buffers=tuple(peaks), timeline=tuple(map(tuple, timeline)),
            steps=self.steps, waits=tuple(waits), semantics=self.semantics)


_HANDLERS: dict[type, Callable[..., None]] = {
    RecvActivation: _Simulation._on_recv_act,
    Forward: _Simulation._on_forward,
    SendActivation: _Simulation._on_send_act,
    RecvGrad: _Simulation._on_recv_grad,
    Backward: _Simulation._on_backward,
    BackwardInput: _Simulation._on_backward,
    BackwardWeight: _Simulation._on_backward,
    SendGrad: _Simulation._on_send_grad,
}
