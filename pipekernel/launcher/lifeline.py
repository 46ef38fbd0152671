"""A local worker's tie to the process that launched it (:func:`pipekernel.launcher.launch`).

A worker must not outlive its launcher, whatever ended the launcher (``kill -9``, the OOM
killer, a closed terminal) and whatever started the worker. ``PR_SET_PDEATHSIG`` alone
does not do it: it watches the worker's *parent*, and a worker the ``forkserver`` start
method made is the fork server's child, not the launcher's. So the launcher opens a pipe
(:class:`Lifeline`), keeps its write end, and hands every worker the read end; no other
process holds the write end. The kernel closes it when the launcher dies, however it
dies; the worker's watch thread then reads end-of-file and stops the worker: SIGTERM
first (the worker unwinds as it does when the launcher stops it), SIGKILL after
:data:`GRACE` seconds if it has not ended. The fork server ends on its own once the
launcher and the workers are gone (it exits when the last holder of its "alive" pipe,
which every worker holds, closes it).

The launcher forwards SIGUSR1 to its workers (:func:`forward_signal`): ``kill -USR1`` on
the one PID a user sees prints every rank's report, instead of killing the launcher.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Lifeline", "watch_launcher", "report_on_signal", "forward_signal", "GRACE"]

#: Seconds a worker whose launcher died gets to unwind after SIGTERM before SIGKILL.
GRACE = 5.0


class Lifeline:
    """The launcher's end of the pipe; pickled into a worker as the read end.

    Open it before starting the workers, :meth:`close` it once they have ended (or been
    killed): closing it earlier tells every worker still running that the launcher died.
    """

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()  # both close-on-exec (not inheritable)

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing import reduction
        return (_received, (reduction.DupFd(self.read_fd),))

    def started(self) -> None:
        """Every worker has its copy of the read end: the launcher needs its own no more."""
        if self.read_fd >= 0:
            os.close(self.read_fd)
            self.read_fd = -1

    def close(self) -> None:
        """Close both ends (idempotent)."""
        self.started()
        if self.write_fd >= 0:
            os.close(self.write_fd)
            self.write_fd = -1


def _received(fd: Any) -> int:
    return fd.detach()


def watch_launcher(fd: int, rank: int, launcher_pid: int) -> None:
    """In a worker: a daemon thread that stops this process when the launcher dies
    (end-of-file on ``fd``); also SIGTERM from the kernel when the parent dies
    (``PR_SET_PDEATHSIG``, Linux), the quicker of the two under ``spawn``."""
    thread = threading.Thread(target=_watch, args=(fd, rank, launcher_pid), daemon=True,
                              name=f"pipekernel-lifeline-rank{rank}")
    thread.start()
    _die_with_parent()


def _watch(fd: int, rank: int, launcher_pid: int) -> None:
    try:
        while os.read(fd, 1):  # nobody writes: only end-of-file (or an error) returns
            pass
    except OSError:
        pass
    try:
        os.write(2, f"pipekernel: rank {rank} (pid {os.getpid()}): its launcher (pid "
                    f"{launcher_pid}) is gone; stopping\n".encode())
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGTERM)  # unwinds as when the launcher stops it
    threading.Event().wait(GRACE)
    os.kill(os.getpid(), signal.SIGKILL)  # blocked where SIGTERM cannot reach it


def _die_with_parent() -> None:
    """Linux: the kernel sends this worker SIGTERM when its parent dies."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def report_on_signal(rank: int) -> None:
    """In a worker: SIGUSR1 prints this rank's Python stacks (a
    :class:`~pipekernel.plugins.monitor.Monitor`, when the job has one, replaces this with
    every rank's position), where the default action would kill the rank."""
    usr1 = getattr(signal, "SIGUSR1", None)
    if usr1 is None:
        return

    def dump(signum: int, frame: Any) -> None:
        print(f"pipekernel: rank {rank} (pid {os.getpid()}) got SIGUSR1; no Monitor here to "
              "report every rank's position, so its own Python stacks:", file=sys.stderr,
              flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)

    signal.signal(usr1, dump)


def forward_signal(signum: int, procs: Sequence[Any]) -> Callable[[], None]:
    """In the launcher (main thread): pass ``signum`` on to every live worker instead of
    its default action; returns the function that restores the previous handler."""

    def forward(sig: int, frame: Any) -> None:
        pids = [p.pid for p in procs if p.pid is not None and p.is_alive()]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        print(f"pipekernel: passed {signal.Signals(sig).name} on to the ranks (pids "
              f"{', '.join(map(str, pids))})", file=sys.stderr, flush=True)

    old = signal.signal(signum, forward)

    def restore() -> None:
        signal.signal(signum, old)
    return restore
