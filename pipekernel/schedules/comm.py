"""The communication plan: when a stage posts each send and receive (layer 0: no torch).

The runtime does not post a transfer when it meets the instruction; it follows a
*plan* computed once per schedule from the stage's instruction stream, and the
simulator proves that same plan deadlock-free under rendezvous semantics (see
:mod:`pipekernel.schedules.simulator`). One function, :func:`plan_communication`,
decides for both, so what is proven is what runs.

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
* Every channel — one kind of traffic (activations or gradients) of one sending
  chunk in one direction between two stages — has its own **lane** (transport
  tag, :func:`lane_of`). A pair of ranks runs each lane's operations in order
  (NCCL: one stream per communicator), but lanes never wait for one another,
  and a lane carries one channel in one direction only: a receive posted early
  can never hold back an unrelated send, which is what deadlocks 1F1B when a
  pair shares one ordered stream (each side's send waits behind its own
  receive). The runtime never waits on a send before the batch ends, so under
  rendezvous sends the only waits are receives whose data the peer produces —
  the same dependencies as with buffered sends — and collectives.
  Posting is bounded by the receive's own position: at the latest it is posted
  right before it is waited on.
* Everything posted at one point of the stream is posted as **one group**
  (``Transport.batch_isend_irecv``), in stream order; a receive is waited on at
  its own instruction, a send only when the batch ends (or its buffer is needed).
* A transfer whose peer is the stage itself (one stage holding consecutive
  positions, e.g. the turn of a V) is a **local hand-off**: never posted.
* Skip connections (:mod:`pipekernel.schedules.skips`) are two more channels per
  edge, each with its own lane, planned by the same rules.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pipekernel.schedules.instructions import (
    Instruction, MicroBatchInstruction, RecvActivation, RecvGrad, RecvSkip, RecvSkipGrad,
    SendActivation, SendGrad, SendSkip, SendSkipGrad, SkipInstruction,
)
from pipekernel.schedules.placement import locate
from pipekernel.schedules.placement import peer as placement_peer
from pipekernel.schedules.skips import skip_edge_of, skip_lane

__all__ = ["CommPlan", "plan_communication", "peer_of", "lane_of", "lanes_needed", "SENDS",
           "RECVS", "P2P"]

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


def lane_of(instruction: MicroBatchInstruction, stage: int, peer: tuple[int, int]) -> int:
    """The lane (transport tag) of a point-to-point instruction of ``stage`` talking to
    ``peer = (stage, chunk)``: ``4 * sending chunk + 2 * kind + direction`` (kind 0 for
    activations, 1 for gradients; direction 0 when the sender's stage is the lower).
    Both sides compute the same lane from their own view of the transfer."""
    sending = isinstance(instruction, SENDS)
    sender_stage, sender_chunk = (stage, instruction.chunk) if sending else peer
    receiver_stage = peer[0] if sending else stage
    kind = 0 if isinstance(instruction, (SendActivation, RecvActivation)) else 1
    return 4 * sender_chunk + 2 * kind + (0 if sender_stage < receiver_stage else 1)


def lanes_needed(chunks: int, skip_edges: int = 0) -> int:
    """How many lanes (``Transport.max_tags``) a schedule with ``chunks`` needs, plus
    two per skip edge (:func:`pipekernel.schedules.skips.skip_lane`)."""
    return 4 * chunks + 2 * skip_edges


@dataclass(frozen=True)
class CommPlan:
    """One stage's instruction stream with its posting points.

    * ``stream``: the schedule's instructions, flattened in execution order;
      ``step_of[i]`` is the step ``stream[i]`` came from.
    * ``posts[i]``: the point-to-point instructions posted together, as one group,
      right before ``stream[i]`` runs (in stream order; a send appears at its own
      index, a receive at or before its own index). Local hand-offs never appear.
    * ``peers[i]``: ``(stage, chunk)`` of the peer of ``stream[i]`` if it is a
      point-to-point instruction with one, else ``None``.
    * ``local[i]``: ``True`` when ``stream[i]`` is a hand-off to or from this stage.
    * ``lanes[i]``: the lane (:func:`lane_of`) of a remote point-to-point
      instruction, else ``None``.
    """

    stage: int
    stream: tuple[Instruction, ...]
    step_of: tuple[int, ...]
    posts: tuple[tuple[Instruction, ...], ...]
    peers: tuple[tuple[int, int] | None, ...]
    local: tuple[bool, ...]
    lanes: tuple[int | None, ...] = ()

    def posted_at(self) -> dict[int, int]:
        """``{stream index of a remote p2p instruction: stream index where it is posted}``."""
        where, index_of = {}, {id(i): n for n, i in enumerate(self.stream)}
        for n, group in enumerate(self.posts):
            for instruction in group:
                where[index_of[id(instruction)]] = n
        return where


def plan_communication(steps: Iterable[Sequence[Instruction]], *, stage: int, num_stages: int,
                       chunks: int = 1, placement: str = "loop",
                       trains: bool | None = None,
                       skips: Sequence[tuple[int, int]] = ()) -> CommPlan:
    """The :class:`CommPlan` of ``stage`` for ``steps`` (see the module docstring).

    ``trains`` is accepted so that every posting policy (the simulator's
    ``posting=`` hook) has one signature; this policy does not need it.
    ``skips``: the sorted skip edges ``(producer, consumer)`` of the model
    (:func:`pipekernel.schedules.skips.check_skip_edges`); each gets two lanes of
    its own, and its instructions (inserted by
    :func:`~pipekernel.schedules.skips.add_skip_transfers`) are planned like the
    activations and gradients: a skip receive at once, a skip-gradient receive once
    the skip it answers was sent.

    Instructions the plan cannot place (a receive from no peer, a micro-batch
    instruction with an invalid chunk) are left to the simulator and the
    runtime to report; the plan then posts them at their own index.
    """
    stream, step_of = [], []
    for index, step in enumerate(steps):
        for instruction in step:
            stream.append(instruction)
            step_of.append(index)
    n = len(stream)
    peers: list[tuple[int, int] | None] = [None] * n
    local = [False] * n
    lanes: list[int | None] = [None] * n
    for i, ins in enumerate(stream):
        if isinstance(ins, P2P) and 0 <= ins.chunk < chunks:
            peers[i] = peer_of(ins, stage, num_stages, chunks, placement)
            local[i] = peers[i] is not None and peers[i][0] == stage
            if peers[i] is not None and not local[i]:
                if isinstance(ins, SkipInstruction):
                    lanes[i] = skip_lane(list(skips), skip_edge_of(ins, stage, num_stages,
                                                                   placement),
                                         isinstance(ins, (SendSkipGrad, RecvSkipGrad)), chunks)
                    if lanes[i] is None:  # an edge nobody declared: no peer to talk to
                        peers[i] = None
                else:
                    lanes[i] = lane_of(ins, stage, peers[i])
    sent_at = {(type(ins), ins.chunk, ins.micro_batch, getattr(ins, "peer", None)): i
               for i, ins in enumerate(stream) if isinstance(ins, (SendActivation, SendSkip))}
    posts: list[list[int]] = [[] for _ in range(n)]
    last_recv_on: dict[tuple[int, int], int] = {}  # (peer, lane) -> index of the last receive
    for i, ins in enumerate(stream):
        if isinstance(ins, SENDS) and peers[i] is not None and not local[i]:
            posts[i].append(i)
        if not (isinstance(ins, RECVS) and peers[i] is not None and not local[i]):
            continue
        answers = _ANSWERS.get(type(ins))
        if answers is None:
            earliest = 0
        else:
            earliest = sent_at.get((answers, ins.chunk, ins.micro_batch,
                                    getattr(ins, "peer", None)), i)
        channel = (peers[i][0], lanes[i])
        previous = last_recv_on.get(channel)
        if previous is not None:
            earliest = max(earliest, previous + 1)
        last_recv_on[channel] = i
        posts[min(max(earliest, 0), i)].append(i)
    return CommPlan(stage=stage, stream=tuple(stream), step_of=tuple(step_of),
                    posts=tuple(tuple(stream[j] for j in sorted(group)) for group in posts),
                    peers=tuple(peers), local=tuple(local), lanes=tuple(lanes))
