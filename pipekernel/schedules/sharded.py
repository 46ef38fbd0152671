"""FSDP2's timing as instructions of a sharded stage's program (layer 0: no torch).

A stage whose layers are sharded (``data_parallel_shard``, :mod:`pipekernel.grid.stage_parallel`)
runs what ``torch.distributed.pipelining`` calls ``UNSHARD``, ``RESHARD`` and ``REDUCE_GRAD``
as instructions of its program, which the simulator times and the monitor sees:

* ``Unshard()`` first: the stage's roots gathered (and gradient sync deferred);
* after each compute, ``Unshard(chunk, forward)`` for the next compute that gathers
  parameters (both halves of a pair; a weight pass only at position 0, whose input pass has
  no inputs to differentiate, so that its weight pass runs the whole backward);
* training: ``ReduceShardedGrads()`` after the last weight-gradient instruction and the sends
  right after it (the peer waiting on them is not held up: ``simulate(..., sharded=True)``,
  1f1b 2 x 4 with the reduction costing 5, makespan 20 before those sends, 15 after);
  evaluation: ``Reshard()`` last.
"""
from __future__ import annotations

from collections.abc import Sequence

from pipekernel.schedules.comm import SENDS
from pipekernel.schedules.instructions import (Backward, BackwardInput, BackwardWeight,
                                               Forward, ForwardBackward, Instruction,
                                               MicroBatchInstruction,
                                               ReduceShardedGrads, Reshard, Unshard)

__all__ = ["add_shard_instructions", "WEIGHTS"]

_COMPUTES = (Forward, Backward, BackwardInput, BackwardWeight, ForwardBackward)
#: what produces weight gradients (a pair's backward half is a Backward)
WEIGHTS = (Backward, BackwardWeight, ForwardBackward)


def add_shard_instructions(steps: Sequence[Sequence[Instruction]], *, trains: bool,
                           first_chunk: int | None) -> tuple[tuple[Instruction, ...], ...]:
    """``steps`` with a sharded stage's instructions added (see the module docstring), each
    in the step of the instruction it follows. ``first_chunk``: the stage's chunk at
    pipeline position 0, else ``None``."""
    flat = [ins for step in steps for ins in step]
    ahead: list[tuple[Instruction, ...]] = [()] * len(flat)
    upcoming: tuple[MicroBatchInstruction, ...] = ()  # the next compute's part(s)
    for i in range(len(flat) - 1, -1, -1):
        ins = flat[i]
        if isinstance(ins, _COMPUTES):
            ahead[i] = tuple(Unshard(half.chunk, isinstance(half, Forward)) for half in upcoming)
            if not isinstance(ins, BackwardWeight) or ins.chunk == first_chunk:
                upcoming = ins.halves if isinstance(ins, ForwardBackward) else (ins,)
    last = max((i for i, ins in enumerate(flat) if isinstance(ins, WEIGHTS)), default=-1) \
        if trains else -1
    out: list[tuple[Instruction, ...]] = []
    i, reduce_at = 0, -1
    for step in steps:
        new: list[Instruction] = [] if out else [Unshard()]
        for ins in step:
            new.append(ins)
            new += ahead[i]
            if i == last:
                reduce_at = len(new)
            elif i - 1 == last and reduce_at == len(new) - 1 and isinstance(ins, SENDS):
                reduce_at, last = len(new), i  # after the sends that follow it
            i += 1
        if reduce_at >= 0:
            new.insert(reduce_at, ReduceShardedGrads())
            reduce_at = -1
        out.append(tuple(new))
    out = out or [(Unshard(),)]
    if not trains:
        out[-1] += (Reshard(),)
    return tuple(out)
