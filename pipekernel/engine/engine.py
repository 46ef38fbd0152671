"""The engine (layer 3): a short loop over a frozen :class:`~pipekernel.engine.assembly.Assembly`
(built by :func:`~pipekernel.engine.assembly.assemble`) and one small
:class:`~pipekernel.engine.state.RunState`; ``train_batch`` / ``eval_batch`` / checkpoints.

The engine implements :class:`pipekernel.plugin.EngineView`, the typed read-only view that
hooks and checkpoints get: hooks receive the engine itself, so a plugin reading
``engine.<attr>`` keeps working, and the view says which attributes are the contract."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pipekernel.comm import clusters, teardown  # noqa: F401 - teardown binds at import
from pipekernel.engine.assembly import Assembly, assemble, check_options
from pipekernel.engine.assembly_step import make_lr_scheduler, make_optimizer
from pipekernel.engine.faults import engine_board, root_cause
from pipekernel.engine.fields import EngineFields
from pipekernel.engine.programs import (agree_micro_batches, check_micro_batch_count,
                                        check_micro_batches, load_program, program_of)
from pipekernel.engine.state import RunState
from pipekernel.errors import ConfigError, PipelineError
from pipekernel.extend.manager import make_plugin_manager, make_transport
from pipekernel.grid.parallel import ParallelConfig
from pipekernel.kernel.program import LoadedProgram
from pipekernel.stage.module import PipelineModule

__all__ = ["PipelineEngine"]


class PipelineEngine(EngineFields):
    """Train and evaluate a :class:`PipelineModule` with pipeline × data parallelism.

    Every rank of the world constructs the engine with the same arguments.

    :param module: the model as a layer list.
    :param optimizer: ``factory(params) -> Optimizer`` (preferred: the engine
        builds it over this stage's parameters, or over the fp32 master copies
        for low-precision policies) or an optimizer built over
        ``engine.module.parameters()`` (refused with ``ConfigError`` when the
        precision steps master copies); ``None`` for inference only.
    :param micro_batches: micro-batches per ``train_batch``/``eval_batch``; change it
        later with :meth:`set_micro_batches` or per call (``train_batch(it, micro_batches=n)``),
        every rank together.
    :param schedule: training schedule name (``"1f1b"``, ``"gpipe"``, ...), or
        ``"auto"`` / ``pk.auto(memory_budget=..., ...)``: profile the layers and choose
        schedule, chunks, micro-batch count and partition by simulation (the choice
        in ``engine.plan``; see :mod:`pipekernel.engine.planner`).
    :param eval_schedule: schedule name ``eval_batch`` runs (default ``"inference"``:
        forward only).
    :param transport: transport name (entry point of ``pipekernel.transports``);
        ``"auto"`` (default) picks ``"nccl"`` when the stages run on CUDA (CUDA available,
        or a host's process group with the nccl backend), else ``"gloo"``, and rank 0
        prints the choice once.
    :param precision: precision policy name: ``"fp32"``, ``"bf16"``, ``"fp16"``,
        ``"amp-bf16"`` or one a plugin provides (see ``docs/precision.md``).
    :param data_parallel_size: replicas; default ``world_size // num_stages``.
    :param plugins: plugin objects/modules for this engine only.
    :param timeout: seconds any wait on a peer may take before an error.
    :param autoload_plugins: load third-party ``pipekernel.plugins`` entry points
        (default: yes, unless ``PIPEKERNEL_DISABLE_PLUGIN_AUTOLOAD`` is set).
    :param disable_plugins: names of plugins not to load or register (also
        ``PIPEKERNEL_DISABLE_PLUGINS=a,b``).
    :param transport_options: extra keyword options for the transport, e.g.
        ``{"group": process_group}`` to run on a subgroup of the job.
    :param precision_options: keyword options for the precision policy (e.g. the
        fp16 loss-scaling settings).
    :param max_grad_norm: clip gradients to this global norm (over every stage
        and replica, tied weights counted once, after unscaling, before the step),
        as ``torch.nn.utils.clip_grad_norm_`` on the whole model; ``None``: no clipping.
    :param lr_scheduler: ``factory(optimizer) -> LRScheduler`` or a scheduler;
        stepped after every step taken (not after a step the precision skipped).
    :param nonfinite: what a NaN/inf training loss does: ``"error"`` (default) raises
        on every rank naming the step, the micro-batch(es) and the stage; ``"skip"``
        skips the optimizer step on every rank (one extra tiny all-reduce per step)
        and goes on. fp16 gradient overflow is handled by the precision policy either
        way (skip and back off).
    :param check_data_steps: for this many first batches (train or eval), the first
        stage sends a fingerprint of the labels it read along with each activation and
        the last stage compares it with the labels it read itself: loaders shuffled
        differently raise a ``DataError`` naming the micro-batch. ``0`` turns it off.
    :param chunks: model chunks (virtual stages) per rank, for schedules that hold
        several (``"interleaved"``: any, default 2; ``"zbv"``: 2). The layers are
        split into ``num_stages * chunks`` parts, placed by the schedule's
        ``placement`` (:mod:`pipekernel.schedules.placement`); explicit partition
        boundaries then list ``num_stages * chunks + 1`` entries.
    :param loss_reduction: ``"mean"`` (default: ``loss_fn`` returns a scalar, the batch
        loss is the mean over micro-batches and replicas) or ``"tokens"`` (``loss_fn``
        returns ``(loss_sum, token_count)``; the gradient and the returned loss are the
        mean over every token of every micro-batch and replica; see :mod:`pipekernel.stage.loss`).
    :param grad_bucket_mb: size in MiB of the buckets in which gradients are averaged
        over data-parallel replicas (as DDP's ``bucket_cap_mb``); each bucket's
        all-reduce starts during the stage's last backward of the batch, as soon as
        its gradients are final (see :mod:`pipekernel.step.grad_reduce`). ``0``: no
        overlap, one flat all-reduce at ``ReduceGrads``.
    :param tensor_parallel_size: tensor-parallel ranks per stage ``T`` (default 1): the
        world is ``stages x replicas x T``; layers reach their group through
        :mod:`pipekernel.grid.tensor_parallel` while they are built (see ``docs/parallelism.md``).
    :param rank_order: which rank is which, innermost axis first (default
        ``"tp-dp-pp"``: tensor-parallel ranks adjacent, pipeline outermost; any
        permutation of ``tp``, ``dp``, ``pp``; see :mod:`pipekernel.grid.topology`).
    :param partition_activations: with ``T > 1``, each tensor-parallel rank sends only
        its ``1/T`` slice of the (replicated) floating-point activations and gradients
        between stages and the receiver all-gathers them over its tensor-parallel group
        (default ``True``; ``False`` sends the whole tensors from every rank).
    :param zero_stage: ``1`` shards the optimizer state over the data-parallel replicas
        (ZeRO-1, :mod:`pipekernel.grid.zero`); ``0`` (default) replicates it.
    :param data_parallel_shard: ``N > 1`` shards each stage's parameters, gradients and
        optimizer state over ``N`` ranks with FSDP2 (``fully_shard``, the built-in plugin
        :mod:`pipekernel.plugins.fsdp`), timed by the schedule
        (:mod:`pipekernel.grid.stage_parallel`). The world is then ``stages x replicas x N
        x T``: ``data_parallel_size`` still counts the replicas (HSDP when both are > 1),
        while ``engine.data_parallel_rank`` / ``data_parallel_size`` count every
        data-parallel rank (replicas x shards), each reading its own micro-batches.
    :param reshard_after_forward: with ``data_parallel_shard``, free each layer's gathered
        parameters after its forward and gather them again for its backward (less memory,
        two all-gathers per micro-batch); default ``False``: gathered once per batch.
    :param tensor_parallel_plan: a ``parallelize_module`` plan (``{module-name pattern:
        ParallelStyle}``, names relative to the stage, whose children are the global layer
        indices: ``{"*.fc1": ColwiseParallel(), "*.fc2": RowwiseParallel()}``) applied to
        each stage over ``mesh["tp"]`` (``tensor_parallel_size`` ranks) by the built-in plugin
        :mod:`pipekernel.plugins.tensor_parallel_dtensor`; what crosses stages stays plain
        tensors.

    ``engine.mesh`` is the :class:`~torch.distributed.device_mesh.DeviceMesh` with the dims
    ``("pp", "dp_replicate", "dp_shard", "tp")`` (:mod:`pipekernel.grid.mesh`; ``None``
    for a transport that cannot carry one); plugins apply torch parallelism over it
    through the hook ``pipekernel_parallelize_stage``.
    :param expert_parallel_size: ``E`` (default 1) spreads each stage's experts (layers
        such as :class:`pipekernel.MoE`) over groups of ``E`` of its data-parallel
        replicas; ``E`` must divide the data-parallel size (see
        :mod:`pipekernel.grid.expert_parallel` and ``docs/moe.md``).
    """

    def __init__(self, module: PipelineModule, optimizer: Any = None, *, micro_batches: int = 1,
                 schedule: Any = "1f1b", transport: str = "auto", precision: str = "fp32",
                 data_parallel_size: int | None = None, plugins: Iterable[Any] = (),
                 timeout: float = 300.0, autoload_plugins: bool | None = None,
                 disable_plugins: Iterable[str] = (), transport_options: dict | None = None,
                 precision_options: dict | None = None, eval_schedule: str = "inference",
                 max_grad_norm: float | None = None, lr_scheduler: Any = None,
                 chunks: int | None = None, grad_bucket_mb: float = 25.0,
                 nonfinite: str = "error", check_data_steps: int = 3,
                 loss_reduction: str = "mean",
                 tensor_parallel_size: int = 1, rank_order: str | None = None,
                 partition_activations: bool = True, zero_stage: int = 0,
                 data_parallel_shard: int = 1, reshard_after_forward: bool = False,
                 expert_parallel_size: int = 1, tensor_parallel_plan: Any = None) -> None:
        if not isinstance(module, PipelineModule):
            raise ConfigError(f"module must be a PipelineModule, got {type(module).__name__}",
                              hint="wrap your layers: PipelineModule([LayerSpec(...), ...])")
        # a launcher's world (a SLURM step, Ray Train) is joined through torchrun's variables
        world = clusters.export()
        check_micro_batch_count(micro_batches, world.rank if world is not None else None)
        if isinstance(grad_bucket_mb, bool) or not (isinstance(grad_bucket_mb, (int, float))
                                                    and grad_bucket_mb >= 0):
            raise ConfigError(f"grad_bucket_mb must be a number >= 0, got {grad_bucket_mb!r}",
                              hint="e.g. grad_bucket_mb=25 (0 turns the overlap off)")
        pm = make_plugin_manager(plugins, autoload=autoload_plugins, disabled=disable_plugins)
        made = make_transport(pm, transport, {"timeout": timeout, **(transport_options or {})})
        #: the first failure of this engine's ranks (see pipekernel.engine.faults)
        self.abort_board = engine_board(made)
        #: what changes as the engine runs (:class:`~pipekernel.engine.state.RunState`)
        self.state = RunState(micro_batches)
        #: (schedule class, micro-batch count) -> its loaded program: the one cache of them
        self._programs: dict[tuple[Any, int], LoadedProgram] = {}
        try:
            options = check_options(
                schedule=schedule, eval_schedule=eval_schedule, chunks=chunks,
                data_parallel_size=data_parallel_size, transport=transport,
                precision=precision, precision_options=dict(precision_options or {}),
                nonfinite=nonfinite, check_data_steps=check_data_steps,
                loss_reduction=loss_reduction, grad_bucket_mb=grad_bucket_mb,
                max_grad_norm=max_grad_norm, lr_scheduler=lr_scheduler,
                parallel=ParallelConfig.make(tensor_parallel_size, rank_order,
                                             partition_activations, zero_stage,
                                             data_parallel_shard, reshard_after_forward,
                                             expert_parallel_size, tensor_parallel_plan))
            self._assembly: Assembly = assemble(module, optimizer, micro_batches, options, pm,
                                                made)
            counted = self._assembly.layout.micro_batches  # the planner may choose it
            self.state.micro_batches = self.state.checked_micro_batches = counted
            self.state.skips_proven = {counted}
            pm.hook.pipekernel_configure(engine=self)
        except BaseException as err:
            self.abort_board.publish(err)  # the others stop waiting for this rank
            raise

<<<<<<< HEAD
=======
    def _build(self, module: PipelineModule, optimizer: Any, *, micro_batches: int,
               schedule: Any, precision: str, data_parallel_size: int | None,
               precision_options: dict | None, eval_schedule: str,
               max_grad_norm: float | None, lr_scheduler: Any, chunks: int | None,
               transport: str, nonfinite: str, check_data_steps: int,
               loss_reduction: str, parallel: ParallelConfig) -> None:
        self._check_options(module, nonfinite, check_data_steps, loss_reduction)
        micro_batches = self._choose_schedule(module, optimizer, schedule, chunks, micro_batches,
                                              data_parallel_size, parallel, transport,
                                              eval_schedule)
        self._agree(module, micro_batches, precision, eval_schedule, parallel)
        self._partition(module, optimizer, micro_batches)
        self._build_stage(module, micro_batches, transport)
        self._build_step(optimizer, precision, precision_options, max_grad_norm, lr_scheduler)
        self._build_kernel(module, parallel, micro_batches)

    def _check_options(self, module: PipelineModule, nonfinite: str, check_data_steps: int,
                       loss_reduction: str) -> None:
        if nonfinite not in ("error", "skip"):
            raise ConfigError(f"nonfinite must be 'error' or 'skip', got {nonfinite!r}",
                              hint="pass nonfinite='error' (stop on a NaN/inf loss) or "
                                   "nonfinite='skip' (skip that step)")
        if not isinstance(check_data_steps, int) or check_data_steps < 0:
            raise ConfigError(f"check_data_steps must be an int >= 0, got {check_data_steps!r}",
                              hint="pass check_data_steps=N, the number of first batches whose "
                                   "labels are checked (0: off)")
        self.nonfinite, self.check_data_steps = nonfinite, check_data_steps
        self.loss_reduction = check_loss_reduction(loss_reduction)
        #: the ``loss_fn`` wrapper keeping token counts (``loss_reduction="tokens"``)
        self.token_loss = TokenLoss(module.loss_fn) if loss_reduction == "tokens" \
            and module.loss_fn is not None else None
        self._batches_run = 0

    def _choose_schedule(self, module: PipelineModule, optimizer: Any, schedule: Any,
                         chunks: int | None, micro_batches: int,
                         data_parallel_size: int | None, parallel: ParallelConfig,
                         transport: str, eval_schedule: str) -> int:
        """The topology, the schedule (the planner's with ``"auto"``), chunks and placement;
        the micro-batch count (the planner may choose it)."""
        world, rank = self.transport.world_size, self.transport.rank
        self.parallel = parallel
        tp, shard = parallel.tensor_parallel_size, parallel.data_parallel_shard
        num_stages = module.num_stages or world // ((data_parallel_size or 1) * shard * tp)
        self.topology = Topology.from_world(world, rank, num_stages, data_parallel_size, tp,
                                            parallel.rank_order, shard)
        expert_parallel.check_config(parallel.expert_parallel_size, self.topology.data_size,
                                     tensor_parallel_size=tp, zero_stage=parallel.zero_stage,
                                     rank=rank)
        #: The :class:`~pipekernel.engine.planner.Plan` ``schedule="auto"`` chose (else ``None``).
        self.plan: Plan | None = None
        if is_auto(schedule):
            if chunks is not None:
                raise ConfigError(f"chunks={chunks!r} with schedule='auto': the planner "
                                  "chooses the chunks", hint="give the chunks to try as "
                                  "schedule=pk.auto(chunks=[1, 2])", rank=rank)
            self.plan = self._auto_plan(module, schedule, num_stages, micro_batches, optimizer)
            schedule, chunks, micro_batches = (self.plan.schedule, self.plan.chunks,
                                               self.plan.micro_batches)
            self.micro_batches = micro_batches
        self.schedule_cls = resolve_schedule(self.pm, schedule)
        self.chunks = self.schedule_cls.default_chunks if chunks is None else chunks
        if not isinstance(self.chunks, int) or isinstance(self.chunks, bool) or self.chunks < 1:
            raise ConfigError(f"chunks must be a positive int, got {chunks!r}",
                              hint="e.g. chunks=2 with schedule='interleaved'")
        self.placement = self.schedule_cls.placement
        self.schedule_cls(num_stages, 0, micro_batches, self.chunks)  # its own clear errors
        if self.chunks > 1:
            check_placement(self.placement, self.chunks)
        if not hasattr(self.transport, "open_lanes"):  # fail before partitioning
            self._require_lanes(transport, num_stages, [])
        self.eval_schedule_cls = _eval_schedule(resolve_schedule(self.pm, eval_schedule),
                                                self.placement, self.chunks)
        return micro_batches

    def _agree(self, module: PipelineModule, micro_batches: int, precision: str,
               eval_schedule: str, parallel: ParallelConfig) -> None:
        """Check that every rank got the same configuration (one all-gather)."""
        world, num_stages = self.transport.world_size, self.num_stages
        nonfinite, check_data_steps = self.nonfinite, self.check_data_steps
        loss_reduction = self.loss_reduction
        # before anything that depends on it communicates: every rank must agree
        fields = {"pipekernel version": _version(), "world size": world,
                  "stages": num_stages, "data parallel size": self.topology.data_size,
                  "schedule": self.schedule_cls.name, "eval schedule": eval_schedule,
                  "chunks": self.chunks, "micro_batches": micro_batches,
                  "precision": precision, "layers": len(module.layers),
                  "partition": module.partition_method
                  if isinstance(module.partition_method, (str, list, tuple)) else
                  type(module.partition_method).__name__,
                  "nonfinite": nonfinite, "check_data_steps": check_data_steps,
                  "loss_reduction": loss_reduction, **parallel.fields(),
                  "skip connections": sorted(module.skip_names.items())}
        check_consistency(self.transport, fields)

    def _partition(self, module: PipelineModule, optimizer: Any, micro_batches: int) -> None:
        """Split the layers into parts (every rank the same bounds) and report it."""
        num_stages, rank = self.num_stages, self.transport.rank
        # every rank partitions here, before any group exists: plugins may broadcast
        in_flight = [self.schedule_cls(num_stages, s, micro_batches, self.chunks).num_buffers()
                     for s in range(num_stages)]
        num_parts = num_stages * self.chunks
        #: Which stage holds each part (pipeline position).
        self.part_stages = [locate(p, num_stages, self.placement)[0] for p in range(num_parts)]
        context = PartitionContext(
            module=module, num_stages=num_parts, transport=self.transport,
            device=self.transport.device, rank=rank, micro_batches=micro_batches,
            in_flight=[in_flight[s] for s in self.part_stages],
            optimizer=optimizer if callable(optimizer)
            and not isinstance(optimizer, torch.optim.Optimizer) else None)
        self.bounds = list(self.plan.bounds) if self.plan is not None else \
            module.partition(num_parts, self.pm, context)
        check_consistency(self.transport, {"partition bounds": list(self.bounds)},
                          "partition (a method that measures, e.g. profile, must "
                          "broadcast its result)")
        #: :class:`~pipekernel.stage.partitioning.PartitionReport`: layers, parameters,
        #: cost and memory per stage, and the imbalance (same on every rank).
        self.partition_report = PartitionReport.build(module, self.bounds, context)
        if rank == 0:
            _partition_log.info("%s", self.partition_report.format())

    def _mesh_unwanted(self) -> str:
        """Why this engine needs no DeviceMesh (``""``: it does): no FSDP2, no DTensor plan
        and no plugin of the user's on ``pipekernel_parallelize_stage``."""
        parallel = self.parallel
        if parallel.data_parallel_shard > 1 or parallel.tensor_parallel_plan is not None:
            return ""
        for impl in self.pm.hook.pipekernel_parallelize_stage.get_hookimpls():
            plugin = impl.plugin
            where = getattr(plugin, "__name__", None) or type(plugin).__module__
            if not str(where).startswith("pipekernel.plugins."):
                return ""  # a user's parallelizer gets the mesh
        return ("nothing applies torch parallelism to the stage (data_parallel_shard, "
                "tensor_parallel_plan or a pipekernel_parallelize_stage plugin builds one)")

    def _build_stage(self, module: PipelineModule, micro_batches: int, transport: str) -> None:
        """Build this stage's layers (in its tensor-parallel group) and its skip routing."""
        num_stages = self.num_stages
        #: This rank's groups and the mesh (:mod:`pipekernel.grid.mesh`).
        self.grid = build_grid(self.topology, self.transport, self._mesh_unwanted())
        #: The engine's :class:`~torch.distributed.device_mesh.DeviceMesh` (dims ``("pp",
        #: "dp_replicate", "dp_shard", "tp")``), or ``None`` (a transport without one, or
        #: an engine where nothing applies torch parallelism to the stage).
        self.mesh = self.grid.mesh
        #: This rank's :class:`~pipekernel.grid.tensor_parallel.TensorParallelGroup`.
        self.tp_group = tp_group_of(self.grid, self.topology, self.transport)
        #: This rank's :class:`~pipekernel.grid.expert_parallel.ExpertParallelGroup`.
        self.ep_group = expert_parallel.make_group(self.topology, self.transport,
                                                   self.parallel.expert_parallel_size,
                                                   lanes=min(self.chunks, 2))
        positions = parts_of(self.stage, num_stages, self.chunks, self.placement)
        with tp_context(self.tp_group), expert_parallel.context(self.ep_group):
            self.module = module.build_stage(self.stage, self.bounds, positions
                                             ).to(self.transport.device)
        #: Skip connections between parts (:mod:`pipekernel.stage.skips`), or ``None``.
        self.skip_router = router_for(module, self.bounds, self.module, positions, self.stage)
        self.skip_edges = self.skip_router.edges if self.skip_router is not None else []
        # after check_consistency: opening lanes is collective, every rank opens as many
        self._require_lanes(transport, num_stages, self.skip_edges)
        if self.skip_edges:
            check_schedules([self.schedule_cls, self.eval_schedule_cls], num_stages,
                            micro_batches, self.chunks, self.skip_edges)
        self._skips_proven = {micro_batches}  # counts whose skip routing was simulated

    def _build_step(self, optimizer: Any, precision: str, precision_options: dict | None,
                    max_grad_norm: float | None, lr_scheduler: Any) -> None:
        """Precision, process groups, reducers, optimizer and LR scheduler."""
        self.precision = make_precision(self.pm, precision, dict(precision_options or {}))
        if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float))
                                              and max_grad_norm > 0):
            raise ConfigError(f"max_grad_norm must be a positive number or None, "
                              f"got {max_grad_norm!r}", hint="e.g. max_grad_norm=1.0")
        self.max_grad_norm = max_grad_norm
        self._make_groups()
        self._sync_parameters()
        # before the precision and the optimizer see the parameters (FSDP2, DTensor)
        self.pm.hook.pipekernel_parallelize_stage(module=self.module, mesh=self.mesh,
                                                  engine=self)
        #: The :class:`~pipekernel.grid.stage_parallel.StageParallel` timing the stage's
        #: FSDP2 modules by the schedule, or ``None``.
        self.stage_parallel = check_stage_parallel(self)
        self.precision.prepare(self.module)  # after the sync: casts and masters start equal
        self._make_reducers()  # after prepare: the reducers need the master copies
        self.optimizer = self._make_optimizer(optimizer)
        self.lr_scheduler = (lr_scheduler(self.optimizer) if callable(lr_scheduler)
                             and not hasattr(lr_scheduler, "step") else lr_scheduler)

    def _build_kernel(self, module: PipelineModule, parallel: ParallelConfig,
                      micro_batches: int) -> None:
        """The stage runtime, the batch step and the kernel over both's handlers."""
        rank = self.transport.rank
        self.runtime = StageRuntime(self.module, self.topology, self.transport,
                                    self.token_loss or module.loss_fn,
                                    self.precision, chunks=self.chunks, placement=self.placement,
                                    wire=ActivationPartitioner(self.tp_group)
                                    if parallel.partitions else None,
                                    skips=self.skip_router, **self._backward_callbacks())
        #: The :class:`~pipekernel.step.optimizer_step.BatchStep`: reductions, the
        #: optimizer step and the batch loss.
        self.batch_step = BatchStep(
            module=self.module, precision=self.precision, optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler, transport=self.transport, topology=self.topology,
            tied_groups=self.tied_groups, tied_reducers=self._tied_reducers,
            grad_reducer=self.grad_reducer, max_grad_norm=self.max_grad_norm,
            nonfinite=self.nonfinite, token_loss=self.token_loss,
            expert_parallel=self.ep_group if self.ep_group.size > 1 else None)
        handlers = {**self.runtime.handlers(), **self.batch_step.handlers()}
        for extra in self.pm.hook.pipekernel_register_instructions(runtime=self.runtime):
            handlers.update(extra or {})
        self.kernel = Kernel(handlers, hook=self.pm.hook, rank=rank, stage=self.stage,
                             enter=self.runtime.enter)
        self.global_steps = 0
        self.skipped_steps = 0
        #: Micro-batches each replica trained on so far (the counts may change).
        self.trained_micro_batches = 0
        #: (schedule class, micro-batch count) -> its loaded program: the one cache of them
        self._programs: dict[tuple[Any, int], LoadedProgram] = {}
        self._checked_micro_batches = micro_batches  # agreed on by the check above
        self.pm.hook.pipekernel_configure(engine=self)

    def _auto_plan(self, module: PipelineModule, request: Any, num_stages: int,
                   micro_batches: int, optimizer: Any) -> Plan:
        """Profile and search (every rank, the same plan; see :mod:`pipekernel.engine.planner`)."""
        plan = plan_module(module, request if isinstance(request, Auto) else Auto(),
                           num_stages=num_stages, micro_batches=micro_batches, pm=self.pm,
                           transport=self.transport, device=self.transport.device,
                           optimizer=optimizer if callable(optimizer)
                           and not isinstance(optimizer, torch.optim.Optimizer) else None,
                           expert_parallel_size=self.parallel.expert_parallel_size,
                           topology=self.topology)
        check_consistency(self.transport, plan.fields(), "plan (schedule='auto')")
        if self.transport.rank == 0:
            _plan_log.info("%s", plan.format())
        return plan

    @property
    def last_grad_norm(self) -> float | None:
        """Global gradient norm of the last step (before clipping), when clipping."""
        return self.batch_step.last_grad_norm

    # -- where this process sits ---------------------------------------------
    @property
    def stage(self) -> int:
        return self.topology.stage

    @property
    def num_stages(self) -> int:
        return self.topology.pipe_size

    @property
    def data_parallel_rank(self) -> int:
        return self.topology.data_rank

    @property
    def data_parallel_size(self) -> int:
        return self.topology.data_size

    @property
    def rank(self) -> int:
        return self.topology.rank

    def is_first_stage(self) -> bool:
        return self.topology.is_first_stage

    def is_last_stage(self) -> bool:
        return self.topology.is_last_stage

    # -- set-up ---------------------------------------------------------------
    def _make_groups(self) -> None:
        """Create every group on every rank, in the same order (a transport requirement)."""
        topo, transport = self.topology, self.transport
        self.data_group, self.data_ranks = self.grid.data  # replicas x shards
        self.tied_groups: dict[str, tuple[Any, list[int]]] = {}
        tied = self.pipeline_module.tied_stages(self.bounds, self.part_stages.__getitem__)
        for key, stages in sorted(tied.items()):
            if len(stages) < 2:
                continue
            for ranks in topo.stage_groups(stages):
                group = transport.new_group(ranks)
                if topo.rank in ranks:
                    self.tied_groups[key] = (group, ranks)

    def _sync_parameters(self) -> None:
        """Make tied copies and replicas start identical (matters when no seed is given)."""
        with torch.no_grad():
            for key, (group, ranks) in self.tied_groups.items():
                for p in self.module.tied_modules[key].parameters():
                    self.transport.broadcast(p.data, ranks[0], group)
            ep = self.ep_group
            if self.topology.data_size > 1:
                for p in self.module.parameters():
                    if ep.size == 1 or not expert_parallel.is_expert(p):
                        self.transport.broadcast(p.data, self.data_ranks[0], self.data_group)
            if ep.size > 1:  # experts differ over the data-parallel group
                expert_parallel.broadcast_experts(
                    self.transport, [p for p in self.module.parameters()
                                     if expert_parallel.is_expert(p)], ep)
            tp = self.tp_group
            if tp.size > 1:  # replicated parameters are equal on every tensor-parallel rank
                for p in self.module.parameters():
                    if sharded_dim(p) is None:
                        self.transport.broadcast(p.data, tp.ranks[0], tp.handle)

    def _make_reducers(self) -> None:
        """One :class:`GradReducer` per tied group (a sum over stages, no overlap) and
        one over the data-parallel replicas (an average, overlapped with the backward;
        tied weights wait for the tied sum)."""
        master = self.precision.master
        self._tied_reducers = {
            key: GradReducer(self.module.tied_modules[key].parameters(), self.transport, group,
                             len(ranks), 0, master=master, average=False)
            for key, (group, ranks) in self.tied_groups.items()}
        #: The data-parallel :class:`~pipekernel.step.grad_reduce.GradReducer` (``None``
        #: without data parallelism).
        self.grad_reducer: GradReducer | None = None
        if self.topology.data_size > 1:
            sharded = self.stage_parallel
            named = [(name, p) for name, p in self.module.named_parameters()
                     if sharded is None or not sharded.managed(p)]  # FSDP2 reduces those
            experts: list = []
            if self.ep_group.size > 1:  # experts: their own group (grid/expert_parallel.py)
                experts = [(n, p) for n, p in named if expert_parallel.is_expert(p)]
                named = [(n, p) for n, p in named if not expert_parallel.is_expert(p)]
            tied = [p for key in self.tied_groups for p in self.module.tied_modules[key].parameters()]
            if not any(p.requires_grad for _, p in named + experts):
                return
            self.grad_reducer = GradReducer(
                [p for _, p in named], self.transport, self.data_group, self.topology.data_size,
                int(self.grad_bucket_mb * 2 ** 20), master=master, late=tied,
                names=[name for name, _ in named])
            if self.ep_group.size > 1:
                self.grad_reducer = ReducerPair(
                    self.grad_reducer, ExpertGradReducer(
                        [p for _, p in experts], self.transport, self.ep_group,
                        int(self.grad_bucket_mb * 2 ** 20), master, [n for n, _ in experts]))

    def _backward_callbacks(self) -> dict[str, Any]:
        """What the runtime calls around the stage's last backward of the batch."""
        reducer, sharded = self.grad_reducer, self.stage_parallel
        callbacks: dict[str, Any] = {}
        if sharded is not None:  # FSDP2's reduce-scatters, once per batch
            callbacks = {"after_last_backward": sharded.after_last_backward,
                         "params_of": sharded.autograd_params}
        if reducer is None or reducer.bucket_bytes <= 0:
            return callbacks
        if sharded is not None:
            def after() -> None:
                sharded.after_last_backward()
                reducer.backward_done()
        else:
            after = reducer.backward_done
        return {**callbacks, "after_last_backward": after,
                "before_last_backward": lambda settled: reducer.arm(final=settled)}

>>>>>>> epcost
    def set_optimizer(self, optimizer: Any, lr_scheduler: Any = None) -> None:
        """Replace the optimizer (and LR scheduler) after construction, for hosts that
        build it only once the stage exists (Lightning's ``configure_optimizers`` runs over
        ``engine.module.parameters()``). Takes what the constructor takes: a factory, an
        optimizer over this stage's trained tensors (the fp32 master copies under low
        precision, :meth:`precision.master <pipekernel.step.precision>`), or ``None``; the
        scheduler is stepped after each step taken. Call it between batches, on every rank.

        :raises ConfigError: as the constructor (tensors that are not this stage's, ...).
        """
        built = make_optimizer(optimizer, self, self.data_group)
        scheduler = make_lr_scheduler(lr_scheduler, built)
        self._assembly = self._assembly.replace(optimizer=built, lr_scheduler=scheduler)
        self.batch_step.optimizer, self.batch_step.lr_scheduler = built, scheduler

    # -- the public loop ------------------------------------------------------------
    def set_micro_batches(self, micro_batches: int) -> None:
        """Run ``micro_batches`` micro-batches per ``train_batch``/``eval_batch`` from now on
        (e.g. a batch-size ramp-up). Every rank must call it with the same value before the
        same batch: the first batch with a new count checks that (one tiny all-reduce) and
        raises ``ConfigError`` on every rank when they differ. Schedules and communication
        plans are built once per count and cached; the loss is averaged over the current count.

        :raises ConfigError: not a positive int, or a count the schedule refuses.
        """
        self._check_micro_batches(micro_batches)
        self.micro_batches = micro_batches

    def _check_micro_batches(self, micro_batches: Any) -> None:
        check_micro_batches(self, micro_batches)

    def _program(self, cls: Any) -> LoadedProgram:
        """The loaded program of ``cls`` for the current count (:mod:`.programs`)."""
        return program_of(self, cls)

    def _load(self, program: Any) -> LoadedProgram:
        return load_program(self, program)

    def _run(self, cls: Any, data_iter: Iterator | None, compute_loss: bool,
             keep_outputs: bool) -> torch.Tensor | None:
        if isinstance(data_iter, Iterable) and not isinstance(data_iter, Iterator):
            data_iter = iter(data_iter)
        batch_fn = getattr(self.pipeline_module, "batch_fn", None)
        if batch_fn is not None and isinstance(data_iter, Iterator):
            data_iter = map(batch_fn, data_iter)  # read lazily, inside LoadMicroBatch
        check = self.state.batches_run < self.check_data_steps and self.num_stages > 1
        self.state.batches_run += 1
        sharded = self.stage_parallel
        try:
            agree_micro_batches(self)
            program = self._program(cls)
            self.batch_step.begin(self.micro_batches, self.global_steps)  # clears the losses
            self.runtime.begin(data_iter, self.micro_batches, program.program.num_buffers, program,
                               compute_loss=compute_loss, keep_outputs=keep_outputs,
                               check_data=check)
            if sharded is not None:
                sharded.begin_batch(cls.trains)
            self.kernel.run(program, **self._when(cls))
            if sharded is not None:
                sharded.end_batch(cls.trains)
            self.runtime.end()
            return self.batch_step.mean_loss(cls.trains) if compute_loss else None
        except BaseException as err:
            cause = root_cause(err, self.transport, self.abort_board, self.rank)
            if isinstance(cause, PipelineError):  # errors from outside the kernel too
                cause.locate(**self._when(cls))
            self.failed = cause
            self.abort_board.publish(cause)  # the others stop waiting for this rank
            self.runtime.abandon()
            if cause is err:
                raise
            raise cause from err

    def _when(self, cls: Any) -> dict[str, int]:
        """Which batch this is, for errors: the schedule step alone does not say."""
        return ({"train_step": self.global_steps + 1} if cls.trains
                else {"eval_after": self.global_steps})

    def _check_loss_fn(self, what: str) -> None:
        if self.pipeline_module.loss_fn is None:
            raise ConfigError(f"{what} needs a loss function on the last stage, and "
                              "PipelineModule has loss_fn=None",
                              hint="pass PipelineModule(..., loss_fn=torch.nn.CrossEntropyLoss())",
                              rank=self.rank, stage=self.stage)

    def train_batch(self, data_iter: Iterator | None = None,
                    micro_batches: int | None = None) -> torch.Tensor:
        """Train on ``micro_batches`` micro-batches from ``data_iter`` and step once.

        :param micro_batches: this batch only, instead of ``engine.micro_batches``
            (same value on every rank; see :meth:`set_micro_batches`).
        :returns: the mean loss over micro-batches and replicas, a 0-dim tensor with
            the same value on every rank.
        """
        self._check_loss_fn("train_batch")
        if not self.schedule_cls.trains:
            raise ConfigError(f"schedule {self.schedule_cls.name!r} does not train",
                              hint="use schedule='1f1b' or 'gpipe'")
        with self._micro_batches_for(micro_batches):
            return self._train_batch(data_iter)

    @contextlib.contextmanager
    def _micro_batches_for(self, micro_batches: int | None) -> Iterator[None]:
        """``engine.micro_batches`` is ``micro_batches`` inside (unless ``None``)."""
        if micro_batches is None:
            yield
            return
        previous = self.micro_batches
        self.set_micro_batches(micro_batches)
        try:
            yield
        finally:
            self.micro_batches = previous

    def _train_batch(self, data_iter: Iterator | None) -> torch.Tensor:
        start, state, step = time.perf_counter(), self.state, self.batch_step
        self.pm.hook.pipekernel_before_train_batch(engine=self)
        self.module.train()
        loss = self._run(self.schedule_cls, data_iter, True, False)
        state.global_steps += 1
        state.trained_micro_batches += self.micro_batches
        state.skipped_steps += not step.last_step_taken
        state.last_loss, state.last_grad_norm = loss, step.last_grad_norm
        metrics = {"step": state.global_steps, "seconds": time.perf_counter() - start,
                   "skipped": not step.last_step_taken, **self.precision.metrics()}
        if self.max_grad_norm is not None:
            metrics["grad_norm"] = state.last_grad_norm
        if step.last_aux_loss is not None:  # part of loss (stage/aux_loss.py)
            metrics["aux_loss"] = step.last_aux_loss
        self.pm.hook.pipekernel_after_train_batch(engine=self, loss=loss, metrics=metrics)
        return loss  # type: ignore[return-value]

    def eval_batch(self, data_iter: Iterator | None = None, compute_loss: bool = True,
                   return_outputs: bool = False, micro_batches: int | None = None) -> Any:
        """Run forward only over ``micro_batches`` micro-batches.

        :param micro_batches: this batch only, instead of ``engine.micro_batches``.
        :returns: the mean loss (same 0-dim tensor on every rank) if
            ``compute_loss``; with ``return_outputs`` a pair ``(loss, outputs)``
            where ``outputs`` is the list of last-stage outputs per micro-batch on
            the last stage and ``None`` elsewhere.
        """
        if compute_loss:
            self._check_loss_fn("eval_batch(compute_loss=True)")
        self.module.eval()
        with torch.no_grad(), self._micro_batches_for(micro_batches):
            loss = self._run(self.eval_schedule_cls, data_iter, compute_loss, return_outputs)
        self.module.train()
        if not return_outputs:
            return loss
        outputs = list(self.runtime.outputs) if self.is_last_stage() else None
        return loss, outputs

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError("PipelineEngine.forward() is not used: the schedule interleaves "
                            "forward and backward passes across stages",
                            hint="call engine.train_batch(data_iter) or "
                                 "engine.eval_batch(data_iter)")

    backward = step = forward

    # -- checkpoints (pipekernel/engine/checkpoint.py; docs/checkpoints.md) -----------------
    def save_checkpoint(self, path: Any, tag: str | None = None,
                        client_state: Any = None) -> str:
        """Save weights, optimizer, precision, LR scheduler, RNG and counters under
        ``path/tag`` atomically, then point ``path/latest`` at it. Every rank calls it.
        See :func:`pipekernel.engine.checkpoint.save`."""
        from pipekernel.engine.checkpoint import save
        return save(self, path, tag, client_state)

    def load_checkpoint(self, path: Any, tag: str | None = None) -> dict[str, Any]:
        """Load ``path/tag`` (default ``path/latest``), saved at any pipeline or
        data-parallel degree. Every rank calls it. See :func:`pipekernel.engine.checkpoint.load`."""
        from pipekernel.engine.checkpoint import load
        return load(self, path, tag)

    def resume(self, path: Any) -> dict[str, Any] | None:
        """Continue from the newest checkpoint under ``path`` if there is one: load the
        checkpoint ``path/latest`` names and return :meth:`load_checkpoint`'s dict, or
        return ``None`` (nothing changed: a fresh start) when there is none. Every rank
        calls it; the ranks agree on the checkpoint first. Train on from
        ``engine.global_steps``; with ``save_checkpoint(path)`` every ``k`` steps, a job
        restarted after a failure (``torchrun --max-restarts``) loses at most ``k``
        steps. See :func:`pipekernel.engine.checkpoint.resume` and docs/faults.md."""
        from pipekernel.engine.checkpoint import resume
        return resume(self, path)

    def close(self) -> None:
        """Wait for in-flight sends, let plugins finish (``pipekernel_unconfigure``,
        collectives still allowed) and release the transport. After a failed batch
        (``self.failed``) nothing waits on a peer: plugins see ``engine.failed`` and
        should not communicate either."""
        if self.failed is None:
            self.runtime.flush()
        if not self.state.unconfigured:
            self.state.unconfigured = True
            self.pm.hook.pipekernel_unconfigure(engine=self)
        self.transport.close()
