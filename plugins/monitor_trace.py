"""The monitor's trace: instruction slices of one rank, merged into a Chrome trace.

:class:`TraceBuffer` keeps this rank's slices (microseconds since the common
time zero agreed at start), bounded by ``max_events``; :func:`chrome_events`
turns every rank's buffer into Chrome-trace events (one process per rank, a
thread for instructions and one for steps), which the ``trace`` sink writes.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["TraceBuffer", "chrome_events"]


class TraceBuffer:
    """This rank's recorded slices: ``(ts_us, dur_us, name, category, micro_batch, step)``.

    :param max_events: cap on kept slices; later ones are counted in ``dropped``.
    """

    def __init__(self, max_events: int) -> None:
        self.max_events = max_events
        self.events: list[tuple] = []
        self.dropped = 0

    def keep(self, spans: Sequence[tuple[float, float, Any]], step: int | None, epoch: float,
             step_start: float | None = None) -> None:
        """Record instruction ``spans`` as ``(start, seconds, instruction)`` (host seconds,
        on the monitor's time axis) and, for a training step, one slice for the step
        from ``step_start`` to the end of its last instruction. ``step=None``: eval."""
        if not spans:
            return
        room = self.max_events - len(self.events)
        if room < len(spans):
            self.dropped += len(spans) - max(room, 0)
        kept = spans[:max(room, 0)]
        for start, seconds, ins in kept:
            self.events.append(((start - epoch) * 1e6, seconds * 1e6, str(ins),
                                type(ins).__name__, getattr(ins, "micro_batch", None), step))
        if step is not None and kept and step_start is not None:
            self.events.append(((step_start - epoch) * 1e6,
                                (kept[-1][0] + kept[-1][1] - step_start) * 1e6,
                                f"step {step}", "step", None, step))


def chrome_events(parts: Sequence[tuple[int, int, list, int]]) -> list[dict[str, Any]]:
    """Chrome-trace events from every rank's ``(rank, stage, events, dropped)``."""
    out: list[dict[str, Any]] = []
    for rank, stage, events, dropped in parts:
        out.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                    "args": {"name": f"rank {rank} (stage {stage})"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0,
                    "args": {"sort_index": rank}})
        out.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": 0,
                    "args": {"name": "instructions"}})
        out.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": 1,
                    "args": {"name": "steps"}})
        for ts, dur, name, cat, micro_batch, step in events:
            args = {"stage": stage, "micro_batch": micro_batch, "step": step}
            if step is None:
                args["phase"] = "eval"
            out.append({"name": name, "cat": cat, "ph": "X", "ts": round(ts, 3),
                        "dur": round(dur, 3), "pid": rank, "tid": 1 if cat == "step" else 0,
                        "args": args})
        if dropped:
            out.append({"name": f"{dropped} instructions not traced (trace_max_events)",
                        "ph": "i", "s": "p", "ts": events[-1][0] if events else 0,
                        "pid": rank, "tid": 0})
    return out
