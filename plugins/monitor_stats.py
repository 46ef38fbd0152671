"""The monitor's numbers: per-step measurements of one rank, running totals, and the
per-rank summary (grouped seconds, bubble and wait fractions, rates).

Everything here is plain arithmetic on numbers the monitor measured: no torch,
no communication, no clock.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["WAITS", "GROUPS", "VECTOR", "Totals", "derive", "step_numbers", "merge_record"]

#: Instructions whose time is waiting for a peer (the bubble inside the schedule); a
#: skip connection's receives wait like an activation's.
WAITS = ("RecvActivation", "RecvGrad", "RecvSkip", "RecvSkipGrad")
#: Summary keys and the instruction classes they add up.
GROUPS = {
    "forward_s": ("Forward",), "backward_s": ("Backward", "BackwardInput", "BackwardWeight"),
    "wait_s": WAITS, "send_s": ("SendActivation", "SendGrad", "SendSkip", "SendSkipGrad"), "load_s": ("LoadMicroBatch",),
    # the data-parallel reducer's arm and launch points start its buckets: reduction time
    "reduce_s": ("ReduceTiedGrads", "ArmGradReduce", "LaunchGradReduce", "ReduceGrads"),
    "optimizer_s": ("OptimizerStep",),
    "paired_s": ("ForwardBackward",),  # a forward and a backward overlapped: one span
}
#: Per-rank numbers carried by the per-step all-reduce, before the per-class seconds.
VECTOR = ("step_s", "drain_s", "peak_memory_mb", "samples", "tokens", "other_instr_s")


def step_numbers(classes: Sequence[str], spans: Sequence[tuple[float, float, Any]],
                 step_s: float, step: int, **counts: float) -> dict[str, Any]:
    """One step's numbers from its instructions' ``(offset, seconds, instruction)`` spans
    (offsets from the step's start) and the step's length; ``counts``:
    ``peak_memory_mb``, ``samples``, ``tokens``."""
    per_class = dict.fromkeys(classes, 0.0)
    other_instr = 0.0
    for _, seconds, instruction in spans:
        name = type(instruction).__name__
        if name in per_class:
            per_class[name] += seconds
        else:
            other_instr += seconds
    last = spans[-1][0] + spans[-1][1] if spans else 0.0
    return {"step": step, "step_s": step_s, "drain_s": max(0.0, step_s - last),
            "peak_memory_mb": counts["peak_memory_mb"], "samples": counts["samples"],
            "tokens": counts["tokens"], "other_instr_s": other_instr,
            "instructions": per_class}


def merge_record(step: int, mine: Mapping[str, Any], ranks: Sequence[Mapping[str, Any]]
                 ) -> dict[str, Any]:
    """The record sinks get for one step: the world's numbers from every rank's
    :func:`derive` dict (``ranks``) and this rank's loss, flags and extras (``mine``)."""
    step_s = max(r["step_s"] for r in ranks)
    samples = sum(r["samples"] for r in ranks)
    tokens = sum(r["tokens"] for r in ranks)
    memory = [r["peak_memory_mb"] for r in ranks if r["peak_memory_mb"] == r["peak_memory_mb"]]
    return {
        "step": step, "loss": mine["loss"], "skipped": mine["skipped"], "step_s": step_s,
        "samples": samples, "tokens": tokens,
        "samples_per_s": samples / step_s if step_s > 0 else 0.0,
        "tokens_per_s": tokens / step_s if step_s > 0 else 0.0,
        "bubble_fraction": sum(r["bubble_fraction"] for r in ranks) / len(ranks),
        "wait_fraction": sum(r["wait_fraction"] for r in ranks) / len(ranks),
        "peak_memory_mb": max(memory) if memory else None,
        **mine["extra"],
        "ranks": list(ranks),
    }


class Totals:
    """Running sums of a rank's per-step numbers."""

    def __init__(self) -> None:
        self.numbers = dict.fromkeys(VECTOR, 0.0)
        self.classes: dict[str, float] = {}
        self.steps = self.skipped = 0

    def add(self, step: Mapping[str, Any]) -> None:
        for key in VECTOR:
            if key == "peak_memory_mb":
                self.numbers[key] = max(self.numbers[key], step[key])
            else:
                self.numbers[key] += step[key]
        for cls, seconds in step["instructions"].items():
            self.classes[cls] = self.classes.get(cls, 0.0) + seconds
        self.steps += 1
        self.skipped += bool(step["skipped"])


def derive(rank: int, stage: int, data: int, numbers: Mapping[str, float],
            classes: Mapping[str, float]) -> dict[str, Any]:
    """A rank's dict from raw sums: grouped times, other, fractions, rates."""
    out: dict[str, Any] = {"rank": rank, "stage": stage, "data_parallel_rank": data}
    step_s = numbers["step_s"]
    for key, names in GROUPS.items():
        out[key] = sum(classes.get(n, 0.0) for n in names)
    out["step_s"], out["drain_s"] = step_s, numbers["drain_s"]
    out["other_s"] = max(0.0, step_s - sum(classes.values()) - numbers["other_instr_s"]
                         - numbers["drain_s"])
    out["bubble_fraction"] = (out["wait_s"] + out["drain_s"]) / step_s if step_s > 0 else 0.0
    out["wait_fraction"] = out["wait_s"] / step_s if step_s > 0 else 0.0
    out["samples"], out["tokens"] = int(numbers["samples"]), int(numbers["tokens"])
    out["samples_per_s"] = out["samples"] / step_s if step_s > 0 else 0.0
    out["tokens_per_s"] = out["tokens"] / step_s if step_s > 0 else 0.0
    out["peak_memory_mb"] = numbers["peak_memory_mb"]
    out["instructions"] = dict(classes)
    return out

