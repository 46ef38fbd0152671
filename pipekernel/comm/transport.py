"""The ``Transport`` protocol: how the stage runtime talks to its peers.

The core never calls ``torch.distributed`` directly; it talks to an object with
this shape. Transports are selected by name through the
``pipekernel.transports`` entry-point group and the
``pipekernel_make_transport`` hook.

Contract for implementers
-------------------------
* **Construction**: the transport is built by a callable published in the
  ``pipekernel.transports`` entry-point group (entry name = transport name),
  called with keyword options: ``timeout`` always, plus the user's
  ``transport_options``; an unknown option raises
  :class:`~pipekernel.errors.ConfigError`. It follows the torchrun contract
  (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``)
  when it must set up communication itself, and reuses what the host set up
  otherwise. It must not communicate in ``__init__`` beyond that set-up.
* **Ranks** are ranks of the world the transport spans, ``0 .. world_size-1``;
  ``rank`` and ``world_size`` describe this process. That world may be a
  subset of a larger job (the torch transports take ``group=``): the
  transport maps its ranks to the job's, the core never sees the difference.
* **Point-to-point** (``isend``/``irecv``) is asynchronous: both return a
  :class:`Handle` at once. The caller owns the tensor and will not touch it
  until ``handle.wait()`` returned. Messages between the same pair of ranks on
  the same lane arrive in the order they were posted: the k-th send from A to B
  on lane t fills B's k-th receive from A on lane t, whatever they carry.
* **Lanes (tags).** A lane is **one ordered stream per rank**: the operations a
  rank posts on one lane complete in posting order **across all peers** (a
  receive from rank 1 posted before a send to rank 3 on the same lane holds that
  send back until it completes), and the operations posted together in one call
  on one lane form **one group that progresses together**. Operations on
  different lanes never wait for one another, whatever the order they were
  posted in. This is NCCL's behaviour with one communicator per lane (NCCL has no
  tags; a communicator runs a rank's operations in order on one stream, a group
  call as one unit); a transport may be weaker (gloo matches by pair and tag and
  runs every operation at once) but the core only relies on this. A transport
  supports lanes ``0 .. max_tags - 1`` and maps each to one stream (one
  communicator), the same lane number on every rank. The plan's ``lanes[i]``
  (:class:`~pipekernel.schedules.program.Program`) is exactly that number: the
  runtime gives each lane one *channel* at each rank
  (:mod:`pipekernel.schedules.lanes`), so that no receive can hold back an
  unrelated send, and :func:`~pipekernel.schedules.simulate` proves the plans
  under these rules.
* **Sends may rendezvous.** An implementer may make a send complete only once
  the peer posted the matching receive (NCCL does; so does gloo, even for a
  one-byte message: its send is posted at once but completes only once
  received). The core never relies on a send completing before its receive is
  posted, and never waits on a send it does not have to.
* **Batched point-to-point** (``batch_isend_irecv``) posts a *group* of
  :class:`P2POp` — the ``torch.distributed.batch_isend_irecv`` / NCCL group-call
  model — and returns one handle per op, in order. What a caller may rely on:
  the ops of one group on one lane progress together, so a group holding a send
  to and a receive from the same peer completes even when that peer's group lists
  them in the other order (both "send first"); groups posted one after the other
  on one lane complete in order. What an implementer must guarantee: exactly
  that, and per-pair FIFO matching per lane across groups and single
  ``isend``/``irecv`` calls alike. A group may span several lanes; it is then one
  group per lane, posted in the order of the lanes' first use. A transport with
  no group call posts the ops one by one, in order, if its sends never block the
  poster (gloo: every op is asynchronous).
* **Waiting** (:meth:`Handle.wait`): on a *host* transport (gloo) ``wait()``
  blocks until the transfer finished: the received tensor holds the data and a
  sent tensor may be reused. On a *device* transport (nccl, cupy-nccl) it
  blocks nothing: it orders the caller's current device stream after the
  transfer, so work enqueued on that stream afterwards sees the received data
  and may overwrite a sent tensor, and it bounds the transfer by ``timeout``
  (a watch thread; see ``synchronize`` below). On both, ``is_completed()`` is
  ``True`` only once the transfer really finished (on a device: its event has
  completed), never merely because ``wait()`` was called.
* **Control lane** (optional attribute ``control``): a transport whose tensors
  live on a device (NCCL, CuPy) offers a host transport over the same ranks
  (e.g. gloo on a CPU group) with tags (the wire uses each channel's lane number
  there too, so the plan stays safe if it orders lanes as above). The wire protocol then sends each
  transfer's 16-byte header, and any metadata change, there, so the hot path
  never reads device memory; without it the header rides in the data message
  (right for CPU transports, a device sync per transfer on a GPU).
* **Dtypes**: every dtype torch has (float, bfloat16, float16, int, bool) must
  round-trip bit-exactly. A backend that cannot carry a dtype natively converts
  inside the transport (e.g. a byte view), never in the core.
* **Shapes**: 0-dim and empty tensors are legal messages; the receiver
  always posts a tensor of the sender's shape and dtype (the wire protocol
  guarantees it), on ``device``.
* **Collectives** (``all_reduce``, ``broadcast``, ``barrier``) are blocking,
  in place, and called by every member of ``group`` in the same order.
  ``group=None`` means the transport's whole world. ``all_reduce`` must
  support float32/float64/int32/int64 with ``"sum"``, ``"max"``, ``"min"``.
  ``iall_reduce`` is the asynchronous form: it returns a :class:`Handle` and
  the tensor holds the result once ``wait()`` returned; several may be in
  flight on one group and complete in the order they were started. Members of
  the group start them in the same order.
* **Groups** come from ``new_group(ranks)``, which every rank of the world
  calls with the same arguments in the same order (even ranks outside
  ``ranks``); it returns an opaque object (``None`` for non-members is fine).
* **Timeouts**: every wait is bounded by ``timeout`` seconds; a wait that runs
  out raises :class:`~pipekernel.errors.TransportTimeout` naming the peer
  (point-to-point) or the group (collectives). A peer that died raises a
  :class:`~pipekernel.errors.TransportError` no later than the timeout.
* ``close()`` releases what the transport created (not a process group it
  found already initialised).

Optional members (the core uses them when present)
--------------------------------------------------
* ``store``: a key-value store every rank of the world shares (``set(key,
  value)``, ``get(key)``, ``check([keys])``, ``add(key, n)``, as
  ``torch.distributed.Store``), or ``None``. The core uses it to tell the other
  ranks that this one failed (:mod:`pipekernel.engine.faults`); keys start with
  ``pipekernel/``. The torch transports return the process group's store.
* ``all_gather(out, tensor, group=None)``: blocking; ``out`` of shape ``(group
  size, *tensor.shape)`` receives every member's ``tensor`` in group-rank order.
  Tensor parallelism and ZeRO-1 use it (:mod:`pipekernel.comm.collectives`); without it
  they fall back to an all-reduce of a zero-padded buffer.
* ``synchronize()``: a transport whose ``wait()`` only orders a device stream
  (nccl, cupy-nccl: the host never blocks on the hot path) offers it to block the
  host until everything waited on so far finished, raising ``TransportTimeout``
  naming the peer after ``timeout``; such a transport bounds its waits with a
  watch thread instead (:mod:`pipekernel.transports.device_watch`), and raises an
  overdue transfer's timeout at its next call.
* ``failure``: such a transport's overdue-transfer error once its watch found one
  (else ``None``). The core reports it in place of whatever the host then hit (a
  CUDA or NCCL error from the communicators the watch aborted).
* ``open_lanes(count)``: a transport whose lanes cost something (one NCCL
  communicator each) may create them only when asked: the engine calls it on
  every rank, at the same point and with the same ``count`` (the pipeline's
  :func:`~pipekernel.schedules.lanes.lanes_needed`), before the first transfer,
  possibly more than once with a larger count; afterwards ``max_tags >= count``,
  or it raised :class:`~pipekernel.errors.ConfigError` naming ``count`` (a lane
  count fixed by an option that is too small). Without it, ``max_tags`` must
  already be large enough (:func:`require_lanes` says by how much).
* ``abort_check``: the core sets it to a callable (or ``None``) that raises when
  another rank has failed. A wait that blocks calls it about once per
  ``abort_interval`` seconds (default 0.5) and lets what it raises propagate, so
  every rank ends within seconds of the first failure instead of after the
  timeout. :func:`wait_sliced` implements such a wait.

Proving it: :mod:`pipekernel.testing.conformance` is a suite any transport runs
against itself (``check_transport("my_transport")``); pipekernel runs it for
gloo in its tests and for nccl on GPU machines. See
``docs/writing-a-plugin.md`` for publishing a transport.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from pipekernel.errors import ConfigError

__all__ = ["Transport", "Handle", "P2POp", "wait_sliced", "require_lanes"]


def wait_sliced(wait: Callable[[float], bool], timeout: float,
                check: Callable[[], None] | None = None, interval: float = 0.5) -> bool:
    """Wait up to ``timeout`` seconds in slices; ``True`` once ``wait(seconds)`` is.

    Every bounded wait of a transport can go through this one function:
    ``wait(seconds)`` blocks at most that long and says whether the work finished
    (e.g. ``threading.Event.wait``); between slices of ``interval`` seconds
    ``check()`` runs and may raise to abort the wait (another rank failed). A
    slice is a Python-level wait, so signal handlers (Ctrl-C, SIGTERM) run while
    a rank is blocked, which they do not inside a C++ wait.

    Why not slice the backend's own wait: a gloo ``Work.wait(timeout)`` that times
    out closes the connection to the peer (it cannot be waited again), and a
    gloo send/receive reports ``is_completed()`` only after ``wait()`` — so the
    torch transports wait on a helper thread and slice the wait for its event.
    """
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        if wait(max(0.0, min(interval, remaining))):
            return True
        if time.monotonic() >= deadline:
            return False
        if check is not None:
            check()


def require_lanes(transport: Any, needed: int, *, name: str, layout: str,
                  rank: int | None = None) -> None:
    """Make sure ``transport`` offers ``needed`` lanes: ``open_lanes(needed)`` when it has
    it (called by every rank at the same point), then check ``max_tags``.

    :param name: the transport's name, and ``layout`` the pipeline's (for the message).
    :raises ConfigError: naming the number of lanes needed and how to get them.
    """
    opener = getattr(transport, "open_lanes", None)
    if needed > 0 and opener is not None:
        opener(needed)
    offered = getattr(transport, "max_tags", 1)
    if offered < needed:
        raise ConfigError(
            f"transport {name!r} offers {offered} lane(s) (tags) and {layout} needs "
            f"{needed}",
            hint=f"a lane carries one channel at each rank, so that no receive holds back a "
                 f"send (pipekernel/schedules/lanes.py); give the transport {needed} lanes "
                 f"(nccl, cupy-nccl: transport_options={{'lanes': {needed}}}, or leave "
                 f"'lanes' out: they open as many as needed)", rank=rank)


@dataclass(frozen=True)
class P2POp:
    """One operation of a :meth:`Transport.batch_isend_irecv` group.

    :param op: ``"send"`` or ``"recv"``.
    :param tensor: the tensor to send, or to receive into (contiguous, on the
        transport's ``device``; the caller keeps it untouched until the op's
        handle was waited on).
    :param peer: the peer's rank in the transport's world.
    :param tag: the lane (``0 .. Transport.max_tags - 1``; see the module docstring).
    """

    op: str
    tensor: Any
    peer: int
    tag: int = 0


@runtime_checkable
class Handle(Protocol):
    """An in-flight point-to-point transfer (or asynchronous collective)."""

    def wait(self) -> None:
        """Make the transfer's result usable: a host transport blocks until it finished;
        a device transport orders the current stream after it (the host does not
        block). Raises ``TransportTimeout`` naming the peer if it does not finish
        within the transport's timeout (a device transport: at a later call, see the
        module docstring). Waiting again is a no-op."""

    def is_completed(self) -> bool:
        """``True`` once the transfer really finished (never blocks; on a device, not
        merely because ``wait()`` ordered the stream after it)."""


@runtime_checkable
class Transport(Protocol):
    """What the stage runtime needs from a communication backend."""

    #: This process's global rank.
    rank: int
    #: Number of processes in the world.
    world_size: int
    #: Seconds any single wait may take before ``TransportTimeout``; may be changed
    #: between waits (the next wait uses the new value).
    timeout: float
    #: ``torch.device`` that tensors must live on for this transport.
    device: Any
    #: Number of lanes (tags ``0 .. max_tags - 1``) point-to-point operations may use,
    #: each one ordered stream per rank (see the module docstring; ``open_lanes`` may
    #: raise it).
    max_tags: int

    def isend(self, tensor: Any, dst: int, tag: int = 0) -> Handle:
        """Start sending ``tensor`` to rank ``dst`` on lane ``tag``."""

    def irecv(self, tensor: Any, src: int, tag: int = 0) -> Handle:
        """Start receiving from rank ``src`` on lane ``tag`` into ``tensor`` (same shape
        and dtype as what the peer sends)."""

    def batch_isend_irecv(self, ops: Sequence[P2POp]) -> list[Handle]:
        """Post ``ops`` as one group; one handle per op, in order (see the module docstring
        for what the group guarantees). An empty list posts nothing."""

    def all_reduce(self, tensor: Any, op: str = "sum", group: Any = None) -> None:
        """Reduce ``tensor`` in place over ``group``; ``op`` is ``"sum"``, ``"max"`` or ``"min"``."""

    def iall_reduce(self, tensor: Any, op: str = "sum", group: Any = None) -> Handle:
        """Start reducing ``tensor`` in place over ``group``; the result is there once the
        handle's ``wait()`` returned (which raises as a blocking collective would)."""

    def broadcast(self, tensor: Any, src: int, group: Any = None) -> None:
        """Copy ``tensor`` from global rank ``src`` to every member of ``group``."""

    def barrier(self, group: Any = None) -> None:
        """Wait until every member of ``group`` reached the barrier."""

    def new_group(self, ranks: Sequence[int]) -> Any:
        """Create a group of global ``ranks``; called by every rank in the same order."""

    def close(self) -> None:
        """Release resources created by this transport."""
