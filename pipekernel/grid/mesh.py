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
Nor is it built when nothing in the stage applies torch parallelism (:func:`build_grid`).

At the engine's close the mesh's groups are destroyed and freed (:meth:`Grid.close`,
:func:`release_mesh`): none stays registered in ``torch.distributed``, no gloo thread of
theirs outlives the engine, and a later engine in the same world builds a mesh of its own.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipekernel.errors import ConfigError

__all__ = ["MESH_DIMS", "Grid", "build_grid", "local_share", "mesh_groups", "mesh_ranks",
           "mesh_unavailable", "release_mesh", "forget_meshes",
           "drop_destroyed", "is_registered"]

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

    def close(self) -> None:
        """Destroy every process group the mesh created (its dims', the flattened
        ``"dp"``) and drop this grid's references to them (local, no collective; see
        :func:`release_mesh`). The groups from ``transport.new_group`` (no mesh) are the
        transport's. Afterwards ``mesh`` is ``None`` and ``groups`` empty."""
        mesh, self.mesh, self.groups = self.mesh, None, {}
        if mesh is not None:
            release_mesh(mesh)
            self.why_no_mesh = "the engine was closed"

    def require_mesh(self, what: str, rank: int | None = None) -> Any:
        """The mesh, or a ``ConfigError`` saying why there is none and what needs it."""
        if self.mesh is None:
            raise ConfigError(f"{what} needs a torch DeviceMesh, and this engine has none: "
                              f"{self.why_no_mesh}",
                              hint="use transport='gloo' or 'nccl' over the whole job (no "
                                   "transport_options group=)", rank=rank)
        return self.mesh


def mesh_groups(mesh: Any) -> list[Any]:
    """The process groups ``mesh`` holds (its root's registry: every dim's group and every
    flattened dim's), the default group included where a dim spans the world."""
    root = mesh._get_root_mesh()
    found: dict[int, Any] = {}
    for one in (root, *root._flatten_mapping.values()):
        for group in getattr(one, "_pg_registry", {}).values():
            found.setdefault(id(group), group)
    return list(found.values())


def release_mesh(mesh: Any) -> None:
    """Destroy the process groups ``mesh`` created and empty its registries.

    A ``DeviceMesh`` outlives its engine: DTensor's sharding-propagation cache keeps the
    specs of the ops it ran, and each spec its mesh. ``destroy_process_group`` only
    unregisters a group, and gloo joins a group's threads when its last reference goes,
    so the mesh must let go of the groups too: its registry (``_pg_registry``, where it
    and its slices and flattened meshes look their groups up) is emptied. The default
    group (a dim that spans the world) is left to whoever created it (the transport or
    the host)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    default = c10d._get_default_group() if dist.is_initialized() else None
    for group in mesh_groups(mesh):
        if group is not default and is_registered(group):
            dist.destroy_process_group(group)
    root = mesh._get_root_mesh()
    for one in (root, *root._flatten_mapping.values()):
        getattr(one, "_pg_registry", {}).clear()
    forget_meshes()


def drop_destroyed(*holders: Any, names: tuple[str, ...] = ("handle", "group")) -> None:
    """Set each of ``holders``' attributes ``names`` that holds a destroyed process group
    (no longer registered in ``torch.distributed``) to ``None``: the engine's reducers and
    groups let go of the mesh's groups at close (see :func:`release_mesh`)."""
    import torch.distributed as dist

    for holder in holders:
        for name in names:
            value = getattr(holder, name, None)
            if isinstance(value, dist.ProcessGroup) and not is_registered(value):
                setattr(holder, name, None)


def is_registered(group: Any) -> bool:
    """Whether ``group`` is still a process group of ``torch.distributed`` (not destroyed)."""
    from torch.distributed import distributed_c10d as c10d
    return group in c10d._world.pg_map


def forget_meshes() -> None:
    """Empty DTensor's caches keyed by specs (sharding propagation, Python and C++;
    redistribution plans; mesh topologies): a ``DeviceMesh`` compares equal to another of
    the same ranks and dim names, so a later engine's DTensors would be handed the
    outputs cached for a closed engine's mesh, whose groups are gone. Costs the other
    live meshes' cache entries only (they are worked out again)."""
    try:
        from torch.distributed.tensor import debug
        from torch.distributed.tensor import _redistribute as redistribute
        from torch.distributed.tensor._collective_utils import MeshTopoInfo
        from torch.distributed.tensor._sharding_prop import ShardingPropagator
    except ImportError:  # pragma: no cover - a torch without these (nothing cached)
        return
    clears = [getattr(debug, "_clear_sharding_prop_cache", None),
              getattr(getattr(redistribute, "_gen_transform_infos", None), "cache_clear", None),
              getattr(redistribute, "clear_redistribute_planner_cache", None),
              getattr(MeshTopoInfo.build_from_mesh, "cache_clear", None),
              getattr(getattr(ShardingPropagator, "_propagate_tensor_meta_cached", None),
                      "cache_clear", None)]
    for clear in clears:
        if clear is not None:
            clear()


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
    the stage applies torch parallelism), then only the groups the engine uses are made:
    a mesh creates a group per dim on every rank, size-1 dims included (on NCCL, a
    communicator each), which an engine without FSDP2 or DTensor would never use.
    (Not for leaks: :meth:`Grid.close` destroys and frees the mesh's groups at the
    engine's close, and ``tests/test_exit.py`` passes with a mesh on every engine.)

    A group spanning the whole world is given as ``None`` (the transport's world, as
    ``transport.new_group`` gives it), so the engine holds no reference to the default
    group."""
    why = unwanted or mesh_unavailable(transport)
    if why:
        return Grid(None, _transport_groups(topology, transport), why)
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    device_type = torch.device(transport.device).type
    mesh = DeviceMesh(device_type, torch.tensor(mesh_ranks(topology), dtype=torch.int),
                      mesh_dim_names=MESH_DIMS)
    groups: dict[str, tuple[Any, list[int]]] = {}
    whole = transport.world_size
    for dim in MESH_DIMS:  # a group of the whole world is None, as transport.new_group's
        ranks = _mine(topology, dim)
        groups[dim] = (mesh.get_group(dim) if 1 < len(ranks) < whole else None, ranks)
    ranks = _mine(topology, "dp")
    if topology.replicate_size > 1 and topology.shard_size > 1:
        flat = mesh["dp_replicate", "dp_shard"]._flatten("dp")
        groups["dp"] = (flat.get_group() if len(ranks) < whole else None, ranks)
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
