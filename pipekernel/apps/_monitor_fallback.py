"""A minimal stand-in for ``pipekernel.plugins.monitor.Monitor`` (same interface).

``pipekernel train`` uses the real monitoring plugin when it is installed; this
fallback only exists so the command works without it. It times each
instruction through ``pipekernel_before/after_instruction``, writes a CSV and a
JSONL row per step and one merged Chrome trace on rank 0.
"""
from __future__ import annotations

import csv
import json
import os
import time
from pathlib import Path
from typing import Any

import pipekernel as pk

_KIND = {"Forward": "forward_s", "Backward": "backward_s", "BackwardInput": "backward_s",
         "BackwardWeight": "backward_s", "RecvActivation": "wait_s", "RecvGrad": "wait_s",
         "SendActivation": "send_s", "SendGrad": "send_s"}
_CAT = {"forward_s": "Forward", "backward_s": "Backward", "wait_s": "Wait", "send_s": "Send"}
_FIELDS = ("forward_s", "backward_s", "wait_s", "send_s", "other_s")


class Monitor:
    """Per-instruction timers, CSV/JSONL rows per step and a merged Chrome trace."""

    def __init__(self, out_dir: str | os.PathLike = "pipekernel-out",
                 sinks: tuple[str, ...] = ("csv", "jsonl", "trace"), every: int = 10) -> None:
        self.out_dir, self.sinks, self.every = Path(out_dir), tuple(sinks), every
        self.paths: dict[str, str] = {}
        self._events: list[dict[str, Any]] = []
        self._totals = dict.fromkeys(_FIELDS, 0.0)
        self._step_time = dict.fromkeys(_FIELDS, 0.0)
        self._steps, self._seconds, self._start_us = 0, 0.0, 0.0
        self._engine: Any = None
        self._rows: list[dict[str, Any]] = []

    @pk.hookimpl
    def pipekernel_before_instruction(self) -> None:
        self._start_us = time.time() * 1e6

    @pk.hookimpl
    def pipekernel_after_instruction(self, instruction: Any, stage: int, seconds: float) -> None:
        kind = _KIND.get(type(instruction).__name__, "other_s")
        self._step_time[kind] += seconds
        if "trace" in self.sinks:
            self._events.append({
                "ph": "X", "name": str(instruction), "cat": _CAT.get(kind, type(instruction).__name__),
                "ts": self._start_us, "dur": seconds * 1e6, "tid": 0,
                "args": {"stage": stage, "micro_batch": getattr(instruction, "micro_batch", None),
                         "step": self._steps + 1}})

    @pk.hookimpl
    def pipekernel_after_train_batch(self, engine: Any, loss: Any, metrics: Any) -> None:
        self._engine = engine
        self._steps += 1
        self._seconds += metrics["seconds"]
        for key in _FIELDS:
            self._totals[key] += self._step_time[key]
        row = {"step": metrics["step"], "rank": engine.rank, "stage": engine.stage,
               "loss": float(loss), "step_s": metrics["seconds"], **self._step_time}
        self._step_time = dict.fromkeys(_FIELDS, 0.0)
        if engine.rank == 0:
            self._rows.append(row)

    def stage_summary(self) -> dict[str, float]:
        """This rank's mean seconds per step by kind, and the waiting fraction."""
        n = max(self._steps, 1)
        summary = {key: value / n for key, value in self._totals.items()}
        summary["step_s"] = self._seconds / n
        summary["bubble_fraction"] = self._totals["wait_s"] / self._seconds if self._seconds else 0.0
        if self._engine is not None:
            summary.update(rank=self._engine.rank, stage=self._engine.stage)
        return summary

    def _gather(self, obj: Any) -> list[Any] | None:
        import torch.distributed as dist
        if not dist.is_initialized():
            return [obj]
        out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out

    def gather(self) -> list[dict[str, float]] | None:
        """Every rank's :meth:`stage_summary` on rank 0 (``None`` elsewhere); all ranks call it."""
        return self._gather(self.stage_summary())

    def close(self) -> None:
        """Write the files; all ranks call it (the trace is merged on rank 0)."""
        rank = self._engine.rank if self._engine is not None else 0
        for event in self._events:
            event["pid"] = rank
        merged = self._gather(self._events) if "trace" in self.sinks else None
        if rank != 0:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if "csv" in self.sinks and self._rows:
            self.paths["csv"] = str(self.out_dir / "metrics.csv")
            with open(self.paths["csv"], "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=list(self._rows[0]))
                writer.writeheader()
                writer.writerows(self._rows)
        if "jsonl" in self.sinks:
            self.paths["jsonl"] = str(self.out_dir / "metrics.jsonl")
            with open(self.paths["jsonl"], "w") as f:
                f.writelines(json.dumps(row) + "\n" for row in self._rows)
        if merged is not None:
            self.paths["trace"] = str(self.out_dir / "trace.json")
            events = [e for rank_events in merged for e in rank_events]
            meta = [{"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"rank {r}"}}
                    for r in range(len(merged))]
            with open(self.paths["trace"], "w") as f:
                json.dump({"traceEvents": meta + events, "displayTimeUnit": "ms"}, f)
