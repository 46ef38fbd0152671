"""Schedules written as an order of compute operations (layer 0: no torch).

Interleaved and zero-bubble schedules are easiest to state as *what each stage
computes, in which order*: ``("F", chunk, micro_batch)``, ``("B", ...)``, or the
zero-bubble split ``("I", ...)`` / ``("W", ...)``. :class:`OrderedSchedule`
turns such an order into steps with the conventions of
:mod:`pipekernel.schedules.pipeline`, one compute instruction per step::

    forward step:   [LoadMicroBatch]  [RecvActivation]  Forward  [SendActivation]
    backward step:  [RecvGrad]  Backward | BackwardInput  [SendGrad]
    weight step:    BackwardWeight

* Communication follows the schedule's ``placement``
  (:mod:`pipekernel.schedules.placement`): a part receives activations unless it
  is position 0, sends them unless it is the last position, and the reverse for
  gradients. A peer on the same stage (the turn of a V, or one stage holding
  several chunks) is a local hand-off; the instructions are the same.
* ``LoadMicroBatch`` goes with the forward of position 0 (inputs) and of the
  last position (labels). When one stage holds both (one stage, or a V) it is
  emitted once per micro-batch, with the forward of chunk 0: the runtime keeps
  a micro-batch's labels until its loss is computed.
* Buffers are one pool per stage shared by all chunks. The part ``(chunk,
  micro_batch)`` takes the lowest free slot at its forward step and frees it
  after its ``Backward`` (or its ``BackwardWeight``), so :meth:`num_buffers` is
  exactly the stage's peak number of live parts.
* A schedule that pairs a forward with the backward right after it (:meth:`pairs`)
  gets one step for both, with one ``ForwardBackward`` and both halves' transfers —
  receives first, in the halves' order, sends after::

    paired step:    [LoadMicroBatch]  [RecvActivation]  [RecvGrad]  ForwardBackward
                    [SendActivation]  [SendGrad]

* The last step ends with ``ReduceTiedGrads``, ``ReduceGrads``, ``OptimizerStep``.
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

from pipekernel.schedules.instructions import (
    Backward, BackwardInput, BackwardWeight, Forward, ForwardBackward, Instruction,
    LoadMicroBatch, MicroBatchInstruction, OptimizerStep, RecvActivation, RecvGrad, ReduceGrads,
    ReduceTiedGrads, SendActivation, SendGrad,
)
from pipekernel.errors import ScheduleError
from pipekernel.schedules.base import Schedule

__all__ = ["Op", "OrderedSchedule", "KINDS", "unpair", "unpaired_steps"]

#: ``(kind, chunk, micro_batch)`` with kind ``"F"``, ``"B"``, ``"I"`` or ``"W"``.
Op = tuple[str, int, int]
KINDS = ("F", "B", "I", "W")
_COMPUTE = {"F": Forward, "B": Backward, "I": BackwardInput, "W": BackwardWeight}

# a plain micro-batch instruction class (no fields of its own, no ``__post_init__``) made
# as ``_new(cls)`` with its three slots set directly: the frozen dataclass's ``__init__``
# costs three ``object.__setattr__`` calls through the class, about three times this; a
# build makes one per instruction of the plan (issue 29, item 7)
_new = object.__new__
_set_micro_batch = MicroBatchInstruction.__dict__["micro_batch"].__set__
_set_buffer = MicroBatchInstruction.__dict__["buffer"].__set__
_set_chunk = MicroBatchInstruction.__dict__["chunk"].__set__


class OrderedSchedule(Schedule):
    """A training schedule given by :meth:`order`; subclasses implement ``order()``."""

    def order(self) -> Sequence[Op]:
        """This stage's compute operations, in execution order."""
        raise NotImplementedError

    def pairs(self) -> frozenset[int]:
        """Indices ``i`` of :meth:`order` whose ``F`` runs with the ``B`` at ``i + 1`` as
        one ``ForwardBackward`` (default: none)."""
        return frozenset()

    # -- steps -----------------------------------------------------------------------

    @cached_property
    def _built(self) -> tuple[list[list[Instruction]], int]:
        return self._build(self._built_order, self.pairs())

    def _build(self, order: list[Op], pairs: frozenset[int]
               ) -> tuple[list[list[Instruction]], int]:
        """The steps of ``order`` with ``pairs`` merged, and their number of buffers."""
        free: list[int] = []
        size = 0
        slot: dict[tuple[int, int], int] = {}
        steps: list[list[Instruction]] = []
        shapes: dict[tuple[str, int], tuple[type, ...] | None] = {}
        for kind, chunk, mb in order:
            part = (chunk, mb)
            if kind == "F":
                if free:
                    free.sort()
                    buf = free.pop(0)
                else:
                    buf, size = size, size + 1
                slot[part] = buf
            else:
                buf = slot[part]
                if kind == "B" or kind == "W":  # frees its slot (for the parts after it)
                    del slot[part]
                    free.append(buf)
            shape = shapes.get((kind, chunk), ())
            if shape == ():
                shape = shapes[(kind, chunk)] = self._shape(kind, chunk)
            if shape is None:
                steps.append(self.chunk_forward_step(chunk, mb, buf))  # a subclass's own
            else:
                step = []
                for cls in shape:  # made as _new's comment says, with no call of its own
                    ins: Instruction = _new(cls)
                    _set_micro_batch(ins, mb)
                    _set_buffer(ins, buf)
                    _set_chunk(ins, chunk)
                    step.append(ins)
                steps.append(step)
        steps = _paired(steps, order, pairs)
        if steps:
            steps[-1].extend([ReduceTiedGrads(), ReduceGrads(), OptimizerStep()])
        return steps, max(size, 1)

    def _shape(self, kind: str, chunk: int) -> tuple[type, ...] | None:
        """The classes of a step of ``kind`` for ``chunk``, in order (see the module
        docstring; the same for every micro-batch), or ``None`` for a forward step of a
        subclass's own."""
        loads, recv_act, send_act, recv_grad, send_grad = self._ends(chunk)
        if kind == "F":
            if self._own_forward_step:
                return None
            around: tuple[tuple[type[Instruction], bool], ...] = (
                (LoadMicroBatch, loads), (RecvActivation, recv_act), (Forward, True),
                (SendActivation, send_act))
        elif kind == "W":
            around = ((BackwardWeight, True),)
        else:
            around = ((RecvGrad, recv_grad), (_COMPUTE[kind], True), (SendGrad, send_grad))
        return tuple(cls for cls, emitted in around if emitted)

    @cached_property
    def _chunk_ends(self) -> dict[int, tuple[bool, bool, bool, bool, bool]]:
        return {}

    @cached_property
    def _own_forward_step(self) -> bool:
        """Whether a subclass gives its own ``chunk_forward_step`` (asked once)."""
        return type(self).chunk_forward_step is not Schedule.chunk_forward_step

    def _ends(self, chunk: int) -> tuple[bool, bool, bool, bool, bool]:
        """Per chunk, once: whether its forward loads, receives and sends activations, and
        its backward receives and sends gradients (what :meth:`_shape` puts around the
        compute; the same for every micro-batch)."""
        found = self._chunk_ends.get(chunk)
        if found is None:
            pos, last = self.position_of(chunk), self.last_position
            found = self._chunk_ends[chunk] = (self.loads(chunk), pos > 0, pos < last,
                                               pos < last, pos > 0)
        return found

    def steps(self) -> list[list[Instruction]]:
        return list(map(list, self._built[0]))  # fresh lists, copied in C

    def unpaired_steps(self) -> list[list[Instruction]]:
        """The steps a stage runs when it runs each pair as its two steps (no overlapping
        executor): by default :func:`unpair` of :meth:`steps` (its steps themselves when
        it pairs nothing). A schedule whose pairs change its order (``zbv``) returns the
        order it would run without them."""
        if type(self).steps is OrderedSchedule.steps and not self.pairs():
            return self.steps()  # nothing paired: no step to look through
        if self._splits_plainly:
            return list(map(list, self._unpaired_built[0]))
        return unpair(self.steps())

    @cached_property
    def _splits_plainly(self) -> bool:
        """Whether :meth:`unpaired_steps` are the steps of the order without pairs: the
        built-in steps (no subclass's own), pairs that :func:`_plain_pairs` accepts."""
        return (type(self).steps is OrderedSchedule.steps and not self._own_forward_step
                and _plain_pairs(self._built_order, self.pairs()))

    @cached_property
    def _built_order(self) -> list[Op]:
        return list(self.order())

    @cached_property
    def _unpaired_built(self) -> tuple[list[list[Instruction]], int]:
        """The steps of the order with no pair made, and their buffers: :func:`unpair` of
        the paired steps when :attr:`_splits_plainly` (each pair's step splits back into
        the two steps it was made of), without making the pairs to split them again."""
        return self._build(self._built_order, frozenset())

    def num_buffers(self) -> int:
        """The stage's peak number of live ``(chunk, micro_batch)`` parts (the same with
        pairs or without: a pair merges two steps, it moves no buffer)."""
        if "_built" not in self.__dict__ and self.pairs() and self._splits_plainly:
            return self._unpaired_built[1]  # no paired steps made only to count
        return self._built[1]


def _paired(steps: list[list[Instruction]], order: Sequence[Op],
            pairs: frozenset[int]) -> list[list[Instruction]]:
    """``steps`` (one per op of ``order``) with each pair's two steps merged into one
    (see the module docstring)."""
    if not pairs:
        return steps
    out: list[list[Instruction]] = []
    skip = False
    for i, step in enumerate(steps):
        if skip:
            skip = False
            continue
        if i not in pairs:
            out.append(step)
            continue
        if order[i][0] != "F" or i + 1 >= len(order) or order[i + 1][0] != "B":
            raise ScheduleError(f"pairs() names op {i} ({order[i]}), which is not a forward "
                                "followed by a full backward",
                                hint="pair an F with the B right after it in order()")
        f_step, b_step = step, steps[i + 1]
        f_at, forward = next((k, ins) for k, ins in enumerate(f_step) if type(ins) is Forward)
        b_at, backward = next((k, ins) for k, ins in enumerate(b_step) if type(ins) is Backward)
        out.append([*f_step[:f_at], *b_step[:b_at],
                    ForwardBackward(forward, backward),
                    *f_step[f_at + 1:], *b_step[b_at + 1:]])
        skip = True
    return out


def _plain_pairs(order: Sequence[Op], pairs: frozenset[int]) -> bool:
    """Whether :func:`_paired` makes every pair it looks at without an error and the
    last op is in none (its step then ends the batch, a pair's would move the end's
    reductions into its forward half): then unpairing the paired steps gives the steps
    of ``order`` without pairs. Otherwise the caller builds and unpairs, as before."""
    n = len(order)
    made = -2  # the pair made last (_paired skips the op after it)
    for i in sorted(pairs):
        if i >= n:
            break
        if i < 0 or i == made + 1:  # never an index of a step, or right after a pair
            continue
        if i + 1 >= n - 1 or order[i][0] != "F" or order[i + 1][0] != "B" \
                or order[i][1:] == order[i + 1][1:]:  # a part paired with itself
            return False
        made = i
    return True


def unpair(steps: Sequence[Sequence[Instruction]]) -> list[list[Instruction]]:
    """``steps`` with each ``ForwardBackward`` step split back into its forward step and
    its backward step (each half with its own transfers, the forward's first): what a
    stage without an overlapping executor runs, the order and the posting of the
    schedule before it paired (a pure ``steps -> steps`` pass)."""
    out: list[list[Instruction]] = []
    for step in steps:
        at = _pair_at(step)
        if at is None:
            out.append(list(step))
            continue
        pair = step[at]
        assert isinstance(pair, ForwardBackward)  # what _pair_at found
        f, b = pair.halves
        fwd: list[Instruction] = [ins for ins in step[:at] if not isinstance(ins, RecvGrad)]
        bwd: list[Instruction] = [ins for ins in step[:at] if isinstance(ins, RecvGrad)]
        fwd.append(f)
        bwd.append(b)
        for ins in step[at + 1:]:
            (bwd if isinstance(ins, SendGrad) else fwd).append(ins)
        out += [fwd, bwd]
    return out


def _pair_at(step: Sequence[Instruction]) -> int | None:
    """The index of the first ``ForwardBackward`` in ``step``, or ``None`` (a plain loop: a
    generator per step cost more than the step's own split)."""
    for k, ins in enumerate(step):
        if isinstance(ins, ForwardBackward):
            return k
    return None


def unpaired_steps(schedule: object) -> list[list[Instruction]]:
    """What ``schedule`` runs on a stage without an overlapping executor: its own
    ``unpaired_steps()`` when it has one (:meth:`OrderedSchedule.unpaired_steps`), else
    :func:`unpair` of its ``steps()`` (any object with ``steps()``)."""
    own = getattr(schedule, "unpaired_steps", None)
    if callable(own):
        return own()
    steps = schedule.steps()  # type: ignore[attr-defined]
    if any(isinstance(i, ForwardBackward) for step in steps for i in step):
        return unpair(steps)
    return list(map(list, steps))
