"""Timeline pictures: one row per stage (or rank), coloured blocks per instruction.

Two sources feed the same drawing: a merged Chrome trace (``{"traceEvents": [...]}``
with complete ``"ph": "X"`` slices, one ``pid`` per rank) from a real run, and a
:class:`pipekernel.schedules.SimulationResult`. matplotlib is imported lazily with
the Agg backend, so no display is needed.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["KIND_COLOURS", "kind_of", "rows_from_trace", "rows_from_simulation", "draw_timeline",
           "draw_trace", "draw_simulation"]

#: Colour of each kind of block.
KIND_COLOURS = {"forward": "#4C72B0", "backward": "#DD8452", "wait": "#C44E52",
                "send": "#8C8C8C", "other": "#CCCCCC"}
_LABELS = {"forward": "forward", "backward": "backward", "wait": "waiting on a receive",
           "send": "send", "other": "load / reduce / step"}

# A block is (start, duration, kind, label); a row is (row label, [blocks]).
Block = tuple[float, float, str, str]
Row = tuple[str, list[Block]]


def kind_of(category: str, name: str = "") -> str:
    """Map a trace category or instruction class name to a block kind."""
    text = (category or name).lower()
    if text.startswith("forward"):
        return "forward"
    if text.startswith("backward"):
        return "backward"
    if text.startswith("recv") or "wait" in text:
        return "wait"
    if text.startswith("send"):
        return "send"
    return "other"


def rows_from_trace(trace: Mapping[str, Any] | str | Path, *, last_steps: int | None = 2,
                    stages: Mapping[int, int] | None = None) -> list[Row]:
    """Rows (one per ``pid``, i.e. rank) from a Chrome trace, in milliseconds.

    :param trace: the trace object or the path of its JSON file.
    :param last_steps: draw only the last ``n`` training steps (by ``args.step``)
        so single instructions stay visible; ``None`` draws everything.
    :param stages: ``{rank: stage}`` for the row labels.
    """
    if not isinstance(trace, Mapping):
        trace = json.loads(Path(trace).read_text())
    # instruction slices only (the monitor also puts whole-step slices, cat "step", on tid 1)
    events = [e for e in trace.get("traceEvents", [])
              if e.get("ph") == "X" and e.get("cat") != "step" and e.get("tid", 0) == 0]
    if last_steps is not None:
        steps = sorted({e.get("args", {}).get("step") for e in events} - {None})
        keep = set(steps[-last_steps:])
        if keep:
            events = [e for e in events if e.get("args", {}).get("step") in keep]
    if not events:
        return []
    origin = min(float(e["ts"]) for e in events)
    by_rank: dict[int, list[Block]] = {}
    for e in events:
        start = (float(e["ts"]) - origin) / 1000.0
        by_rank.setdefault(int(e.get("pid", 0)), []).append(
            (start, float(e.get("dur", 0.0)) / 1000.0, kind_of(e.get("cat", ""), e.get("name", "")),
             str(e.get("name", ""))))
    rows = []
    for rank in sorted(by_rank):
        stage = _stage_of(trace, rank) if stages is None else stages.get(rank)
        label = f"rank {rank}" + (f" (stage {stage})" if stage is not None else "")
        rows.append((label, sorted(by_rank[rank])))
    return rows


def _stage_of(trace: Mapping[str, Any], rank: int) -> int | None:
    for e in trace.get("traceEvents", []):
        if e.get("pid") == rank and "stage" in e.get("args", {}):
            return int(e["args"]["stage"])
    return None


def rows_from_simulation(result: Any) -> list[Row]:
    """Rows (one per stage) from a :class:`~pipekernel.schedules.SimulationResult`."""
    rows = []
    for stage, events in enumerate(result.timeline):
        blocks = [(start, end - start, kind_of(type(i).__name__), str(i))
                  for start, end, i in events]
        rows.append((f"stage {stage}", blocks))
    return rows


def draw_timeline(rows: Sequence[Row], path: str | Path, *, title: str = "",
                  unit: str = "ms", label_blocks: bool = True) -> Path:
    """Draw ``rows`` as horizontal bars and save a PNG at ``path``."""
    import matplotlib
    matplotlib.use("Agg")  # files only: no display, safe in worker processes and CI
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    end = max((s + d for _, blocks in rows for s, d, _, _ in blocks), default=1.0) or 1.0
    fig, ax = plt.subplots(figsize=(12, 0.7 * len(rows) + 1.6), dpi=110)
    for y, (_, blocks) in enumerate(rows):
        for start, dur, kind, text in blocks:
            ax.broken_barh([(start, dur)], (y - 0.4, 0.8), facecolors=KIND_COLOURS[kind],
                           edgecolors="white", linewidth=0.5)
            if label_blocks and kind in ("forward", "backward") and dur > end / 60:
                ax.text(start + dur / 2, y, text, ha="center", va="center", fontsize=7,
                        color="white")
    ax.set_yticks(range(len(rows)), [label for label, _ in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, end)
    ax.set_xlabel(unit)
    if title:
        ax.set_title(title, fontsize=10)
    used = [k for k in KIND_COLOURS if any(b[2] == k for _, bl in rows for b in bl)]
    ax.legend(handles=[Patch(color=KIND_COLOURS[k], label=_LABELS[k]) for k in used],
              loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def draw_trace(trace: Mapping[str, Any] | str | Path, path: str | Path, *,
               last_steps: int | None = 2, title: str = "") -> Path:
    """A PNG of the last ``last_steps`` steps of a merged Chrome trace."""
    rows = rows_from_trace(trace, last_steps=last_steps)
    return draw_timeline(rows, path, title=title, unit="ms", label_blocks=True)


def draw_simulation(result: Any, path: str | Path, *, title: str = "") -> Path:
    """A PNG of a simulated schedule (time in compute units)."""
    return draw_timeline(rows_from_simulation(result), path, title=title, unit="time units")
