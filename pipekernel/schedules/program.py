"""A stage's program: what it runs for one schedule and micro-batch count (layer 0: no torch).

A :class:`Program` is built once per (schedule, micro-batch count, skip edges) by
:func:`compile_program` (or :func:`plan_communication`, from steps you have) and only read
afterwards: the kernel walks its stream by index, the stage runtime posts its groups and
finds each transfer's channel and each hand-off's receive by index;
:func:`~pipekernel.schedules.simulator.simulate` proves and times the same objects. Every answer is a stream index or a number — nothing is
found again by comparing instruction objects (equal instructions may stand at several places
of one stream). A sharded stage's program also holds FSDP2's gathers and reductions
(:mod:`pipekernel.schedules.sharded`), a replicated stage's the points of its overlapped
gradient reduction (:mod:`pipekernel.schedules.data_parallel`).
"""
from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import chain
from typing import Any, NamedTuple

from pipekernel.errors import ScheduleError
from pipekernel.schedules import instructions as isa
from pipekernel.schedules.comm import RECVS, SENDS, plan_posts
from pipekernel.schedules.data_parallel import add_reduce_instructions
from pipekernel.schedules.instructions import (Backward, BackwardInput, BackwardWeight,
                                               ForwardBackward, Instruction,
                                               MicroBatchInstruction)
from pipekernel.schedules.ordered import unpaired_steps
from pipekernel.schedules.placement import position
from pipekernel.schedules.sharded import WEIGHTS, add_shard_instructions
from pipekernel.schedules.skips import add_skip_transfers

__all__ = ["Program", "ChannelSpec", "compile_program", "lower", "plan_communication"]

_BACKWARDS = (Backward, BackwardInput, BackwardWeight, ForwardBackward)
_PLAIN = frozenset((isa.SendActivation, isa.SendGrad, isa.RecvActivation, isa.RecvGrad))
_SEND_SET = frozenset(SENDS)
#: The receive a local hand-off of each send fills.
_RECV_OF = {isa.SendActivation: isa.RecvActivation, isa.SendGrad: isa.RecvGrad,
            isa.SendSkip: isa.RecvSkip, isa.SendSkipGrad: isa.RecvSkipGrad}


class ChannelSpec(NamedTuple):
    """One channel of a stage: one kind of traffic to or from one peer position.

    ``key`` is ``(instruction class, chunk, skip peer position or None)``: the same key in
    two programs of one stage (training and evaluation) is the same channel, so what a
    transport learnt about it (cached wire metadata) carries over. ``peer_stage`` is the
    stage at the other end, ``lane`` the lane it travels on, ``send`` whether this stage
    sends on it."""

    key: tuple[type, int, int | None]
    peer_stage: int
    lane: int | None
    send: bool


@dataclass(frozen=True)
class Program:
    """One stage's compiled schedule: its instructions and when it posts each transfer
    (the policy: :mod:`pipekernel.schedules.comm`).

    * ``stream``: the instructions in execution order; ``step_of[i]`` the step of
      ``stream[i]`` (:attr:`steps` groups them back);
    * ``posts[i]``: the stream indices of the point-to-point instructions posted together,
      as one group, right before ``stream[i]`` runs (ascending: stream order; a send at its
      own index, a receive at or before its own). Local hand-offs never appear;
    * ``peers[i]``: ``(stage, chunk)`` of the peer of a point-to-point ``stream[i]``, else
      ``None``; ``local[i]``: whether it is a hand-off to or from this stage;
    * ``lanes[i]``: the lane of a remote point-to-point instruction
      (:func:`~pipekernel.schedules.lanes.lane_map`), else ``None`` (``()``: no lanes, one
      ordered stream per stage);
    * ``schedule``, ``trains``, ``micro_batches``, ``skips``, ``num_buffers``: what it was
      compiled from.

    Worked out on first read (the runtime's bind; the simulator never needs them):
    :attr:`channels` / :attr:`channel_of`, :attr:`handoffs`, :attr:`last_weight` /
    :attr:`last_weight_chunk`."""

    stage: int
    stream: tuple[Instruction, ...]
    step_of: tuple[int, ...]
    posts: tuple[tuple[int, ...], ...]
    peers: tuple[tuple[int, int] | None, ...]
    local: tuple[bool, ...]
    lanes: tuple[int | None, ...] = ()
    schedule: str = ""
    trains: bool = True
    micro_batches: int = 1
    skips: tuple[tuple[int, int], ...] = ()
    num_buffers: int | None = None

    @cached_property
    def steps(self) -> tuple[tuple[Instruction, ...], ...]:
        """The stream cut back into its steps (``step_of`` ascends: a bisection per step)."""
        step_of, stream = self.step_of, self.stream
        cuts = [bisect_left(step_of, s) for s in range(step_of[-1] + 2)] if step_of else [0]
        return tuple(stream[a:b] for a, b in zip(cuts, cuts[1:]))

    @property
    def channels(self) -> tuple[ChannelSpec, ...]:
        """The stage's channels, numbered in posting order."""
        return self._channels[0]

    @property
    def channel_of(self) -> tuple[int | None, ...]:
        """``channel_of[i]``: the number of the channel ``stream[i]`` travels on (a remote
        point-to-point instruction), an index into :attr:`channels`, else ``None``."""
        return self._channels[1]

    @cached_property
    def _channels(self) -> tuple[tuple[ChannelSpec, ...], tuple[int | None, ...]]:
        return _channels(self)

    @cached_property
    def handoffs(self) -> tuple[int | None, ...]:
        """``handoffs[i]``: for a local send, the stream index of the receive it fills (the
        first of its kind, micro-batch and chunks not filled yet), else ``None``."""
        stream, peers, local = self.stream, self.peers, self.local
        waiting: dict[tuple, list[int]] = {}
        for j, ins in enumerate(stream):
            peer = peers[j]  # a local transfer has its peer
            if local[j] and peer is not None and isinstance(ins, RECVS):
                waiting.setdefault((type(ins), ins.chunk, ins.micro_batch, peer[1]),
                                   []).append(j)
        out: list[int | None] = [None] * len(stream)
        for i, ins in enumerate(stream):
            peer = peers[i]
            if local[i] and peer is not None and isinstance(ins, SENDS):
                queue = waiting.get((_RECV_OF[type(ins)], peer[1], ins.micro_batch,
                                     ins.chunk))
                out[i] = queue.pop(0) if queue else None
        return tuple(out)

    @cached_property
    def last_weight(self) -> int:
        """The index of the batch's last weight-gradient instruction (``Backward``,
        ``BackwardWeight``, or a ``ForwardBackward``, whose backward half is a
        ``Backward``), ``-1`` if none."""
        stream = self.stream
        return next((i for i in range(len(stream) - 1, -1, -1)
                     if isinstance(stream[i], WEIGHTS)), -1)

    @property
    def last_weight_chunk(self) -> int | None:
        """The chunk of :attr:`last_weight` (``None``: none)."""
        if self.last_weight < 0:
            return None
        last = self.stream[self.last_weight]
        half = last.backward if isinstance(last, ForwardBackward) else last
        return half.chunk if isinstance(half, MicroBatchInstruction) else None  # it is one


def compile_program(schedule_cls: Any, *, stage: int, num_stages: int, micro_batches: int,
                    chunks: int = 1, placement: str = "loop",
                    skips: tuple[tuple[int, int], ...] | list = (),
                    paired: bool = True, sharded: bool = False,
                    data_parallel: bool = False) -> Program:
    """The :class:`Program` of ``stage`` for ``schedule_cls`` with ``micro_batches``
    micro-batches: the schedule's steps with the skip transfers of ``skips`` (sorted
    ``(producer, consumer)`` positions) added, and their communication plan.
    ``paired=False``: what the schedule runs without an overlapping executor
    (:func:`~pipekernel.schedules.ordered.unpaired_steps`: each ``ForwardBackward`` step
    split back into its two steps, or, for ``zbv``, its plan without pairs), for a stage
    that runs pairs one half after the other anyway. ``sharded``: with FSDP2's instructions
    (:func:`~pipekernel.schedules.sharded.add_shard_instructions`). ``data_parallel``: with
    the overlapped gradient reduction's instructions
    (:func:`~pipekernel.schedules.data_parallel.add_reduce_instructions`)."""
    return lower(schedule_cls(num_stages, stage, micro_batches, chunks), stage=stage,
                 num_stages=num_stages, micro_batches=micro_batches, chunks=chunks,
                 placement=placement, skips=skips, paired=paired, sharded=sharded,
                 data_parallel=data_parallel)


def lower(schedule: Any, *, stage: int, num_stages: int, micro_batches: int, chunks: int = 1,
          placement: str = "loop", skips: tuple[tuple[int, int], ...] | list = (),
          paired: bool = True, sharded: bool = False, data_parallel: bool = False) -> Program:
    """:func:`compile_program` of a schedule object already made (the one lowering the engine
    runs and :func:`~pipekernel.schedules.simulator.simulate` proves): any object with
    ``steps()``; without ``trains``, it trains if its steps hold a backward; without
    ``num_buffers()``, ``num_buffers`` is ``None``.

    :raises ScheduleError: when the object has no ``steps()``."""
    if not callable(getattr(schedule, "steps", None)):
        raise ScheduleError(f"schedule object {schedule!r} for stage {stage} has no steps()",
                            hint="return a Schedule (or an object with steps())", stage=stage)
    skips = tuple(tuple(edge) for edge in skips)
    steps = schedule.steps() if paired else unpaired_steps(schedule)
    if skips:
        steps = add_skip_transfers(steps, stage=stage, num_stages=num_stages,
                                   chunks=chunks, placement=placement, edges=list(skips))
    trains = getattr(schedule, "trains", None)
    if not isinstance(trains, bool):
        trains = any(isinstance(i, _BACKWARDS) for step in steps for i in step)
    if sharded:
        first = [c for c in range(chunks) if position(stage, c, num_stages, placement) == 0]
        steps = add_shard_instructions(steps, trains=trains,
                                       first_chunk=first[0] if first else None)
    if data_parallel and trains:  # after FSDP2's: next to the weight-gradient instruction
        steps = add_reduce_instructions(steps)
    num_buffers = getattr(schedule, "num_buffers", None)
    return plan_communication(steps, stage=stage, num_stages=num_stages, chunks=chunks,
                              placement=placement, trains=trains, skips=skips,
                              schedule=getattr(schedule, "name", "") or type(schedule).__name__,
                              micro_batches=micro_batches,
                              num_buffers=num_buffers() if callable(num_buffers) else None)


def plan_communication(steps: Iterable[Sequence[Instruction]], *, stage: int, num_stages: int,
                       chunks: int = 1, placement: str = "loop", trains: bool | None = None,
                       skips: Sequence[tuple[int, int]] = (), schedule: str = "",
                       micro_batches: int = 1, num_buffers: int | None = None) -> Program:
    """The :class:`Program` of ``steps`` as they are (no skip transfers added): their
    posting plan (:func:`~pipekernel.schedules.comm.plan_posts`; ``skips``, the sorted skip
    edges, give the skip channels their lanes). ``trains`` ``None``: whether a backward is
    among them. Also the ``posting=`` hook's signature of
    :func:`~pipekernel.schedules.simulator.simulate`, for another policy to be proven."""
    stream, step_of, posts, peers, local, lanes = plan_posts(steps, stage, num_stages, chunks,
                                                             placement, skips)
    if not isinstance(trains, bool):
        trains = any(isinstance(i, _BACKWARDS) for i in stream)
    return Program(stage=stage, stream=tuple(stream), step_of=tuple(step_of),
                   posts=tuple(map(tuple, posts)),  # ascending already; no frame per group
                   peers=tuple(peers), local=tuple(local), lanes=tuple(lanes),
                   schedule=schedule, trains=trains, micro_batches=micro_batches,
                   skips=tuple((a, b) for a, b in skips), num_buffers=num_buffers)


def _channels(program: Program) -> tuple[tuple[ChannelSpec, ...], tuple[int | None, ...]]:
    """The program's channels, numbered in posting order, and each stream index's number."""
    stream, peers, lanes = program.stream, program.peers, program.lanes
    channels: list[ChannelSpec] = []
    number: dict[tuple, int] = {}
    channel_of: list[int | None] = [None] * len(stream)
    plain = _PLAIN  # classes without a skip peer: no getattr (and its exception) per transfer
    for at in chain.from_iterable(program.posts):
        # a posted index is a remote transfer: a micro-batch's, with a peer
        ins: MicroBatchInstruction = stream[at]  # type: ignore[assignment]
        peer: tuple[int, int] = peers[at]  # type: ignore[assignment]
        cls = type(ins)
        key = (cls, ins.chunk, None if cls in plain else getattr(ins, "peer", None))
        k = number.get(key)
        if k is None:
            k = number[key] = len(channels)
            channels.append(ChannelSpec(key, peer[0], lanes[at] if lanes else None,
                                        cls in _SEND_SET))
        channel_of[at] = k
    return tuple(channels), tuple(channel_of)
