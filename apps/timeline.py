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

__all__ = ["KIND_COLOURS", "GAP_LABEL", "kind_of", "rows_from_trace", "kept_steps",
           "steps_title", "has_gaps", "legend_labels", "rows_from_simulation", "draw_timeline",
           "draw_trace", "draw_simulation"]

#: Colour of each kind of block.
KIND_COLOURS = {"forward": "#4C72B0", "backward": "#DD8452", "wait": "#C44E52",
                "send": "#8C8C8C", "other": "#CCCCCC"}
_LABELS = {"forward": "forward", "backward": "backward", "wait": "waiting on a receive",
           "send": "send", "other": "load / reduce / step"}
#: The legend's entry for time in no block (drawn blank).
GAP_LABEL = "gap: idle, no instruction running"

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
    events = _instructions(trace)
    keep = set(kept_steps(trace, last_steps)) if last_steps is not None else set()
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


def _instructions(trace: Mapping[str, Any]) -> list[dict[str, Any]]:
    # instruction slices only (the monitor also puts whole-step slices, cat "step", on tid 1)
    return [e for e in trace.get("traceEvents", [])
            if e.get("ph") == "X" and e.get("cat") != "step" and e.get("tid", 0) == 0]


def kept_steps(trace: Mapping[str, Any] | str | Path, last_steps: int | None = 2) -> list[int]:
    """The step numbers (``args.step``, as in ``metrics.csv``) :func:`rows_from_trace`
    draws: the last ``last_steps`` of the trace (``None``: all)."""
    if not isinstance(trace, Mapping):
        trace = json.loads(Path(trace).read_text())
    steps = sorted({e.get("args", {}).get("step") for e in _instructions(trace)} - {None})
    return steps if last_steps is None else steps[-last_steps:]


def steps_title(steps: Sequence[int], title: str = "") -> str:
    """A picture's title that says which steps it shows."""
    shown = "no step" if not steps else f"step {steps[0]}" if len(steps) == 1 else \
        f"steps {steps[0]}-{steps[-1]}" if list(steps) == list(range(steps[0], steps[-1] + 1)) \
        else "steps " + ", ".join(str(s) for s in steps)
    return f"{shown} (numbered as in metrics.csv)" + (f": {title}" if title else "")


def has_gaps(rows: Sequence[Row]) -> bool:
    """Whether some row has time in no block (idle: the picture shows it blank)."""
    end = max((s + d for _, blocks in rows for s, d, _, _ in blocks), default=0.0)
    for _, blocks in rows:
        reached = 0.0
        for start, dur, _, _ in sorted(blocks):
            if start > reached + 1e-9 * max(end, 1.0):
                return True
            reached = max(reached, start + dur)
        if reached < end - 1e-9 * max(end, 1.0):
            return True
    return False


def legend_labels(rows: Sequence[Row]) -> list[str]:
    """The legend's entries: each kind of block drawn, and the gaps when there are any."""
    used = [_LABELS[k] for k in KIND_COLOURS if any(b[2] == k for _, bl in rows for b in bl)]
    return used + ([GAP_LABEL] if has_gaps(rows) else [])


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
    colours = {_LABELS[k]: KIND_COLOURS[k] for k in KIND_COLOURS}
    ax.legend(handles=[Patch(facecolor=colours.get(label, "white"), edgecolor="#999999",
                             label=label) for label in legend_labels(rows)],
              loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def draw_trace(trace: Mapping[str, Any] | str | Path, path: str | Path, *,
               last_steps: int | None = 2, title: str = "") -> Path:
    """A PNG of the last ``last_steps`` steps of a merged Chrome trace; its title starts
    with the steps it shows (:func:`steps_title`), then ``title``."""
    if not isinstance(trace, Mapping):
        trace = json.loads(Path(trace).read_text())
    rows = rows_from_trace(trace, last_steps=last_steps)
    return draw_timeline(rows, path, title=steps_title(kept_steps(trace, last_steps), title),
                         unit="ms", label_blocks=True)


def draw_simulation(result: Any, path: str | Path, *, title: str = "") -> Path:
    """A PNG of a simulated schedule (time in compute units)."""
    return draw_timeline(rows_from_simulation(result), path, title=title, unit="time units")
