"""Start local worker processes for the embedded default (CPU, gloo).

``launch(fn, nprocs)`` runs ``fn(*args)`` in ``nprocs`` fresh processes with the
torchrun environment set (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT`` on a free port), returns each rank's return
value, re-raises the first failure with its rank and traceback, and kills every
process when one fails or the timeout passes — so nothing hangs.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from pipekernel.errors import PipelineError

__all__ = ["launch", "RankError", "free_port"]

#: Seconds a worker that already returned its result gets to exit on its own.
_EXIT_GRACE = 10.0


class RankError(PipelineError):
    """A worker process failed; ``original`` is its exception (when picklable)."""

    def __init__(self, message: str, *, original: BaseException | None = None, **kw: Any):
        super().__init__(message, **kw)
        self.original = original


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn: Callable, args: Sequence[Any], rank: int, env: dict[str, str],
            results: Any, threads: int | None) -> None:
    os.environ.update(env)
    try:
        if threads:
            import torch
            torch.set_num_threads(threads)
        # plain pickle: tensors travel by value, not as shared memory the worker must outlive
        results.put((rank, True, pickle.dumps(fn(*args)), None))
    except BaseException as err:  # report everything, including SystemExit
        tb = traceback.format_exc()
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
           timeout: float = 600.0, threads: int | None = 1,
           env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(*args)`` on ``nprocs`` local processes; return their results by rank.

    :param fn: a picklable (module-level) function.
    :param timeout: seconds before every process is killed and an error raised.
    :param threads: ``torch.set_num_threads`` in each worker (``None`` leaves it).
    :raises RankError: naming the first rank that failed, with its traceback.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = str(free_port())
    procs = []
    for rank in range(nprocs):
        rank_env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nprocs),
                    "LOCAL_WORLD_SIZE": str(nprocs), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": port, **(env or {})}
        proc = ctx.Process(target=_worker, args=(fn, args, rank, rank_env, results, threads),
                           daemon=True)
        proc.start()
        procs.append(proc)
    finished = False
    try:
        values = _collect(procs, results, nprocs, timeout)
        finished = True
        return values
    finally:
        for proc in procs:
            if finished:  # let workers finish their clean-up: a kill there leaks the queue's lock
                proc.join(timeout=_EXIT_GRACE)
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)


def _collect(procs: list[Any], results: Any, nprocs: int, timeout: float) -> list[Any]:
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
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
            if time.monotonic() > deadline:
                waiting = sorted(set(range(nprocs)) - set(values))
                raise RankError(f"timed out after {timeout:g}s waiting for ranks {waiting}",
                                hint="a rank hangs or is slow; raise timeout= or look for a "
                                     "collective that not every rank calls") from None
            continue
        if not ok:
            raise RankError(f"rank {rank} failed:\n{tb}", original=value, rank=rank) from value
        values[rank] = pickle.loads(value)
    return [values[r] for r in range(nprocs)]
