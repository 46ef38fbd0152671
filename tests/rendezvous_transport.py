"""A CPU transport with NCCL's point-to-point rules, to run real pipelines under them.

gloo buffers small sends and runs every posted op concurrently, so a schedule
that would deadlock on NCCL trains fine on gloo. This transport puts NCCL's rules
on top of gloo:

* **rendezvous**: a send's data leaves only once the receiver posted the matching
  receive (the receiver sends a ready token on a side group first);
* **in order per peer**: a rank's operations with one peer run one group after
  the other, like kernels on one NCCL stream; the ops of one group to one peer
  progress together (its receives announce themselves before its sends wait).

Selected in tests with ``plugins=[RendezvousPlugin()]`` and ``transport="rendezvous"``.
"""
from __future__ import annotations

import queue
import threading

import torch
import torch.distributed as dist

import pipekernel as pk
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
        self._queues: dict[int, queue.Queue] = {}
        self._lock = threading.Lock()
        self.groups_posted: list[list[tuple[str, int]]] = []

    def _queue(self, peer):
        with self._lock:
            if peer not in self._queues:
                self._queues[peer] = queue.Queue()
                threading.Thread(target=self._worker, args=(peer,), daemon=True).start()
            return self._queues[peer]

    def batch_isend_irecv(self, ops):
        self.groups_posted.append([(op.op, op.peer) for op in ops])
        return self._post_group(ops)

    def _post_group(self, ops):
        futures = [_Future(self, op.peer, "send to" if op.op == "send" else "receive from")
                   for op in ops]
        by_peer: dict[int, list] = {}
        for op, future in zip(ops, futures):
            by_peer.setdefault(op.peer, []).append((op, future))
        for peer, unit in by_peer.items():
            self._queue(peer).put(unit)
        return futures

    def isend(self, tensor, dst):
        return self._post_group([pk.P2POp("send", tensor, dst)])[0]

    def irecv(self, tensor, src):
        return self._post_group([pk.P2POp("recv", tensor, src)])[0]

    def _worker(self, peer):
        token = torch.zeros(1, dtype=torch.uint8)
        while True:
            unit = self._queue(peer).get()
            if unit is None:
                return
            try:
                works = []  # gloo's sends complete only once received: never wait on a token
                for op, _ in unit:  # announce every receive of the unit first
                    if op.op == "recv":
                        works.append(dist.isend(token, peer, group=self._tokens))
                        works.append(super().irecv(op.tensor, peer))
                for op, _ in unit:  # then each send waits for its receiver
                    if op.op == "send":
                        ready = torch.empty(1, dtype=torch.uint8)
                        work = dist.irecv(ready, peer, group=self._tokens)
                        if not work.wait(_seconds(self.timeout)):
                            raise TransportTimeout(f"rank {self.rank}: rank {peer} never posted "
                                                   "the receive of a send", peer=peer,
                                                   rank=self.rank)
                        works.append(super().isend(op.tensor, peer))
                for work in works:
                    work.wait()
                for _, future in unit:
                    future._set()
            except BaseException as err:  # noqa: BLE001 - handed to the waiter
                if not isinstance(err, TransportError):
                    err = TransportError(f"rank {self.rank} failed to talk to rank {peer}: {err}",
                                         rank=self.rank)
                for _, future in unit:
                    future._set(err)

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
