"""Start local worker processes for the embedded default (CPU, gloo).

``launch(fn, nprocs)`` runs ``fn(*args)`` in ``nprocs`` fresh processes with the
torchrun environment set (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT`` on a free port), returns each rank's return
value, re-raises the first failure with its rank and traceback, and kills every
process when one fails (or, with ``timeout=``, when that deadline on the whole run
passes). Hangs are found by the engine's own per-wait timeouts
(``PipelineEngine(timeout=)``), so a long job is never killed for being long.

Inside a world another launcher made (torchrun, SLURM, Ray Train, Kubeflow, an
initialised process group: :mod:`pipekernel.launcher.clusters`) it runs ``fn`` in this
process as that world's rank instead.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from pipekernel.launcher import clusters
from pipekernel.launcher import lifeline as lifeline_mod
from pipekernel.launcher.clusters import World
from pipekernel.errors import ConfigError, PipelineError, shorten

__all__ = ["launch", "RankError", "LaunchInterrupted", "free_port", "start_context"]

#: Seconds a worker that already returned its result gets to exit on its own.
_EXIT_GRACE = 10.0
#: The clock of ``timeout=`` (a test replaces it to pass hours in a second).
_clock = time.monotonic


class RankError(PipelineError):
    """A worker process failed; ``original`` is its exception (when picklable)."""

    def __init__(self, message: str, *, original: BaseException | None = None, **kw: Any):
        super().__init__(message, **kw)
        self.original = original

    def __str__(self) -> str:  # "rank R failed: ..." says where: no location bracket
        text = f"{self.message}\n  how to fix: {self.hint}" if self.hint else self.message
        return "".join([text, *("\n  " + d.replace("\n", "\n  ") for d in self.details)])


class LaunchInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM reached the launcher: every worker was stopped.

    The message says which ranks were stopped and, if one had failed before, which one
    (``rank``, its exception as ``original`` when picklable, its traceback in the text).
    It stays a ``KeyboardInterrupt``: a host that catches ``Exception`` (a test runner,
    a server loop) still stops, as the signal asked, instead of carrying on.
    """

    def __init__(self, message: str, *, rank: int | None = None,
                 original: BaseException | None = None) -> None:
        super().__init__(message)
        self.rank, self.original = rank, original


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"terminated by {signal.Signals(signum).name}")


def start_context() -> Any:
    """Where workers come from. ``forkserver`` (Linux) forks each worker from one server
    process that imported torch and pipekernel once, instead of a fresh interpreter
    importing them again per worker (``spawn``): ~2 s of CPU saved per worker, which is
    most of the cost of starting a test's ranks. ``PIPEKERNEL_START_METHOD=spawn`` (or a
    platform without forkserver) starts fresh interpreters as before. The server never
    touches CUDA, so a forked worker initialises it as a spawned one would.
    ``PIPEKERNEL_PRELOAD`` (comma-separated module names) and :data:`PRELOAD` add modules
    for the server to import once, e.g. what every world of a test suite imports again;
    one that is not installed is left out. They count only when the server starts (the
    first launch of the process)."""
    method = os.environ.get("PIPEKERNEL_START_METHOD", "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ConfigError(f"PIPEKERNEL_START_METHOD={method!r} is not a start method pipekernel "
                          "uses", hint="set it to 'forkserver' (default) or 'spawn'")
    if method == "forkserver" and "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "pipekernel", *_preload()])
        return ctx
    return mp.get_context("spawn")


#: modules this process's fork server imports once besides torch and pipekernel (see
#: :func:`start_context`), for a host that starts many worlds importing them (the test
#: suite: ``tests/conftest.py``). Unlike ``PIPEKERNEL_PRELOAD``, the programs this process
#: starts do not inherit it: a launcher they run pays only for what it imports itself.
PRELOAD: list[str] = []


def _preload() -> list[str]:
    """The installed modules ``PIPEKERNEL_PRELOAD`` and :data:`PRELOAD` name (see
    :func:`start_context`)."""
    import importlib.util
    names = [n.strip() for n in os.environ.get("PIPEKERNEL_PRELOAD", "").split(",")]
    names += [n for n in PRELOAD if n not in names]
    found = []
    for name in filter(None, names):
        # the top-level package only: finding ``lightning.pytorch`` would import
        # ``lightning`` here (~4 s of CPU) just to ask; the server's own import of a
        # submodule that is missing fails quietly (multiprocessing skips an ImportError)
        try:
            if importlib.util.find_spec(name.partition(".")[0]) is not None:
                found.append(name)
        except (ImportError, ValueError):
            pass
    return found


class _LauncherOutput:
    """The launcher's stdout and stderr *as they are now*, sent to a worker as file
    descriptors (a pytest capture, a shell redirect made after the fork server started)."""

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing import reduction
        try:
            fds = tuple(reduction.DupFd(fd) for fd in (1, 2))  # while the worker starts
        except OSError:  # a closed stdout (a daemon): the worker keeps the server's
            fds = ()
        return (_received, (fds,))


def _received(fds: tuple[Any, ...]) -> tuple[int, ...]:
    return tuple(fd.detach() for fd in fds)


def _worker(fn: Callable, args: Sequence[Any], rank: int, env: dict[str, str],
            results: Any, threads: int | None, path: list[str] | None = None,
            output: tuple[int, ...] = (), lifeline: int | None = None,
            launcher_pid: int | None = None) -> None:
    # a forked worker inherits the server's environment, path and output, fixed when it
    # started: take the launcher's as they are now, as a spawned worker would
    os.environ.clear()
    os.environ.update(env)
    if path is not None:
        sys.path[:] = path
    for target, fd in zip((1, 2), output):
        os.dup2(fd, target)
        os.close(fd)
    # Ctrl-C (and a closed terminal's SIGHUP) reach the launcher, which ends the workers
    # with SIGTERM: they unwind (KeyboardInterrupt), report and destroy their process group
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _interrupted)
    lifeline_mod.report_on_signal(rank)
    if lifeline is not None:  # after the SIGTERM handler: the watch may use it at once
        lifeline_mod.watch_launcher(lifeline, rank, launcher_pid or 0)
    try:
        if threads:
            import torch
            torch.set_num_threads(threads)
        # plain pickle: tensors travel by value, not as shared memory the worker must outlive
        results.put((rank, True, pickle.dumps(fn(*args)), None))
    except BaseException as err:  # report everything, including SystemExit
        tb = _format_traceback(err)
        try:
            results.put((rank, False, err, tb))
        except Exception:  # unpicklable exception: send its text only
            results.put((rank, False, None, tb))
    finally:
        try:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def launch(fn: Callable[..., Any], nprocs: int, args: Sequence[Any] = (), *,
           timeout: float | None = None, threads: int | None = 1,
           env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(*args)`` on ``nprocs`` local processes; return their results by rank.

    Inside a world a launcher made (:mod:`pipekernel.launcher.clusters`: torchrun, TorchX,
    Kubeflow, a SLURM step, Ray Train, a process group of several ranks), ``launch`` runs
    ``fn(*args)`` once, here, as this rank, and returns ``nprocs`` entries: this rank's
    result at its index, ``None`` elsewhere (``nprocs`` must be the world's size).

    :param fn: a picklable (module-level) function.
    :param timeout: ``None`` (default): no limit (a hang ends in the engine's own
        ``timeout=``). A number: a *deadline* on the whole run, in seconds.
    :param threads: ``torch.set_num_threads`` in each worker (``None`` leaves it).
    :raises RankError: naming the first rank that failed, with its traceback.
    :raises ConfigError: inside a launched world that does not fit ``nprocs``.
    """
    world = _launched_world(nprocs)
    if world is not None:
        return _join(fn, args, world, nprocs, threads)
    try:
        return _launch_local(fn, nprocs, args, timeout, threads, env)
    except (PipelineError, KeyboardInterrupt) as err:
        _mark_for_the_user(err)
        raise


def _launch_local(fn: Callable[..., Any], nprocs: int, args: Sequence[Any],
                  timeout: float | None, threads: int | None,
                  env: dict[str, str] | None) -> list[Any]:
    """:func:`launch` on this machine: start, collect, stop and clean up the workers."""
    ctx = start_context()
    results = ctx.Queue()
    store_dir = tempfile.mkdtemp(prefix="pipekernel-store-")
    local = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
             "PIPEKERNEL_INIT_METHOD": "file://" + os.path.join(store_dir, "store")}
    if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
        local["GLOO_SOCKET_IFNAME"] = "lo"
    procs: list[Any] = []
    lifeline = lifeline_mod.Lifeline()
    restore = _launcher_signals(procs)
    finished = False
    try:
        _start_workers(ctx, procs, fn, args, nprocs, threads, {**local, **(env or {})},
                       results, lifeline)
        try:
            values = _collect(procs, results, nprocs, timeout)
        except KeyboardInterrupt as interrupt:
            raise _stop_workers(procs, results, interrupt) from None
        finished = True
        return values
    finally:
        for proc in procs:
            if finished:  # let workers finish their clean-up: a kill there leaks the queue's lock
                proc.join(timeout=_EXIT_GRACE)
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)
        lifeline.close()  # after the workers ended: closing it earlier would stop them
        restore()
        shutil.rmtree(store_dir, ignore_errors=True)


def _start_workers(ctx: Any, procs: list[Any], fn: Callable[..., Any], args: Sequence[Any],
                   nprocs: int, threads: int | None, local: dict[str, str], results: Any,
                   lifeline: lifeline_mod.Lifeline) -> None:
    """Start ``nprocs`` workers into ``procs``, each holding the read end of ``lifeline``."""
    output = _LauncherOutput() if ctx.get_start_method() == "forkserver" else ()
    for rank in range(nprocs):
        rank_env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": str(nprocs), "LOCAL_WORLD_SIZE": str(nprocs), **local}
        proc = ctx.Process(target=_worker, daemon=True,
                           args=(fn, args, rank, rank_env, results, threads, list(sys.path),
                                 output, lifeline, os.getpid()))
        proc.start()
        procs.append(proc)
    lifeline.started()


def _launcher_signals(procs: list[Any]) -> Callable[[], None]:
    """In the main thread: SIGTERM and SIGHUP (a closed terminal; not when ignored, as
    under ``nohup``) stop the workers as Ctrl-C does; SIGUSR1 is passed on to them (their
    hang report). Returns the function that restores the previous handlers."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    old = {signal.SIGTERM: signal.signal(signal.SIGTERM, _interrupted)}
    hup = getattr(signal, "SIGHUP", None)
    if hup is not None and signal.getsignal(hup) is not signal.SIG_IGN:
        old[hup] = signal.signal(hup, _interrupted)
    usr1 = getattr(signal, "SIGUSR1", None)
    restore_usr1 = lifeline_mod.forward_signal(usr1, procs) if usr1 else (lambda: None)

    def restore() -> None:
        for signum, handler in old.items():
            signal.signal(signum, handler)
        restore_usr1()
    return restore


#: the hook an uncaught error not from :func:`launch` goes to (see :func:`_mark_for_the_user`)
_previous_excepthook: Callable[..., Any] = sys.excepthook


def _mark_for_the_user(err: BaseException) -> None:
    """An error leaving :func:`launch` uncaught is shown pipekernel's message first: its
    own text (the failing rank's error and traceback are in it), then where ``launch`` was
    called, without the launcher's internal frames Python would print before it. Other
    errors go to the hook there was (installed once, only when such an error leaves)."""
    global _previous_excepthook
    try:
        err._pk_launch = True  # type: ignore[attr-defined]
    except AttributeError:
        return
    if sys.excepthook is not _show_launch_error:
        _previous_excepthook, sys.excepthook = sys.excepthook, _show_launch_error


def _show_launch_error(kind: type, value: BaseException, tb: Any) -> None:
    if not getattr(value, "_pk_launch", False):
        _previous_excepthook(kind, value, tb)
        return
    where = _frames(tb).rstrip().replace("\n", "\n  ")
    text = f"{kind.__module__}.{kind.__qualname__}: {value}"
    if where:
        text += f"\n  raised by pk.launch, called from (most recent call last):\n  {where}"
    print(text, file=sys.stderr, flush=True)


def _launched_world(nprocs: int) -> World | None:
    """The world another launcher started this process in (:mod:`pipekernel.launcher.clusters`:
    a process group, torchrun, a SLURM step, Ray Train, Kubeflow), ``None`` when ``launch``
    should start its own processes."""
    world = clusters.detect()
    if world is None or world.launcher == "pk.launch":  # a job of its own, as always
        return None
    if world.launcher == "process group" and world.world_size == 1 and nprocs != 1:
        return None  # a one-process group (a notebook, a test): the job is started here
    if world.world_size == nprocs:
        return world
    how = {"torchrun": f"start torchrun with {nprocs} processes in all (e.g. torchrun "
                       f"--nproc-per-node {nprocs} script.py)",
           "slurm": f"start the step with {nprocs} tasks in all (e.g. srun --ntasks {nprocs} "
                    f"python script.py, one task per GPU)",
           }.get(world.launcher, f"start {nprocs} processes in all")
    where = {"torchrun": "a torchrun world", "slurm": "a SLURM step",
             "process group": "an initialised process group"}.get(world.launcher,
                                                                   "a world a launcher made")
    raise ConfigError(
        f"pk.launch(fn, nprocs={nprocs}) runs inside {where} of WORLD_SIZE={world.world_size} "
        f"(this is RANK={world.rank}): it would start {nprocs} more processes per rank",
        hint=f"{how}, or pass nprocs={world.world_size}; pk.launch then runs fn on each "
             f"{'torchrun ' if world.launcher == 'torchrun' else ''}rank")


def _join(fn: Callable, args: Sequence[Any], world: World, nprocs: int,
          threads: int | None) -> list[Any]:
    """Run ``fn`` here as ``world.rank``, with the torchrun variables that world implies
    (a SLURM task gets ``RANK``, ``MASTER_ADDR``, ...) so the engine's transport joins it."""
    clusters.export()
    if threads:
        import torch
        torch.set_num_threads(threads)
    results: list[Any] = [None] * nprocs
    results[world.rank] = fn(*args)
    return results


def _stop_workers(procs: list[Any], results: Any, interrupt: BaseException) -> LaunchInterrupted:
    """SIGTERM every worker, collect what they report for a few seconds; the error to
    raise names the first rank that failed other than by the interruption. A second
    Ctrl-C meanwhile kills the workers at once and still ends with that summary."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    first = None
    deadline = time.monotonic() + 5.0
    try:  # the announcement inside: a second Ctrl-C can land as soon as its line is out
        print(f"pipekernel: stopping {len(procs)} workers (Ctrl-C again to kill them at once)",
              file=sys.stderr, flush=True)
        while time.monotonic() < deadline and (any(p.is_alive() for p in procs)
                                               or not results.empty()):
            try:
                rank, ok, value, tb = results.get(timeout=0.1)
            except queue.Empty:
                continue
            if not ok and first is None and not _is_interrupt(value, tb):
                first = (rank, value, tb)
    except KeyboardInterrupt:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        interrupt = KeyboardInterrupt(f"{str(interrupt) or 'interrupted (Ctrl-C)'}, then killed "
                                      "by a second Ctrl-C")
    why = str(interrupt) or "interrupted (Ctrl-C)"
    stopped = [r for r in range(len(procs))]
    if first is None:
        return LaunchInterrupted(f"launch {why}: stopped ranks {stopped}; no rank had failed")
    rank, value, tb = first
    return LaunchInterrupted(f"launch {why}: stopped ranks {stopped}; rank {rank} failed "
                             f"first:\n{tb}", rank=rank,
                             original=value if isinstance(value, BaseException) else None)


def _is_interrupt(value: Any, tb: str | None) -> bool:
    last = (tb or "").strip().splitlines()[-1:]
    return isinstance(value, KeyboardInterrupt) or bool(last and
                                                       last[0].startswith("KeyboardInterrupt"))


def _root_cause(rank: int, value: Any, tb: str, results: Any) -> tuple[int, Any, str]:
    """A rank that stopped because another failed first (``PeerAbort``): wait a moment
    for the failing rank's own report, which names the cause and has its traceback."""
    culprit = getattr(value, "rank", None)
    if type(value).__name__ != "PeerAbort" or culprit is None or culprit == rank:
        return rank, value, tb
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        try:
            r, ok, v, t = results.get(timeout=0.1)
        except queue.Empty:
            continue
        if r == culprit and not ok:
            return r, v, t
    return rank, value, tb


def _format_traceback(err: BaseException) -> str:
    """The worker's traceback as Python prints it (causes first), each exception's
    message :func:`~pipekernel.errors.shorten`-ed: a backend's 40-line text as a few."""
    chain: list[BaseException] = []
    current: BaseException | None = err
    while current is not None and all(current is not seen for seen in chain):
        chain.append(current)
        current = current.__cause__ or (None if current.__suppress_context__
                                        else current.__context__)
    parts = [f"Traceback (most recent call last):\n{_frames(e.__traceback__)}{_last_line(e)}"
             for e in reversed(chain)]
    return "\n\nThe above exception led to the following exception:\n\n".join(parts)


def _frames(tb: Any) -> str:
    """A traceback's frames without this module's (the worker's own frame says nothing)."""
    here = os.path.abspath(__file__)
    return "".join(traceback.format_list(
        [f for f in traceback.extract_tb(tb) if os.path.abspath(f.filename) != here]))


def _last_line(err: BaseException) -> str:
    """A traceback's last line: the error's type and (shortened) message."""
    return f"{type(err).__name__}: {shorten(str(err), lines=3, width=300)}"


def _failure_text(rank: int, value: Any, tb: str | None) -> str:
    """``rank R failed: <its error in pipekernel's words>``, then its traceback: the
    first line says what failed and where, the backend's text (if any) comes after."""
    if isinstance(value, PipelineError):
        headline = str(value)
        last = _last_line(value)
        if tb and tb.endswith(last):  # said once, in the headline
            tb = tb[:-len(last)] + f"{type(value).__name__} (the message above)"
    elif isinstance(value, BaseException):
        headline = f"{type(value).__name__}: {shorten(str(value))}"
    else:  # an exception that could not be pickled: its traceback's last line
        headline = (tb or "").strip().splitlines()[-1] if tb else "no report"
    trace = ("\n" + (tb or "")).replace("\n", "\n    ")
    return f"rank {rank} failed: {headline}\n  traceback of rank {rank}:{trace}"


def _collect(procs: list[Any], results: Any, nprocs: int, timeout: float | None) -> list[Any]:
    values: dict[int, Any] = {}
    deadline = None if timeout is None else _clock() + timeout
    while len(values) < nprocs:
        try:
            rank, ok, value, tb = results.get(timeout=0.2)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs)
                    if r not in values and not p.is_alive() and p.exitcode not in (None, 0)]
            if dead:
                raise RankError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode} "
                                "without reporting a result",
                                rank=dead[0], hint="it was probably killed (out of memory?)")
            if deadline is not None and _clock() > deadline:
                waiting = sorted(set(range(nprocs)) - set(values))
                raise RankError(f"the launch deadline passed: timed out after {timeout:g}s "
                                f"waiting for ranks {waiting} (pk.launch(timeout={timeout:g}) "
                                "is a deadline on the whole run, not a sign of a hang)",
                                hint="raise timeout= or pass timeout=None (no deadline; a "
                                     "hang still ends in the engine's own timeout= on every "
                                     "wait)") from None
            continue
        if not ok:
            rank, value, tb = _root_cause(rank, value, tb, results)
            raise RankError(_failure_text(rank, value, tb), original=value, rank=rank) from None
        values[rank] = pickle.loads(value)
    return [values[r] for r in range(nprocs)]
