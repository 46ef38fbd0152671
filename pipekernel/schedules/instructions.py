"""The pipeline instruction set (layer 0: no torch).

A schedule is a list of *steps*; a step is a list of instructions that a stage
executes in order. Instructions are frozen, hashable dataclasses so schedules
can be compared, printed and simulated without a runtime.

Fields that schedules rely on:

* ``micro_batch``: index of the micro-batch within the current batch.
* ``buffer``: the slot in the stage's buffer pool that holds this micro-batch's
  activations while it is in flight (the schedule decides reuse).
* ``chunk``: the virtual stage (model chunk) on this rank, ``0`` unless the
  schedule is interleaved.

``str(instruction)`` gives a short, stable form (``F3``, ``B3``, ``SEND_F3``, ...)
used by the simulator's grid and in error messages; :func:`parse` reverses it.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import ClassVar

__all__ = [
    "Instruction", "MicroBatchInstruction", "LoadMicroBatch", "Forward", "Backward",
    "BackwardInput", "BackwardWeight", "SendActivation", "RecvActivation", "SendGrad",
    "RecvGrad", "ReduceTiedGrads", "ReduceGrads", "OptimizerStep", "SkipInstruction",
    "SendSkip", "RecvSkip", "SendSkipGrad", "RecvSkipGrad", "ForwardBackward", "Unshard",
    "Reshard", "ReduceShardedGrads", "ArmGradReduce", "LaunchGradReduce", "parse",
]


@dataclass(frozen=True, slots=True)
class Instruction:
    """Base class of every instruction. Subclasses set ``short`` for ``str()``."""

    short: ClassVar[str] = "?"

    def __str__(self) -> str:
        return self.short


@dataclass(frozen=True, slots=True)
class MicroBatchInstruction(Instruction):
    """An instruction about one micro-batch held in one buffer slot."""

    micro_batch: int
    buffer: int = 0
    chunk: int = 0

    def __str__(self) -> str:
        chunk = f"c{self.chunk}" if self.chunk else ""
        return f"{self.short}{self.micro_batch}{chunk}"


@dataclass(frozen=True, slots=True)
class LoadMicroBatch(MicroBatchInstruction):
    """Fetch the next micro-batch from the data iterator (first stage: inputs,
    last stage: labels) into ``buffer``."""

    short: ClassVar[str] = "LOAD"


@dataclass(frozen=True, slots=True)
class Forward(MicroBatchInstruction):
    """Run the stage's layers on the inputs in ``buffer``; on the last stage also the loss."""

    short: ClassVar[str] = "F"


@dataclass(frozen=True, slots=True)
class Backward(MicroBatchInstruction):
    """Back-propagate through the stage for the micro-batch in ``buffer``
    (input and weight gradients together)."""

    short: ClassVar[str] = "B"


@dataclass(frozen=True, slots=True)
class BackwardInput(MicroBatchInstruction):
    """Zero-bubble split: gradients with respect to the stage's inputs only."""

    short: ClassVar[str] = "I"


@dataclass(frozen=True, slots=True)
class BackwardWeight(MicroBatchInstruction):
    """Zero-bubble split: gradients with respect to the stage's weights only."""

    short: ClassVar[str] = "W"


@dataclass(frozen=True, slots=True)
class SendActivation(MicroBatchInstruction):
    """Send the outputs in ``buffer`` to the next stage (asynchronous)."""

    short: ClassVar[str] = "SEND_F"


@dataclass(frozen=True, slots=True)
class RecvActivation(MicroBatchInstruction):
    """Receive the previous stage's outputs into ``buffer`` (blocks until they arrive)."""

    short: ClassVar[str] = "RECV_F"


@dataclass(frozen=True, slots=True)
class SendGrad(MicroBatchInstruction):
    """Send the gradients of this stage's inputs to the previous stage (asynchronous)."""

    short: ClassVar[str] = "SEND_B"


@dataclass(frozen=True, slots=True)
class RecvGrad(MicroBatchInstruction):
    """Receive the gradients of this stage's outputs from the next stage."""

    short: ClassVar[str] = "RECV_B"


@dataclass(frozen=True, slots=True)
class SkipInstruction(MicroBatchInstruction):
    """A transfer of a skip connection (:mod:`pipekernel.model.skips`): the tensors layers of
    one pipeline position stash for a later one, sent straight between the two.

    ``peer`` is the pipeline position at the other end (the consumer for
    ``SendSkip``/``RecvSkipGrad``, the producer for ``RecvSkip``/``SendSkipGrad``);
    ``str()`` appends it: ``SEND_S3@5``. Schedules never emit these: they are inserted
    by :func:`pipekernel.schedules.skips.add_skip_transfers` once the layers are placed.
    """

    peer: int = -1

    def __str__(self) -> str:
        chunk = f"c{self.chunk}" if self.chunk else ""
        return f"{self.short}{self.micro_batch}{chunk}@{self.peer}"


@dataclass(frozen=True, slots=True)
class SendSkip(SkipInstruction):
    """Send what the forward in ``buffer`` stashed for position ``peer`` (asynchronous)."""

    short: ClassVar[str] = "SEND_S"


@dataclass(frozen=True, slots=True)
class RecvSkip(SkipInstruction):
    """Receive what position ``peer`` stashed for this chunk's forward."""

    short: ClassVar[str] = "RECV_S"


@dataclass(frozen=True, slots=True)
class SendSkipGrad(SkipInstruction):
    """Send the gradients of the skip tensors received from position ``peer``."""

    short: ClassVar[str] = "SEND_SG"


@dataclass(frozen=True, slots=True)
class RecvSkipGrad(SkipInstruction):
    """Receive the gradients of the tensors this chunk stashed for position ``peer``."""

    short: ClassVar[str] = "RECV_SG"


@dataclass(frozen=True, slots=True)
class ForwardBackward(Instruction):
    """A forward and a backward of *different* parts run as one compute instruction
    (DualPipe's overlapped pair), so that one's communication can hide behind the
    other's compute. Emitted by ``dualpipev``'s steady state, and by ``zbv`` where its plan
    puts a forward beside the other chunk's backward
    (:func:`~pipekernel.schedules.zero_bubble.pair_forwards`).

    Roughly: ``forward`` then ``backward`` (each with its own ``buffer``), run by the
    stage's paired executor (:mod:`pipekernel.stage.paired`): by default one after the
    other, exactly as the two instructions alone; a model may supply its own
    ``overlapped_forward_backward``. The step around it holds both halves' transfers::

        [LoadMicroBatch] [RecvActivation] [RecvGrad]  F+B  [SendActivation] [SendGrad]

    ``str()`` joins the halves: ``F4+B1c1``.
    """

    short: ClassVar[str] = "FB"
    forward: Forward
    backward: Backward

    def __post_init__(self) -> None:
        from pipekernel.errors import ConfigError

        if type(self.forward) is not Forward or type(self.backward) is not Backward:
            raise ConfigError(
                f"ForwardBackward pairs a Forward with a Backward, got "
                f"{type(self.forward).__name__} ({self.forward!r}) and "
                f"{type(self.backward).__name__} ({self.backward!r})",
                hint="pass ForwardBackward(Forward(m, buf, chunk), Backward(n, buf, chunk)); "
                     "split backwards (BackwardInput/BackwardWeight) are not paired")
        if (self.forward.chunk, self.forward.micro_batch) == (self.backward.chunk,
                                                              self.backward.micro_batch):
            raise ConfigError(
                f"ForwardBackward({self.forward}, {self.backward}) pairs a part with itself",
                hint="pair the forward of one micro-batch with the backward of another")

    @property
    def halves(self) -> tuple[Forward, Backward]:
        """``(forward, backward)``."""
        return self.forward, self.backward

    def __str__(self) -> str:
        return f"{self.forward}+{self.backward}"


@dataclass(frozen=True, slots=True)
class ReduceTiedGrads(Instruction):
    """Sum the gradients of tied weights across the stages that hold them."""

    short: ClassVar[str] = "REDUCE_TIED"


@dataclass(frozen=True, slots=True)
class ReduceGrads(Instruction):
    """Average gradients across data-parallel replicas: start what is not on the wire yet,
    then wait for every bucket (:mod:`pipekernel.schedules.data_parallel`)."""

    short: ClassVar[str] = "REDUCE"


@dataclass(frozen=True, slots=True)
class OptimizerStep(Instruction):
    """Step the optimizer (the precision policy may skip it) and zero gradients."""

    short: ClassVar[str] = "STEP"


@dataclass(frozen=True, slots=True)
class Unshard(Instruction):
    """FSDP2 (:mod:`pipekernel.schedules.sharded`): gather the stage's roots before a batch
    (``chunk=None``), or start the first all-gather of ``chunk``'s next forward
    (``forward``) or backward. Torch's ``UNSHARD``."""

    short: ClassVar[str] = "UNSHARD"
    chunk: int | None = None
    forward: bool = True

    def __str__(self) -> str:
        where = "" if self.chunk is None else f"_{'F' if self.forward else 'B'}c{self.chunk}"
        return self.short + where


@dataclass(frozen=True, slots=True)
class Reshard(Instruction):
    """FSDP2: free the parameters an evaluation left gathered. Torch's ``RESHARD``."""

    short: ClassVar[str] = "RESHARD"


@dataclass(frozen=True, slots=True)
class ReduceShardedGrads(Instruction):
    """FSDP2: reduce-scatter the stage's gradients once per batch, then reshard. Torch's
    ``REDUCE_GRAD``."""

    short: ClassVar[str] = "REDUCE_SHARDED"


@dataclass(frozen=True, slots=True)
class ArmGradReduce(Instruction):
    """Data parallelism (:mod:`pipekernel.schedules.data_parallel`): right before the
    stage's last weight-gradient instruction of the batch, arm the reducer, whose buckets
    then start from gradient hooks during that backward. ``chunk``: that instruction's
    chunk (the other chunks' gradients are final already)."""

    short: ClassVar[str] = "ARM_REDUCE"
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.short}c{self.chunk}" if self.chunk else self.short


@dataclass(frozen=True, slots=True)
class LaunchGradReduce(Instruction):
    """Data parallelism: right after the stage's last weight-gradient instruction, start
    every bucket not started yet but those of tied weights (fp32 masters' gradients are
    final only there)."""

    short: ClassVar[str] = "LAUNCH_REDUCE"


_BY_SHORT: dict[str, type[Instruction]] = {cls.short: cls for cls in (
    LoadMicroBatch, Forward, Backward, BackwardInput, BackwardWeight, SendActivation,
    RecvActivation, SendGrad, RecvGrad, ReduceTiedGrads, ReduceGrads, OptimizerStep,
    SendSkip, RecvSkip, SendSkipGrad, RecvSkipGrad, Reshard, ReduceShardedGrads, ArmGradReduce,
    LaunchGradReduce)}
_PATTERN = re.compile(r"^([A-Z_]+?)(\d+)?(?:c(\d+))?(?:@(\d+))?$")


def parse(text: str, buffer: int = 0) -> Instruction:
    """Inverse of ``str(instruction)``: ``parse("F3") == Forward(3)``.

    The buffer is not part of the short form; pass it if it matters (a
    ``ForwardBackward``, ``"F4+B1c1"``, gets it in both halves).
    """
    if "+" in text:
        first, _, second = text.strip().partition("+")
        forward, backward = parse(first, buffer), parse(second, buffer)
        if not isinstance(forward, Forward) or not isinstance(backward, Backward):
            raise ValueError(f"cannot parse instruction {text!r}: a pair is a forward and a "
                             f"backward, e.g. F4+B1c1")
        return ForwardBackward(forward, backward)
    match = _PATTERN.match(text.strip())
    cls = _BY_SHORT.get(match.group(1)) if match else None
    if match is None or cls is None:
        known = ", ".join(sorted(_BY_SHORT))
        raise ValueError(f"cannot parse instruction {text!r}; known prefixes: {known}")
    if issubclass(cls, MicroBatchInstruction):
        if match.group(2) is None:
            raise ValueError(f"instruction {text!r} needs a micro-batch number, e.g. {cls.short}0")
        if issubclass(cls, SkipInstruction):
            return cls(int(match.group(2)), buffer, int(match.group(3) or 0),
                       int(match.group(4) or 0))
        return cls(int(match.group(2)), buffer, int(match.group(3) or 0))
    if cls is ArmGradReduce:
        return ArmGradReduce(int(match.group(3) or 0))
    return cls()


def replace(instruction: Instruction, **changes: int) -> Instruction:
    """``dataclasses.replace`` re-exported for schedule writers."""
    return dataclasses.replace(instruction, **changes)
