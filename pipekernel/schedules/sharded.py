"""FSDP2's timing as instructions of a sharded stage's program (layer 0: no torch).

A stage whose layers are sharded (``data_parallel_shard``, :mod:`pipekernel.grid.stage_parallel`)
runs, besides its schedule, what ``torch.distributed.pipelining`` calls ``UNSHARD``,
``RESHARD`` and ``REDUCE_GRAD``; :func:`add_shard_instructions` puts them in the program, so
that the simulator times them and the monitor sees them like any other instruction:

* ``Unshard()`` first: the stage's roots gathered (and, training, gradient sync deferred);
* after each compute instruction, ``Unshard(chunk, forward)`` for the next compute that
  gathers parameters (both halves of a pair): its first all-gather starts while this rank
  waits on its transfers. A weight pass gathers only at the first position, whose input pass
  has no inputs to differentiate, so that its weight pass runs the whole backward;
* training: ``ReduceShardedGrads()`` after the last weight-gradient instruction and the
  sends right after it (the peer waiting on them is not held up by the reduction:
  ``simulate(..., sharded=True)`` shows it, 1f1b 2 x 4 with the reduction costing 5: 20
  right after the backward, 15 after its send); evaluation: ``Reshard()`` last.
"""
from __future__ import annotations

from collections.abc import Sequence

from pipekernel.schedules.comm import SENDS
from pipekernel.schedules.instructions import (Backward, BackwardInput, BackwardWeight,
                                               Forward, ForwardBackward, Instruction,
                                               ReduceShardedGrads, Reshard, Unshard)

__all__ = ["add_shard_instructions", "COMPUTES", "WEIGHTS"]

#: the compute instructions after which the next one's parameters are gathered
COMPUTES = (Forward, Backward, BackwardInput, BackwardWeight, ForwardBackward)
#: what produces weight gradients (a pair's backward half is a Backward)
WEIGHTS = (Backward, BackwardWeight, ForwardBackward)


def add_shard_instructions(steps: Sequence[Sequence[Instruction]], *, trains: bool,
                           first_chunk: int | None) -> tuple[tuple[Instruction, ...], ...]:
    """``steps`` with a sharded stage's instructions added (see the module docstring), each
    in the step of the instruction it follows. ``first_chunk``: the stage's chunk at
    pipeline position 0, else ``None``."""
    flat = [ins for step in steps for ins in step]
    ahead: list[tuple[Instruction, ...]] = [()] * len(flat)
    upcoming = None
    for i in range(len(flat) - 1, -1, -1):
        ins = flat[i]
        if isinstance(ins, COMPUTES):
            ahead[i] = _gathers(upcoming)
            if not isinstance(ins, BackwardWeight) or ins.chunk == first_chunk:
                upcoming = ins
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
    if not out:
        out.append((Unshard(),))
    if not trains:
        out[-1] += (Reshard(),)
    return tuple(out)


def _gathers(upcoming: Instruction | None) -> tuple[Instruction, ...]:
    """The ``Unshard`` instructions that start ``upcoming``'s gathers."""
    if upcoming is None:
        return ()
    halves = upcoming.halves if isinstance(upcoming, ForwardBackward) else (upcoming,)
    return tuple(Unshard(half.chunk, isinstance(half, Forward)) for half in halves)
