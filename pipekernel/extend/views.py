"""What plugins and checkpoints may read of an engine: typed, read-only views.

These are :class:`typing.Protocol` classes, exported by :mod:`pipekernel.plugin` as the
contract of the ``engine`` and ``runtime`` arguments hooks receive. The objects passed are
the engine itself (:class:`~pipekernel.PipelineEngine` implements :class:`EngineView`), a
:class:`~pipekernel.engine.assembly_step.StageBuild` while the stage is being parallelized
(:class:`StageView`), and the stage runtime (:class:`RuntimeView`): an attribute outside
these views is internal and may change between versions.

Why the engine itself and not a copy: plugins written before these views read
``engine.<attr>`` (``engine.transport``, ``engine.grid``, ...); the engine implementing the
Protocol keeps them working, costs nothing per hook call, and a type checker holds
plugins that annotate ``engine: EngineView`` to the contract.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # the types the views name; at run time nothing is imported
    import pluggy
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from pipekernel.comm.transport import Transport
    from pipekernel.grid.expert_parallel import ExpertParallelGroup
    from pipekernel.grid.mesh import Grid
    from pipekernel.grid.parallel import ParallelConfig
    from pipekernel.grid.topology import Topology
    from pipekernel.schedules.base import Schedule
    from pipekernel.schedules.instructions import Instruction
    from pipekernel.step.precision import Precision

__all__ = ["Placed", "StageView", "EngineView", "RuntimeView"]


class Placed:
    """Where a process sits, read from ``self.topology``
    (a :class:`~pipekernel.grid.topology.Topology`)."""

    topology: Topology

    @property
    def rank(self) -> int:
        """This process's rank in the engine's world."""
        return self.topology.rank

    @property
    def stage(self) -> int:
        """This rank's pipeline stage, ``0 .. num_stages - 1``."""
        return self.topology.stage

    @property
    def num_stages(self) -> int:
        return self.topology.pipe_size

    @property
    def data_parallel_rank(self) -> int:
        """This rank's data-parallel rank (replicas x shards): which micro-batches it reads."""
        return self.topology.data_rank

    @property
    def data_parallel_size(self) -> int:
        return self.topology.data_size

    def is_first_stage(self) -> bool:
        return self.topology.is_first_stage

    def is_last_stage(self) -> bool:
        return self.topology.is_last_stage


@runtime_checkable
class StageView(Protocol):
    """The engine as its stage is built (the hook ``pipekernel_parallelize_stage``).

    * place: ``rank``, ``stage``, ``num_stages``, ``data_parallel_rank``,
      ``data_parallel_size``, ``is_first_stage()``, ``is_last_stage()``, ``topology``;
    * layout: ``schedule`` (the training schedule's name), ``schedule_cls``,
      ``eval_schedule_cls``, ``chunks``, ``placement``, ``micro_batches`` (the count at
      construction), ``bounds`` (the partition), ``part_stages`` (the stage of each part);
    * parts: ``pipeline_module`` (the user's :class:`~pipekernel.PipelineModule`),
      ``module`` (this stage's layers), ``precision`` (the policy), ``transport``,
      ``mesh`` (the :class:`~torch.distributed.device_mesh.DeviceMesh` or ``None``),
      ``grid`` (its groups: ``grid.require_mesh(what)``), ``parallel`` (the
      :class:`~pipekernel.grid.parallel.ParallelConfig` of the tensor-parallel, sharding and
      expert options), ``ep_group`` (this rank's expert-parallel group; the
      tensor-parallel group is ``mesh["tp"]``), ``pm`` (the engine's plugin manager).

    Read only: the engine does not expect a plugin to assign any of these.
    """

    @property
    def rank(self) -> int: ...
    @property
    def stage(self) -> int: ...
    @property
    def num_stages(self) -> int: ...
    @property
    def data_parallel_rank(self) -> int: ...
    @property
    def data_parallel_size(self) -> int: ...
    @property
    def topology(self) -> Topology: ...
    @property
    def schedule(self) -> str: ...
    @property
    def schedule_cls(self) -> type[Schedule]: ...
    @property
    def eval_schedule_cls(self) -> type[Schedule]: ...
    @property
    def chunks(self) -> int: ...
    @property
    def placement(self) -> str: ...
    @property
    def micro_batches(self) -> int: ...
    @property
    def bounds(self) -> Sequence[int]: ...
    @property
    def part_stages(self) -> Sequence[int]: ...
    @property
    def pipeline_module(self) -> Any: ...  # a pipekernel.PipelineModule (a layer above)
    @property
    def module(self) -> nn.Module: ...
    @property
    def precision(self) -> Precision: ...
    @property
    def transport(self) -> Transport: ...
    @property
    def mesh(self) -> DeviceMesh | None: ...
    @property
    def grid(self) -> Grid: ...
    @property
    def parallel(self) -> ParallelConfig: ...
    @property
    def ep_group(self) -> ExpertParallelGroup | None: ...
    @property
    def pm(self) -> pluggy.PluginManager: ...

    def is_first_stage(self) -> bool: ...

    def is_last_stage(self) -> bool: ...


@runtime_checkable
class EngineView(StageView, Protocol):
    """The engine a hook receives once built (``pipekernel_configure``, the batch hooks,
    ``pipekernel_unconfigure``) and what checkpoints read: everything of
    :class:`StageView`, and

    * ``micro_batches``: the count the next batch runs;
    * ``optimizer``, ``lr_scheduler`` (``None`` when absent);
    * counters: ``global_steps`` (optimizer steps run), ``skipped_steps`` (of which
      skipped), ``trained_micro_batches`` (per replica, so far), ``last_grad_norm`` (when
      clipping), ``last_loss`` (the last ``train_batch``'s 0-dim loss, or ``None``);
    * ``partition_report``, ``plan`` (``schedule="auto"``'s choice, or ``None``),
      ``loss_reduction``, ``failed`` (the error that ended the last batch, else ``None``:
      then a plugin must not communicate), ``runtime`` (a :class:`RuntimeView`);
    * the kernel: ``instruction_types`` (every instruction class it dispatches) and
      ``position`` (``(schedule step, instruction)`` running now, or ``None``).

    Read only, but for one call: ``restore_counters(global_steps, skipped_steps,
    trained_micro_batches)``, which a checkpoint loader makes after loading the state.

    The hook argument is the :class:`~pipekernel.PipelineEngine` itself (so a plugin that
    reads another attribute still works), but only what is listed here is a contract.
    """

    @property
    def optimizer(self) -> torch.optim.Optimizer | None: ...
    @property
    def lr_scheduler(self) -> Any: ...
    @property
    def global_steps(self) -> int: ...
    @property
    def skipped_steps(self) -> int: ...
    @property
    def trained_micro_batches(self) -> int: ...
    @property
    def last_grad_norm(self) -> float | None: ...
    @property
    def last_loss(self) -> torch.Tensor | None: ...
    @property
    def partition_report(self) -> Any: ...
    @property
    def plan(self) -> Any: ...
    @property
    def loss_reduction(self) -> str: ...
    @property
    def failed(self) -> BaseException | None: ...
    @property
    def runtime(self) -> RuntimeView: ...
    @property
    def instruction_types(self) -> tuple[type[Instruction], ...]: ...
    @property
    def position(self) -> tuple[int, Instruction] | None: ...

    def restore_counters(self, global_steps: int, skipped_steps: int,
                         trained_micro_batches: int) -> None: ...


@runtime_checkable
class RuntimeView(Protocol):
    """The stage runtime as observers see it (``pipekernel_register_instructions``'
    ``runtime``, ``engine.runtime``).

    * ``handlers()``: ``{instruction class: handler}`` of the runtime's part of the
      dispatch table (the kernel also holds the step's and plugins' handlers:
      ``engine.instruction_types`` lists every class it dispatches);
    * ``inputs_of(instruction)``: the inputs the buffer of ``instruction``'s micro-batch
      holds now (``None``: none yet), e.g. to count the samples a stage reads;
    * ``outputs``: the last-stage outputs of the last ``eval_batch(return_outputs=True)``;
    * ``flush()``: wait for the sends still in flight (before a checkpoint or a collective
      outside a batch);
    * ``held_tensors()``: what the runtime holds now (buffers, posted receives, sends in
      flight), for memory accounting (``pipekernel.stage.memory``);
    * ``stage``, ``chunks``, ``micro_batches`` (of the running batch), ``transport``.
    """

    @property
    def stage(self) -> int: ...
    @property
    def chunks(self) -> int: ...
    @property
    def micro_batches(self) -> int: ...
    @property
    def transport(self) -> Transport: ...
    @property
    def outputs(self) -> list[Any]: ...

    def handlers(self) -> Mapping[type[Instruction], Callable[[Instruction], Any]]: ...

    def inputs_of(self, instruction: Instruction) -> Any: ...

    def flush(self) -> None: ...

    def held_tensors(self) -> list[torch.Tensor]: ...
