"""Seq1F1B: 1F1B over sequence chunks of each micro-batch (layer 0: no torch).

Long context (Sun et al., *Seq1F1B*, NAACL 2025): each micro-batch is cut along the
sequence into ``k`` equal chunks, and every ``(micro-batch, chunk)`` is one *unit* of
1F1B. Unit ``u`` is chunk ``u % k`` of micro-batch ``u // k``; the ``micro_batch`` field of
every instruction holds the unit, so the wire, the buffers, the simulator and the
communication plan treat units exactly as micro-batches.

What makes it more than 1F1B over ``m * k`` micro-batches is attention: chunk ``j``'s
queries read the keys and values of chunks ``0 .. j`` of its micro-batch, which the stage
keeps (its KV prefix, :mod:`pipekernel.stage.sequence`). So on every stage

* the forwards run in unit order (chunk ``j`` after chunk ``j - 1``), and
* the backwards of a micro-batch run its chunks in *reverse* (``k - 1`` first): chunk
  ``j``'s backward needs the gradients the later chunks sent into its keys and values.

The last stage's first backward is chunk ``k - 1`` of micro-batch 0, so every stage runs
``k - 1`` more warm-up forwards than 1F1B: ``min(S - s - 1 + k - 1, m * k)``. A stage then
holds at most ``S - s + k - 1`` units, each ``1/k`` of a micro-batch's activations —
``(S - s + k - 1) / k`` micro-batches against 1F1B's ``min(S - s, m)``.
"""
from __future__ import annotations

from typing import ClassVar

from pipekernel.errors import ConfigError
from pipekernel.schedules.ordered import Op, OrderedSchedule

__all__ = ["Seq1F1B", "unit_of", "split_unit"]


def unit_of(micro_batch: int, chunk: int, seq_chunks: int) -> int:
    """The unit of sequence chunk ``chunk`` of ``micro_batch``."""
    return micro_batch * seq_chunks + chunk


def split_unit(unit: int, seq_chunks: int) -> tuple[int, int]:
    """``(micro_batch, sequence chunk)`` of ``unit``."""
    return divmod(unit, seq_chunks)


class Seq1F1B(OrderedSchedule):
    """1F1B over the ``seq_chunks`` sequence chunks of every micro-batch (see the module
    docstring). Made for a chunk count by :meth:`with_chunks` (the engine does it for
    ``seq_chunks=k``); ``micro_batches`` counts whole micro-batches, the program runs
    ``micro_batches * seq_chunks`` units."""

    name = "seq1f1b"
    trains = True
    #: Sequence chunks per micro-batch.
    seq_chunks: ClassVar[int] = 2

    @classmethod
    def with_chunks(cls, seq_chunks: int) -> type[Seq1F1B]:
        """This schedule cutting every micro-batch into ``seq_chunks`` chunks.

        :raises ConfigError: ``seq_chunks`` not an int >= 2."""
        if not isinstance(seq_chunks, int) or isinstance(seq_chunks, bool) or seq_chunks < 2:
            raise ConfigError(f"seq_chunks must be an int >= 2 for {cls.name!r}, got "
                              f"{seq_chunks!r}",
                              hint="e.g. seq_chunks=4 (seq_chunks=1 is plain 1F1B)")
        return type(f"{cls.__name__}_{seq_chunks}", (cls,),
                    {"seq_chunks": seq_chunks, "__module__": cls.__module__,
                     "__doc__": f"{cls.__name__} with {seq_chunks} sequence chunks."})

    @property
    def units(self) -> int:
        return self.micro_batches * self.seq_chunks

    def warmup(self) -> int:
        """Forwards before the first backward: ``min(S - s - 1 + k - 1, m * k)``."""
        return min(self.num_stages - self.stage - 1 + self.seq_chunks - 1, self.units)

    def _backward_op(self, n: int) -> Op:
        mb, back = divmod(n, self.seq_chunks)
        return "B", 0, unit_of(mb, self.seq_chunks - 1 - back, self.seq_chunks)

    def order(self) -> list[Op]:
        total, warmup = self.units, self.warmup()
        ops: list[Op] = [("F", 0, u) for u in range(warmup)]
        for n in range(total - warmup):
            ops.append(("F", 0, warmup + n))
            ops.append(self._backward_op(n))
        ops.extend(self._backward_op(n) for n in range(total - warmup, total))
        return ops
