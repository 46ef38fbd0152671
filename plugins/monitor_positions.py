"""Hang diagnostics of the monitor: every rank's position in the schedule.

Every rank publishes its position (train step, schedule step, instruction,
running or waiting and for how long: :meth:`Monitor.position`) to the process
group's key-value store once per ``heartbeat`` seconds from a daemon thread.
:class:`PositionBoard` reads the other ranks' positions back, formats them
(:func:`format_positions`) and dumps them when ``dump_signal`` arrives — even
while the main thread is blocked in a receive (the signal's wakeup fd wakes the
position thread, not the interpreter).
"""
from __future__ import annotations

import atexit
import json
import os
import select
import signal
import sys
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any

__all__ = ["PositionBoard", "format_positions", "default_store"]


class PositionBoard:
    """The position thread, the dump signal and the store keys of one monitor.

    :param monitor: the :class:`~pipekernel.plugins.monitor.Monitor`; the board reads
        its ``position()``, ``rank``, ``world_size``, ``out_dir``, ``paths``,
        ``heartbeat``, ``dump_signal`` and ``_key`` (the store prefix agreed at start).
    """

    def __init__(self, monitor: Any) -> None:
        self.monitor = monitor
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake_r: int | None = None
        self._wake_w: int | None = None
        self._old_wakeup_fd: int | None = None
        self._old_handler: Any = None
        self._store: Any = None

    def positions(self) -> dict[int, dict[str, Any]]:
        """Every rank's last published position (this rank's is live); ranks that never
        published are missing."""
        found = {}
        if self._store is not None:
            for rank in range(self.monitor.world_size):
                key = f"{self.monitor._key}/pos/{rank}"
                try:
                    if rank != self.monitor.rank and self._store.check([key]):
                        found[rank] = json.loads(self._store.get(key).decode())
                except Exception:  # the store is gone (peer died): report what we have
                    continue
        found[self.monitor.rank] = self.monitor.position()
        return dict(sorted(found.items()))

    def dump(self, file: Any = None, filename: str | None = None) -> str:
        """Format every rank's position, print it to ``file`` (stderr by default) and
        write it to ``out_dir/positions-rank{R}.txt`` (or ``filename``); returns the text."""
        text = format_positions(self.positions(), seen_from=self.monitor.rank,
                                world_size=self.monitor.world_size)
        print(text, file=file or sys.stderr, flush=True)
        m = self.monitor
        path = os.path.join(m.out_dir, filename or f"positions-rank{m.rank}.txt")
        try:
            os.makedirs(self.monitor.out_dir, exist_ok=True)
            with open(path, "w") as f:
                f.write(text + "\n")
            self.monitor.paths[f"positions-rank{self.monitor.rank}"] = path
        except OSError:
            pass
        return text

    def publish(self) -> None:
        """Write this rank's position to the store now. Never after a stop: the store
        may be on its way down with the process group."""
        # never after a stop: the store may be on its way down with the process group
        if self._store is not None and not self._stop.is_set():
            try:
                m = self.monitor
                self._store.set(f"{m._key}/pos/{m.rank}", json.dumps(m.position()))
            except Exception:
                pass

    def start(self) -> None:
        """Start the position thread (and the dump signal, from the main thread)."""
        self._store = default_store() if self.monitor.world_size > 1 else None
        if (self.monitor.dump_signal is not None
                and threading.current_thread() is threading.main_thread()):
            self._install_signal()
        self._stop.clear()
        self._thread = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                        name=f"pipekernel-monitor-rank{self.monitor.rank}")
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
            os.close(r)
            os.close(w)
            return
        if old != -1:  # someone else (an event loop) owns the wakeup fd: leave it to them
            signal.set_wakeup_fd(old)
            os.close(r)
            os.close(w)
            return
        self._wake_r, self._wake_w, self._old_wakeup_fd = r, w, old
        self._old_handler = signal.signal(self.monitor.dump_signal, lambda *_: None)

    def _heartbeat_loop(self) -> None:
        while not self._stop.is_set():
            self.publish()
            if self._wake_r is None:
                self._stop.wait(self.monitor.heartbeat)
                continue
            ready, _, _ = select.select([self._wake_r], [], [], self.monitor.heartbeat)
            if ready:
                try:
                    data = os.read(self._wake_r, 512)
                except (BlockingIOError, OSError):
                    data = b""
                if self.monitor.dump_signal in data and not self._stop.is_set():
                    try:
                        self.dump()
                    except Exception as err:  # never kill the thread
                        print(f"pipekernel monitor: position dump failed: {err!r}",
                              file=sys.stderr)

    def stop(self) -> None:
        """Stop and join the thread, restore the signal; idempotent."""
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
                    signal.signal(self.monitor.dump_signal, self._old_handler or signal.SIG_DFL)
            finally:
                for fd in (self._wake_r, self._wake_w):
                    if fd is not None:
                        os.close(fd)
                self._wake_r = self._wake_w = None
        self._store = None  # the thread is gone; keep no handle into torch.distributed


# Boards whose position thread runs. A daemon thread that is inside a store call
# (GIL released) when the interpreter starts finalizing is torn down as it tries to
# take the GIL back, through C++ frames: "terminate called without an active
# exception". So a run that never closed its engine still stops and joins the
# thread here, before finalization (atexit hooks run first).
_RUNNING: weakref.WeakSet[PositionBoard] = weakref.WeakSet()


@atexit.register
def _stop_running_boards() -> None:
    for board in list(_RUNNING):
        try:
            board.stop()
        except Exception:
            pass


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
            where.append(f"train step {p['train_step']} (1-based),")
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



def default_store() -> Any:
    """The key-value store of torch.distributed's default group, if there is one."""
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            from torch.distributed import distributed_c10d
            return distributed_c10d._get_default_store()
    except Exception:
        pass
    return None
