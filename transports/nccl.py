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

from pipekernel.errors import ConfigError
from pipekernel.transports.gloo import TorchDistributedTransport

__all__ = ["NcclTransport"]


class NcclTransport(TorchDistributedTransport):
    """GPU transport over NCCL (see :class:`TorchDistributedTransport` for options)."""

    backend = "nccl"

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
        super().__init__(timeout, group, **options)

    def _init_options(self) -> dict[str, Any]:
        return {"device_id": self._cuda}  # binds the communicator to this GPU eagerly

    def _device(self) -> torch.device:
        return self._cuda
