"""Run every stage's schedule together, without a runtime (layer 0: no torch).

:func:`simulate` executes all stages' instruction streams at once, event-driven:
each stage runs its flattened instructions in order, a receive blocks until the
matching send was posted, sends never block. It proves that a schedule

* matches every send with a receive, in FIFO order per channel
  ``(sender stage, receiver stage, "activation" | "grad")``, with the same
  micro-batch and chunk, and leaves no message unreceived;
* never deadlocks;
* forwards every micro-batch exactly once per (stage, chunk) and, when it
  trains, backwards it exactly once (``Backward``, or ``BackwardInput`` then
  ``BackwardWeight``) after its forward and, except at the last pipeline
  position, after its ``RecvGrad``;
* never overwrites a buffer that still holds a live micro-batch (until its
  backward when training; until its forward and send for inference).

Virtual stages: chunk ``c`` on stage ``s`` is the pipeline position that the
schedule's ``placement`` gives (:mod:`pipekernel.schedules.placement`; ``"loop"``,
``p = c * num_stages + s``, when the schedule has none); activations flow from
``p`` to ``p + 1``, gradients from ``p`` to ``p - 1``. A transfer between two
chunks of one stage (the turn of a V) goes through that stage's own channel.

All problems are collected and raised as one :class:`ScheduleError`.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from pipekernel.errors import ConfigError, ScheduleError
from pipekernel.schedules.placement import peer as placement_peer
from pipekernel.instructions import (
    Backward, BackwardInput, BackwardWeight, Forward, Instruction, LoadMicroBatch,
    MicroBatchInstruction, RecvActivation, RecvGrad, SendActivation, SendGrad,
)

__all__ = ["simulate", "SimulationResult", "format_grid", "COMPUTE", "DEFAULT_COSTS"]

#: Instruction classes that count as compute (in the timeline and the bubble).
COMPUTE = (Forward, Backward, BackwardInput, BackwardWeight)
#: Unit costs; every instruction class not listed costs 0.
DEFAULT_COSTS: Mapping[type, float] = {cls: 1.0 for cls in COMPUTE}

_BACKWARDS = (Backward, BackwardInput, BackwardWeight)
_WRITES = (LoadMicroBatch, RecvActivation, Forward)


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
    """

    num_stages: int
    micro_batches: int
    chunks: int
    makespan: float
    bubble_fraction: float
    buffers: tuple[int, ...]
    timeline: tuple[tuple[tuple[float, float, Instruction], ...], ...]
    steps: tuple[tuple[tuple[Instruction, ...], ...], ...]


def simulate(schedule: Callable[..., object], num_stages: int, micro_batches: int,
             chunks: int = 1, costs: Mapping[type, float] | None = None) -> SimulationResult:
    """Simulate ``schedule`` on every stage of a pipeline and check it.

    :param schedule: a :class:`~pipekernel.schedules.base.Schedule` subclass, or
        any callable ``(num_stages, stage, micro_batches, chunks)`` returning an
        object with ``steps()`` (and optionally ``trains``, ``num_buffers()``).
        Without ``trains``, the schedule trains if it emits any backward.
    :param costs: ``{instruction class: duration}`` overriding
        :data:`DEFAULT_COSTS` (compute 1, everything else 0).
    :raises ConfigError: for invalid sizes or costs.
    :raises ScheduleError: listing every problem found (mismatched sends and
        receives, deadlock with the stuck stages and the grid so far, missing
        or repeated forwards/backwards, overwritten live buffers).
    """
    _check_sizes(num_stages, micro_batches, chunks)
    objects = [schedule(num_stages, s, micro_batches, chunks) for s in range(num_stages)]
    sim = _Simulation(num_stages, micro_batches, chunks, _cost_table(costs), objects)
    sim.run()
    if sim.problems:
        raise _error(schedule, num_stages, micro_batches, chunks, sim.problems)
    return sim.result()


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


def _cost_table(costs: Mapping[type, float] | None) -> dict[type, float]:
    table = dict(DEFAULT_COSTS)
    for cls, cost in (costs or {}).items():
        if not (isinstance(cls, type) and issubclass(cls, Instruction)):
            raise ConfigError(f"simulate: cost key {cls!r} is not an instruction class",
                              hint="key costs by class, e.g. {Forward: 1.0, Backward: 2.0}")
        if not isinstance(cost, (int, float)) or cost < 0:
            raise ConfigError(f"simulate: cost of {cls.__name__} must be a number >= 0, "
                              f"got {cost!r}", hint="use non-negative durations")
        table[cls] = float(cost)
    return table


def _error(schedule, num_stages, micro_batches, chunks, problems) -> ScheduleError:
    name = getattr(schedule, "name", "") or getattr(schedule, "__name__", repr(schedule))
    lines = "\n".join(f"  - {p}" for p in problems)
    return ScheduleError(
        f"schedule {name!r} is invalid for {num_stages} stage(s) x {micro_batches} "
        f"micro-batch(es) x {chunks} chunk(s): {len(problems)} problem(s):\n{lines}",
        hint="fix the schedule's steps(); every send needs a matching receive in the same "
             "order, and a buffer may be reused only after its micro-batch is done")


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
    slots: dict[int, tuple[int, int]] = field(default_factory=dict)  # buffer -> (chunk, mb)
    peak: int = 0
    timeline: list[tuple[float, float, Instruction]] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.pc >= len(self.stream)


class _Simulation:
    """Mutable state of one simulation; :meth:`run` fills ``problems``."""

    def __init__(self, num_stages, micro_batches, chunks, costs, objects) -> None:
        self.S, self.M, self.C = num_stages, micro_batches, chunks
        self.costs, self.problems = costs, []
        self.steps = tuple(self._steps_of(obj, s) for s, obj in enumerate(objects))
        self.stages = [_StageState(self._flatten(s), self._num_buffers(obj))
                       for s, obj in enumerate(objects)]
        self.trains = self._trains(objects)
        self.placement = getattr(objects[0], "placement", "loop") if objects else "loop"
        self.channels: dict[tuple[int, int, str], deque] = {}
        self.progress: dict[tuple[int, int, int], _Progress] = {}
        self.deadlocked = False

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

    # -- the event loop ----------------------------------------------------------------

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
        where = f"stage {stage} step {index} ({instruction})"
        if isinstance(instruction, MicroBatchInstruction) and not self._in_range(
                stage, where, instruction):
            return True
        if isinstance(instruction, (RecvActivation, RecvGrad)):
            return self._receive(stage, where, instruction)
        start = self.stages[stage].clock
        self._run(stage, where, instruction)
        self._tick(stage, start, instruction)
        return True

    def _tick(self, stage: int, start: float, instruction: Instruction) -> float:
        st = self.stages[stage]
        end = start + self.costs.get(type(instruction), 0.0)
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

    # -- communication -----------------------------------------------------------------

    def _peer(self, stage: int, chunk: int, delta: int) -> tuple[int, int] | None:
        """(stage, chunk) of pipeline position ``p + delta``, or None past either end."""
        return placement_peer(stage, chunk, delta, self.S, self.C, self.placement)

    def _send(self, stage: int, where: str, i: MicroBatchInstruction, kind: str) -> None:
        peer = self._peer(stage, i.chunk, 1 if kind == "activation" else -1)
        if peer is None:
            end = "last" if kind == "activation" else "first"
            self.problems.append(f"{where}: the {end} pipeline position has no peer to send "
                                 f"the {kind} to")
            return
        queue = self.channels.setdefault((stage, peer[0], kind), deque())
        cost = self.costs.get(type(i), 0.0)
        queue.append((i.micro_batch, peer[1], self.stages[stage].clock + cost, where))

    def _receive(self, stage: int, where: str, i: MicroBatchInstruction) -> bool:
        kind = "activation" if isinstance(i, RecvActivation) else "grad"
        peer = self._peer(stage, i.chunk, -1 if kind == "activation" else 1)
        if peer is None:
            end = "first" if kind == "activation" else "last"
            self.problems.append(f"{where}: the {end} pipeline position has no peer to receive "
                                 f"the {kind} from")
            return True
        queue = self.channels.get((peer[0], stage, kind))
        if not queue:
            return False
        micro_batch, chunk, posted, sender = queue.popleft()
        if (micro_batch, chunk) != (i.micro_batch, i.chunk):
            self.problems.append(f"{where}: mismatched {kind}: the next message on channel "
                                 f"stage {peer[0]} -> stage {stage} is micro-batch {micro_batch} "
                                 f"chunk {chunk}, sent by {sender}")
        start = max(self.stages[stage].clock, posted)
        self._run(stage, where, i)
        self._tick(stage, start, i)
        return True

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
        self._send(stage, where, i, "activation")
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
        self._send(stage, where, i, "grad")

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

    def _report_deadlock(self) -> None:
        self.deadlocked = True
        lines = [self._where_stuck(s) for s in range(self.S)]
        timeline = tuple(tuple(st.timeline) for st in self.stages)
        makespan = max((st.clock for st in self.stages), default=0.0)
        grid = _grid(timeline, makespan) if makespan else "(nothing ran)"
        stuck = [s for s in range(self.S) if not self.stages[s].done]
        self.problems.append(
            f"deadlock: stages {stuck} cannot progress:\n"
            + "\n".join(f"      {line}" for line in lines)
            + "\n    grid so far:\n" + "\n".join(f"      {row}" for row in grid.splitlines()))

    def _where_stuck(self, stage: int) -> str:
        st = self.stages[stage]
        if st.done:
            return f"stage {stage}: finished"
        index, i = st.stream[st.pc]
        kind = "activation" if isinstance(i, RecvActivation) else "grad"
        peer = self._peer(stage, i.chunk, -1 if kind == "activation" else 1)
        return (f"stage {stage}: blocked at step {index} on {i}, waiting for stage {peer[0]} "
                f"to send the {kind} of micro-batch {i.micro_batch} chunk {i.chunk}")

    def _check_complete(self) -> None:
        for (src, dst, kind), queue in self.channels.items():
            for micro_batch, chunk, _, sender in queue:
                self.problems.append(f"{sender}: the {kind} of micro-batch {micro_batch} sent to "
                                     f"stage {dst} chunk {chunk} is never received")
        for s in range(self.S):
            for c in range(self.C):
                for m in range(self.M):
                    self._check_micro_batch(s, c, m)

    def _check_micro_batch(self, stage: int, chunk: int, m: int) -> None:
        p = self.progress.get((stage, chunk, m), _Progress())
        where = f"stage {stage} chunk {chunk} micro-batch {m}"
        if p.forward != 1:
            self.problems.append(f"{where}: forwarded {p.forward} times, expected once")
        if not self.trains:
            return
        once = (p.backward, p.b_input, p.b_weight) in ((1, 0, 0), (0, 1, 1))
        if not once:
            self.problems.append(f"{where}: backwarded {p.backward} times (plus {p.b_input} "
                                 f"BackwardInput, {p.b_weight} BackwardWeight), expected one "
                                 "Backward or one BackwardInput + one BackwardWeight")

    def result(self) -> SimulationResult:
        makespan = max(st.clock for st in self.stages)
        busy = sum(end - start for st in self.stages for start, end, _ in st.timeline)
        bubble = 1.0 - busy / (self.S * makespan) if makespan > 0 else 0.0
        return SimulationResult(
            num_stages=self.S, micro_batches=self.M, chunks=self.C, makespan=makespan,
            bubble_fraction=bubble, buffers=tuple(st.peak for st in self.stages),
            timeline=tuple(tuple(st.timeline) for st in self.stages), steps=self.steps)


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
