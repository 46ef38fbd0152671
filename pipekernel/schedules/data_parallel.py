"""The data-parallel reducer's timing as instructions of a stage's program (layer 0: no torch).

A stage replicated over data-parallel ranks averages its gradients in buckets overlapped
with the batch's last backward (:class:`pipekernel.step.grad_reduce.GradReducer`). Its
three points are instructions, which the simulator times and the monitor sees:

* ``ArmGradReduce(chunk)`` right before the stage's last weight-gradient instruction
  (``Backward``, ``BackwardWeight`` or a ``ForwardBackward``): buckets start from gradient
  hooks as that backward fills them (``chunk``: its chunk; every other chunk's gradients
  are final already, so their buckets need not wait);
* ``LaunchGradReduce()`` after it and the sends that follow it in its step: every bucket
  not started yet but the tied weights' (the gradients of fp32 masters are written only
  after the backward). After the sends, as FSDP2's ``ReduceShardedGrads``: launched
  before them, its cost would hold up the peer waiting for the last gradient (the
  simulator showed it: 1F1B, 2 stages, 4 micro-batches, a launch of cost 3 made the step
  6 longer instead of 3);
* ``ReduceGrads()`` (in the schedule's last step already): start the rest, wait for all.

A program without a weight-gradient instruction (evaluation) gets none. FSDP2's own
reduction is :mod:`pipekernel.schedules.sharded`'s; when both apply these are added after
it, next to the weight-gradient instruction itself.
"""
from __future__ import annotations

from collections.abc import Sequence

from pipekernel.schedules.comm import SENDS
from pipekernel.schedules.instructions import (ArmGradReduce, ForwardBackward, Instruction,
                                               LaunchGradReduce, MicroBatchInstruction)
from pipekernel.schedules.sharded import WEIGHTS

__all__ = ["add_reduce_instructions"]


def add_reduce_instructions(steps: Sequence[Sequence[Instruction]]
                            ) -> tuple[tuple[Instruction, ...], ...]:
    """``steps`` with ``ArmGradReduce`` before the last weight-gradient instruction and
    ``LaunchGradReduce`` after it and its step's sends (see the module docstring); unchanged
    (as tuples) when there is none."""
    out = [tuple(step) for step in steps]
    for s in range(len(out) - 1, -1, -1):
        step = out[s]
        at = next((i for i in range(len(step) - 1, -1, -1) if isinstance(step[i], WEIGHTS)),
                  None)
        if at is None:
            continue
        last = step[at]
        half = last.backward if isinstance(last, ForwardBackward) else last
        chunk = half.chunk if isinstance(half, MicroBatchInstruction) else 0  # it is one
        end = at + 1
        while end < len(step) and isinstance(step[end], SENDS):
            end += 1
        out[s] = (step[:at] + (ArmGradReduce(chunk),) + step[at:end] + (LaunchGradReduce(),)
                  + step[end:])
        break
    return tuple(out)
