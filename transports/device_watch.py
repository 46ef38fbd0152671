"""Timeouts for work that runs on a GPU, without host polling on the hot path.

A device transport's :meth:`Handle.wait` only *orders* torch's current stream
after the transfer: the host goes on queueing kernels and never blocks on the
device. So nothing waits on the host where a timeout could fire. This module
bounds such work instead:

* :meth:`DeviceWatch.watch` registers a waited-on work item with its deadline
  (``timeout`` seconds from the wait). A daemon thread wakes every ``interval``
  seconds and asks each registered item whether it finished (``done(work)``:
  ``Work.is_completed()`` or ``cudaEventQuery`` — a query, never a device sync).
  An item past its deadline becomes a :class:`~pipekernel.errors.TransportTimeout`
  naming the peer, ``on_expire(error)`` runs once (abort the communicators, so
  the stuck kernels end and a host sitting in a CUDA synchronisation gets control
  back) and every later call of :meth:`check` — each transport call makes one —
  raises it.
* If no :meth:`check` raised it ``grace`` seconds after the expiry (the host is
  still blocked, e.g. in a device synchronisation the abort did not end),
  ``on_stuck(error)`` runs once: the transports end the process with the error's
  text (:func:`end_process`), as torch's NCCL watchdog tears a process down. So an
  overdue transfer ends the rank within ``timeout + interval + grace`` seconds.
* :meth:`wait_for` and :meth:`synchronize` are the bounded *host* waits, for the
  places that must block (a barrier, the end of a test, ``close``): they poll
  ``done`` with short sleeps, so they are kept off the per-transfer path.

Cost on the hot path: one lock, a list append and a completion query or two per
wait (finished items at the head are dropped then). Cost elsewhere: one
thread waking ``1 / interval`` times a second, querying each in-flight item once
per wake. (On the CPU this cannot be measured against a GPU; ``docs/gpu.md``
says how ``gpu/check.sh`` times it.)
"""
from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from pipekernel.errors import TransportTimeout

__all__ = ["DeviceWatch", "end_process", "STUCK_EXIT_CODE"]

#: The exit status of a process :func:`end_process` ended (a rank whose host stayed
#: blocked after its overdue transfer's communicators were aborted).
STUCK_EXIT_CODE = 75


def end_process(error: BaseException) -> None:
    """Write ``error`` to stderr and end the process at once (``os._exit``, status
    :data:`STUCK_EXIT_CODE`): the host thread is stuck in native code, so raising
    cannot reach it and a normal exit would wait for it."""
    try:
        sys.stderr.write(f"pipekernel: {type(error).__name__}: {error}\n"
                         "pipekernel: the host stayed blocked after the communicators were "
                         "aborted; ending the process\n")
        sys.stderr.flush()
    finally:
        os._exit(STUCK_EXIT_CODE)


class _Item:
    __slots__ = ("work", "deadline", "timeout", "what", "peer")

    def __init__(self, work: Any, deadline: float, timeout: float, what: str,
                 peer: int | None) -> None:
        self.work, self.deadline, self.timeout = work, deadline, timeout
        self.what, self.peer = what, peer


class DeviceWatch:
    """Deadlines for in-flight device work of one transport (see the module docstring).

    :param rank: this process's rank, for messages.
    :param done: ``done(work) -> bool``, ``True`` once ``work`` finished; must not block.
    :param describe: ``describe(peer) -> str`` for messages (``"rank 3"``).
    :param on_expire: called once with the first timeout error (from the watch thread).
    :param on_stuck: called once with that error if no :meth:`check` raised it within
        ``grace`` seconds of the expiry (from the watch thread; e.g. :func:`end_process`).
    :param grace: seconds the host gets, after the expiry, to reach a transport call.
    :param interval: seconds between the thread's rounds.
    :param clock: monotonic seconds (a fake in tests).
    :param thread: start the watch thread on the first :meth:`watch` (``False`` in
        tests, which call :meth:`poll` themselves).
    """

    def __init__(self, rank: int, done: Callable[[Any], bool], *,
                 describe: Callable[[int], str] = lambda peer: f"rank {peer}",
                 on_expire: Callable[[TransportTimeout], None] | None = None,
                 on_stuck: Callable[[TransportTimeout], None] | None = None,
                 grace: float = 10.0, interval: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 thread: bool = True) -> None:
        self.rank, self.done, self.describe = rank, done, describe
        self.on_expire, self.interval, self.clock = on_expire, interval, clock
        self.on_stuck, self.grace = on_stuck, grace
        self.error: TransportTimeout | None = None
        #: set once a :meth:`check` (or a bounded wait) handed ``error`` to the host
        self.raised = False
        self._expired_at: float | None = None
        self._stuck_called = False
        self._items: list[_Item] = []
        self._lock = threading.Lock()
        self._use_thread = thread
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # -- hot path ----------------------------------------------------------------------
    def watch(self, work: Any, timeout: float, what: str, peer: int | None) -> None:
        """Bound ``work`` to ``timeout`` seconds from now (``what``: e.g. ``"receive from"``;
        ``peer``: the peer's rank, ``None`` for a collective)."""
        item = _Item(work, self.clock() + timeout, timeout, what, peer)
        with self._lock:
            items = self._items
            # Work completes about in order: drop finished items at the head (a few
            # queries per wait), so the list, and the tensors a Work keeps alive, stay
            # short between the thread's rounds.
            head = 0
            while head < min(len(items), 4) and self.done(items[head].work):
                head += 1
            if head:
                del items[:head]
            items.append(item)
        if self._use_thread and self._thread is None:
            self._start()

    def check(self) -> None:
        """Raise the timeout the watch found, if any (every transport call makes this check)."""
        if self.error is not None:
            self.raised = True
            raise self.error

    # -- the watch -----------------------------------------------------------------------
    def poll(self) -> None:
        """One round: forget finished items; turn the first overdue one into ``error``
        (and call ``on_expire``); after that, only watch for the host staying away
        (``on_stuck`` after ``grace``): aborted work is not queried again."""
        now = self.clock()
        if self.error is not None:
            if (self._expired_at is not None and not self.raised and not self._stuck_called
                    and now >= self._expired_at + self.grace):
                self._stuck_called = True  # the host never came back for the error
                self._call(self.on_stuck)
            return
        with self._lock:
            items = self._items
            self._items = [item for item in items if not self.done(item.work)]
            overdue = next((item for item in self._items if now >= item.deadline), None)
        if overdue is not None:
            self._expire(overdue, now)

    def _expire(self, item: _Item, now: float) -> None:
        """The first timeout: keep it, run ``on_expire`` (once, whoever found it)."""
        if self.error is None:
            self.error = self._timeout(item)
            self._expired_at = now
            self._call(self.on_expire)

    def _call(self, hook: Callable[[TransportTimeout], None] | None) -> None:
        if hook is not None:
            try:
                hook(self.error)  # type: ignore[arg-type]
            except Exception:  # noqa: BLE001 - the error itself is what matters
                pass

    def pending(self) -> int:
        """How many waited-on items are not known to be finished."""
        with self._lock:
            self._items = [item for item in self._items if not self.done(item.work)]
            return len(self._items)

    def _timeout(self, item: _Item) -> TransportTimeout:
        who = self.describe(item.peer) if item.peer is not None else "its group"
        return TransportTimeout(
            f"rank {self.rank} waited {item.timeout:g}s to {item.what} {who} and gave up "
            "(the transfer was still running on the GPU)", peer=item.peer, rank=self.rank,
            hint="check that the peer is alive and runs the same schedule; raise timeout= "
                 "if it is just slow")

    # -- bounded host waits ----------------------------------------------------------------
    def wait_for(self, work: Any, timeout: float, what: str, peer: int | None,
                 sleep: Callable[[float], None] = time.sleep,
                 abort_check: Callable[[], None] | None = None) -> None:
        """Block the host until ``work`` finished; ``TransportTimeout`` after ``timeout``."""
        self.check()
        item = _Item(work, self.clock() + timeout, timeout, what, peer)
        self._block([item], sleep, abort_check)

    def synchronize(self, sleep: Callable[[float], None] = time.sleep,
                    abort_check: Callable[[], None] | None = None) -> None:
        """Block the host until every watched item finished, each within its deadline."""
        self.check()
        with self._lock:
            items = list(self._items)
        self._block(items, sleep, abort_check)
        self.poll()

    def _block(self, items: list[_Item], sleep: Callable[[float], None],
               abort_check: Callable[[], None] | None) -> None:
        pause, last_check = 1e-4, self.clock()
        while items:
            items = [item for item in items if not self.done(item.work)]
            if not items:
                return
            now = self.clock()
            overdue = next((item for item in items if now >= item.deadline), None)
            if overdue is not None:
                self._expire(overdue, now)  # aborts the communicators, as the thread would
                self.raised = True
                raise self._timeout(overdue)
            if abort_check is not None and now - last_check >= 0.5:
                abort_check()
                last_check = now
            sleep(pause)
            pause = min(pause * 2, 0.01)

    # -- thread --------------------------------------------------------------------------
    def _start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"pipekernel-device-watch-rank{self.rank}")
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - a failing query must not kill the watch
                continue

    def stop(self) -> None:
        """End the watch thread (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


class Watched:
    """What a transport whose device transfers a :class:`DeviceWatch` (``self._watch``)
    guards has from it (nccl, cupy-nccl): ``failure`` and ``synchronize``."""

    _watch: DeviceWatch

    @property
    def failure(self) -> TransportTimeout | None:
        """The device watch's ``TransportTimeout`` once a transfer was overdue, else
        ``None`` (see :mod:`pipekernel.comm.transport`, optional members)."""
        watch = getattr(self, "_watch", None)
        return watch.error if watch is not None else None

    def synchronize(self) -> None:
        """Block the host until every transfer waited on so far finished on the GPU, each
        within ``timeout`` of its wait; ``TransportTimeout`` naming the peer otherwise.
        Off the hot path: for the end of a run, tests, and before reading results on
        the host without the stream."""
        self._watch.synchronize(abort_check=getattr(self, "abort_check", None))
