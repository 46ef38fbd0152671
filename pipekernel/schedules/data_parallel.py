"""The data-parallel reducer's timing as instructions of a stage's program (layer 0: no torch).

A stage replicated over data-parallel ranks averages its gradients in buckets overlapped
with the batch's last backward (:class:`pipekernel.step.grad_reduce.GradReducer`). Its
three points are instructions, which the simulator times and the monitor sees:

* ``ArmGradReduce(chunk)`` right before the stage's last weight-gradient instruction
  (``Backward``, ``BackwardWeight`` or a ``ForwardBackward``): buckets start from gradient
  hooks as that backward fills them (``chunk``: its chunk; every other chunk's gradients
  are final already, so their buckets need not wait);
* ``LaunchGradReduce()`` right after it: every bucket not started yet but the tied weights'
  (the gradients of fp32 masters are written only after the backward);
* ``ReduceGrads()`` (in the schedule's last step already): start the rest, wait for all.

A program without a weight-gradient instruction (evaluation) gets none. FSDP2's own
reduction is :mod:`pipekernel.schedules.sharded`'s; when both apply these are added after
it, next to the weight-gradient instruction itself.
"""
from __future__ import annotations

from collections.abc import Sequence

from pipekernel.schedules.instructions import (ArmGradReduce, ForwardBackward, Instruction,
                                               LaunchGradReduce, MicroBatchInstruction)
from pipekernel.schedules.sharded import WEIGHTS

__all__ = ["add_reduce_instructions"]


def add_reduce_instructions(steps: Sequence[Sequence[Instruction]]
                            ) -> tuple[tuple[Instruction, ...], ...]:
    """``steps`` with ``ArmGradReduce`` and ``LaunchGradReduce`` around the last
    weight-gradient instruction, in its step (see the module docstring); unchanged
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
        out[s] = step[:at] + (ArmGradReduce(chunk), last, LaunchGradReduce()) + step[at + 1:]
        break
    return tuple(out)
