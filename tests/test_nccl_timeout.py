"""nccl's timeouts fire (issue 20, item 4), with fake communicators and a fake clock: no
CUDA or NCCL runs here.

A device transport's ``wait()`` only orders a stream, so a host can sit in a CUDA
synchronisation while a transfer never arrives. The device watch must then abort every
communicator the rank uses (the lanes' and the group's), hand the host a
``TransportTimeout`` naming the peer at its next transport call, and end the process
if the host never comes back.
"""
from __future__ import annotations

import threading

import pytest
import torch

from pipekernel.comm.transport import P2POp
from pipekernel.errors import TransportTimeout
from pipekernel.transports import nccl
from pipekernel.transports.device_watch import DeviceWatch


class Clock:
    def __init__(self):
        self.now = 50.0

    def __call__(self):
        return self.now


class FakeGroup:
    """A process group whose ``abort()`` is logged and ends its stuck work."""

    def __init__(self, name, log, aborted=None):
        self.name, self.log, self.aborted = name, log, aborted or threading.Event()

    def abort(self):
        self.log.append(self.name)
        self.aborted.set()


class FakeWork:
    """NCCL work that never finishes until its communicator is aborted; then its wait
    raises as torch's does."""

    def __init__(self, aborted):
        self.aborted = aborted

    def is_completed(self):
        return False

    def wait(self):
        if self.aborted.is_set():
            raise RuntimeError("NCCL communicator was aborted")


def fake_nccl(monkeypatch, lanes=3, **watch):
    """An NcclTransport on fake groups (rank 1 of 2), its watch on ``watch`` fakes."""
    log, aborted = [], threading.Event()
    transport = nccl.NcclTransport.__new__(nccl.NcclTransport)
    transport.rank, transport.world_size, transport.timeout = 1, 2, 5.0
    transport._global = [3, 7]  # a subgroup: messages name the global rank too
    transport.group = FakeGroup("group", log, aborted)
    transport._lanes = [FakeGroup(f"lane{i}", log, aborted) for i in range(lanes)]
    transport.max_tags = lanes
    transport._watch = transport._make_watch(watch.pop("interval", 1.0), watch.pop("grace", 10.0),
                                             **watch)
    monkeypatch.setattr(nccl.dist, "P2POp", lambda *args, **kwargs: args)
    monkeypatch.setattr(nccl.dist, "batch_isend_irecv",
                        lambda ops: [FakeWork(aborted) for _ in ops])
    return transport, log, aborted


def test_an_overdue_transfer_aborts_every_communicator_and_the_next_call_names_the_peer(
        monkeypatch):
    clock, stuck = Clock(), []
    transport, log, _ = fake_nccl(monkeypatch, clock=clock, thread=False, on_stuck=stuck.append)
    (handle,) = transport.batch_isend_irecv([P2POp("recv", torch.zeros(4), 0, 2)])
    handle.wait()  # orders the stream, registers the deadline
    clock.now += 4.9
    transport._watch.poll()
    assert log == []  # not overdue yet
    clock.now += 0.2
    transport._watch.poll()
    assert log == ["lane0", "lane1", "lane2", "group"]  # every communicator, at once
    with pytest.raises(TransportTimeout, match=r"rank 1 waited 5s to receive from rank 0 "
                                               r"\(global rank 3\)") as err:
        transport.batch_isend_irecv([P2POp("send", torch.zeros(4), 0, 1)])
    assert err.value.peer == 0 and err.value.rank == 1
    clock.now += 60
    transport._watch.poll()
    assert stuck == []  # the host got the error: nobody ends the process


def test_a_host_that_never_comes_back_is_ended_once_after_the_grace(monkeypatch):
    clock, stuck = Clock(), []
    transport, log, _ = fake_nccl(monkeypatch, clock=clock, thread=False, grace=10.0,
                                  on_stuck=stuck.append)
    transport.batch_isend_irecv([P2POp("send", torch.zeros(2), 0, 0)])[0].wait()
    clock.now += 5.5
    transport._watch.poll()
    assert len(log) == 4 and stuck == []
    clock.now += 9.0
    transport._watch.poll()
    assert stuck == []
    clock.now += 1.5
    transport._watch.poll()
    transport._watch.poll()
    assert len(stuck) == 1 and isinstance(stuck[0], TransportTimeout)
    assert "send to rank 0" in str(stuck[0])


def test_a_host_blocked_in_a_device_sync_gets_the_timeout_after_the_abort(monkeypatch):
    """The watch thread for real (short interval): the host blocks in a 'CUDA sync' that
    only the abort ends, then its next transport call raises the timeout; the wait of
    the aborted work reports the timeout too, not NCCL's abort error."""
    transport, log, aborted = fake_nccl(monkeypatch, interval=0.01, grace=60.0,
                                        on_stuck=lambda err: None)
    transport.timeout = 0.05
    handles = transport.batch_isend_irecv([P2POp("recv", torch.zeros(1), 0, 0),
                                           P2POp("recv", torch.zeros(1), 0, 1)])
    handles[0].wait()
    ended_by_abort = aborted.wait(timeout=60.0)  # the host's stuck synchronisation
    transport._watch.stop()
    assert ended_by_abort and "group" in log
    with pytest.raises(TransportTimeout, match="receive from rank 0"):
        handles[1].wait()


def test_nccl_ends_a_stuck_process_by_default():
    from pipekernel.transports.device_watch import end_process

    assert DeviceWatch(0, bool).on_stuck is None  # the watch alone ends nothing
    transport = nccl.NcclTransport.__new__(nccl.NcclTransport)
    transport.rank, transport.timeout = 0, 1.0
    transport._global = None
    assert transport._make_watch(1.0, 10.0, thread=False).on_stuck is end_process


def test_the_engine_reports_the_overdue_transfer_not_what_the_abort_caused(monkeypatch):
    """After the watch aborted the communicators the host may hit a CUDA/NCCL error
    anywhere; the rank ends with the transport's TransportTimeout instead."""
    from types import SimpleNamespace

    from pipekernel.engine.faults import root_cause

    clock = Clock()
    transport, _, _ = fake_nccl(monkeypatch, clock=clock, thread=False, on_stuck=lambda e: None)
    transport.batch_isend_irecv([P2POp("recv", torch.zeros(1), 0, 0)])[0].wait()
    engine = SimpleNamespace(transport=transport, abort_board=None)
    assert transport.failure is None
    crash = RuntimeError("CUDA error: an illegal memory access was encountered")
    assert root_cause(crash, engine.transport, engine.abort_board, 0) is crash
    clock.now += 10
    transport._watch.poll()
    cause = root_cause(crash, engine.transport, engine.abort_board, 0)
    assert isinstance(cause, TransportTimeout) and cause.peer == 0


def test_a_bounded_host_wait_that_expires_aborts_the_communicators_too(monkeypatch):
    clock, stuck = Clock(), []
    transport, log, _ = fake_nccl(monkeypatch, clock=clock, thread=False, on_stuck=stuck.append)
    transport.batch_isend_irecv([P2POp("recv", torch.zeros(1), 0, 0)])[0].wait()

    def nap(seconds):
        clock.now += 1.0

    with pytest.raises(TransportTimeout, match="receive from rank 0"):
        transport._watch.synchronize(sleep=nap)
    assert log == ["lane0", "lane1", "lane2", "group"] and transport.failure is not None
    clock.now += 60
    transport._watch.poll()
    assert stuck == [] and log == ["lane0", "lane1", "lane2", "group"]  # once, host informed
