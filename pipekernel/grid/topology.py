"""Where each process sits: a (pipe, data, model) grid of ranks, in a chosen rank order.

The **rank order** names the axes from the innermost (neighbouring ranks differ in
it) to the outermost, Megatron-style: ``"tp-dp-pp"`` (the default) means

    rank = (stage * data_size + data) * model_size + model

so a tensor-parallel group is a run of consecutive ranks, the replicas of one stage
come next, and the pipeline axis is outermost. On a job of nodes with ``G`` GPUs each
(ranks ``n*G .. n*G+G-1`` on node ``n``), this keeps the tensor-parallel collectives
(every layer) and then the data-parallel all-reduce (the whole gradient, every step)
on the fast intra-node links whenever ``T * D`` divides ``G``, and puts the smallest
traffic — point-to-point activations between stages — across nodes. Per step and rank,
with ``p`` parameters per stage, gradients of ``g`` bytes, ``m`` micro-batches of
``a`` activation bytes: the ring all-reduce moves ``2 * p * g * (D-1)/D`` bytes, the
pipeline ``2 * m * a`` (one activation forward, one gradient back). For a 7B model on
2 stages in bf16 (``p = 3.5e9``, ``g = 2``) that is ~7 GB per rank per step for the
all-reduce at D=2, against ~0.5 GB of activations for ``m = 8`` micro-batches of
``4096 x 4096`` bf16 — the all-reduce is the one to keep off the network
(``docs/parallelism.md`` works a 2-node example).

Any permutation of ``tp``, ``dp`` and ``pp`` is accepted; ``"tp-pp-dp"`` is the
order pipekernel used before (stages of one pipeline on adjacent ranks). With
``data_size == model_size == 1`` every order gives ``rank == stage``.
"""
from __future__ import annotations

from dataclasses import dataclass

from pipekernel.errors import ConfigError

__all__ = ["Topology", "DEFAULT_RANK_ORDER", "parse_rank_order", "rank_map", "format_rank_map",
           "world_size_rules"]

#: The default rank order, innermost axis first (see the module docstring).
DEFAULT_RANK_ORDER = "tp-dp-pp"
_AXES = ("tp", "dp", "pp")


def parse_rank_order(order: str) -> tuple[str, str, str]:
    """``"tp-dp-pp"`` -> ``("tp", "dp", "pp")``, innermost axis first; ``ConfigError``
    unless ``order`` names each of ``tp``, ``dp`` and ``pp`` once."""
    parts = tuple(order.lower().split("-")) if isinstance(order, str) else ()
    if sorted(parts) != sorted(_AXES):
        raise ConfigError(f"rank_order={order!r} is not an order of the axes tp, dp and pp",
                          hint="name each axis once, innermost first, e.g. rank_order='tp-dp-pp' "
                               "(the default) or 'tp-pp-dp'")
    return parts  # type: ignore[return-value]


def rank_map(order: str, pipe_size: int, data_size: int = 1, model_size: int = 1
             ) -> list[tuple[int, int, int]]:
    """``(stage, data, model)`` of every rank ``0 .. P*D*T-1`` under ``order``."""
    topo = Topology(pipe_size, data_size, model_size, 0, order)
    return [(s, d, m) for d, s, m in (topo.coords(r) for r in range(topo.world_size))]


def world_size_rules(world_size: int, num_stages: int, data_parallel_size: int | None,
                     model_size: int = 1, shard_size: int = 1) -> list[str]:
    """Every rule of the grid that ``world_size`` processes break, in words (empty: none).

    A world is ``num_stages x model_size`` ranks per replica, ``data_parallel_size``
    replicas of ``shard_size`` shards each; one error names all the rules it breaks, so
    that fixing one does not uncover the next."""
    if num_stages < 1:
        return [f"num_stages={num_stages} must be >= 1"]
    cell = num_stages * model_size
    tp = f" x {model_size} tensor-parallel ranks" if model_size > 1 else ""
    broken = []
    if world_size % cell:
        broken.append(f"world size {world_size} is not divisible by {num_stages} pipeline "
                      f"stages{tp}")
    if shard_size > 1 and world_size % (cell * shard_size):
        broken.append(f"data_parallel_shard={shard_size} needs a multiple of "
                      f"{cell * shard_size} processes ({num_stages} stages{tp} x "
                      f"{shard_size} shards), not {world_size}")
    if data_parallel_size is not None and \
            data_parallel_size * shard_size * cell != world_size:
        shards = f" x {shard_size} shards" if shard_size > 1 else ""
        broken.append(f"data_parallel_size={data_parallel_size}{shards} does not match world "
                      f"size {world_size}: it needs {data_parallel_size * shard_size * cell} "
                      f"processes ({num_stages} stages{tp} x {data_parallel_size} "
                      f"replica(s){shards})")
    return broken


def format_rank_map(topology: Topology, ranks_per_node: int | None = None,
                    pids: list[int] | None = None) -> list[str]:
    """One line per rank: ``"rank 5: stage 1, replica 0, tp 1, pid 4242 (node 0)"`` (the
    pid when ``pids`` gives each rank's: what ``kill -USR1`` needs)."""
    lines = []
    for rank in range(topology.world_size):
        data, stage, model = topology.coords(rank)
        node = f" (node {rank // ranks_per_node})" if ranks_per_node else ""
        tp = f", tp {model}" if topology.model_size > 1 else ""
        pid = f", pid {pids[rank]}" if pids else ""
        lines.append(f"rank {rank}: stage {stage}, replica {data}{tp}{pid}{node}")
    return lines


@dataclass(frozen=True, slots=True)
class Topology:
    """An immutable view of the grid and of one rank's coordinates in it.

    :param pipe_size: pipeline stages ``P``.
    :param data_size: data-parallel replicas ``D``.
    :param model_size: tensor-parallel ranks ``T`` per stage.
    :param rank: this process's rank.
    :param order: the rank order, innermost axis first (default ``"tp-dp-pp"``).
    :param shard_size: of the ``D`` data-parallel ranks, how many shard one copy of the
        stage (FSDP2's ``dp_shard``; ``D / shard_size`` replicas of it, ``dp_replicate``).
        A data-parallel index ``d`` is ``replica * shard_size + shard``: the shards of one
        replica are adjacent ranks (see :mod:`pipekernel.grid.mesh`).
    """

    pipe_size: int
    data_size: int = 1
    model_size: int = 1
    rank: int = 0
    order: str = DEFAULT_RANK_ORDER
    shard_size: int = 1

    def __post_init__(self) -> None:
        for name in ("pipe_size", "data_size", "model_size", "shard_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}",
                                  hint="give every parallel size (stages, replicas, "
                                       "tensor-parallel ranks) as a positive int")
        if self.data_size % self.shard_size:
            raise ConfigError(f"{self.data_size} data-parallel ranks cannot be split into "
                              f"shards of {self.shard_size}",
                              hint="data_parallel_shard must divide the data-parallel ranks "
                                   "(world size / (stages x tensor-parallel size))")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside a world of {self.world_size} ranks",
                              hint="give a rank in 0 .. world_size - 1 (RANK from the launcher)")
        object.__setattr__(self, "order", "-".join(parse_rank_order(self.order)))

    @classmethod
    def from_world(cls, world_size: int, rank: int, num_stages: int,
                   data_parallel_size: int | None = None, model_size: int = 1,
                   order: str = DEFAULT_RANK_ORDER, shard_size: int = 1) -> Topology:
        """Build the grid for ``world_size`` ranks split into ``num_stages`` stages of
        ``model_size`` tensor-parallel ranks each; ``data_parallel_size`` counts the
        replicas (``dp_replicate``), each of ``shard_size`` shards."""
        broken = world_size_rules(world_size, num_stages, data_parallel_size, model_size,
                                  shard_size)
        if broken:
            cell = max(num_stages, 1) * model_size * shard_size
            fix = (f"launch {cell * data_parallel_size} processes, or omit data_parallel_size "
                   f"and launch a multiple of {cell}" if data_parallel_size is not None else
                   f"launch a multiple of {cell} processes, or change num_stages")
            raise ConfigError("; and ".join(broken), hint=fix, rank=rank)
        dp = world_size // (num_stages * model_size)
        return cls(num_stages, dp, model_size, rank, order, shard_size)

    @property
    def world_size(self) -> int:
        return self.pipe_size * self.data_size * self.model_size

    def _sizes(self) -> dict[str, int]:
        return {"tp": self.model_size, "dp": self.data_size, "pp": self.pipe_size}

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(data, stage, model)`` of ``rank``."""
        sizes, at = self._sizes(), {}
        for axis in self.order.split("-"):
            rank, at[axis] = divmod(rank, sizes[axis])
        return at["dp"], at["pp"], at["tp"]

    def rank_of(self, data: int, stage: int, model: int = 0) -> int:
        at, sizes, rank = {"dp": data, "pp": stage, "tp": model}, self._sizes(), 0
        for axis in reversed(self.order.split("-")):
            rank = rank * sizes[axis] + at[axis]
        return rank

    @property
    def stage(self) -> int:
        return self.coords(self.rank)[1]

    @property
    def data_rank(self) -> int:
        return self.coords(self.rank)[0]

    @property
    def model_rank(self) -> int:
        return self.coords(self.rank)[2]

    @property
    def replicate_size(self) -> int:
        """Replicas of the stage (``dp_replicate``): ``data_size / shard_size``."""
        return self.data_size // self.shard_size

    @property
    def replica_rank(self) -> int:
        """Which replica this rank's shard belongs to."""
        return self.data_rank // self.shard_size

    @property
    def shard_rank(self) -> int:
        """Which shard of its replica this rank holds."""
        return self.data_rank % self.shard_size

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pipe_size - 1

    def stage_rank(self, stage: int) -> int:
        """Rank of ``stage`` in this rank's pipeline."""
        data, _, model = self.coords(self.rank)
        return self.rank_of(data, stage, model)

    def pipe_groups(self) -> list[list[int]]:
        """The ranks of every pipeline (one per data x model index)."""
        return [[self.rank_of(d, s, m) for s in range(self.pipe_size)]
                for d in range(self.data_size) for m in range(self.model_size)]

    def data_groups(self) -> list[list[int]]:
        """The replicas of every (stage, model) position: data-parallel reduction groups."""
        return [[self.rank_of(d, s, m) for d in range(self.data_size)]
                for s in range(self.pipe_size) for m in range(self.model_size)]

    def model_groups(self) -> list[list[int]]:
        """The tensor-parallel ranks of every (stage, replica): tensor-parallel groups."""
        return [[self.rank_of(d, s, m) for m in range(self.model_size)]
                for s in range(self.pipe_size) for d in range(self.data_size)]

    def stage_groups(self, stages: list[int]) -> list[list[int]]:
        """For each pipeline, the ranks holding ``stages`` (e.g. a tied weight's stages)."""
        return [[self.rank_of(d, s, m) for s in stages]
                for d in range(self.data_size) for m in range(self.model_size)]
