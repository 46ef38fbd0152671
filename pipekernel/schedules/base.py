"""The schedule contract (layer 0: no torch).

A schedule turns ``(num_stages, stage, micro_batches, chunks)`` into the list of
steps that one stage executes; a step is a list of instructions run in order.
Schedules are plain classes so a framework can use them without the runtime.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import ClassVar

from pipekernel.errors import ConfigError
from pipekernel.schedules.instructions import (Forward, Instruction, LoadMicroBatch, RecvActivation,
                                     SendActivation)
from pipekernel.schedules.placement import locate, position

Step = Sequence[Instruction]


class Schedule:
    """Base class of every schedule.

    Subclasses implement :meth:`steps`; the engine and the simulator only use
    ``steps()``, ``num_buffers()`` and the class attributes.

    :param num_stages: pipeline stages (ranks in one pipeline), >= 1.
    :param stage: this stage, ``0 <= stage < num_stages``.
    :param micro_batches: micro-batches per batch, >= 1.
    :param chunks: model chunks (virtual stages) per rank; 1 unless interleaved.
    """

    #: Name under which the schedule is registered (``schedule="1f1b"``).
    name: ClassVar[str] = ""
    #: ``True`` if the schedule trains (backward + optimizer step), ``False`` for inference.
    trains: ClassVar[bool] = True
    #: Largest ``chunks`` value the schedule supports.
    max_chunks: ClassVar[int] = 1
    #: Smallest ``chunks`` value the schedule supports (``zbv``: exactly 2).
    min_chunks: ClassVar[int] = 1
    #: ``chunks`` used when the user gives none.
    default_chunks: ClassVar[int] = 1
    #: Which parts each stage holds (:mod:`pipekernel.schedules.placement`):
    #: ``"loop"`` or ``"v"``. The partitioner, the runtime and the simulator read it here.
    placement: ClassVar[str] = "loop"

    def __init__(self, num_stages: int, stage: int, micro_batches: int, chunks: int = 1) -> None:
        if num_stages < 1 or not 0 <= stage < num_stages:
            raise ConfigError(f"stage {stage} is outside a pipeline of {num_stages} stages",
                              hint="use 0 <= stage < num_stages with num_stages >= 1")
        if micro_batches < 1:
            raise ConfigError(f"micro_batches must be >= 1, got {micro_batches}",
                              hint="pass micro_batches=1 or more")
        if not self.min_chunks <= chunks <= self.max_chunks:
            span = (f"exactly {self.min_chunks}" if self.min_chunks == self.max_chunks
                    else f"{self.min_chunks} to {self.max_chunks}")
            raise ConfigError(f"schedule {self.name!r} supports {span} chunk(s) per stage, "
                              f"got chunks={chunks}",
                              hint="use schedule='interleaved' (loop) or 'zbv' (V, chunks=2) "
                                   "for several chunks per stage")
        self.num_stages, self.stage = num_stages, stage
        self.micro_batches, self.chunks = micro_batches, chunks

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    # -- placement (shared by every multi-chunk schedule) --------------------------------
    def position_of(self, chunk: int) -> int:
        """Pipeline position of ``chunk`` on this stage (see ``placement``)."""
        return position(self.stage, chunk, self.num_stages, self.placement)

    @property
    def last_position(self) -> int:
        return self.num_stages * self.chunks - 1

    def loads(self, chunk: int) -> bool:
        """Whether the forward of ``chunk`` on this stage loads the micro-batch: at
        position 0 (inputs) and at the last position (labels), once per micro-batch
        when one stage holds both (one stage, or a V)."""
        pos, last = self.position_of(chunk), self.last_position
        if pos == 0:
            return True
        first_stage = locate(0, self.num_stages, self.placement)[0]
        return pos == last and locate(last, self.num_stages, self.placement)[0] != first_stage

    def chunk_forward_step(self, chunk: int, micro_batch: int, buf: int) -> list[Instruction]:
        """``[LoadMicroBatch] [RecvActivation] Forward [SendActivation]`` for one part."""
        pos, step = self.position_of(chunk), list[Instruction]()
        if self.loads(chunk):
            step.append(LoadMicroBatch(micro_batch, buf, chunk))
        if pos > 0:
            step.append(RecvActivation(micro_batch, buf, chunk))
        step.append(Forward(micro_batch, buf, chunk))
        if pos < self.last_position:
            step.append(SendActivation(micro_batch, buf, chunk))
        return step

    def steps(self) -> list[list[Instruction]]:
        """Every step this stage executes for one batch, in order."""
        raise NotImplementedError

    def num_buffers(self) -> int:
        """Buffer slots this stage needs: ``1 + max buffer index`` used by ``steps()``."""
        used = [getattr(i, "buffer", 0) for step in self.steps() for i in step]
        return 1 + max(used, default=0)

    def __iter__(self) -> Iterator[list[Instruction]]:
        return iter(self.steps())

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(num_stages={self.num_stages}, stage={self.stage}, "
                f"micro_batches={self.micro_batches}, chunks={self.chunks})")
