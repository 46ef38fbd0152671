"""Run every stage's schedule together, without a runtime (layer 0: no torch).

:func:`simulate` executes all stages' instruction streams at once, event-driven,
and proves that a schedule

* matches every send with a receive, with the same kind, micro-batch and chunk,
  and leaves no message unreceived;
* never deadlocks under the chosen communication semantics;
* forwards every micro-batch exactly once per (stage, chunk) and, when it
  trains, backwards it exactly once (``Backward``, or ``BackwardInput`` then
  ``BackwardWeight``) after its forward and, except at the last pipeline
  position, after its ``RecvGrad``;
* never overwrites a buffer that still holds a live micro-batch (until its
  backward when training; until its forward and send for inference).

Two communication semantics:

``"rendezvous"`` (the default; the strictest any transport has: NCCL, and gloo
for large messages — see "Communication model" in the design). Each stage runs
the :class:`~pipekernel.schedules.comm.CommPlan` that the runtime runs,
computed by :func:`~pipekernel.schedules.comm.plan_communication` (or by the
``posting=`` hook):

* before ``stream[i]`` runs, the group ``posts[i]`` is posted (non-blocking); a
  receive instruction waits for its own transfer to complete; a send never
  blocks the poster's compute;
* matching is FIFO per ordered pair of stages and *lane* (``plan.lanes``, the
  transport tag of the transfer's channel, :func:`~pipekernel.schedules.comm.lane_of`),
  and tagless within a lane: the k-th send from A to B on a lane matches the
  k-th receive B posted from A on that lane, whatever it says. A plan without
  lanes puts all of a pair's traffic on one lane (a transport without tags).
  A pair that disagrees (kind, micro-batch, chunk) is reported with both
  instructions;
* a transfer completes only when both of its operations are *active*. A
  group's operations to one peer on one lane form one *unit*; at a rank, a
  unit becomes active only when every earlier unit of that rank to that peer
  on that lane has completed (a lane's operations complete in posting order;
  operations posted together progress together). Units to different peers or
  on different lanes are independent;
* a local hand-off (``plan.local[i]``, a stage that is its own peer) completes
  at once; its receive needs the send to have run;
* ``ReduceTiedGrads`` and ``OptimizerStep`` are world collectives (every stage
  must enter them, in the same order), as is the implicit loss all-reduce that
  ends every batch (after the stage waited for its sends). ``ReduceGrads`` is
  a data-parallel collective: the replicas run the same stream, so it is a
  blocking point without a cross-stage dependency. A stage in a collective
  runs nothing further, but what it posted still progresses;
* timing: a transfer completes at ``max(post times, unit starts)`` plus the
  costs of its send and receive classes; compute starts when its inputs are
  there. A deadlock is reported with the stuck stages, what each waits for,
  and the wait-for *cycle* through units, peers and collectives.

``"buffered"`` (the old, lenient model): sends never block and are buffered
per channel ``(sender stage, receiver stage, "activation" | "grad")``, a
receive blocks until its message was sent, collectives are free.

Virtual stages: pipeline positions and peers come from the schedule's
``placement`` (:mod:`pipekernel.schedules.placement`).

Skip connections: with ``skips=[(producer, consumer), ...]`` (pipeline positions)
each stage's steps get the skip transfers the engine inserts
(:func:`~pipekernel.schedules.skips.add_skip_transfers`) and the plan gives each
edge its lanes; they are matched, posted and checked like the activations and
gradients (local hand-offs included). An edge whose consumer does not come after
its producer is rejected before simulating.

All problems are collected and raised as one :class:`ScheduleError`.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from pipekernel.errors import ConfigError, ScheduleError
from pipekernel.instructions import (
    Backward, BackwardInput, BackwardWeight, Forward, Instruction, LoadMicroBatch,
    MicroBatchInstruction, OptimizerStep, RecvActivation, RecvGrad, RecvSkip, RecvSkipGrad,
    ReduceTiedGrads, SendActivation, SendGrad, SendSkip, SendSkipGrad, SkipInstruction,
)
from pipekernel.schedules.comm import CommPlan, peer_of, plan_communication
from pipekernel.schedules.placement import check_placement
from pipekernel.schedules.skips import add_skip_transfers, check_skip_edges, skip_edge_of

__all__ = ["simulate", "SimulationResult", "format_grid", "COMPUTE", "DEFAULT_COSTS",
           "SEMANTICS", "WORLD_COLLECTIVES"]

#: Instruction classes that count as compute (in the timeline and the bubble).
COMPUTE = (Forward, Backward, BackwardInput, BackwardWeight)
#: Unit costs; every instruction class not listed costs 0.
DEFAULT_COSTS: Mapping[type, float] = {cls: 1.0 for cls in COMPUTE}
#: Communication semantics :func:`simulate` understands.
SEMANTICS = ("rendezvous", "buffered")
#: Instructions every stage must enter together under rendezvous semantics.
WORLD_COLLECTIVES = (ReduceTiedGrads, OptimizerStep)

_BACKWARDS = (Backward, BackwardInput, BackwardWeight)
_WRITES = (LoadMicroBatch, RecvActivation, Forward)
_SENDS = (SendActivation, SendGrad, SendSkip, SendSkipGrad)
_RECVS = (RecvActivation, RecvGrad, RecvSkip, RecvSkipGrad)
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


def simulate(schedule: Callable[..., object], num_stages: int, micro_batches: int,
             chunks: int = 1, costs: Mapping[type, float] | None = None,
             semantics: str = "rendezvous",
             posting: Callable[..., CommPlan] | None = None,
             stage_costs: Mapping[tuple[int, int], Mapping[type, float]] | None = None,
             skips: Sequence[Sequence[int]] = (),
             host_costs: Mapping[type, float] | None = None) -> SimulationResult:
    """Simulate ``schedule`` on every stage of a pipeline and check it.

    :param schedule: a :class:`~pipekernel.schedules.base.Schedule` subclass, or
        any callable ``(num_stages, stage, micro_batches, chunks)`` returning an
        object with ``steps()`` (and optionally ``trains``, ``num_buffers()``).
        Without ``trains``, the schedule trains if it emits any backward. Its
        ``placement`` attribute (default ``"loop"``) places the chunks.
    :param costs: ``{instruction class: duration}`` overriding
        :data:`DEFAULT_COSTS` (compute 1, everything else 0). Under rendezvous,
        the costs of a send's and a receive's classes add up to the duration of
        their transfer and do not occupy either stage.
    :param stage_costs: ``{(stage, chunk): {instruction class: duration}}``: compute
        costs of one stage's chunk (e.g. measured, for a partition whose stages
        differ), overriding ``costs`` for the classes listed there.
    :param semantics: ``"rendezvous"`` (default) or ``"buffered"``; see the
        module docstring.
    :param posting: rendezvous only: the function that computes each stage's
        :class:`~pipekernel.schedules.comm.CommPlan`, called like
        :func:`~pipekernel.schedules.comm.plan_communication` (the default, the
        plan the runtime executes) — to check another posting policy.
    :param skips: skip edges ``(producer position, consumer position)``
        (:mod:`pipekernel.schedules.skips`): each stage's steps get the skip
        transfers the engine inserts, and the plan their lanes, before simulating.
    :param host_costs: rendezvous only: ``{send or receive class: seconds}`` the stage
        itself spends on a transfer to or from another stage (packing and posting a
        send, unpacking a receive once its data is there): unlike ``costs`` they
        occupy the stage, delaying what it runs next. Local hand-offs cost nothing.
    :raises ConfigError: for invalid sizes, costs, semantics or placement.
    :raises ScheduleError: for a skip edge whose consumer does not come after its
        producer (or outside the pipeline); then listing every problem found
        (mismatched sends and receives, deadlock with the stuck stages, the cycle and
        the grid so far, missing or repeated forwards/backwards, overwritten live buffers).
    """
    _check_sizes(num_stages, micro_batches, chunks)
    if semantics not in SEMANTICS:
        raise ConfigError(f"simulate: unknown semantics {semantics!r}",
                          hint=f"use one of {', '.join(map(repr, SEMANTICS))}")
    if host_costs and semantics != "rendezvous":
        raise ConfigError("simulate: host_costs= only applies to semantics='rendezvous'",
                          hint="drop host_costs= or use semantics='rendezvous'")
    if posting is not None and semantics != "rendezvous":
        raise ConfigError("simulate: posting= only applies to semantics='rendezvous'",
                          hint="drop posting= or use semantics='rendezvous'")
    objects = [schedule(num_stages, s, micro_batches, chunks) for s in range(num_stages)]
    placement = getattr(schedule, "placement", None) or getattr(objects[0], "placement", "loop")
    check_placement(placement, chunks)
    edges = check_skip_edges(skips, num_stages * chunks)
    if edges:
        objects = [_WithSkips(obj, s, num_stages, chunks, placement, edges)
                   for s, obj in enumerate(objects)]
    cls = _Rendezvous if semantics == "rendezvous" else _Buffered
    sim = cls(num_stages, micro_batches, chunks, _cost_table(costs), objects, placement)
    sim.skips = edges
    if posting is not None:
        sim.posting = posting
    if stage_costs:
        sim.stage_costs = {key: _cost_table(table, base={}) for key, table in stage_costs.items()}
    if host_costs:
        sim.host_costs = _cost_table(host_costs, base={})
    sim.run()
    if sim.problems:
        raise _error(schedule, num_stages, micro_batches, chunks, sim.problems, semantics)
    return sim.result()


class _WithSkips:
    """A stage's schedule object whose ``steps()`` carry the skip transfers."""

    def __init__(self, obj, stage, num_stages, chunks, placement, edges) -> None:
        self._obj, self._args = obj, (stage, num_stages, chunks, placement, edges)

    def __getattr__(self, name):
        return getattr(self._obj, name)

    def steps(self):
        stage, num_stages, chunks, placement, edges = self._args
        return add_skip_transfers(self._obj.steps(), stage=stage, num_stages=num_stages,
                                  chunks=chunks, placement=placement, edges=edges)


def format_grid(result: SimulationResult) -> str:
    """An ASCII grid: one row per stage, one column per time unit.

    A cell shows the compute instruction running in that unit (``F3``, ``B3``,
    ``F3c1`` ...) or ``.`` when the stage is idle. Rows are labelled
    ``stage N |``; cells are padded to the same width and separated by a space.
    """
    return _grid(result.timeline, result.makespan)


def _grid(timeline, makespan: float) -> str:
    columns = math.ceil(makespan)
    rows = [[_cell(events, t) for t in range(columns)] for events in timeline]
    width = max((len(cell) for row in rows for cell in row), default=1)
    label = len(f"stage {len(rows) - 1}")
    return "\n".join(f"{f'stage {s}':<{label}} | " + " ".join(c.ljust(width) for c in row).rstrip()
                     for s, row in enumerate(rows))


def _cell(events, t: int) -> str:
    for start, end, instruction in events:
        if start < t + 1 and end > t:
            return str(instruction)
    return "."


def _check_sizes(num_stages: int, micro_batches: int, chunks: int) -> None:
    for what, value in (("num_stages", num_stages), ("micro_batches", micro_batches),
                        ("chunks", chunks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"simulate: {what} must be an int >= 1, got {value!r}",
                              hint=f"pass {what}=1 or more")


def _cost_table(costs: Mapping[type, float] | None,
                base: Mapping[type, float] = DEFAULT_COSTS) -> dict[type, float]:
    table = dict(base)
    for cls, cost in (costs or {}).items():
        if not (isinstance(cls, type) and issubclass(cls, Instruction)):
            raise ConfigError(f"simulate: cost key {cls!r} is not an instruction class",
                              hint="key costs by class, e.g. {Forward: 1.0, Backward: 2.0}")
        if not isinstance(cost, (int, float)) or cost < 0:
            raise ConfigError(f"simulate: cost of {cls.__name__} must be a number >= 0, "
                              f"got {cost!r}", hint="use non-negative durations")
        table[cls] = float(cost)
    return table


def _error(schedule, num_stages, micro_batches, chunks, problems, semantics) -> ScheduleError:
    name = getattr(schedule, "name", "") or getattr(schedule, "__name__", repr(schedule))
    lines = "\n".join(f"  - {p}" for p in problems)
    hint = ("fix the schedule's steps(); every send needs a matching receive in the same "
            "order, and a buffer may be reused only after its micro-batch is done")
    if semantics == "rendezvous":
        hint += ("; a send completes only when its receive is posted and every earlier "
                 "transfer between the two stages has completed")
    return ScheduleError(
        f"schedule {name!r} is invalid for {num_stages} stage(s) x {micro_batches} "
        f"micro-batch(es) x {chunks} chunk(s) ({semantics} sends): {len(problems)} "
        f"problem(s):\n{lines}", hint=hint)


def _kind(instruction: Instruction) -> str:
    if isinstance(instruction, SkipInstruction):
        return "skip" if isinstance(instruction, (SendSkip, RecvSkip)) else "skip grad"
    return "activation" if isinstance(instruction, (SendActivation, RecvActivation)) else "grad"


class _Where:
    """``"stage S step N (INSTRUCTION)"``, formatted only when a problem is reported."""

    __slots__ = ("stage", "index", "instruction")

    def __init__(self, stage: int, index: int, instruction: object) -> None:
        self.stage, self.index, self.instruction = stage, index, instruction

    def __str__(self) -> str:
        return f"stage {self.stage} step {self.index} ({self.instruction})"

    __format__ = lambda self, spec: format(str(self), spec)  # noqa: E731


@dataclass
class _Progress:
    """What has happened to one micro-batch on one (stage, chunk)."""

    recv_act: int = 0
    forward: int = 0
    recv_grad: int = 0
    backward: int = 0
    b_input: int = 0
    b_weight: int = 0
    sent_act: int = 0


@dataclass
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


class _Simulation:
    """What both semantics share: setup, instruction checks, buffers, final checks."""

    semantics = ""
    #: ``{(stage, chunk): {class: cost}}`` overriding ``costs`` for compute (simulate's ``stage_costs``)
    stage_costs: dict[tuple[int, int], dict[type, float]] = {}
    #: ``{class: seconds}`` a transfer occupies its stage (simulate's ``host_costs``)
    host_costs: dict[type, float] = {}
    #: the skip edges (simulate's ``skips``), sorted
    skips: list[tuple[int, int]] = []

    def __init__(self, num_stages, micro_batches, chunks, costs, objects, placement) -> None:
        self.S, self.M, self.C = num_stages, micro_batches, chunks
        self.placement = placement
        self.costs, self.problems = costs, []
        self.steps = tuple(self._steps_of(obj, s) for s, obj in enumerate(objects))
        self.stages = [_StageState(self._flatten(s), self._num_buffers(obj))
                       for s, obj in enumerate(objects)]
        self.trains = self._trains(objects)
        self.progress: dict[tuple[int, int, int], _Progress] = {}
        self.deadlocked = False
        self._peers: dict[tuple[int, int, int], tuple[int, int] | None] = {}

    # -- setup -------------------------------------------------------------------------

    def _steps_of(self, obj, stage: int) -> tuple[tuple[Instruction, ...], ...]:
        steps = getattr(obj, "steps", None)
        if not callable(steps):
            raise ScheduleError(f"schedule object {obj!r} for stage {stage} has no steps()",
                                hint="return a Schedule (or an object with steps())",
                                stage=stage)
        return tuple(tuple(step) for step in steps())

    def _flatten(self, stage: int) -> list[tuple[int, Instruction]]:
        stream = []
        for index, step in enumerate(self.steps[stage]):
            for item in step:
                if isinstance(item, Instruction):
                    stream.append((index, item))
                else:
                    self.problems.append(f"stage {stage} step {index}: {item!r} is not an "
                                         "Instruction")
        return stream

    @staticmethod
    def _num_buffers(obj) -> int | None:
        method = getattr(obj, "num_buffers", None)
        return method() if callable(method) else None

    def _trains(self, objects) -> bool:
        flags = {getattr(obj, "trains", None) for obj in objects}
        if flags <= {True, False} and len(flags) == 1:
            return flags.pop()
        return any(isinstance(i, _BACKWARDS) for st in self.stages for _, i in st.stream)

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

    def _no_peer(self, where: str, i: MicroBatchInstruction) -> None:
        kind = _kind(i)
        if isinstance(i, SkipInstruction):
            producer, consumer = skip_edge_of(i, where.stage, self.S,
                                              self.placement)
            self.problems.append(f"{where}: no skip edge {producer} -> {consumer} was "
                                 f"declared (edges: {self.skips})")
            return
        if isinstance(i, _SENDS):
            end = "last" if kind == "activation" else "first"
            self.problems.append(f"{where}: the {end} pipeline position has no peer to send "
                                 f"the {kind} to")
        else:
            end = "first" if kind == "activation" else "last"
            self.problems.append(f"{where}: the {end} pipeline position has no peer to "
                                 f"receive the {kind} from")

    @staticmethod
    def _where(stage: int, index: int, instruction: object) -> _Where:
        return _Where(stage, index, instruction)

    def _compute_cost(self, stage: int, instruction: Instruction) -> float:
        table = self.stage_costs.get((stage, getattr(instruction, "chunk", 0)))
        if table is not None and type(instruction) in table:
            return table[type(instruction)]
        return self.costs.get(type(instruction), 0.0)

    def _tick(self, stage: int, start: float, instruction: Instruction,
              cost: float | None = None) -> float:
        st = self.stages[stage]
        end = start + (self._compute_cost(stage, instruction) if cost is None else cost)
        if isinstance(instruction, COMPUTE):
            st.timeline.append((start, end, instruction))
        st.clock = end
        return end

    def _in_range(self, stage: int, where: str, instruction: MicroBatchInstruction) -> bool:
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

    def _run(self, stage: int, where: str, i: Instruction) -> None:
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

    def _write_buffer(self, stage: int, where: str, i: MicroBatchInstruction) -> None:
        st, owner = self.stages[stage], (i.chunk, i.micro_batch)
        held = st.slots.get(i.buffer)
        if held is not None and held != owner:
            until = "backward" if self.trains else "forward and send"
            self.problems.append(f"{where}: overwrites buffer {i.buffer}, which still holds "
                                 f"micro-batch {held[1]} chunk {held[0]} whose {until} has "
                                 "not finished")
        st.slots[i.buffer] = owner
        st.peak = max(st.peak, len(st.slots))

    def _read_buffer(self, stage: int, where: str, i: MicroBatchInstruction) -> None:
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
        makespan = self.makespan()
        busy = sum(end - start for st in self.stages for start, end, _ in st.timeline)
        bubble = 1.0 - busy / (self.S * makespan) if makespan > 0 else 0.0
        return SimulationResult(
            num_stages=self.S, micro_batches=self.M, chunks=self.C, makespan=makespan,
            bubble_fraction=bubble, buffers=tuple(st.peak for st in self.stages),
            timeline=tuple(tuple(st.timeline) for st in self.stages), steps=self.steps,
            waits=tuple(st.wait for st in self.stages), semantics=self.semantics)


_HANDLERS = {
    RecvActivation: _Simulation._on_recv_act,
    Forward: _Simulation._on_forward,
    SendActivation: _Simulation._on_send_act,
    RecvGrad: _Simulation._on_recv_grad,
    Backward: _Simulation._on_backward,
    BackwardInput: _Simulation._on_backward,
    BackwardWeight: _Simulation._on_backward,
    SendGrad: _Simulation._on_send_grad,
}


# == buffered: sends never block ==========================================================

class _Buffered(_Simulation):
    """The lenient model: a send is buffered at once, a receive waits for its message."""

    semantics = "buffered"

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.channels: dict[tuple[int, int, str], deque] = {}

    def run(self) -> None:
        """Advance every stage until all finish or none can progress."""
        while not all(st.done for st in self.stages):
            moved = [self._advance(s) for s in range(self.S)]
            if not any(moved):
                self._report_deadlock()
                return
        self._check_complete()

    def _advance(self, stage: int) -> bool:
        """Run ``stage`` until it blocks or finishes; ``True`` if it executed anything."""
        st, moved = self.stages[stage], False
        while not st.done:
            index, instruction = st.stream[st.pc]
            if not self._execute(stage, index, instruction):
                break
            st.pc, moved = st.pc + 1, True
        return moved

    def _execute(self, stage: int, index: int, instruction: Instruction) -> bool:
        """Execute one instruction; ``False`` if it is a receive that must wait."""
        where = self._where(stage, index, instruction)
        if isinstance(instruction, MicroBatchInstruction) and not self._in_range(
                stage, where, instruction):
            return True
        if isinstance(instruction, _RECVS):
            return self._receive(stage, where, instruction)
        start = self.stages[stage].clock
        if isinstance(instruction, _SENDS):
            self._send(stage, where, instruction)
        self._run(stage, where, instruction)
        self._tick(stage, start, instruction)
        return True

    def _send(self, stage: int, where: str, i: MicroBatchInstruction) -> None:
        peer = self._peer_of(stage, i)
        if peer is None:
            self._no_peer(where, i)
            return
        queue = self.channels.setdefault((stage, peer[0], self._channel(stage, i)), deque())
        cost = self.costs.get(type(i), 0.0)
        queue.append((i.micro_batch, peer[1], self.stages[stage].clock + cost, where))

    def _receive(self, stage: int, where: str, i: MicroBatchInstruction) -> bool:
        kind, peer = _kind(i), self._peer_of(stage, i)
        if peer is None:
            self._no_peer(where, i)
            return True
        queue = self.channels.get((peer[0], stage, self._channel(stage, i)))
        if not queue:
            return False
        micro_batch, chunk, posted, sender = queue.popleft()
        if (micro_batch, chunk) != (i.micro_batch, i.chunk):
            self.problems.append(f"{where}: mismatched {kind}: the next message on channel "
                                 f"stage {peer[0]} -> stage {stage} is micro-batch {micro_batch} "
                                 f"chunk {chunk}, sent by {sender}")
        st = self.stages[stage]
        start = max(st.clock, posted)
        st.wait += start - st.clock
        self._run(stage, where, i)
        self._tick(stage, start, i)
        return True

    def _report_deadlock(self) -> None:
        self.deadlocked = True
        lines = [self._where_stuck(s) for s in range(self.S)]
        stuck = [s for s in range(self.S) if not self.stages[s].done]
        self.problems.append(
            f"deadlock: stages {stuck} cannot progress:\n"
            + "\n".join(f"      {line}" for line in lines) + self._grid_so_far())

    def _where_stuck(self, stage: int) -> str:
        st = self.stages[stage]
        if st.done:
            return f"stage {stage}: finished"
        index, i = st.stream[st.pc]
        kind, peer = _kind(i), self._peer_of(stage, i)
        return (f"stage {stage}: blocked at step {index} on {i}, waiting for stage {peer[0]} "
                f"to send the {kind} of micro-batch {i.micro_batch} chunk {i.chunk}")

    def _check_complete(self) -> None:
        for (src, dst, channel), queue in self.channels.items():
            kind = channel if isinstance(channel, str) else channel[0]
            for micro_batch, chunk, _, sender in queue:
                self.problems.append(f"{sender}: the {kind} of micro-batch {micro_batch} sent to "
                                     f"stage {dst} chunk {chunk} is never received")
        self._check_micro_batches()


# == rendezvous: the CommPlan under NCCL rules ============================================

class _Op:
    """One posted (or to be posted) point-to-point operation."""

    __slots__ = ("rank", "peer", "lane", "index", "step", "ins", "send", "mate", "unit", "done")

    def __init__(self, rank: int, peer: int, lane: int | None, index: int, step: int,
                 ins: Instruction) -> None:
        self.rank, self.peer, self.index, self.step, self.ins = rank, peer, index, step, ins
        self.lane = lane
        self.send = isinstance(ins, _SENDS)
        self.mate: _Op | None = None
        self.unit: _Unit | None = None  # set when posted
        self.done: float | None = None

    def name(self) -> str:
        return f"stage {self.rank}'s {self.ins}"

    def where(self) -> str:
        return f"stage {self.rank} step {self.step} ({self.ins})"


class _Unit:
    """A group's operations from one rank to one peer: they progress together."""

    __slots__ = ("ops", "post", "start", "end", "left", "active", "queue")

    def __init__(self, ops: list[_Op], post: float, queue: deque) -> None:
        self.ops, self.post, self.queue = ops, post, queue
        self.start, self.end, self.left, self.active = post, post, len(ops), False


class _Rendezvous(_Simulation):
    """Each stage runs its CommPlan; sends rendezvous, pairs complete in order."""

    semantics = "rendezvous"
    posting: Callable[..., CommPlan] = staticmethod(plan_communication)

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.local: dict[tuple[int, object], deque] = {}
        self.world: list[dict[int, tuple[float, object, str]]] = []  # k -> {stage: arrival}
        self.released: list[float | None] = []

    # -- setup: plans, static matching -------------------------------------------------

    def _setup(self) -> None:
        n_stages = self.S
        self.plans: list[CommPlan] = []
        # stage -> stream index -> [((peer, lane), ops to it posted there)]
        self.groups: list[list[list[tuple[int, list[_Op]]]]] = []
        self.op_at: list[dict[int, _Op]] = []
        self.queues: list[dict[int, deque]] = [dict() for _ in range(n_stages)]
        self.last_end: list[dict[int, float]] = [dict() for _ in range(n_stages)]
        self.pending = [0] * n_stages  # posted, not yet completed ops per stage
        self.coll = [0] * n_stages  # world collectives entered so far
        self.arrived = [False] * n_stages  # entered the collective at pc
        self.flushed = [False] * n_stages
        self.finished = [False] * n_stages
        self.posted_upto = [-1] * n_stages
        self.end_time = [0.0] * n_stages
        sends: dict[tuple[int, int], list[_Op]] = {}
        recvs: dict[tuple[int, int], list[_Op]] = {}
        for s, st in enumerate(self.stages):
            steps = [[i for i in step if isinstance(i, Instruction)] for step in self.steps[s]]
            extra = {"skips": self.skips} if self.skips else {}
            plan = self.posting(steps, stage=s, num_stages=self.S, chunks=self.C,
                                placement=self.placement, trains=self.trains, **extra)
            self.plans.append(plan)
            groups, op_at = self._place_posts(s, plan)
            self.groups.append(groups)
            self.op_at.append(op_at)
            for group in groups:
                for op in (op for _, ops in group for op in ops):
                    key = ((op.rank, op.peer, op.lane) if op.send
                           else (op.peer, op.rank, op.lane))
                    (sends if op.send else recvs).setdefault(key, []).append(op)
        for key in sorted(set(sends) | set(recvs), key=repr):
            out, into = sends.get(key, []), recvs.get(key, [])
            for send, recv in zip(out, into):
                send.mate, recv.mate = recv, send
                self._check_pair(send, recv)
            for send in out[len(into):]:
                self.problems.append(
                    f"{send.where()}: the {_kind(send.ins)} of micro-batch "
                    f"{send.ins.micro_batch} sent to stage {send.peer} chunk "
                    f"{self._peer_of(send.rank, send.ins)[1]} is never received "
                    f"(stage {send.peer} posts only {len(into)} receive(s) from stage "
                    f"{send.rank})")
            for recv in into[len(out):]:
                self.problems.append(
                    f"{recv.where()}: nothing is ever sent to it (stage {recv.peer} posts only "
                    f"{len(out)} send(s) to stage {recv.rank})")

    def _place_posts(self, stage: int, plan: CommPlan) -> tuple[list[list[_Op]], dict[int, _Op]]:
        """Turn ``plan.posts`` into ops by stream index, checking the plan itself."""
        stream, n = self.stages[stage].stream, len(self.stages[stage].stream)
        if len(plan.stream) != n or len(plan.posts) != n or len(plan.peers) != n:
            raise ScheduleError(f"stage {stage}: the posting plan covers {len(plan.stream)} "
                                f"instruction(s), the stream has {n}",
                                hint="a posting= function must plan the steps it is given",
                                stage=stage)
        p2p = _SENDS + _RECVS
        remote = [i for i, (_, ins) in enumerate(stream)
                  if isinstance(ins, p2p) and 0 <= ins.chunk < self.C
                  and plan.peers[i] is not None and not plan.local[i]]
        lanes = tuple(getattr(plan, "lanes", ()) or ())

        def lane(i: int) -> int | None:
            return lanes[i] if len(lanes) == n else None

        by_id: dict[int, list[int]] = {}
        for i in remote:
            by_id.setdefault(id(stream[i][1]), []).append(i)
        groups: dict[int, list[_Op]] = {}
        op_at: dict[int, _Op] = {}
        for g, group in enumerate(plan.posts):
            for ins in group:
                candidates = [i for i in by_id.get(id(ins), ()) if i not in op_at]
                at = next((i for i in candidates if i >= g), None)
                if at is None:
                    what = ("is not a point-to-point instruction to another stage"
                            if not candidates else "runs before that")
                    self.problems.append(f"stage {stage}: the posting plan posts {ins} at "
                                         f"stream index {g}, but it {what}")
                    continue
                if isinstance(ins, _SENDS) and at != g:
                    self.problems.append(f"{self._where(stage, stream[at][0], ins)}: the "
                                         "posting plan posts a send before its data exists")
                op = _Op(stage, plan.peers[at][0], lane(at), at, stream[at][0], ins)
                op_at[at] = op
                groups.setdefault(g, []).append(op)
        for i in remote:
            if i not in op_at:  # a plan that forgot it: post it at its index
                ins = stream[i][1]
                self.problems.append(f"{self._where(stage, stream[i][0], ins)}: the posting "
                                     "plan never posts it")
                op = _Op(stage, plan.peers[i][0], lane(i), i, stream[i][0], ins)
                op_at[i] = op
                groups.setdefault(i, []).append(op)
        split: list = [()] * n
        for g, group in groups.items():
            group.sort(key=lambda op: op.index)
            by_peer: dict[tuple[int, int | None], list[_Op]] = {}
            for op in group:
                by_peer.setdefault((op.peer, op.lane), []).append(op)
            split[g] = list(by_peer.items())
        return split, op_at

    def _check_pair(self, send: _Op, recv: _Op) -> None:
        s, r = send.ins, recv.ins
        target = self._peer_of(send.rank, s)
        same_kind = _kind(s) == _kind(r)
        if same_kind and s.micro_batch == r.micro_batch and target[1] == r.chunk:
            return
        source = self._peer_of(recv.rank, r)
        self.problems.append(
            f"{recv.where()}: mismatched {_kind(r)}: transfers from stage {send.rank} to stage "
            f"{recv.rank} match in posting order on their lane, whatever they say, and this "
            f"receive "
            f"(of micro-batch {r.micro_batch} chunk {r.chunk}, from chunk {source[1]}) "
            f"meets {send.where()}, which sends the {_kind(s)} of micro-batch "
            f"{s.micro_batch} chunk {target[1]}")

    # -- transfers ---------------------------------------------------------------------

    def _post(self, stage: int, at: float) -> None:
        """Post the group planned at the current instruction."""
        todo: list[_Op] = []
        for channel, ops in self.groups[stage][self.stages[stage].pc]:
            queue = self.queues[stage].setdefault(channel, deque())
            unit = _Unit(ops, at, queue)
            for op in ops:
                op.unit = unit
            self.pending[stage] += len(ops)
            queue.append(unit)
            if len(queue) == 1:
                self._activate(stage, channel, unit)
                todo.extend(ops)
        self._progress(todo)

    def _activate(self, stage: int, channel: tuple, unit: _Unit) -> None:
        """``unit`` heads its ``(peer, lane)`` queue: it may progress from now on."""
        unit.active = True
        unit.start = max(unit.post, self.last_end[stage].get(channel, 0.0))

    def _progress(self, todo: list[_Op]) -> None:
        """Complete every transfer that can complete now, and what that unblocks."""
        while todo:
            op = todo.pop()
            mate = op.mate
            if op.done is not None or mate is None or mate.unit is None:
                continue
            if not (op.unit.active and mate.unit.active):
                continue
            send, recv = (op, mate) if op.send else (mate, op)
            t = (max(op.unit.start, mate.unit.start) + self.costs.get(type(send.ins), 0.0)
                 + self.costs.get(type(recv.ins), 0.0))
            op.done = mate.done = t
            for o in (op, mate):
                unit = o.unit
                self.pending[o.rank] -= 1
                unit.end = max(unit.end, t)
                unit.left -= 1
                if unit.left == 0:
                    queue = unit.queue
                    queue.popleft()
                    self.last_end[o.rank][(o.peer, o.lane)] = unit.end
                    if queue:
                        following = queue[0]
                        self._activate(o.rank, (o.peer, o.lane), following)
                        todo.extend(following.ops)

    # -- the event loop ----------------------------------------------------------------

    def run(self) -> None:
        self._setup()
        while not all(self.finished):
            moved = False
            for s in range(self.S):
                if not self.finished[s] and self._advance(s):
                    moved = True
            if not moved:
                self._report_deadlock()
                return
        self._check_complete()

    def _advance(self, stage: int) -> bool:
        """Run ``stage`` until it blocks or finishes; ``True`` if anything happened."""
        st, moved = self.stages[stage], False
        stream, n, groups = st.stream, len(st.stream), self.groups[stage]
        while st.pc < n:
            pc = st.pc
            if self.posted_upto[stage] < pc:
                self.posted_upto[stage] = pc
                if self.host_costs:  # a send is packed before its group leaves
                    st.clock += self._send_host_cost(stage, stream[pc][1])
                if groups[pc]:
                    self._post(stage, st.clock)
                moved = True
            index, instruction = stream[pc]
            if not self._execute(stage, pc, index, instruction):
                return moved
            st.pc, moved = pc + 1, True
        return self._finish(stage) or moved

    def _send_host_cost(self, stage: int, i: Instruction) -> float:
        if not isinstance(i, _SENDS) or not (0 <= i.micro_batch < self.M and 0 <= i.chunk < self.C):
            return 0.0  # out of range: _execute reports it
        peer = self._peer_of(stage, i)
        return 0.0 if peer is None or peer[0] == stage else self.host_costs.get(type(i), 0.0)

    def _execute(self, stage: int, pc: int, index: int, i: Instruction) -> bool:
        """Execute one instruction; ``False`` if the stage must wait."""
        st = self.stages[stage]
        if isinstance(i, MicroBatchInstruction):
            where = self._where(stage, index, i)
            if not self._in_range(stage, where, i):
                return True
            if isinstance(i, _RECVS):
                return self._receive(stage, pc, where, i)
            if isinstance(i, _SENDS):
                self._send(stage, pc, where, i)
                return True
            start = st.clock
            self._run(stage, where, i)
            self._tick(stage, start, i)
            return True
        if isinstance(i, WORLD_COLLECTIVES):
            return self._collective(stage, self._where(stage, index, i), i)
        self._tick(stage, st.clock, i)  # ReduceGrads and the rest: a local blocking point
        return True

    def _send(self, stage: int, pc: int, where: str, i: MicroBatchInstruction) -> None:
        peer = self._peer_of(stage, i)
        if peer is None:
            self._no_peer(where, i)
            return
        self._run(stage, where, i)
        if peer[0] == stage:  # a local hand-off: done at once
            queue = self.local.setdefault((stage, self._channel(stage, i)), deque())
            queue.append((i.micro_batch, peer[1], self.stages[stage].clock, where))

    def _receive(self, stage: int, pc: int, where: str, i: MicroBatchInstruction) -> bool:
        peer = self._peer_of(stage, i)
        if peer is None:
            self._no_peer(where, i)
            return True
        st = self.stages[stage]
        if peer[0] == stage:
            queue = self.local.get((stage, self._channel(stage, i)))
            if not queue:
                return False
            micro_batch, chunk, ready, sender = queue.popleft()
            if (micro_batch, chunk) != (i.micro_batch, i.chunk):
                self.problems.append(f"{where}: mismatched local {_kind(i)}: the next hand-off "
                                     f"is micro-batch {micro_batch} chunk {chunk}, from {sender}")
        else:
            op = self.op_at[stage].get(pc)
            if op is None or op.done is None:
                return False
            ready = op.done
        start = max(st.clock, ready)
        st.wait += start - st.clock
        st.clock = start + (self.host_costs.get(type(i), 0.0) if peer[0] != stage else 0.0)
        self._run(stage, where, i)
        return True

    def _collective(self, stage: int, where: str, i: object) -> bool:
        """Enter (or keep waiting in) the next world collective; ``True`` once it is done."""
        st, k = self.stages[stage], self.coll[stage]
        if not self.arrived[stage]:
            self.arrived[stage] = True
            if k == len(self.world):
                self.world.append({})
                self.released.append(None)
            self.world[k][stage] = (st.clock, i, where)
            if len(self.world[k]) == self.S:
                self._release_collective(k)
        when = self.released[k]
        if when is None:
            return False
        st.wait += when - st.clock
        st.clock = when
        self.arrived[stage] = False
        self.coll[stage] = k + 1
        return True

    def _release_collective(self, k: int) -> None:
        members = self.world[k]
        kinds = {type(i) if i is not _END else _END for _, i, _ in members.values()}
        if len(kinds) > 1:
            listed = ", ".join(f"stage {s} is in {i if i is _END else w}"
                               for s, (_, i, w) in sorted(members.items()))
            self.problems.append(f"mismatched world collective #{k + 1}: {listed}")
        cost = max((self.costs.get(type(i), 0.0) for _, i, _ in members.values()
                    if i is not _END), default=0.0)
        self.released[k] = max(t for t, _, _ in members.values()) + cost

    def _finish(self, stage: int) -> bool:
        """The end of the batch: wait for this stage's sends, then the loss all-reduce."""
        st = self.stages[stage]
        moved = False
        if not self.flushed[stage]:
            if self.pending[stage]:
                return False
            self.flushed[stage] = True
            last = max(self.last_end[stage].values(), default=0.0)
            if last > st.clock:
                st.wait += last - st.clock
                st.clock = last
            moved = True
        if not self._collective(stage, f"stage {stage} ({_END})", _END):
            return moved
        self.finished[stage] = True
        return True

    def _check_complete(self) -> None:
        for (stage, channel), queue in self.local.items():
            kind = channel if isinstance(channel, str) else \
                f"{channel[0]} {channel[1][0]}->{channel[1][1]}"
            for micro_batch, chunk, _, sender in queue:
                self.problems.append(f"{sender}: the {kind} of micro-batch {micro_batch} handed "
                                     f"to chunk {chunk} of the same stage is never received")
        self._check_micro_batches()

    # -- deadlock report -----------------------------------------------------------------

    def _report_deadlock(self) -> None:
        self.deadlocked = True
        stuck = [s for s in range(self.S) if not self.finished[s]]
        lines = [self._where_stuck(s) for s in range(self.S)]
        cycle = self._cycle(stuck)
        self.problems.append(
            f"deadlock: stages {stuck} cannot progress:\n"
            + "\n".join(f"      {line}" for line in lines)
            + (f"\n    cycle: {cycle}" if cycle else "") + self._grid_so_far())
        self._check_micro_batches(only_excess=True)

    def _blocked_on(self, stage: int) -> tuple:
        """The node ``stage`` waits on: ``("op", op)`` or ``("coll", stage)``."""
        st = self.stages[stage]
        if st.pc < len(st.stream):
            _, i = st.stream[st.pc]
            if isinstance(i, _RECVS):
                op = self.op_at[stage].get(st.pc)
                return ("op", op) if op is not None else ("local", stage)
            return ("coll", stage)
        if not self.flushed[stage]:
            return ("op", self._first_pending(stage))
        return ("coll", stage)

    def _first_pending(self, stage: int) -> _Op:
        heads = [q[0] for q in self.queues[stage].values() if q]
        unit = min(heads, key=lambda u: u.ops[0].index)
        return next(op for op in unit.ops if op.done is None)

    def _collective_name(self, stage: int) -> str:
        st = self.stages[stage]
        if st.pc < len(st.stream):
            return f"the world collective {st.stream[st.pc][1]}"
        return _END

    def _where_stuck(self, stage: int) -> str:
        st = self.stages[stage]
        if self.finished[stage]:
            return f"stage {stage}: finished"
        node = self._blocked_on(stage)
        if st.pc < len(st.stream):
            index, i = st.stream[st.pc]
            head = f"stage {stage}: blocked at step {index} on {i}"
        elif node[0] == "op":
            head = f"stage {stage}: blocked at the end of the batch on its {node[1].ins}"
        else:
            head = f"stage {stage}: blocked in {_END}"
        text, following, joiner = self._edge(node)
        if joiner is not None:
            text += joiner + self._verb(following)
        if text[:3] in ("<- ", "-> "):
            text = text[3:]
        elif node[0] == "coll":
            text = text.removeprefix("for ")
        return f"{head}, waiting for {text}"

    def _edge(self, node: tuple) -> tuple[str, tuple | None, str | None]:
        """Why ``node`` cannot progress: ``(text, the node it waits on or None, joiner)``.

        With a ``joiner``, the text ends in ``"stage N"`` and reads on with what
        stage N waits on (:meth:`_verb`); without, it names the node it leads to."""
        kind, what = node
        if kind == "local":
            st = self.stages[what]
            return f"its own hand-off to {st.stream[st.pc][1]}, which never ran", None, None
        if kind == "coll":
            waiting = [s for s in range(self.S) if not self._in_collective(s)]
            if not waiting:
                return "the other stages (mismatched collectives)", None, None
            return f"for stage {waiting[0]}", self._blocked_on(waiting[0]), ", which "
        op: _Op = what
        unit = op.unit
        if unit is not None and not unit.active:
            behind = next(o for o in unit.queue[0].ops if o.done is None)
            return f"queued behind {behind.name()}", ("op", behind), None
        mate = op.mate
        if mate is None:
            return (f"stage {op.peer} to post a matching {'receive' if op.send else 'send'}, "
                    "which it never does", None, None)
        arrow = "->" if op.send else "<-"
        if mate.unit is None:
            return (f"{arrow} {mate.name()}, not yet posted: stage {mate.rank}",
                    self._blocked_on(mate.rank), " ")
        behind = next(o for o in mate.unit.queue[0].ops if o.done is None)
        return f"{arrow} {mate.name()}, queued behind {behind.name()}", ("op", behind), None

    def _in_collective(self, stage: int) -> bool:
        return self.arrived[stage] and self.coll[stage] < len(self.world)

    def _verb(self, node: tuple) -> str:
        """What the stage of ``node`` does while blocked on it: ``"waits RECV_F0"``."""
        kind, what = node
        if kind == "coll":
            return f"waits in {self._collective_name(what)}"
        if kind == "local":
            return f"waits {self.stages[what].stream[self.stages[what].pc][1]}"
        return f"waits {what.ins}"

    def _cycle(self, stuck: list[int]) -> str:
        """The wait-for chain from the first stuck stage that reaches a cycle, rendered as
        ``stage 0 waits RECV_B0 <- stage 1's SEND_B0, queued behind ... (the cycle closes)``."""
        for start in stuck:
            node = self._blocked_on(start)
            out = f"stage {start} {self._verb(node)}"
            seen: set[tuple] = set()
            while node is not None and self._key(node) not in seen:
                seen.add(self._key(node))
                text, following, joiner = self._edge(node)
                out += (", " if text.startswith("queued") else " ") + text
                if joiner is not None:
                    out += joiner + self._verb(following)
                node = following
            if node is not None:
                return out + " (the cycle closes)"
        return ""

    @staticmethod
    def _key(node: tuple) -> tuple:
        kind, what = node
        return (kind, id(what)) if kind == "op" else node

    @staticmethod
    def _rank(node: tuple) -> int:
        kind, what = node
        return what.rank if kind == "op" else what
