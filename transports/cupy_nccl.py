"""The cupy-nccl transport: torch CUDA tensors over CuPy's NCCL bindings.

Select it with ``transport="cupy-nccl"`` after ``pip install "pipekernel[cupy]"``
(CuPy's CUDA 12 wheel). Importing pipekernel, listing transports or choosing
another one never imports CuPy: this module imports it only when the transport
is built, and without CuPy (or without a GPU) that raises a
:class:`~pipekernel.errors.ConfigError` saying what is missing.

How it works, and what a caller may rely on:

* **Rendezvous**: none of its own. The host side is a gloo transport over the
  same ranks (it initialises the default process group from the torchrun
  environment when none exists): the wire's control lane, ``store``,
  ``abort_check``. Each NCCL communicator's unique id is made by the lowest
  member, written to that process group's store (TCPStore under torchrun, a
  FileStore under :func:`pipekernel.launcher.launch`) and read by the other members
  (:func:`exchange_unique_id`).
* **Communicators**: one per lane (tag) over the whole world for point to
  point, one for the world's collectives, one per subgroup from
  :meth:`new_group`. NCCL runs a communicator's operations in order, so lanes
  never wait for one another and a collective never queues behind a posted
  receive.
* **Zero copy**: a tensor's ``data_ptr()`` is handed to NCCL; point to point
  carries it as bytes (``NCCL_UINT8``), so every dtype, bool included, crosses
  bit-exactly. Collectives use :func:`nccl_dtype`.
* **Streams**: a lane's operations run on that lane's own stream (a torch
  ``Stream``, passed by its handle as ``cupy.cuda.ExternalStream`` would), ordered
  after torch's current stream with a CUDA event, so a receive posted ahead
  never holds up compute; each posting group is one
  ``groupStart()``/``groupEnd()``. Buffers are marked used by that stream
  (``record_stream``) so the caching allocator does not reuse them early.
* **Handles** are CUDA events recorded on the operation's stream after it;
  ``wait()`` makes the current stream wait for the event (no host block) and
  hands it to a :class:`~pipekernel.transports.device_watch.DeviceWatch`, which
  turns one that never completes into ``TransportTimeout`` naming the peer and
  aborts the communicators (CuPy's NCCL has no watchdog of its own).
"""
from __future__ import annotations

import hashlib
import importlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pipekernel.errors import ConfigError, TransportError
from pipekernel.comm import P2POp, attempt_prefix
from pipekernel.transports.connections import check_max_connections
from pipekernel.transports.device_watch import DeviceWatch, Watched, end_process
from pipekernel.transports.gloo import TorchDistributedTransport
from pipekernel.transports.lanes import split_by_lane

__all__ = ["CupyNcclTransport", "INSTALL", "nccl_dtype", "NCCL_TYPES", "encode_unique_id",
           "decode_unique_id", "exchange_unique_id", "make_communicator", "load_cupy_nccl"]

#: The exact line that installs what this transport needs.
INSTALL = 'pip install "pipekernel[cupy]"'

#: NCCL's ``ncclDataType_t`` values (stable ABI); CuPy's ``NCCL_*`` constants are the
#: same numbers, and older CuPy lacks ``NCCL_BFLOAT16``.
NCCL_TYPES = {"NCCL_INT8": 0, "NCCL_UINT8": 1, "NCCL_INT32": 2, "NCCL_UINT32": 3,
              "NCCL_INT64": 4, "NCCL_UINT64": 5, "NCCL_FLOAT16": 6, "NCCL_FLOAT32": 7,
              "NCCL_FLOAT64": 8, "NCCL_BFLOAT16": 9}
#: ``ncclRedOp_t`` values of the reductions the Transport protocol asks for.
NCCL_OPS = {"sum": 0, "max": 2, "min": 3}

# torch dtype -> (NCCL type name, elements per tensor element)
_DTYPES: dict[torch.dtype, tuple[str, int]] = {
    torch.bool: ("NCCL_UINT8", 1), torch.uint8: ("NCCL_UINT8", 1), torch.int8: ("NCCL_INT8", 1),
    torch.int32: ("NCCL_INT32", 1), torch.int64: ("NCCL_INT64", 1),
    torch.float16: ("NCCL_FLOAT16", 1), torch.bfloat16: ("NCCL_BFLOAT16", 1),
    torch.float32: ("NCCL_FLOAT32", 1), torch.float64: ("NCCL_FLOAT64", 1),
    # complex as (real, imag) pairs: right for sum, meaningless for max/min
    torch.complex64: ("NCCL_FLOAT32", 2), torch.complex128: ("NCCL_FLOAT64", 2),
}


def nccl_dtype(dtype: torch.dtype, op: str | None = None, nccl: Any = None) -> tuple[int, int]:
    """``(ncclDataType_t, elements per tensor element)`` for a collective on ``dtype``.

    bool travels as ``uint8`` (``max``/``min`` are logical or/and; ``sum`` counts);
    complex as pairs of floats, for ``sum`` (and ``op=None``: broadcast) only;
    bfloat16 is ``NCCL_BFLOAT16`` (9) whether or not CuPy names it. ``nccl``: the
    CuPy module whose constants to prefer. Raises ``TransportError`` for a dtype
    NCCL cannot reduce (int16, uint16, ...).
    """
    entry = _DTYPES.get(dtype)
    if entry is None or (entry[1] == 2 and op not in (None, "sum")):
        raise TransportError(f"NCCL cannot {op or 'broadcast'} {dtype} tensors",
                             hint="reduce int16/uint16 as int32, complex with 'sum' only "
                                  "(point-to-point carries every dtype)")
    name, factor = entry
    code = NCCL_TYPES[name] if nccl is None else int(getattr(nccl, name, NCCL_TYPES[name]))
    return code, factor


def encode_unique_id(uid: Sequence[int] | bytes) -> bytes:
    """CuPy's unique id as bytes for a store: CuPy 14 makes it ``bytes`` already, older
    releases a tuple of signed chars."""
    return bytes(b & 0xFF for b in uid)


def decode_unique_id(data: bytes) -> tuple[int, ...]:
    """Inverse of :func:`encode_unique_id`: the tuple ``NcclCommunicator`` takes."""
    return tuple(b - 256 if b > 127 else b for b in data)


def exchange_unique_id(store: Any, key: str, is_root: bool,
                       make_id: Callable[[], Sequence[int] | bytes]) -> bytes:
    """The unique id of one communicator, agreed through ``store``, as bytes.

    The root (the lowest member) calls ``make_id()`` and writes it under ``key``;
    every other member blocks in ``store.get(key)`` (bounded by the store's own
    timeout) until it is there. All members call this with the same ``key``.
    """
    if is_root:
        data = encode_unique_id(make_id())
        store.set(key, data)
        return data
    return bytes(store.get(key))


def make_communicator(nccl: Any, size: int, uid: bytes, rank: int) -> Any:
    """``nccl.NcclCommunicator`` for the id :func:`exchange_unique_id` agreed on, in the
    form the installed CuPy takes: ``bytes`` from CuPy 14 on (a tuple there is a
    ``TypeError``, seen on an H200 with cupy-cuda13x 14.2), a tuple of signed chars
    before. The type is checked before NCCL is called, so the retry starts nothing twice."""
    try:
        return nccl.NcclCommunicator(size, uid, rank)
    except TypeError:
        return nccl.NcclCommunicator(size, decode_unique_id(uid), rank)


def load_cupy_nccl() -> Any:
    """``cupy.cuda.nccl``, or ``ConfigError`` saying what is missing and how to install it."""
    try:
        importlib.import_module("cupy")
        nccl = importlib.import_module("cupy.cuda.nccl")
    except ImportError as err:
        raise ConfigError(f"transport 'cupy-nccl' needs CuPy with NCCL, and importing it failed "
                          f"({err})",
                          hint=f"install it with: {INSTALL}   (CuPy's CUDA 12 wheel, "
                               "cupy-cuda12x); or use transport='nccl'") from err
    if not getattr(nccl, "available", True):
        raise ConfigError("transport 'cupy-nccl': CuPy is installed but its NCCL library is "
                          "not available", hint=f"reinstall with: {INSTALL}")
    if not torch.cuda.is_available():
        raise ConfigError("transport 'cupy-nccl' needs a CUDA GPU, and "
                          "torch.cuda.is_available() is False",
                          hint="use transport='gloo' on machines without a GPU (with a GPU: "
                               f"torch.cuda must work, and {INSTALL})")
    return nccl


class _Comm:
    """One NCCL communicator with the stream its operations run on."""

    __slots__ = ("comm", "stream", "ranks", "index")

    def __init__(self, comm: Any, stream: Any, ranks: Sequence[int], index: int) -> None:
        self.comm, self.stream, self.ranks, self.index = comm, stream, list(ranks), index

    def local(self, rank: int) -> int:
        """``rank``'s rank in this communicator."""
        return self.ranks.index(rank)


class _EventHandle:
    """An operation on a side stream; ``wait()`` makes torch's current stream wait for
    its event (no host block) and hands the event to the watch."""

    __slots__ = ("_event", "_ops", "_peer", "_what", "_done")

    def __init__(self, event: Any, ops: _Ops, peer: int | None, what: str) -> None:
        self._event, self._ops, self._peer, self._what = event, ops, peer, what
        self._done = event is None  # nothing was posted (an empty message)

    def is_completed(self) -> bool:
        # really finished: a wait() only ordered the current stream after the event
        return self._event is None or bool(self._event.query())

    def wait(self) -> None:
        ops = self._ops
        ops.watch.check()
        if self._done:
            return
        ops.cuda.current_stream().wait_event(self._event)
        ops.watch.watch(self._event, ops.timeout(), self._what, self._peer)
        self._done = True


class _Ops:
    """The device side: posting groups and collectives on communicators and streams.

    :param nccl: ``cupy.cuda.nccl`` (or a fake with ``groupStart``/``groupEnd``).
    :param cuda: ``torch.cuda`` (or a fake with ``current_stream()`` and ``Event``).
    :param timeout: callable returning the transport's current timeout.
    """

    def __init__(self, nccl: Any, cuda: Any, watch: DeviceWatch, timeout: Callable[[], float]):
        self.nccl, self.cuda, self.watch, self.timeout = nccl, cuda, watch, timeout

    @staticmethod
    def record_stream(tensor: torch.Tensor, stream: Any) -> None:
        """Tell the caching allocator that ``stream`` uses ``tensor``'s memory."""
        tensor.record_stream(stream)

    def _after_current(self, stream: Any) -> None:
        ready = self.cuda.Event()
        ready.record(self.cuda.current_stream())
        stream.wait_event(ready)

    def _done_event(self, stream: Any) -> Any:
        done = self.cuda.Event()
        done.record(stream)
        return done

    def post(self, comm: _Comm, entries: Sequence[tuple[int, P2POp]]) -> list[_EventHandle]:
        """One NCCL group of ``entries`` (all on ``comm``) on ``comm.stream``; a handle per op."""
        uint8 = NCCL_TYPES["NCCL_UINT8"]
        live = [(op, _bytes(op.tensor)) for _, op in entries]
        live_ops = [(op, buf) for op, buf in live if buf.numel()]
        event = None
        if live_ops:  # empty messages are not sent: both sides skip them alike
            stream = comm.stream
            self._after_current(stream)
            handle = stream.cuda_stream
            self.nccl.groupStart()
            try:
                for op, buf in live_ops:
                    call = comm.comm.send if op.op == "send" else comm.comm.recv
                    call(buf.data_ptr(), buf.numel(), uint8, comm.local(op.peer), handle)
                    self.record_stream(buf, stream)
            finally:
                self.nccl.groupEnd()
            event = self._done_event(stream)
        return [_EventHandle(event if buf.numel() else None, self, op.peer,
                             "send to" if op.op == "send" else "receive from")
                for op, buf in live]

    def all_reduce(self, comm: _Comm, tensor: torch.Tensor, op: str) -> _EventHandle:
        if op not in NCCL_OPS:
            raise ConfigError(f"all_reduce op must be one of {sorted(NCCL_OPS)}, got {op!r}",
                              hint="use one of the listed ops ('sum', 'max', 'min')")
        code, factor = nccl_dtype(tensor.dtype, op, self.nccl)
        return self._collective(comm, tensor, "all_reduce", lambda ptr, n, h: comm.comm.allReduce(
            ptr, ptr, n * factor, code, NCCL_OPS[op], h))

    def broadcast(self, comm: _Comm, tensor: torch.Tensor, root: int) -> _EventHandle:
        code, factor = nccl_dtype(tensor.dtype, None, self.nccl)
        return self._collective(comm, tensor, "broadcast", lambda ptr, n, h: comm.comm.bcast(
            ptr, n * factor, code, root, h))

    def all_gather(self, comm: _Comm, out: torch.Tensor, tensor: torch.Tensor) -> _EventHandle:
        """``out`` (``len(comm.ranks) * tensor.numel()`` elements) gets every member's
        ``tensor`` in rank order; carried as bytes, so any dtype works."""
        send, recv = _bytes(tensor.contiguous()), _bytes(out)
        if recv.numel() != send.numel() * len(comm.ranks):
            raise TransportError(f"all_gather needs an output of {len(comm.ranks)} x the "
                                 f"input ({send.numel()} bytes), got {recv.numel()} bytes",
                                 hint="shape the output (group size, *tensor.shape)")
        uint8 = NCCL_TYPES["NCCL_UINT8"]
        self.record_stream(send, comm.stream)
        return self._collective(comm, out, "all_gather", lambda _, __, h: comm.comm.allGather(
            send.data_ptr(), recv.data_ptr(), send.numel(), uint8, h))

    def _collective(self, comm: _Comm, tensor: torch.Tensor, what: str,
                    call: Callable[[int, int, int], None]) -> _EventHandle:
        if not tensor.is_contiguous():
            raise TransportError(f"{what} needs a contiguous tensor",
                                 hint="call .contiguous() first")
        stream = comm.stream
        self._after_current(stream)
        call(tensor.data_ptr(), tensor.numel(), stream.cuda_stream)
        self.record_stream(tensor, stream)
        return _EventHandle(self._done_event(stream), self, None,
                            f"finish a {what} over ranks {comm.ranks} with")


#: a contiguous tensor's bytes (every dtype crosses as bytes), as the torch transports do
_bytes = TorchDistributedTransport._bytes


class CupyNcclTransport(Watched):
    """GPU transport over ``cupy.cuda.nccl.NcclCommunicator`` (see the module docstring).

    :param timeout: seconds for every wait.
    :param group: a torch.distributed process group to span instead of the world
        (as for gloo); only members create the transport.
    :param lanes: lanes (tags), one communicator each; default: as many as the pipeline
        needs, opened by the engine (:meth:`open_lanes`).
    :param watch_interval: seconds between the device watch's rounds (default 1).
    :param grace: seconds a host has, after a timeout aborted the communicators, to reach
        a transport call before the process is ended (default 10; see
        :mod:`pipekernel.transports.device_watch`).
    """

    backend = "cupy-nccl"

    def __init__(self, timeout: float = 300.0, group: Any = None, lanes: int | None = None,
                 watch_interval: float = 1.0, grace: float = 10.0, **options: Any) -> None:
        if options:
            raise ConfigError(f"unknown cupy-nccl transport options: {sorted(options)}",
                              hint="supported options: timeout, group, lanes, watch_interval, "
                                   "grace")
        self._grace = float(grace)
        nccl = load_cupy_nccl()  # before anything else: the error says what to install
        # before CUDA starts; checked again as lanes open
        check_max_connections(int(lanes or 0), "cupy-nccl")
        import cupy

        from pipekernel.transports.gloo import GlooTransport
        from pipekernel.transports.nccl import cuda_device_from_env

        self.device = cuda_device_from_env("cupy-nccl")
        torch.cuda.set_device(self.device)
        cupy.cuda.Device(self.device.index).use()
        self.timeout = float(timeout)
        self.abort_check: Any = None
        self.abort_interval = 0.5
        #: the host lane: wire headers, store, group bookkeeping (see the module docstring)
        self.control = GlooTransport(timeout=timeout, group=group)
        self.rank, self.world_size = self.control.rank, self.control.world_size
        self._nccl = nccl
        self._comms: list[_Comm] = []
        try:
            self._set_up(nccl, lanes, watch_interval)
        except BaseException:
            self.control.close()  # no gloo group left behind by a failed start
            raise

    def _set_up(self, nccl: Any, lanes: int | None, watch_interval: float) -> None:
        """The device side: the watch, then the world's and the lanes' communicators."""
        self._watch = DeviceWatch(self.rank, lambda event: bool(event.query()),
                                  describe=self.describe,
                                  on_expire=lambda _: self._abort(), on_stuck=end_process,
                                  grace=self._grace, interval=watch_interval)
        self._ops = _Ops(nccl, torch.cuda, self._watch, lambda: self.timeout)
        world = list(range(self.world_size))
        members = [self.control.global_rank(r) for r in world]
        where = hashlib.sha1(repr(members).encode()).hexdigest()[:8]
        store = self.store
        if store is None:
            raise ConfigError("transport 'cupy-nccl' found no torch.distributed store to "
                              "exchange NCCL ids through",
                              hint="start with torchrun or pipekernel.launcher.launch()")
        # keyed by attempt (pipekernel.comm.attempt): a restart never reads a dead id
        base = f"{attempt_prefix()}/cupy-nccl/{where}"
        made = store.add(f"{base}/made/{self.rank}", 1)
        self._prefix = f"{base}/{made}"
        self._fixed_lanes = lanes is not None
        self.max_tags = int(lanes) if lanes is not None else 0
        if self._fixed_lanes and self.max_tags < 1:
            raise ConfigError(f"cupy-nccl transport option lanes={lanes} must be >= 1",
                              hint="leave it out: the engine opens as many as it needs")
        self._world = self._communicator(world)
        self._lanes = [self._communicator(world) for _ in range(self.max_tags)]
        self._groups: dict[tuple[int, ...], _Comm | None] = {}

    def open_lanes(self, count: int) -> None:
        """Create lane communicators up to ``count``; called by the engine on every rank
        with the number the pipeline needs (optional member,
        :mod:`pipekernel.comm.transport`). A count fixed by ``lanes`` is kept."""
        if self._fixed_lanes or count <= self.max_tags:
            return
        check_max_connections(count, "cupy-nccl")
        world = list(range(self.world_size))
        self._lanes += [self._communicator(world) for _ in range(count - self.max_tags)]
        self.max_tags = count

    # -- set-up --------------------------------------------------------------------------
    @property
    def store(self) -> Any:
        """The host process group's store (shared by every rank of the job)."""
        return self.control.store

    def _communicator(self, ranks: Sequence[int]) -> _Comm:
        """A communicator over ``ranks`` (this rank among them); every member calls this
        in the same order, so the n-th communicator has the same store key everywhere."""
        index = len(self._comms)
        key = f"{self._prefix}/comm/{index}"
        uid = exchange_unique_id(self.store, key, self.rank == ranks[0], self._nccl.get_unique_id)
        comm = make_communicator(self._nccl, len(ranks), uid, list(ranks).index(self.rank))
        made = _Comm(comm, torch.cuda.Stream(self.device), ranks, index)
        self._comms.append(made)
        return made

    def describe(self, rank: int) -> str:
        return self.control.describe(rank)

    # -- point to point ----------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> _EventHandle:
        return self.batch_isend_irecv([P2POp("send", tensor, dst, tag)])[0]

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> _EventHandle:
        return self.batch_isend_irecv([P2POp("recv", tensor, src, tag)])[0]

    def batch_isend_irecv(self, ops: Sequence[P2POp]) -> list[_EventHandle]:
        """One NCCL group per lane the ops use (lanes in order of first use)."""
        self._watch.check()
        handles: list[Any] = [None] * len(ops)
        for tag, entries in split_by_lane(ops, self.max_tags).items():
            try:
                posted = self._ops.post(self._lanes[tag], entries)
            except Exception as err:  # cupy.cuda.nccl.NcclError and friends
                if isinstance(err, (TransportError, ConfigError)):
                    raise
                peers = sorted({op.peer for _, op in entries})
                raise TransportError(f"rank {self.rank} failed to post a group with ranks "
                                     f"{peers} on lane {tag}", rank=self.rank,
                                     hint="look at the peers' logs: one probably failed "
                                          "first").add_cause(err, "cupy-nccl") from None
            for (index, _), handle in zip(entries, posted):
                handles[index] = handle
        return handles

    # -- collectives ---------------------------------------------------------------------
    def _group(self, group: Any) -> _Comm:
        return self._world if group is None else group

    def iall_reduce(self, tensor: torch.Tensor, op: str = "sum", group: Any = None
                    ) -> _EventHandle:
        self._watch.check()
        return self._ops.all_reduce(self._group(group), tensor, op)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", group: Any = None) -> None:
        self.iall_reduce(tensor, op, group).wait()

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any = None) -> None:
        self._watch.check()
        comm = self._group(group)
        self._ops.broadcast(comm, tensor, comm.local(src)).wait()

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor, group: Any = None) -> None:
        """Optional member: every member's ``tensor`` into ``out`` (shape ``(group size,
        *tensor.shape)``) in group-rank order."""
        self._watch.check()
        self._ops.all_gather(self._group(group), out, tensor).wait()

    def barrier(self, group: Any = None) -> None:
        """An all-reduce of one element, waited on by the host (bounded)."""
        flag = torch.zeros(1, device=self.device)
        handle = self.iall_reduce(flag, "sum", group)
        self._watch.wait_for(handle._event, self.timeout, handle._what, None,
                             abort_check=self.abort_check)

    def new_group(self, ranks: Sequence[int]) -> Any:
        """A communicator over ``ranks`` (transport ranks); every rank calls this in the
        same order, members get the group, the others ``None``."""
        ranks = sorted(ranks)
        if len(ranks) == self.world_size:
            return None
        key = tuple(ranks)
        if key not in self._groups:
            self._groups[key] = self._communicator(ranks) if self.rank in ranks else None
            if self.rank not in ranks:
                self._comms.append(None)  # type: ignore[arg-type]  # same index everywhere
        return self._groups[key]

    # -- tear-down -----------------------------------------------------------------------
    def _abort(self) -> None:
        for comm in self._comms:
            if comm is not None:
                try:
                    comm.comm.abort()
                except Exception:  # noqa: BLE001 - already broken
                    pass

    def close(self) -> None:
        """Destroy the communicators (abort them when an operation may still be pending:
        destroying would wait for it) and close the host side."""
        self._watch.stop()
        if self._watch.error is not None or self._watch.pending():
            self._abort()
        else:
            for comm in self._comms:
                if comm is not None:
                    try:
                        comm.comm.destroy()
                    except Exception:  # noqa: BLE001 - aborted communicators
                        pass
        self._comms = []
        self.control.close()
