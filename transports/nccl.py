"""The nccl transport: CUDA tensors over ``torch.distributed`` with the NCCL backend.

Each process uses the GPU ``cuda:LOCAL_RANK`` (torchrun's contract). Point-to-
point transfers carry a byte view of the tensor, as for gloo, so bool and every
other dtype cross stages bit-exactly although NCCL has no bool type — the
conversion lives here, never in the core.
"""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from pipekernel.errors import ConfigError
from pipekernel.transports.gloo import TorchDistributedTransport

__all__ = ["NcclTransport"]


class NcclTransport(TorchDistributedTransport):
    """GPU transport over NCCL (see :class:`TorchDistributedTransport` for options)."""

    backend = "nccl"
    #: NCCL's wait() orders the current stream and does not block the host: keep it
    #: (polling is_completed() would synchronise the device on every transfer). So on
    #: NCCL an abort is seen only by waits that poll (a gloo host lane, when there is one);
    #: otherwise a failure still ends every rank within the timeout.
    polls = False

    def __init__(self, timeout: float = 300.0, group: Any = None, **options: Any) -> None:
        if not torch.cuda.is_available():
            raise ConfigError("transport 'nccl' needs CUDA, and torch.cuda.is_available() is False",
                              hint="use transport='gloo' (or 'auto') on machines without a GPU")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if local >= torch.cuda.device_count():
            raise ConfigError(f"LOCAL_RANK={local} but only {torch.cuda.device_count()} GPU(s) "
                              "are visible",
                              hint="start at most one process per GPU on each node")
        self._cuda = torch.device("cuda", local)
        torch.cuda.set_device(self._cuda)
        lanes = int(options.pop("lanes", 8))
        super().__init__(timeout, group, **options)
        self._make_lanes(lanes)

    def _make_lanes(self, count: int) -> None:
        """NCCL has no tags and runs a communicator's operations in order, so each lane
        (tag) is its own process group, hence its own communicators and streams. Every
        rank creates them at construction, in the same order (``new_group`` is
        collective); NCCL initialises a pair's communicator lazily at its first use."""
        ranks = dist.get_process_group_ranks(self.group) if self.group is not None \
            else list(range(dist.get_world_size()))
        self._lanes = [self.group] + [dist.new_group(ranks) for _ in range(count - 1)]
        self.max_tags = count
        # The wire's headers and metadata changes ride on a host lane, so the hot path
        # never reads device memory (see pipekernel.wire).
        from pipekernel.transports.gloo import GlooTransport

        self.control = GlooTransport(timeout=self.timeout,
                                     group=dist.new_group(ranks, backend="gloo"))

    def _post(self, fn, tensor: torch.Tensor, peer: int, what: str, tag: int = 0) -> Any:
        if not 0 <= tag < self.max_tags:
            raise ConfigError(f"nccl transport has {self.max_tags} lanes, tag {tag} asked for",
                              hint="raise transport_options={'lanes': ...}")
        group, self.group = self.group, self._lanes[tag]
        try:
            return super()._post(fn, tensor, peer, what, 0)
        finally:
            self.group = group

    def _init_options(self) -> dict[str, Any]:
        return {"device_id": self._cuda}  # binds the communicator to this GPU eagerly

    def _device(self) -> torch.device:
        return self._cuda
