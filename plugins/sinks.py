"""Where the monitor's numbers go: console, CSV, JSONL, TensorBoard, W&B, Chrome trace.

A sink is an object with ``open(monitor)``, ``write(record)`` and
``close(monitor, trace_events)``; it runs on rank 0 only, after the monitor
merged every rank's numbers for the step (see :mod:`pipekernel.plugins.monitor`
for the record's fields). Sinks are selected by name::

    Monitor(sinks=("console", "csv", "jsonl", "trace", "tensorboard", "wandb"))

or passed as objects. Names resolve through :data:`SINKS` and then through the
entry-point group ``pipekernel.sinks`` (name -> sink class or factory taking
keyword options), so a third-party package adds a sink with::

    [project.entry-points."pipekernel.sinks"]
    mysink = "my_pkg.sinks:MySink"

Contract for implementers
-------------------------
* ``open(monitor)`` is called once, on rank 0, before the first ``write``;
  ``monitor.out_dir`` exists then. Import optional libraries here, not at module
  import time.
* ``write(record)`` is called on rank 0 after every training step with a
  plain dict (JSON-serialisable numbers, strings, bools, lists and dicts).
* ``close(monitor, trace_events)`` is called once on rank 0; ``trace_events``
  is the merged Chrome trace event list if some selected sink sets
  ``needs_trace = True`` (the monitor gathers it from every rank), else ``None``.
* ``path`` (optional) is the file the sink wrote, reported in ``Monitor.paths``
  under the sink's ``name``.
"""
from __future__ import annotations

import csv
import json
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from pipekernel.errors import ConfigError, PipelineError, UnknownNameError, did_you_mean

__all__ = ["Sink", "ConsoleSink", "CSVSink", "JSONLSink", "TraceSink", "TensorBoardSink",
           "WandbSink", "SINKS", "SINKS_GROUP", "make_sink", "flatten_record"]

SINKS_GROUP = "pipekernel.sinks"


class Sink:
    """Base class (optional: any object with the same methods works)."""

    name = "sink"
    needs_trace = False
    path: str | None = None

    def open(self, monitor: Any) -> None:
        """Prepare output (rank 0, once)."""

    def write(self, record: Mapping[str, Any]) -> None:
        """Record one training step (rank 0)."""

    def close(self, monitor: Any, trace_events: list[dict] | None) -> None:
        """Flush and release (rank 0, once)."""


def flatten_record(record: Mapping[str, Any]) -> dict[str, Any]:
    """One flat row: top-level numbers, then ``rank{R}_{field}`` for each rank's
    numbers and ``rank{R}_{Instruction}_s`` for its time per instruction type."""
    row = {k: v for k, v in record.items() if k != "ranks"}
    for r in record.get("ranks", ()):
        prefix = f"rank{r['rank']}_"
        for key, value in r.items():
            if key == "instructions":
                for cls, seconds in value.items():
                    row[f"{prefix}{cls}_s"] = seconds
            elif key != "rank":
                row[prefix + key] = value
    return row


class ConsoleSink(Sink):
    """One line every ``every`` steps (default: the monitor's ``every``) on rank 0."""

    name = "console"

    def __init__(self, every: int | None = None, stream: TextIO | None = None) -> None:
        self.every, self.stream = every, stream

    def open(self, monitor: Any) -> None:
        if self.every is None:
            self.every = monitor.every
        if self.stream is None:
            self.stream = sys.stdout

    def write(self, record: Mapping[str, Any]) -> None:
        if record["step"] % max(1, self.every or 1):
            return
        mem = record.get("peak_memory_mb")
        line = (f"step {record['step']:>5}  loss {record['loss']:.4f}  "
                f"{record['step_s'] * 1e3:8.1f} ms  {record['samples_per_s']:9.1f} samples/s  "
                f"{record['tokens_per_s']:10.1f} tokens/s  bubble {100 * record['bubble_fraction']:5.1f}%"
                + (f"  mem {mem:.0f} MB" if mem is not None else "")
                + ("  SKIPPED" if record.get("skipped") else "")
                + (f"  check passed {record['check_seconds'] * 1e3:.1f} ms"
                   if "check_seconds" in record else ""))
        print(line, file=self.stream, flush=True)


class _FileSink(Sink):
    """A sink that keeps one text file in ``monitor.out_dir`` open from ``open`` to ``close``."""

    _newline: str | None = None  # ``open(..., newline=)``

    def __init__(self, filename: str) -> None:
        self.filename = filename
        self._file: TextIO | None = None

    def open(self, monitor: Any) -> None:
        self.path = os.path.join(monitor.out_dir, self.filename)
        self._file = open(self.path, "w", newline=self._newline)

    def close(self, monitor: Any, trace_events: list[dict] | None) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _opened(self) -> TextIO:
        """The file ``open`` opened (a write outside ``open``..``close`` is a bug)."""
        if self._file is None:
            raise PipelineError(f"the {self.name!r} sink was written to while not open",
                                hint="the monitor opens each sink before the first step")
        return self._file


class CSVSink(_FileSink):
    """``metrics.csv``: a header and one row per step (see :func:`flatten_record`)."""

    name = "csv"
    _newline = ""  # the csv module writes its own line endings

    def __init__(self, filename: str = "metrics.csv") -> None:
        super().__init__(filename)
        self._writer: csv.DictWriter | None = None

    def write(self, record: Mapping[str, Any]) -> None:
        row, file = flatten_record(record), self._opened()
        if self._writer is None:  # columns are fixed by the first step
            self._writer = csv.DictWriter(file, fieldnames=list(row), extrasaction="ignore")
            self._writer.writeheader()
        self._writer.writerow(row)
        file.flush()


class JSONLSink(_FileSink):
    """``metrics.jsonl``: the full record (with the per-rank list) as one JSON line per step."""

    name = "jsonl"

    def __init__(self, filename: str = "metrics.jsonl") -> None:
        super().__init__(filename)

    def write(self, record: Mapping[str, Any]) -> None:
        file = self._opened()
        file.write(json.dumps(record) + "\n")
        file.flush()


class TraceSink(Sink):
    """``trace.json``: one Chrome/Perfetto trace, a track per rank, a slice per instruction.

    Open it in ``ui.perfetto.dev`` or ``chrome://tracing``.
    """

    name = "trace"
    needs_trace = True

    def __init__(self, filename: str = "trace.json") -> None:
        self.filename = filename

    def open(self, monitor: Any) -> None:
        self.path = os.path.join(monitor.out_dir, self.filename)

    def close(self, monitor: Any, trace_events: list[dict] | None) -> None:
        if self.path is None:  # never opened: no run to write
            return
        with open(self.path, "w") as f:
            json.dump({"traceEvents": trace_events or [], "displayTimeUnit": "ms"}, f)


class TensorBoardSink(Sink):
    """TensorBoard event files via ``torch.utils.tensorboard.SummaryWriter``.

    Needs the ``tensorboard`` package (``pip install "pipekernel[tensorboard]"``).
    Scalars: ``train/loss``, ``train/samples_per_s``, ``train/tokens_per_s``,
    ``train/step_s``, ``pipeline/bubble_fraction``, ``memory/peak_mb`` and per rank
    ``rank{R}/{forward_s,backward_s,wait_s,bubble_fraction}``.
    """

    name = "tensorboard"

    def __init__(self, subdir: str = "tensorboard") -> None:
        self.subdir = subdir
        self._writer: Any = None  # a SummaryWriter from open() (tensorboard is optional)

    def open(self, monitor: Any) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ConfigError("the 'tensorboard' sink needs the tensorboard package",
                              hint='pip install "pipekernel[tensorboard]" (or tensorboard)') from err
        self.path = os.path.join(monitor.out_dir, self.subdir)
        self._writer = SummaryWriter(log_dir=self.path)

    def write(self, record: Mapping[str, Any]) -> None:
        step, w = record["step"], self._writer
        w.add_scalar("train/loss", record["loss"], step)
        w.add_scalar("train/samples_per_s", record["samples_per_s"], step)
        w.add_scalar("train/tokens_per_s", record["tokens_per_s"], step)
        w.add_scalar("train/step_s", record["step_s"], step)
        w.add_scalar("train/skipped", float(record["skipped"]), step)
        w.add_scalar("pipeline/bubble_fraction", record["bubble_fraction"], step)
        if record.get("peak_memory_mb") is not None:
            w.add_scalar("memory/peak_mb", record["peak_memory_mb"], step)
        for r in record["ranks"]:
            for key in ("forward_s", "backward_s", "wait_s", "bubble_fraction"):
                w.add_scalar(f"rank{r['rank']}/{key}", r[key], step)

    def close(self, monitor: Any, trace_events: list[dict] | None) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None


class WandbSink(Sink):
    """Weights & Biases, when ``wandb`` is installed.

    :param mode: ``"online"``, ``"offline"`` (no network; what tests use) or
        ``"disabled"``; default: ``WANDB_MODE`` or ``"offline"``.
    :param init: extra keyword arguments for ``wandb.init`` (project, name, ...).
    """

    name = "wandb"

    def __init__(self, mode: str | None = None, **init: Any) -> None:
        self.mode = mode or os.environ.get("WANDB_MODE", "offline")
        self.init = init
        self._run: Any = None  # a wandb run from open() (wandb is optional)

    def open(self, monitor: Any) -> None:
        try:
            import wandb
        except ImportError as err:
            raise ConfigError("the 'wandb' sink needs the wandb package",
                              hint="pip install wandb, or drop 'wandb' from sinks") from err
        self.path = os.path.join(monitor.out_dir, "wandb")
        os.makedirs(self.path, exist_ok=True)
        options = {"project": "pipekernel", "dir": self.path, "mode": self.mode, **self.init}
        self._run = wandb.init(**options)

    def write(self, record: Mapping[str, Any]) -> None:
        self._run.log(flatten_record(record), step=record["step"])

    def close(self, monitor: Any, trace_events: list[dict] | None) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


#: Built-in sinks by name.
SINKS: dict[str, Callable[..., Any]] = {
    cls.name: cls for cls in (ConsoleSink, CSVSink, JSONLSink, TraceSink, TensorBoardSink,
                              WandbSink)}


def make_sink(spec: Any, **options: Any) -> Any:
    """A sink from a name (built-in or ``pipekernel.sinks`` entry point) or an object.

    :raises UnknownNameError: listing the available names.
    """
    if not isinstance(spec, str):
        return spec
    if spec in SINKS:
        return SINKS[spec](**options)
    from pipekernel.plugin import entry_points

    for ep in entry_points(SINKS_GROUP):
        if ep.name == spec:
            return ep.load()(**options)
    names = sorted({*SINKS, *(ep.name for ep in entry_points(SINKS_GROUP))})
    raise UnknownNameError(f"unknown monitor sink {spec!r}{did_you_mean(spec, names)}",
                           hint=f"available sinks: {', '.join(names)}; third-party sinks are "
                                f"published in the {SINKS_GROUP!r} entry-point group")
