"""The staged transport: device tensors staged through host memory over gloo.

NCCL refuses two ranks on one GPU, so a pipeline of several stages cannot run
on one GPU with ``nccl`` or ``cupy-nccl``. ``transport="staged"`` can: every
rank uses the same GPU (``cuda:LOCAL_RANK % device_count``), a send copies the
tensor to host memory and sends it over gloo, a receive lands in host memory
and is copied to the receiver's device when waited on. It is for tests and
parity checks on one GPU (``gpu/check.sh``), not for speed: every transfer
synchronises the device.

Without CUDA (or with ``device="cpu"``) it runs the same staging on CPU tensors
— separate host buffers, copied in at ``wait()`` — which is how its logic is
tested on machines without a GPU. Everything else (timeouts, aborts, subgroups,
lanes) is the gloo transport's.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from pipekernel.errors import ConfigError
from pipekernel.transports.gloo import GlooTransport

__all__ = ["StagedTransport"]


class _StagedHandle:
    """A gloo transfer of a host copy; ``then`` runs once, after the first ``wait()``."""

    __slots__ = ("_inner", "_then", "_keep")

    def __init__(self, inner: Any, keep: torch.Tensor, then: Callable[[], object] | None = None):
        self._inner, self._keep, self._then = inner, keep, then

    def is_completed(self) -> bool:
        # a receive is complete only once its data reached the device tensor
        return self._then is None and self._inner.is_completed()

    def wait(self) -> None:
        self._inner.wait()
        if self._then is not None:
            then, self._then = self._then, None
            then()


class StagedTransport(GlooTransport):
    """gloo between host copies of device tensors (see the module docstring).

    :param device: where the caller's tensors live (default: ``cuda:LOCAL_RANK %
        device_count`` with CUDA, else ``"cpu"``). Other options: as for gloo.
    """

    def __init__(self, timeout: float = 300.0, group: Any = None, device: Any = None,
                 **options: Any) -> None:
        self._staged_device = _pick_device(device)
        if self._staged_device.type == "cuda":
            torch.cuda.set_device(self._staged_device)
        super().__init__(timeout, group, **options)

    def _device(self) -> torch.device:
        return self._staged_device

    @staticmethod
    def _host(tensor: torch.Tensor) -> torch.Tensor:
        """A host copy (always a copy, also of a CPU tensor: the staging is the same)."""
        return torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor.detach())

    # -- point to point ----------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> _StagedHandle:
        host = self._host(tensor)
        return _StagedHandle(super().isend(host, dst, tag), host)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> _StagedHandle:
        host = torch.empty(tensor.shape, dtype=tensor.dtype)
        return _StagedHandle(super().irecv(host, src, tag), host,
                             lambda: tensor.copy_(host))

    # -- collectives ---------------------------------------------------------------------
    def iall_reduce(self, tensor: torch.Tensor, op: str = "sum", group: Any = None
                    ) -> _StagedHandle:
        host = self._host(tensor)
        return _StagedHandle(super().iall_reduce(host, op, group), host,
                             lambda: tensor.copy_(host))

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", group: Any = None) -> None:
        self.iall_reduce(tensor, op, group).wait()

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any = None) -> None:
        host = self._host(tensor)
        super().broadcast(host, src, group)
        tensor.copy_(host)

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor, group: Any = None) -> None:
        """Optional member: every member's ``tensor`` into ``out`` (shape ``(group size,
        *tensor.shape)``) in group-rank order; blocking; through host copies."""
        import torch.distributed as dist

        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        host_out = torch.empty(out.shape, dtype=out.dtype)
        # flat views: gloo checks each chunk of the output against the input's shape
        self._collective("all_gather", group, gather, host_out.view(-1),
                         self._host(tensor).view(-1)).wait()
        out.copy_(host_out)


def _pick_device(device: Any) -> torch.device:
    if device is None:
        if not torch.cuda.is_available():
            return torch.device("cpu")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", local % torch.cuda.device_count())
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ConfigError(f"staged transport: device={device!r} is not a device: {err}",
                          hint="use 'cpu', 'cuda' or 'cuda:N'") from err
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"staged transport: device={device} but CUDA is not available",
                              hint="leave device unset (CPU without CUDA) or run on a GPU")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        raise ConfigError(f"staged transport: device type {device.type!r} is not supported",
                          hint="use 'cpu' or 'cuda[:N]'")
    return device
