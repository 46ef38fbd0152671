"""What each stage holds, instruction by instruction: the memory model behind the planner,
the partition report and ``pk.memory`` (layer 0: no torch).

:func:`stage_memory` replays each stage's program — the one the engine runs, lowered by
:func:`~pipekernel.schedules.program.lower`, posting points included — and tracks, per
buffer slot, what the stage runtime (:mod:`pipekernel.stage.runtime`) keeps there after
every instruction, in the two categories the :class:`~pipekernel.stage.memory.MemoryLedger`
measures beside the static state (parameters, gradients, optimizer):

* ``saved``: a part's activations saved for backward, from its ``Forward`` until its
  ``Backward`` — or, with a split backward, until its ``BackwardWeight`` (the input pass
  keeps the whole graph: the weight pass re-runs its split nodes); on the last position
  the loss's own saved tensors (its labels) too;
* ``buffers``: what the runtime holds: an input from its receive (or load) until its
  gradient is sent (on the first position, until the slot is filled again), outputs from
  the forward until the backward, a received gradient until the backward, the inputs'
  gradients until sent, the gradients a ``BackwardInput`` records for its
  ``BackwardWeight``, receives from their posting, activation sends until their gradient
  arrives and gradient sends until their release point (a gloo send completes only when
  waited; the runtime waits each once it knows the peer posted the receive:
  :func:`~pipekernel.schedules.send_release.release_points`; the step's last ones until
  its end), labels from the load until the loss. A send is a
  copy (a host transport packs what it sends into one message); a receive's message
  becomes the tensors received.

While a part's graph is alive its input is counted as saved (a part's first layer saves
what it receives), so the input counts in ``buffers`` only once the graph is gone; a local
hand-off (two chunks of one stage) shares the sender's storage.

Skip connections (``skips``: :class:`SkipBytes` per edge, :mod:`pipekernel.schedules.skips`)
add, per micro-batch: at the producer, the stash from its ``Forward`` until its
``Backward`` / ``BackwardInput`` (the runtime's skip state; the part of it the profiler
counted as the producer's saved bytes, ``SkipBytes.held``, moves from ``saved`` to
``buffers``), the received gradients from ``RecvSkipGrad``'s posting until that backward,
and ``SendSkip``'s buffer until the step's end; at the consumer, the values' message from
``RecvSkip``'s posting until its ``Forward`` (buffers), then in the graph until the backward
(``saved``: the popping layers save views of it; ``SkipBytes.popped`` of the part's
profiled bytes replaced by it), their gradients from the backward until ``SendSkipGrad``,
and its buffer until the step's end. What the model ignores: a tensor a layer saves that
the next part also receives.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pipekernel.schedules import instructions as isa
from pipekernel.schedules.program import lower
from pipekernel.schedules.send_release import release_points

__all__ = ["PartBytes", "SkipBytes", "stage_memory", "part_bytes", "live_graphs"]


@dataclass(frozen=True)
class PartBytes:
    """Bytes of one micro-batch on one part (a stage's chunk).

    :param saved: saved for backward by the part's layers (and, on the last position,
        by the loss).
    :param inputs: what the part receives (on the first position: what it loads).
    :param outputs: what the part returns (on the last position: the logits).
    :param weight_state: what a ``BackwardInput`` keeps for its ``BackwardWeight``
        beyond the graph (the split nodes' recorded gradients).
    :param labels: the labels a last position loads.
    :param grads: the part's parameter gradients: absent until its first backward writes
        them (``Backward`` or ``BackwardWeight``; they are dropped before each step), then
        held to the step's end.
    :param offloaded: of ``saved``, what activation offload moves to the host when the
        part is offloaded (what the runtime does not hold anyway: not its inputs, not its
        outputs; :mod:`pipekernel.stage.offload`).
    """

    saved: float = 0.0
    inputs: float = 0.0
    outputs: float = 0.0
    weight_state: float = 0.0
    labels: float = 0.0
    grads: float = 0.0
    offloaded: float = 0.0


@dataclass(frozen=True)
class SkipBytes:
    """Bytes of one micro-batch on one skip edge (producer position -> consumer position).

    :param values: the stashed tensors (what ``SendSkip`` sends, ``RecvSkip`` receives).
    :param grads: their gradients (of those that require grad: what ``SendSkipGrad`` sends).
    :param held: of ``values``, what the producer's ``PartBytes.saved`` already counts (the
        profiler counts a stash autograd does not save as the stashing layer's): held by
        the runtime's skip state, so counted in ``buffers`` instead, until the backward.
    :param popped: what the consumer's ``PartBytes.saved`` counts for the pops (the
        profiler: each popped value's bytes, once): the consumer's graph keeps the received
        message (``values``, one storage that its popped views share) instead.
    """

    values: float = 0.0
    grads: float = 0.0
    held: float = 0.0
    popped: float = 0.0


class _Slot:
    __slots__ = ("key", "inputs", "outputs", "shared", "grads", "input_grads", "graph", "split",
                 "host", "skips")

    def __init__(self, key: tuple[int, int]) -> None:
        self.key = key
        self.inputs = self.outputs = self.grads = self.input_grads = 0.0
        self.graph = self.split = self.host = 0.0
        self.skips = 0.0  # stashes kept for a backward, skip values and gradients received
        self.shared = False  # outputs handed to a chunk of this stage: counted there

    def buffers(self) -> float:
        held = self.grads + self.input_grads + self.split + self.skips
        held += 0.0 if self.shared else self.outputs
        return held + (0.0 if self.graph else self.inputs)


def stage_memory(schedule_cls, num_stages: int, micro_batches: int, chunks: int,
                 parts: Mapping[tuple[int, int], PartBytes],
                 offload: tuple[int, int] | None = None,
                 trace: list | None = None,
                 skips: Mapping[tuple[int, int], SkipBytes] | None = None
                 ) -> list[dict[str, float]]:
    """Per stage, ``{"grads": bytes, "saved": bytes, "buffers": bytes}`` at the peak of
    their sum over the step (sampled between instructions, as the meter samples).
    ``parts``: ``{(stage, chunk): PartBytes}`` for every part. ``offload``:
    ``(min_distance, prefetch)`` of activation offload
    (:func:`~pipekernel.schedules.offload_plan.offload_points`): an offloaded part's
    ``PartBytes.offloaded`` leaves ``saved`` after its forward and comes back at its
    prefetch point. ``trace``: a list that receives, per stage, the samples
    ``[(saved, host)]`` taken after each instruction (host: the bytes offloaded then).
    ``skips``: ``{(producer position, consumer position): SkipBytes}`` of a model with skip
    connections (the engine's ``skip_edges``); the program then holds their transfers."""
    placement = getattr(schedule_cls, "placement", "loop")
    edges = dict(skips or {})
    programs = [lower(schedule_cls(num_stages, stage, micro_batches, chunks), stage=stage,
                      num_stages=num_stages, micro_batches=micro_batches, chunks=chunks,
                      placement=placement, paired=False, skips=tuple(sorted(edges)))
                for stage in range(num_stages)]
    out = []
    for stage in range(num_stages):
        samples: list[tuple[float, float]] = []
        out.append(_replay(programs[stage], stage, num_stages, chunks, placement, parts,
                           release_points(programs, stage), offload, samples, edges))
        if trace is not None:
            trace.append(samples)
    return out


def _replay(plan, stage: int, num_stages: int, chunks: int, placement: str,
            parts: Mapping[tuple[int, int], PartBytes],
            release: Mapping[int, tuple[int, ...]], offload, samples: list,
            table: Mapping[tuple[int, int], SkipBytes]) -> dict[str, float]:
    from pipekernel.schedules.offload_plan import offload_points

    first, last = _ends(stage, num_stages, chunks, placement)
    slots: dict[int, _Slot] = {}
    where: dict[tuple[int, int], _Slot] = {}
    state = {"posted": 0.0, "labels": 0.0}
    sends: dict[int, float] = {}  # a gradient's or skip's send copy by stream index, until released
    written: set[int] = set()  # chunks whose gradients exist
    pending_acts: dict[tuple[int, int], float] = {}
    posted: dict[int, float] = {}
    best = {"grads": 0.0, "saved": 0.0, "buffers": 0.0}
    points = offload_points(plan.stream, *offload) if offload else None

    def fill(ins) -> _Slot:
        slot = slots.get(ins.buffer)
        if slot is None or slot.key != (ins.micro_batch, ins.chunk):
            slot = slots[ins.buffer] = _Slot((ins.micro_batch, ins.chunk))
            where[slot.key] = slot
        return slot

    def sample() -> None:
        saved = sum(s.graph for s in slots.values())
        buffers = sum(s.buffers() for s in slots.values()) + sum(state.values())
        buffers += sum(pending_acts.values()) + sum(sends.values())
        grads = sum(parts[(stage, c)].grads for c in written)
        if grads + saved + buffers > sum(best.values()):
            best.update(grads=grads, saved=saved, buffers=buffers)

    edge_of = _skip_edges(stage, num_stages, chunks, placement, table)
    for i, ins in enumerate(plan.stream):
        state["posted"] += _post(plan, i, stage, num_stages, placement, parts, table, posted)
        for key in points.prefetch_at.get(i, ()) if points is not None else ():
            slot = where[key]  # the copy back, posted before stream[i]
            slot.graph, slot.host = slot.graph + slot.host, 0.0
        sample()
        if isinstance(ins, isa.SkipInstruction):
            _skip_step(ins, i, table[_edge(ins, stage, num_stages, placement)], fill, state,
                       posted, sends)
        else:
            _step(ins, i, plan, parts, stage, first, last, fill, where, state, pending_acts,
                  posted, sends)
            _skip_part(ins, where, edge_of)
        for j in release.get(i, ()):
            sends.pop(j, None)
        if isinstance(ins, (isa.Backward, isa.BackwardWeight)):
            written.add(ins.chunk)
        if points is not None and isinstance(ins, isa.Forward) \
                and (ins.micro_batch, ins.chunk) in points.parts:
            slot = where[(ins.micro_batch, ins.chunk)]  # moved out after the forward
            slot.host = parts[(stage, ins.chunk)].offloaded
            slot.graph -= slot.host
        sample()
        samples.append((sum(s.graph for s in slots.values()),
                        sum(s.host for s in slots.values())))
    return best


def _ends(stage: int, num_stages: int, chunks: int, placement: str) -> tuple[set, set]:
    """The chunks of ``stage`` at the first position and at the last."""
    from pipekernel.schedules.placement import locate

    at = {c: _position(stage, c, num_stages, placement, locate) for c in range(chunks)}
    return ({c for c in at if at[c] == 0},
            {c for c in at if at[c] == num_stages * chunks - 1})


def _post(plan, i: int, stage: int, num_stages: int, placement: str, parts, table,
          posted: dict[int, float]) -> float:
    """The receives posted before ``stream[i]``: their bytes (kept in ``posted`` by index)."""
    total = 0.0
    for j in plan.posts[i]:
        recv = plan.stream[j]
        if isinstance(recv, (isa.RecvSkip, isa.RecvSkipGrad)):
            edge = table[_edge(recv, stage, num_stages, placement)]
            posted[j] = edge.values if isinstance(recv, isa.RecvSkip) else edge.grads
        elif isinstance(recv, (isa.RecvActivation, isa.RecvGrad)):
            part = parts[(stage, recv.chunk)]
            posted[j] = part.inputs if isinstance(recv, isa.RecvActivation) else part.outputs
        else:
            continue
        total += posted[j]
    return total


def _edge(ins, stage: int, num_stages: int, placement: str) -> tuple[int, int]:
    from pipekernel.schedules.skips import skip_edge_of
    return skip_edge_of(ins, stage, num_stages, placement)


def _skip_edges(stage: int, num_stages: int, chunks: int, placement: str,
                skips: Mapping[tuple[int, int], SkipBytes]
                ) -> dict[int, tuple[list[SkipBytes], list[SkipBytes]]]:
    """``{chunk: ([SkipBytes of every edge it produces], [... it consumes])}`` on ``stage``."""
    from pipekernel.schedules.placement import position
    out = {}
    for c in range(chunks):
        pos = position(stage, c, num_stages, placement)
        out[c] = ([b for (producer, _), b in sorted(skips.items()) if producer == pos],
                  [b for (_, consumer), b in sorted(skips.items()) if consumer == pos])
    return out


def _skip_step(ins, i, edge: SkipBytes, fill, state, posted, sends) -> None:
    """One skip transfer: a send's buffer kept to the step's end (gloo completes a send only
    when waited; a skip's sends have no release point, :mod:`~pipekernel.schedules.send_release`);
    a receive's message kept in the slot until used."""
    if isinstance(ins, isa.SendSkip):
        sends[i] = edge.values
    elif isinstance(ins, isa.SendSkipGrad):
        sends[i] = edge.grads
        fill(ins).skips -= edge.grads  # the gradients computed by the backward: sent, dropped
    else:
        state["posted"] -= posted.pop(i, 0.0)
        fill(ins).skips += edge.values if isinstance(ins, isa.RecvSkip) else edge.grads


def _skip_part(ins, where,
               edge_of: Mapping[int, tuple[list[SkipBytes], list[SkipBytes]]]) -> None:
    """What a part's forward and backward do to its skip state (runtime: skip_routing)."""
    if not isinstance(ins, (isa.Forward, isa.Backward, isa.BackwardInput)):
        return
    slot = where.get((ins.micro_batch, ins.chunk))
    if slot is None:
        return
    produced, consumed = edge_of.get(ins.chunk, ([], []))
    if isinstance(ins, isa.Forward):
        # received values: popped into the graph, which keeps their whole message; the
        # stash the part produced: the skip state's, not the graph's
        slot.skips = sum(b.held for b in produced)
        slot.graph += sum(b.values - b.popped for b in consumed) - slot.skips
    else:  # the backward takes the stash and its gradients as roots and drops them; the
        # received values' gradients wait for their SendSkipGrad
        slot.skips = sum(b.grads for b in consumed)


def _position(stage, chunk, num_stages, placement, locate) -> int:
    for p in range(num_stages * (chunk + 1) * 2):
        if locate(p, num_stages, placement) == (stage, chunk):
            return p
    return -1


def _step(ins, i, plan, parts, stage, first, last, fill, where, state, pending_acts,
          posted, sends) -> None:
    """Apply one instruction to the slots (what the runtime's handler keeps and drops)."""
    key = (getattr(ins, "micro_batch", None), getattr(ins, "chunk", None))
    # every instruction that reads it names a chunk (a part of this stage)
    part: Any = parts.get((stage, key[1])) if key[1] is not None else None
    if isinstance(ins, isa.LoadMicroBatch):
        slot = fill(ins)
        if ins.chunk in first:
            slot.inputs = part.inputs
        for c in last:  # the stage holding the last position keeps the labels from any load
            state["labels"] += parts[(stage, c)].labels
    elif isinstance(ins, isa.RecvActivation):
        state["posted"] -= posted.pop(i, 0.0)
        fill(ins).inputs = part.inputs
        if plan.local[i]:  # the sender's outputs: the same storage
            sender = where.get((ins.micro_batch, plan.peers[i][1]))
            if sender is not None:
                sender.shared = True
    elif isinstance(ins, isa.Forward):
        slot = where[key]
        slot.graph = part.saved + (part.labels if ins.chunk in last else 0.0)
        slot.outputs = part.outputs
        if ins.chunk in last:
            state["labels"] -= part.labels
    elif isinstance(ins, isa.RecvGrad):
        state["posted"] -= posted.pop(i, 0.0)
        where[key].grads = part.outputs
        pending_acts.pop(key, None)
    elif isinstance(ins, (isa.Backward, isa.BackwardInput)):
        slot = where[key]
        if isinstance(ins, isa.Backward):
            slot.graph = 0.0
        else:
            slot.split = part.weight_state
        slot.outputs = slot.grads = 0.0
        slot.shared = False
        if ins.chunk not in first:
            slot.input_grads = part.inputs
    elif isinstance(ins, isa.BackwardWeight):
        slot = where[key]
        slot.graph = slot.split = 0.0
    elif isinstance(ins, isa.SendActivation):
        if not plan.local[i]:
            # a host transport packs the outputs into a send buffer of their size, which
            # the runtime waits (frees) when the outputs' gradient comes back
            pending_acts[key] = part.outputs
    elif isinstance(ins, isa.SendGrad):
        slot = where[key]
        if not plan.local[i]:
            sends[i] = slot.input_grads
        slot.inputs = slot.input_grads = 0.0


def part_bytes(bounds, num_stages: int, chunks: int, placement: str, *, saved, outputs,
             weight_states=None, input_bytes: float = 0.0, label_bytes: float = 0.0,
             checkpoint_interval: int | Sequence[int] = 0,
             grads=None) -> dict[tuple[int, int], PartBytes]:
    """``{(stage, chunk): PartBytes}`` of a partition (``bounds``, one more than the parts)
    from per-layer bytes: ``saved`` (saved for backward), ``outputs`` (what each layer
    returns), ``weight_states`` (what its input pass keeps for the weight pass; ``None``:
    nothing). ``input_bytes``: one micro-batch of the first layer's inputs;
    ``label_bytes``: of its labels (the loss saves them). The first position's input pass
    runs no node (nothing requires grad below it), so its weight pass keeps the outputs'
    gradient instead. ``checkpoint_interval`` ``k > 0``: a part keeps only the input of
    each run of ``k`` of its layers (what activation checkpointing saves; the recompute's
    own tensors live inside the backward, where the meter does not see them); a sequence
    gives each stage its own interval (the engine's ``recompute``, one per stage; ``0``:
    that stage keeps everything). ``grads``: per layer, its parameters' gradient bytes
    (``None``: counted as nothing)."""
    from pipekernel.schedules.placement import locate

    count = num_stages * chunks
    intervals = [checkpoint_interval] * num_stages if isinstance(checkpoint_interval, int) \
        else list(checkpoint_interval)
    out = {}
    for q in range(count):
        lo, hi = bounds[q], bounds[q + 1]
        where = locate(q, num_stages, placement)
        every = intervals[where[0]]
        state = outputs[hi - 1] if q == 0 else sum((weight_states or [0.0] * hi)[lo:hi])
        inputs = outputs[lo - 1] if lo else input_bytes
        kept = sum(saved[lo:hi]) if not every else sum(
            outputs[k - 1] if k else input_bytes for k in range(lo, hi, every))
        out[where] = PartBytes(
            saved=kept, inputs=inputs,
            outputs=outputs[hi - 1], weight_state=state,
            labels=label_bytes if q == count - 1 else 0.0,
            grads=sum((grads or [0.0] * hi)[lo:hi]))
    return out


def live_graphs(schedule_cls, num_stages: int, micro_batches: int,
                chunks: int) -> dict[tuple[int, int], int]:
    """``{(stage, chunk): the most micro-batches whose graph that chunk holds at once}``
    (from its ``Forward`` to its ``Backward``, or to its ``BackwardWeight``): the multiplier
    of a part's saved activations, per part — not the stage's whole in-flight count."""
    placement = getattr(schedule_cls, "placement", "loop")
    out = {}
    for stage in range(num_stages):
        program = lower(schedule_cls(num_stages, stage, micro_batches, chunks), stage=stage,
                        num_stages=num_stages, micro_batches=micro_batches, chunks=chunks,
                        placement=placement, paired=False)
        live = [0] * chunks
        peak = [0] * chunks
        for ins in program.stream:
            if isinstance(ins, isa.Forward):
                live[ins.chunk] += 1
                peak[ins.chunk] = max(peak[ins.chunk], live[ins.chunk])
            elif isinstance(ins, isa.Backward) or isinstance(ins, isa.BackwardWeight):
                live[ins.chunk] -= 1
        out.update({(stage, c): peak[c] for c in range(chunks)})
    return out
