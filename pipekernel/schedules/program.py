"""A stage's program: what it runs for one schedule and micro-batch count (layer 0: no torch).

A :class:`Program` is built once per (schedule, micro-batch count, skip edges) by
:func:`compile_program` and only read afterwards: the kernel walks its stream by index, the
stage runtime posts its groups and finds each transfer's channel by index, and the
data-parallel reducer learns from it which backward is the batch's last. Every answer is a
stream index or a number — nothing is found again by comparing instruction objects (equal
instructions may stand at several places of one stream).

What it holds (the :class:`~pipekernel.schedules.comm.CommPlan` fields are re-exported):

* ``stream`` / ``step_of``: the instructions in execution order and each one's step;
* ``posts[i]``: the stream indices posted as one group right before ``stream[i]``;
* ``peers`` / ``local`` / ``lanes``: each point-to-point instruction's peer, whether it is a
  hand-off to this stage, its lane;
* ``channel_of[i]``: the number of the channel ``stream[i]`` travels on (a remote
  point-to-point instruction), an index into ``channels``, else ``None``;
* ``last_weight``: the index of the batch's last weight-gradient instruction
  (``Backward``/``BackwardWeight``, or a ``ForwardBackward``, whose backward half is a
  ``Backward``), ``-1`` if none; ``last_weight_chunk`` its chunk.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import chain
from typing import Any, NamedTuple

from pipekernel.errors import ScheduleError
from pipekernel.schedules.comm import CommPlan, plan_communication
from pipekernel.schedules.instructions import (Backward, BackwardInput, BackwardWeight,
                                               ForwardBackward, Instruction, RecvActivation,
                                               RecvGrad, SendActivation, SendGrad)
from pipekernel.schedules.ordered import unpaired_steps
from pipekernel.schedules.skips import add_skip_transfers

__all__ = ["Program", "ChannelSpec", "compile_program", "lower", "program_of"]

_BACKWARDS = (Backward, BackwardInput, BackwardWeight, ForwardBackward)
_WEIGHTS = (Backward, BackwardWeight, ForwardBackward)  # a pair's backward half is a Backward
_PLAIN = frozenset((SendActivation, SendGrad, RecvActivation, RecvGrad))


class ChannelSpec(NamedTuple):
    """One channel of a stage: one kind of traffic to or from one peer position.

    ``key`` is ``(instruction class, chunk, skip peer position or None)``: the same key in
    two programs of one stage (training and evaluation) is the same channel, so what a
    transport learnt about it (cached wire metadata) carries over. ``peer_stage`` is the
    stage at the other end, ``lane`` the lane it travels on."""

    key: tuple[type, int, int | None]
    peer_stage: int
    lane: int | None


@dataclass(frozen=True)
class Program:
    """One stage's compiled schedule (see the module docstring). Build it with
    :func:`compile_program` (a schedule class) or :func:`program_of` (steps you have)."""

    schedule: str
    trains: bool
    micro_batches: int
    skips: tuple[tuple[int, int], ...]
    num_buffers: int | None
    steps: tuple[tuple[Instruction, ...], ...]
    plan: CommPlan
    last_weight: int
    last_weight_chunk: int | None

    @property
    def channels(self) -> tuple[ChannelSpec, ...]:
        return self._channels[0]

    @property
    def channel_of(self) -> tuple[int | None, ...]:
        return self._channels[1]

    @cached_property
    def _channels(self) -> tuple[tuple[ChannelSpec, ...], tuple[int | None, ...]]:
        """Worked out from the plan on first read (the runtime's bind): the simulator, which
        proves the same program, never needs them."""
        return _channels(self.plan)

    @property
    def stage(self) -> int:
        return self.plan.stage

    @property
    def stream(self) -> tuple[Instruction, ...]:
        return self.plan.stream

    @property
    def step_of(self) -> tuple[int, ...]:
        return self.plan.step_of

    @property
    def posts(self) -> tuple[tuple[int, ...], ...]:
        return self.plan.posts

    @property
    def peers(self) -> tuple[tuple[int, int] | None, ...]:
        return self.plan.peers

    @property
    def local(self) -> tuple[bool, ...]:
        return self.plan.local

    @property
    def lanes(self) -> tuple[int | None, ...]:
        return self.plan.lanes


def compile_program(schedule_cls: Any, *, stage: int, num_stages: int, micro_batches: int,
                    chunks: int = 1, placement: str = "loop",
                    skips: tuple[tuple[int, int], ...] | list = (),
                    paired: bool = True) -> Program:
    """The :class:`Program` of ``stage`` for ``schedule_cls`` with ``micro_batches``
    micro-batches: the schedule's steps with the skip transfers of ``skips`` (sorted
    ``(producer, consumer)`` positions) added, and their communication plan.
    ``paired=False``: what the schedule runs without an overlapping executor
    (:func:`~pipekernel.schedules.ordered.unpaired_steps`: each ``ForwardBackward`` step
    split back into its two steps, or, for ``zbv``, its plan without pairs), for a stage
    that runs pairs one half after the other anyway."""
    return lower(schedule_cls(num_stages, stage, micro_batches, chunks), stage=stage,
                 num_stages=num_stages, micro_batches=micro_batches, chunks=chunks,
                 placement=placement, skips=skips, paired=paired)


def lower(schedule: Any, *, stage: int, num_stages: int, micro_batches: int, chunks: int = 1,
          placement: str = "loop", skips: tuple[tuple[int, int], ...] | list = (),
          paired: bool = True) -> Program:
    """:func:`compile_program` of a schedule object already made (the one lowering the engine
    runs and :func:`~pipekernel.schedules.simulator.simulate` proves): any object with
    ``steps()``; without ``trains``, it trains if its steps hold a backward; without
    ``num_buffers()``, ``num_buffers`` is ``None``.

    :raises ScheduleError: when the object has no ``steps()``."""
    if not callable(getattr(schedule, "steps", None)):
        raise ScheduleError(f"schedule object {schedule!r} for stage {stage} has no steps()",
                            hint="return a Schedule (or an object with steps())", stage=stage)
    skips = tuple(tuple(edge) for edge in skips)
    steps = tuple(map(tuple, schedule.steps() if paired else unpaired_steps(schedule)))
    if skips:
        steps = add_skip_transfers(steps, stage=stage, num_stages=num_stages,
                                   chunks=chunks, placement=placement, edges=list(skips))
    trains = getattr(schedule, "trains", None)
    if not isinstance(trains, bool):
        trains = any(isinstance(i, _BACKWARDS) for step in steps for i in step)
    plan = plan_communication(steps, stage=stage, num_stages=num_stages, chunks=chunks,
                              placement=placement, trains=trains, skips=skips)
    num_buffers = getattr(schedule, "num_buffers", None)
    return program_of(plan, steps, trains=trains, micro_batches=micro_batches, skips=skips,
                      schedule=getattr(schedule, "name", "") or type(schedule).__name__,
                      num_buffers=num_buffers() if callable(num_buffers) else None)


def program_of(plan: CommPlan, steps: Any, *, schedule: str, trains: bool, micro_batches: int,
               skips: tuple[tuple[int, int], ...] = (), num_buffers: int | None) -> Program:
    """The :class:`Program` of a plan already made (e.g. one a test or a posting policy
    changed): its last weight-gradient index found (its channels are numbered when read)."""
    last = next((i for i in range(len(plan.stream) - 1, -1, -1)
                 if isinstance(plan.stream[i], _WEIGHTS)), -1)
    last_ins = plan.stream[last] if last >= 0 else None
    if isinstance(last_ins, ForwardBackward):
        last_ins = last_ins.backward
    return Program(schedule=schedule, trains=trains, micro_batches=micro_batches,
                   skips=tuple(skips), num_buffers=num_buffers,
                   steps=tuple(map(tuple, steps)), plan=plan,
                   last_weight=last,
                   last_weight_chunk=last_ins.chunk if last_ins is not None else None)


def _channels(plan: CommPlan) -> tuple[tuple[ChannelSpec, ...], tuple[int | None, ...]]:
    """The plan's channels, numbered in posting order, and each stream index's number."""
    stream, peers, lanes = plan.stream, plan.peers, plan.lanes
    channels: list[ChannelSpec] = []
    number: dict[tuple, int] = {}
    channel_of: list[int | None] = [None] * len(stream)
    plain = _PLAIN  # classes without a skip peer: no getattr (and its exception) per transfer
    for at in chain.from_iterable(plan.posts):
        ins = stream[at]
        cls = type(ins)
        key = (cls, ins.chunk, None if cls in plain else getattr(ins, "peer", None))
        k = number.get(key)
        if k is None:
            k = number[key] = len(channels)
            channels.append(ChannelSpec(key, peers[at][0], lanes[at] if lanes else None))
        channel_of[at] = k
    return tuple(channels), tuple(channel_of)
