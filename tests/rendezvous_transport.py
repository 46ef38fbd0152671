"""A CPU transport with NCCL's point-to-point rules, to run real pipelines under them.

gloo buffers small sends and runs every posted op concurrently, so a schedule
that would deadlock on NCCL trains fine on gloo. This transport puts NCCL's rules
on top of gloo:

* **rendezvous**: a send's data leaves only once the receiver posted the matching
  receive (the receiver sends a ready token on a side group first);
* **one ordered stream per lane, whatever the peer**: a rank's operations on one
  tag run one group after the other, like kernels on one NCCL communicator's stream
  (a lane is a communicator, see ``pipekernel.comm.transport``): a receive from rank 1
  posted before a send to rank 3 on the same tag holds that send back; the ops of
  one group on one lane, to any peers, progress together (its receives announce
  themselves before its sends wait, and each send waits for its own receiver
  on a thread of its own, so no peer of the group waits for another).

Selected in tests with ``plugins=[RendezvousPlugin()]`` and ``transport="rendezvous"``.
"""
from __future__ import annotations

import queue
import threading

import torch
import torch.distributed as dist

import pipekernel as pk
from pipekernel.comm import P2POp
from pipekernel.errors import TransportError, TransportTimeout
from pipekernel.transports.gloo import GlooTransport


class _Future:
    def __init__(self, transport, peer, what):
        self._event, self._error = threading.Event(), None
        self._transport, self._peer, self._what = transport, peer, what

    def _set(self, error=None):
        self._error = error
        self._event.set()

    def is_completed(self):
        return self._event.is_set()

    def wait(self):
        if not self._event.wait(self._transport.timeout + 5):
            raise TransportTimeout(f"rank {self._transport.rank} waited "
                                   f"{self._transport.timeout:g}s to {self._what} rank "
                                   f"{self._peer} (rendezvous)", peer=self._peer,
                                   rank=self._transport.rank)
        if self._error is not None:
            raise self._error


class RendezvousTransport(GlooTransport):
    def __init__(self, timeout: float = 300.0, **options):
        super().__init__(timeout=timeout, **options)
        self._tokens = dist.new_group(list(range(self.world_size)))  # ready tokens
        # A transport whose pairs run in order needs a host lane for the wire's headers
        # and metadata changes (see pipekernel.comm.wire): a plain gloo group.
        self.control = GlooTransport(timeout=timeout,
                                     group=dist.new_group(list(range(self.world_size))))
        self._queues: dict[int, queue.Queue] = {}
        self._lock = threading.Lock()
        self.groups_posted: list[list[tuple[str, int]]] = []

    def _queue(self, tag):
        with self._lock:
            if tag not in self._queues:
                self._queues[tag] = queue.Queue()
                threading.Thread(target=self._worker, args=(tag,), daemon=True).start()
            return self._queues[tag]

    def batch_isend_irecv(self, ops):
        self.groups_posted.append([(op.op, op.peer) for op in ops])
        return self._post_group(ops)

    def _post_group(self, ops):
        futures = [_Future(self, op.peer, "send to" if op.op == "send" else "receive from")
                   for op in ops]
        by_lane: dict[int, list] = {}
        for op, future in zip(ops, futures):
            by_lane.setdefault(op.tag, []).append((op, future))
        for tag, unit in by_lane.items():
            self._queue(tag).put(unit)
        return futures

    def isend(self, tensor, dst, tag=0):
        return self._post_group([P2POp("send", tensor, dst, tag)])[0]

    def irecv(self, tensor, src, tag=0):
        return self._post_group([P2POp("recv", tensor, src, tag)])[0]

    def _worker(self, tag):
        """Run lane ``tag``'s units one after the other (one NCCL communicator)."""
        while True:
            unit = self._queue(tag).get()
            if unit is None:
                return
            try:
                self._run_unit(unit, tag)
                for _, future in unit:
                    future._set()
            except BaseException as err:  # noqa: BLE001 - handed to the waiter
                if not isinstance(err, TransportError):
                    err = TransportError(f"rank {self.rank} failed on lane {tag}: {err}",
                                         rank=self.rank)
                for _, future in unit:
                    future._set(err)

    def _run_unit(self, unit, tag):
        """One group's ops on one lane, to any peers, progressing together."""
        token = torch.zeros(1, dtype=torch.uint8)
        works = []  # gloo's sends complete only once received: never wait on a token
        for op, _ in unit:  # announce every receive of the unit first
            if op.op == "recv":
                works.append(dist.isend(token, op.peer, group=self._tokens, tag=tag))
                works.append(GlooTransport.irecv(self, op.tensor, op.peer, tag))
        sends: dict[int, list] = {}  # peer -> its sends, in order (FIFO per pair and tag)
        for op, _ in unit:
            if op.op == "send":
                sends.setdefault(op.peer, []).append(op)
        errors = []

        def send(peer, ops):  # waits for its receiver's tokens, whatever the other peers do
            try:
                for op in ops:
                    ready = torch.empty(1, dtype=torch.uint8)
                    work = dist.irecv(ready, peer, group=self._tokens, tag=tag)
                    if not work.wait(_seconds(self.timeout)):
                        raise TransportTimeout(f"rank {self.rank}: rank {peer} never posted "
                                               "the receive of a send", peer=peer,
                                               rank=self.rank)
                    works.append(GlooTransport.isend(self, op.tensor, peer, tag))
            except BaseException as err:  # noqa: BLE001 - raised below
                errors.append(err)

        if len(sends) == 1:
            send(*next(iter(sends.items())))
        else:
            threads = [threading.Thread(target=send, args=item, daemon=True)
                       for item in sends.items()]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        if errors:
            raise errors[0]
        for work in works:
            work.wait()

    def close(self):
        for q in list(self._queues.values()):
            q.put(None)
        super().close()


def _seconds(value):
    import datetime
    return datetime.timedelta(seconds=value)


class RendezvousPlugin:
    """Publishes ``transport="rendezvous"`` for one engine."""

    @pk.hookimpl
    def pipekernel_make_transport(self, name, options):
        if name == "rendezvous":
            return RendezvousTransport(**options)
        return None
