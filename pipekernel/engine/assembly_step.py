"""Building an engine, second half: the step's parts and the kernel, and :func:`assemble`,
which runs both halves in order.

After :mod:`pipekernel.engine.assembly` built the stage: the precision policy, the process
groups (every rank creates every group, in the same order), the parameter sync, torch
parallelism through the hook ``pipekernel_parallelize_stage`` (which sees a
:class:`StageBuild`), the gradient reducers, the optimizer and LR scheduler, then the stage
runtime, the batch step and the kernel over both's handlers.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from pipekernel.engine.assembly import (Assembly, Layout, Options, Parts, Stage, agree,
                                        build_stage, check_max_grad_norm, choose_layout,
                                        partition)
from pipekernel.engine.parallelize import check_stage_parallel
from pipekernel.engine.fields import StageFields
from pipekernel.errors import ConfigError
from pipekernel.extend.manager import make_precision
from pipekernel.grid import expert_parallel
from pipekernel.kernel.loop import Kernel
from pipekernel.schedules import instructions as isa
from pipekernel.model.module import PipelineModule
from pipekernel.stage.offload import make_offload
from pipekernel.stage.runtime import StageRuntime
from pipekernel.step.expert_reduce import ExpertGradReducer, ReducerPair
from pipekernel.step.grad_reduce import GradReducer, settled_parameters
from pipekernel.step.optimizer_step import BatchStep

__all__ = ["assemble", "StageBuild", "build_step", "make_optimizer", "make_lr_scheduler"]


@dataclass(frozen=True)
class StageBuild(StageFields):
    """What the hook ``pipekernel_parallelize_stage`` gets as ``engine``: the engine being
    built once its stage exists (a :class:`pipekernel.plugin.StageView`; the optimizer,
    the runtime and the counters do not exist yet): the engine's own members
    (:class:`~pipekernel.engine.fields.StageFields`) over the parts built so far."""

    _assembly: SimpleNamespace


def assemble(module: PipelineModule, optimizer: Any, micro_batches: int, options: Options,
             pm: Any, transport: Any) -> Assembly:
    """Build every part of an engine over ``transport`` (collective: every rank, same
    arguments): the first half's phases, then the step. The stage-parallel hook sees a
    :class:`StageBuild`."""
    layout = choose_layout(module, optimizer, micro_batches, options, pm, transport)
    agree(module, layout, options, transport)
    parts = partition(module, optimizer, layout, pm, transport)
    stage = build_stage(module, layout, parts, options, pm, transport)
    return build_step(module, optimizer, options, pm, transport, layout, parts, stage)


def build_step(module: PipelineModule, optimizer: Any, options: Options, pm: Any,
               transport: Any, layout: Layout, parts: Parts, stage: Stage) -> Assembly:
    """Precision, groups, reducers, optimizer and LR scheduler; the runtime and kernel."""
    precision = make_precision(pm, options.precision, dict(options.precision_options))
    check_max_grad_norm(options.max_grad_norm)
    topology = layout.topology
    data_group, data_ranks = stage.grid.data  # replicas x shards
    tied_groups = make_tied_groups(module, parts, topology, transport)
    sync_parameters(stage, tied_groups, topology, transport, data_group, data_ranks)
    build = StageBuild(SimpleNamespace(pipeline_module=module, pm=pm, transport=transport,
                                       precision=precision, options=options, layout=layout,
                                       parts=parts, stage=stage))
    # before the precision and the optimizer see the parameters (FSDP2, DTensor)
    pm.hook.pipekernel_parallelize_stage(module=stage.module, mesh=stage.mesh, engine=build)
    stage_parallel = check_stage_parallel(build)
    if stage_parallel is not None:  # prefetch by the program, chunk by chunk
        part = getattr(stage.module, "part", None)
        stage_parallel.plan_chunks([part(c) if part is not None else stage.module
                                    for c in range(layout.chunks)])
    precision.prepare(stage.module)  # after the sync: casts and masters start equal
    tied_reducers, grad_reducer = make_reducers(  # after prepare: they need the masters
        stage, precision, tied_groups, topology, transport, data_group, stage_parallel,
        options.grad_bucket_mb)
    built = make_optimizer(optimizer, build, data_group)
    scheduler = make_lr_scheduler(options.lr_scheduler, built)
    runtime, batch_step, kernel = build_kernel(
        module, options, layout, stage, precision, transport, pm, stage_parallel,
        dict(optimizer=built, lr_scheduler=scheduler, tied_groups=tied_groups,
             tied_reducers=tied_reducers, grad_reducer=grad_reducer))
    return Assembly(module, pm, transport, options, layout, parts, stage, precision,
                    data_group, data_ranks, tied_groups, tied_reducers, grad_reducer,
                    stage_parallel, built, scheduler, runtime, batch_step, kernel)


def make_tied_groups(module: PipelineModule, parts: Parts, topology: Any,
                     transport: Any) -> dict[str, tuple[Any, list[int]]]:
    """Create every tied group on every rank, in the same order (a transport requirement);
    this rank's ``{key: (group, ranks)}``."""
    groups: dict[str, tuple[Any, list[int]]] = {}
    tied = module.tied_stages(parts.bounds, parts.part_stages.__getitem__)
    for key, stages in sorted(tied.items()):
        if len(stages) < 2:
            continue
        for ranks in topology.stage_groups(stages):
            group = transport.new_group(ranks)
            if topology.rank in ranks:
                groups[key] = (group, ranks)
    return groups


def sync_parameters(stage: Stage, tied_groups: dict, topology: Any, transport: Any,
                    data_group: Any, data_ranks: list[int]) -> None:
    """Make tied copies, replicas and tensor-parallel ranks start identical (matters when
    no seed is given; before the DTensor plan shards the stage, so every parameter is whole)."""
    module, ep = stage.module, stage.ep_group
    with torch.no_grad():
        for key, (group, ranks) in tied_groups.items():
            for p in module.tied_modules[key].parameters():
                transport.broadcast(p.data, ranks[0], group)
        if topology.data_size > 1:
            for p in module.parameters():
                if ep.size == 1 or not expert_parallel.is_expert(p):
                    transport.broadcast(p.data, data_ranks[0], data_group)
        if ep.size > 1:  # experts differ over the data-parallel group
            expert_parallel.broadcast_experts(
                transport, [p for p in module.parameters() if expert_parallel.is_expert(p)], ep)
        if topology.model_size > 1:
            handle, ranks = stage.grid.groups["tp"]
            for p in module.parameters():
                transport.broadcast(p.data, ranks[0], handle)


def make_reducers(stage: Stage, precision: Any, tied_groups: dict, topology: Any,
                  transport: Any, data_group: Any, sharded: Any, bucket_mb: float
                  ) -> tuple[dict[str, GradReducer], Any]:
    """One :class:`GradReducer` per tied group (a sum over stages, no overlap) and one
    over the data-parallel replicas (an average, overlapped with the backward; tied
    weights wait for the tied sum; ``None`` without data parallelism)."""
    module, master, ep = stage.module, precision.master, stage.ep_group
    tied_reducers = {
        key: GradReducer(module.tied_modules[key].parameters(), transport, group, len(ranks),
                         0, master=master, average=False)
        for key, (group, ranks) in tied_groups.items()}
    if topology.data_size <= 1:
        return tied_reducers, None
    named = [(name, p) for name, p in module.named_parameters()
             if sharded is None or not sharded.managed(p)]  # FSDP2 reduces those
    experts: list = []
    if ep.size > 1:  # experts: their own group (grid/expert_parallel.py)
        experts = [(n, p) for n, p in named if expert_parallel.is_expert(p)]
        named = [(n, p) for n, p in named if not expert_parallel.is_expert(p)]
    tied = [p for key in tied_groups for p in module.tied_modules[key].parameters()]
    if not any(p.requires_grad for _, p in named + experts):
        return tied_reducers, None
    bucket = int(bucket_mb * 2 ** 20)
    reducer: Any = GradReducer([p for _, p in named], transport, data_group, topology.data_size,
                               bucket, master=master, late=tied, names=[n for n, _ in named])
    if ep.size > 1:
        reducer = ReducerPair(reducer, ExpertGradReducer(
            [p for _, p in experts], transport, ep, bucket, master, [n for n, _ in experts]))
    return tied_reducers, reducer


def build_kernel(module: PipelineModule, options: Options, layout: Layout, stage: Stage,
                 precision: Any, transport: Any, pm: Any, sharded: Any,
                 step: dict[str, Any]) -> tuple[StageRuntime, BatchStep, Kernel]:
    """The stage runtime (which records the batch's losses and token counts), the batch
    step (which reads them) and the kernel over both's handlers, FSDP2's (``sharded``) and
    the data-parallel reducer's (``step["grad_reducer"]``)."""
    topology = layout.topology
    tokens = options.loss_reduction == "tokens" and module.loss_fn is not None
    offload = make_offload(options.offload, transport.device, topology.stage)
    runtime = StageRuntime(stage.module, topology, transport, module.loss_fn, precision,
                           chunks=layout.chunks, placement=layout.placement,
                           skips=stage.skip_router, tokens=tokens, offload=offload,
                           params_of=sharded.autograd_params if sharded is not None else None)
    batch_step = BatchStep(
        module=stage.module, precision=precision, transport=transport, topology=topology,
        max_grad_norm=options.max_grad_norm, nonfinite=options.nonfinite, tokens=tokens,
        expert_parallel=stage.ep_group if stage.ep_group.size > 1 else None,
        losses=runtime.loss_keeper.recorded, **step)
    handlers = {**runtime.handlers(), **batch_step.handlers(),
                **(sharded_handlers(sharded) if sharded is not None else {}),
                **(reducer_handlers(step["grad_reducer"], stage.module)
                   if topology.data_size > 1 else {}),
                **plugin_handlers(pm, runtime)}
    kernel = Kernel(handlers, hook=pm.hook, rank=transport.rank, stage=topology.stage,
                    enter=runtime.enter)
    return runtime, batch_step, kernel


def sharded_handlers(sharded: Any) -> dict[type, Any]:
    """The handlers of FSDP2's instructions (:mod:`pipekernel.schedules.sharded`)."""
    return {isa.Unshard: sharded.unshard, isa.Reshard: lambda _: sharded.reshard(),
            isa.ReduceShardedGrads: lambda _: sharded.reduce_grads()}


def reducer_handlers(reducer: Any, module: Any) -> dict[type, Any]:
    """The handlers of the data-parallel reducer's arm and launch points
    (:mod:`pipekernel.schedules.data_parallel`), on every replicated stage so that every
    rank dispatches the same classes (the monitor adds their times up over ranks); a stage
    with nothing to reduce (``None``) has none in its programs. Arming for the last
    backward of ``chunk`` counts the parameters of the stage's other chunks as final
    (:func:`~pipekernel.step.grad_reduce.settled_parameters`, worked out once per chunk)."""
    if reducer is None:
        return {isa.ArmGradReduce: _nothing, isa.LaunchGradReduce: _nothing}
    settled: dict[int, list] = {}

    def arm(instruction: isa.ArmGradReduce) -> None:
        final = settled.get(instruction.chunk)
        if final is None:
            part = getattr(module, "part", None)  # a chunked module's parts; else itself
            parts = [list(part(c).parameters()) if part is not None else
                     list(module.parameters()) for c in range(getattr(module, "num_parts", 1))]
            final = settled[instruction.chunk] = settled_parameters(instruction.chunk, parts)
        reducer.arm(final=final)

    return {isa.ArmGradReduce: arm, isa.LaunchGradReduce: lambda _: reducer.backward_done()}


def _nothing(instruction: isa.Instruction) -> None:
    """A handler that does nothing (a class this stage never runs)."""


def plugin_handlers(pm: Any, runtime: Any) -> dict[type, Any]:
    """The handlers plugins contribute. A plugin may replace a core handler (the hook's
    contract); two plugins claiming one instruction class is an error naming both, since
    which one ran would depend on registration order."""
    found: dict[type, Any] = {}
    owner: dict[type, str] = {}
    for impl in reversed(pm.hook.pipekernel_register_instructions.get_hookimpls()):
        if impl.hookwrapper or impl.wrapper:
            continue
        extra = impl.function(**({"runtime": runtime} if "runtime" in impl.argnames else {}))
        for cls, handler in (extra or {}).items():
            if cls in owner:
                raise ConfigError(
                    f"plugins {owner[cls]!r} and {impl.plugin_name!r} both register a handler "
                    f"for instruction {cls.__name__}",
                    hint="disable one of them (PipelineEngine(..., disable_plugins=[...]) or "
                         "PIPEKERNEL_DISABLE_PLUGINS), or give one its own instruction class")
            owner[cls], found[cls] = impl.plugin_name, handler
    return found


def make_lr_scheduler(lr_scheduler: Any, optimizer: Any) -> Any:
    """``lr_scheduler(optimizer)`` for a factory, else ``lr_scheduler`` itself."""
    return (lr_scheduler(optimizer) if callable(lr_scheduler)
            and not hasattr(lr_scheduler, "step") else lr_scheduler)


def make_optimizer(optimizer: Any, where: Any, data_group: Any) -> torch.optim.Optimizer | None:
    """The stage's optimizer from a factory or a built optimizer (``where``: a
    :class:`StageBuild` or the engine: module, precision, parallel, topology, transport)."""
    precision, topology = where.precision, where.topology
    params = list(precision.optimizer_parameters(where.module))
    if isinstance(optimizer, torch.optim.Optimizer):
        given = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if not given <= {id(p) for p in params}:
            raise ConfigError(
                f"the optimizer was built over tensors that stage {where.stage} does not "
                f"train with precision {precision.name!r} (low-precision policies "
                f"step fp32 master copies, made when the engine starts)",
                hint="pass a factory: optimizer=lambda params: torch.optim.AdamW(params, ...)",
                rank=where.rank, stage=where.stage)
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        if optimizer is not None and where.parallel.zero_stage:
            raise ConfigError("zero_stage=1 needs an optimizer factory, got a built optimizer",
                              hint="pass optimizer=lambda params: torch.optim.AdamW(params, "
                                   "...): ZeRO-1 builds it over this replica's shard")
        return optimizer
    if callable(optimizer) and where.parallel.zero_stage and topology.data_size > 1:
        from pipekernel.grid.mesh import mesh_unavailable
        from pipekernel.grid.zero import ZeroOptimizer
        why = mesh_unavailable(where.transport)
        if why:
            raise ConfigError(f"zero_stage=1 runs torch's ZeroRedundancyOptimizer, which needs "
                              f"torch process groups: {why}",
                              hint="use transport='gloo' or 'nccl' over the whole job, or "
                                   "data_parallel_shard=N (FSDP2)", rank=where.rank)
        return ZeroOptimizer(params, optimizer, data_group)
    if callable(optimizer):
        return optimizer(params)
    raise ConfigError(f"optimizer must be a factory or a torch optimizer, got {optimizer!r}",
                      hint="pass optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3)")
