"""The monitor plugin: where every millisecond of the pipeline goes.

``Monitor`` is a pluggy plugin object; give the same one to the engine on every
rank::

    from pipekernel.plugins.monitor import Monitor

    mon = Monitor(out_dir="out", sinks=("console", "csv", "jsonl", "trace"), every=10)
    engine = pk.PipelineEngine(module, ..., plugins=[mon])
    for step in range(steps):
        engine.train_batch(data_iter)
    print(mon.stage_summary())      # this rank's totals
    table = mon.gather()            # every rank's summary, on rank 0 (collective)
    mon.close()                     # collective: flush sinks, merge the trace on rank 0
    print(mon.paths)                # {"csv": ..., "jsonl": ..., "trace": ..., "summary": ...}
    mon.summaries, mon.trace_events # after close(), on rank 0: every rank's summary, the
                                    # merged Chrome trace events (with a "trace" sink)

What it measures, per training step and per rank (hooks
``pipekernel_before/after_instruction`` around each instruction,
``pipekernel_before/after_train_batch`` around each step):

* ``forward_s``, ``backward_s``, ``send_s``, ``load_s``, ``reduce_s``,
  ``optimizer_s`` and ``instructions`` (seconds per instruction class); ``paired_s``:
  the ``ForwardBackward`` pairs a model's ``overlapped_forward_backward`` runs (forward
  and backward overlapped, one span: in neither ``forward_s`` nor ``backward_s``);
* ``wait_s``: time blocked in ``RecvActivation``/``RecvGrad`` (and a skip
  connection's ``RecvSkip``/``RecvSkipGrad``) — the bubble inside the schedule;
* ``drain_s``: time from the end of the last instruction to the end of the step
  (finishing sends and the loss all-reduce: waiting for the slowest stage, the
  bubble at the end of the step that the simulator also counts);
* ``bubble_fraction = (wait_s + drain_s) / step_s`` and ``wait_fraction =
  wait_s / step_s``;
* ``other_s``: the rest of the step (Python, hooks, data loading outside
  instructions);
* ``samples``/``tokens`` (first stage: ``dim 0`` of the first input tensor /
  ``numel`` of the input tensors, or ``tokens_per_sample``) and the global
  ``samples_per_s``/``tokens_per_s``;
* ``peak_memory_mb``: CUDA max allocated during the step on a GPU, the process's
  peak RSS on CPU;
* the loss and whether the optimizer step was ``skipped`` (fp16 overflow), and
  the other numbers the engine reports for the step (e.g. ``loss_scale``; rank 0's).

Hang diagnostics: every rank publishes its position in the schedule (train
step, schedule step, instruction, running or waiting and for how long) to the
process group's key-value store once per ``heartbeat`` seconds from a daemon
thread. When an instruction fails with a transport error (a receive that timed
out), the monitor adds every rank's position to the error and writes it to
``out_dir/hang-rank{R}.txt``; ``kill -USR1 <pid>`` makes a rank print every
rank's position to stderr and ``out_dir/positions-rank{R}.txt`` at once, even
while it is blocked in a receive.

Timing on a GPU: instructions are timed with CUDA events on the current stream
(the work's own time, read once at the end of each step), on the CPU with
``time.perf_counter`` (:mod:`pipekernel.plugins.monitor_clock`).

One job per module: this one is the plugin (hooks, state, summaries, close);
``monitor_clock`` the timers, ``monitor_stats`` the arithmetic,
``monitor_trace`` the Chrome trace, ``monitor_positions`` the hang diagnostics.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pipekernel.errors import ConfigError, TransportError
from pipekernel.plugin import (EngineView, LoadMicroBatch, all_gather_objects, hookimpl,
                               tensors_of)

from pipekernel.plugins.monitor_clock import CudaTimer, HostTimer, make_timer
from pipekernel.plugins.monitor_positions import PositionBoard, format_positions
from pipekernel.plugins.monitor_stats import (VECTOR, WAITS, Totals, derive, merge_record,
                                              step_numbers)
from pipekernel.plugins.monitor_trace import TraceBuffer, chrome_events
from pipekernel.plugins.sinks import make_sink

__all__ = ["Monitor", "format_positions", "gather_objects"]


class Monitor:
    """Timers, metrics, sinks, a merged trace and hang diagnostics (a pluggy plugin).

    Construct one per engine and pass it as ``PipelineEngine(..., plugins=[mon])``
    on every rank. :meth:`gather` and :meth:`close` are collectives: call them on
    every rank (``engine.close()`` closes the monitor for you).

    :param out_dir: directory for the files (created on first use).
    :param sinks: sink names (``"console"``, ``"csv"``, ``"jsonl"``, ``"trace"``,
        ``"tensorboard"``, ``"wandb"``, or a ``pipekernel.sinks`` entry point) or
        sink objects; see :mod:`pipekernel.plugins.sinks`. Sinks run on rank 0.
    :param every: the console sink prints every ``every`` steps.
    :param tokens_per_sample: how to count tokens: ``None`` (numel of the
        first-stage input tensors), an int (samples x int) or a callable
        ``fn(inputs) -> int`` called with each micro-batch's inputs.
    :param warmup_steps: steps left out of :meth:`stage_summary` (the first step
        pays for metadata exchange and lazy initialisation); ignored when no
        more steps than that ran.
    :param trace_max_events: per-rank cap on recorded instruction slices (memory
        bound for long runs); later instructions are counted but not traced.
    :param heartbeat: seconds between position updates (hang diagnostics);
        ``0`` turns the position thread and the signal off.
    :param dump_signal: signal that dumps every rank's position (``SIGUSR1``
        by default; ``None`` for none). Installed only from the main thread.
    :param sink_options: ``{sink name: {option: value}}`` for sinks given by name.
    :param keep_steps: how many steps ``history``/``records`` keep in memory (the
        summaries are running totals over every step).
    :param clock: host seconds now (default :func:`time.perf_counter`): every time the
        monitor reads on the host, and the CPU timer's (tests drive it with a fake clock).
    """

    def __init__(self, out_dir: str = "pipekernel-out", sinks: Iterable[Any] = ("console",),
                 every: int = 10, *, tokens_per_sample: int | Callable[[Any], int] | None = None,
                 warmup_steps: int = 1, trace_max_events: int = 200_000, heartbeat: float = 1.0,
                 dump_signal: int | None = getattr(signal, "SIGUSR1", None),
                 sink_options: Mapping[str, Mapping[str, Any]] | None = None,
                 keep_steps: int = 10_000,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if not isinstance(every, int) or every < 1:
            raise ConfigError(f"Monitor(every=...) must be an int >= 1, got {every!r}",
                              hint="e.g. Monitor(every=10): a summary every 10 train steps")
        if not (tokens_per_sample is None or callable(tokens_per_sample)
                or (isinstance(tokens_per_sample, int) and tokens_per_sample > 0)):
            raise ConfigError(f"tokens_per_sample must be None, a positive int or a callable, "
                              f"got {tokens_per_sample!r}",
                              hint="pass the tokens in one sample (e.g. the sequence length), a "
                                   "function of the batch, or None")
        self.out_dir, self.every = out_dir, every
        self.tokens_per_sample = tokens_per_sample
        self.warmup_steps, self.trace_max_events = warmup_steps, trace_max_events
        self.heartbeat, self.dump_signal = heartbeat, dump_signal
        options = dict(sink_options or {})
        self.sink_specs = list(sinks)
        self.sinks = [make_sink(s, **options.get(s, {})) if isinstance(s, str) else s
                      for s in self.sink_specs]
        self.needs_trace = any(getattr(s, "needs_trace", False) for s in self.sinks)
        self.paths: dict[str, str] = {}
        self.keep_steps = keep_steps
        self._clock = clock
        #: this rank's numbers of the last ``keep_steps`` steps
        self.history: deque[dict[str, Any]] = deque(maxlen=keep_steps)
        #: rank 0: the merged records of the last ``keep_steps`` steps (when sinks are on)
        self.records: deque[dict[str, Any]] = deque(maxlen=keep_steps)
        self._all, self._measured = Totals(), Totals()
        self.engine: EngineView | None = None  # read through the view only
        self.summaries: list[dict[str, Any]] | None = None  # set by close() (rank 0)
        self.trace_events: list[dict[str, Any]] | None = None  # merged trace, after close()
        self.rank, self.world_size, self.stage = 0, 1, 0
        self._closed = False
        # hot-path state
        self._timer: HostTimer | CudaTimer = HostTimer(clock)  # CUDA events on a GPU (configure)
        # (host start, start mark, end mark, instruction) of the instructions since the step began
        self._events: list[tuple[float, Any, Any, Any]] = []
        self._trace = TraceBuffer(trace_max_events)
        self._current: tuple[float, Any, Any] | None = None  # (host start, instruction, mark)
        self._last_end = clock()
        self._in_train = False
        self._step_start = 0.0
        self._step_mark: Any = None
        self._samples = self._tokens = 0
        self._count_inputs = False
        self._board = PositionBoard(self)
        self._key = "pipekernel/monitor"
        #: the sentinel's last passed check: ``{"step", "result", "seconds"}`` or ``None``
        self.last_check: dict[str, Any] | None = None

    # ------------------------------------------------------------------ set-up
    @hookimpl
    def pipekernel_configure(self, engine: EngineView) -> None:
        if self.engine is not None and self.engine is not engine:
            raise ConfigError("a Monitor serves one engine; make a new Monitor per engine",
                              hint="pass plugins=[Monitor(...)] with a new Monitor to each "
                                   "PipelineEngine")
        self.engine = engine
        self.transport = engine.transport
        self.rank, self.world_size = engine.rank, engine.transport.world_size
        self.stage, self.topology = engine.stage, engine.topology
        self._count_inputs = engine.is_first_stage()
        self._classes = sorted({cls.__name__ for cls in engine.instruction_types})
        self._cuda = getattr(engine.transport.device, "type", "cpu") == "cuda"
        self._timer = make_timer(engine.transport.device, clock=self._clock)
        self._epoch = self._clock()
        if self.world_size > 1:
            self._align(engine.transport)
        if self.rank == 0 and self.sinks:
            os.makedirs(self.out_dir, exist_ok=True)  # only where files are written
            for sink in self.sinks:
                sink.open(self)
        if self.heartbeat and self.heartbeat > 0:
            self._board.start()

    def _align(self, transport: Any) -> None:
        """Agree on a key prefix and a common time zero for the trace.

        Every rank leaves a barrier, then rank 0 broadcasts its wall clock and host.
        Ranks on rank 0's host share its clock exactly, so they convert through it;
        ranks on other hosts use the barrier exit as time zero (good to the barrier's
        skew, whatever their clocks say).
        """
        import torch

        transport.barrier()
        perf, wall = self._clock(), time.time()
        host = int(hashlib.sha1(socket.gethostname().encode()).hexdigest()[:12], 16)
        info = torch.tensor([int.from_bytes(os.urandom(6), "little"), wall, host],
                            dtype=torch.float64, device=transport.device)
        transport.broadcast(info, 0)
        key, wall0, host0 = info.tolist()
        self._key = f"pipekernel/monitor/{int(key)}"
        self._epoch = perf - (wall - wall0) if host0 == host else perf

    # ---------------------------------------------------------------- hot path
    @hookimpl
    def pipekernel_before_train_batch(self, engine: EngineView) -> None:
        if self._events:  # instructions since the last step ran outside train_batch (eval)
            self._keep_loose(self._events)
            self._events = []
        self._in_train = True
        self._samples = self._tokens = 0
        if self._cuda and self.engine is not None:
            import torch
            torch.cuda.reset_peak_memory_stats(engine.transport.device)
        self._step_start = self._clock()
        self._step_mark = self._timer.mark()

    @hookimpl
    def pipekernel_before_instruction(self, instruction: Any) -> None:
        now = self._clock()
        self._current = (now, instruction, self._timer.start(now))

    @hookimpl
    def pipekernel_after_instruction(self, instruction: Any, seconds: float) -> None:
        current = self._current
        if current is None:  # no before hook seen (e.g. a plugin registered mid-step)
            now = self._clock() - seconds
            current = (now, instruction, self._timer.start(now))
        start, _, mark = current
        self._events.append((start, mark, self._timer.stop(mark, seconds), instruction))
        self._current = None
        self._last_end = start + seconds
        if self._count_inputs and type(instruction) is LoadMicroBatch and self._in_train:
            self._count(instruction)

    def _count(self, instruction: Any) -> None:
        if self.engine is None:  # not configured: nothing to count against
            return
        inputs = self.engine.runtime.inputs_of(instruction)
        if inputs is None:
            return
        tensors = tensors_of(inputs)
        samples = int(tensors[0].shape[0]) if tensors and tensors[0].dim() else 1
        self._samples += samples
        spec = self.tokens_per_sample
        if spec is None:
            self._tokens += sum(t.numel() for t in tensors)
        elif callable(spec):
            self._tokens += int(spec(inputs))
        else:
            self._tokens += samples * spec

    # ------------------------------------------------------------- per step
    @hookimpl
    def pipekernel_after_train_batch(self, engine: EngineView, loss: Any, metrics: Mapping) -> None:
        end_mark = self._timer.mark()
        if self._closed:  # sinks are closed; a new Monitor sees later steps
            self._events = []
            return
        step = int(metrics.get("step", self._all.steps + 1))
        events, self._events = self._events, []
        self._in_train = False
        spans, step_s = self._resolve(self._step_mark, events, end_mark)
        mine = step_numbers(self._classes, spans, step_s, step,
                            peak_memory_mb=self._peak_memory_mb(), samples=self._samples,
                            tokens=self._tokens)
        mine["loss"] = float(loss) if loss is not None else float("nan")
        mine["skipped"] = bool(metrics.get("skipped", False))
        if "check_seconds" in metrics:  # the sentinel ran after this step and passed
            self.last_check = {"step": step, "result": "passed",
                               "seconds": float(metrics["check_seconds"])}
        # other numbers the engine reports for the step (e.g. the precision's loss_scale)
        mine["extra"] = {k: v for k, v in metrics.items()
                         if k not in ("step", "seconds", "skipped")
                         and isinstance(v, (int, float)) and not isinstance(v, bool)}
        self.history.append(mine)
        self._all.add(mine)
        if self._all.steps > self.warmup_steps:
            self._measured.add(mine)
        if self.needs_trace:
            start = self._step_start
            self._trace.keep([(start + o, s, ins) for o, s, ins in spans], step, self._epoch,
                             start)
        if self.sinks:  # every rank knows the same sink list, so all join or none do
            rows = self._gather_step(mine)
            if self.rank == 0:
                record = merge_record(step, mine, [self._rank_dict(r, row)
                                                   for r, row in enumerate(rows)])
                self.records.append(record)
                for sink in self.sinks:
                    sink.write(record)

    def _resolve(self, anchor: Any, events: list, end: Any
                 ) -> tuple[list[tuple[float, float, Any]], float]:
        """``([(offset, seconds, instruction)], total)`` from the timer's marks: offsets
        from ``anchor``, which is where the instructions' work ran (GPU or host)."""
        times, total = self._timer.resolve(anchor, [(s, e) for _, s, e, _ in events], end)
        return [(o, s, ev[3]) for (o, s), ev in zip(times, events)], total

    def _keep_loose(self, events: list) -> None:
        """Trace instructions that ran outside a training step (eval), on the host axis
        anchored at the first one's start."""
        if not self.needs_trace or not events:
            return
        spans, _ = self._resolve(events[0][1], events, events[-1][2])
        start = events[0][0]
        self._trace.keep([(start + o, s, ins) for o, s, ins in spans], None, self._epoch)

    def _peak_memory_mb(self) -> float:
        if self._cuda and self.engine is not None:
            import torch
            return torch.cuda.max_memory_allocated(self.engine.transport.device) / 2**20
        try:
            import resource
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes vs KiB
        except ImportError:  # Windows
            return float("nan")

    def _vector(self, mine: dict[str, Any]) -> list[float]:
        return [float(mine[k]) for k in VECTOR] + [mine["instructions"][c] for c in self._classes]

    def _gather_step(self, mine: dict[str, Any]) -> list[list[float]]:
        row = self._vector(mine)
        if self.world_size == 1:
            return [row]
        import torch
        table = torch.zeros(self.world_size, len(row), dtype=torch.float64,
                            device=self.transport.device)
        table[self.rank] = torch.tensor(row, dtype=torch.float64)
        self.transport.all_reduce(table)
        return table.cpu().tolist()

    def _rank_dict(self, rank: int, row: list[float]) -> dict[str, Any]:
        numbers = dict(zip(VECTOR, row))
        classes = dict(zip(self._classes, row[len(VECTOR):]))
        data, stage, _ = self.topology.coords(rank) if self.world_size > 1 else (0, 0, 0)
        return derive(rank, stage, data, numbers, classes)

    # ------------------------------------------------------------- summaries
    def stage_summary(self) -> dict[str, Any]:
        """This rank's totals over the steps so far (minus ``warmup_steps``).

        Keys: ``rank``, ``stage``, ``data_parallel_rank``, ``steps``, ``step_s``,
        ``forward_s``, ``backward_s``, ``wait_s``, ``drain_s``, ``send_s``,
        ``load_s``, ``reduce_s``, ``optimizer_s``, ``other_s`` (seconds summed over
        the steps), ``bubble_fraction`` (``(wait_s + drain_s) / step_s``),
        ``wait_fraction``, ``samples``, ``tokens``, ``samples_per_s`` and
        ``tokens_per_s`` (this rank's inputs: zero except on first stages),
        ``peak_memory_mb``, ``skipped_steps``, ``instructions`` (seconds per
        instruction class), ``losses`` (of the last ``keep_steps`` steps) and
        ``last_check``: the sentinel's last check (``check_every``), ``{"step",
        "result", "seconds"}`` or ``None`` (a failed check raises instead).
        Totals are running sums: memory does not grow with the number of steps.
        """
        totals = self._measured if self._measured.steps else self._all
        data, stage = (self.topology.data_rank, self.stage) if self.engine else (0, 0)
        summary = derive(self.rank, stage, data, totals.numbers, totals.classes)
        summary.update(steps=totals.steps, skipped_steps=totals.skipped,
                       losses=[h["loss"] for h in self.history], last_check=self.last_check)
        return summary

    def gather(self) -> list[dict[str, Any]] | None:
        """Every rank's :meth:`stage_summary`, by rank, on rank 0; ``None`` elsewhere.

        A collective over the engine's transport: call it on every rank. After
        :meth:`close` it returns what ``close()`` gathered, without communicating.
        """
        if self._closed:  # the transport may be gone: answer what close() gathered
            return self.summaries
        summary = self.stage_summary()
        if self.world_size == 1 or self.engine is None:
            return [summary]
        return gather_objects(self.transport, summary)

    # ------------------------------------------------------------------ close
    @hookimpl
    def pipekernel_unconfigure(self, engine: EngineView) -> None:
        self.close()

    def close(self) -> None:
        """Flush the sinks; on rank 0 merge the trace and (with any sink) write
        ``summary.json``: every rank's summary and the partition.

        A collective when the world has more than one rank: call it on every
        rank (``engine.close()`` does). Idempotent.
        """
        if self._closed:
            return
        self._board.stop()
        if self.engine is None or getattr(self.engine, "failed", None) is not None:
            # after a failed batch the peers may be gone: no collective (no gather, no
            # merged trace); what this rank measured stays in history/stage_summary()
            self._closed = True
            return
        if self._events:
            self._keep_loose(self._events)
            self._events = []
        summaries = self.gather()
        self.summaries, self._closed = summaries, True
        parts = None
        if self.needs_trace:
            mine = (self.rank, self.stage, self._trace.events, self._trace.dropped)
            parts = [mine] if self.world_size == 1 else gather_objects(self.transport, mine)
        if self.rank != 0:
            return
        trace = chrome_events(parts) if parts is not None else None
        self.trace_events = trace
        for sink in self.sinks:
            sink.close(self, trace)
            if getattr(sink, "path", None):
                self.paths[getattr(sink, "name", type(sink).__name__)] = sink.path
        if not self.sinks:  # no sinks, no files
            return
        path = os.path.join(self.out_dir, "summary.json")
        with open(path, "w") as f:
            json.dump({"ranks": summaries, "world_size": self.world_size,
                       "num_stages": self.engine.num_stages,
                       "micro_batches": self.engine.micro_batches,
                       "bounds": list(self.engine.bounds)}, f, indent=1)
        self.paths["summary"] = path

    # ------------------------------------------------------- hang diagnostics
    def position(self) -> dict[str, Any]:
        """Where this rank is now: train step, schedule step, instruction and for how long."""
        now = self._clock()
        current, engine = self._current, self.engine
        kernel_pos = getattr(engine, "position", None)
        pos: dict[str, Any] = {
            "rank": self.rank, "stage": self.stage, "host": socket.gethostname(),
            "pid": os.getpid(), "updated": time.time(),
            "train_step": (engine.global_steps + 1) if engine is not None and self._in_train
            else None,
            "schedule_step": kernel_pos[0] if kernel_pos else None,
        }
        if current is not None:
            instruction = current[1]
            kind = type(instruction).__name__
            pos.update(instruction=str(instruction), type=kind,
                       micro_batch=getattr(instruction, "micro_batch", None),
                       state="waiting" if kind in WAITS else "running",
                       seconds=now - current[0])
        else:
            pos.update(instruction=None, type=None, micro_batch=None,
                       state="in a step, between instructions" if kernel_pos
                       else "outside train_batch/eval_batch", seconds=now - self._last_end)
        return pos

    def positions(self) -> dict[int, dict[str, Any]]:
        """Every rank's last published position (this rank's is live); ranks that never
        published are missing."""
        return self._board.positions()

    def dump_positions(self, file: Any = None, filename: str | None = None) -> str:
        """Format every rank's position, print it to ``file`` (stderr by default) and
        write it to ``out_dir/positions-rank{R}.txt`` (or ``filename``); returns the text."""
        return self._board.dump(file, filename)

    @hookimpl
    def pipekernel_instruction_error(self, instruction: Any, stage: int, error: Any) -> None:
        if not isinstance(error, TransportError):
            return
        self._board.publish()
        text = format_positions(self.positions(), seen_from=self.rank,
                                world_size=self.world_size)
        error.add_detail(text)
        try:
            os.makedirs(self.out_dir, exist_ok=True)
            with open(os.path.join(self.out_dir, f"hang-rank{self.rank}.txt"), "w") as f:
                f.write(str(error) + "\n")
        except OSError:
            pass



def gather_objects(transport: Any, obj: Any) -> list[Any] | None:
    """Pickle ``obj`` on every rank; rank 0 gets the list by rank, others ``None``.

    Uses only the Transport protocol's collectives (an all-reduce of the sizes,
    then one broadcast per rank), so it works on any transport.
    """

    out = all_gather_objects(transport, obj)
    return out if transport.rank == 0 else None

