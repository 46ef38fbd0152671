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
from typing import Any, NamedTuple

from pipekernel.schedules.comm import CommPlan, plan_communication
from pipekernel.schedules.instructions import (Backward, BackwardWeight, ForwardBackward,
                                               Instruction)
from pipekernel.schedules.ordered import unpaired_steps
from pipekernel.schedules.skips import add_skip_transfers

__all__ = ["Program", "ChannelSpec", "compile_program", "program_of"]


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
    num_buffers: int
    steps: tuple[tuple[Instruction, ...], ...]
    plan: CommPlan
    channels: tuple[ChannelSpec, ...]
    channel_of: tuple[int | None, ...]
    last_weight: int
    last_weight_chunk: int | None

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
    skips = tuple(tuple(edge) for edge in skips)
    schedule = schedule_cls(num_stages, stage, micro_batches, chunks)
    steps = schedule.steps() if paired else unpaired_steps(schedule)
    steps = add_skip_transfers(steps, stage=stage, num_stages=num_stages,
                               chunks=chunks, placement=placement, edges=list(skips))
    plan = plan_communication(steps, stage=stage, num_stages=num_stages, chunks=chunks,
                              placement=placement, trains=schedule_cls.trains, skips=skips)
    return program_of(plan, steps, schedule=schedule_cls.name, trains=schedule_cls.trains,
                      micro_batches=micro_batches, skips=skips,
                      num_buffers=schedule.num_buffers())


def program_of(plan: CommPlan, steps: Any, *, schedule: str, trains: bool, micro_batches: int,
               skips: tuple[tuple[int, int], ...] = (), num_buffers: int) -> Program:
    """The :class:`Program` of a plan already made (e.g. one a test or a posting policy
    changed): its channels numbered and its last weight-gradient index found."""
    channels: list[ChannelSpec] = []
    number: dict[tuple, int] = {}
    channel_of: list[int | None] = [None] * len(plan.stream)
    for index, group in enumerate(plan.posts):
        for at in group:
            ins = plan.stream[at]
            key = (type(ins), ins.chunk, getattr(ins, "peer", None))
            if key not in number:
                number[key] = len(channels)
                channels.append(ChannelSpec(key, plan.peers[at][0], plan.lanes[at]
                                            if plan.lanes else None))
            channel_of[at] = number[key]
    weights = [i for i, ins in enumerate(plan.stream)
               if isinstance(ins, (Backward, BackwardWeight, ForwardBackward))]
    last = weights[-1] if weights else -1
    last_ins = plan.stream[last] if weights else None
    if isinstance(last_ins, ForwardBackward):
        last_ins = last_ins.backward
    return Program(schedule=schedule, trains=trains, micro_batches=micro_batches,
                   skips=tuple(skips), num_buffers=num_buffers,
                   steps=tuple(tuple(step) for step in steps), plan=plan,
                   channels=tuple(channels), channel_of=tuple(channel_of), last_weight=last,
                   last_weight_chunk=last_ins.chunk if last_ins is not None else None)
