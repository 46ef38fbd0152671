"""``PipelineStrategy``: pipekernel's pipeline (x data) parallelism behind
``lightning.pytorch.Trainer``.

Lightning's DDP strategy already starts the processes (its subprocess or
multiprocessing launcher, or none under torchrun / SLURM / processes started by the
caller, through its cluster environments) and opens the process group; this strategy
keeps all of that (it subclasses :class:`~lightning.pytorch.strategies.DDPStrategy`)
and replaces what DDP does with the model:

* ``setup``: takes the :class:`pipekernel.PipelineModule` that
  ``LightningModule.configure_model()`` returned, builds a
  :class:`pipekernel.PipelineEngine` over the job's process group (each rank builds only
  its stage) and registers the stage under the LightningModule (attribute
  :attr:`PipelineStrategy.stage_attribute`), so ``self.parameters()`` are the stage's when
  Lightning calls ``configure_optimizers()``. The one optimizer it returns becomes the
  engine's; its LR schedulers stay Lightning's (stepped by Lightning's automatic loop, or
  here for a manual optimization). Layers the module built in ``__init__`` are taken out
  of it (:mod:`pipekernel.lightning.modules`); the Trainer's precision, clipping and
  accumulation become engine options (:mod:`pipekernel.lightning.options`).
* ``train_batch(batch)`` / ``eval_batch(batch)`` / ``predict_batch(batch)``, called from
  ``training_step`` / ``validation_step`` / ``predict_step`` (the last also by default):
  cut the batch into micro-batches and run a whole pipelined step. Under automatic
  optimization Lightning's closure runs ``training_step`` and nothing else
  (:mod:`pipekernel.lightning.stepping` does accumulation and the step's hooks).
* samplers: ``DistributedSampler`` over the data-parallel replicas, not over every rank.
* checkpoints (:mod:`pipekernel.lightning.checkpoints`): a Lightning file with the whole
  model, and pipekernel's directory beside it for resuming.
"""
from __future__ import annotations

import os
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer import call
from lightning.pytorch.trainer.states import TrainerFn

from pipekernel.engine.engine import PipelineEngine
from pipekernel.errors import ConfigError
from pipekernel.lightning.batches import split_batch
from pipekernel.lightning.checkpoints import CheckpointMixin
from pipekernel.lightning.modules import detach_pipeline_layers, restore_layers
from pipekernel.lightning.options import engine_precision, trainer_step_options
from pipekernel.lightning.predict import OutputBroadcast, PredictMixin
from pipekernel.lightning.stepping import StepControl
from pipekernel.model.module import PipelineModule, StageModule

__all__ = ["PipelineStrategy"]

#: Engine options the strategy decides itself (with what to do instead).
_RESERVED = {
    "optimizer": "return the optimizer from LightningModule.configure_optimizers()",
    "lr_scheduler": "return the scheduler from LightningModule.configure_optimizers()",
    "data_parallel_size": "it is Trainer(devices x num_nodes) / num_stages",
    "zero_stage": "ZeRO-1 is not available through Lightning yet; drop zero_stage",
}
class PipelineStrategy(CheckpointMixin, PredictMixin, DDPStrategy):
    """Train a ``LightningModule`` whose ``configure_model()`` returns a
    :class:`pipekernel.PipelineModule`, with pipeline x data parallelism.

    The contract the LightningModule is written against (see ``docs/lightning.md``):

    * ``configure_model()`` returns the ``pk.PipelineModule`` (of ``LayerSpec`` objects, or of
      layers the module built in ``__init__``: ``pk.PipelineModule(list(self.net),
      loss_fn=...)``); this rank's stage is registered as ``self.pipeline``
      (:attr:`stage_attribute`), so ``self.parameters()`` are the stage's;
    * ``configure_optimizers()`` as usual: one optimizer over ``self.parameters()`` and its
      LR schedulers (under manual optimization a ``ReduceLROnPlateau`` is the module's to
      step, as Lightning's manual optimization requires);
    * automatic or manual optimization; ``training_step`` calls
      ``loss = self.trainer.strategy.train_batch(batch)`` and ``validation_step``
      ``loss = self.trainer.strategy.eval_batch(batch)``: the loss of the whole batch, the
      same 0-dim tensor on every rank (log it with ``self.log`` on every rank);
      ``trainer.predict`` returns the model's outputs on every rank.

    :param num_stages: pipeline stages; ``None``: the PipelineModule's ``num_stages`` or,
        if that is ``None`` too, one stage per process. The processes
        (``devices x num_nodes``) must be a multiple; the quotient is the number of
        data-parallel replicas.
    :param micro_batches: micro-batches each batch is cut into (the batch size must be a
        multiple).
    :param schedule: the engine's schedule (``"1f1b"``, ``"gpipe"``, ``"interleaved"``, ...).
    :param transport: pipekernel transport; ``None``: ``"nccl"`` on GPUs, else ``"gloo"``.
    :param start_method: how the Trainer starts its processes, as for ``DDPStrategy``:
        ``"popen"`` (runs the script again per rank), ``"spawn"``, ``"fork"``.
    :param whole_model_file: the Lightning checkpoint file holds the whole model (rank 0
        reads every stage's layers back after saving), for ``load_from_checkpoint``;
        ``False``: the Trainer's state only (models one process cannot hold).
    :param log_grad_norm: a metric name: ``self.log`` the whole model's gradient norm
        (:attr:`grad_norm`) under it at every step (``trainer.callback_metrics``, loggers).
    :param engine_options: any other :class:`pipekernel.PipelineEngine` option
        (``precision``, ``max_grad_norm``, ``chunks``, ``timeout``, ``plugins``, ...).
    """

    strategy_name = "pipekernel"
    #: The LightningModule attribute that holds this rank's stage (an ``nn.Module``).
    stage_attribute = "pipeline"

    def __init__(self, num_stages: int | None = None, micro_batches: int = 1,
                 schedule: Any = "1f1b", *, transport: str | None = None,
                 accelerator: Any = None, parallel_devices: list[torch.device] | None = None,
                 cluster_environment: Any = None, checkpoint_io: Any = None,
                 precision_plugin: Any = None, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout, start_method: str = "popen",
                 whole_model_file: bool = True, log_grad_norm: str | None = None,
                 **engine_options: Any) -> None:
        if num_stages is not None and (not isinstance(num_stages, int)
                                       or isinstance(num_stages, bool) or num_stages < 1):
            raise ConfigError(f"PipelineStrategy(num_stages={num_stages!r}): a positive int "
                              "or None", hint="e.g. PipelineStrategy(num_stages=2)")
        if not isinstance(micro_batches, int) or isinstance(micro_batches, bool) \
                or micro_batches < 1:
            raise ConfigError(f"PipelineStrategy(micro_batches={micro_batches!r}): a positive "
                              "int", hint="e.g. PipelineStrategy(micro_batches=4)")
        for name, instead in _RESERVED.items():
            if name in engine_options and not (name == "zero_stage"
                                               and not engine_options[name]):
                raise ConfigError(f"PipelineStrategy({name}=...) is not an option here",
                                  hint=instead)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin,
                         process_group_backend=process_group_backend, timeout=timeout,
                         start_method=start_method)
        self.num_stages, self.micro_batches, self.schedule = num_stages, micro_batches, schedule
        self.transport = transport
        self.engine_options = engine_options
        #: This rank's :class:`pipekernel.PipelineEngine` (after the Trainer's setup).
        self.engine: PipelineEngine | None = None
        self._pipeline_module: Any = None
        self._configure_model_called = False
        self._engine_open = False
        #: write the whole model into the Lightning checkpoint file (rank 0 reads it back)
        self.whole_model_file = whole_model_file
        #: log the whole model's gradient norm under this name at every step
        self.log_grad_norm = log_grad_norm
        #: the engine plugin behind accumulation, the hooks at the step and the grad norm
        self.step_control = StepControl(self)
        self._precision_options: dict[str, Any] = {}
        self._layer_names: dict[int, str] = {}
        self._broadcast: OutputBroadcast | None = None
        self._train_batch_calls = 0

    # -- processes -------------------------------------------------------------------
    def _tensor_parallel_size(self) -> int:
        return int(self.engine_options.get("tensor_parallel_size", 1))

    def _configure_launcher(self) -> None:
        # Lightning calls this from Trainer(...), before any process starts: a world the
        # pipeline cannot be cut into, or Lightning's own mixed precision (which would wrap
        # the pipeline's forward in autocast behind the engine's back), fails here
        world, model = self.num_nodes * self.num_processes, self._tensor_parallel_size()
        per_replica = (self.num_stages or 1) * model
        if world % per_replica:
            raise ConfigError(
                f"Trainer(devices={self.num_processes}, num_nodes={self.num_nodes}) gives "
                f"{world} processes, not a multiple of num_stages={self.num_stages}"
                + (f" x tensor_parallel_size={model}" if model > 1 else ""),
                hint=f"use devices x num_nodes = a multiple of {per_replica} (e.g. devices="
                     f"{per_replica}), or another PipelineStrategy(num_stages=...)")
        if type(self.precision_plugin) is not Precision:
            # the engine applies the precision (per stage, with its own casts on the
            # wire); Lightning's plugin would autocast behind its back
            self._precision_options = engine_precision(self.precision_plugin,
                                                       self.engine_options)
            self.precision_plugin = Precision()
        super()._configure_launcher()

    def setup_environment(self) -> None:
        # Before the process group exists (see pipekernel.transports.gloo: a module
        # imported after init_process_group would hold the default group for good)
        try:
            import torch.distributed.nn.functional  # noqa: F401
        except ImportError:
            pass
        if self.root_device.type == "cuda":
            # pipekernel's nccl transport finds its GPU as cuda:LOCAL_RANK (torchrun's
            # contract); SLURM and other cluster environments do not always export it
            os.environ.setdefault("LOCAL_RANK", str(self.local_rank))
        super().setup_environment()

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Replicas of one stage read different samples; the stages of one replica the
        same ones (the first stage uses the inputs, the last the labels)."""
        engine = self._need_engine("the distributed sampler")
        return {"num_replicas": engine.data_parallel_size, "rank": engine.data_parallel_rank}

    # -- the model -------------------------------------------------------------------
    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Lightning calls ``configure_model()`` inside this context and drops what it
        returns; the strategy keeps it (the hook's contract here: a PipelineModule)."""
        module = self.lightning_module
        if module is None:
            yield
            return
        original = module.configure_model

        def configure_model(*args: Any, **kwargs: Any) -> Any:
            self._configure_model_called = True
            self._pipeline_module = original(*args, **kwargs)
            return self._pipeline_module

        module.configure_model = configure_model  # an instance attribute, for this call
        try:
            yield
        finally:
            del module.configure_model

    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        pipeline = self._take_pipeline_module()
        self._broadcast = None  # a new engine: a new pipeline group for predictions
        step_options: dict[str, Any] = {}
        if fitting:
            step_options, self.step_control.clip_value = trainer_step_options(
                trainer, self.lightning_module, self.engine_options)
            if self.lightning_module.automatic_optimization:
                # the engine runs backward and zeroes gradients itself (inside
                # train_batch); Lightning's closure must not (as for SWA's updates)
                trainer.fit_loop._skip_backward = True
        self.engine = self._make_engine(pipeline, {**self._precision_options, **step_options})
        self._engine_open = True
        self._attach_stage(pipeline)
        self.model_to_device()
        if fitting:
            self.setup_optimizers(trainer)
            self._attach_optimizer()
        self.setup_precision_plugin()

    def _take_pipeline_module(self) -> PipelineModule:
        module, name = self._pipeline_module, type(self.lightning_module).__name__
        if isinstance(module, PipelineModule):
            restore_layers(module)
            return module
        if not self._configure_model_called:
            what = f"{name} does not override configure_model()"
        else:
            what = f"{name}.configure_model() returned {type(module).__name__}"
        raise ConfigError(f"PipelineStrategy needs the model as a pipekernel.PipelineModule: "
                          f"{what}",
                          hint="define configure_model(self) to build and return "
                               "pk.PipelineModule([pk.LayerSpec(...), ...], loss_fn=...) (keep "
                               "it and return the same object when called again); the "
                               f"strategy registers this rank's stage as self."
                               f"{self.stage_attribute}")

    def _make_engine(self, pipeline: PipelineModule, mapped: dict[str, Any]) -> PipelineEngine:
        model = self._tensor_parallel_size()
        if self.num_stages is not None and pipeline.num_stages not in (None, self.num_stages):
            raise ConfigError(f"PipelineStrategy(num_stages={self.num_stages}) but the "
                              f"PipelineModule says num_stages={pipeline.num_stages}",
                              hint="give the number of stages in one place only")
        stages = self.num_stages or pipeline.num_stages or self.world_size // model
        if self.world_size % (stages * model):
            raise ConfigError(f"{self.world_size} processes are not a multiple of "
                              f"num_stages={stages}" + (f" x {model}" if model > 1 else ""),
                              hint="match Trainer(devices=..., num_nodes=...) to num_stages")
        options = {**self.engine_options, **mapped}
        plugins = [*options.pop("plugins", ()), self.step_control]
        transport = self.transport or ("nccl" if self.root_device.type == "cuda" else "gloo")
        return PipelineEngine(pipeline, None, micro_batches=self.micro_batches,
                              schedule=self.schedule, transport=transport,
                              data_parallel_size=self.world_size // (stages * model),
                              plugins=plugins, **options)

    def _attach_stage(self, pipeline: PipelineModule) -> None:
        """Register the stage under the LightningModule (its parameters become
        ``self.parameters()``); a second ``fit`` of the same module (same Trainer or a new
        one) goes on from the weights its stage holds, as with DDP. Layers the module
        built in ``__init__`` are replaced there by placeholders
        (:mod:`pipekernel.lightning.modules`)."""
        module, engine = self.lightning_module, self.engine
        self._layer_names.update(detach_pipeline_layers(module, pipeline,
                                                        self.stage_attribute))
        held = getattr(module, self.stage_attribute, None)
        if held is not None and not isinstance(held, (StageModule, PipelineModule)):
            raise ConfigError(
                f"{type(module).__name__}.{self.stage_attribute} is a "
                f"{type(held).__name__}; PipelineStrategy puts this rank's stage there",
                hint=f"rename that attribute, or set PipelineStrategy.stage_attribute")
        if isinstance(held, StageModule) and held is not engine.module:
            state, ours = held.state_dict(), engine.module.state_dict()
            if ours.keys() <= state.keys():  # the same layers here (or the whole model)
                engine.module.load_state_dict({k: state[k] for k in ours})
        setattr(module, self.stage_attribute, engine.module)

    def _attach_optimizer(self) -> None:
        engine, name = self.engine, type(self.lightning_module).__name__
        if len(self.optimizers) != 1:
            raise ConfigError(f"{name}.configure_optimizers() gave {len(self.optimizers)} "
                              "optimizers; a pipeline stage steps one",
                              hint="return one optimizer (with parameter groups if needed) "
                                   "built over self.parameters()")
        optimizer = self.optimizers[0]
        ours = {id(p) for p in engine.module.parameters()}
        given = [p for group in optimizer.param_groups for p in group["params"]]
        if not given or not {id(p) for p in given} <= ours:
            raise ConfigError(
                f"the optimizer of {name}.configure_optimizers() holds tensors that are not "
                f"the parameters of stage {engine.stage}",
                hint="build it in configure_optimizers() from self.parameters() (or "
                     f"self.{self.stage_attribute}.parameters()): they are this rank's stage",
                rank=engine.rank, stage=engine.stage)
        if optimizer.state:
            raise ConfigError(f"the optimizer of {name}.configure_optimizers() already has "
                              "state", hint="return a fresh optimizer")
        master = engine.precision.master
        for group in optimizer.param_groups:  # low precision steps fp32 master copies
            group["params"] = [master(p) for p in group["params"]]
        engine.set_optimizer(optimizer)  # the schedulers stay Lightning's (_step_schedulers)

    # -- the step ------------------------------------------------------------------
    def _need_engine(self, what: str) -> PipelineEngine:
        if self.engine is None:
            raise ConfigError(f"{what} needs the pipeline engine, which the Trainer builds "
                              "in its setup", hint="call it from training_step / "
                              "validation_step, inside Trainer.fit/validate")
        return self.engine

    def train_batch(self, batch: Any, micro_batches: int | None = None) -> torch.Tensor:
        """One pipelined training step on ``batch`` ``(inputs, labels)``: cut into
        micro-batches, forward and backward through every stage, gradients reduced,
        the optimizer stepped (with ``Trainer(accumulate_grad_batches=k)``: on the
        ``k``-th batch of a window only), LR schedulers stepped as configured.

        Call it from ``training_step`` on every rank, once per batch, with automatic or
        manual optimization.

        :param micro_batches: this batch only, instead of the strategy's ``micro_batches``.
        :returns: the mean loss over the batch, a 0-dim tensor, the same on every rank.
        """
        engine = self._need_engine("train_batch")
        trainer = self.lightning_module.trainer
        automatic = self.lightning_module.automatic_optimization
        count = micro_batches or engine.micro_batches
        items = split_batch(batch, count, "train_batch")
        control = self.step_control
        k = trainer.accumulate_grad_batches if automatic else 1
        # Lightning's own decision for this batch (the automatic loop asked it too)
        control.accumulating = automatic and trainer.fit_loop._should_accumulate()
        control.grad_scale = 1.0 / k
        self._train_batch_calls += 1
        skipped = engine.skipped_steps
        try:
            loss = engine.train_batch(iter(items), micro_batches=micro_batches)
        finally:
            control.accumulating = False
        if not automatic and engine.skipped_steps == skipped:  # fp16 may skip a step
            self._count_step()
            self._step_schedulers()
        return loss

    def eval_batch(self, batch: Any, micro_batches: int | None = None) -> torch.Tensor:
        """The mean loss of ``batch`` ``(inputs, labels)``, forward only through the
        pipeline; the same 0-dim tensor on every rank. Call it from ``validation_step`` /
        ``test_step`` on every rank."""
        engine = self._need_engine("eval_batch")
        items = split_batch(batch, micro_batches or engine.micro_batches, "eval_batch")
        # Lightning evaluates under inference mode on NCCL; buffers the engine keeps
        # between batches must stay usable by training, so plain no_grad here
        with torch.inference_mode(False):
            return engine.eval_batch(iter(items), micro_batches=micro_batches)

    # -- automatic optimization: the engine's step inside Lightning's ------------------
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._train_batch_calls = 0
        output = super().training_step(*args, **kwargs)
        if self.lightning_module.automatic_optimization:
            self._check_step_output(output)
        return output

    def _check_step_output(self, output: Any) -> None:
        name = type(self.lightning_module).__name__
        loss = output.get("loss") if isinstance(output, Mapping) else output
        if self._train_batch_calls != 1 or (isinstance(loss, torch.Tensor)
                                            and loss.requires_grad):
            raise ConfigError(
                f"{name}.training_step called self.trainer.strategy.train_batch(batch) "
                f"{self._train_batch_calls} time(s)"
                + (" and returned a loss with a graph" if isinstance(loss, torch.Tensor)
                   and loss.requires_grad else "")
                + ": under PipelineStrategy the pipeline computes the loss, "
                "loss_fn(outputs, labels) on the last stage, and runs the backward",
                hint="write training_step as: loss = self.trainer.strategy.train_batch("
                     "batch); self.log('train_loss', loss); return loss (the loss function "
                     "goes to pk.PipelineModule(..., loss_fn=...))")

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any,
                 **kwargs: Any) -> torch.Tensor:
        if self.lightning_module.automatic_optimization:
            return closure_loss  # the engine ran the backward in train_batch
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None,
                       **kwargs: Any) -> Any:
        """Automatic optimization: the closure runs ``training_step``, whose
        ``train_batch`` steps the engine (the optimizer's parameters are its)."""
        if self.lightning_module.automatic_optimization:
            return closure()
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    @property
    def grad_norm(self) -> float | None:
        """The whole model's gradient 2-norm at the last step (every stage, tied weights
        once, before clipping): what ``clip_grad_norm_`` returns in one process. Set right
        before ``on_before_optimizer_step``; the same on every rank."""
        return self.step_control.grad_norm

    def _before_optimizer_step(self) -> None:
        module = self.lightning_module
        trainer, optimizer = module.trainer, self.optimizers[0]
        norm = self.step_control.grad_norm
        if self.log_grad_norm and norm is not None:  # (we are inside training_step)
            module.log(self.log_grad_norm, norm, on_step=True, on_epoch=False)
        call._call_callback_hooks(trainer, "on_before_optimizer_step", optimizer)
        call._call_lightning_module_hook(trainer, "on_before_optimizer_step", optimizer)

    def _count_step(self) -> None:
        """``trainer.global_step`` counts the optimizer steps of a manual optimization:
        the engine stepped the optimizer itself, so tell the Trainer's progress (the
        callbacks the manual loop installs on the LightningOptimizer for each batch)."""
        lightning_optimizer = self._lightning_optimizers[0]
        lightning_optimizer._on_before_step()
        lightning_optimizer._on_after_step()

    def _step_schedulers(self) -> None:
        """Manual optimization only (Lightning's automatic loop steps them itself,
        ``ReduceLROnPlateau`` with its monitored metric included). What Lightning's
        training loop does for an automatic optimization: ``step``
        schedulers after every ``frequency`` batches of the epoch, ``epoch`` ones after
        the epoch's last batch every ``frequency`` epochs."""
        trainer = self.lightning_module.trainer
        loop = trainer.fit_loop.epoch_loop
        for config in self.lr_scheduler_configs:
            if config.reduce_on_plateau or isinstance(
                    config.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                continue  # manual optimization: the module steps it with its metric
            if config.interval == "step":
                index = loop.batch_idx + 1
            elif config.interval == "epoch" and loop._num_ready_batches_reached():
                index = trainer.current_epoch + 1
            else:
                continue
            if index % config.frequency == 0:
                call._call_lightning_module_hook(trainer, "lr_scheduler_step",
                                                 config.scheduler, None)

    def on_exception(self, exception: BaseException) -> None:
        """An error outside the engine (the module's own code, a callback) on one rank:
        tell the others through the engine's abort board, so that a rank waiting in a
        pipelined step for this one stops within a second, not after the timeout."""
        super().on_exception(exception)
        engine = self.engine
        if engine is not None and self._engine_open:
            engine.abort(exception)  # close() then waits on no peer

    def teardown(self) -> None:
        super().teardown()
        if self.engine is not None and self._engine_open:  # the engine stays for inspection
            self._engine_open = False
            self.engine.close()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls,
                                       description="pipekernel pipeline (x data) parallelism")


PipelineStrategy.register_strategies(StrategyRegistry)
