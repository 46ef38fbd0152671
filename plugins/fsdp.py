"""FSDP2 inside each pipeline stage: ``PipelineEngine(..., data_parallel_shard=N)``.

An implementation of :func:`~pipekernel.extend.hookspecs.pipekernel_parallelize_stage`
(``trylast``: after tensor parallelism, as torchtitan orders them). It shards the stage
with ``torch.distributed.fsdp.fully_shard`` over ``mesh["dp_shard"]`` (HSDP over
``mesh["dp_replicate", "dp_shard"]`` when there are replicas too). The engine times it by
the schedule (:mod:`pipekernel.grid.stage_parallel`):

* ``reshard_after_forward=False`` (the default): the stage is one FSDP2 parameter group,
  gathered by one all-gather before the batch's first instruction and reduce-scattered
  once after the stage's last backward. Parameters stay gathered for the whole batch
  either way, so a group per layer would buy no memory and cost two collectives per layer:
  measured on 8 x Linear(256, 256) at D = 2 on gloo, 0.108-0.116 s per step with a group
  per layer against 0.043-0.052 s with one per stage (plain DP 0.023 s).
* ``reshard_after_forward=True``: each layer (a child of the stage holding parameters)
  becomes one group, then the stage itself (the root): each layer's gathered parameters
  are freed after every forward and gathered again for its backward, each all-gather
  started ahead (the program's ``Unshard`` instructions); one reduce-scatter per layer and
  batch.

What stays as it was:

* **tied layers** (``TiedLayerSpec``): their parameters are left out of FSDP2
  (``ignored_params``) and stay whole on every rank: summed over the stages that hold them
  (``ReduceTiedGrads``), then averaged over the data-parallel ranks by the engine's own
  reducer, as without sharding;
* the gradient is the mean over every data-parallel rank (replicas x shards): FSDP2's
  default divisor is the size of its mesh, and the loss is already divided by the
  micro-batch count.

FSDP2 would reduce with ``ReduceOp.PREMUL_SUM``, which gloo refuses: every FSDP2 module
gets ``set_force_sum_reduction_for_comms(True)`` (a sum, then a local division; on NCCL
too, where sums are the zero-copy kind).
Every module also reduce-scatters zeros for a parameter without a gradient on this rank
(``set_reduce_scatter_unused_params(True)``): otherwise ranks that used different
parameters would start reduce-scatters of different sizes and hang. (A parameter no rank
used then gets a zero gradient rather than none: the optimizer steps it, which only
differs from one process for optimizers that move a parameter on a zero gradient, e.g.
weight decay.)
"""
from __future__ import annotations

from typing import Any

from pipekernel.errors import ConfigError
from pipekernel.plugin import StageView, hookimpl

#: Precision policies FSDP2 runs under: ``fp32``, and ``bf16`` mapped to FSDP2's
#: ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` — the fp32 shards
#: are the masters the optimizer steps, gathered in bf16 for the forward and backward,
#: gradients accumulated over micro-batches and reduced in fp32 (the policy keeps its own
#: masters only for what FSDP2 does not manage, e.g. tied layers). ``fp16`` (loss
#: scaling) and ``amp-bf16`` are refused so far.
SUPPORTED_PRECISIONS = ("fp32", "bf16")


def mixed_precision(precision: Any) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for the engine's precision policy."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if getattr(precision, "name", "fp32") == "bf16":
        return MixedPrecisionPolicy(param_dtype=getattr(precision, "dtype", torch.bfloat16),
                                    reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def data_mesh(mesh: Any) -> Any:
    """The mesh FSDP2 shards over: ``dp_shard``, or ``(dp_replicate, dp_shard)`` (HSDP)."""
    if mesh["dp_replicate"].size() > 1:
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp_shard"]


def _check(engine: StageView) -> None:
    rank = engine.transport.rank
    name = getattr(engine.precision, "name", "fp32")
    if name not in SUPPORTED_PRECISIONS:
        raise ConfigError(f"precision={name!r} with data_parallel_shard="
                          f"{engine.parallel.data_parallel_shard}: FSDP2 inside a stage runs "
                          f"under {', '.join(map(repr, SUPPORTED_PRECISIONS))} only so far",
                          hint="use precision='fp32' with data_parallel_shard, or "
                               "data_parallel_shard=1", rank=rank, stage=engine.stage)


@hookimpl(trylast=True)
def pipekernel_parallelize_stage(module: Any, mesh: Any, engine: StageView) -> None:
    shard = engine.parallel.data_parallel_shard
    if shard <= 1:
        return
    engine.grid.require_mesh(f"data_parallel_shard={shard}", rank=engine.transport.rank)
    _check(engine)
    from torch.distributed.fsdp import FSDPModule, fully_shard

    dp_mesh = data_mesh(mesh)
    tied = {p for m in module.tied_modules.values() for p in m.parameters()}
    reshard = engine.parallel.reshard_after_forward
    mp = mixed_precision(engine.precision)
    # one group per layer only where it saves memory (see the module docstring)
    for layer in module.children() if reshard else ():
        own = [p for p in layer.parameters() if p not in tied]
        if own and not isinstance(layer, FSDPModule):
            fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp,
                        ignored_params={p for p in layer.parameters() if p in tied} or None)
    fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp,
                ignored_params=tied or None)
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.set_reduce_scatter_unused_params(True, recurse=False)
            sub.set_force_sum_reduction_for_comms(True)
