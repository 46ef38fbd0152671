"""The full simulation: every stage's :class:`~pipekernel.schedules.program.Program` run under
NCCL's rules, every instruction checked as it runs, so that a broken plan is reported with
where it went wrong (see :mod:`pipekernel.schedules.simulator`). Layer 0: no torch."""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Container

from pipekernel.errors import ScheduleError
from pipekernel.schedules.instructions import Instruction, MicroBatchInstruction
from pipekernel.schedules.comm import RECVS, SENDS
from pipekernel.schedules.program import Program
from pipekernel.schedules.sim_deadlock import _DeadlockReport
from pipekernel.schedules.sim_base import (WORLD_COLLECTIVES, _END, _kind, PAIRED, _Progress,
                                           _Simulation, _Where, _World, role)
from pipekernel.schedules.sim_units import _Op, _Unit, _units


# how _advance runs one instruction (_Rendezvous._compile)
_RUN, _SEND, _RECV, _TICK, _SLOW = "run", "send", "recv", "tick", "slow"


class _Rendezvous(_DeadlockReport, _Simulation):
    """Each stage runs its Program; sends rendezvous, a rank's lane completes in order."""

    #: another posting policy to prove instead of the programs' own plans (simulate's
    #: ``posting=``), called like :func:`~pipekernel.schedules.program.plan_communication`
    posting: Callable[..., Program] | None = None

    def __init__(self, *args) -> None:
        super().__init__(*args)
        # (stage, channel) -> the local hand-offs waiting there
        self.local: dict[tuple[int, object], deque] = {}
        self.world = _World(self.S, self.costs, self._mismatched_collective)

    # -- setup: plans, static matching -------------------------------------------------

    def _setup(self) -> None:
        n_stages = self.S
        self.plans: list[Program] = []
        # stage -> stream index -> [(lane, the group's ops on that lane)]
        self.groups: list[list[tuple[_Unit, ...]]] = []  # stage -> index -> units posted
        self.op_at: list[dict[int, _Op]] = []
        self.heads: list[list[_Unit | None]] = []  # stage -> lane -> the unit heading it
        self.last_end: list[list[float]] = []  # stage -> lane -> when its last unit ended
        self.pending = [0] * n_stages  # posted, not yet completed ops per stage
        self.flushed = [False] * n_stages
        self.finished = [False] * n_stages
        self.posted_upto = [-1] * n_stages
        self.end_time = [0.0] * n_stages
        # (sender, receiver, lane) -> its ops, in posting order
        sends: dict[tuple[int, int, int | None], list[_Op]] = {}
        recvs: dict[tuple[int, int, int | None], list[_Op]] = {}
        for s, st in enumerate(self.stages):
            plan = self._plan(s)
            self.plans.append(plan)
            groups, op_at = self._place_posts(s, plan)
            self.op_at.append(op_at)
            units, heads, ends = _units(groups, len(st.stream))
            self.groups.append(units)
            self.heads.append(heads)
            self.last_end.append(ends)
            for group in units:
                for unit in group:
                    for op in unit.ops:
                        if op.send:
                            sends.setdefault((s, op.peer, op.lane), []).append(op)
                        else:
                            recvs.setdefault((op.peer, s, op.lane), []).append(op)
        self._match(sends, recvs)
        self.code = [self._compile(s) for s in range(n_stages)]
        self.send_host = [[self._send_host_cost(s, i) for _, i in st.stream]
                          if self.host_costs else None for s, st in enumerate(self.stages)]

    def _plan(self, stage: int) -> Program:
        """The stage's plan: its program's own (what the runtime runs), or the ``posting``
        policy's for the program's steps."""
        if self.posting is None:
            return self.programs[stage]
        extra = {"skips": self.skips} if self.skips else {}
        return self.posting(self.steps[stage], stage=stage, num_stages=self.S, chunks=self.C,
                            placement=self.placement, trains=self.trains, **extra)

    def _match(self, sends: dict[tuple, list[_Op]], recvs: dict[tuple, list[_Op]]) -> None:
        """Pair each (sender, receiver, lane)'s sends and receives in posting order, each
        pair given its cost, and report what does not match."""
        costs = self.costs
        targets: dict[tuple, int | None] = {}  # (stage, class, chunk, skip peer) -> peer chunk
        for key in sorted(set(sends) | set(recvs), key=repr):
            out, into = sends.get(key, []), recvs.get(key, [])
            for send, recv in zip(out, into):
                send.mate, recv.mate = recv, send
                si, ri = send.ins, recv.ins
                cs, cr = type(si), type(ri)
                send.cost_send = recv.cost_send = costs.get(cs, 0.0)
                send.cost_recv = recv.cost_recv = costs.get(cr, 0.0)
                where = (send.rank, cs, si.chunk, getattr(si, "peer", None))
                target = targets.get(where)
                if target is None:
                    target = targets[where] = self._peer_chunk(send.rank, si)
                if not (si.micro_batch == ri.micro_batch and target == ri.chunk
                        and role(cs).kind == role(cr).kind):
                    self._check_pair(send, recv)  # reports the mismatch
            for send in out[len(into):]:
                self.problems.append(
                    f"{send.where()}: the {_kind(send.ins)} of micro-batch "
                    f"{send.ins.micro_batch} sent to stage {send.peer} chunk "
                    f"{self._peer_chunk(send.rank, send.ins)} is never received "
                    f"(stage {send.peer} posts only {len(into)} receive(s) from stage "
                    f"{send.rank})")
            for recv in into[len(out):]:
                self.problems.append(
                    f"{recv.where()}: nothing is ever sent to it (stage {recv.peer} posts only "
                    f"{len(out)} send(s) to stage {recv.rank})")

    def _place_posts(self, stage: int, plan: Program
                     ) -> tuple[dict[int, list[_Op]], dict[int, _Op]]:
        """Turn ``plan.posts`` (stream indices) into ops by stream index, checking the plan
        itself."""
        stream, n = self.stages[stage].stream, len(self.stages[stage].stream)
        if len(plan.stream) != n or len(plan.posts) != n or len(plan.peers) != n:
            raise ScheduleError(f"stage {stage}: the posting plan covers {len(plan.stream)} "
                                f"instruction(s), the stream has {n}",
                                hint="a posting= function must plan the steps it is given",
                                stage=stage)
        peers, local, chunks = plan.peers, plan.local, self.C
        # stream index of each transfer to another stage -> (its peer stage, the transfer)
        remote: dict[int, tuple[int, MicroBatchInstruction]] = {
            i: (peer[0], ins) for i, ((_, ins), peer, here) in enumerate(zip(stream, peers, local))
            if peer is not None and not here  # most are None: tested first
            and isinstance(ins, MicroBatchInstruction) and role(type(ins)).p2p
            and 0 <= ins.chunk < chunks}
        lanes = tuple(getattr(plan, "lanes", ()) or ())
        if len(lanes) != n:
            lanes = (None,) * n
        groups: dict[int, list[_Op]] = {}
        op_at: dict[int, _Op] = {}
        for g, group in enumerate(plan.posts):
            for at in group:
                if isinstance(at, int) and at >= g and at in remote and at not in op_at:
                    step, (peer, ins) = stream[at][0], remote[at]  # a well-formed post
                    send = role(type(ins)).send
                    if send and at != g:
                        self.problems.append(f"{self._where(stage, step, ins)}: the posting "
                                             "plan posts a send before its data exists")
                    op = op_at[at] = _Op(stage, peer, lanes[at], at, step, ins, send)
                    if g in groups:
                        groups[g].append(op)
                    else:
                        groups[g] = [op]
                else:
                    self._bad_post(stage, g, at, remote, op_at)
        for i, (peer, ins) in remote.items():
            if i not in op_at:  # a plan that forgot it: post it at its index
                step = stream[i][0]
                self.problems.append(f"{self._where(stage, step, ins)}: the posting "
                                     "plan never posts it")
                op = op_at[i] = _Op(stage, peer, lanes[i], i, step, ins, role(type(ins)).send)
                groups.setdefault(i, []).append(op)
        return groups, op_at

    def _bad_post(self, stage: int, g: int, at: object, is_remote: Container[int],
                  op_at: dict[int, _Op]) -> None:
        """Report a post of the plan at stream index ``g`` that is not a remote transfer's
        first post at or after its place (it is then left out)."""
        stream = self.stages[stage].stream
        n = len(stream)
        ins = stream[at][1] if isinstance(at, int) and 0 <= at < n else at
        problem = ("is not a stream index (Program.posts holds the indices of the "
                   "instructions posted)" if not isinstance(at, int)
                   else "is not a point-to-point instruction to another stage"
                   if at not in is_remote else "is posted twice" if at in op_at
                   else "runs before that")
        self.problems.append(f"stage {stage}: the posting plan posts {ins} (stream "
                             f"index {at}) at stream index {g}, but it {problem}")

    def _check_pair(self, send: _Op, recv: _Op) -> None:
        s, r = send.ins, recv.ins
        target = self._peer_chunk(send.rank, s)
        same_kind = role(type(s)).kind == role(type(r)).kind
        if same_kind and s.micro_batch == r.micro_batch and target == r.chunk:
            return
        source = self._peer_chunk(recv.rank, r)
        self.problems.append(
            f"{recv.where()}: mismatched {_kind(r)}: transfers from stage {send.rank} to stage "
            f"{recv.rank} match in posting order on their lane, whatever they say, and this "
            f"receive "
            f"(of micro-batch {r.micro_batch} chunk {r.chunk}, from chunk {source}) "
            f"meets {send.where()}, which sends the {_kind(s)} of micro-batch "
            f"{s.micro_batch} chunk {target}")

    def _peer_chunk(self, stage: int, i: MicroBatchInstruction) -> int | None:
        """The chunk at the other end of ``stage``'s transfer ``i`` (``None``: no peer)."""
        peer = self._peer_of(stage, i)
        return None if peer is None else peer[1]

    # -- transfers ---------------------------------------------------------------------

    def _post(self, stage: int, units: tuple[_Unit, ...], at: float) -> None:
        """Post ``units`` (``stage``'s group, one unit per lane) at time ``at``."""
        todo: list[_Op] = []
        posted = 0
        for unit in units:
            unit.post = unit.end = at
            ops = unit.ops
            posted += len(ops)
            k = unit.lane
            if unit.heads[k] is unit:  # it heads its lane: it may progress from now on
                unit.active = True
                free = unit.ends[k]
                unit.start = at if at >= free else free
                todo += ops
        self.pending[stage] += posted
        if todo:
            self._progress(todo)

    def _progress(self, todo: list[_Op]) -> None:
        """Complete every transfer that can complete now, and what that unblocks: a
        transfer starts when both its units head their lanes and takes both ends' costs;
        a unit done hands its lane to the next one (which starts no earlier than it
        ends)."""
        pending = self.pending
        while todo:
            op = todo.pop()
            mate = op.mate
            if op.done is not None or mate is None:
                continue
            unit, other = op.unit, mate.unit
            if unit is None or other is None or not (unit.active and other.active):
                continue
            a, b = unit.start, other.start
            t = (a if a >= b else b) + op.cost_send + op.cost_recv
            op.done = mate.done = t
            for o, u in ((op, unit), (mate, other)):
                pending[o.rank] -= 1
                if t > u.end:
                    u.end = t
                u.left -= 1
                if u.left == 0:  # it hands its lane to the next unit, if that is posted
                    k, following = u.lane, u.next
                    end = u.ends[k] = u.end
                    u.heads[k] = following
                    if following is not None and following.post is not None:
                        following.active = True
                        post = following.post
                        following.start = post if post >= end else end
                        todo += following.ops

    # -- the event loop ----------------------------------------------------------------

    def run(self) -> None:
        self._setup()
        try:
            while not all(self.finished):
                moved = False
                for s in range(self.S):
                    if not self.finished[s] and self._advance(s):
                        moved = True
                if not moved:
                    self._report_deadlock()
                    return
            self._check_complete()
        finally:
            self._unlink()

    def _unlink(self) -> None:
        """Break the cycles between the ops and their units and mates, once nothing reads
        them: reference counting then frees them as the simulation ends, instead of the
        cyclic collector (off while it runs) scanning them all when it is back on."""
        for ops in self.op_at:
            for op in ops.values():
                op.mate = op.unit = None
        for heads in self.heads:  # a unit still heading its lane (a deadlock) and its list
            heads.clear()
        self.groups, self.code, self.heads = [], [], []

    def _compile(self, stage: int) -> list[tuple]:
        """Per stream index, how :meth:`_advance` runs the instruction: ``(_RUN, index,
        instruction, progress, writes a buffer, handler, cost, on the timeline)`` for a
        compute or other micro-batch instruction, ``(_SEND, index, instruction, progress,
        writes, handler, None, 0.0)`` / ``(_RECV, index, instruction, progress, writes, handler, op,
        host cost)`` for a transfer to or from another stage, ``(_TICK, index,
        instruction, cost)`` for a local blocking point, and ``(_SLOW, index,
        instruction)`` for the rest (collectives, hand-offs, anything with a problem to
        report), which :meth:`_execute` runs as it always did. Everything here is fixed
        before the batch starts (the stream, the peers, the costs), so the answers are the
        same as looking them up per instruction."""
        out: list[tuple] = []
        ops, host, progress = self.op_at[stage], self.host_costs, self.progress
        remote: dict[tuple, bool] = {}  # (class, chunk, skip peer) -> talks to another stage
        costs: dict[tuple, float] = {}  # (class, chunk) -> compute cost
        limit = self.stages[stage].num_buffers
        limit = 1 << 62 if limit is None else limit
        micro_batches, chunks = self.M, self.C
        for pc, (index, i) in enumerate(self.stages[stage].stream):
            cls = type(i)
            r = role(cls)
            if not isinstance(i, MicroBatchInstruction):  # r.micro_batch, which mypy sees
                out.append((_SLOW, index, i) if r.world or r.paired
                           else (_TICK, index, i, self._compute_cost(stage, i)))
                continue
            chunk = i.chunk
            if not (0 <= i.micro_batch < micro_batches and 0 <= chunk < chunks
                    and 0 <= i.buffer < limit):  # _in_range would report it
                out.append((_SLOW, index, i))
                continue
            at = (stage, chunk, i.micro_batch)  # what _run looks up (_prepared)
            p = progress.get(at)
            if p is None:
                p = progress[at] = _Progress()
            if not r.p2p:
                priced = (cls, chunk)
                cost = costs.get(priced)
                if cost is None:
                    cost = costs[priced] = self._compute_cost(stage, i)
                out.append((_RUN, index, i, p, r.writes, r.handler, cost, r.compute))
                continue
            key = (cls, chunk, getattr(i, "peer", None))
            far = remote.get(key)
            if far is None:
                peer = self._peer_of(stage, i)
                far = remote[key] = peer is not None and peer[0] != stage
            op = ops.get(pc) if far else None
            if op is None:
                out.append((_SLOW, index, i))
            elif op.send:
                out.append((_SEND, index, i, p, r.writes, r.handler, None, 0.0))
            else:
                out.append((_RECV, index, i, p, r.writes, r.handler, op, host.get(cls, 0.0)))
        return out

    def _advance(self, stage: int) -> bool:
        """Run ``stage`` until it blocks or finishes; ``True`` if anything happened.

        What :meth:`_execute` does, with what it looks up found once (:meth:`_compile`):
        the one loop every instruction of the batch goes through (what :meth:`_post` and
        :meth:`_run_prepared` do, inline; the clock and the wait in locals, written back
        before anything else reads them)."""
        st, moved = self.stages[stage], False
        n, groups = len(st.stream), self.groups[stage]
        code, send_host = self.code[stage], self.send_host[stage]
        timeline, write, post = st.timeline, self._write_buffer, self._post
        pc, clock, wait = st.pc, st.clock, st.wait
        fresh = self.posted_upto[stage] < pc  # resumed at an instruction not posted yet
        while pc < n:
            if fresh:
                if send_host:  # a send is packed before its group leaves
                    clock += send_host[pc]
                if groups[pc]:
                    post(stage, groups[pc], clock)
                moved = True
            how = code[pc]
            kind = how[0]
            if kind is _TICK:
                clock = clock + how[3]
            elif kind is _SLOW:
                st.pc, st.clock, st.wait = pc, clock, wait  # _execute and the report read them
                if not self._execute(stage, pc, how[1], how[2]):
                    self.posted_upto[stage] = pc
                    return moved
                clock, wait = st.clock, st.wait
            else:  # _RUN (x: cost, y: on the timeline), _SEND, _RECV (x: op, y: host cost)
                _, index, ins, p, writes, handler, x, y = how
                if kind is _RECV:
                    done = x.done
                    if done is None:
                        st.pc = self.posted_upto[stage] = pc
                        st.clock, st.wait = clock, wait
                        return moved
                    start = clock if clock >= done else done
                    wait += start - clock
                    clock = start + y
                where = _Where((stage, index, ins))
                if writes:
                    write(stage, where, ins)
                if handler is not None:
                    handler(self, stage, where, ins, p)
                if kind is _RUN:
                    start, clock = clock, clock + x
                    if y:
                        timeline.append((start, clock, ins))
            pc, moved, fresh = pc + 1, True, True
        st.pc = self.posted_upto[stage] = pc
        st.clock, st.wait = clock, wait
        return self._finish(stage) or moved

    def _send_host_cost(self, stage: int, i: Instruction) -> float:
        if not isinstance(i, SENDS) or not (0 <= i.micro_batch < self.M and 0 <= i.chunk < self.C):
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
            if isinstance(i, RECVS):
                return self._receive(stage, pc, where, i)
            if isinstance(i, SENDS):
                self._send(stage, pc, where, i)
                return True
            start = st.clock
            self._run(stage, where, i)
            self._tick(stage, start, i)
            return True
        if isinstance(i, WORLD_COLLECTIVES):
            return self._collective(stage, self._where(stage, index, i), i)
        if isinstance(i, PAIRED):  # both halves, then both on the timeline
            start = st.clock
            self._run(stage, self._where(stage, index, i), i)
            self._tick(stage, start, i)
            return True
        self._tick(stage, st.clock, i)  # ReduceGrads and the rest: a local blocking point
        return True

    def _send(self, stage: int, pc: int, where: _Where, i: MicroBatchInstruction) -> None:
        peer = self._peer_of(stage, i)
        if peer is None:
            self._no_peer(where, i)
            return
        self._run(stage, where, i)
        if peer[0] == stage:  # a local hand-off: done at once
            queue = self.local.setdefault((stage, self._channel(stage, i)), deque())
            queue.append((i.micro_batch, peer[1], self.stages[stage].clock, where))

    def _receive(self, stage: int, pc: int, where: _Where, i: MicroBatchInstruction) -> bool:
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

    def _collective(self, stage: int, where: _Where | str, i: object) -> bool:
        """Enter (or keep waiting in) the next world collective; ``True`` once it is done."""
        st = self.stages[stage]
        when = self.world.enter(stage, st.clock, i, where)
        if when is None:
            return False
        st.wait += when - st.clock
        st.clock = when
        return True

    def _mismatched_collective(self, k: int, members: dict[int, tuple]) -> None:
        listed = ", ".join(f"stage {s} is in {i if i is _END else w}"
                           for s, (_, i, w) in sorted(members.items()))
        self.problems.append(f"mismatched world collective #{k + 1}: {listed}")

    def _finish(self, stage: int) -> bool:
        """The end of the batch: wait for this stage's sends, then the loss all-reduce."""
        st = self.stages[stage]
        moved = False
        if not self.flushed[stage]:
            if self.pending[stage]:
                return False
            self.flushed[stage] = True
            last = max(self.last_end[stage], default=0.0)
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
            # a kind, or a skip's (kind, (producer, consumer)) (_channel)
            kind = f"{channel[0]} {channel[1][0]}->{channel[1][1]}" \
                if isinstance(channel, tuple) else str(channel)
            for micro_batch, chunk, _, sender in queue:
                self.problems.append(f"{sender}: the {kind} of micro-batch {micro_batch} handed "
                                     f"to chunk {chunk} of the same stage is never received")
        self._check_micro_batches()
