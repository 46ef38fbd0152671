"""A reusable conformance suite for :class:`~pipekernel.comm.transport.Transport` implementations.

Any transport — built in or third party — proves it keeps the contract of
:mod:`pipekernel.comm.transport` by running this suite against itself::

    # tests/test_my_transport.py of your package
    from pipekernel.testing import check_transport

    def test_conformance():
        check_transport("my_transport", nprocs=3)   # an installed entry-point name

:func:`pipekernel.testing.check_transport` starts ``nprocs`` local processes with
:func:`pipekernel.launch` (torchrun environment set), builds the transport in
each — by entry-point name through the plugin manager, or with a picklable
factory — and runs :func:`run_transport_conformance` on every rank. Hosts that
start processes themselves call :func:`run_transport_conformance` on every rank.

What is checked (see :data:`CHECKS`): the attributes; every dtype (float,
bfloat16, float16, int, bool, complex) round-trips bit-exactly, NaN and
infinities included; 0-dim, empty and large tensors; FIFO order per direction
with many sends in flight both ways; handles; batched point-to-point
groups (a send and a receive to the same peer posted "send first" on both
sides, large enough to rendezvous, must complete; order across groups; a group
spanning two peers); ``iall_reduce`` with several in flight; ``all_reduce`` (sum/max/min),
``broadcast`` from every rank and ``barrier``; subgroups from ``new_group``;
and, last, that a receive nobody answers raises
:class:`~pipekernel.errors.TransportTimeout` naming the peer (gloo and NCCL
close the connection after a timeout, so nothing is sent after it).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pipekernel.errors import TransportTimeout
from pipekernel.comm.transport import Handle, Transport

__all__ = ["run_transport_conformance", "ConformanceError", "CHECKS",
           "SOLO_CHECKS", "DTYPES"]

#: Every dtype a transport must carry point-to-point.
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
          torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128)
#: The dtypes collectives must reduce.
REDUCE_DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64)


class ConformanceError(AssertionError):
    """A transport broke its contract; the message names the check and the rank."""


def _fail(check: str, rank: int, message: str) -> ConformanceError:
    return ConformanceError(f"transport conformance check {check!r} failed on rank {rank}: "
                            f"{message}")


def _payload(dtype: torch.dtype, shape: Sequence[int], seed: int) -> torch.Tensor:
    """Deterministic content of ``dtype``, with NaN/inf/-0 and extreme values mixed in."""
    g = torch.Generator().manual_seed(seed)
    numel = 1
    for n in shape:
        numel *= n
    if dtype == torch.bool:
        flat = torch.rand(numel, generator=g) > 0.5
    elif dtype.is_floating_point or dtype.is_complex:
        real = torch.float64 if dtype != torch.complex64 else torch.float32
        flat = (torch.randn(numel, generator=g, dtype=real) * 1e3)
        specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0], dtype=real)
        flat[:min(4, numel)] = specials[:min(4, numel)]
        if dtype.is_complex:
            flat = torch.complex(flat, flat.flip(0))
        flat = flat.to(dtype)
    else:
        info = torch.iinfo(dtype)
        low, high = max(info.min, -(1 << 62)), min(info.max, 1 << 62)
        flat = torch.randint(low, high, (numel,), generator=g, dtype=torch.int64)
        flat[:min(2, numel)] = torch.tensor([info.min, info.max])[:min(2, numel)]
        flat = flat.to(dtype)
    return flat.reshape(tuple(shape))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(_bits(a), _bits(b)))


class _Run:
    """State of one rank's run of the suite."""

    def __init__(self, transport: Transport) -> None:
        self.t, self.rank, self.world = transport, transport.rank, transport.world_size
        self.check = ""

    def fail(self, message: str) -> ConformanceError:
        return _fail(self.check, self.rank, message)

    def ring(self, tensors_for: Callable[[int], list[torch.Tensor]], what: str) -> None:
        """Every rank sends ``tensors_for(rank)`` to the next rank and checks what the
        previous rank sent; all sends are posted before any receive."""
        t, nxt, prv = self.t, (self.rank + 1) % self.world, (self.rank - 1) % self.world
        outgoing = [x.to(t.device) for x in tensors_for(self.rank)]
        expected = tensors_for(prv)
        sends = [t.isend(x, nxt) for x in outgoing]
        received = [torch.empty(x.shape, dtype=x.dtype, device=t.device) for x in expected]
        recvs = [t.irecv(x, prv) for x in received]
        for handle in (*recvs, *sends):
            handle.wait()
        for i, (got, want) in enumerate(zip(received, expected)):
            if not _same(got, want):
                raise self.fail(f"{what} #{i} ({want.dtype}, shape {tuple(want.shape)}) from rank "
                                f"{prv} arrived changed: got {got.flatten()[:6].tolist()}, "
                                f"expected {want.flatten()[:6].tolist()}")


def _check_attributes(run: _Run) -> None:
    t = run.t
    if not isinstance(t, Transport):
        missing = [n for n in ("rank", "world_size", "timeout", "device", "isend", "irecv",
                               "all_reduce", "broadcast", "barrier", "new_group", "close")
                   if not hasattr(t, n)]
        raise run.fail(f"{type(t).__name__} lacks {missing}")
    if not (isinstance(t.rank, int) and isinstance(t.world_size, int)
            and 0 <= t.rank < t.world_size):
        raise run.fail(f"rank {t.rank!r} / world_size {t.world_size!r} are not ints with "
                       "0 <= rank < world_size")
    if not float(t.timeout) > 0:
        raise run.fail(f"timeout must be a positive number of seconds, got {t.timeout!r}")
    torch.empty(1, device=t.device)  # the device must be usable


def _check_dtypes(run: _Run) -> None:
    run.ring(lambda src: [_payload(d, (5, 3), 100 * src + i) for i, d in enumerate(DTYPES)],
             "tensor")


def _check_shapes(run: _Run) -> None:
    shapes = [(), (0,), (3, 0, 2), (1,), (7, 1, 5), (1 << 16,)]
    run.ring(lambda src: [_payload(d, s, 7 * src + i)
                          for i, s in enumerate(shapes) for d in (torch.float32, torch.bool,
                                                                  torch.bfloat16, torch.int64)],
             "shaped tensor")


def _check_fifo(run: _Run) -> None:
    # 24 messages of varying size and dtype in flight in both directions between 0 and 1
    if run.rank > 1:
        return
    t, peer = run.t, 1 - run.rank

    def messages(src: int) -> list[torch.Tensor]:
        return [torch.full((1 + (i * 37) % 300,), i + 1000 * src,
                           dtype=torch.int64 if i % 2 else torch.float32) for i in range(24)]

    sends = [t.isend(x.to(t.device), peer) for x in messages(run.rank)]
    for i, want in enumerate(messages(peer)):
        got = torch.empty(want.shape, dtype=want.dtype, device=t.device)
        t.irecv(got, peer).wait()
        if not _same(got, want):
            raise run.fail(f"message {i} from rank {peer} is out of order or changed: got "
                           f"{got[:3].tolist()}..., expected {want[:3].tolist()}...")
    for handle in sends:
        handle.wait()


def _check_handles(run: _Run) -> None:
    if run.rank > 1:
        return
    t, peer = run.t, 1 - run.rank
    x = torch.arange(4, device=t.device)
    send, recv = t.isend(x, peer), t.irecv(torch.empty_like(x), peer)
    if not (isinstance(send, Handle) and isinstance(recv, Handle)):
        raise run.fail(f"isend/irecv must return handles with wait() and is_completed(), got "
                       f"{type(send).__name__}")
    recv.wait()
    send.wait()
    send.wait()  # waiting twice is allowed
    if not (send.is_completed() and recv.is_completed()):
        raise run.fail("is_completed() is False after wait() returned")


def _check_batched(run: _Run) -> None:
    """Groups of sends and receives: ranks 0 and 1 each post "send first, then receive"
    to the other in one group (under rendezvous sends, posting them one by one would
    deadlock), with messages large enough that gloo and NCCL rendezvous; then several
    groups back to back to check per-pair order across groups; a middle rank posts one
    group spanning two peers."""
    t = run.t
    if not hasattr(t, "batch_isend_irecv"):
        raise run.fail(f"{type(t).__name__} lacks batch_isend_irecv")
    if run.rank <= 1:
        _batched_pair(run)
    if t.world_size >= 3:
        _batched_span(run)
    if run.rank <= 1:
        _batched_lanes(run)
    if t.batch_isend_irecv([]) != []:
        raise run.fail("an empty group must return no handles")


def _batched_pair(run: _Run) -> None:
    """Ranks 0 and 1: three groups back to back, each sending first, then receiving."""
    from pipekernel.comm.transport import P2POp

    t = run.t
    peer = 1 - run.rank
    for round_ in range(3):
        out = _payload(torch.float32, (1 << 20,), 10 * run.rank + round_).to(t.device)
        small = _payload(torch.bool, (7,), 10 * run.rank + round_).to(t.device)
        got = torch.empty_like(out)
        got_small = torch.empty_like(small)
        handles = t.batch_isend_irecv([P2POp("send", out, peer), P2POp("send", small, peer),
                                       P2POp("recv", got, peer),
                                       P2POp("recv", got_small, peer)])
        if len(handles) != 4 or not all(isinstance(h, Handle) for h in handles):
            raise run.fail(f"batch_isend_irecv must return one handle per op, got {handles!r}")
        for handle in reversed(handles):  # wait in any order
            handle.wait()
        if not (_same(got, _payload(torch.float32, (1 << 20,), 10 * peer + round_))
                and _same(got_small, _payload(torch.bool, (7,), 10 * peer + round_))):
            raise run.fail(f"group {round_}: the messages from rank {peer} arrived changed "
                           "or out of order")


def _batched_span(run: _Run) -> None:
    """Rank 1 receives from 0 and sends to 2 in one group, like a stage."""
    from pipekernel.comm.transport import P2POp

    t = run.t
    if run.rank == 0:
        t.batch_isend_irecv([P2POp("send", torch.full((5,), 3.0, device=t.device), 1)])[0].wait()
    elif run.rank == 1:
        got = torch.empty(5, device=t.device)
        handles = t.batch_isend_irecv([P2POp("send", torch.full((5,), 4.0, device=t.device), 2),
                                       P2POp("recv", got, 0)])
        for handle in handles:
            handle.wait()
        if got.cpu().tolist() != [3.0] * 5:
            raise run.fail(f"a group spanning two peers received {got.tolist()} from rank 0")
    elif run.rank == 2:
        got = torch.empty(5, device=t.device)
        t.batch_isend_irecv([P2POp("recv", got, 1)])[0].wait()
        if got.cpu().tolist() != [4.0] * 5:
            raise run.fail(f"a group spanning two peers sent {got.tolist()} to rank 2")


def _batched_lanes(run: _Run) -> None:
    """Lanes: rank 0 sends on tag 1 then tag 0, rank 1 receives 0 then 1."""
    from pipekernel.comm.transport import P2POp

    t = run.t
    lanes = min(int(getattr(t, "max_tags", 1)), 4)
    if lanes >= 2:
        peer = 1 - run.rank
        if run.rank == 0:
            handles = t.batch_isend_irecv(
                [P2POp("send", torch.full((1 << 18,), float(tag), device=t.device), peer, tag)
                 for tag in reversed(range(lanes))])
            for handle in handles:
                handle.wait()
        else:
            got = [torch.empty(1 << 18, device=t.device) for _ in range(lanes)]
            for tag in range(lanes):  # one group per lane, in the other order
                t.batch_isend_irecv([P2POp("recv", got[tag], peer, tag)])[0].wait()
            for tag in range(lanes):
                if not bool((got[tag] == float(tag)).all()):
                    raise run.fail(f"lane {tag} received the message of lane "
                                   f"{got[tag].flatten()[0].item():g}: tags must match "
                                   "messages per (pair, tag)")


def _check_async_all_reduce(run: _Run) -> None:
    t, world = run.t, run.world
    xs = [torch.full((1000 * (i + 1),), float(run.rank + i), device=t.device) for i in range(3)]
    handles = [t.iall_reduce(x, "sum") for x in xs]  # three in flight at once
    for handle in handles:
        handle.wait()
    for i, x in enumerate(xs):
        want = float(sum(r + i for r in range(world)))
        if not bool((x == want).all()):
            raise run.fail(f"iall_reduce #{i} gave {x.flatten()[0].item()}, expected {want}")


def _check_collectives(run: _Run) -> None:
    t, world = run.t, run.world
    ranks = torch.arange(world, dtype=torch.float64)
    for dtype in REDUCE_DTYPES:
        for op, want in (("sum", ranks.sum() + world), ("max", ranks.max() + 1),
                         ("min", torch.tensor(1.0))):
            x = torch.full((3, 2), run.rank + 1, dtype=dtype, device=t.device)
            t.all_reduce(x, op)
            if not torch.equal(x.cpu(), torch.full((3, 2), want.item(), dtype=dtype)):
                raise run.fail(f"all_reduce({op}) of {dtype} gave {x.flatten()[0].item()}, "
                               f"expected {want.item()}")
    for src in range(world):
        x = _payload(torch.float32, (4,), src) if run.rank == src else torch.zeros(4)
        x = x.to(t.device)
        t.broadcast(x, src)
        if not _same(x, _payload(torch.float32, (4,), src)):
            raise run.fail(f"broadcast from rank {src} gave {x.tolist()}")
    t.barrier()


def _check_subgroups(run: _Run) -> None:
    t, world = run.t, run.world
    # every rank creates every group, in the same order
    layouts = [list(range(world - 1)), list(range(1, world)), list(range(world))]
    groups = [t.new_group(ranks) for ranks in layouts]
    for ranks, group in zip(layouts, groups):
        if run.rank not in ranks:
            continue
        x = torch.tensor([float(run.rank + 1)], device=t.device)
        t.all_reduce(x, "sum", group)
        want = float(sum(r + 1 for r in ranks))
        if x.item() != want:
            raise run.fail(f"all_reduce over group {ranks} gave {x.item()}, expected {want} "
                           "(the group must contain exactly its ranks)")
        y = torch.tensor([float(run.rank)], device=t.device)
        t.broadcast(y, ranks[-1], group)
        if y.item() != ranks[-1]:
            raise run.fail(f"broadcast from rank {ranks[-1]} over group {ranks} gave {y.item()}")
        t.barrier(group)


def _check_timeout(run: _Run, seconds: float) -> None:
    t = run.t
    t.barrier()  # start together: rank 1 must stay silent while rank 0 waits
    if run.rank == 1:
        time.sleep(seconds * 3)  # alive but silent, so rank 0 sees a timeout, not a dead peer
        return
    if run.rank != 0:
        return
    saved, t.timeout = t.timeout, seconds
    start = time.monotonic()
    try:
        t.irecv(torch.empty(3, device=t.device), 1).wait()
        # a device transport's wait only orders the stream: its bounded host wait is here
        synchronize = getattr(t, "synchronize", None)
        if synchronize is not None:
            synchronize()
    except TransportTimeout as err:
        if getattr(err, "peer", None) != 1 or "rank 1" not in str(err):
            raise run.fail(f"TransportTimeout must name peer rank 1 (peer=1 and 'rank 1' in the "
                           f"message), got peer={getattr(err, 'peer', None)!r}: {err}") from err
    except Exception as err:
        raise run.fail(f"a receive nobody answers raised {type(err).__name__}, not "
                       f"TransportTimeout: {err}") from err
    else:
        raise run.fail("a receive nobody answers returned instead of raising TransportTimeout")
    finally:
        t.timeout = saved
    waited = time.monotonic() - start
    if waited > seconds * 5:
        raise run.fail(f"the timeout was {seconds}s but the wait took {waited:.1f}s")


#: The checks, in the order they run (the timeout check runs last, separately).
CHECKS: dict[str, Callable[[_Run], None]] = {
    "attributes": _check_attributes, "dtypes": _check_dtypes, "shapes": _check_shapes,
    "fifo": _check_fifo, "handles": _check_handles, "batched": _check_batched,
    "collectives": _check_collectives, "async_all_reduce": _check_async_all_reduce,
    "subgroups": _check_subgroups,
}


#: The checks a world of one rank runs (e.g. NCCL on a machine with one GPU: NCCL
#: refuses two ranks on one device); point to point needs a peer.
SOLO_CHECKS = ("attributes", "collectives", "async_all_reduce")


def run_transport_conformance(transport: Transport, *, timeout_check: float | None = 1.0
                              ) -> list[str]:
    """Run every check on this rank; every rank of ``transport`` calls it at once.

    A transport whose ``wait()`` only orders a device stream offers
    ``synchronize()`` (block the host until what was waited on finished, bounded
    by ``timeout``); the timeout check calls it after the wait.

    :param transport: a freshly created transport; with 2 ranks or more every
        check runs, with one rank only :data:`SOLO_CHECKS`.
    :param timeout_check: seconds for the timeout check (run last; it sets
        ``transport.timeout`` for one wait). ``None`` skips it. After it the
        transport may be unusable: close it.
    :returns: the names of the checks that passed.
    :raises ConformanceError: at the first check that fails, naming it and the rank.
    """
    opener = getattr(transport, "open_lanes", None)
    if opener is not None:  # lanes made on demand (nccl, cupy-nccl): the checks use 4
        opener(4)
    run = _Run(transport)
    passed = []
    solo = transport.world_size == 1
    for name, check in CHECKS.items():
        if solo and name not in SOLO_CHECKS:
            continue
        run.check = name
        check(run)
        passed.append(name)
    if timeout_check is not None and not solo:
        run.check = "timeout"
        _check_timeout(run, timeout_check)
        passed.append("timeout")
    return passed
