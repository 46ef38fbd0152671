"""The engine's attributes: read-only properties over its frozen
:class:`~pipekernel.engine.assembly.Assembly` and read-write ones over its
:class:`~pipekernel.engine.state.RunState` (what :class:`pipekernel.plugin.EngineView`
documents, and the internals the engine's own modules read); the stage's part also serves
the :class:`~pipekernel.engine.assembly_step.StageBuild` the stage-parallel hook sees."""
from __future__ import annotations

from operator import attrgetter
from typing import Any

from pipekernel.extend.views import Placed

__all__ = ["StageFields", "EngineFields"]


def _read(path: str, doc: str | None = None) -> property:
    """A read-only attribute of the engine: ``path`` in its assembly."""
    get = attrgetter(path)
    return property(lambda self: get(self._assembly), doc=doc)


def _open_mesh(assembly: Any) -> Any:
    """The stage's mesh, or a ``ConfigError`` once ``close()`` destroyed its groups (the
    DeviceMesh object would still answer, over dead groups)."""
    stage = assembly.stage
    if stage.mesh is not None and stage.grid.mesh is None:
        from pipekernel.errors import ConfigError

        raise ConfigError("engine.mesh was read after engine.close(): its process groups "
                          "are destroyed", hint="read engine.mesh (and build what needs "
                          "it) before close(), or build a new engine")
    return stage.mesh


def _run_state(name: str, doc: str | None = None) -> property:
    """An attribute of the engine's run state (checkpoints restore the counters)."""
    return property(lambda self: getattr(self.state, name),
                    lambda self, value: setattr(self.state, name, value), doc=doc)


class StageFields(Placed):
    """The members of :class:`pipekernel.plugin.StageView`, read from ``self._assembly``
    (an Assembly, or a StageBuild's parts so far); the place from ``topology``."""

    _assembly: Any

    # read-only; the contract is pipekernel.plugin.StageView
    pipeline_module = _read("pipeline_module", "The user's PipelineModule.")
    pm = _read("pm", "The engine's plugin manager (its own plugins).")
    transport = _read("transport")
    precision = _read("precision", "The precision policy.")
    topology = _read("layout.topology", "This rank's Topology.")
    schedule_cls, eval_schedule_cls = _read("layout.schedule_cls"), _read("layout.eval_schedule_cls")
    chunks, placement = _read("layout.chunks"), _read("layout.placement")
    micro_batches = _read("layout.micro_batches", "Micro-batches at construction.")
    part_stages = _read("parts.part_stages", "Which stage holds each part.")
    bounds = _read("parts.bounds")
    grid = _read("stage.grid", "This rank's groups and the mesh (pipekernel.grid.mesh).")
    mesh = property(lambda self: _open_mesh(self._assembly),
                    doc="The DeviceMesh (dims ('pp', 'dp_replicate', 'dp_shard', 'tp')), or "
                        "None (a transport without one, or nothing that needs it); after "
                        "close() a ConfigError (its groups are destroyed).")
    ep_group = _read("stage.ep_group")
    module = _read("stage.module", "This stage's layers (a StageModule).")
    parallel = _read("options.parallel")

    @property
    def schedule(self) -> str:
        """The training schedule's name."""
        return self.schedule_cls.name


class EngineFields(StageFields):
    """What an engine is built of (``self._assembly``) and what changes as it runs
    (``self.state``), as attributes."""

    state: Any

    # -- the rest of what it is built of (read-only; the contract is EngineView) --------
    plan = _read("layout.plan", "The Plan schedule='auto' chose (else None).")
    recompute = _read("layout.recompute", "Per stage, its activation checkpoint interval "
                      "(0: none): the engine's recompute, the plan's or the module's.")
    partition_report = _read("parts.partition_report", "Layers, parameters, cost and memory "
                             "per stage, and the imbalance (same on every rank).")
    skip_router, skip_edges = _read("stage.skip_router"), _read("stage.skip_edges")
    nonfinite, check_data_steps = _read("options.nonfinite"), _read("options.check_data_steps")
    loss_reduction, max_grad_norm = _read("options.loss_reduction"), _read("options.max_grad_norm")
    grad_bucket_mb = _read("options.grad_bucket_mb")
    data_group, data_ranks = _read("data_group"), _read("data_ranks")
    tied_groups, _tied_reducers = _read("tied_groups"), _read("tied_reducers")
    grad_reducer = _read("grad_reducer", "The data-parallel GradReducer (None without data "
                         "parallelism).")
    stage_parallel = _read("stage_parallel", "The StageParallel timing the stage's FSDP2 "
                           "modules by the schedule, or None.")
    optimizer, lr_scheduler = _read("optimizer"), _read("lr_scheduler")
    runtime = _read("runtime", "The stage runtime (a pipekernel.plugin.RuntimeView).")
    batch_step = _read("batch_step", "The BatchStep: reductions, the optimizer step and the "
                       "batch loss (the one owner of its losses and token counts).")
    kernel = _read("kernel")

    # -- what changes as it runs ----------------------------------------------------
    micro_batches = _run_state("micro_batches", "Micro-batches of the next batch.")
    global_steps, skipped_steps = _run_state("global_steps"), _run_state("skipped_steps")
    trained_micro_batches = _run_state("trained_micro_batches", "Micro-batches each replica "
                                       "trained on so far (the counts may change).")
    failed = _run_state("failed", "The error that ended the last batch, else None.")
    last_loss = property(lambda self: self.state.last_loss, doc="The last train_batch's loss.")
    last_grad_norm = property(lambda self: self.state.last_grad_norm,
                              doc="Global gradient norm of the last step (before clipping), "
                                  "when clipping.")

    def restore_counters(self, global_steps: int, skipped_steps: int,
                         trained_micro_batches: int) -> None:
        """Set the step counters (a checkpoint loader, after loading the state)."""
        state = self.state
        state.global_steps, state.skipped_steps = global_steps, skipped_steps
        state.trained_micro_batches = trained_micro_batches

    @property
    def instruction_types(self) -> tuple[type, ...]:
        """Every instruction class the kernel dispatches."""
        return tuple(self.kernel.handlers)

    @property
    def position(self) -> Any:
        """``(schedule step, instruction)`` the kernel runs now, or ``None``."""
        return self.kernel.position
