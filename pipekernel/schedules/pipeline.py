"""The built-in pipeline schedules: 1F1B, GPipe and inference (layer 0: no torch).

Every schedule here emits one compute instruction per step, together with the
communication and data loading that belong to it, in this order::

    forward step:  [LoadMicroBatch]  [RecvActivation]  Forward  [SendActivation]
    backward step: [RecvGrad]  Backward  [SendGrad]

* ``LoadMicroBatch`` is emitted on the first stage (inputs) and on the last
  stage (labels); a one-stage pipeline emits it once. Middle stages never load.
* ``RecvActivation`` on every stage but the first, ``SendActivation`` on every
  stage but the last; ``RecvGrad`` on every stage but the last, ``SendGrad`` on
  every stage but the first.
* A training schedule's last step ends with ``ReduceTiedGrads``,
  ``ReduceGrads``, ``OptimizerStep`` (in that order) on every stage.

Sends rendezvous with their receives (NCCL): the runtime posts each transfer
as :func:`pipekernel.schedules.comm.plan_posts` plans (receives posted
ahead, one ordered lane per channel), and
:func:`pipekernel.schedules.simulator.simulate` proves that these orders never
deadlock under those rules, for any size.
"""
from __future__ import annotations

from pipekernel.schedules.instructions import (
    Backward, Forward, Instruction, LoadMicroBatch, OptimizerStep, RecvActivation, RecvGrad,
    ReduceGrads, ReduceTiedGrads, SendActivation, SendGrad,
)
from pipekernel.schedules.base import Schedule
from pipekernel.schedules.placement import check_placement

__all__ = ["OneFOneB", "GPipe", "Inference"]


class _PipelineSchedule(Schedule):
    """Shared step builders of the built-in single-chunk schedules."""

    def buffer_of(self, micro_batch: int) -> int:
        """The buffer slot that holds ``micro_batch``: ``micro_batch % num_buffers()``."""
        return micro_batch % self.num_buffers()

    def forward_step(self, micro_batch: int) -> list[Instruction]:
        """Load/receive, forward and send one micro-batch."""
        buf = self.buffer_of(micro_batch)
        step: list[Instruction] = []
        if self.is_first or self.is_last:
            step.append(LoadMicroBatch(micro_batch, buf))
        if not self.is_first:
            step.append(RecvActivation(micro_batch, buf))
        step.append(Forward(micro_batch, buf))
        if not self.is_last:
            step.append(SendActivation(micro_batch, buf))
        return step

    def backward_step(self, micro_batch: int) -> list[Instruction]:
        """Receive the output gradient, back-propagate and send the input gradient."""
        buf = self.buffer_of(micro_batch)
        step: list[Instruction] = []
        if not self.is_last:
            step.append(RecvGrad(micro_batch, buf))
        step.append(Backward(micro_batch, buf))
        if not self.is_first:
            step.append(SendGrad(micro_batch, buf))
        return step

    @staticmethod
    def finish(steps: list[list[Instruction]]) -> list[list[Instruction]]:
        """Append the reductions and the optimizer step to the last step."""
        steps[-1].extend([ReduceTiedGrads(), ReduceGrads(), OptimizerStep()])
        return steps


class OneFOneB(_PipelineSchedule):
    """1F1B (PipeDream-Flush, DeepSpeed's ``TrainSchedule``).

    Stage ``s`` runs ``w = min(num_stages - s - 1, micro_batches)`` warm-up
    forwards, then alternates one forward and one backward, then runs the
    remaining backwards. Micro-batches are forwarded and backwarded in
    ascending order. At most ``min(num_stages - s, micro_batches)``
    micro-batches are in flight, which is :meth:`num_buffers`; micro-batch
    ``m`` lives in buffer ``m % num_buffers()``.
    """

    name = "1f1b"
    trains = True

    def num_buffers(self) -> int:
        """``min(num_stages - stage, micro_batches)``."""
        return min(self.num_stages - self.stage, self.micro_batches)

    def steps(self) -> list[list[Instruction]]:
        warmup = min(self.num_stages - self.stage - 1, self.micro_batches)
        steps = [self.forward_step(m) for m in range(warmup)]
        for i in range(self.micro_batches - warmup):
            steps.append(self.forward_step(warmup + i))
            steps.append(self.backward_step(i))
        steps.extend(self.backward_step(m)
                     for m in range(self.micro_batches - warmup, self.micro_batches))
        return self.finish(steps)


class GPipe(_PipelineSchedule):
    """GPipe: every forward, then every backward.

    Forwards and backwards both run in ascending micro-batch order
    (``F0 .. F(M-1)`` then ``B0 .. B(M-1)``), so all ``micro_batches``
    micro-batches are in flight at once: :meth:`num_buffers` is
    ``micro_batches`` and micro-batch ``m`` lives in buffer ``m``.
    """

    name = "gpipe"
    trains = True

    def num_buffers(self) -> int:
        """``micro_batches``."""
        return self.micro_batches

    def steps(self) -> list[list[Instruction]]:
        steps = [self.forward_step(m) for m in range(self.micro_batches)]
        steps.extend(self.backward_step(m) for m in range(self.micro_batches))
        return self.finish(steps)


class Inference(_PipelineSchedule):
    """Forward only, in ascending micro-batch order, with double buffering.

    :meth:`num_buffers` is 2 (1 when only one forward runs); the ``k``-th forward of
    the stage lives in buffer ``k % num_buffers()``. The last stage loads each
    micro-batch too (labels, for an evaluation loss). No backward, no
    reductions, no optimizer step.

    With several chunks per stage (a model split for an interleaved or V-shaped
    training schedule) the stage runs its parts in pipeline order, each over all
    micro-batches (breadth first); :meth:`for_placement` gives the variant for
    another placement than ``"loop"``.
    """

    name = "inference"
    trains = False
    max_chunks = 64

    @classmethod
    def for_placement(cls, placement: str) -> type[Inference]:
        """This schedule for models placed by ``placement`` (``"loop"`` or ``"v"``)."""
        if placement == cls.placement:
            return cls
        check_placement(placement, 2)
        return type(f"{cls.__name__}_{placement}", (cls,),
                    {"placement": placement, "__module__": cls.__module__,
                     "__doc__": f"{cls.__name__} for placement {placement!r}."})

    def num_buffers(self) -> int:
        """``min(2, micro_batches * chunks)``."""
        return min(2, self.micro_batches * self.chunks)

    def steps(self) -> list[list[Instruction]]:
        if self.chunks == 1 and self.placement == "loop":
            return [self.forward_step(m) for m in range(self.micro_batches)]
        order = sorted(range(self.chunks), key=self.position_of)
        steps, k = [], 0
        for chunk in order:
            for m in range(self.micro_batches):
                buf, k = k % self.num_buffers(), k + 1
                steps.append(self.chunk_forward_step(chunk, m, buf))
        return steps
