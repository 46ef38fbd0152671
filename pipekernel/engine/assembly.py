"""Building an engine, first half: functions from explicit inputs to the frozen parts of
one :class:`Assembly`.

The phases, in the order every rank must run them (each may communicate, and collectives
pair up by order): check the options, choose the layout (topology, schedule, chunks,
placement; the planner's with ``schedule="auto"``), agree on the configuration, partition,
build the stage. :mod:`.assembly_step` builds the step on top (groups, parameter sync,
torch parallelism, reducers, optimizer, kernel) and its :func:`~.assembly_step.assemble`
runs all the phases. Each phase takes what it reads as arguments and returns a frozen
value; nothing here holds the engine. The engine (:mod:`pipekernel.engine.engine`) keeps
the result and reads it.
"""
from __future__ import annotations

import dataclasses
import logging
import sys
from dataclasses import dataclass
from typing import Any

import torch

from pipekernel.comm.transport import require_lanes
from pipekernel.engine.faults import check_consistency
from pipekernel.engine.sentinel import check_every_option
from pipekernel.engine.planner import Auto, Plan, is_auto, plan_module
from pipekernel.engine.recompute_option import resolve_recompute
from pipekernel.errors import ConfigError, PipelineError, positive_int
from pipekernel.extend.manager import resolve_schedule
from pipekernel.grid import expert_parallel
from pipekernel.grid.mesh import build_grid
from pipekernel.grid.parallel import ParallelConfig
from pipekernel.grid.topology import Topology
from pipekernel.schedules.comm import lanes_needed
from pipekernel.schedules.pipeline import OneFOneB
from pipekernel.schedules.placement import check_placement, locate, parts_of
from pipekernel.schedules.sequence import Seq1F1B
from pipekernel.stage.loss import check_loss_reduction
from pipekernel.model.module import PipelineModule
from pipekernel.schedules.sim_memory import live_graphs, part_bytes, stage_memory
from pipekernel.model.partitioning import PartitionContext, PartitionReport
from pipekernel.model.skip_routing import check_schedules, router_for

__all__ = ["Options", "Layout", "Parts", "Stage", "Assembly", "check_options",
           "choose_layout", "check_recompute", "agree", "partition", "build_stage", "require_layout_lanes"]

_partition_log = logging.getLogger("pipekernel.partition")
_plan_log = logging.getLogger("pipekernel.plan")


@dataclass(frozen=True)
class Options:
    """The constructor's options that outlive construction, checked."""

    schedule: Any
    eval_schedule: str
    chunks: int | None
    data_parallel_size: int | None
    transport: str
    precision: str
    precision_options: dict
    nonfinite: str
    check_data_steps: int
    check_every: int | None
    verify_every: int | None
    loss_reduction: str
    grad_bucket_mb: float
    max_grad_norm: float | None
    lr_scheduler: Any
    parallel: ParallelConfig
    seq_chunks: int = 1
    #: the engine's ``recompute`` as given (``None``: the plan's or the module's)
    recompute: Any = None
    offload: Any = None


@dataclass(frozen=True)
class Layout:
    """Where this rank sits and what it runs: the topology, the schedules, the chunks and
    their placement, the micro-batch count (the user's, also under ``"auto"``) and the plan."""

    topology: Topology
    schedule_cls: Any
    eval_schedule_cls: Any
    chunks: int
    placement: str
    micro_batches: int
    plan: Plan | None
    #: per stage, its activation checkpoint interval (``0``: none; see
    #: :mod:`pipekernel.engine.recompute_option`)
    recompute: tuple[int, ...] = ()


@dataclass(frozen=True)
class Parts:
    """The partition: the stage holding each part, the bounds and their report."""

    part_stages: list[int]
    bounds: list[int]
    partition_report: PartitionReport


@dataclass(frozen=True)
class Stage:
    """This rank's stage: groups and mesh, its layers and its skip routing."""

    grid: Any
    mesh: Any
    ep_group: Any
    module: Any
    skip_router: Any
    skip_edges: list


@dataclass(frozen=True)
class Assembly:
    """Everything one engine is built of (:func:`~.assembly_step.assemble`), read-only.

    ``optimizer`` and ``lr_scheduler`` change only through
    :meth:`~pipekernel.PipelineEngine.set_optimizer`, which makes a new assembly.
    """

    pipeline_module: PipelineModule
    pm: Any
    transport: Any
    options: Options
    layout: Layout
    parts: Parts
    stage: Stage
    precision: Any
    data_group: Any
    data_ranks: list[int]
    tied_groups: dict[str, tuple[Any, list[int]]]
    tied_reducers: dict[str, Any]
    grad_reducer: Any
    stage_parallel: Any
    optimizer: Any
    lr_scheduler: Any
    runtime: Any
    batch_step: Any
    kernel: Any

    def replace(self, **changes: Any) -> Assembly:
        return dataclasses.replace(self, **changes)


def check_options(*, nonfinite: str, check_data_steps: int, loss_reduction: str,
                  max_grad_norm: float | None, check_every: Any = None,
                  verify_every: Any = None, **rest: Any
                  ) -> Options:
    """The options, refused by name when wrong."""
    if nonfinite not in ("error", "skip"):
        raise ConfigError(f"nonfinite must be 'error' or 'skip', got {nonfinite!r}",
                          hint="pass nonfinite='error' (stop on a NaN/inf loss) or "
                               "nonfinite='skip' (skip that step)")
    if not isinstance(check_data_steps, int) or check_data_steps < 0:
        raise ConfigError(f"check_data_steps must be an int >= 0, got {check_data_steps!r}",
                          hint="pass check_data_steps=N, the number of first batches whose "
                               "labels are checked (0: off)")
    return Options(nonfinite=nonfinite, check_data_steps=check_data_steps,
                   check_every=check_every_option(check_every),
                   verify_every=check_every_option(verify_every, "verify_every"),
                   loss_reduction=check_loss_reduction(loss_reduction),
                   max_grad_norm=max_grad_norm, **rest)


def check_max_grad_norm(max_grad_norm: Any) -> None:
    if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float))
                                          and max_grad_norm > 0):
        raise ConfigError(f"max_grad_norm must be a positive number or None, "
                          f"got {max_grad_norm!r}", hint="e.g. max_grad_norm=1.0")


def choose_layout(module: PipelineModule, optimizer: Any, micro_batches: int,
                  options: Options, pm: Any, transport: Any) -> Layout:
    """The topology, the schedule (the planner's with ``"auto"``), chunks and placement;
    the micro-batch count is the caller's (the planner chooses at it, never changes it)."""
    world, rank = transport.world_size, transport.rank
    parallel, schedule, chunks = options.parallel, options.schedule, options.chunks
    tp, shard = parallel.tensor_parallel_size, parallel.data_parallel_shard
    num_stages = module.num_stages or world // ((options.data_parallel_size or 1) * shard * tp)
    topology = Topology.from_world(world, rank, num_stages, options.data_parallel_size, tp,
                                   parallel.rank_order, shard)
    expert_parallel.check_config(parallel.expert_parallel_size, topology.data_size,
                                 tensor_parallel_size=tp, zero_stage=parallel.zero_stage,
                                 rank=rank)
    plan = None
    # the engine's recompute wins; else the plan's; else the module's interval everywhere
    fixed = None if options.recompute is None else resolve_recompute(
        options.recompute, num_stages, module.activation_checkpoint_interval)
    recompute = fixed or resolve_recompute(None, num_stages,
                                           module.activation_checkpoint_interval)
    if is_auto(schedule):
        if options.seq_chunks != 1:
            raise ConfigError(f"seq_chunks={options.seq_chunks!r} with schedule='auto': "
                              "the planner does not plan sequence chunks", rank=rank,
                              hint="pass schedule='1f1b' with seq_chunks")
        if chunks is not None:
            raise ConfigError(f"chunks={chunks!r} with schedule='auto': the planner "
                              "chooses the chunks", hint="give the chunks to try as "
                              "schedule=pk.auto(chunks=[1, 2])", rank=rank)
        plan = _auto_plan(module, schedule, num_stages, micro_batches, optimizer, pm, transport,
                          parallel.expert_parallel_size, topology, fixed)
        schedule, chunks = plan.schedule, plan.chunks  # the batch stays the user's
        recompute = plan.recompute or recompute
    check_recompute(module, recompute, options.seq_chunks, rank)
    schedule_cls = sequence_schedule(resolve_schedule(pm, schedule), options.seq_chunks,
                                     module, rank)
    chosen = positive_int("chunks", schedule_cls.default_chunks if chunks is None else chunks,
                          hint="e.g. chunks=2 with schedule='interleaved'")
    placement = schedule_cls.placement
    schedule_cls(num_stages, 0, micro_batches, chosen)  # its own clear errors
    if chosen > 1:
        check_placement(placement, chosen)
    if not hasattr(transport, "open_lanes"):  # fail before partitioning
        require_layout_lanes(transport, options.transport, num_stages, chosen, placement, [])
    eval_cls = eval_schedule_for(resolve_schedule(pm, options.eval_schedule), placement, chosen)
    return Layout(topology, schedule_cls, eval_cls, chosen, placement, micro_batches, plan,
                  recompute)


def check_recompute(module: Any, recompute: tuple[int, ...], seq_chunks: int,
                    rank: int) -> None:
    """Refuse recomputation where it cannot run: with skip connections (a recompute would
    stash again) and with sequence chunks (it runs without the key/value prefix)."""
    if not any(recompute):
        return
    if getattr(module, "activation_checkpoint_interval", 0):
        return  # the module's own interval is checked where it is set
    on = [s for s, k in enumerate(recompute) if k]
    if getattr(module, "skip_names", None):
        raise ConfigError(f"recompute on stage(s) {on} with skip connections "
                          f"({sorted(module.skip_names)}): a recompute would stash again",
                          rank=rank, hint="use recompute=None/0 with pk.stash/pk.pop")
    if seq_chunks != 1:
        raise ConfigError(f"recompute on stage(s) {on} with seq_chunks={seq_chunks}: the "
                          "recompute runs outside its chunk, without the key/value prefix",
                          rank=rank, hint="pass recompute=0 with seq_chunks (the chunks cut "
                                          "the activations instead), or seq_chunks=1")


def sequence_schedule(schedule_cls: Any, seq_chunks: Any, module: Any, rank: int) -> Any:
    """``schedule_cls``, or :class:`~pipekernel.schedules.sequence.Seq1F1B` for
    ``seq_chunks`` chunks when ``seq_chunks > 1`` (1F1B only; a model whose attention
    cannot take a key/value prefix says why in ``module.sequence_chunks_refused``)."""
    if seq_chunks == 1:
        return schedule_cls
    positive_int("seq_chunks", seq_chunks, hint="e.g. seq_chunks=4 (1: whole sequences)",
                 rank=rank)
    if schedule_cls.name != OneFOneB.name:
        raise ConfigError(f"seq_chunks={seq_chunks} with schedule {schedule_cls.name!r}: "
                          f"sequence chunks run under 1F1B only (Seq1F1B)", rank=rank,
                          hint="pass schedule='1f1b' with seq_chunks, or seq_chunks=1")
    if module.sequence_chunks_refused:
        raise ConfigError(f"seq_chunks={seq_chunks}: {module.sequence_chunks_refused}",
                          rank=rank, hint="train this model with seq_chunks=1 (whole sequences)")
    if getattr(module, "activation_checkpoint_interval", 0):
        raise ConfigError(f"seq_chunks={seq_chunks} with activation_checkpoint_interval="
                          f"{module.activation_checkpoint_interval}: the recompute runs "
                          f"outside its chunk, without the key/value prefix", rank=rank,
                          hint="pass activation_checkpoint_interval=0 with seq_chunks (the "
                               "chunks cut the activations instead), or seq_chunks=1")
    return Seq1F1B.with_chunks(seq_chunks)


def _auto_plan(module: PipelineModule, request: Any, num_stages: int, micro_batches: int,
               optimizer: Any, pm: Any, transport: Any, expert_parallel_size: int,
               topology: Topology, recompute: tuple[int, ...] | None) -> Plan:
    """Profile and search (every rank, the same plan; see :mod:`pipekernel.engine.planner`)."""
    plan = plan_module(module, request if isinstance(request, Auto) else Auto(),
                       num_stages=num_stages, micro_batches=micro_batches, pm=pm,
                       transport=transport, device=transport.device,
                       optimizer=_factory(optimizer),
                       expert_parallel_size=expert_parallel_size, topology=topology,
                       runs=micro_batches, recompute=recompute)
    check_consistency(transport, plan.fields(), "plan (schedule='auto')")
    if transport.rank == 0:
        print(plan.announce(), file=sys.stderr, flush=True)
        _plan_log.info("%s", plan.format())
    return plan


def _factory(optimizer: Any) -> Any:
    """``optimizer`` when it is a factory (not a built optimizer), else ``None``."""
    return optimizer if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer) \
        else None


def eval_schedule_for(cls: Any, placement: str, chunks: int) -> Any:
    """The evaluation schedule for a model split by ``placement`` into ``chunks`` per stage."""
    if getattr(cls, "placement", "loop") == placement and chunks <= cls.max_chunks:
        return cls
    adapt = getattr(cls, "for_placement", None)
    if adapt is None:
        raise ConfigError(f"eval schedule {cls.name!r} cannot run a model placed {placement!r} "
                          f"with {chunks} chunks per stage",
                          hint="use eval_schedule='inference' (it follows any placement)")
    return adapt(placement)


def require_layout_lanes(transport: Any, name: str, num_stages: int, chunks: int,
                         placement: str, skips: list) -> None:
    """Open (or check) the transport's lanes for this pipeline's layout: one per
    channel at each rank (:mod:`pipekernel.schedules.lanes`)."""
    needed = lanes_needed(num_stages=num_stages, chunks=chunks, placement=placement,
                          skips=skips)
    layout = (f"{num_stages} stage(s) x {chunks} chunk(s) ({placement!r} "
              f"placement)" + (f" with skip edges {list(skips)}" if skips else ""))
    require_lanes(transport, needed, name=name, layout=layout, rank=transport.rank)


def agree(module: PipelineModule, layout: Layout, options: Options, transport: Any) -> None:
    """Check that every rank got the same configuration (one all-gather), before anything
    that depends on it communicates."""
    partition = module.partition_method
    fields = {"pipekernel version": version(), "world size": transport.world_size,
              "stages": layout.topology.pipe_size,
              "data parallel size": layout.topology.data_size,
              "schedule": layout.schedule_cls.name, "eval schedule": options.eval_schedule,
              "chunks": layout.chunks, "micro_batches": layout.micro_batches,
              "precision": options.precision, "layers": len(module.layers),
              "partition": partition if isinstance(partition, (str, list, tuple))
              else type(partition).__name__,
              "nonfinite": options.nonfinite, "check_data_steps": options.check_data_steps,
              "check_every": options.check_every, "verify_every": options.verify_every,
              "loss_reduction": options.loss_reduction, **options.parallel.fields(),
              "recompute": list(layout.recompute),
              "skip connections": sorted(module.skip_names.items())}
    check_consistency(transport, fields)


def version() -> str:
    try:
        from importlib.metadata import version as installed
        return installed("pipekernel")
    except Exception:
        return "unknown"


def partition(module: PipelineModule, optimizer: Any, layout: Layout, pm: Any,
              transport: Any) -> Parts:
    """Split the layers into parts (every rank the same bounds) and report it."""
    num_stages, chunks = layout.topology.pipe_size, layout.chunks
    micro_batches = layout.micro_batches
    # every rank partitions here, before any group exists: plugins may broadcast
    # per part, the micro-batches whose graph its chunk holds at once (a deferred weight
    # pass included), not its stage's whole in-flight count, which counts every chunk's;
    # Seq1F1B's buffers hold sequence chunks, 1/seq_chunks of a micro-batch each
    per = getattr(layout.schedule_cls, "seq_chunks", 1)
    live = {k: -(-n // per) for k, n in
            live_graphs(layout.schedule_cls, num_stages, micro_batches, chunks).items()}
    num_parts = num_stages * chunks
    part_stages = [locate(p, num_stages, layout.placement)[0] for p in range(num_parts)]
    context = PartitionContext(
        module=module, num_stages=num_parts, transport=transport, device=transport.device,
        rank=transport.rank, micro_batches=micro_batches,
        in_flight=[live[locate(p, num_stages, layout.placement)] for p in range(num_parts)],
        optimizer=_factory(optimizer))
    bounds = list(layout.plan.bounds) if layout.plan is not None else \
        module.partition(num_parts, pm, context)
    check_consistency(transport, {"partition bounds": list(bounds)},
                      "partition (a method that measures, e.g. profile, must "
                      "broadcast its result)")
    report = PartitionReport.build(module, bounds, context, predicted_memory(
        module, bounds, context, layout.schedule_cls, num_stages, chunks, layout.placement))
    if transport.rank == 0:
        _partition_log.info("%s", report.format())
    return Parts(part_stages, bounds, report)


def predicted_memory(module: PipelineModule, bounds: list[int], context: PartitionContext,
                     schedule_cls: Any, num_stages: int, chunks: int,
                     placement: str) -> list[dict[str, float]] | None:
    """Per pipeline stage, the memory model's bytes at its peak by category (params, grads,
    optimizer, saved, buffers: :func:`~pipekernel.schedules.sim_memory.stage_memory`, the
    model of ``pk.auto`` and ``pipekernel plan``), from the bytes the partition plugin
    measured per layer; ``None`` where it measured none (or the schedule cannot be
    replayed). The loss's labels are not counted (the profile sees inputs only)."""
    static, saved = context.layer_static_bytes, context.layer_activation_bytes
    if static is None or saved is None:
        return None
    params, trainable = _parameter_bytes(module)
    sample = getattr(module.partition_method, "sample", None)
    parts = part_bytes(bounds, num_stages, chunks, placement, saved=saved,
                       outputs=context.layer_output_bytes or [0.0] * len(saved),
                       weight_states=context.layer_weight_state_bytes,
                       input_bytes=_nbytes(sample) if sample is not None else 0.0,
                       checkpoint_interval=module.activation_checkpoint_interval or 0,
                       grads=trainable)
    try:
        peaks = stage_memory(schedule_cls, num_stages, context.micro_batches, chunks, parts)
    except PipelineError:
        return None
    out = []
    for s in range(num_stages):
        mine = [i for q in range(num_stages * chunks) if locate(q, num_stages, placement)[0] == s
                for i in range(bounds[q], bounds[q + 1])]
        own = sum(params[i] for i in mine)
        state = sum(static[i] for i in mine) - own - sum(trainable[i] for i in mine)
        out.append({"params": own, "grads": peaks[s]["grads"], "optimizer": max(state, 0.0),
                    "saved": peaks[s]["saved"], "buffers": peaks[s]["buffers"]})
    return out


def _parameter_bytes(module: PipelineModule) -> tuple[list[float], list[float]]:
    """Per layer, its parameters' bytes and its trainable ones' (their gradients' bytes),
    counted on the meta device (nothing is allocated)."""
    from pipekernel.model.module import LayerSpec

    params, trainable = [], []
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        for layer in module.layers:
            built = layer.build() if isinstance(layer, LayerSpec) else layer
            found = list(built.parameters()) if isinstance(built, torch.nn.Module) else []
            params.append(float(sum(p.numel() * p.element_size() for p in found)))
            trainable.append(float(sum(p.numel() * p.element_size() for p in found
                                       if p.requires_grad)))
    return params, trainable


def _nbytes(sample: Any) -> float:
    """Bytes of the tensors in ``sample`` (one micro-batch of first-stage inputs)."""
    tensors = [sample] if isinstance(sample, torch.Tensor) else list(
        sample.values() if isinstance(sample, dict) else
        sample if isinstance(sample, (tuple, list)) else ())
    return float(sum(_nbytes(t) if not isinstance(t, torch.Tensor)
                     else t.numel() * t.element_size() for t in tensors))


def mesh_unwanted(parallel: ParallelConfig, pm: Any) -> str:
    """Why this engine needs no DeviceMesh (``""``: it does): no FSDP2, no DTensor plan
    and no plugin of the user's on ``pipekernel_parallelize_stage``."""
    if parallel.data_parallel_shard > 1 or parallel.tensor_parallel_plan is not None:
        return ""
    for impl in pm.hook.pipekernel_parallelize_stage.get_hookimpls():
        plugin = impl.plugin
        where = getattr(plugin, "__name__", None) or type(plugin).__module__
        if not str(where).startswith("pipekernel.plugins."):
            return ""  # a user's parallelizer gets the mesh
    return ("nothing applies torch parallelism to the stage (data_parallel_shard, "
            "tensor_parallel_plan or a pipekernel_parallelize_stage plugin builds one)")


def build_stage(module: PipelineModule, layout: Layout, parts: Parts, options: Options,
                pm: Any, transport: Any) -> Stage:
    """Build this stage's layers (in its expert-parallel group) and its skip routing."""
    topology, chunks = layout.topology, layout.chunks
    num_stages, stage = topology.pipe_size, topology.stage
    grid = build_grid(topology, transport, mesh_unwanted(options.parallel, pm))
    ep_group = expert_parallel.make_group(topology, transport,
                                          options.parallel.expert_parallel_size,
                                          lanes=min(chunks, 2))
    positions = parts_of(stage, num_stages, chunks, layout.placement)
    with expert_parallel.context(ep_group):
        # the engine's interval only where it differs from the module's: a subclass
        # overriding build_stage without the argument keeps working
        interval = layout.recompute[stage] if layout.recompute else None
        extra = {} if interval in (None, module.activation_checkpoint_interval) else \
            {"activation_checkpoint_interval": interval}
        built = module.build_stage(stage, parts.bounds, positions, **extra).to(transport.device)
    router = router_for(module, parts.bounds, built, positions, stage)
    edges = router.edges if router is not None else []
    # after the agreement: opening lanes is collective, every rank opens as many
    require_layout_lanes(transport, options.transport, num_stages, chunks, layout.placement,
                         edges)
    if edges:
        check_schedules([layout.schedule_cls, layout.eval_schedule_cls], num_stages,
                        layout.micro_batches, chunks, edges)
    return Stage(grid, grid.mesh, ep_group, built, router, edges)
