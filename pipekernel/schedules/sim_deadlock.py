"""The rendezvous simulation's deadlock report (:mod:`pipekernel.schedules.sim_rendezvous`):
the stuck stages, what each waits for, and the wait-for cycle through units, peers and
collectives. Layer 0: no torch."""
from __future__ import annotations

from pipekernel.schedules.comm import RECVS
from pipekernel.schedules.sim_base import _END, _Simulation, _World
from pipekernel.schedules.sim_units import _Op, _Unit


class _DeadlockReport(_Simulation):
    """Mixed into :class:`~pipekernel.schedules.sim_rendezvous._Rendezvous`; reads its state."""

    # the rendezvous simulation's state this report reads (set by its ``__init__``/``_setup``)
    world: _World
    op_at: list[dict[int, _Op]]
    heads: list[list[_Unit | None]]
    flushed: list[bool]
    finished: list[bool]

    def _report_deadlock(self) -> None:
        self.deadlocked = True
        stuck = [s for s in range(self.S) if not self.finished[s]]
        lines = [self._where_stuck(s) for s in range(self.S)]
        cycle = self._cycle(stuck)
        self.problems.append(
            f"deadlock: stages {stuck} cannot progress:\n"
            + "\n".join(f"      {line}" for line in lines)
            + (f"\n    cycle: {cycle}" if cycle else "") + self._grid_so_far())
        self._check_micro_batches(only_excess=True)

    def _blocked_on(self, stage: int) -> tuple:
        """The node ``stage`` waits on: ``("op", op)`` or ``("coll", stage)``."""
        st = self.stages[stage]
        if st.pc < len(st.stream):
            _, i = st.stream[st.pc]
            if isinstance(i, RECVS):
                op = self.op_at[stage].get(st.pc)
                return ("op", op) if op is not None else ("local", stage)
            return ("coll", stage)
        if not self.flushed[stage]:
            return ("op", self._first_pending(stage))
        return ("coll", stage)

    def _first_pending(self, stage: int) -> _Op:
        heads = [u for u in self.heads[stage] if u is not None and u.post is not None]
        unit = min(heads, key=lambda u: u.ops[0].index)
        return next(op for op in unit.ops if op.done is None)

    def _collective_name(self, stage: int) -> str:
        st = self.stages[stage]
        if st.pc < len(st.stream):
            return f"the world collective {st.stream[st.pc][1]}"
        return _END

    def _where_stuck(self, stage: int) -> str:
        st = self.stages[stage]
        if self.finished[stage]:
            return f"stage {stage}: finished"
        node = self._blocked_on(stage)
        if st.pc < len(st.stream):
            index, i = st.stream[st.pc]
            head = f"stage {stage}: blocked at step {index} on {i}"
        elif node[0] == "op":
            head = f"stage {stage}: blocked at the end of the batch on its {node[1].ins}"
        else:
            head = f"stage {stage}: blocked in {_END}"
        text, following, joiner = self._edge(node)
        if joiner is not None and following is not None:  # _edge gives both or neither
            text += joiner + self._verb(following)
        if text[:3] in ("<- ", "-> "):
            text = text[3:]
        elif node[0] == "coll":
            text = text.removeprefix("for ")
        return f"{head}, waiting for {text}"

    def _edge(self, node: tuple) -> tuple[str, tuple | None, str | None]:
        """Why ``node`` cannot progress: ``(text, the node it waits on or None, joiner)``.

        With a ``joiner``, the text ends in ``"stage N"`` and reads on with what
        stage N waits on (:meth:`_verb`); without, it names the node it leads to."""
        kind, what = node
        if kind == "local":
            st = self.stages[what]
            return f"its own hand-off to {st.stream[st.pc][1]}, which never ran", None, None
        if kind == "coll":
            waiting = [s for s in range(self.S) if not self.world.waiting(s)]
            if not waiting:
                return "the other stages (mismatched collectives)", None, None
            return f"for stage {waiting[0]}", self._blocked_on(waiting[0]), ", which "
        op: _Op = what
        unit = op.unit
        if unit is not None and unit.post is not None and not unit.active:
            behind = next(o for o in unit.heads[unit.lane].ops if o.done is None)
            return f"queued behind {behind.name()}", ("op", behind), None
        mate = op.mate
        if mate is None:
            return (f"stage {op.peer} to post a matching {'receive' if op.send else 'send'}, "
                    "which it never does", None, None)
        arrow = "->" if op.send else "<-"
        if mate.unit is None or mate.unit.post is None:
            return (f"{arrow} {mate.name()}, not yet posted: stage {mate.rank}",
                    self._blocked_on(mate.rank), " ")
        behind = next(o for o in mate.unit.heads[mate.unit.lane].ops if o.done is None)
        return f"{arrow} {mate.name()}, queued behind {behind.name()}", ("op", behind), None

    def _verb(self, node: tuple) -> str:
        """What the stage of ``node`` does while blocked on it: ``"waits RECV_F0"``."""
        kind, what = node
        if kind == "coll":
            return f"waits in {self._collective_name(what)}"
        if kind == "local":
            return f"waits {self.stages[what].stream[self.stages[what].pc][1]}"
        return f"waits {what.ins}"

    def _cycle(self, stuck: list[int]) -> str:
        """The wait-for chain from the first stuck stage that reaches a cycle, rendered as
        ``stage 0 waits RECV_B0 <- stage 1's SEND_B0, queued behind ... (the cycle closes)``."""
        for start in stuck:
            first = self._blocked_on(start)
            out = f"stage {start} {self._verb(first)}"
            node: tuple | None = first
            seen: set[tuple] = set()
            while node is not None and self._key(node) not in seen:
                seen.add(self._key(node))
                text, following, joiner = self._edge(node)
                out += (", " if text.startswith("queued") else " ") + text
                if joiner is not None and following is not None:  # _edge gives both or neither
                    out += joiner + self._verb(following)
                node = following
            if node is not None:
                return out + " (the cycle closes)"
        return ""

    @staticmethod
    def _key(node: tuple) -> tuple:
        kind, what = node
        return (kind, id(what)) if kind == "op" else node
