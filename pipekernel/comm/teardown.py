"""An orderly end for ``torch.distributed``: gloo's threads joined while Python is alive.

A gloo worker thread that drops a collective's last reference to a tensor needs the GIL.
While the interpreter finalizes, taking it ends the thread with ``pthread_exit``, whose
unwinding through C++ frames aborts the process: "terminate called without an active
exception", now and then, at the very end of a run that trained correctly. So every
process group a pipekernel transport ran on is destroyed in an ``atexit`` hook (the
transports do that: ``pipekernel.transports.gloo``), and destroying must really free it:
see :func:`bind_defaults_before_init`, which importing this module runs.
"""
from __future__ import annotations

__all__ = ["bind_defaults_before_init"]


def bind_defaults_before_init() -> None:
    """Import ``torch.distributed.nn.functional`` while no process group exists.

    Its collectives take ``group=group.WORLD`` as a default argument, evaluated when
    the module is first imported, and torch imports it lazily (through
    ``torch._dynamo``, e.g. when the first optimizer is built). Imported *after*
    ``init_process_group``, those defaults hold the default group for good:
    ``destroy_process_group()`` then frees nothing, gloo's worker threads outlive
    ``close()``, and one of them dropping a finished collective's tensor while the
    interpreter finalizes aborts the process. Imported first, the defaults are ``None``.
    ``import pipekernel`` runs this, so a host that creates its process group after
    importing pipekernel (``pipekernel.deepspeed.init_distributed``, a script's own
    ``init_process_group``) gets a group that its destruction frees.
    """
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return  # too late: importing it now would pin the group
        import torch.distributed.nn.functional  # noqa: F401
    except ImportError:  # a torch without it cannot leak through it either
        pass


bind_defaults_before_init()
