"""The engine (layer 3): a short loop over a frozen :class:`~pipekernel.engine.assembly.Assembly`
(built by :func:`~pipekernel.engine.assembly_step.assemble`) and one small
:class:`~pipekernel.engine.state.RunState`; ``train_batch`` / ``eval_batch`` / checkpoints.

The engine implements :class:`pipekernel.plugin.EngineView`, the typed read-only view that
hooks and checkpoints get: hooks receive the engine itself, so a plugin reading
``engine.<attr>`` keeps working, and the view says which attributes are the contract."""
from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pipekernel.comm import teardown  # noqa: F401 - teardown binds at import
from pipekernel.launcher import clusters
from pipekernel.engine.assembly import Assembly, check_options
from pipekernel.engine.assembly_step import assemble, make_lr_scheduler, make_optimizer
from pipekernel.engine.faults import engine_board, root_cause
from pipekernel.engine.fields import EngineFields
from pipekernel.engine.sentinel import DEFAULT_CHECK_EVERY, Sentinel
from pipekernel.engine.programs import (agree_micro_batches, check_micro_batch_count,
                                        check_micro_batches, program_of)
from pipekernel.engine.state import RunState
from pipekernel.errors import ConfigError, PipelineError
from pipekernel.extend.manager import make_plugin_manager, make_transport
from pipekernel.grid.parallel import ParallelConfig
from pipekernel.schedules.program import Program
from pipekernel.model.module import PipelineModule
from pipekernel.stage.sequence import split_sequences

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
        schedule, chunks and partition by simulation for ``micro_batches`` (the batch is
        never changed; the choice in ``engine.plan``, rank 0 prints it; see
        :mod:`pipekernel.engine.planner`).
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
    :param check_every: every this many train steps, after the optimizer step, check the
        invariants that a silently wrong pipeline breaks (:mod:`pipekernel.engine.sentinel`):
        data-parallel replicas (and the replicas of each expert slice) hold bit-identical
        parameters and optimizer state, tied copies are identical over their stages, every
        rank normalised the loss alike, and (during the checked step's batch) every
        activation and gradient arrived as it was sent. One all-reduce per check; a
        violation raises ``ConsistencyError`` on every rank naming the check, stage, rank,
        parameter and step. Default ``100`` (docs/faults.md); ``None`` turns them off.
    :param verify_every: every this many train steps, ``train_batch`` first replays its
        batch (:meth:`verify_batch`: the micro-batches are read once and used twice), then
        trains on it; ``None`` (default): never.
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
        world is ``stages x replicas x T``; ``T > 1`` needs a ``tensor_parallel_plan`` (see
        ``docs/parallelism.md``).
    :param rank_order: which rank is which, innermost axis first (default
        ``"tp-dp-pp"``: tensor-parallel ranks adjacent, pipeline outermost; any
        permutation of ``tp``, ``dp``, ``pp``; see :mod:`pipekernel.grid.topology`).
    :param partition_activations: retired with pipekernel's own tensor-parallel layers;
        anything but ``None`` is a ``ConfigError`` saying what to do instead.
    :param zero_stage: ``1`` shards the optimizer state over the data-parallel replicas
        (ZeRO-1: torch's ``ZeroRedundancyOptimizer``, :mod:`pipekernel.grid.zero`);
        ``0`` (default) replicates it.
    :param data_parallel_shard: ``N > 1`` shards each stage's parameters, gradients and
        optimizer state over ``N`` ranks with FSDP2 (``fully_shard``, the built-in plugin
        :mod:`pipekernel.plugins.fsdp`), timed by the schedule
        (:mod:`pipekernel.grid.stage_parallel`). The world is then ``stages x replicas x N
        x T``: ``data_parallel_size`` still counts the replicas (HSDP when both are > 1),
        while ``engine.data_parallel_rank`` / ``data_parallel_size`` count every
        data-parallel rank (replicas x shards), each reading its own micro-batches.
    :param reshard_after_forward: with ``data_parallel_shard``, free each layer's gathered
        parameters after its forward and gather them again for its backward (less memory,
        two all-gathers per micro-batch, each started ahead: by the previous layer, or
        after the previous compute instruction for the next chunk the program runs);
        default ``False``: gathered once per batch.
    :param tensor_parallel_plan: a ``parallelize_module`` plan (``{module-name pattern:
        ParallelStyle}``, names relative to the stage, whose children are the global layer
        indices: ``{"*.fc1": ColwiseParallel(), "*.fc2": RowwiseParallel()}``) applied to
        each stage over ``mesh["tp"]`` (``tensor_parallel_size`` ranks) by the built-in plugin
        :mod:`pipekernel.plugins.tensor_parallel_dtensor`; what crosses stages stays plain
        tensors.
    :param seq_chunks: ``k > 1`` cuts every training micro-batch along the sequence (dim 1)
        into ``k`` equal chunks run as units of 1F1B (Seq1F1B,
        :mod:`pipekernel.schedules.sequence`; ``schedule="1f1b"`` only), each chunk's
        attention reading the keys and values of the chunks before it
        (:func:`pipekernel.sequence_chunk`): less activation memory and a smaller bubble
        for long sequences. The model's attention must read the prefix
        (``docs/sequences.md``); ``eval_batch`` runs whole sequences. Default 1.
    :param recompute: activation recomputation per stage: an int ``k >= 0`` for every
        stage or one per stage (``0``: keep every activation; ``1``: recompute every layer
        from its input; ``k``: every run of ``k`` layers), or ``"none"`` / ``"all"``. It
        wins over the module's ``activation_checkpoint_interval``, which is the default
        (``None``) on every stage; under ``schedule=pk.auto(memory_budget=...)`` without it,
        the planner chooses per stage (:mod:`pipekernel.engine.recompute_option`,
        ``docs/memory.md``). ``engine.recompute`` holds what each stage runs.
    :param offload: schedule-aware activation offload on CUDA (``True``, or
        :class:`pipekernel.Offload` with ``min_distance`` and ``prefetch``): the saved
        activations of micro-batches whose backward is far away in the program move to
        pinned host memory after their forward and come back ahead of their backward
        (:mod:`pipekernel.stage.offload`, ``docs/memory.md``). ``None`` (default): off. On
        a CPU stage a ``ConfigError``, unless ``Offload(mover=...)`` brings its own mover.

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
                 check_every: int | None = DEFAULT_CHECK_EVERY, verify_every: int | None = None,
                 loss_reduction: str = "mean",
                 tensor_parallel_size: int = 1, rank_order: str | None = None,
                 partition_activations: Any = None, zero_stage: int = 0,
                 data_parallel_shard: int = 1, reshard_after_forward: bool = False,
                 expert_parallel_size: int = 1, tensor_parallel_plan: Any = None,
                 seq_chunks: int = 1, recompute: Any = None, offload: Any = None) -> None:
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
        #: (schedule class, micro-batch count) -> (program, handlers, runtime binding): the
        #: one cache of them (pipekernel.engine.programs)
        self._programs: dict[tuple[Any, int], tuple] = {}
        try:
            options = check_options(
                schedule=schedule, eval_schedule=eval_schedule, chunks=chunks,
                data_parallel_size=data_parallel_size, transport=transport,
                precision=precision, precision_options=dict(precision_options or {}),
                nonfinite=nonfinite, check_data_steps=check_data_steps,
                check_every=check_every, verify_every=verify_every,
                loss_reduction=loss_reduction, grad_bucket_mb=grad_bucket_mb,
                max_grad_norm=max_grad_norm, lr_scheduler=lr_scheduler,
                seq_chunks=seq_chunks, recompute=recompute, offload=offload,
                parallel=ParallelConfig.make(tensor_parallel_size, rank_order,
                                             partition_activations, zero_stage,
                                             data_parallel_shard, reshard_after_forward,
                                             expert_parallel_size, tensor_parallel_plan))
            self._assembly: Assembly = assemble(module, optimizer, micro_batches, options, pm,
                                                made)
            every = self._assembly.options.check_every
            #: the run-time checks (None: off)
            self.sentinel = Sentinel(self, every) if every is not None else None
            self.state.checked_micro_batches = micro_batches
            self.state.skips_proven = {micro_batches}
            pm.hook.pipekernel_configure(engine=self)
        except BaseException as err:
            self.abort_board.publish(err)  # the others stop waiting for this rank
            raise

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

    def _program(self, cls: Any) -> Program:
        """The program of ``cls`` for the current count (:mod:`.programs`)."""
        return program_of(self, cls)[0]

    def _run(self, cls: Any, data_iter: Iterator | None, compute_loss: bool,
             keep_outputs: bool, wrap: Any = None) -> torch.Tensor | None:
        """One batch of schedule ``cls``; ``wrap(program, handlers)`` gives the handlers
        run instead (the replay check's recording: :mod:`pipekernel.engine.replay`)."""
        if isinstance(data_iter, Iterable) and not isinstance(data_iter, Iterator):
            data_iter = iter(data_iter)
        batch_fn = getattr(self.pipeline_module, "batch_fn", None)
        if batch_fn is not None and isinstance(data_iter, Iterator):
            data_iter = map(batch_fn, data_iter)  # read lazily, inside LoadMicroBatch
        seq_chunks = getattr(cls, "seq_chunks", 1)  # Seq1F1B: a unit per sequence chunk
        if seq_chunks > 1 and isinstance(data_iter, Iterator):
            prepare = getattr(self.pipeline_module, "sequence_chunk_fn", None)
            if prepare is not None:
                data_iter = map(prepare, data_iter)
            data_iter = split_sequences(data_iter, seq_chunks,
                                        mean_loss=self.loss_reduction == "mean")
        units = self.micro_batches * seq_chunks
        check = self.state.batches_run < self.check_data_steps and self.num_stages > 1
        self.state.batches_run += 1
        try:
            agree_micro_batches(self)
            program, handlers, bound = program_of(self, cls)
            if wrap is not None:
                handlers = wrap(program, handlers)
            self.batch_step.begin(units, self.global_steps)
            self.runtime.begin(data_iter, program, bound, compute_loss=compute_loss,
                               keep_outputs=keep_outputs, check_data=check,
                               seq_chunks=seq_chunks)
            self.kernel.run(program, handlers, **self._when(cls))
            losses = self.runtime.end()
            return self.batch_step.mean_loss(losses, cls.trains) if compute_loss else None
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
            every = self._assembly.options.verify_every
            if every is not None and (self.global_steps + 1) % every == 0:
                data_iter = self._verified(data_iter)
            return self._train_batch(data_iter)

    def _verified(self, data_iter: Any) -> Any:
        """``verify_every``: the batch's micro-batches read once, replayed
        (:meth:`verify_batch`), then handed to the train step."""
        if data_iter is not None:
            items = list(itertools.islice(iter(data_iter), self.micro_batches))
            self.verify_batch(iter(items))
            return iter(items)
        self.verify_batch(None)
        return None

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
        sentinel = self.sentinel
        if sentinel is not None and sentinel.due(state.global_steps + 1):
            self.runtime.transfer_sums = sentinel.transfer_sums()  # read by its check
        loss = self._run(self.schedule_cls, data_iter, True, False)
        state.global_steps += 1
        state.trained_micro_batches += self.micro_batches
        state.skipped_steps += not step.last_step_taken
        state.last_loss, state.last_grad_norm = loss, step.last_grad_norm
        checked = None
        if sentinel is not None and sentinel.due(state.global_steps):
            checked = self._check_invariants(sentinel)
        metrics = {"step": state.global_steps, "seconds": time.perf_counter() - start,
                   "skipped": not step.last_step_taken, **self.precision.metrics()}
        if self.max_grad_norm is not None:
            metrics["grad_norm"] = state.last_grad_norm
        if step.last_aux_loss is not None:  # part of loss (model/aux_loss.py)
            metrics["aux_loss"] = step.last_aux_loss
        if checked is not None:  # the sentinel ran (and passed) after this step
            metrics["check_seconds"] = checked
        self.pm.hook.pipekernel_after_train_batch(engine=self, loss=loss, metrics=metrics)
        return loss  # type: ignore[return-value]

    def verify_batch(self, data_iter: Iterator | None = None,
                     micro_batches: int | None = None) -> torch.Tensor:
        """Check one batch by replaying it (:mod:`pipekernel.engine.replay`): run it through
        the schedule, recording what each stage's compute saw, then re-run its micro-batches
        on every stage in the plainest order (full backward, no recomputation, no split, no
        pairs, no overlap) and compare the gradients. Nothing is reduced or stepped: the
        weights, optimizer and step counters stay as they were, and the batch's gradients
        are dropped. Every rank calls it, like :meth:`train_batch`; it costs about three
        times a batch.

        :returns: the batch's mean loss, as :meth:`train_batch` would.
        :raises ConsistencyError: on every rank (``check="replay"``) when a stage's
            gradients differ, naming the stage, rank and module.
        :raises ConfigError: when a stage cannot replay (why and what to change).
        """
        from pipekernel.engine.replay import verify

        self._check_loss_fn("verify_batch")
        if not self.schedule_cls.trains:
            raise ConfigError(f"schedule {self.schedule_cls.name!r} does not train",
                              hint="verify_batch checks a training schedule's batch")
        with self._micro_batches_for(micro_batches):
            return verify(self, data_iter)

    def _check_invariants(self, sentinel: Sentinel) -> float:
        """Run the sentinel's checks (every rank together); their seconds. A failure ends
        the run on every rank alike (each read the same reduced vector)."""
        start = time.perf_counter()
        try:
            sentinel.check()
        except BaseException as err:
            self.failed = err
            raise
        return time.perf_counter() - start

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
                        client_state: Any = None, format: str | None = None) -> str:  # noqa: A002
        """Save weights, optimizer, precision, LR scheduler, RNG and counters under
        ``path/tag`` atomically, then point ``path/latest`` at it. Every rank calls it.
        One format for every engine (pipekernel's layer files); ``format`` other than
        ``None`` is a ``ConfigError`` (DCP directories are read, not written). See
        :func:`pipekernel.engine.checkpoint.save`."""
        from pipekernel.engine.checkpoint import save
        return save(self, path, tag, client_state, format)

    def load_checkpoint(self, path: Any, tag: str | None = None, *,
                        trust_checkpoint: bool = False) -> dict[str, Any]:
        """Load ``path/tag`` (default ``path/latest``), saved at any pipeline or
        data-parallel degree. Every rank calls it. The files load as data only; a file
        that would run code when unpickled is refused unless ``trust_checkpoint=True``
        (docs/checkpoints.md). See :func:`pipekernel.engine.checkpoint.load`."""
        from pipekernel.engine.checkpoint import load
        return load(self, path, tag, trust_checkpoint=trust_checkpoint)

    def resume(self, path: Any, *, trust_checkpoint: bool = False) -> dict[str, Any] | None:
        """Continue from the newest checkpoint under ``path`` if there is one: load the
        checkpoint ``path/latest`` names and return :meth:`load_checkpoint`'s dict, or
        return ``None`` (nothing changed: a fresh start) when there is none. Every rank
        calls it; the ranks agree on the checkpoint first. Train on from
        ``engine.global_steps``; with ``save_checkpoint(path)`` every ``k`` steps, a job
        restarted after a failure (``torchrun --max-restarts``) loses at most ``k``
        steps. See :func:`pipekernel.engine.checkpoint.resume` and docs/faults.md."""
        from pipekernel.engine.checkpoint import resume
        return resume(self, path, trust_checkpoint=trust_checkpoint)

    def abort(self, error: BaseException) -> None:
        """Mark this rank failed with ``error`` (raised outside the engine: the caller's
        own code, a framework callback) and tell the other ranks through the abort board,
        so a peer waiting on this rank in a pipelined step stops within a second instead
        of at the transport's timeout. After it, :meth:`close` waits on no peer. A rank
        that already failed keeps its first error (the call does nothing)."""
        if self.failed is None:
            self.failed = error
            self.abort_board.publish(error)

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
        self._release_mesh()
        self.transport.close()

    def _release_mesh(self) -> None:
        """Destroy the mesh's process groups (local: no peer waited on) and let go of
        them everywhere the engine holds one, so that gloo joins their threads now even
        if this engine object lives on (:func:`pipekernel.grid.mesh.release_mesh`)."""
        if self.grid.mesh is None:
            return
        from pipekernel.grid.mesh import drop_destroyed, is_registered

        self.grid.close()
        if self.stage_parallel is not None:
            self.stage_parallel.close()
        drop_destroyed(self.grad_reducer, self.optimizer,
                       *self._tied_reducers.values())
        if self.data_group is not None and not is_registered(self.data_group):
            self._assembly = self._assembly.replace(data_group=None)
