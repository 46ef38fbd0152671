"""V-Min and V-Half: V schedules with controllable memory (layer 0: no torch).

From "Pipeline Parallelism with Controllable Memory" (Qi et al., NeurIPS 2024). Both
use the V placement of ``zbv`` (two chunks per rank: rank ``s`` holds positions ``s``
and ``2 S - 1 - s``) and the zero-bubble split backward (``BackwardInput`` I, then
``BackwardWeight`` W), and both hold fewer micro-batches than 1F1B's ``S``, paying
for it with part of the bubble that ``zbv`` removes:

=========  ====================================  ==============================
schedule   peak activations per stage            bubble at ``F = B = W``
=========  ====================================  ==============================
``v-min``  ``(S + 4) // 3`` micro-batches' worth  about ``2 S / 3 M`` (1F1B: ``S / M``)
``v-half`` ``(S + 2) // 2`` micro-batches' worth  about ``S / 2 M``
=========  ====================================  ==============================

(A part is half a stage, so ``k`` micro-batches' worth is ``2 k`` live parts, what
:meth:`~pipekernel.schedules.ordered.OrderedSchedule.num_buffers` counts.)

**How a plan is made: the paper's building block, repeated.** In unit time
(``F = I = W = 1`` per part) one micro-batch occupies every stage for six slots
(F and I of both chunks, and their two W). The block gives each stage the slot,
modulo a period of 6, of each of its four F/I operations; micro-batch ``k`` runs them
``6 k`` later, so in the steady state every stage is busy in every slot. The slots
follow from the *offsets* between neighbours — how many slots after its upstream
neighbour a stage runs the same operation:

* ``F`` of chunk 0 (going down) and ``I`` of chunk 1 (the first backward, going down
  too): offset ``a`` — 1 for V-Min, 2 for V-Half;
* ``F`` of chunk 1 and ``I`` of chunk 0 (coming back up): offset 1;
* the turns: the last rank's chunk-1 ``F`` right after its chunk-0 ``F``; rank 0's
  chunk-1 ``I`` (the loss) ``1 + gap`` after its chunk-1 ``F``; the last rank's
  chunk-0 ``I`` ``a`` after its chunk-1 ``I``.

A part lives from its F to its W, so its lifetime is the distance between those slots;
the sum over a stage's two chunks is about ``4 S + 2 gap`` (V-Min) or ``6 S + 2 gap``
(V-Half) slots, a sixth of it in parts: about ``2 S / 3`` parts (``S / 3`` micro-batches)
and ``S`` parts (``S / 2`` micro-batches). ``gap`` is the smallest value (0 or 2 for
V-Min, 0 or 3 for V-Half) for which a stage's four slots fall on four different
residues modulo 6 (else two operations of a stage would want the same slot). W take
the two free slots of each period, the oldest pending W first.

Each stage then runs its operations in the order of their slots: the runtime (and the
simulator) start each as soon as its input is there, which squeezes out the empty
slots of the warm-up and the cool-down, and the order — hence the peak of live parts
— is the block's. At equal costs the simulator measures the paper's bubble within a
micro-batch's work (``tests/test_schedules_controllable.py`` says how close).

Micro-batches: with ``M <=`` the peak (in micro-batches) every micro-batch is live at
once on some stage, so the schedule saves nothing against ``zbv`` and has a larger
bubble; :meth:`ControllableV.min_micro_batches` is one more, and fewer is a
:class:`~pipekernel.errors.ConfigError`.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from functools import lru_cache
from typing import ClassVar

from pipekernel.errors import ConfigError
from pipekernel.schedules.ordered import Op, OrderedSchedule

__all__ = ["ControllableV", "VMin", "VHalf", "building_block", "v_order"]

#: Slots per micro-batch and stage: F and I of two chunks, and their two W.
PERIOD = 6


@lru_cache(maxsize=64)
def building_block(num_stages: int, spread: int) -> tuple[tuple[int, int, int, int], ...]:
    """Per stage, the slots of micro-batch 0's ``(F chunk 0, F chunk 1, I chunk 1,
    I chunk 0)`` (see the module docstring); ``spread`` is the offset ``a`` of the
    operations going down (1: V-Min, 2: V-Half)."""
    S, a = num_stages, spread
    turn_f = a * (S - 1) + 1              # the last rank's chunk-1 F
    for gap in range(PERIOD):
        first_i = turn_f + (S - 1) + 1 + gap  # rank 0's chunk-1 I (after the loss)
        turn_i = first_i + a * (S - 1) + a    # the last rank's chunk-0 I
        rows = tuple((a * s, turn_f + (S - 1 - s), first_i + a * s, turn_i + (S - 1 - s))
                     for s in range(S))
        if all(len({slot % PERIOD for slot in row}) == 4 for row in rows):
            return rows
    raise AssertionError(f"no building block for {S} stages, spread {a}")  # unreachable


@lru_cache(maxsize=256)
def v_order(num_stages: int, stage: int, micro_batches: int, spread: int) -> tuple[Op, ...]:
    """One stage's order: the block repeated ``micro_batches`` times, the W in the free
    slots (oldest first), everything sorted by slot."""
    f0, f1, i1, i0 = building_block(num_stages, spread)[stage]
    slots: dict[Op, int] = {}
    for k in range(micro_batches):
        shift = PERIOD * k
        slots[("F", 0, k)], slots[("F", 1, k)] = f0 + shift, f1 + shift
        slots[("I", 1, k)], slots[("I", 0, k)] = i1 + shift, i0 + shift
    taken = set(slots.values())
    inputs = sorted((slot, op) for op, slot in slots.items() if op[0] == "I")
    pending: deque[Op] = deque()
    slot = nxt = 0
    while nxt < len(inputs) or pending:
        while nxt < len(inputs) and inputs[nxt][0] < slot:
            pending.append(inputs[nxt][1])
            nxt += 1
        if pending and slot not in taken:
            _, chunk, mb = pending.popleft()
            slots[("W", chunk, mb)] = slot
        slot += 1
    return tuple(sorted(slots, key=slots.__getitem__))


@lru_cache(maxsize=64)
def _steady_peak(num_stages: int, spread: int) -> int:
    """The most live parts any stage holds once the block repeats without end (measured on
    enough micro-batches for every stage to reach its steady state)."""
    # a micro-batch's slots on a stage span under 6 S + 12 (a block, and a W delayed a
    # period): from micro-batch S + 2 on every stage repeats its steady state
    micro_batches = 2 * num_stages + 4
    return max(_peak(v_order(num_stages, s, micro_batches, spread)) for s in range(num_stages))


def _peak(order: Sequence[Op]) -> int:
    live = peak = 0
    for kind, _, _ in order:
        live += (kind == "F") - (kind == "W")
        peak = max(peak, live)
    return peak


class ControllableV(OrderedSchedule):
    """A V schedule built from the paper's building block (see
    :mod:`pipekernel.schedules.controllable`); subclasses set ``spread``."""

    placement = "v"
    trains = True
    min_chunks = max_chunks = default_chunks = 2
    #: The offset between neighbours of the operations going down the V.
    spread: ClassVar[int] = 1

    def __init__(self, num_stages: int, stage: int, micro_batches: int, chunks: int = 2) -> None:
        super().__init__(num_stages, stage, micro_batches, chunks)
        least = self.min_micro_batches(num_stages)
        if micro_batches < least:
            peak = self.peak_micro_batches(num_stages)
            raise ConfigError(
                f"{self.name} with {num_stages} stage(s) needs micro_batches >= {least}, got "
                f"{micro_batches}: its steady state holds {peak} micro-batches' worth of "
                "activations per stage, and with no more micro-batches than that every one "
                "is live at once, so it saves no memory",
                hint=f"pass micro_batches={least} or more, or use schedule='zbv' (the same V "
                     "placement, any micro-batch count, less bubble)", stage=stage)

    @classmethod
    def peak_micro_batches(cls, num_stages: int) -> int:
        """The peak of activations a stage holds in the steady state, in micro-batches'
        worth (two live parts each, rounded up): ``(S + 4) // 3`` for V-Min, ``(S + 2) //
        2`` for V-Half, measured on the building block, not assumed."""
        return -(-_steady_peak(num_stages, cls.spread) // 2)

    @classmethod
    def min_micro_batches(cls, num_stages: int) -> int:
        """The fewest micro-batches the schedule takes: one more than its peak."""
        return cls.peak_micro_batches(num_stages) + 1

    def order(self) -> Sequence[Op]:
        return v_order(self.num_stages, self.stage, self.micro_batches, self.spread)


class VMin(ControllableV):
    """V-Min: about a third of 1F1B's activation memory (``(S + 4) // 3`` micro-batches'
    worth per stage), a bubble of about ``2 S / 3 M`` at ``F = B = W``."""

    name = "v-min"
    spread = 1


class VHalf(ControllableV):
    """V-Half: about half of 1F1B's activation memory (``(S + 2) // 2`` micro-batches'
    worth per stage), a bubble of about ``S / 2 M`` at ``F = B = W``."""

    name = "v-half"
    spread = 2
