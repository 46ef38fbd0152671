"""Lanes: which transfers share an ordered stream (layer 0: no torch).

A *lane* is one ordered stream per rank (:mod:`pipekernel.comm.transport`; on NCCL one
communicator): the operations a rank posts on one lane complete in posting order,
**whatever the peer**, and the operations of one posting group on one lane progress
together. Every rank's lane ``k`` is the same communicator, so both ends of a transfer
must use the same lane number.

A *channel* is one stream of transfers from one pipeline position to another: the
activations from position ``p`` to ``p + 1``, the gradients from ``p + 1`` to ``p``,
and, per skip edge ``(producer, consumer)``, the skips from the producer to the
consumer and their gradients back (:mod:`pipekernel.schedules.skips`). A channel whose
two positions live on the same stage is a local hand-off and needs no lane.

**The rule: at every rank, a lane carries exactly one channel.** A rank's operations
on one lane then all go to one peer in one direction, so "in posting order whatever
the peer" is the same as "in order per channel", and the plan's per-channel posting
(:mod:`pipekernel.schedules.comm`: a receive posted early can only wait for the
transfers before it on its own channel, which its peer sends in the same order) is
safe whatever the schedule. Sharing a lane between two channels at a rank couples
them by posting order: the lanes of an earlier version (``4 * chunk + 2 * kind +
direction``) gave a stage's receive from stage ``s - 1`` and its send to ``s + 1`` the
same lane, and 1F1B deadlocks from 4 stages x 5 micro-batches (stage 1's ``SEND_B0``
queues behind its early ``RECV_B1``; ``tests/test_lanes.py``).

Which lane each channel gets is an *edge colouring* of the channel graph (ranks are
vertices, channels edges; two channels meeting at a rank get different lanes): a rank
needs at least as many lanes as it has channels (``degree``), and every rank holds
every lane (one communicator per lane spans the world), so the pipeline needs at
least the largest degree. The colouring reaches that bound whenever the stages form
no odd cycle (any 1-chunk pipeline, the V placement, a loop over an even number of
stages: König's theorem, by alternating-path swaps); a loop over an odd number of
stages (3 stages x 2 chunks: every two links meet at a stage, so every lane carries
one channel of the whole pipeline: 10 lanes for a largest degree of 8) needs more,
and :func:`lane_map` records the lower bound it reached (``LaneMap.bound``).
Counts (``lanes_needed``): 1F1B, GPipe, ZB-H1 on 3+ stages 4 lanes (2 on 2 stages);
ZB-V 8 (4 on 2 stages); interleaved ``4 * chunks`` on an even number of stages; each
skip edge adds at most 2.

Why lanes numbered across the pipeline rather than one communicator per neighbour pair:
a pair's communicator orders everything between the two ranks in one stream, which
deadlocks 1F1B by itself (each side's send behind its own receive), so a pair would
still need one per channel — as many communicators per rank as ours wherever the
colouring meets the largest degree (every layout above but odd loops, which need 1 or 2
more), yet every rank of the job would create all of them (``new_group`` is
collective: 8 stages x 2 chunks, 30 two-rank groups instead of 8 lanes), and a lane
number alone would no longer name a communicator: the contract, the simulator and the
transports would need the peer too.

Every rank computes the same map from the same ``(num_stages, chunks, placement,
skips)`` (deterministic order, no randomness), so both ends agree without talking.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import combinations

from pipekernel.schedules.instructions import (
    Instruction, MicroBatchInstruction, RecvActivation, RecvGrad, RecvSkip, RecvSkipGrad, SendActivation, SendGrad,
    SendSkip, SendSkipGrad, SkipInstruction,
)
from pipekernel.schedules.placement import locate, position

__all__ = ["Channel", "LaneMap", "lane_map", "lanes_needed", "channel_of"]

#: ``(kind, sender position, receiver position)``; kind is ``"activation"``, ``"grad"``,
#: ``"skip"`` or ``"skip grad"``.
Channel = tuple[str, int, int]

# instruction class -> (kind, it sends, its position's offset to the peer's for act/grad)
_ROLE: dict[type[Instruction], tuple[str, bool, int]] = {SendActivation: ("activation", True, 1), RecvActivation: ("activation", False, -1),
         SendGrad: ("grad", True, -1), RecvGrad: ("grad", False, 1),
         SendSkip: ("skip", True, 0), RecvSkip: ("skip", False, 0),
         SendSkipGrad: ("skip grad", True, 0), RecvSkipGrad: ("skip grad", False, 0)}


def channel_of(instruction: Instruction, stage: int, num_stages: int,
               placement: str = "loop") -> Channel | None:
    """The channel a point-to-point instruction of ``stage`` sends on or receives from,
    or ``None`` for any other instruction."""
    role = _ROLE.get(type(instruction))
    if role is None or not isinstance(instruction, MicroBatchInstruction):
        return None
    kind, sends, delta = role
    own = position(stage, instruction.chunk, num_stages, placement)
    # a skip's peer is named (delta 0); an activation's or gradient's is the next/previous
    other = instruction.peer if isinstance(instruction, SkipInstruction) else own + delta
    return (kind, own, other) if sends else (kind, other, own)


@dataclass(frozen=True)
class LaneMap:
    """The lanes of one pipeline layout.

    * ``lanes``: ``{channel: lane}`` for every channel between two different stages;
    * ``count``: lanes the pipeline needs (``Transport.max_tags`` at least this many):
      ``max(lanes) + 1``, or 0 when nothing crosses stages;
    * ``degree``: per stage, the channels it takes part in (the lanes it uses);
    * ``bound``: a lower bound on ``count`` for any map that keeps one channel per lane
      at every rank (the largest degree, or more where the stages form odd cycles):
      ``count == bound`` proves the map uses no more lanes than needed.
    """

    lanes: dict[Channel, int] = field(repr=False)
    count: int
    degree: tuple[int, ...]
    bound: int

    def lane(self, channel: Channel | None) -> int | None:
        """The lane of ``channel``, or ``None`` for a channel the layout does not have."""
        return self.lanes.get(channel) if channel is not None else None


def lanes_needed(*, num_stages: int, chunks: int = 1, placement: str = "loop",
                 skips: Sequence[tuple[int, int]] = ()) -> int:
    """How many lanes (``Transport.max_tags``) a pipeline of ``num_stages`` x ``chunks``
    with skip edges ``skips`` uses (``lane_map(...).count``)."""
    return lane_map(num_stages, chunks, placement, skips).count


def lane_map(num_stages: int, chunks: int = 1, placement: str = "loop",
             skips: Sequence[Sequence[int]] = ()) -> LaneMap:
    """The :class:`LaneMap` of a layout (see the module docstring); ``skips``: the skip
    edges ``(producer, consumer)`` in any order (the map depends on the set only)."""
    edges = tuple(sorted({(int(a), int(b)) for a, b in skips}))
    return _lane_map(num_stages, chunks, placement, edges)


@lru_cache(maxsize=256)
def _lane_map(num_stages: int, chunks: int, placement: str,
              skips: tuple[tuple[int, int], ...]) -> LaneMap:
    remote = []
    for channel in _channels(num_stages * chunks, skips):
        ends = (locate(channel[1], num_stages, placement)[0],
                locate(channel[2], num_stages, placement)[0])
        if ends[0] != ends[1]:
            remote.append((channel, ends))
    colours = _colour([ends for _, ends in remote], num_stages)
    degree = [0] * num_stages
    for _, (a, b) in remote:
        degree[a] += 1
        degree[b] += 1
    return LaneMap(lanes={channel: c for (channel, _), c in zip(remote, colours)},
                   count=max(colours, default=-1) + 1, degree=tuple(degree),
                   bound=_lower_bound([ends for _, ends in remote], num_stages))


def _channels(positions: int, skips: Sequence[tuple[int, int]]) -> list[Channel]:
    """Every channel of the layout, in a fixed order: along the pipeline, then the skips."""
    out: list[Channel] = []
    for p in range(positions - 1):
        out += [("activation", p, p + 1), ("grad", p + 1, p)]
    for producer, consumer in skips:
        out += [("skip", producer, consumer), ("skip grad", consumer, producer)]
    return out


def _colour(edges: list[tuple[int, int]], vertices: int) -> list[int]:
    """A proper edge colouring of the multigraph ``edges`` (no two edges at one vertex
    share a colour) with as few colours as :func:`_lower_bound` allows when it can find
    one: :func:`_kempe` (optimal on bipartite graphs), else :func:`_exact`."""
    colour = _kempe(edges, vertices)
    bound = _lower_bound(edges, vertices)
    if max(colour, default=-1) + 1 > bound:
        classes = _exact(edges, vertices, max(colour) + 1)
        if classes is not None:
            colour = _assign(edges, classes)
    return colour


def _kempe(edges: list[tuple[int, int]], vertices: int) -> list[int]:
    """Each edge ``(u, v)`` takes a colour free at both ends; failing that, with ``a``
    free at ``u`` and ``b`` free at ``v``, the path from ``v`` whose edges alternate
    ``a``, ``b`` swaps its two colours, which frees ``a`` at ``v`` unless the path ends at
    ``u`` (only possible through an odd cycle); failing every pair, a new colour. Uses
    the largest degree colours on a bipartite graph (König)."""
    at: list[dict[int, int]] = [{} for _ in range(vertices)]  # vertex -> {colour: edge}
    colour: list[int] = [-1] * len(edges)
    degree = [0] * vertices
    for u, v in edges:
        degree[u] += 1
        degree[v] += 1
    k = max(degree, default=0)
    for e, (u, v) in enumerate(edges):
        while colour[e] < 0:
            free_u = [c for c in range(k) if c not in at[u]]
            free_v = [c for c in range(k) if c not in at[v]]
            common = next((c for c in free_u if c not in at[v]), None)
            if common is None:
                common = next((a for a in free_u for b in free_v
                               if _swap(edges, colour, at, u, v, a, b)), None)
            if common is None:
                k += 1
                continue
            colour[e] = common
            at[u][common] = at[v][common] = e
    return colour


def _exact(edges: list[tuple[int, int]], vertices: int, above: int,
           budget: int = 5000) -> list[tuple[tuple[int, int], ...]] | None:
    """Fewest colour classes (matchings of the links, as link lists) covering every
    link as often as it has edges, if fewer than ``above`` and found within ``budget``
    search nodes (deterministic); else ``None``. Depth-first over the matchings that
    hold the link with the most edges left, pruned by :func:`_lower_bound`."""
    links = sorted(set((min(u, v), max(u, v)) for u, v in edges))
    demand0 = tuple(sum(1 for u, v in edges if (min(u, v), max(u, v)) == link)
                    for link in links)
    failed: set[tuple[tuple[int, ...], int]] = set()
    nodes = 0

    odd_sets = _odd_sets(links, vertices)

    def bound(demand: tuple[int, ...]) -> int:
        return _bound(links, demand, vertices, odd_sets)

    def matchings(first: int, demand: tuple[int, ...]) -> list[tuple[int, ...]]:
        """Maximal matchings among the links still needed that hold ``links[first]``."""
        out: list[tuple[int, ...]] = []

        def grow(chosen: list[int], used: set[int], start: int) -> None:
            extended = False
            for i in range(start, len(links)):
                a, b = links[i]
                if demand[i] and i != first and a not in used and b not in used:
                    extended = True
                    grow(chosen + [i], used | {a, b}, i + 1)
            if not extended and not any(demand[i] and i not in chosen and
                                        links[i][0] not in used and links[i][1] not in used
                                        for i in range(start)):
                out.append(tuple(chosen))
        grow([first], set(links[first]), 0)
        return out

    def search(demand: tuple[int, ...], k: int) -> list[tuple[int, ...]] | None:
        nonlocal nodes
        if not any(demand):
            return []
        if k < bound(demand) or (demand, k) in failed or nodes > budget:
            return None
        nodes += 1
        first = max(range(len(links)), key=lambda i: demand[i])
        for matching in matchings(first, demand):
            rest = tuple(d - 1 if i in matching and d else d for i, d in enumerate(demand))
            found = search(rest, k - 1)
            if found is not None:
                return [matching, *found]
        failed.add((demand, k))
        return None

    best = None
    for k in range(bound(demand0), above):
        best = search(demand0, k)
        if best is not None or nodes > budget:
            break
    if best is None:
        return None
    return [tuple(links[i] for i in matching) for matching in best]


def _assign(edges: list[tuple[int, int]],
            classes: list[tuple[tuple[int, int], ...]]) -> list[int]:
    """Colour ``edges`` from matchings: the n-th edge of a link takes the n-th class
    that holds the link."""
    holding: dict[tuple[int, int], list[int]] = {}
    for c, matching in enumerate(classes):
        for link in matching:
            holding.setdefault(link, []).append(c)
    taken: dict[tuple[int, int], int] = {}
    colour = []
    for u, v in edges:
        link = (min(u, v), max(u, v))
        colour.append(holding[link][taken.get(link, 0)])
        taken[link] = taken.get(link, 0) + 1
    return colour


def _swap(edges, colour, at, u: int, v: int, a: int, b: int) -> bool:
    """Swap ``a`` and ``b`` along the ``a``/``b`` path from ``v`` unless it ends at ``u``;
    ``True`` once ``a`` is free at ``v``."""
    path, x, c = [], v, a
    while c in at[x]:
        f = at[x][c]
        path.append(f)
        s, t = edges[f]
        x = t if s == x else s
        c = b if c == a else a
    if x == u:
        return False
    for f in path:
        for end in edges[f]:
            at[end].pop(colour[f], None)
    for f in path:
        colour[f] = b if colour[f] == a else a
        for end in edges[f]:
            at[end][colour[f]] = f
    return True


def _lower_bound(edges: list[tuple[int, int]], vertices: int) -> int:
    """``max(largest degree, max over odd sets W of ceil(edges inside W / (|W| // 2)))``:
    a colour class holds at most one edge per vertex, so at most ``|W| // 2`` inside
    ``W`` (the fractional chromatic index, rounded up)."""
    links = sorted(set((min(u, v), max(u, v)) for u, v in edges))
    index = {link: i for i, link in enumerate(links)}
    demand = [0] * len(links)
    for u, v in edges:
        demand[index[(min(u, v), max(u, v))]] += 1
    return _bound(links, tuple(demand), vertices, _odd_sets(links, vertices))


def _odd_sets(links: list[tuple[int, int]], vertices: int) -> list[tuple[int, list[int]]]:
    """``(|W| // 2, indices of the links inside W)`` for every odd vertex set ``W`` of 3 or
    more vertices (none above 12 vertices: the bound is for small pipelines)."""
    if vertices > 12:
        return []
    out = []
    for size in range(3, vertices + 1, 2):
        for subset in combinations(range(vertices), size):
            inside = set(subset)
            held = [i for i, (u, v) in enumerate(links) if u in inside and v in inside]
            if len(held) > 1:
                out.append((size // 2, held))
    return out


def _bound(links: list[tuple[int, int]], demand: tuple[int, ...], vertices: int,
           odd_sets: list[tuple[int, list[int]]]) -> int:
    degree = [0] * vertices
    for (u, v), d in zip(links, demand):
        degree[u] += d
        degree[v] += d
    bound = max(degree, default=0)
    for half, held in odd_sets:
        bound = max(bound, -(-sum(demand[i] for i in held) // half))
    return bound
