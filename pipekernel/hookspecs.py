"""Hook specifications: the contract between pipekernel and its plugins.

Every hook is named ``pipekernel_*``. Implementations may accept any subset of
a hook's parameters (pluggy passes only the ones they name); omit defaults in
implementations, pluggy does not pass arguments that have them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from pipekernel.instructions import Instruction
    from pipekernel.transport import Transport

hookspec = pluggy.HookspecMarker("pipekernel")
hookimpl = pluggy.HookimplMarker("pipekernel")

# ---------------------------------------------------------------------------
# Providers: "who makes X" (firstresult)
# ---------------------------------------------------------------------------


@hookspec(firstresult=True)
def pipekernel_make_transport(name: str, options: Mapping[str, Any]) -> Transport | None:
    """Create the transport called ``name``.

    Called once per engine, before any communication.

    :param name: the transport the user selected, e.g. ``"gloo"``.
    :param options: keyword options for the transport (``timeout`` at least).
    :returns: an object satisfying :class:`pipekernel.transport.Transport`, or
        ``None`` if this plugin does not provide ``name``.

    Stops at the first non-``None`` result.

    Use in plugins
    ==============
    The built-in implementation (``trylast``) loads the entry point ``name`` of
    the ``pipekernel.transports`` group and calls it with ``**options``;
    implement this hook only to build transports some other way.
    """


@hookspec(firstresult=True)
def pipekernel_make_precision(name: str, options: Mapping[str, Any]) -> Any | None:
    """Create the precision policy called ``name`` (``"fp32"``, ...).

    Called once per engine.

    :param name: the precision the user selected.
    :param options: keyword options for the policy.
    :returns: a precision policy (see :class:`pipekernel.precision.Precision`)
        or ``None`` if this plugin does not provide ``name``.

    Stops at the first non-``None`` result.
    """


@hookspec(firstresult=True)
def pipekernel_partition(method: Any, layers: Sequence[Any], num_stages: int,
                         context: Any) -> list[int] | None:
    """Split ``layers`` into ``num_stages`` contiguous parts.

    Called once per :class:`~pipekernel.PipelineModule` partitioning: by the
    engine on every rank of the world, at the same point of its construction
    (before any group is created), so every rank must return the same answer.

    :param method: the ``partition=`` argument: a name (``"uniform"``,
        ``"parameters"``, ``"type:<regex>"``, ``"memory"``), a list of
        boundaries, a request object (``pk.profile(sample)``, ``pk.memory(sample)``,
        ``pk.balance(costs)``), a cost function, or an object a plugin understands.
    :param layers: the layer list (``LayerSpec``, modules or callables).
    :param num_stages: the number of stages.
    :param context: a :class:`pipekernel.partitioning.PartitionContext`: the
        module, transport (``None`` outside an engine), device, rank, micro-batches,
        micro-batches in flight per stage and optimizer factory.
    :returns: ``num_stages + 1`` increasing boundaries from ``0`` to
        ``len(layers)`` (stage ``s`` holds ``layers[b[s]:b[s+1]]``), or ``None``
        if this plugin does not handle ``method``.

    Stops at the first non-``None`` result.

    Use in plugins
    ==============
    A method that measures (time, memory) should measure once and agree: compute
    on global rank 0 and ``context.transport.broadcast`` the result, since every
    rank calls this hook at the same point. Set ``context.layer_costs`` /
    ``cost_unit`` / ``layer_static_bytes`` / ``layer_activation_bytes`` to what
    was balanced: the engine's ``partition_report`` shows them.
    """


# ---------------------------------------------------------------------------
# Registries: contribute named things (every implementation is called)
# ---------------------------------------------------------------------------


@hookspec
def pipekernel_register_schedules() -> Mapping[str, Callable[..., Any]]:
    """Contribute named schedules.

    Called once per engine (and by ``pipekernel plugins``).

    :returns: ``{name: schedule class}``; a class takes ``(num_stages, stage,
        micro_batches, chunks)`` and has ``steps()`` (see
        :class:`pipekernel.schedules.Schedule`). Later registrations override
        earlier ones of the same name.
    """


@hookspec
def pipekernel_register_instructions(runtime: Any) -> Mapping[type, Callable[[Instruction], Any]]:
    """Contribute instruction types and their handlers.

    Called once per engine, when the kernel's dispatch table is filled.

    :param runtime: the :class:`pipekernel.runtime.StageRuntime` of this rank:
        buffers, module, transport, topology. Handlers usually close over it.
    :returns: ``{instruction class: handler(instruction)}``.
    """


# ---------------------------------------------------------------------------
# Observers (every implementation is called)
# ---------------------------------------------------------------------------


@hookspec
def pipekernel_before_instruction(instruction: Instruction, stage: int) -> None:
    """Called right before an instruction's handler runs.

    Only called when at least one plugin implements it: the kernel skips the
    call entirely otherwise.

    :param instruction: the instruction about to run.
    :param stage: this rank's pipeline stage.
    """


@hookspec
def pipekernel_after_instruction(instruction: Instruction, stage: int, seconds: float) -> None:
    """Called right after an instruction's handler returned.

    :param instruction: the instruction that ran.
    :param stage: this rank's pipeline stage.
    :param seconds: wall time of the handler.
    """


@hookspec
def pipekernel_after_train_batch(engine: Any, loss: Any, metrics: Mapping[str, Any]) -> None:
    """Called on every rank after ``train_batch`` finished.

    :param engine: the :class:`pipekernel.PipelineEngine`.
    :param loss: the 0-dim loss tensor (same value on every rank).
    :param metrics: ``{"step": int, "seconds": float, "skipped": bool, ...}``.
    """
