"""The one :class:`~torch.distributed.device_mesh.DeviceMesh` of an engine: the axes that
torch's parallel libraries (FSDP2, DTensor) compose inside each pipeline stage.

The mesh has the named dims ``("pp", "dp_replicate", "dp_shard", "tp")`` in that order,
size-1 dims included (so code can always index ``mesh["tp"]``). It lays today's rank
order over them (:mod:`pipekernel.grid.topology`, ``rank_map`` unchanged): for stage
``s``, replica ``r``, shard ``h`` and tensor-parallel rank ``t`` the mesh holds the rank
``topology.rank_of(r * shard_size + h, s, t)``, so under the default ``"tp-dp-pp"`` the
shards of one replica are adjacent ranks (between tensor-parallel groups and replicas).

Which group does what:

* ``mesh["dp_shard"]`` — FSDP2 shards a stage's parameters, gradients and optimizer state
  over it (``data_parallel_shard=N``); ``mesh["dp_replicate", "dp_shard"]`` is FSDP2's
  HSDP mesh when both are > 1;
* ``mesh["tp"]`` — tensor parallelism (pipekernel's own layers and DTensor plans);
* the **data group** (every data-parallel rank of one (stage, tp) position, replicas x
  shards: ``Grid.data``) — the mean of the gradients of what FSDP2 does not shard (the
  replicated parameters: tied layers, a stage without ``data_parallel_shard``), the
  ZeRO-1 optimizer shards;
* ``mesh["pp"]`` — not used for activations (the pipeline's lanes carry those, see
  :mod:`pipekernel.schedules.lanes`); it is there so that every rank's coordinates are in
  one object, as torchtitan's mesh has them.

Tied layers reduce over the stages that hold them: a subset of ``pp``, groups of their own.

The mesh needs torch process groups: it is built when the transport spans the whole
``torch.distributed`` world with the default group's backend (``gloo``, ``nccl``); for any
other transport (``cupy-nccl``, a transport over a subgroup, a test double) ``Grid.mesh``
is ``None``, the groups come from ``transport.new_group`` as before, and whatever needs
the mesh (FSDP2, DTensor plans) refuses with a :class:`~pipekernel.errors.ConfigError`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipekernel.errors import ConfigError

__all__ = ["MESH_DIMS", "Grid", "build_grid", "local_share", "mesh_ranks",
           "mesh_unavailable"]

#: The named dims of ``engine.mesh``, outermost first.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


def mesh_ranks(topology: Any) -> list:
    """The ranks of the mesh as a nested list of shape ``(P, R, S, T)`` (see the module
    docstring): transport ranks, global when the transport spans the world."""
    shard = topology.shard_size
    return [[[[topology.rank_of(r * shard + h, s, t) for t in range(topology.model_size)]
              for h in range(shard)] for r in range(topology.replicate_size)]
            for s in range(topology.pipe_size)]


def _dim_groups(topology: Any, dim: str) -> list[list[int]]:
    """Every group of ranks along ``dim`` of the mesh, or along ``"dp"`` (replicas x
    shards), in a fixed order (the same on every rank)."""
    import itertools

    sizes = (topology.pipe_size, topology.replicate_size, topology.shard_size,
             topology.model_size)
    along = (1, 2) if dim == "dp" else (MESH_DIMS.index(dim),)
    rest = [d for d in range(4) if d not in along]

    def rank(at: dict[int, int]) -> int:
        return topology.rank_of(at[1] * topology.shard_size + at[2], at[0], at[3])

    groups = []
    for fixed in itertools.product(*(range(sizes[d]) for d in rest)):
        groups.append([rank({**dict(zip(rest, fixed)), **dict(zip(along, moving))})
                       for moving in itertools.product(*(range(sizes[d]) for d in along))])
    return groups


def _mine(topology: Any, dim: str) -> list[int]:
    return next(g for g in _dim_groups(topology, dim) if topology.rank in g)


@dataclass
class Grid:
    """This rank's groups: the mesh (or ``None``) and, per dim (and ``"dp"``), the
    ``(handle, ranks)`` of the group holding this rank, the handle being what the
    transport's collectives take (``None`` for a one-rank group)."""

    mesh: Any
    groups: dict[str, tuple[Any, list[int]]] = field(default_factory=dict)
    why_no_mesh: str = ""

    @property
    def data(self) -> tuple[Any, list[int]]:
        """The data-parallel group (replicas x shards of this rank's stage position)."""
        return self.groups["dp"]

    def require_mesh(self, what: str, rank: int | None = None) -> Any:
        """The mesh, or a ``ConfigError`` saying why there is none and what needs it."""
        if self.mesh is None:
            raise ConfigError(f"{what} needs a torch DeviceMesh, and this engine has none: "
                              f"{self.why_no_mesh}",
                              hint="use transport='gloo' or 'nccl' over the whole job (no "
                                   "transport_options group=)", rank=rank)
        return self.mesh


def mesh_unavailable(transport: Any) -> str:
    """Why ``transport`` cannot carry a DeviceMesh (``""``: it can)."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed
        return "torch.distributed is not available"
    if not (dist.is_available() and dist.is_initialized()):
        return "torch.distributed is not initialised"
    name = getattr(transport, "backend", None)
    if name != dist.get_backend():
        return (f"transport {name or type(transport).__name__!r} does not run its "
                f"collectives on torch.distributed's default group ({dist.get_backend()!r})")
    if getattr(transport, "group", None) is not None or \
            transport.world_size != dist.get_world_size():
        return (f"the transport spans {transport.world_size} of the job's "
                f"{dist.get_world_size()} ranks (transport_options group=)")
    return ""


def build_grid(topology: Any, transport: Any, unwanted: str = "") -> Grid:
    """Create the mesh and this rank's groups (collective: every rank calls it in the same
    order as the engine's other groups). ``unwanted``: why no mesh is needed (nothing in
    the stage applies torch parallelism), then only the groups the engine uses are made —
    a DeviceMesh keeps its process groups referenced for good, so ``destroy_process_group``
    could not free them and their gloo threads would outlive the engine (the exit abort
    of ``tests/test_exit.py``)."""
    why = unwanted or mesh_unavailable(transport)
    if why:
        return Grid(None, _transport_groups(topology, transport), why)
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    device_type = torch.device(transport.device).type
    mesh = DeviceMesh(device_type, torch.tensor(mesh_ranks(topology), dtype=torch.int),
                      mesh_dim_names=MESH_DIMS)
    groups: dict[str, tuple[Any, list[int]]] = {}
    for dim in MESH_DIMS:
        ranks = _mine(topology, dim)
        groups[dim] = (mesh.get_group(dim) if len(ranks) > 1 else None, ranks)
    ranks = _mine(topology, "dp")
    if topology.replicate_size > 1 and topology.shard_size > 1:
        flat = mesh["dp_replicate", "dp_shard"]._flatten("dp")
        groups["dp"] = (flat.get_group(), ranks)
    else:  # one of the two dims holds every data-parallel rank
        one = "dp_shard" if topology.shard_size > 1 else "dp_replicate"
        groups["dp"] = (groups[one][0], ranks)
    return Grid(mesh, groups)


def _transport_groups(topology: Any, transport: Any) -> dict[str, tuple[Any, list[int]]]:
    """Without a mesh: this rank's groups from ``transport.new_group`` (every group of
    more than one rank created on every rank, in the same order)."""
    groups: dict[str, tuple[Any, list[int]]] = {}
    made: dict[tuple[int, ...], Any] = {}
    for dim in ("dp", "tp"):
        for ranks in _dim_groups(topology, dim):
            key = tuple(sorted(ranks))
            if len(ranks) > 1 and key not in made:
                made[key] = transport.new_group(ranks)
            if topology.rank in ranks:
                groups[dim] = (made.get(key), ranks)
    for dim in ("pp", "dp_replicate", "dp_shard"):  # not used without a mesh: ranks only
        groups[dim] = (None, _mine(topology, dim))
    return groups


def local_share(tensor: Any, tp_rank: int = 0) -> Any:
    """What of a DTensor this rank counts in a global sum of squares (a norm): its local
    shard, or ``None`` where that is a copy of another rank's (a ``Replicate`` dim at a
    coordinate other than 0, or a DTensor whose mesh lacks the ``tp`` dim on a
    tensor-parallel rank other than ``0``: FSDP2 alone shards a layer outside the plan the
    same way on every tensor-parallel rank); ``False`` for a plain tensor (the caller
    decides)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return False
    if not isinstance(tensor, DTensor):
        return False
    mesh = tensor.device_mesh
    if tp_rank != 0 and "tp" not in (mesh.mesh_dim_names or ()):
        return None
    for dim, placement in enumerate(tensor.placements):
        if placement.is_replicate() and mesh.get_local_rank(dim) != 0:
            return None
    return tensor.to_local()
