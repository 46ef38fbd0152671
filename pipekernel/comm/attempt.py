"""Which attempt of a job this process belongs to, and the store keys that go with it.

``torchrun --max-restarts N`` restarts every worker of a job when one fails. With the c10d
rendezvous backend the restarted workers meet again in the agent's TCP store, the same
store the failed attempt used, and torch names its process groups the same way in every
attempt: the keys a group's ranks publish their gloo addresses under (``default_pg/0/...``,
then one per ``new_group``) are the dead attempt's until the new rank overwrites them. A
restarted rank that reads one first connects to a dead port (``Gloo connectFullMesh failed
... Connection refused`` or ``Connect timeout``; seen in 3 of 5 runs of a plain torch
script with one ``new_group`` and one killed rank, torch 2.13).

So everything pipekernel keeps in a job's store lives under :func:`attempt_prefix`, which
names the run and the attempt under torchelastic (``TORCHELASTIC_RUN_ID``,
``TORCHELASTIC_RESTART_COUNT``): the process group a transport creates (and with it every
``new_group``, lane and control lane, whose keys go under the default group's store), the
abort board, and cupy-nccl's communicator ids. A restarted world never reads a dead
attempt's key.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

__all__ = ["attempt", "attempt_prefix", "keyed_store", "store_host"]


def attempt(environ: Mapping[str, str] | None = None) -> tuple[str, int] | None:
    """``(run id, restart count)`` under torchelastic (``torchrun``), else ``None``."""
    env = os.environ if environ is None else environ
    count = env.get("TORCHELASTIC_RESTART_COUNT")
    if count is None:
        return None
    return env.get("TORCHELASTIC_RUN_ID", "none"), int(count)


def attempt_prefix(environ: Mapping[str, str] | None = None) -> str:
    """The store prefix of this attempt: ``pipekernel/run/<run id>/attempt/<n>`` under
    torchelastic, ``pipekernel`` otherwise. Every rank of one attempt gets the same one."""
    current = attempt(environ)
    if current is None:
        return "pipekernel"
    run_id, count = current
    return f"pipekernel/run/{run_id}/attempt/{count}"


def keyed_store(store: Any, environ: Mapping[str, str] | None = None) -> Any:
    """``store`` seen through this attempt's prefix (a ``torch.distributed.PrefixStore``)."""
    import torch.distributed as dist

    return dist.PrefixStore(attempt_prefix(environ) + "/", store)


def store_host(environ: Mapping[str, str] | None = None) -> int | None:
    """The rank whose process serves the default process group's store, when it is one
    of the job's ranks: rank 0 for a raw ``env://`` launch (``MASTER_ADDR``/``PORT``
    without torchrun's agent, which serves it otherwise); ``None`` under torchrun's agent
    or with a file store (``pk.launch``), whose store outlives any rank."""
    env = os.environ if environ is None else environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or env.get("PIPEKERNEL_INIT_METHOD"):
        return None
    if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        return None
    return 0
