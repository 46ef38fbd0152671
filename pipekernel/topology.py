"""Where each process sits: a (data, pipe, model) grid of ranks.

Rank order: ``rank = (data * pipe_size + stage) * model_size + model``. With
``model_size == 1`` (the default) adjacent ranks are consecutive stages of the
same pipeline, so a pipeline's point-to-point traffic stays on one node when
``pipe_size`` divides the GPUs per node. The model (tensor-parallel) axis is
kept in the type for later; it is innermost, as tensor parallelism needs the
fastest links.
"""
from __future__ import annotations

from dataclasses import dataclass

from pipekernel.errors import ConfigError

__all__ = ["Topology"]


@dataclass(frozen=True, slots=True)
class Topology:
    """An immutable view of the grid and of one rank's coordinates in it."""

    pipe_size: int
    data_size: int = 1
    model_size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        for name in ("pipe_size", "data_size", "model_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside a world of {self.world_size} ranks")

    @classmethod
    def from_world(cls, world_size: int, rank: int, num_stages: int,
                   data_parallel_size: int | None = None, model_size: int = 1) -> Topology:
        """Build the grid for ``world_size`` ranks split into ``num_stages`` stages."""
        if num_stages < 1 or world_size % (num_stages * model_size):
            raise ConfigError(
                f"world size {world_size} is not divisible by {num_stages} pipeline stages"
                + (f" x {model_size} model-parallel ranks" if model_size > 1 else ""),
                hint="launch a multiple of num_stages processes, or change num_stages",
                rank=rank)
        dp = world_size // (num_stages * model_size)
        if data_parallel_size is not None and data_parallel_size != dp:
            raise ConfigError(
                f"data_parallel_size={data_parallel_size} does not match world size {world_size} "
                f"with {num_stages} stages (which gives {dp})",
                hint=f"launch {num_stages * data_parallel_size * model_size} processes or "
                     f"omit data_parallel_size", rank=rank)
        return cls(num_stages, dp, model_size, rank)

    @property
    def world_size(self) -> int:
        return self.pipe_size * self.data_size * self.model_size

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(data, stage, model)`` of ``rank``."""
        model = rank % self.model_size
        stage = (rank // self.model_size) % self.pipe_size
        return rank // (self.model_size * self.pipe_size), stage, model

    def rank_of(self, data: int, stage: int, model: int = 0) -> int:
        return (data * self.pipe_size + stage) * self.model_size + model

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

    def stage_groups(self, stages: list[int]) -> list[list[int]]:
        """For each pipeline, the ranks holding ``stages`` (e.g. a tied weight's stages)."""
        return [[self.rank_of(d, s, m) for s in stages]
                for d in range(self.data_size) for m in range(self.model_size)]
