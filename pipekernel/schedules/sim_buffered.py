"""``semantics="buffered"``: sends never block (the old, lenient model; see
:mod:`pipekernel.schedules.simulator`)."""
from __future__ import annotations

from collections import deque

from pipekernel.schedules.instructions import Instruction, MicroBatchInstruction
from pipekernel.schedules.sim_base import _RECVS, _SENDS, _kind, _Simulation


class _Buffered(_Simulation):
    """The lenient model: a send is buffered at once, a receive waits for its message."""

    semantics = "buffered"

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.channels: dict[tuple[int, int, str], deque] = {}

    def run(self) -> None:
        """Advance every stage until all finish or none can progress."""
        while not all(st.done for st in self.stages):
            moved = [self._advance(s) for s in range(self.S)]
            if not any(moved):
                self._report_deadlock()
                return
        self._check_complete()

    def _advance(self, stage: int) -> bool:
        """Run ``stage`` until it blocks or finishes; ``True`` if it executed anything."""
        st, moved = self.stages[stage], False
        while not st.done:
            index, instruction = st.stream[st.pc]
            if not self._execute(stage, index, instruction):
                break
            st.pc, moved = st.pc + 1, True
        return moved

    def _execute(self, stage: int, index: int, instruction: Instruction) -> bool:
        """Execute one instruction; ``False`` if it is a receive that must wait."""
        where = self._where(stage, index, instruction)
        if isinstance(instruction, MicroBatchInstruction) and not self._in_range(
                stage, where, instruction):
            return True
        if isinstance(instruction, _RECVS):
            return self._receive(stage, where, instruction)
        start = self.stages[stage].clock
        if isinstance(instruction, _SENDS):
            self._send(stage, where, instruction)
        self._run(stage, where, instruction)
        self._tick(stage, start, instruction)
        return True

    def _send(self, stage: int, where: str, i: MicroBatchInstruction) -> None:
        peer = self._peer_of(stage, i)
        if peer is None:
            self._no_peer(where, i)
            return
        queue = self.channels.setdefault((stage, peer[0], self._channel(stage, i)), deque())
        cost = self.costs.get(type(i), 0.0)
        queue.append((i.micro_batch, peer[1], self.stages[stage].clock + cost, where))

    def _receive(self, stage: int, where: str, i: MicroBatchInstruction) -> bool:
        kind, peer = _kind(i), self._peer_of(stage, i)
        if peer is None:
            self._no_peer(where, i)
            return True
        queue = self.channels.get((peer[0], stage, self._channel(stage, i)))
        if not queue:
            return False
        micro_batch, chunk, posted, sender = queue.popleft()
        if (micro_batch, chunk) != (i.micro_batch, i.chunk):
            self.problems.append(f"{where}: mismatched {kind}: the next message on channel "
                                 f"stage {peer[0]} -> stage {stage} is micro-batch {micro_batch} "
                                 f"chunk {chunk}, sent by {sender}")
        st = self.stages[stage]
        start = max(st.clock, posted)
        st.wait += start - st.clock
        self._run(stage, where, i)
        self._tick(stage, start, i)
        return True

    def _report_deadlock(self) -> None:
        self.deadlocked = True
        lines = [self._where_stuck(s) for s in range(self.S)]
        stuck = [s for s in range(self.S) if not self.stages[s].done]
        self.problems.append(
            f"deadlock: stages {stuck} cannot progress:\n"
            + "\n".join(f"      {line}" for line in lines) + self._grid_so_far())

    def _where_stuck(self, stage: int) -> str:
        st = self.stages[stage]
        if st.done:
            return f"stage {stage}: finished"
        index, i = st.stream[st.pc]
        kind, peer = _kind(i), self._peer_of(stage, i)
        return (f"stage {stage}: blocked at step {index} on {i}, waiting for stage {peer[0]} "
                f"to send the {kind} of micro-batch {i.micro_batch} chunk {i.chunk}")

    def _check_complete(self) -> None:
        for (src, dst, channel), queue in self.channels.items():
            kind = channel if isinstance(channel, str) else channel[0]
            for micro_batch, chunk, _, sender in queue:
                self.problems.append(f"{sender}: the {kind} of micro-batch {micro_batch} sent to "
                                     f"stage {dst} chunk {chunk} is never received")
        self._check_micro_batches()
