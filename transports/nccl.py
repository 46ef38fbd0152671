"""The nccl transport: CUDA tensors over ``torch.distributed`` with the NCCL backend.

Device: each process uses ``cuda:LOCAL_RANK`` (torchrun's contract), set as the
current device before the process group exists; tensors live on
``torch.cuda.current_device()``.

Point to point: each posting group of :meth:`batch_isend_irecv` becomes one
``torch.distributed.batch_isend_irecv`` call per lane, i.e. one NCCL group
call, so a send to and a receive from the same peer in one group never
deadlock. NCCL has no tags and runs a communicator's operations in order, so
each lane (tag) is its own process group, hence its own communicators and
streams. Transfers carry a byte view of the tensor, so bool, complex and every
other dtype cross bit-exactly although NCCL has no bool type — the conversion
lives here, never in the core; a byte view costs nothing.

No host synchronisation on the hot path: ``Handle.wait()`` calls
``Work.wait()`` *without* a timeout, which makes torch's current stream wait
for NCCL's stream and returns at once (given a timeout, torch's NCCL work busy-
waits on the host instead). Collectives run on NCCL's stream ordered the same
way; only :meth:`barrier` and :meth:`synchronize` block the host, by design.

Timeouts, two layers:

1. :class:`~pipekernel.transports.device_watch.DeviceWatch`: every waited-on
   transfer is registered with its deadline; a daemon thread queries
   ``Work.is_completed()`` (an event query, no device sync) once per
   ``watch_interval`` seconds. An overdue one becomes a ``TransportTimeout``
   naming the peer and the thread **aborts the lanes' and the group's
   communicators** at once: the stuck kernels end, so a host blocked in a CUDA
   synchronisation (``.item()``, ``synchronize``) gets control back, and the next
   transport call raises the timeout (a CUDA or NCCL error the abort caused in a
   wait is replaced by it). A host that still has not come back ``grace`` seconds
   later (default 10) is ended by
   :func:`~pipekernel.transports.device_watch.end_process` with the timeout's
   text. So an overdue transfer ends the rank within ``timeout + watch_interval
   (+ grace)`` seconds. A peer that died is usually seen earlier, on the gloo
   control lane, whose waits are bounded and abort-aware.
2. The process group's own NCCL watchdog, with the groups' timeout set to
   ``timeout + backstop`` seconds (default backstop 60): a last resort should
   the watch thread itself be stuck. The backstop lets layer 1 report first,
   with the peer's name.

Lanes are NCCL process groups whatever made the default group (the host may have
made it with gloo, or with ``"cpu:gloo,cuda:nccl"``: a lane inheriting gloo would
carry CUDA tensors through the host, or fail), each initialised eagerly on this GPU
(``device_id``): its one communicator exists after construction, the batched
point-to-point calls run on it, and a rank that cannot make it fails at start
rather than inside the first batch.

The wire's headers and metadata changes ride on ``control``, a gloo transport
over the same ranks (host memory), so the hot path never reads device memory.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from pipekernel.errors import ConfigError, TransportError
from pipekernel.comm import Handle, P2POp, TORCH_REDUCE_OPS
from pipekernel.transports.connections import check_max_connections
from pipekernel.transports.device_watch import DeviceWatch, Watched, end_process
from pipekernel.transports.gloo import TorchDistributedTransport
from pipekernel.transports.lanes import split_by_lane

__all__ = ["NcclTransport", "cuda_device_from_env"]


def cuda_device_from_env(name: str) -> torch.device:
    """``cuda:LOCAL_RANK`` (torchrun's contract), checked; raises ``ConfigError`` naming
    transport ``name`` when CUDA or that GPU is missing."""
    if not torch.cuda.is_available():
        raise ConfigError(f"transport {name!r} needs CUDA, and torch.cuda.is_available() is "
                          "False",
                          hint="use transport='gloo' (or 'auto') on machines without a GPU")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if local >= torch.cuda.device_count():
        raise ConfigError(f"LOCAL_RANK={local} but only {torch.cuda.device_count()} GPU(s) "
                          "are visible",
                          hint="start at most one process per GPU on each node (NCCL refuses "
                               "two ranks on one GPU; transport='staged' shares one)")
    return torch.device("cuda", local)


class _DeviceHandle:
    """A transfer or collective on NCCL's stream; ``wait()`` orders the current stream
    after it and registers it with the transport's watch (no host block)."""

    __slots__ = ("_work", "_transport", "_peer", "_what", "_done")

    def __init__(self, work: Any, transport: NcclTransport, peer: int | None, what: str):
        self._work, self._transport, self._peer, self._what = work, transport, peer, what
        self._done = False

    def is_completed(self) -> bool:
        # really finished: a wait() only ordered the current stream after the work
        return self._work.is_completed()

    def wait(self) -> None:
        transport = self._transport
        transport._watch.check()
        if self._done:
            return
        try:
            self._work.wait()  # no timeout: stream ordering only (see the module docstring)
        except RuntimeError as err:
            transport._watch.check()  # aborted after a timeout: that is the error to report
            peer = transport.describe(self._peer) if self._peer is not None else "its group"
            raise TransportError(f"rank {transport.rank} failed to {self._what} {peer}",
                                 rank=transport.rank, peer=self._peer,
                                 hint="look at the peer's log: it probably failed first"
                                 ).add_cause(err, "nccl") from None
        transport._watch.watch(self._work, transport.timeout, self._what, self._peer)
        self._done = True


class NcclTransport(Watched, TorchDistributedTransport):
    """GPU transport over NCCL (see the module docstring; options of
    :class:`TorchDistributedTransport` plus these).

    :param lanes: lanes (tags), one process group (one NCCL communicator) each; default:
        as many as the pipeline needs, opened by the engine (:meth:`open_lanes`;
        :func:`~pipekernel.schedules.lanes.lanes_needed`).
    :param watch_interval: seconds between the device watch's rounds (default 1).
    :param backstop: seconds the process groups' own NCCL watchdog waits beyond
        ``timeout`` before it aborts a communicator (default 60).
    :param grace: seconds a host has, after a timeout aborted the communicators, to
        reach a transport call and raise it before the process is ended (default 10).
    """

    backend = "nccl"

    def __init__(self, timeout: float = 300.0, group: Any = None, **options: Any) -> None:
        # before CUDA starts (transports/connections.py); checked again as lanes open
        check_max_connections(int(options.get("lanes") or 0), "nccl")
        self._cuda = cuda_device_from_env("nccl")
        torch.cuda.set_device(self._cuda)
        lanes = options.pop("lanes", None)  # None: as many as the engine opens
        interval = float(options.pop("watch_interval", 1.0))
        self._backstop = float(options.pop("backstop", 60.0))
        grace = float(options.pop("grace", 10.0))
        if lanes is not None and int(lanes) < 1:
            raise ConfigError(f"nccl transport option lanes={lanes} must be >= 1",
                              hint="leave it out: the engine opens as many as it needs")
        self.timeout = float(timeout)
        super().__init__(timeout, group, **options)
        self._lanes: list[Any] = []
        self._watch = self._make_watch(interval, grace)
        self._fixed_lanes = lanes is not None
        self._make_lanes(int(lanes) if lanes is not None else 0)

    def _make_watch(self, interval: float, grace: float, **fakes: Any) -> DeviceWatch:
        """The device watch: an overdue transfer aborts every communicator this rank
        uses (lanes and group), then ends the process if the host stays blocked
        (``fakes``: ``clock``/``thread``/``on_stuck`` for tests)."""
        fakes.setdefault("on_stuck", end_process)
        return DeviceWatch(self.rank, lambda work: work.is_completed(), describe=self.describe,
                           on_expire=lambda _: self._abort_groups(), interval=interval,
                           grace=grace, **fakes)

    def _make_lanes(self, count: int) -> None:
        """Every rank creates the control lane and ``count`` lanes at construction, in the
        same order (``new_group`` is collective)."""
        ranks, kwargs = self._group_args()
        self._lanes = [self._new_lane(ranks, kwargs) for _ in range(count)]
        self.max_tags = count
        from pipekernel.transports.gloo import GlooTransport

        self.control = GlooTransport(timeout=self.timeout,
                                     group=dist.new_group(ranks, backend="gloo", **kwargs))

    def _group_args(self) -> tuple[list[int], dict[str, Any]]:
        """The ranks and ``new_group`` options of the lanes and the control lane."""
        ranks = dist.get_process_group_ranks(self.group) if self.group is not None \
            else list(range(dist.get_world_size()))
        # on a host's subgroup only its members get here: they synchronise among themselves
        kwargs = {"timeout": self._timedelta(),
                  **({"use_local_synchronization": True} if self.group is not None else {})}
        return ranks, kwargs

    def open_lanes(self, count: int) -> None:
        """Create lanes up to ``count`` (one process group, one NCCL communicator each);
        called by the engine on every rank with the number the pipeline needs
        (optional member, :mod:`pipekernel.comm.transport`). A count fixed by the
        ``lanes`` option is kept (the engine then reports a shortfall)."""
        if self._fixed_lanes or count <= self.max_tags:
            return
        check_max_connections(count, "nccl")
        ranks, kwargs = self._group_args()
        self._lanes += [self._new_lane(ranks, kwargs) for _ in range(count - self.max_tags)]
        self.max_tags = count

    def _new_lane(self, ranks: list[int], kwargs: dict[str, Any]) -> Any:
        """One lane: an NCCL process group apart from ``self.group`` (a collective never
        queues behind a posted receive), NCCL and eager on this GPU whoever made the
        default group (see the module docstring)."""
        return dist.new_group(ranks, backend="nccl", device_id=self._cuda, **kwargs)

    def _timedelta(self) -> Any:
        import datetime

        return datetime.timedelta(seconds=self._group_timeout())

    def _group_timeout(self) -> float:
        return self.timeout + self._backstop

    def _init_options(self) -> dict[str, Any]:
        return {"device_id": self._cuda}  # binds the communicator to this GPU eagerly

    def _device(self) -> torch.device:
        return self._cuda

    # -- point to point ----------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Handle:
        return self.batch_isend_irecv([P2POp("send", tensor, dst, tag)])[0]

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Handle:
        return self.batch_isend_irecv([P2POp("recv", tensor, src, tag)])[0]

    def batch_isend_irecv(self, ops: Sequence[P2POp]) -> list[Handle]:
        """One ``torch.distributed.batch_isend_irecv`` (an NCCL group) per lane the ops use,
        lanes in order of first use; one handle per op (ops of one lane share the group's
        work: NCCL completes a group together)."""
        self._watch.check()
        by_lane = split_by_lane(ops, self.max_tags)
        handles: list[Any] = [None] * len(ops)
        for tag, entries in by_lane.items():
            group = self._lanes[tag]
            p2p = [dist.P2POp(dist.isend if op.op == "send" else dist.irecv, self._bytes(op.tensor),
                              self.global_rank(op.peer), group=group) for _, op in entries]
            try:
                works = dist.batch_isend_irecv(p2p)
            except RuntimeError as err:
                peers = sorted({op.peer for _, op in entries})
                raise TransportError(f"rank {self.rank} failed to post a group with ranks "
                                     f"{peers} on lane {tag}", rank=self.rank,
                                     hint="look at the peers' logs: one probably failed "
                                          "first").add_cause(err, "nccl") from None
            for k, (index, op) in enumerate(entries):
                work = works[k] if len(works) == len(entries) else works[-1]
                handles[index] = _DeviceHandle(work, self, op.peer,
                                               "send to" if op.op == "send" else "receive from")
        return handles

    # -- collectives ---------------------------------------------------------------------
    def _start(self, what: str, group: Any, fn: Any, *args: Any, **kwargs: Any) -> _DeviceHandle:
        self._watch.check()
        group = self.group if group is None else group
        try:
            work = fn(*args, group=group, async_op=True, **kwargs)
        except RuntimeError as err:
            raise TransportError(f"{what} failed on rank {self.rank}", rank=self.rank,
                                 hint="a peer in the group probably failed or timed out "
                                      "first; look at its log").add_cause(err, "nccl") from None
        return _DeviceHandle(work, self, None, f"finish a {what} with")

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", group: Any = None) -> None:
        self._start("all_reduce", group, dist.all_reduce, tensor, op=TORCH_REDUCE_OPS[op]).wait()

    def iall_reduce(self, tensor: torch.Tensor, op: str = "sum", group: Any = None
                    ) -> _DeviceHandle:
        return self._start("all_reduce", group, dist.all_reduce, tensor, op=TORCH_REDUCE_OPS[op])

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any = None) -> None:
        self._start("broadcast", group, dist.broadcast, tensor, self.global_rank(src)).wait()

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor, group: Any = None) -> None:
        """Optional member: every member's ``tensor`` into ``out`` (shape ``(group size,
        *tensor.shape)``) in group-rank order; ordered on the stream like the others."""
        self._start("all_gather", group, dist.all_gather_into_tensor, out.view(-1),
                    tensor.contiguous().view(-1)).wait()

    def barrier(self, group: Any = None) -> None:
        """An all-reduce of one element, waited on by the host (bounded): torch's NCCL
        barrier would block in an unbounded stream synchronisation instead."""
        flag = torch.zeros(1, device=self._cuda)
        handle = self._start("barrier", group, dist.all_reduce, flag)
        self._watch.wait_for(handle._work, self.timeout, "finish a barrier with", None,
                             abort_check=getattr(self, "abort_check", None))

    def close(self) -> None:
        """As for gloo; after a timeout the communicators are aborted first (destroying one
        with a transfer still pending could block forever)."""
        self._watch.stop()
        control = getattr(self, "control", None)
        if control is not None:
            control.close()
        if self._watch.error is not None or self._watch.pending():
            self._abort_groups()
        super().close()

    def _abort_groups(self) -> None:
        """Abort the lanes' communicators and the group's (``self.group``, or the world
        when the transport spans it), within one NCCL group call where torch offers
        it (aborting communicators one by one can block on each other). Called from
        the watch thread on a timeout, and by :meth:`close` after one."""
        groups = [*self._lanes, self.group if self.group is not None else dist.group.WORLD]
        nccl = _nccl_backend(groups[0])
        if nccl is not None:
            _quietly(nccl._group_start)
        for group in groups:
            if group is not None:
                _quietly(group.abort)
        if nccl is not None:
            _quietly(nccl._group_end)


def _nccl_backend(group: Any) -> Any:
    """``group``'s NCCL backend object if it has ``_group_start``/``_group_end``, else None."""
    try:
        backend = group._get_backend(torch.device("cuda"))
    except Exception:  # noqa: BLE001 - a fake, a non-NCCL group, an older torch
        return None
    return backend if hasattr(backend, "_group_start") and hasattr(backend, "_group_end") \
        else None


def _quietly(call: Any) -> None:
    try:
        call()
    except Exception:  # noqa: BLE001 - already broken or not abortable: aborting is best effort
        pass

