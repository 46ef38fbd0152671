"""Communication: the Transport protocol, the wire format (tensor metadata), collectives,
agreement across ranks, attempt-keyed stores (the conformance suite:
``pipekernel.testing.conformance``).

This package's own names are the stable import path for **transport authors** (a plugin
author sees a transport only through :class:`Transport` and :class:`Handle`, which
``pipekernel.plugin`` also offers): the contract (:class:`Transport`, :class:`Handle`,
:class:`P2POp`, :func:`wait_sliced`) and the plumbing a transport on ``torch.distributed``
needs: :data:`TORCH_REDUCE_OPS`, the restart attempt (:func:`attempt`,
:func:`attempt_prefix`, :func:`keyed_store`) and :func:`bind_defaults_before_init`. The
conformance suite every transport passes is ``pipekernel.testing.check_transport`` (on
ranks it starts) and ``pipekernel.testing.run_transport_conformance`` (on yours).
Submodules (``pipekernel.comm.wire`` and the like) are internal and may move.
"""
from pipekernel.comm.attempt import attempt, attempt_prefix, keyed_store
from pipekernel.comm.collectives import TORCH_REDUCE_OPS
from pipekernel.comm.teardown import bind_defaults_before_init
from pipekernel.comm.transport import Handle, P2POp, Transport, wait_sliced

__all__ = ["Transport", "Handle", "P2POp", "wait_sliced", "TORCH_REDUCE_OPS", "attempt",
           "attempt_prefix", "keyed_store", "bind_defaults_before_init"]
