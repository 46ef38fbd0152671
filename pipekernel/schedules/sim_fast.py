"""The rendezvous simulation's fast path (:mod:`pipekernel.schedules.simulator`): a plan with
nothing to report, proved and timed from one compiled form per stage. Layer 0: no torch.

The full simulation (:class:`~pipekernel.schedules.sim_rendezvous._Rendezvous`) checks every
instruction as it runs it, so that a broken plan is reported with where it went wrong. Nearly
every plan it is asked about is a valid one, and what it checks per instruction — buffers,
forwards and backwards in order, micro-batches and chunks in range — depends on the stage's own
stream only, never on when the other stages run. So this path

1. checks each stage's stream once, on its own (:func:`_check_stage`: the same conditions the
   full simulation's handlers test, and the once-per-micro-batch counts), which also gives the
   stage's peak of live buffers;
2. turns the stage's program's plan (what the runtime posts) into *transfers*, one plain list each — ``[done, send posted, receive posted, next
   on its channel, send cost, receive cost, when the one before it was done, sender,
   receiver, ...]`` — matched per sender, receiver and lane in posting order as its second
   end is met. The runtime's lanes carry one channel per rank each
   (:mod:`~pipekernel.schedules.lanes`), so a unit of the full simulation is one end of one
   transfer, and a lane's order is its channel's: a transfer starts when both its ends are
   posted and the one before it on its channel is done (this path bails on a lane that
   carries two channels);
3. compiles each stage's stream into the few entries that move time (:func:`_code`): a compute
   instruction on the timeline, a posting point, a receive that waits, a local hand-off, a
   collective, a tick with a cost (a zero cost is left out: adding ``0.0`` changes no clock);
4. runs the entries under the full simulation's rules and arithmetic (the same expressions in
   the same order per stage, so every time is the same float), each stage until it blocks and
   again only once what it waits for has happened (:meth:`_Fast._loop`).

Whenever anything would be reported — a check fails, a transfer does not match, a collective
or a hand-off disagrees, the stages deadlock — or the plan holds what this path does not model
(a ``ForwardBackward``, an instruction class of its own), :meth:`_Fast.prove` returns ``None``
and the full simulation runs instead, which then reports exactly what it always did.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from operator import add

from pipekernel.schedules.sim_base import (
    _CODES, _END, B_INPUT, B_WEIGHT, BACKWARD, FORWARD, RECV_ACT, RECV_GRAD, SEND_ACT,
    SEND_GRAD, SKIP_RECV, SKIP_SEND, SimulationResult, _Simulation, _World, role, trains_of,
)
from pipekernel.schedules.skips import skip_edge_of

# the codes (:data:`~pipekernel.schedules.sim_base._CODES`, the one table) by what they do
_SEND_KINDS = frozenset((SEND_ACT, SEND_GRAD, SKIP_SEND))
_P2P_KINDS = _SEND_KINDS | {RECV_ACT, RECV_GRAD, SKIP_RECV}
_TIMELINE = frozenset((FORWARD, BACKWARD, B_INPUT, B_WEIGHT))
_SEND_CLASSES = frozenset(cls for cls, kind in _CODES.items() if kind in _SEND_KINDS)
_TIMELINE_CLASSES = tuple(cls for cls, kind in _CODES.items() if kind in _TIMELINE)
# the entries of a stage's code (_code), first element
_TL, _SPOST, _RPOST, _RECV, _TICK, _LSEND, _LRECV, _COLL = range(8)


class _Bail(Exception):
    """Something the full simulation would report (or this path does not model)."""


def _mismatch(k: int, members: dict) -> None:
    """Mismatched world collectives: the full simulation reports them."""
    raise _Bail


def _check_stage(stream: Sequence, limit: int, sizes: tuple, ends: tuple, trains: bool) -> int:
    """Check one stage's stream as the full simulation's handlers do (raise :class:`_Bail`
    where one would report a problem); return its peak number of live buffers.

    ``ends[chunk]`` is ``(has a previous position, has a next position)``."""
    micro_batches, chunks = sizes
    counts = [[0] * (micro_batches * chunks) for _ in range(6)]
    recv_act, forward, recv_grad, backward, b_input, b_weight = counts
    slots: dict[int, int] = {}
    peak = 0
    for ins in stream:
        kind = _CODES.get(type(ins))
        if kind is None or kind >= SKIP_SEND:  # not a micro-batch instruction, or a skip:
            if kind is not None and not (0 <= ins.micro_batch < micro_batches  # range only
                                         and 0 <= ins.chunk < chunks and 0 <= ins.buffer < limit):
                raise _Bail
            continue
        mb, buf, chunk = ins.micro_batch, ins.buffer, ins.chunk
        if not (0 <= mb < micro_batches and 0 <= chunk < chunks and 0 <= buf < limit):
            raise _Bail
        x = chunk * micro_batches + mb
        if kind <= FORWARD:  # writes its buffer
            if slots.setdefault(buf, x) != x:  # held by another part
                raise _Bail
            if len(slots) > peak:
                peak = len(slots)
            if kind == RECV_ACT:
                recv_act[x] += 1
            elif kind == FORWARD:
                if ends[chunk][0] and not recv_act[x]:
                    raise _Bail
                forward[x] += 1
                if not trains and not ends[chunk][1] and slots.get(buf) == x:
                    del slots[buf]
            continue
        if kind == SEND_GRAD:
            if not (backward[x] or b_input[x]):
                raise _Bail
            continue
        if slots.get(buf) != x:  # the rest read their buffer
            raise _Bail
        if kind == SEND_ACT:
            if not forward[x]:
                raise _Bail
            if not trains:
                del slots[buf]
        elif kind == RECV_GRAD:
            recv_grad[x] += 1
        else:
            _backward(kind, x, counts, ends[chunk][1], trains)
            if backward[x] or (b_input[x] and b_weight[x]):
                del slots[buf]
    _check_counts(counts, trains)
    return peak


def _backward(kind: int, x: int, counts: list, has_next: bool, trains: bool) -> None:
    """A backward's checks and counts (the full simulation's ``_on_backward``)."""
    _, forward, recv_grad, backward, b_input, b_weight = counts
    if not trains or not forward[x] or (has_next and not recv_grad[x]):
        raise _Bail
    if kind == BACKWARD:
        backward[x] += 1
    elif kind == B_INPUT:
        b_input[x] += 1
    else:
        b_weight[x] += 1
        if not b_input[x]:
            raise _Bail


def _check_counts(counts: list, trains: bool) -> None:
    """Every micro-batch forwarded once and, when training, backwarded once (one Backward,
    or one BackwardInput and one BackwardWeight)."""
    _, forward, _, backward, b_input, b_weight = counts
    ones = [1] * len(forward)
    if forward != ones:
        raise _Bail
    if trains and (list(map(add, backward, b_input)) != ones or b_input != b_weight):
        raise _Bail


class _Fast(_Simulation):
    """The fast path (see the module docstring): :meth:`prove` gives the result, or ``None``."""

    def __init__(self, num_stages, micro_batches, chunks, costs, programs, placement) -> None:
        self.S, self.M, self.C = num_stages, micro_batches, chunks
        self.placement, self.costs, self.programs = placement, costs, programs
        self.steps = tuple(program.steps for program in programs)
        self._peers = {}
        self.prices: dict[tuple[type, type], tuple[float, ...]] = {}  # _price
        self.lanes: list[list] = []  # stage -> the channels of its lanes

    def prove(self) -> SimulationResult | None:
        try:
            if any(c != c for table in (self.costs, self.host_costs, *self.stage_costs.values())
                   for c in table.values()):
                raise _Bail  # NaN: max() would depend on the order things happen in
            self.trains = trains_of(self.programs)
            peaks = self._setup()
            self._loop()
        except _Bail:
            return None
        return self._result_of(max(self.clock), self.timeline, peaks, self.wait)

    def _checked(self, stage: int, stream: tuple) -> int:
        limit = self.programs[stage].num_buffers
        ends = tuple((self._peer(stage, c, -1) is not None, self._peer(stage, c, 1) is not None)
                     for c in range(self.C))
        return _check_stage(stream, 1 << 62 if limit is None else limit, (self.M, self.C),
                            ends, self.trains)

    # -- setup: plans, transfers, code -------------------------------------------------

    def _setup(self) -> list[int]:
        """Each stage's program checked, its transfers placed and its code compiled; its peak
        of live buffers, per stage."""
        self.code: list[list] = []
        self.chans: dict[tuple, list] = {}  # (sender, receiver, lane) -> [transfers, sends, recvs]
        peaks = []
        for s, program in enumerate(self.programs):
            peaks.append(self._checked(s, program.stream))
            self.code.append(self._code(s, program))
        if any(chan[1] != chan[2] for chan in self.chans.values()):
            raise _Bail  # a send never received, or a receive nothing is sent to
        return peaks

    def _end(self, chan: list, send: bool, ins, chunk: int, stage: int, peer: int) -> list:
        """The transfer of ``chan`` that this send or receive is an end of: the next one its
        side has not met, made by whichever end comes first; the second end checks that the
        two match (micro-batch, the receiver's chunk, kind) and prices it."""
        transfers = chan[0]
        if send:
            k = chan[1]
            chan[1] = k + 1
        else:
            k = chan[2]
            chan[2] = k + 1
        if k < len(transfers):
            transfer = transfers[k]
            if send:
                si, ri, target = ins, transfer[9], chunk
            else:
                si, ri, target = transfer[9], ins, transfer[11]
            price = self.prices.get((type(si), type(ri)))
            if price is None:
                price = self._price(type(si), type(ri))
            if not price or si.micro_batch != ri.micro_batch or target != ri.chunk:
                raise _Bail
            transfer[4], transfer[5] = price
            transfer[9] = None
            return transfer
        sender, receiver = (stage, peer) if send else (peer, stage)
        transfer = [None, None, None, None, 0.0, 0.0, None if transfers else 0.0, sender,
                    receiver, ins, None, chunk]
        if transfers:
            transfers[-1][3] = transfer
        transfers.append(transfer)
        return transfer

    def _price(self, send: type, recv: type) -> tuple[float, ...]:
        """The costs of a send and a receive of these classes, ``()`` when their kinds
        differ; kept per pair of classes (a few per plan, read per transfer)."""
        price = self.prices[(send, recv)] = (
            (self.costs.get(send, 0.0), self.costs.get(recv, 0.0))
            if role(send).kind == role(recv).kind else ())
        return price

    def _code(self, stage: int, program) -> list:
        """The entries of ``stage``'s event loop (see the module docstring), in stream order:
        per instruction its send's host cost, the ends of transfers posted there, then what it
        does. Bails where one of the stage's lanes carries more than one channel (then a
        lane's units are not one transfer's end each)."""
        code: list[tuple] = []
        append = code.append
        stream, posts, peers, local, lanes = program.stream, program.posts, program.peers, \
            program.local, program.lanes
        host, chans = self.host_costs, self.chans
        # a compute's cost depends on its class and chunk only (the check has seen every
        # chunk in range): [class][chunk]
        cost_of = {cls: [self._compute_cost(stage, cls(0, 0, chunk)) for chunk in range(self.C)]
                   for cls in _TIMELINE_CLASSES}
        own: dict = {}  # lane -> (sends, peer, channel)
        waits: list[list | None] = [None] * len(stream)  # stream index of a remote receive -> its transfer
        for pc, ins in enumerate(stream):
            cls = type(ins)
            kind = _CODES.get(cls)
            group = posts[pc]
            if group:
                if host and kind in _SEND_KINDS and not local[pc] and host.get(cls, 0.0):
                    append((_TICK, host[cls]))  # a send is packed before its group leaves
                for at in group:
                    i = stream[at]
                    send = type(i) in _SEND_CLASSES
                    lane, (peer, chunk) = lanes[at], peers[at]
                    line = own.get(lane)
                    if line is None:
                        key = (stage, peer, lane) if send else (peer, stage, lane)
                        chan = chans.get(key)
                        if chan is None:
                            chan = chans[key] = [[], 0, 0]
                        line = own[lane] = (send, peer, chan)
                    elif line[0] is not send or line[1] != peer:
                        raise _Bail
                    transfer: list | None = self._end(line[2], send, i, chunk, stage, peer)
                    if not send:
                        waits[at] = transfer
                    append((_SPOST if send else _RPOST, transfer))
            if kind in _TIMELINE:
                append((_TL, ins, cost_of[cls][ins.chunk]))
            elif kind in _P2P_KINDS:
                transfer = waits[pc]
                if transfer is not None:
                    append((_RECV, transfer, host.get(cls, 0.0) if host else 0.0))
                elif peers[pc] is None or local[pc]:  # else a remote send: posted, no wait
                    self._local(stage, ins, kind, peers[pc], append)
            else:
                self._other(stage, ins, kind, append)
        self.lanes.append([line[2] for line in own.values()])
        return code

    def _local(self, stage: int, ins, kind: int, peer, append) -> None:
        """A hand-off to this stage itself, or bail (a transfer with no peer)."""
        if peer is None or (kind >= SKIP_SEND and skip_edge_of(
                ins, stage, self.S, self.placement) not in self.skips):
            raise _Bail
        channel = self._channel(stage, ins)
        if kind in _SEND_KINDS:
            append((_LSEND, channel, ins.micro_batch, peer[1]))
        else:
            append((_LRECV, channel, ins.micro_batch, ins.chunk))

    def _other(self, stage: int, ins, kind: int | None, append) -> None:
        """LoadMicroBatch, collectives and local blocking points; bail on what this path
        does not model (a ForwardBackward, a micro-batch instruction class of its own)."""
        r = role(type(ins))
        if kind is None and (r.paired or r.micro_batch or not r.instruction):
            raise _Bail
        if r.world:
            append((_COLL, ins))
            return
        cost = self._compute_cost(stage, ins)
        if cost:
            append((_TICK, cost))

    # -- the event loop ----------------------------------------------------------------

    def _loop(self) -> None:
        """Advance every stage until all finish; bail if none can progress (a deadlock).

        A stage runs until it blocks, and runs again only when what it waits for happens
        (``ready``): its receive's transfer done, its collective released, its last sends
        done. The times do not depend on the order the stages run in (each is the later of
        what it waits for, plus costs), so they are the full simulation's."""
        S = self.S
        self.pc, self.clock, self.wait = [0] * S, [0.0] * S, [0.0] * S
        self.timeline: list[list] = [[] for _ in range(S)]
        self.pending = [0] * S
        self.flushed, self.finished = [False] * S, [False] * S
        self.flushing = [False] * S  # at the end of its stream, waiting for its sends
        self.queues: list[dict] = [{} for _ in range(S)]
        finished, advance = self.finished, self._advance
        ready = self.ready = list(range(S - 1, -1, -1))
        self.world = _World(S, self.costs, _mismatch, woken=ready)
        while ready:
            s = ready.pop()
            if not finished[s]:
                advance(s)
        if not all(finished):
            raise _Bail  # a deadlock
        if any(queue for queues in self.queues for queue in queues.values()):
            raise _Bail  # a hand-off never received

    def _advance(self, stage: int) -> None:
        """Run ``stage``'s entries until it blocks or finishes (the full simulation's
        ``_advance``, on the compiled entries)."""
        code, pc, pending = self.code[stage], self.pc[stage], self.pending
        n = len(code)
        clock, wait, timeline = self.clock[stage], self.wait[stage], self.timeline[stage]
        for pc in range(pc, n):  # (a range: no compare and add of its own per entry)
            how = code[pc]
            kind = how[0]
            if kind is _TL:
                start, clock = clock, clock + how[2]
                timeline.append((start, clock, how[1]))
            # a send's and a receive's posting, written out apart (not one entry with its
            # slots as data): this loop runs once per instruction of every stage
            elif kind is _SPOST:  # post a send: its transfer runs once it heads its lanes
                transfer = how[1]
                transfer[1] = clock
                pending[stage] += 1
                if transfer[2] is not None and transfer[6] is not None:
                    self._complete(transfer)
            elif kind is _RPOST:
                transfer = how[1]
                transfer[2] = clock
                pending[stage] += 1
                if transfer[1] is not None and transfer[6] is not None:
                    self._complete(transfer)
            elif kind is _RECV:
                done = how[1][0]
                if done is None:
                    how[1][10] = stage  # woken when it is done
                    break
                start = clock if clock >= done else done
                wait += start - clock
                clock = start + how[2]
            elif kind is _TICK:
                clock = clock + how[1]
            else:
                self.clock[stage], self.wait[stage] = clock, wait
                if not self._blocking(stage, how):
                    break
                clock, wait = self.clock[stage], self.wait[stage]
        else:
            pc = n  # ran to the end (or had nothing left to run)
        self.pc[stage], self.clock[stage], self.wait[stage] = pc, clock, wait
        if pc == n:
            self._finish(stage)

    def _blocking(self, stage: int, how: tuple) -> bool:
        """A local hand-off or a world collective; ``False`` while it must wait."""
        kind, clock = how[0], self.clock[stage]
        if kind is _COLL:
            return self._collective(stage, how[1])
        queue = self.queues[stage].setdefault(how[1], deque())
        if kind is _LSEND:
            queue.append((how[2], how[3], clock))
            return True
        if not queue:
            return False
        micro_batch, chunk, ready = queue.popleft()
        if (micro_batch, chunk) != (how[2], how[3]):
            raise _Bail
        start = max(clock, ready)
        self.wait[stage] += start - clock
        self.clock[stage] = start
        return True

    def _complete(self, transfer: list) -> None:
        """Complete ``transfer`` (both ends posted, the one before it on its channel done)
        and each following one that is ready then: it starts when both its ends head their
        lanes — the later of its posts and the end of the transfer before it — and takes both
        ends' costs (the full simulation's ``_progress``, for units of one operation each)."""
        pending, flushing, ready = self.pending, self.flushing, self.ready
        while True:
            free, a, b = transfer[6], transfer[1], transfer[2]
            a = a if a >= free else free
            b = b if b >= free else free
            t = (a if a >= b else b) + transfer[4] + transfer[5]
            transfer[0] = t
            sender, receiver = transfer[7], transfer[8]  # each end one post fewer pending
            pending[sender] -= 1
            if flushing[sender] and not pending[sender]:
                ready.append(sender)
            pending[receiver] -= 1
            if flushing[receiver] and not pending[receiver]:
                ready.append(receiver)
            if transfer[10] is not None:
                ready.append(transfer[10])
            transfer = transfer[3]
            if transfer is None:
                return
            transfer[6] = t
            if transfer[1] is None or transfer[2] is None:
                return

    def _collective(self, stage: int, i: object) -> bool:
        """Enter (or keep waiting in) the next world collective; ``True`` once it is done."""
        clock = self.clock[stage]
        when = self.world.enter(stage, clock, i)
        if when is None:
            return False
        self.wait[stage] += when - clock
        self.clock[stage] = when
        return True

    def _finish(self, stage: int) -> None:
        """The end of the batch: wait for this stage's sends, then the loss all-reduce."""
        if not self.flushed[stage]:
            if self.pending[stage]:
                self.flushing[stage] = True
                return
            self.flushed[stage] = True
            last = max((chan[0][-1][0] for chan in self.lanes[stage]), default=0.0)
            clock = self.clock[stage]
            if last > clock:
                self.wait[stage] += last - clock
                self.clock[stage] = last
        if self._collective(stage, _END):
            self.finished[stage] = True
