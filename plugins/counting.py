"""A transport wrapper that counts what it sends point to point, for tests and
benchmarks: ``PipelineEngine(..., transport="counting", plugins=[CountingPlugin()])``
runs on gloo and ``engine.transport.sent`` holds the bytes."""
from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import torch

from pipekernel.plugin import hookimpl

__all__ = ["CountingTransport", "CountingPlugin"]



class CountingTransport:
    """A transport wrapper counting the bytes sent point to point (data and control
    lanes, headers and metadata included): ``sent["bytes"]`` in all and
    ``sent[dtype name]`` by dtype. Everything else is the wrapped transport's."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.sent: collections.Counter[str] = collections.Counter()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _count(self, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        self.sent["bytes"] += nbytes
        self.sent[str(tensor.dtype).replace("torch.", "")] += nbytes

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Any:
        self._count(tensor)
        return self.inner.isend(tensor, dst, tag)

    def batch_isend_irecv(self, ops: Sequence[Any]) -> list[Any]:
        for op in ops:
            if op.op == "send":
                self._count(op.tensor)
        return self.inner.batch_isend_irecv(ops)


class CountingPlugin:
    """``transport="counting"``: gloo wrapped in a :class:`CountingTransport`."""

    @hookimpl
    def pipekernel_make_transport(self, name: str, options: dict) -> Any:
        if name != "counting":
            return None
        from pipekernel.transports.gloo import GlooTransport
        return CountingTransport(GlooTransport(**options))
