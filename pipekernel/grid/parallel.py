"""The large-model options of :class:`~pipekernel.PipelineEngine`, validated once:
tensor-parallel size and DTensor plan, rank order, ZeRO stage, FSDP2 sharding,
expert-parallel size (checked against the data-parallel size by
:mod:`pipekernel.grid.expert_parallel`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipekernel.errors import ConfigError, positive_int
from pipekernel.grid.topology import DEFAULT_RANK_ORDER, parse_rank_order

__all__ = ["ParallelConfig"]


@dataclass(frozen=True)
class ParallelConfig:
    """What the engine was asked for (see its parameters of the same names)."""

    tensor_parallel_size: int = 1
    rank_order: str = DEFAULT_RANK_ORDER
    zero_stage: int = 0
    data_parallel_shard: int = 1
    reshard_after_forward: bool = False
    expert_parallel_size: int = 1
    #: ``{module-name pattern: ParallelStyle}`` for DTensor tensor parallelism, or ``None``
    tensor_parallel_plan: Any = None

    @classmethod
    def make(cls, tensor_parallel_size: Any = 1, rank_order: Any = None,
             partition_activations: Any = None, zero_stage: Any = 0,
             data_parallel_shard: Any = 1, reshard_after_forward: Any = False,
             expert_parallel_size: Any = 1, tensor_parallel_plan: Any = None
             ) -> ParallelConfig:
        """Validate the engine's arguments (``ConfigError`` saying how to fix each)."""
        positive_int("tensor_parallel_size", tensor_parallel_size,
                     hint="e.g. tensor_parallel_size=2")
        order = "-".join(parse_rank_order(rank_order if rank_order is not None
                                          else DEFAULT_RANK_ORDER))
        if partition_activations is not None:
            raise ConfigError(f"partition_activations={partition_activations!r}: partitioned "
                              f"activations went with pipekernel's own tensor-parallel layers; "
                              f"under a DTensor plan what crosses stages is what the plan's "
                              f"styles output",
                              hint="remove partition_activations; to send 1/T of each "
                                   "activation per rank, shard the sequence at stage "
                                   "boundaries with torch's sequence parallelism in "
                                   "tensor_parallel_plan (docs/parallelism.md, 'Migrating "
                                   "from the retired tensor-parallel layers')")
        if zero_stage not in (0, 1) or isinstance(zero_stage, bool):
            raise ConfigError(f"zero_stage must be 0 or 1, got {zero_stage!r}",
                              hint="zero_stage=1 shards the optimizer state over the "
                                   "data-parallel replicas; stages 2 and 3 are not implemented")
        positive_int("data_parallel_shard", data_parallel_shard,
                     hint="e.g. data_parallel_shard=2 shards each stage over 2 ranks with "
                          "FSDP2 (1: no sharding)")
        if not isinstance(reshard_after_forward, bool):
            raise ConfigError(f"reshard_after_forward must be True or False, got "
                              f"{reshard_after_forward!r}",
                              hint="True frees each layer's gathered parameters after its "
                                   "forward (less memory); False (default) gathers once per batch")
        if data_parallel_shard > 1 and zero_stage:
            raise ConfigError("zero_stage=1 with data_parallel_shard > 1: FSDP2 already shards "
                              "the optimizer state (and parameters and gradients)",
                              hint="drop zero_stage, or use data_parallel_shard=1")
        _check_plan(tensor_parallel_plan, tensor_parallel_size)
        positive_int("expert_parallel_size", expert_parallel_size,
                     hint="e.g. expert_parallel_size=2")
        if expert_parallel_size > 1 and data_parallel_shard > 1:
            raise ConfigError("expert_parallel_size > 1 with data_parallel_shard > 1: experts "
                              "spread over FSDP2-sharded ranks are not supported yet",
                              hint="use data_parallel_size (replicas) for the expert-parallel "
                                   "ranks, or data_parallel_shard without experts")
        return cls(tensor_parallel_size, order, zero_stage,
                   data_parallel_shard, reshard_after_forward, expert_parallel_size,
                   tensor_parallel_plan)

    def fields(self) -> dict[str, Any]:
        """What every rank must agree on (for the engine's consistency check)."""
        return {"tensor parallel size": self.tensor_parallel_size,
                "rank order": self.rank_order,
                "zero stage": self.zero_stage,
                "data parallel shard": self.data_parallel_shard,
                "reshard after forward": self.reshard_after_forward,
                "expert parallel size": self.expert_parallel_size,
                "tensor parallel plan": self.tensor_parallel_plan
                if not isinstance(self.tensor_parallel_plan, dict) else
                sorted((k, type(v).__name__) for k, v in self.tensor_parallel_plan.items())}


def _check_plan(plan: Any, tensor_parallel_size: int) -> None:
    """A DTensor plan: ``{str pattern: ParallelStyle}``, with ``tensor_parallel_size > 1``;
    ``tensor_parallel_size > 1`` needs one (the only tensor parallelism there is)."""
    if plan is None:
        if tensor_parallel_size > 1:
            raise ConfigError(
                f"tensor_parallel_size={tensor_parallel_size} needs a tensor_parallel_plan: "
                f"tensor parallelism is torch's DTensor (pipekernel's own ColumnParallelLinear "
                f"/ RowParallelLinear layers are retired)",
                hint="build plain nn.Linear layers and pass tensor_parallel_plan={'*.up': "
                     "ColwiseParallel(), '*.down': RowwiseParallel()} "
                     "(torch.distributed.tensor.parallel; names relative to the stage), or "
                     "tensor_parallel_plan='hf' for a Hugging Face model (docs/parallelism.md, "
                     "'Migrating from the retired tensor-parallel layers')")
        return
    from torch.distributed.tensor.parallel import ParallelStyle

    # "hf": the Hugging Face model's own plan (pipekernel.plugins.tensor_parallel_dtensor)
    if plan != "hf" and (not isinstance(plan, dict) or not plan or not all(
            isinstance(k, str) and isinstance(v, ParallelStyle) for k, v in plan.items())):
        raise ConfigError(f"tensor_parallel_plan must be 'hf' or a non-empty dict of "
                          f"module-name patterns to torch ParallelStyles, got {plan!r}",
                          hint="e.g. {'*.fc1': ColwiseParallel(), '*.fc2': RowwiseParallel()} "
                               "(torch.distributed.tensor.parallel), names relative to the "
                               "stage, whose children are the global layer indices")
    if tensor_parallel_size < 2:
        raise ConfigError("tensor_parallel_plan needs tensor_parallel_size > 1 (the size of "
                          "the mesh's tp dim)", hint="pass tensor_parallel_size=2 (or more)")
