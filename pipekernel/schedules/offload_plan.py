"""Which parts' saved activations leave the device, and when they come back (layer 0: no
torch): schedule-aware activation offload (PipeOffload, Wan et al., ICML 2025).

A part's activations are kept from its ``Forward`` until the instruction that first reads
them again: its ``Backward``, or with a split backward its ``BackwardInput`` (the
``BackwardWeight`` after it re-runs the split nodes with the same saved tensors, so they
stay on the device from the input pass on). :func:`offload_points` reads the stage's
compiled :class:`~pipekernel.schedules.program.Program` — the stream the runtime runs —
and counts, for every ``Forward``, the compute instructions between it and that
backward: the *distance*. A part whose distance is at least ``min_distance`` and more
than ``prefetch`` moves to host memory right after its forward, and its copy back is
posted ``prefetch`` compute instructions before its backward (before that instruction
runs), so the transfer overlaps the compute in between; the backward waits for it.

The runtime (:mod:`pipekernel.stage.offload`), the memory model
(:mod:`pipekernel.schedules.sim_memory`) and the time model
(:func:`offload_delays`) read the same points, so what is predicted is what runs.
A paired ``ForwardBackward`` instruction's forward half is never offloaded (its backward
half is another micro-batch's: nothing is far away inside a pair).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipekernel.errors import ConfigError
from pipekernel.schedules import instructions as isa

__all__ = ["OffloadPoints", "offload_points", "check_offload_numbers", "offload_delays",
           "offload_step"]

_COMPUTE = (isa.Forward, isa.Backward, isa.BackwardInput, isa.BackwardWeight,
            isa.ForwardBackward)


@dataclass(frozen=True)
class OffloadPoints:
    """The offload decisions of one stage's program.

    * ``parts``: ``{(micro_batch, chunk): (forward, prefetch, backward)}`` stream indices
      of every offloaded part: moved out after ``stream[forward]``, its copy back posted
      right before ``stream[prefetch]`` runs, waited for by ``stream[backward]``;
    * ``prefetch_at``: ``{stream index: keys whose copy back is posted before it}``;
    * ``distance``: ``{(micro_batch, chunk): compute instructions between the forward and
      its backward}`` for every forward of the stream (offloaded or not).
    """

    parts: Mapping[tuple[int, int], tuple[int, int, int]]
    prefetch_at: Mapping[int, tuple[tuple[int, int], ...]]
    distance: Mapping[tuple[int, int], int]

    def offloaded_at(self, index: int) -> list[tuple[int, int]]:
        """The parts on the host while ``stream[index]`` runs (moved out after an earlier
        forward, their copy back not yet posted at or before ``index``)."""
        return [key for key, (f, p, _) in self.parts.items() if f < index < p]


def check_offload_numbers(min_distance: object, prefetch: object) -> None:
    """``ConfigError`` unless ``min_distance >= 1`` and ``prefetch >= 0`` are ints."""
    for what, value, least in (("min_distance", min_distance, 1), ("prefetch", prefetch, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ConfigError(f"offload: {what} must be an int >= {least}, got {value!r}",
                              hint="e.g. pk.Offload(min_distance=2, prefetch=1): offload "
                                   "a part whose backward is 2 or more compute instructions "
                                   "away, fetched back 1 instruction ahead")


def offload_points(stream: Sequence[isa.Instruction], min_distance: int = 2,
                   prefetch: int = 1) -> OffloadPoints:
    """The offload decisions for ``stream`` (a program's instructions, in order): see the
    module docstring. ``prefetch = 0`` posts the copy back right before the backward
    (no overlap)."""
    check_offload_numbers(min_distance, prefetch)
    compute = [i for i, ins in enumerate(stream) if isinstance(ins, _COMPUTE)]
    rank = {index: n for n, index in enumerate(compute)}  # stream index -> compute count
    forwards: dict[tuple[int, int], int] = {}
    parts: dict[tuple[int, int], tuple[int, int, int]] = {}
    distance: dict[tuple[int, int], int] = {}
    for i in compute:
        ins = stream[i]
        key = (getattr(ins, "micro_batch", -1), getattr(ins, "chunk", 0))
        if isinstance(ins, isa.Forward):
            forwards[key] = i
        elif isinstance(ins, (isa.Backward, isa.BackwardInput)) and key in forwards:
            f = forwards.pop(key)
            gap = rank[i] - rank[f] - 1
            distance[key] = gap
            if gap >= min_distance and gap > prefetch:
                parts[key] = (f, compute[rank[i] - prefetch], i)
    at: dict[int, list[tuple[int, int]]] = {}
    for key, (_, p, _) in parts.items():
        at.setdefault(p, []).append(key)
    return OffloadPoints(parts, {i: tuple(keys) for i, keys in at.items()}, distance)


def offload_delays(timeline: Sequence[tuple[float, float, isa.Instruction]],
                   points: OffloadPoints, stream: Sequence[isa.Instruction],
                   seconds: Mapping[tuple[int, int], float]) -> tuple[float, float]:
    """The time model of offload on one stage: ``(stall, busy)`` seconds.

    ``timeline``: the stage's compute instructions as the simulator timed them without
    offload (``SimulationResult.timeline[stage]``, in stream order); ``seconds``: per
    offloaded part, one direction's transfer time (its moved bytes over the host link's
    bandwidth: the cost parameter). Both directions share one side stream (copies run in
    posting order, one at a time) beside the compute stream: a part's copy out starts when
    its forward ends and the side stream is free, its copy back when its prefetch point is
    reached (the start of ``stream[prefetch]``) and the side stream is free; its backward
    starts no earlier than the copy back's end. ``stall``: how much later the stage's last
    compute instruction ends than without offload (each wait delays everything after it
    on the stage); ``busy``: the side stream's total transfer time (what overlaps compute
    when ``stall`` is 0). A stage's stall is its own: how a late stage delays its peers
    is not modelled (the whole pipeline's step grows by at least the largest stall)."""
    compute = [i for i, ins in enumerate(stream) if isinstance(ins, _COMPUTE)]
    if len(compute) != len(timeline):
        raise ConfigError(f"offload_delays: {len(timeline)} timed instructions for "
                          f"{len(compute)} compute instructions in the stream",
                          hint="pass the same stage's SimulationResult.timeline and program")
    waits = {b: key for key, (_, _, b) in points.parts.items()}
    outs = {f: key for key, (f, _, _) in points.parts.items()}
    backs: dict[tuple[int, int], float] = {}
    side = shift = busy = 0.0
    for (start, end, _), i in zip(timeline, compute):
        start += shift
        for key in points.prefetch_at.get(i, ()):
            side = max(side, start) + seconds.get(key, 0.0)
            busy += seconds.get(key, 0.0)
            backs[key] = side
        if i in waits:
            late = backs.get(waits[i], start) - start
            if late > 0:
                shift += late
                start += late
        end += shift
        if i in outs:
            side = max(side, end) + seconds.get(outs[i], 0.0)
            busy += seconds.get(outs[i], 0.0)
    return shift, busy


def offload_step(schedule_cls, num_stages: int, micro_batches: int, chunks: int = 1, *,
                 seconds: Mapping[tuple[int, int], float], min_distance: int = 2,
                 prefetch: int = 1, costs: Mapping[type, float] | None = None
                 ) -> dict[str, object]:
    """The simulator's step with offload: ``{"makespan": without offload, "stalls": per
    stage (:func:`offload_delays`), "busy": per stage, "step": makespan + the largest
    stall}``. ``seconds``: ``{(stage, chunk): one direction's transfer time of one
    micro-batch's moved bytes}`` (a part not listed moves in no time); ``costs`` as
    :func:`~pipekernel.schedules.simulator.simulate` takes them."""
    from pipekernel.schedules.program import lower
    from pipekernel.schedules.simulator import simulate

    result = simulate(schedule_cls, num_stages, micro_batches, chunks, costs=costs)
    placement = getattr(schedule_cls, "placement", "loop")
    stalls, busy = [], []
    for stage in range(num_stages):
        stream = lower(schedule_cls(num_stages, stage, micro_batches, chunks), stage=stage,
                       num_stages=num_stages, micro_batches=micro_batches, chunks=chunks,
                       placement=placement, paired=False).stream
        points = offload_points(stream, min_distance, prefetch)
        per_part = {key: seconds.get((stage, key[1]), 0.0) for key in points.parts}
        stall, side = offload_delays(result.timeline[stage], points, stream, per_part)
        stalls.append(stall)
        busy.append(side)
    return {"makespan": result.makespan, "stalls": stalls, "busy": busy,
            "step": result.makespan + max(stalls, default=0.0)}
