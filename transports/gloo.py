"""The gloo transport: CPU tensors over ``torch.distributed`` with the gloo backend.

Point-to-point transfers carry a byte view of the tensor, so every dtype
(bool, bfloat16, complex, ...) round-trips bit-exactly whatever gloo supports
natively. Waits use ``Work.wait(timeout)`` and become ``TransportTimeout``
naming the peer.

``group=`` makes the transport span a process group the host created instead
of the whole world: its ranks are then the group's ranks (0 .. size-1) and the
transport translates them to global ranks, so a pipeline can live on any
subset of a larger job.
"""
from __future__ import annotations

import atexit
import datetime
import os
import queue
import threading
from _thread import allocate_lock as _allocate_lock
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from pipekernel.errors import (ConfigError, PeerAbort, TransportError, TransportTimeout,
                               shorten)
from pipekernel.comm import TORCH_REDUCE_OPS as _OPS
from pipekernel.comm import Handle, attempt, bind_defaults_before_init, keyed_store, wait_sliced

__all__ = ["TorchDistributedTransport", "GlooTransport"]

_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class _Handle:
    __slots__ = ("_work", "_transport", "_peer", "_what", "_done")

    def __init__(self, work: Any, transport: TorchDistributedTransport, peer: int | None,
                 what: str):
        self._work, self._transport, self._peer, self._what = work, transport, peer, what
        self._done = False

    def is_completed(self) -> bool:
        return self._done or self._work.is_completed()

    def wait(self) -> None:
        """Wait for the work, at most ``timeout`` seconds, checking ``abort_check`` about
        every ``abort_interval`` seconds while blocked: the blocking gloo wait runs on
        the transport's waiter thread (see :func:`pipekernel.comm.transport.wait_sliced`)."""
        if self._done:
            return
        transport = self._transport
        timeout, rank = transport.timeout, transport.rank
        if self._work.is_completed():
            error = None
            try:
                self._work.wait()
            except RuntimeError as err:
                error = err
        else:
            box = transport._waiter().submit(self._work, timeout)
            # the first slice inline: most waits end within it, without wait_sliced's loop
            finished = box.lock.acquire(True, transport.abort_interval)
            if not finished:
                try:
                    # the waiter's gloo wait is bounded by ``timeout``; the slack only
                    # guards against a waiter that never reports
                    finished = wait_sliced(box.wait, timeout + 30.0,
                                           getattr(transport, "abort_check", None),
                                           getattr(transport, "abort_interval", 0.5))
                except PeerAbort as err:
                    err.add_detail(f"rank {rank} was waiting to {self._what} "
                                   f"{self._describe()}")
                    raise
            error = box.error if finished else RuntimeError("Timed out (the waiter thread "
                                                            "never reported)")
        if error is not None:
            self._raise(error)
        self._done = True

    def _describe(self) -> str:
        """The peer in words (error paths only: built when needed, not per wait)."""
        if self._peer is None:
            return "its group"
        return self._transport.describe(self._peer)

    def _raise(self, error: BaseException) -> None:
        transport, peer = self._transport, self._describe()
        timeout, rank = transport.timeout, transport.rank
        check = getattr(transport, "abort_check", None)
        if check is not None:  # a closed connection or a timeout is usually a symptom:
            try:               # report the failure another rank published, if any
                check()
            except PeerAbort as err:
                err.add_detail(f"rank {rank} was waiting to {self._what} {peer} "
                               f"({type(error).__name__}: {shorten(str(error), 1)})")
                raise err from None  # the cause first, not the backend's words
        text = str(error)
        if "imed out" in text or "timeout" in text.lower():
            raise TransportTimeout(
                f"rank {rank} waited {timeout:g}s to {self._what} {peer} "
                f"and gave up", peer=self._peer, rank=rank,
                hint=f"check that rank {self._peer} is alive and runs the same schedule; "
                     f"raise timeout= if it is just slow" if self._peer is not None else
                     "check that every member of the group is alive and calls the same "
                     "collectives in the same order; raise timeout= if one is just "
                     "slow").add_cause(error, transport.backend) from None
        died = "closed" in text or "reset" in text.lower()
        raise TransportError(
            f"rank {rank} failed to {self._what} {peer}"
            + (" (its connection closed)" if died else ""), rank=rank, peer=self._peer,
            hint=(f"{peer}'s connection closed: it probably died or failed first; look "
                  f"at its log" if died and self._peer is not None else
                  f"look at the log of {peer}: it probably failed first")
        ).add_cause(error, transport.backend) from None


class _Box:
    """One wait handed to the waiter thread: ``lock`` is taken when the box is made and
    released by the waiter once the gloo wait returned (``error`` set first if it
    raised). A bare lock, not a ``threading.Event``: the Event's Condition builds and
    takes three locks in Python per wait, on the path every transfer goes through."""

    __slots__ = ("lock", "error")

    def __init__(self) -> None:
        self.lock, self.error = _allocate_lock(), None
        self.lock.acquire()

    def wait(self, seconds: float) -> bool:
        """Block at most ``seconds``; ``True`` once the waiter has reported. Signal
        handlers run while blocked (a timed lock acquire is interruptible)."""
        if self.lock.acquire(True, seconds):
            self.lock.release()  # later calls see it finished too
            return True
        return False


class _Waiter:
    """One daemon thread that runs the blocking gloo waits of a transport, one after the
    other, so that the caller can wait for an event in slices (and abort between them)."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, daemon=True, name=name)
        self.thread.start()

    def submit(self, work: Any, timeout: float) -> _Box:
        box = _Box()
        self._queue.put((work, timeout, box))
        return box

    def stop(self, join: float = 5.0) -> None:
        self._queue.put(None)
        self.thread.join(join)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            work, timeout, box = item
            try:
                work.wait(datetime.timedelta(seconds=timeout))
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                box.error = err
            box.lock.release()
            del work, item, box


class TorchDistributedTransport:
    """A ``Transport`` on ``torch.distributed`` (see :mod:`pipekernel.comm.transport`).

    Uses the default process group if one exists; otherwise initialises it from
    the torchrun environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``) and destroys it on ``close()``.

    :param timeout: seconds for every wait (point-to-point and collectives).
    :param group: a process group (from ``torch.distributed.new_group``) to span
        instead of the whole world; ``rank``/``world_size`` are then this
        process's rank in the group and the group's size. Only members create
        the transport.
    """

    backend = "gloo"

    def __init__(self, timeout: float = 300.0, group: Any = None, **options: Any) -> None:
        if options:
            raise ConfigError(f"unknown {self.backend} transport options: {sorted(options)}",
                              hint="supported options: timeout, group")
        self.timeout = float(timeout)
        #: see pipekernel.comm.transport (optional members): set by the engine
        self.abort_check: Any = None
        self.abort_interval = 0.5
        self._waiter_thread: _Waiter | None = None
        self.group = group
        self._groups: dict[tuple[int, ...], Any] = {}
        self._made: list[Any] = []  # every new_group's group, destroyed by close()
        # group -> collective -> its words; weak, so that a group destroyed elsewhere (a
        # closed engine's mesh) is freed and gloo joins its threads
        self._texts: weakref.WeakKeyDictionary[Any, dict[str, str]] = \
            weakref.WeakKeyDictionary()
        self._world_texts: dict[str, str] = {}
        self._owns_group = not dist.is_initialized()
        if group is not None and self._owns_group:
            raise ConfigError("transport option group= needs an initialised process group",
                              hint="call torch.distributed.init_process_group() and "
                                   "new_group() before creating the engine")
        if self._owns_group:
            missing = [name for name in _ENV if name not in os.environ]
            if missing:
                raise ConfigError(
                    f"no process group exists and the environment lacks {', '.join(missing)}",
                    hint="start the processes with torchrun or pipekernel.launcher.launch(), or "
                         "call "
                         "torch.distributed.init_process_group() before creating the engine")
            bind_defaults_before_init()
            _init_process_group(self.backend, datetime.timedelta(seconds=self._group_timeout()),
                                self._init_options())
            _OWNED.add(self)
        else:  # the host's group: joined at exit unless the host destroys it first
            _HOST_GROUP_USED[0] = True
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        if self.rank < 0:
            raise ConfigError(f"global rank {dist.get_rank()} is not a member of the group "
                              f"{dist.get_process_group_ranks(group)} given as group=",
                              hint="create the engine only on the ranks of its group")
        # group rank -> global rank (torch.distributed's p2p and src arguments are global)
        self._global = dist.get_process_group_ranks(group) if group is not None else None
        self.device = self._device()

    def _waiter(self) -> _Waiter:
        if self._waiter_thread is None:
            self._waiter_thread = _Waiter(f"pipekernel-wait-rank{self.rank}")
            _WAITERS.add(self._waiter_thread)
        return self._waiter_thread

    def global_rank(self, rank: int) -> int:
        """The global rank of this transport's ``rank`` (identity without ``group=``)."""
        return self._global[rank] if self._global is not None else rank

    def describe(self, rank: int) -> str:
        """``"rank R"``, plus the global rank when the transport spans a subgroup."""
        if self._global is None:
            return f"rank {rank}"
        return f"rank {rank} (global rank {self.global_rank(rank)})"

    def _init_options(self) -> dict[str, Any]:
        return {}

    def _group_timeout(self) -> float:
        """Seconds given to the process groups this transport creates."""
        return self.timeout

    def _device(self) -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def _bytes(tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_contiguous():
            raise TransportError("point-to-point tensors must be contiguous",
                                 hint="call .contiguous() before sending")
        return tensor.reshape(-1).view(torch.uint8) if tensor.dim() else \
            tensor.reshape(1).view(torch.uint8)

    #: gloo matches point-to-point messages by (pair, tag): any tag is a lane.
    max_tags = 1 << 16

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Handle:
        work = self._post(dist.isend, tensor, dst, "send to", tag)
        return _Handle(work, self, dst, "send to")

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Handle:
        work = self._post(dist.irecv, tensor, src, "receive from", tag)
        return _Handle(work, self, src, "receive from")

    def batch_isend_irecv(self, ops: Sequence[Any]) -> list[Handle]:
        """Post every op in order. gloo's isend/irecv never block the poster and progress
        in gloo's own threads, so ops posted one after the other progress together as
        a group does: a send and a receive to the same peer complete in either order."""
        handles = []
        for op in ops:
            if op.op == "send":
                handles.append(self.isend(op.tensor, op.peer, op.tag))
            elif op.op == "recv":
                handles.append(self.irecv(op.tensor, op.peer, op.tag))
            else:
                raise ConfigError(f"P2POp.op must be 'send' or 'recv', got {op.op!r}",
                                  hint="build each P2POp with op='send' or op='recv'")
        return handles

    def _post(self, fn, tensor: torch.Tensor, peer: int, what: str, tag: int = 0) -> Any:
        try:
            return fn(self._bytes(tensor), self.global_rank(peer), group=self.group, tag=tag)
        except RuntimeError as err:  # e.g. the peer's connection closed: name the peer
            raise TransportError(f"rank {self.rank} failed to {what} rank {peer}",
                                 rank=self.rank, hint=f"look at rank {peer}'s log: it "
                                                      "probably failed first"
                                 ).add_cause(err, self.backend) from None

    def _collective(self, what: str, group: Any, fn, *args, **kwargs) -> _Handle:
        """Start a collective; its handle waits like a transfer (bounded, abort-aware)."""
        group = self.group if group is None else group
        try:
            work = fn(*args, group=group, async_op=True, **kwargs)
        except RuntimeError as err:
            ranks = dist.get_process_group_ranks(group) if group is not None else "all ranks"
            raise TransportError(f"{what} over {ranks} failed on rank {self.rank}",
                                 rank=self.rank, hint="a peer in the group probably failed or "
                                 "timed out first; look at its log"
                                 ).add_cause(err, self.backend) from None
        return _Handle(work, self, None, self._finish_text(what, group))

    def _finish_text(self, what: str, group: Any) -> str:
        """How a wait for a collective names it (once per kind and group, not per call)."""
        texts = self._world_texts if group is None else self._texts.setdefault(group, {})
        text = texts.get(what)
        if text is None:
            ranks = dist.get_process_group_ranks(group) if group is not None else None
            text = texts[what] = (f"finish a {what} over ranks {ranks} with"
                                       if ranks is not None else f"finish a {what} with")
        return text

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", group: Any = None) -> None:
        self._collective("all_reduce", group, dist.all_reduce, tensor, op=_OPS[op]).wait()

    def iall_reduce(self, tensor: torch.Tensor, op: str = "sum", group: Any = None) -> Handle:
        return self._collective("all_reduce", group, dist.all_reduce, tensor, op=_OPS[op])

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor, group: Any = None) -> None:
        """Optional member: every member's ``tensor`` into ``out`` (shape
        ``(group size, *tensor.shape)``), in group-rank order; blocking."""
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        # flat views: gloo checks each chunk of ``out`` against the input's shape
        self._collective("all_gather", group, gather, out.view(-1),
                         tensor.contiguous().view(-1)).wait()

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any = None) -> None:
        self._collective("broadcast", group, dist.broadcast, tensor,
                         self.global_rank(src)).wait()

    def barrier(self, group: Any = None) -> None:
        self._collective("barrier", group, dist.barrier).wait()

    @property
    def store(self) -> Any:
        """The process group's key-value store (shared by every rank of the job), or
        ``None`` (see :mod:`pipekernel.comm.transport`, optional members)."""
        try:
            from torch.distributed import distributed_c10d
            return distributed_c10d._get_default_store() if dist.is_initialized() else None
        except Exception:
            return None

    def new_group(self, ranks: Sequence[int]) -> Any:
        ranks = sorted(ranks)
        if len(ranks) == self.world_size:
            return None  # the world itself
        timeout = datetime.timedelta(seconds=self._group_timeout())
        if self._global is None:
            group = dist.new_group(ranks, timeout=timeout)
            self._made.append(group)
            return group
        # Ranks outside self.group never call this, so synchronise among members only;
        # torch names such groups after their ranks, hence one group per rank set.
        key = tuple(self.global_rank(r) for r in ranks)
        if key not in self._groups:
            self._groups[key] = dist.new_group(list(key), timeout=timeout,
                                               use_local_synchronization=True)
            self._made.append(self._groups[key])
        return self._groups[key]

    def close(self) -> None:
        """Destroy the process group this transport created; over a group the host
        created, destroy only the groups ``new_group`` made (the host's stay). Freeing the group joins gloo's worker
        threads: none may be left to touch Python objects while the interpreter exits.
        """
        _OWNED.discard(self)
        made, self._made, self._groups = self._made, [], {}
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False
        else:  # the host's world: destroy only the groups new_group made (tied, EP, ...)
            registered = dist.distributed_c10d._world.pg_map
            for group in made:
                if dist.is_initialized() and group in registered:
                    dist.destroy_process_group(group)
        if self._waiter_thread is not None:  # its gloo wait (if any) ended with the group
            self._waiter_thread.stop()
            self._waiter_thread = None


def _rendezvous(timeout: datetime.timedelta) -> dict[str, Any]:
    """How the process group this transport creates meets: ``init_process_group``'s
    arguments beyond the backend.

    * under ``pk.launch``: a file store (no TCP port), one per group (:func:`_fresh_store`);
    * under torchelastic (torchrun): torch's ``env://`` store seen through this attempt's
      prefix (:func:`pipekernel.comm.attempt.keyed_store`), so that a restarted world never
      reads the gloo addresses a dead attempt left in the agent's store; every
      ``new_group`` (lanes, control lane) keys under it too;
    * otherwise: torch's ``env://`` default.
    """
    if os.environ.get("PIPEKERNEL_INIT_METHOD"):
        return {"init_method": _fresh_store(os.environ["PIPEKERNEL_INIT_METHOD"]),
                "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}
    if attempt() is None:
        return {}
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    return {"store": keyed_store(store), "rank": rank, "world_size": world_size}


_GENERATION = [0]


def _fresh_store(init_method: str) -> str:
    """The file store of this process's next process group under ``pk.launch``.

    A destroyed group's keys (gloo's addresses among them) stay in its store file until
    every rank has let go of it, so a second group on the same file would let a rank that
    starts early read them and time out connecting. Each group gets a file of its own:
    the n-th group any rank creates uses ``store``, ``store.1``, ... ``store.n-1``, which
    holds because ranks create and destroy their engines' groups in the same order (as
    they must: creating a group is collective).
    """
    n = _GENERATION[0]
    _GENERATION[0] += 1
    return init_method if n == 0 else f"{init_method}.{n}"


# Transports whose process group is not destroyed yet. A process that never closed its
# engine still frees the group (and joins gloo's threads) before the interpreter
# finalizes: atexit hooks run while it is fully alive. Destroying is local, no collective.
_OWNED: set[TorchDistributedTransport] = set()

_WAITERS: weakref.WeakSet[_Waiter] = weakref.WeakSet()

#: a transport ran over a default group the host made (``init_process_group`` before the
#: engine: a DeepSpeed-style script, Lightning, a host's own loop)
_HOST_GROUP_USED = [False]


@atexit.register
def _close_at_exit() -> None:
    """The orderly end: no gloo thread may outlive the interpreter's last Python moment.

    A gloo worker thread that drops a collective's last reference to a tensor needs the
    GIL; while the interpreter finalizes, taking it ends the thread with ``pthread_exit``,
    whose unwinding through C++ frames aborts the process ("terminate called without an
    active exception", seen once in twelve 2-process runs of a DeepSpeed-style script on
    a loaded machine). So before finalization: close the transports' own groups, destroy
    a host's gloo default group that an engine ran over and nobody destroyed (the host is
    past its last line; its later atexit hooks run before this one), then end the waiter
    threads (a wait still pending on a destroyed group returns now, in Python's time).
    """
    for transport in list(_OWNED):
        try:
            transport.close()
        except Exception:
            pass
    if _HOST_GROUP_USED[0]:
        _destroy_host_group()
    for waiter in list(_WAITERS):
        try:
            waiter.stop(join=1.0)
        except Exception:
            pass


def _destroy_host_group() -> None:
    """Destroy the default group at exit if it is still there and gloo only: NCCL's
    communicators have their own teardown, and destroying one may wait on the device."""
    try:
        if dist.is_initialized() and str(dist.get_backend()) == "gloo":
            dist.destroy_process_group()
    except Exception:
        pass


def _init_process_group(backend: str, timeout: datetime.timedelta,
                        options: dict[str, Any]) -> None:
    """``init_process_group`` with this process's rendezvous; a failure (a peer that never
    came, an address nobody listens on) raises pipekernel's error first, the backend's
    text after it, shortened."""
    try:
        dist.init_process_group(backend, timeout=timeout, **_rendezvous(timeout), **options)
        if backend == "gloo":
            # gloo connects every pair inside init, and a rank returns once its own pairs
            # are up: one that then fails fast (a ConfigError every rank raises) and exits
            # would close a socket a slower peer is still connecting ("connectFullMesh
            # failed ... Connection closed by peer"). Nobody leaves before all connected.
            dist.barrier()
    except (RuntimeError, ValueError) as err:  # DistBackendError, DistStoreError, ...
        env = os.environ
        where = f"{env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')}" \
            if not env.get("PIPEKERNEL_INIT_METHOD") else "its pk.launch store"
        raise TransportError(
            f"rank {env.get('RANK')} of {env.get('WORLD_SIZE')} could not start the {backend} "
            f"process group (rendezvous at {where}, timeout {timeout.total_seconds():g}s)",
            rank=int(env["RANK"]) if env.get("RANK", "").isdigit() else None,
            hint="check that every rank started, that each reaches MASTER_ADDR:MASTER_PORT, "
                 "and that GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME) names an interface the "
                 "ranks share (e.g. lo on one machine); a rank that failed earlier shows "
                 "why in its own log").add_cause(err, backend) from None






class GlooTransport(TorchDistributedTransport):
    """CPU transport over gloo: the embedded default."""

    backend = "gloo"
