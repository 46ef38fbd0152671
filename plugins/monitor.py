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
  ``optimizer_s`` and ``instructions`` (seconds per instruction class);
* ``wait_s``: time blocked in ``RecvActivation``/``RecvGrad`` — the bubble
  inside the schedule;
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
"""
from __future__ import annotations

import atexit
import hashlib
import json
import os
import select
import signal
import socket
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pipekernel import instructions as isa
from pipekernel.errors import ConfigError, TransportError
from pipekernel.hookspecs import hookimpl

from pipekernel.plugins.sinks import make_sink

__all__ = ["Monitor", "format_positions", "gather_objects"]

_WAITS = ("RecvActivation", "RecvGrad")
_GROUPS = {
    "forward_s": ("Forward",), "backward_s": ("Backward", "BackwardInput", "BackwardWeight"),
    "wait_s": _WAITS, "send_s": ("SendActivation", "SendGrad"), "load_s": ("LoadMicroBatch",),
    "reduce_s": ("ReduceTiedGrads", "ReduceGrads"), "optimizer_s": ("OptimizerStep",),
}
# per-rank numbers carried by the per-step all-reduce, before the per-class seconds
_VECTOR = ("step_s", "drain_s", "peak_memory_mb", "samples", "tokens", "other_instr_s")


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
    """

    def __init__(self, out_dir: str = "pipekernel-out", sinks: Iterable[Any] = ("console",),
                 every: int = 10, *, tokens_per_sample: int | Callable[[Any], int] | None = None,
                 warmup_steps: int = 1, trace_max_events: int = 200_000, heartbeat: float = 1.0,
                 dump_signal: int | None = getattr(signal, "SIGUSR1", None),
                 sink_options: Mapping[str, Mapping[str, Any]] | None = None,
                 keep_steps: int = 10_000) -> None:
        if not isinstance(every, int) or every < 1:
            raise ConfigError(f"Monitor(every=...) must be an int >= 1, got {every!r}")
        if not (tokens_per_sample is None or callable(tokens_per_sample)
                or (isinstance(tokens_per_sample, int) and tokens_per_sample > 0)):
            raise ConfigError(f"tokens_per_sample must be None, a positive int or a callable, "
                              f"got {tokens_per_sample!r}")
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
        #: this rank's numbers of the last ``keep_steps`` steps
        self.history: deque[dict[str, Any]] = deque(maxlen=keep_steps)
        #: rank 0: the merged records of the last ``keep_steps`` steps (when sinks are on)
        self.records: deque[dict[str, Any]] = deque(maxlen=keep_steps)
        self._all, self._measured = _Totals(), _Totals()
        self.engine: Any = None
        self.summaries: list[dict[str, Any]] | None = None  # set by close() (rank 0)
        self.trace_events: list[dict[str, Any]] | None = None  # merged trace, after close()
        self.rank, self.world_size, self.stage = 0, 1, 0
        self._closed = False
        # hot-path state
        self._events: list[tuple[float, float, Any]] = []  # (start, seconds, instruction)
        self._trace: list[tuple] = []
        self._trace_dropped = 0
        self._current: tuple[float, Any] | None = None
        self._last_end = time.perf_counter()
        self._in_train = False
        self._step_start = 0.0
        self._samples = self._tokens = 0
        self._count_inputs = False
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake_r = self._wake_w = None
        self._old_wakeup_fd: int | None = None
        self._old_handler: Any = None
        self._store: Any = None
        self._key = "pipekernel/monitor"

    # ------------------------------------------------------------------ set-up
    @hookimpl
    def pipekernel_configure(self, engine: Any) -> None:
        if self.engine is not None and self.engine is not engine:
            raise ConfigError("a Monitor serves one engine; make a new Monitor per engine")
        self.engine = engine
        self.transport = engine.transport
        self.rank, self.world_size = engine.rank, engine.transport.world_size
        self.stage, self.topology = engine.stage, engine.topology
        self._count_inputs = engine.is_first_stage()
        self._classes = sorted({cls.__name__ for cls in engine.kernel.handlers})
        self._cuda = getattr(engine.transport.device, "type", "cpu") == "cuda"
        self._epoch = time.perf_counter()
        if self.world_size > 1:
            self._align(engine.transport)
        if self.rank == 0 and self.sinks:
            os.makedirs(self.out_dir, exist_ok=True)  # only where files are written
            for sink in self.sinks:
                sink.open(self)
        if self.heartbeat and self.heartbeat > 0:
            self._start_positions()

    def _align(self, transport: Any) -> None:
        """Agree on a key prefix and a common time zero for the trace.

        Every rank leaves a barrier, then rank 0 broadcasts its wall clock and host.
        Ranks on rank 0's host share its clock exactly, so they convert through it;
        ranks on other hosts use the barrier exit as time zero (good to the barrier's
        skew, whatever their clocks say).
        """
        import torch

        transport.barrier()
        perf, wall = time.perf_counter(), time.time()
        host = int(hashlib.sha1(socket.gethostname().encode()).hexdigest()[:12], 16)
        info = torch.tensor([int.from_bytes(os.urandom(6), "little"), wall, host],
                            dtype=torch.float64, device=transport.device)
        transport.broadcast(info, 0)
        key, wall0, host0 = info.tolist()
        self._key = f"pipekernel/monitor/{int(key)}"
        self._epoch = perf - (wall - wall0) if host0 == host else perf

    # ---------------------------------------------------------------- hot path
    @hookimpl
    def pipekernel_before_train_batch(self, engine: Any) -> None:
        if self._events:  # instructions since the last step ran outside train_batch (eval)
            self._keep_trace(self._events, None)
            self._events = []
        self._in_train = True
        self._samples = self._tokens = 0
        if self._cuda:
            import torch
            torch.cuda.reset_peak_memory_stats(engine.transport.device)
        self._step_start = time.perf_counter()

    @hookimpl
    def pipekernel_before_instruction(self, instruction: Any) -> None:
        self._current = (time.perf_counter(), instruction)

    @hookimpl
    def pipekernel_after_instruction(self, instruction: Any, seconds: float) -> None:
        start = self._current[0] if self._current is not None else time.perf_counter() - seconds
        self._events.append((start, seconds, instruction))
        self._current = None
        self._last_end = start + seconds
        if self._count_inputs and type(instruction) is isa.LoadMicroBatch and self._in_train:
            self._count(instruction)

    def _count(self, instruction: Any) -> None:
        from pipekernel.wire import flatten

        inputs = self.engine.runtime.buffers[instruction.buffer].inputs
        if inputs is None:
            return
        tensors, _ = flatten(inputs)
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
    def pipekernel_after_train_batch(self, engine: Any, loss: Any, metrics: Mapping) -> None:
        end = time.perf_counter()
        if self._closed:  # sinks are closed; a new Monitor sees later steps
            self._events = []
            return
        step = int(metrics.get("step", self._all.steps + 1))
        events, self._events = self._events, []
        self._in_train = False
        mine = self._step_numbers(events, end, step)
        mine["loss"] = float(loss) if loss is not None else float("nan")
        mine["skipped"] = bool(metrics.get("skipped", False))
        # other numbers the engine reports for the step (e.g. the precision's loss_scale)
        mine["extra"] = {k: v for k, v in metrics.items()
                         if k not in ("step", "seconds", "skipped")
                         and isinstance(v, (int, float)) and not isinstance(v, bool)}
        self.history.append(mine)
        self._all.add(mine)
        if self._all.steps > self.warmup_steps:
            self._measured.add(mine)
        self._keep_trace(events, step)
        if self.sinks:  # every rank knows the same sink list, so all join or none do
            rows = self._gather_step(mine)
            if self.rank == 0:
                record = self._record(step, mine, rows)
                self.records.append(record)
                for sink in self.sinks:
                    sink.write(record)

    def _step_numbers(self, events: list, end: float, step: int) -> dict[str, Any]:
        per_class = dict.fromkeys(self._classes, 0.0)
        other_instr = 0.0
        for _, seconds, instruction in events:
            name = type(instruction).__name__
            if name in per_class:
                per_class[name] += seconds
            else:
                other_instr += seconds
        step_s = end - self._step_start
        last = events[-1][0] + events[-1][1] if events else self._step_start
        drain = max(0.0, end - last)
        numbers = {"step": step, "step_s": step_s, "drain_s": drain,
                   "peak_memory_mb": self._peak_memory_mb(), "samples": self._samples,
                   "tokens": self._tokens, "other_instr_s": other_instr,
                   "instructions": per_class}
        return numbers

    def _peak_memory_mb(self) -> float:
        if self._cuda:
            import torch
            return torch.cuda.max_memory_allocated(self.engine.transport.device) / 2**20
        try:
            import resource
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes vs KiB
        except ImportError:  # Windows
            return float("nan")

    def _vector(self, mine: dict[str, Any]) -> list[float]:
        return [float(mine[k]) for k in _VECTOR] + [mine["instructions"][c] for c in self._classes]

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
        numbers = dict(zip(_VECTOR, row))
        classes = dict(zip(self._classes, row[len(_VECTOR):]))
        data, stage, _ = self.topology.coords(rank) if self.world_size > 1 else (0, 0, 0)
        return _derive(rank, stage, data, numbers, classes)

    def _record(self, step: int, mine: dict[str, Any], rows: list[list[float]]) -> dict[str, Any]:
        ranks = [self._rank_dict(r, row) for r, row in enumerate(rows)]
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
            "ranks": ranks,
        }

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
        instruction class) and ``losses`` (of the last ``keep_steps`` steps).
        Totals are running sums: memory does not grow with the number of steps.
        """
        totals = self._measured if self._measured.steps else self._all
        data, stage = (self.topology.data_rank, self.stage) if self.engine else (0, 0)
        summary = _derive(self.rank, stage, data, totals.numbers, totals.classes)
        summary.update(steps=totals.steps, skipped_steps=totals.skipped,
                       losses=[h["loss"] for h in self.history])
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

    # ------------------------------------------------------------------ trace
    def _keep_trace(self, events: list, step: int | None) -> None:
        if not self.needs_trace or not events:
            return
        room = self.trace_max_events - len(self._trace)
        if room < len(events):
            self._trace_dropped += len(events) - max(room, 0)
            events = events[:max(room, 0)]
        epoch = self._epoch
        for start, seconds, ins in events:
            self._trace.append(((start - epoch) * 1e6, seconds * 1e6, str(ins), type(ins).__name__,
                                getattr(ins, "micro_batch", None), step))
        if step is not None and events:
            self._trace.append(((self._step_start - epoch) * 1e6,
                                (events[-1][0] + events[-1][1] - self._step_start) * 1e6,
                                f"step {step}", "step", None, step))

    def _trace_events(self, parts: list[tuple[int, int, list, int]]) -> list[dict[str, Any]]:
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

    # ------------------------------------------------------------------ close
    @hookimpl
    def pipekernel_unconfigure(self, engine: Any) -> None:
        self.close()

    def close(self) -> None:
        """Flush the sinks; on rank 0 merge the trace and (with any sink) write
        ``summary.json``: every rank's summary and the partition.

        A collective when the world has more than one rank: call it on every
        rank (``engine.close()`` does). Idempotent.
        """
        if self._closed:
            return
        self._stop_positions()
        if self.engine is None or getattr(self.engine, "failed", None) is not None:
            # after a failed batch the peers may be gone: no collective (no gather, no
            # merged trace); what this rank measured stays in history/stage_summary()
            self._closed = True
            return
        if self._events:
            self._keep_trace(self._events, None)
            self._events = []
        summaries = self.gather()
        self.summaries, self._closed = summaries, True
        parts = None
        if self.needs_trace:
            mine = (self.rank, self.stage, self._trace, self._trace_dropped)
            parts = [mine] if self.world_size == 1 else gather_objects(self.transport, mine)
        if self.rank != 0:
            return
        trace = self._trace_events(parts) if parts is not None else None
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
        now = time.perf_counter()
        current, engine = self._current, self.engine
        kernel_pos = getattr(getattr(engine, "kernel", None), "position", None)
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
                       state="waiting" if kind in _WAITS else "running",
                       seconds=now - current[0])
        else:
            pos.update(instruction=None, type=None, micro_batch=None,
                       state="in a step, between instructions" if kernel_pos
                       else "outside train_batch/eval_batch", seconds=now - self._last_end)
        return pos

    def positions(self) -> dict[int, dict[str, Any]]:
        """Every rank's last published position (this rank's is live); ranks that never
        published are missing."""
        found = {}
        if self._store is not None:
            for rank in range(self.world_size):
                key = f"{self._key}/pos/{rank}"
                try:
                    if rank != self.rank and self._store.check([key]):
                        found[rank] = json.loads(self._store.get(key).decode())
                except Exception:  # the store is gone (peer died): report what we have
                    continue
        found[self.rank] = self.position()
        return dict(sorted(found.items()))

    def dump_positions(self, file: Any = None, filename: str | None = None) -> str:
        """Format every rank's position, print it to ``file`` (stderr by default) and
        write it to ``out_dir/positions-rank{R}.txt`` (or ``filename``); returns the text."""
        text = format_positions(self.positions(), seen_from=self.rank,
                                world_size=self.world_size)
        print(text, file=file or sys.stderr, flush=True)
        path = os.path.join(self.out_dir, filename or f"positions-rank{self.rank}.txt")
        try:
            os.makedirs(self.out_dir, exist_ok=True)
            with open(path, "w") as f:
                f.write(text + "\n")
            self.paths[f"positions-rank{self.rank}"] = path
        except OSError:
            pass
        return text

    @hookimpl
    def pipekernel_instruction_error(self, instruction: Any, stage: int, error: Any) -> None:
        if not isinstance(error, TransportError):
            return
        self._publish()
        text = format_positions(self.positions(), seen_from=self.rank,
                                world_size=self.world_size)
        error.add_detail(text)
        try:
            os.makedirs(self.out_dir, exist_ok=True)
            with open(os.path.join(self.out_dir, f"hang-rank{self.rank}.txt"), "w") as f:
                f.write(str(error) + "\n")
        except OSError:
            pass

    def _publish(self) -> None:
        # never after a stop: the store may be on its way down with the process group
        if self._store is not None and not self._stop.is_set():
            try:
                self._store.set(f"{self._key}/pos/{self.rank}", json.dumps(self.position()))
            except Exception:
                pass

    def _start_positions(self) -> None:
        self._store = _default_store() if self.world_size > 1 else None
        if self.dump_signal is not None and threading.current_thread() is threading.main_thread():
            self._install_signal()
        self._stop.clear()
        self._thread = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                        name=f"pipekernel-monitor-rank{self.rank}")
        self._thread.start()
        _RUNNING.add(self)

    def _install_signal(self) -> None:
        # A Python signal handler runs only when the main thread gets back to the
        # interpreter, which a rank blocked in a receive does not do. The wakeup fd is
        # written by the C-level handler at once, so the position thread reacts instead.
        r, w = os.pipe()
        os.set_blocking(w, False)
        os.set_blocking(r, False)
        try:
            old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except (ValueError, OSError):
            os.close(r), os.close(w)
            return
        if old != -1:  # someone else (an event loop) owns the wakeup fd: leave it to them
            signal.set_wakeup_fd(old)
            os.close(r), os.close(w)
            return
        self._wake_r, self._wake_w, self._old_wakeup_fd = r, w, old
        self._old_handler = signal.signal(self.dump_signal, lambda *_: None)

    def _heartbeat_loop(self) -> None:
        while not self._stop.is_set():
            self._publish()
            if self._wake_r is None:
                self._stop.wait(self.heartbeat)
                continue
            ready, _, _ = select.select([self._wake_r], [], [], self.heartbeat)
            if ready:
                try:
                    data = os.read(self._wake_r, 512)
                except (BlockingIOError, OSError):
                    data = b""
                if self.dump_signal in data and not self._stop.is_set():
                    try:
                        self.dump_positions()
                    except Exception as err:  # never kill the thread
                        print(f"pipekernel monitor: position dump failed: {err!r}",
                              file=sys.stderr)

    def _stop_positions(self) -> None:
        _RUNNING.discard(self)
        self._stop.set()
        if self._wake_w is not None:
            try:
                os.write(self._wake_w, b"\0")
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._wake_r is not None:
            try:
                if threading.current_thread() is threading.main_thread():
                    signal.set_wakeup_fd(self._old_wakeup_fd if self._old_wakeup_fd is not None
                                         else -1)
                    signal.signal(self.dump_signal, self._old_handler or signal.SIG_DFL)
            finally:
                os.close(self._wake_r), os.close(self._wake_w)
                self._wake_r = self._wake_w = None
        self._store = None  # the thread is gone; keep no handle into torch.distributed


# Monitors whose position thread runs. A daemon thread that is inside a store call
# (GIL released) when the interpreter starts finalizing is torn down as it tries to
# take the GIL back, through C++ frames: "terminate called without an active
# exception". So a run that never closed its engine still stops and joins the
# thread here, before finalization (atexit hooks run first).
_RUNNING: weakref.WeakSet[Monitor] = weakref.WeakSet()


@atexit.register
def _stop_running_monitors() -> None:
    for monitor in list(_RUNNING):
        try:
            monitor._stop_positions()
        except Exception:
            pass


class _Totals:
    """Running sums of a rank's per-step numbers."""

    def __init__(self) -> None:
        self.numbers = dict.fromkeys(_VECTOR, 0.0)
        self.classes: dict[str, float] = {}
        self.steps = self.skipped = 0

    def add(self, step: Mapping[str, Any]) -> None:
        for key in _VECTOR:
            if key == "peak_memory_mb":
                self.numbers[key] = max(self.numbers[key], step[key])
            else:
                self.numbers[key] += step[key]
        for cls, seconds in step["instructions"].items():
            self.classes[cls] = self.classes.get(cls, 0.0) + seconds
        self.steps += 1
        self.skipped += bool(step["skipped"])


def _derive(rank: int, stage: int, data: int, numbers: Mapping[str, float],
            classes: Mapping[str, float]) -> dict[str, Any]:
    """A rank's dict from raw sums: grouped times, other, fractions, rates."""
    out: dict[str, Any] = {"rank": rank, "stage": stage, "data_parallel_rank": data}
    step_s = numbers["step_s"]
    for key, names in _GROUPS.items():
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


def format_positions(positions: Mapping[int, Mapping[str, Any]], seen_from: int | None = None,
                     world_size: int | None = None) -> str:
    """A table of where each rank is, one line per rank (see :meth:`Monitor.positions`)."""
    now = time.time()
    head = "pipeline positions" + (f" (seen from rank {seen_from})" if seen_from is not None
                                   else "") + ":"
    lines = [head]
    for rank, p in sorted(positions.items()):
        where = [f"rank {rank} (stage {p.get('stage')}, {p.get('host')} pid {p.get('pid')}):"]
        if p.get("train_step") is not None:
            where.append(f"train step {p['train_step']},")
        if p.get("schedule_step") is not None:
            where.append(f"schedule step {p['schedule_step']},")
        if p.get("instruction"):
            where.append(f"{p['instruction']} ({p['type']}) {p['state']} for "
                         f"{p['seconds']:.1f}s")
        else:
            where.append(f"{p['state']} for {p['seconds']:.1f}s")
        age = now - p.get("updated", now)
        if age > 0.05:
            where.append(f"[as of {age:.1f}s ago]")
        lines.append("  " + " ".join(where))
    if world_size is not None:
        missing = sorted(set(range(world_size)) - set(positions))
        if missing:
            lines.append(f"  ranks {missing}: no position available (the store went away with "
                         "a failed rank, or that rank has no monitor)")
    return "\n".join(lines)


def gather_objects(transport: Any, obj: Any) -> list[Any] | None:
    """Pickle ``obj`` on every rank; rank 0 gets the list by rank, others ``None``.

    Uses only the Transport protocol's collectives (an all-reduce of the sizes,
    then one broadcast per rank), so it works on any transport.
    """
    from pipekernel.faults import all_gather_objects

    out = all_gather_objects(transport, obj)
    return out if transport.rank == 0 else None


def _default_store() -> Any:
    """The key-value store of torch.distributed's default group, if there is one."""
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            from torch.distributed import distributed_c10d
            return distributed_c10d._get_default_store()
    except Exception:
        pass
    return None
