"""Which launcher started this process, and the world it made.

Like Lightning's cluster environments: each :class:`ClusterEnvironment` reads the
variables one launcher sets and says whether this process is one rank of a world that
launcher made — which rank, of how many, its local rank, and the torchrun variables
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) that world
implies. :func:`detect` asks them in order and returns the first :class:`World`, or
``None`` for a process nobody launched as part of a world (then ``pk.launch`` starts its
own processes).

In order:

* ``process group``: ``torch.distributed`` is already initialised (Ray Train's
  ``TorchTrainer``, a host that called ``init_process_group``): its rank and size.
* ``torchrun``: torchelastic's agent started this process (``TORCHELASTIC_RUN_ID`` with
  ``RANK`` and ``WORLD_SIZE``): torchrun, TorchX, Kubeflow's elastic ``PyTorchJob``.
* ``slurm``: one task of a SLURM job step of several tasks (``srun``: ``SLURM_STEP_ID``,
  ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS`` or ``SLURM_NTASKS`` > 1, ``SLURM_LOCALID``),
  without torchrun's variables. A batch script itself (no step, or step ``batch``) is
  one process, not a world. The rendezvous
  address is ``MASTER_ADDR`` if set, else ``SLURM_LAUNCH_NODE_IPADDR``, else the first
  host of ``SLURM_STEP_NODELIST``/``SLURM_NODELIST``; the port ``MASTER_PORT`` if set, else
  one derived from the job id (every task of the step computes the same).
* ``env``: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set by some other
  launcher (Ray Train's workers before the group exists, Kubeflow's ``PyTorchJob``, a
  hand-written script); ``pk.launch``'s own workers (``PIPEKERNEL_INIT_METHOD`` also
  set) are reported as launcher ``"pk.launch"``.

The environment never changes ``os.environ`` itself: :func:`export` fills in what a
world implies where it is unset, for the transport that initialises the process group.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field

__all__ = ["World", "ClusterEnvironment", "ProcessGroupEnvironment", "TorchElasticEnvironment",
           "SlurmEnvironment", "EnvEnvironment", "ENVIRONMENTS", "detect", "export",
           "first_host"]


@dataclass(frozen=True)
class World:
    """One rank's view of the world a launcher made."""

    #: who made it: ``"process group"``, ``"torchrun"``, ``"slurm"``, ``"env"``, ``"pk.launch"``
    launcher: str
    rank: int
    world_size: int
    local_rank: int
    #: torchrun variables this world implies (set by :func:`export` where unset)
    variables: dict[str, str] = field(default_factory=dict)


class ClusterEnvironment:
    """One launcher: :meth:`detect` whether it started this process, :meth:`world` what it made."""

    name = "?"

    def detect(self, env: Mapping[str, str]) -> bool:
        raise NotImplementedError

    def world(self, env: Mapping[str, str]) -> World:
        raise NotImplementedError


class ProcessGroupEnvironment(ClusterEnvironment):
    """A default process group exists already: whoever made it launched the world."""

    name = "process group"

    def detect(self, env: Mapping[str, str]) -> bool:
        try:
            import torch.distributed as dist
        except ImportError:
            return False
        return dist.is_available() and dist.is_initialized()

    def world(self, env: Mapping[str, str]) -> World:
        import torch.distributed as dist

        return World(self.name, dist.get_rank(), dist.get_world_size(),
                     _int(env, "LOCAL_RANK", 0))


class TorchElasticEnvironment(ClusterEnvironment):
    """torchrun (and what runs it: TorchX, Kubeflow's elastic jobs): its agent's variables."""

    name = "torchrun"

    def detect(self, env: Mapping[str, str]) -> bool:
        return bool(env.get("TORCHELASTIC_RUN_ID")) and "RANK" in env and "WORLD_SIZE" in env

    def world(self, env: Mapping[str, str]) -> World:
        return World(self.name, _int(env, "RANK"), _int(env, "WORLD_SIZE"),
                     _int(env, "LOCAL_RANK", 0))


class SlurmEnvironment(ClusterEnvironment):
    """One task of a SLURM job step of several tasks (``srun``), torchrun not involved."""

    name = "slurm"

    def detect(self, env: Mapping[str, str]) -> bool:
        # srun's tasks only: a batch script (step "batch", or no step) is one process
        # whatever SLURM_NTASKS the allocation has, and starts a job of its own
        step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", ""))
        return ("SLURM_PROCID" in env and step not in ("", "batch", "extern", "4294967294")
                and self._tasks(env) > 1 and "RANK" not in env)

    @staticmethod
    def _tasks(env: Mapping[str, str]) -> int:
        return _int(env, "SLURM_STEP_NUM_TASKS", 0) or _int(env, "SLURM_NTASKS", 1)

    def world(self, env: Mapping[str, str]) -> World:
        rank, size = _int(env, "SLURM_PROCID"), self._tasks(env)
        local = _int(env, "SLURM_LOCALID", 0)
        address = (env.get("MASTER_ADDR") or env.get("SLURM_LAUNCH_NODE_IPADDR")
                   or first_host(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST", ""))
                   or "127.0.0.1")
        job = env.get("SLURM_JOB_ID", "")
        # as Lightning's SLURMEnvironment: a port every task of the job agrees on
        port = env.get("MASTER_PORT") or str(15000 + int(job[-4:]) if job[-4:].isdigit()
                                              else 12910)
        return World(self.name, rank, size, local, {
            "RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
            or str(size), "MASTER_ADDR": address, "MASTER_PORT": port})


class EnvEnvironment(ClusterEnvironment):
    """The torchrun variables set by another launcher (Ray Train, Kubeflow, a script)."""

    name = "env"

    def detect(self, env: Mapping[str, str]) -> bool:
        return all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))

    def world(self, env: Mapping[str, str]) -> World:
        # pk.launch's own workers say so: a launch inside one starts a job of its own
        name = "pk.launch" if env.get("PIPEKERNEL_INIT_METHOD") else self.name
        return World(name, _int(env, "RANK"), _int(env, "WORLD_SIZE"),
                     _int(env, "LOCAL_RANK", 0))


#: Asked in this order; the first that detects its launcher wins.
ENVIRONMENTS: tuple[ClusterEnvironment, ...] = (
    ProcessGroupEnvironment(), TorchElasticEnvironment(), SlurmEnvironment(), EnvEnvironment())


def detect(env: Mapping[str, str] | None = None) -> World | None:
    """The world a launcher made with this process as one rank, or ``None``."""
    env = os.environ if env is None else env
    for environment in ENVIRONMENTS:
        if environment.detect(env):
            return environment.world(env)
    return None


def export(env: MutableMapping[str, str] | None = None) -> World | None:
    """:func:`detect`, then set the variables that world implies where they are unset
    (a SLURM task gets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ... so that
    ``init_process_group("env://")`` joins it). Returns the world."""
    env = os.environ if env is None else env
    world = detect(env)
    if world is not None:
        for key, value in world.variables.items():
            env.setdefault(key, value)
    return world


def first_host(nodelist: str) -> str | None:
    """The first host of a SLURM node list: ``"node[003-005,9],gpu1"`` -> ``"node003"``."""
    nodelist = nodelist.strip()
    if not nodelist:
        return None
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if match is None:
        return None
    prefix, ranges = match.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _int(env: Mapping[str, str], key: str, default: int | None = None) -> int:
    value = env.get(key)
    if value in (None, "") and default is not None:
        return default
    try:
        return int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        from pipekernel.errors import ConfigError

        raise ConfigError(f"environment variable {key}={value!r} is not an integer",
                          hint=f"the launcher sets {key}; unset it or set it to this "
                               "process's number") from None
