"""``CUDA_DEVICE_MAX_CONNECTIONS`` and the lanes of a device transport.

Each lane of ``nccl`` and ``cupy-nccl`` runs its NCCL kernels on a stream of its own,
and a NCCL point-to-point kernel occupies its stream until the peer's matching kernel
runs. A GPU feeds streams through ``CUDA_DEVICE_MAX_CONNECTIONS`` hardware queues
(default 8, at most 32); streams beyond that share queues, and a queue runs its
kernels in launch order. Two lanes on one queue therefore serialise: lane A's
receive, launched first, waits for a peer whose matching send waits for this rank's
lane B operation, queued behind A — a deadlock no schedule proof can see. Megatron-LM's
setting ``CUDA_DEVICE_MAX_CONNECTIONS=1`` puts every stream on one queue.

What the device transports do (chosen because the variable only acts when the CUDA
context is created, and an explicit setting is the user's to change, not ours):

* set explicitly to fewer than ``lanes + 1`` (the lanes' streams plus the compute
  stream): refuse at start with a ``ConfigError`` naming the value needed;
* unset while CUDA is not initialised yet: set it to 32, the maximum, so every lane's
  stream can have a queue of its own;
* unset after CUDA was initialised (the default 8 is in force): warn when ``lanes + 1``
  exceeds 8, naming the fix (set it before the first CUDA call).
"""
from __future__ import annotations

import os
import warnings
from collections.abc import Callable, MutableMapping

from pipekernel.errors import ConfigError

__all__ = ["MAX_CONNECTIONS", "DEFAULT_CONNECTIONS", "check_max_connections"]

#: The hardware maximum and CUDA's default of ``CUDA_DEVICE_MAX_CONNECTIONS``.
MAX_CONNECTIONS, DEFAULT_CONNECTIONS = 32, 8
_NAME = "CUDA_DEVICE_MAX_CONNECTIONS"


def check_max_connections(lanes: int, transport: str,
                          environ: MutableMapping[str, str] | None = None,
                          cuda_initialized: Callable[[], bool] | None = None) -> int:
    """Refuse, fix or warn about ``CUDA_DEVICE_MAX_CONNECTIONS`` for ``lanes`` lanes (see
    the module docstring); returns the connections in force (as far as known).

    :param transport: the transport's name, for messages.
    :param environ: the environment (``os.environ``; a dict in tests).
    :param cuda_initialized: whether the CUDA context exists (``torch.cuda.is_initialized``).
    """
    environ = os.environ if environ is None else environ
    if cuda_initialized is None:
        import torch

        cuda_initialized = torch.cuda.is_initialized
    needed = lanes + 1
    given = environ.get(_NAME)
    if given is not None:
        try:
            value = int(given)
        except ValueError:
            raise ConfigError(f"{_NAME}={given!r} is not a number",
                              hint=f"set it to an integer >= {needed} (at most "
                                   f"{MAX_CONNECTIONS}) or unset it") from None
        if value < needed:
            raise ConfigError(
                f"transport {transport!r} runs {lanes} lane(s) on streams of their own, and "
                f"{_NAME}={value} gives them fewer hardware queues than lanes + 1 = {needed}: "
                f"lanes' NCCL kernels would serialise on a shared queue and can deadlock",
                hint=f"unset {_NAME} (pipekernel then uses {MAX_CONNECTIONS}) or set it to at "
                     f"least {needed} before CUDA starts; lower transport_options lanes= only "
                     f"if the schedule needs fewer")
        return value
    if not cuda_initialized():
        environ[_NAME] = str(MAX_CONNECTIONS)
        return MAX_CONNECTIONS
    if needed > DEFAULT_CONNECTIONS:
        warnings.warn(
            f"transport {transport!r}: CUDA started before it with {_NAME} unset (default "
            f"{DEFAULT_CONNECTIONS} hardware queues) for {lanes} lanes + the compute stream; "
            f"lanes sharing a queue can deadlock. Set {_NAME}={MAX_CONNECTIONS} in the "
            f"environment before the first CUDA call", RuntimeWarning, stacklevel=3)
    return DEFAULT_CONNECTIONS
