"""DeepSpeed's process topologies and pipeline grid (``deepspeed/runtime/pipe/topology.py``,
0.19), for scripts that build a ``PipelineModule(topology=...)`` or ask the engine's
``grid`` / ``mpu`` where a rank sits.

:class:`ProcessTopology` and its two specialisations are DeepSpeed's row-major mapping of
named axes to ranks, method for method. :class:`PipelineParallelGrid` answers DeepSpeed's
grid and ``mpu`` queries (stage, data-parallel and model-parallel ranks, sizes and
``torch.distributed`` groups). pipekernel runs the ranks in pipe-major order (rank ``r``
is stage ``r // D``, replica ``r % D``), so :func:`check_topology` accepts the
topologies that map ranks that way with one model-parallel rank
(``PipeDataParallelTopology``, ``PipeModelDataParallelTopology(num_mp=1)``, or a
``ProcessTopology`` of those axes in that order) and refuses the others by name.
"""
from __future__ import annotations

from collections import namedtuple
from itertools import product
from typing import Any

import torch

from pipekernel.errors import ConfigError

__all__ = ["ProcessTopology", "PipeDataParallelTopology", "PipeModelDataParallelTopology",
           "PipelineParallelGrid", "check_topology"]


class ProcessTopology:
    """Named axes of ``dims`` processes each, mapped row-major to ranks (DeepSpeed's)."""

    def __init__(self, axes: list[str], dims: list[int]) -> None:
        self.axes, self.dims = list(axes), list(dims)
        self.ProcessCoord = namedtuple("ProcessCoord", self.axes)  # type: ignore[misc]
        self.mapping = {}
        for rank, coord in enumerate(product(*[range(d) for d in self.dims])):
            self.mapping[self.ProcessCoord(*coord)] = rank

    def get_rank(self, **coord: int) -> int:
        if len(coord) != len(self.axes):
            raise ValueError("get_rank() does not support slices. Use filter_match())")
        key = self.ProcessCoord(**coord)
        if key not in self.mapping:
            raise ConfigError(f"key {coord} invalid",
                              hint=f"give one coordinate per axis {self.axes}, each inside "
                                   f"its dimension {self.dims}")
        return self.mapping[key]

    def get_axis_names(self) -> list[str]:
        return self.axes

    def get_rank_repr(self, rank: int, omit_axes: Any = ("data", "pipe"), inner_sep: str = "_",
                      outer_sep: str = "-") -> str:
        omit = frozenset(omit_axes)
        coord = self.get_coord(rank)
        return outer_sep.join(f"{ax}{inner_sep}{getattr(coord, ax):02d}"
                              for ax in self.axes if ax not in omit)

    def get_dim(self, axis: str) -> int:
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank: int) -> Any:
        for coord, index in self.mapping.items():
            if index == rank:
                return coord
        raise ValueError(f"rank {rank} not found in topology.")

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """Rank lists that agree on every axis but ``axis`` (one group each)."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for coord in product(*[range(self.get_dim(a)) for a in others]):
            fixed = dict(zip(others, coord))
            lists.append([self.mapping[self.ProcessCoord(**fixed, **{axis: i})]
                          for i in range(self.get_dim(axis))])
        return lists

    def filter_match(self, **criteria: int) -> list[int]:
        return [rank for coord, rank in self.mapping.items()
                if all(getattr(coord, k) == v for k, v in criteria.items())]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        position = self.axes.index(axis)
        return [rank for coord, rank in self.mapping.items() if coord[position] == idx]

    def world_size(self) -> int:
        return len(self.mapping)

    def __str__(self) -> str:
        return str(self.mapping)


class PipeDataParallelTopology(ProcessTopology):
    """Axes ``pipe``, ``data`` (data parallelism on the last, fastest axis)."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Axes ``pipe``, ``data``, ``model``."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


def check_topology(topology: Any, world_size: int) -> tuple[int, int]:
    """``(stages, replicas)`` of a topology pipekernel can run, else a ``ConfigError``
    naming what differs (see the module docstring)."""
    if not all(hasattr(topology, m) for m in ("get_axis_names", "get_dim", "get_coord")):
        raise ConfigError(f"PipelineModule(topology=...) must be a ProcessTopology, got "
                          f"{type(topology).__name__}",
                          hint="pass PipeDataParallelTopology(num_pp, num_dp) or num_stages")
    axes = list(topology.get_axis_names())
    extra = [a for a in axes if a not in ("pipe", "data", "model")]
    stages, replicas = max(topology.get_dim("pipe"), 1), max(topology.get_dim("data"), 1)
    if extra or topology.get_dim("model") > 1:
        raise ConfigError(f"PipelineModule(topology=...) has axes "
                          f"{ {a: topology.get_dim(a) for a in axes} }"
                          ": pipekernel.deepspeed runs pipeline and data parallelism only "
                          "(one model-parallel rank)",
                          hint="use PipeDataParallelTopology(num_pp, num_dp) or "
                               "PipeModelDataParallelTopology(num_pp, 1, num_dp)")
    if stages * replicas != world_size:
        raise ConfigError(f"the topology has {stages} x {replicas} ranks and the world has "
                          f"{world_size}", hint="make num_pp * num_dp the world size")
    for rank in range(world_size):
        coord = topology.get_coord(rank)
        if (coord.pipe, coord.data) != divmod(rank, replicas):
            raise ConfigError(f"the topology's axes {axes} put rank {rank} at stage "
                              f"{coord.pipe}, replica {coord.data}; pipekernel runs rank "
                              f"{rank} at stage {rank // replicas}, replica {rank % replicas}",
                              hint="order the axes pipe, data(, model) as DeepSpeed's "
                                   "PipeDataParallelTopology does")
    return stages, replicas


_GROUPS: dict[tuple, Any] = {}


def _group(ranks: list[int]) -> Any:
    """The ``torch.distributed`` group of ``ranks``, made once per process and world:
    every rank creates the same groups in the same order (``new_group`` is collective)."""
    world = torch.distributed.group.WORLD
    key = (id(world), tuple(ranks))
    if key not in _GROUPS:
        _GROUPS[key] = torch.distributed.new_group(ranks=list(ranks))
    return _GROUPS[key]


class PipelineParallelGrid:
    """DeepSpeed's grid over ``topology`` (also the engine's ``mpu``): every group is
    created when the grid is, on every rank."""

    def __init__(self, topology: ProcessTopology) -> None:
        self.global_rank = torch.distributed.get_rank()
        self.world_size = torch.distributed.get_world_size()
        self._topo = topology
        self.data_parallel_size = max(topology.get_dim("data"), 1)
        self.pipe_parallel_size = max(topology.get_dim("pipe"), 1)
        self.model_parallel_size = max(topology.get_dim("model"), 1)
        self.slice_parallel_size = self.model_parallel_size
        self.stage_id = self.get_stage_id()
        self.data_parallel_id = self.get_data_parallel_id()
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1
        # DeepSpeed's "model parallel" group: one whole pipeline (every stage, one replica)
        for dp in range(self.data_parallel_size):
            ranks = sorted(topology.get_axis_list("data", dp))
            group = _group(ranks)
            if self.global_rank in ranks:
                self.ds_model_proc_group, self.ds_model_world_size = group, len(ranks)
                self.ds_model_rank = ranks.index(self.global_rank)
        self.dp_groups = topology.get_axis_comm_lists("data")
        for ranks in self.dp_groups:
            group = _group(ranks)
            if self.global_rank in ranks:
                self.dp_group, self.dp_proc_group = ranks, group
        self.pipe_groups = topology.get_axis_comm_lists("pipe")
        for ranks in self.pipe_groups:
            group = _group(ranks)
            if self.global_rank in ranks:
                self.pp_group, self.pp_proc_group = ranks, group
        slices = topology.get_axis_comm_lists("model") or [[r] for r in range(self.world_size)]
        for ranks in slices:
            group = _group(ranks)
            if self.global_rank in ranks:
                self.slice_group, self.slice_proc_group = ranks, group
        self.p2p_groups = [[r, lst[(lst.index(r) + 1) % self.pipe_parallel_size]]
                           for r in range(self.world_size)
                           for lst in self.pipe_groups if r in lst]

    def get_stage_id(self) -> int:
        return self._topo.get_coord(rank=self.global_rank).pipe

    def get_data_parallel_id(self) -> int:
        return self._topo.get_coord(rank=self.global_rank).data

    def stage_to_global(self, stage_id: int, **kwargs: int) -> int:
        """The global rank of stage ``stage_id`` with this rank's other coordinates."""
        me = self._topo.get_coord(self.global_rank)
        return self._topo.get_rank(**me._replace(pipe=stage_id, **kwargs)._asdict())

    def topology(self) -> ProcessTopology:
        return self._topo

    def get_global_rank(self) -> int:
        return self.global_rank

    def get_pipe_parallel_rank(self) -> int:
        return self.get_stage_id()

    get_pipeline_model_parallel_rank = get_pipe_parallel_rank

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size

    def get_pipe_parallel_group(self) -> Any:
        return self.pp_proc_group

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self) -> Any:
        return self.dp_proc_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.dp_group

    def get_model_parallel_rank(self) -> int:
        return self.ds_model_rank

    def get_model_parallel_world_size(self) -> int:
        return self.ds_model_world_size

    def get_model_parallel_group(self) -> Any:
        return self.ds_model_proc_group

    def get_slice_parallel_rank(self) -> int:
        coord = self._topo.get_coord(rank=self.global_rank)
        return coord.model if "model" in self._topo.get_axis_names() else 0

    get_tensor_model_parallel_rank = get_slice_parallel_rank

    def get_slice_parallel_world_size(self) -> int:
        return self.slice_parallel_size

    get_tensor_model_parallel_world_size = get_slice_parallel_world_size

    def get_slice_parallel_group(self) -> Any:
        return self.slice_proc_group

    get_tensor_model_parallel_group = get_slice_parallel_group
