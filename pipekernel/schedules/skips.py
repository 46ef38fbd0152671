"""Skip connections in the instruction stream (layer 0: no torch).

A *skip edge* ``(producer, consumer)`` says that layers at pipeline position
``producer`` stash tensors that layers at the later position ``consumer`` pop
(:mod:`pipekernel.model.skips`). The tensors go straight from one to the other, not
through the positions in between, and their gradients come straight back.

Schedules know nothing of skips: once the layers are placed, the engine (and the
simulator, so what is proven is what runs) passes each stage's steps through
:func:`add_skip_transfers`, which inserts, for every edge and micro-batch ``m``:

* at the producer, ``SendSkip(m, peer=consumer)`` right after ``Forward(m)`` of
  its chunk, and ``RecvSkipGrad(m, peer=consumer)`` right before its
  ``Backward(m)`` / ``BackwardInput(m)`` (the gradients join the backward's roots);
* at the consumer, ``RecvSkip(m, peer=producer)`` right before ``Forward(m)``, and
  ``SendSkipGrad(m, peer=producer)`` right after its ``Backward(m)`` /
  ``BackwardInput(m)``.

Why every schedule stays deadlock-free: the consumer's forward of ``m`` already
depends on the producer's forward of ``m`` through the activations of the
positions in between, and the producer's backward of ``m`` on the consumer's
backward through their gradients, so a skip transfer adds no dependency the
schedule did not have; each edge's two channels get lanes like the others
(:mod:`pipekernel.schedules.lanes`), posted by the same plan (:mod:`pipekernel.schedules.comm`:
receives ahead, sends never waited on before the batch ends). The simulator
checks it under rendezvous semantics all the same (``simulate(..., skips=...)``),
and an edge whose consumer does not come after its producer is rejected by
:func:`check_skip_edges`.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from pipekernel.errors import ScheduleError
from pipekernel.schedules.instructions import (
    Backward, BackwardInput, Forward, ForwardBackward, Instruction, RecvSkip, RecvSkipGrad, SendSkip,
    SendSkipGrad, SkipInstruction,
)
from pipekernel.schedules.placement import position

__all__ = ["check_skip_edges", "add_skip_transfers", "skip_edge_of"]


def check_skip_edges(edges: Iterable[Sequence[int]], num_positions: int) -> list[tuple[int, int]]:
    """The edges as a sorted list of ``(producer, consumer)`` position pairs.

    :raises ScheduleError: listing every edge whose consumer does not come after its
        producer, or whose positions are outside ``0 .. num_positions - 1``.
    """
    out, problems = set(), []
    for edge in edges:
        producer, consumer = (int(x) for x in edge)
        if not (0 <= producer < num_positions and 0 <= consumer < num_positions):
            problems.append(f"skip edge {producer} -> {consumer}: the pipeline has positions "
                            f"0..{num_positions - 1}")
        elif consumer <= producer:
            problems.append(f"skip edge {producer} -> {consumer}: its consumer (position "
                            f"{consumer}) does not come after its producer (position "
                            f"{producer}); a layer can only pop what an earlier layer stashed")
        out.add((producer, consumer))
    if problems:
        raise ScheduleError("invalid skip edges:\n" + "\n".join(f"  - {p}" for p in problems),
                            hint="a skip connection goes from an earlier layer (stash) to a "
                                 "later one (pop); reorder the layers or the names")
    return sorted(out)


def skip_edge_of(instruction: SkipInstruction, stage: int, num_stages: int,
                 placement: str = "loop") -> tuple[int, int]:
    """``(producer, consumer)`` positions of a skip instruction of ``stage``."""
    own = position(stage, instruction.chunk, num_stages, placement)
    if isinstance(instruction, (SendSkip, RecvSkipGrad)):
        return own, instruction.peer
    return instruction.peer, own


def add_skip_transfers(steps: Iterable[Sequence[Instruction]], *, stage: int, num_stages: int,
                       chunks: int = 1, placement: str = "loop",
                       edges: Sequence[tuple[int, int]] = ()) -> list[list[Instruction]]:
    """``steps`` with the skip transfers of ``stage`` inserted (see the module docstring).
    Without edges, the steps come back as they are (as lists)."""
    listed = [list(step) for step in steps]
    if not edges:
        return listed
    out_of: dict[int, list[int]] = {}  # producer position -> consumers
    into: dict[int, list[int]] = {}    # consumer position -> producers
    for producer, consumer in edges:
        out_of.setdefault(producer, []).append(consumer)
        into.setdefault(consumer, []).append(producer)
    mine = {c: position(stage, c, num_stages, placement) for c in range(chunks)}
    result = []
    for step in listed:
        new: list[Instruction] = []
        for ins in step:
            if isinstance(ins, ForwardBackward):  # the halves' transfers around the pair
                before, after = _pair_skips(ins, mine, into, out_of)
                new += [*before, ins, *after]
                continue
            pos = mine.get(getattr(ins, "chunk", -1))
            if pos is None or not isinstance(ins, (Forward, Backward, BackwardInput)):
                new.append(ins)
                continue
            m, b, c = ins.micro_batch, ins.buffer, ins.chunk
            if isinstance(ins, Forward):
                new += [RecvSkip(m, b, c, p) for p in into.get(pos, ())]
                new.append(ins)
                new += [SendSkip(m, b, c, q) for q in out_of.get(pos, ())]
            else:
                new += [RecvSkipGrad(m, b, c, q) for q in out_of.get(pos, ())]
                new.append(ins)
                new += [SendSkipGrad(m, b, c, p) for p in into.get(pos, ())]
        result.append(new)
    return result


def _pair_skips(pair: ForwardBackward, mine: dict[int, int], into: dict[int, list[int]],
                out_of: dict[int, list[int]]) -> tuple[list[Instruction], list[Instruction]]:
    """The skip transfers before and after a ``ForwardBackward``: each half's, the
    forward's first (as the halves' receives and sends are ordered)."""
    f, b = pair.forward, pair.backward
    before: list[Instruction] = []
    after: list[Instruction] = []
    pos = mine.get(f.chunk)
    if pos is not None:
        before += [RecvSkip(f.micro_batch, f.buffer, f.chunk, p) for p in into.get(pos, ())]
        after += [SendSkip(f.micro_batch, f.buffer, f.chunk, q) for q in out_of.get(pos, ())]
    pos = mine.get(b.chunk)
    if pos is not None:
        before += [RecvSkipGrad(b.micro_batch, b.buffer, b.chunk, q)
                   for q in out_of.get(pos, ())]
        after += [SendSkipGrad(b.micro_batch, b.buffer, b.chunk, p) for p in into.get(pos, ())]
    return before, after
