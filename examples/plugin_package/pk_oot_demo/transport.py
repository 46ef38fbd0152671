"""The ``counting`` transport: gloo underneath, counting what is sent point-to-point."""
from __future__ import annotations

from pipekernel.transports.gloo import GlooTransport


class CountingTransport:
    """A :class:`pipekernel.plugin.Transport` that delegates to gloo and counts.

    pipekernel calls the entry point with keyword options (``timeout`` and the
    engine's ``transport_options``).
    """

    def __init__(self, timeout: float = 300.0, **options):
        self.inner = GlooTransport(timeout=timeout, **options)
        self.rank, self.world_size = self.inner.rank, self.inner.world_size
        self.device = self.inner.device
        self.messages = 0
        self.bytes = 0

    @property
    def timeout(self) -> float:
        return self.inner.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self.inner.timeout = seconds

    @property
    def max_tags(self) -> int:
        return self.inner.max_tags

    def isend(self, tensor, dst, tag=0):
        self.messages += 1
        self.bytes += tensor.numel() * tensor.element_size()
        return self.inner.isend(tensor, dst, tag)

    def irecv(self, tensor, src, tag=0):
        return self.inner.irecv(tensor, src, tag)

    def batch_isend_irecv(self, ops):
        sends = [op.tensor for op in ops if op.op == "send"]
        self.messages += len(sends)
        self.bytes += sum(t.numel() * t.element_size() for t in sends)
        return self.inner.batch_isend_irecv(ops)

    def all_reduce(self, tensor, op="sum", group=None):
        self.inner.all_reduce(tensor, op, group)

    def iall_reduce(self, tensor, op="sum", group=None):
        return self.inner.iall_reduce(tensor, op, group)

    def broadcast(self, tensor, src, group=None):
        self.inner.broadcast(tensor, src, group)

    def barrier(self, group=None):
        self.inner.barrier(group)

    def new_group(self, ranks):
        return self.inner.new_group(ranks)

    def close(self):
        self.inner.close()
