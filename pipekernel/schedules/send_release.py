"""When a stage may wait a send without blocking: the release points of its sends (layer 0).

A host transport (gloo) reports a send complete only once it is waited, and ``wait()``
blocks until the peer has posted the matching receive. The runtime keeps each send's buffer
until it is waited, so a send nobody waits stays in memory until the step's end. An
activation's send is waited when its gradient comes back (the peer used it); a gradient's
send has no such answer. This module finds, from every stage's program, the first point at
which this stage *knows* the peer has posted the receive of a send: this stage receives a
message the peer posted at or after the point where it posted that receive (a stage posts
its groups in program order, so the receive was posted by then). Waiting there returns as
soon as the bytes are through, whatever the peer does next: no wait can deadlock, and the
send's buffer lives about as long as its transfer, not as long as the step.

:func:`release_points` is shared by the runtime (:class:`~pipekernel.stage.transfers.Transfers`)
and the memory model (:mod:`~pipekernel.schedules.sim_memory`), so what the model predicts
is what the runtime does.
"""
from __future__ import annotations

from collections.abc import Sequence

from pipekernel.schedules import instructions as isa
from pipekernel.schedules.program import _RECV_OF, Program

__all__ = ["release_points"]


def release_points(programs: Sequence[Program], stage: int) -> dict[int, tuple[int, ...]]:
    """``{receive index: send indices}`` of ``programs[stage]``: right after the receive at
    that stream index arrives, the sends listed may be waited without blocking on the peer
    (it posted their receives before it posted what just arrived). A remote send with no
    such receive after it (the step's last ones, or a peer that never answers) is absent:
    it is waited at the step's end as before.

    :param programs: every stage's program of one pipeline, indexed by stage (the same
        schedule, micro-batch count and lowering)."""
    mine = programs[stage]
    peers = {p[0] for i, p in enumerate(mine.peers) if p is not None and not mine.local[i]
             and 0 <= p[0] < len(programs)}
    # per peer: when it posted its receive of each of my sends, and its send of each of mine
    posted = {q: _posting_points(programs[q], stage) for q in peers}
    # my receives from each peer, in stream order, with when the peer posted their send
    arrivals: dict[int, list[tuple[int, int]]] = {}
    for r, q, n, key in _transfers(mine, peers, _RECVS, _SEND_OF):
        sent = posted[q][1].get(key, [])
        if n < len(sent):
            arrivals.setdefault(q, []).append((r, sent[n]))
    out: dict[int, list[int]] = {}
    for j, q, n, key in _transfers(mine, peers, _SENDS, _RECV_OF):
        received = posted[q][0].get(key, [])
        if n >= len(received):
            continue
        point = next((r for r, sent_at in arrivals.get(q, ()) if r > j
                      and sent_at >= received[n]), None)
        if point is not None:
            out.setdefault(point, []).append(j)
    return {r: tuple(js) for r, js in sorted(out.items())}


def _posting_points(theirs: Program, stage: int) -> tuple[dict[tuple, list[int]],
                                                          dict[tuple, list[int]]]:
    """``(receives, sends)`` of ``theirs`` with ``stage``: per ``(class, micro-batch, its
    chunk, stage's chunk)``, the posting point of each in stream order."""
    post_at = [0] * len(theirs.stream)
    for at, group in enumerate(theirs.posts):
        for k in group:
            post_at[k] = at
    recvs: dict[tuple, list[int]] = {}
    sends: dict[tuple, list[int]] = {}
    for k, ins in enumerate(theirs.stream):
        peer = theirs.peers[k]
        if peer is None or theirs.local[k] or peer[0] != stage \
                or not isinstance(ins, _RECVS + _SENDS):
            continue
        key: tuple = (type(ins), ins.micro_batch, ins.chunk, peer[1])
        (recvs if isinstance(ins, _RECVS) else sends).setdefault(key, []).append(post_at[k])
    return recvs, sends


def _transfers(mine: Program, peers: set[int], kinds: tuple, answer: dict) -> list[tuple]:
    """``(index, peer stage, n, key)`` of each of ``mine``'s remote ``kinds`` to ``peers``:
    ``key`` as the peer knows the matching transfer (``answer``: its class), ``n`` how
    many with that key came before (FIFO per key: the n-th matches the peer's n-th)."""
    out = []
    taken: dict[tuple, int] = {}
    for i, ins in enumerate(mine.stream):
        peer = mine.peers[i]
        if peer is None or mine.local[i] or not isinstance(ins, kinds) or peer[0] not in peers:
            continue
        key = (answer[type(ins)], ins.micro_batch, peer[1], ins.chunk)
        n = taken.get((peer[0], key), 0)
        taken[(peer[0], key)] = n + 1
        out.append((i, peer[0], n, key))
    return out


_SEND_OF = {recv: send for send, recv in _RECV_OF.items()}
#: the transfers matched across programs: activations and gradients (a skip's transfers
#: keep the old rule, waited at the step's end: their FIFO per key is not one channel's)
_SENDS = (isa.SendActivation, isa.SendGrad)
_RECVS = (isa.RecvActivation, isa.RecvGrad)
