"""The communication plan: when a stage posts each send and receive (layer 0: no torch).

The runtime does not post a transfer when it meets the instruction; it follows a
*plan* computed once per schedule from the stage's instruction stream, and the
simulator proves that same plan deadlock-free under rendezvous semantics (see
:mod:`pipekernel.schedules.simulator`). One function, :func:`plan_posts`, decides for
both (it fills the stage's :class:`~pipekernel.schedules.program.Program`), so what is
proven is what runs.

The policy, schedule-agnostic (it reads instructions, it knows no schedule):

* A **send** is posted when the stream reaches it (its data exists then).
* A **receive** is posted as early as it may be:
  - ``RecvActivation`` at once: its data lands in a fresh tensor that the
    pending receive holds until the instruction moves it into its buffer slot
    (which must be free by then — the simulator checks it), so prefetching costs
    at most one activation per channel, never a slot;
  - ``RecvGrad`` once the activation it is the gradient of was sent (in the
    same group as that send at the earliest);
  - and, for both, only after the previous receive *of the same channel* was
    waited on: a transfer whose metadata changed sends extra messages on its
    lane that a receive posted further ahead would take, and the receiver sizes
    a receive from the metadata of the one before (see :mod:`pipekernel.comm.wire`).
* Every channel — one kind of traffic (activations or gradients, or one skip
  edge's skips or their gradients) from one pipeline position to another — gets a
  **lane** (transport tag, :mod:`pipekernel.schedules.lanes`) that carries no other
  channel at either of its two ranks. A lane is one ordered stream per rank, whatever
  the peer (NCCL: one communicator; :mod:`pipekernel.comm.transport`), so with one
  channel per lane at each rank a receive posted early can only wait for the
  transfers before it on its own channel, never hold back an unrelated send — which
  is what deadlocks 1F1B when a stage's receive from stage ``s - 1`` and its send to
  ``s + 1`` share a lane (stage 1's ``SEND_B0`` behind its early ``RECV_B1``) or when
  a pair shares one ordered stream. The runtime never waits on a send before the
  batch ends, so under rendezvous sends the only waits are receives whose data the
  peer produces — the same dependencies as with buffered sends — and collectives.
  Posting is bounded by the receive's own position: at the latest it is posted
  right before it is waited on.
* Everything posted at one point of the stream is posted as **one group**
  (``Transport.batch_isend_irecv``), in stream order; a receive is waited on at
  its own instruction, a send only when the batch ends (or its buffer is needed).
* A transfer whose peer is the stage itself (one stage holding consecutive
  positions, e.g. the turn of a V) is a **local hand-off**: never posted.
* Skip connections (:mod:`pipekernel.schedules.skips`) are two more channels per
  edge, with lanes from the same map, planned by the same rules.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import chain, repeat
from typing import Any

from pipekernel.schedules.instructions import (
    Instruction, MicroBatchInstruction, RecvActivation, RecvGrad, RecvSkip, RecvSkipGrad,
    SendActivation, SendGrad, SendSkip, SendSkipGrad, SkipInstruction,
)
from pipekernel.schedules.lanes import channel_of, lane_map, lanes_needed
from pipekernel.schedules.placement import locate
from pipekernel.schedules.placement import peer as placement_peer

__all__ = ["plan_posts", "peer_of", "lanes_needed", "SENDS", "RECVS", "P2P"]

SENDS = (SendActivation, SendGrad, SendSkip, SendSkipGrad)
RECVS = (RecvActivation, RecvGrad, RecvSkip, RecvSkipGrad)
P2P = SENDS + RECVS
#: The send whose transfer a gradient receive answers (posted no earlier than it).
_ANSWERS = {RecvGrad: SendActivation, RecvSkipGrad: SendSkip}


def peer_of(instruction: MicroBatchInstruction, stage: int, num_stages: int, chunks: int,
            placement: str = "loop") -> tuple[int, int] | None:
    """``(stage, chunk)`` a point-to-point instruction talks to, or ``None`` if none exists
    (a send past the last position, a receive before the first; a skip instruction whose
    ``peer`` position does not exist)."""
    if isinstance(instruction, SkipInstruction):
        if not 0 <= instruction.peer < num_stages * chunks:
            return None
        return locate(instruction.peer, num_stages, placement)
    forward = isinstance(instruction, (SendActivation, RecvGrad))
    return placement_peer(stage, instruction.chunk, 1 if forward else -1, num_stages, chunks,
                          placement)


_ROLES = frozenset(P2P)


def _route(ins: MicroBatchInstruction, stage: int, num_stages: int, chunks: int,
           placement: str, layout: Any) -> tuple[tuple[int, int] | None, bool, int | None]:
    """``(peer, local, lane)`` of a point-to-point instruction (see
    :class:`~pipekernel.schedules.program.Program`)."""
    if not 0 <= ins.chunk < chunks:
        return None, False, None
    peer = peer_of(ins, stage, num_stages, chunks, placement)
    if peer is None:
        return None, False, None
    if peer[0] == stage:
        return peer, True, None
    lane = layout.lane(channel_of(ins, stage, num_stages, placement))
    if lane is None:  # a skip edge nobody declared: no peer to talk to
        return None, False, None
    return peer, False, lane


def plan_posts(steps: Iterable[Sequence[Instruction]], stage: int, num_stages: int,
               chunks: int, placement: str, skips: Sequence[tuple[int, int]]
               ) -> tuple[list, ...]:
    """The posting plan of ``steps`` (see the module docstring) as the lists ``stream,
    step_of, posts, peers, local, lanes`` of a
    :class:`~pipekernel.schedules.program.Program`, each group of ``posts`` ascending.
    ``skips``: the sorted skip edges ``(producer, consumer)`` of the model; their two
    channels each get a lane, and their instructions are planned like the activations and
    gradients. Instructions the plan cannot place (a receive from no peer, an invalid
    chunk) are left to the simulator and the runtime to report, posted at their own index."""
    if not isinstance(steps, (list, tuple)):
        steps = list(steps)
    stream = list(chain.from_iterable(steps))
    # each instruction's step, all in C: no Python-level work per step
    step_of = list(chain.from_iterable(map(repeat, range(len(steps)), map(len, steps))))
    n = len(stream)
    peers: list[tuple[int, int] | None] = [None] * n
    local = [False] * n
    lanes: list[int | None] = [None] * n
    layout = lane_map(num_stages, chunks, placement, skips)
    # peer, locality and lane depend on (class, chunk, skip peer) only: work them out once
    seen: dict[tuple, tuple[tuple[int, int] | None, bool, int | None]] = {}
    sent_at: dict[tuple, int] = {}
    posts: list = [()] * n  # a point where nothing is posted: the one empty tuple
    recvs: list[int] = []  # the stream indices of the remote receives
    # by class, isinstance once: () (not point-to-point), else (a send, reads a skip
    # peer: getattr(ins, "peer", None) for every class but ours without one)
    kinds: dict[type, tuple[bool, ...]] = {
        cls: (cls in SENDS, issubclass(cls, SkipInstruction)) for cls in _ROLES}
    for i, ins in enumerate(stream):
        cls = type(ins)
        kind = kinds.get(cls)
        if kind is None:
            kind = kinds[cls] = (isinstance(ins, SENDS), True) if isinstance(ins, P2P) else ()
        if not kind:
            continue
        send, skip_peer = kind
        key = (cls, ins.chunk, getattr(ins, "peer", None) if skip_peer else None)
        found = seen.get(key)
        if found is None:
            found = seen[key] = _route(ins, stage, num_stages, chunks, placement, layout)
        peers[i], local[i], lanes[i] = found
        if cls is SendActivation or cls is SendSkip:
            sent_at[(cls, ins.chunk, ins.micro_batch, key[2])] = i
        if found[0] is None or found[1]:
            continue  # no peer, or a local hand-off: never posted
        if send:
            posts[i] = [i]  # at its own index, first in its group: the receives come after
        else:
            recvs.append(i)
    _post_receives(stream, recvs, peers, lanes, sent_at, posts)
    return stream, step_of, posts, peers, local, lanes


def _post_receives(stream: list, recvs: list[int], peers: list, lanes: list,
                   sent_at: dict[tuple, int], posts: list) -> None:
    """Add each remote receive to ``posts`` (see the module docstring): as early as its
    channel allows — after the receive before it on its (peer, lane), and for a gradient
    after the send it answers. In stream order, so each group stays ascending."""
    last_recv_on: dict[tuple[int, int], int] = {}  # (peer, lane) -> index of the last receive
    for i in recvs:
        ins = stream[i]
        answers = _ANSWERS.get(type(ins))
        earliest = 0 if answers is None else sent_at.get(
            (answers, ins.chunk, ins.micro_batch, getattr(ins, "peer", None)), i)
        channel = (peers[i][0], lanes[i])
        previous = last_recv_on.get(channel)
        if previous is not None and previous >= earliest:
            earliest = previous + 1
        last_recv_on[channel] = i
        at = earliest if earliest < i else i  # never negative: indices, or 0
        group = posts[at]
        if group:
            group.append(i)
        else:
            posts[at] = [i]
