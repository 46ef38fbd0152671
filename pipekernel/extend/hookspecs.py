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

    from pipekernel.schedules.instructions import Instruction
    from pipekernel.comm.transport import Transport
    from pipekernel.extend.views import EngineView, RuntimeView, StageView

hookspec = pluggy.HookspecMarker("pipekernel")
hookimpl = pluggy.HookimplMarker("pipekernel")

# ---------------------------------------------------------------------------
# Providers: "who makes X" (firstresult)
# ---------------------------------------------------------------------------


@hookspec(firstresult=True)
def pipekernel_make_transport(name: str, options: Mapping[str, Any]) -> Transport | None:
    """Create the transport called ``name``.

    Called once per engine, before any communication (``transport="auto"`` is
    resolved to ``"nccl"`` or ``"gloo"`` before the call).

    :param name: the transport the user selected, e.g. ``"gloo"``.
    :param options: keyword options for the transport: ``timeout`` always,
        plus the engine's ``transport_options`` (e.g. ``group``).
    :returns: an object satisfying :class:`pipekernel.comm.transport.Transport`, or
        ``None`` if this plugin does not provide ``name``.

    Stops at the first non-``None`` result (firstresult).

    Use in plugins
    ==============
    The built-in implementation (``trylast``) loads the entry point ``name`` of
    the ``pipekernel.transports`` group and calls it with ``**options``, so a
    transport package normally only publishes that entry point. Implement this
    hook only to build transports some other way (e.g. wrap another transport).
    """


@hookspec(firstresult=True)
def pipekernel_make_precision(name: str, options: Mapping[str, Any]) -> Any | None:
    """Create the precision policy called ``name`` (``"fp32"``, ...).

    Called once per engine.

    :param name: the precision the user selected.
    :param options: keyword options for the policy.
    :returns: a precision policy (see :class:`pipekernel.step.precision.Precision`)
        or ``None`` if this plugin does not provide ``name``. The engine checks
        that it has every method of the protocol.

    Stops at the first non-``None`` result (firstresult).

    Use in plugins
    ==============
    Subclass :class:`pipekernel.step.precision.Precision` (or a built-in policy from
    ``pipekernel.plugins.precision``) and return an instance only for the names
    you own, ``None`` otherwise. The built-in implementation (``trylast``)
    provides ``fp32``, ``bf16``, ``fp16`` and ``amp-bf16``, so a plugin may also
    override one of those names. Also implement :func:`pipekernel_list_names`
    for ``kind == "precision"`` so that ``pipekernel plugins`` and error
    messages list your names.
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
    :param context: a :class:`pipekernel.model.partitioning.PartitionContext`: the
        module, transport (``None`` outside an engine), device, rank, micro-batches,
        micro-batches in flight per stage and optimizer factory.
    :returns: ``num_stages + 1`` increasing boundaries from ``0`` to
        ``len(layers)`` (stage ``s`` holds ``layers[b[s]:b[s+1]]``), or ``None``
        if this plugin does not handle ``method``.

    Stops at the first non-``None`` result (firstresult).

    Use in plugins
    ==============
    Return ``None`` for methods you do not understand so the built-in methods
    still work; list your method names through :func:`pipekernel_list_names`
    with ``kind == "partition"``. A method that measures (time, memory) should
    measure once and agree: compute on global rank 0 and
    ``context.transport.broadcast`` the result, since every rank calls this hook
    at the same point. Set ``context.layer_costs`` / ``cost_unit`` /
    ``layer_static_bytes`` / ``layer_activation_bytes`` to what was balanced:
    the engine's ``partition_report`` shows them.
    """


# ---------------------------------------------------------------------------
# Registries: contribute named things (every implementation is called)
# ---------------------------------------------------------------------------


@hookspec
def pipekernel_register_schedules() -> Mapping[str, Callable[..., Any]]:
    """Contribute named schedules.

    Called whenever a schedule is looked up by name: twice per engine (its
    ``schedule`` and its ``eval_schedule``), and by ``pipekernel plugins`` and
    ``pipekernel schedule``; every implementation is called each time, so
    return the same table every time.

    :returns: ``{name: schedule class}``; a class takes ``(num_stages, stage,
        micro_batches, chunks)`` and has ``steps()`` (see
        :class:`pipekernel.schedules.Schedule`). A later-registered plugin
        overrides an earlier one's schedule of the same name.

    Use in plugins
    ==============
    Subclass :class:`pipekernel.schedules.Schedule` and check it with
    :func:`pipekernel.schedules.simulate` in your tests. A schedule may emit
    instruction types of your own if a plugin also handles them through
    :func:`pipekernel_register_instructions`.
    """


@hookspec
def pipekernel_register_instructions(runtime: RuntimeView
                                    ) -> Mapping[type, Callable[[Instruction], Any]]:
    """Contribute instruction types and their handlers.

    Called once per engine, when the kernel's dispatch table is filled; every
    implementation is called. A plugin's handler replaces the core's for the same
    class (so a plugin may override a core handler); two plugins returning a handler
    for the same class is a :class:`pipekernel.ConfigError` naming both.

    :param runtime: the :class:`pipekernel.stage.runtime.StageRuntime` of this rank:
        buffers, module, transport, topology. Handlers usually close over it. Its
        contract is :class:`pipekernel.plugin.RuntimeView`; the rest is internal.
    :returns: ``{instruction class: handler(instruction)}``; the handler's
        return value is ignored.

    Use in plugins
    ==============
    Define the instruction as a frozen dataclass subclassing
    :class:`pipekernel.schedules.instructions.Instruction` (or ``MicroBatchInstruction``
    to carry a micro-batch and buffer), set ``short`` for ``str()``, and emit it
    from a schedule registered with :func:`pipekernel_register_schedules`.
    """


@hookspec
def pipekernel_list_names(kind: str) -> Sequence[str]:
    """List the names this plugin provides for ``kind``.

    Called by ``pipekernel plugins`` and when an unknown name needs an error
    message that lists the available ones; every implementation is called.

    :param kind: what is asked for: ``"precision"`` or ``"partition"`` (for
        methods given by name); other kinds may be asked for later.
    :returns: the names (e.g. ``["fp32"]``), or an empty sequence or ``None`` for
        kinds this plugin does not provide.

    Use in plugins
    ==============
    Implement it next to the firstresult hook that builds the thing by name
    (:func:`pipekernel_make_precision`, :func:`pipekernel_partition`) and return
    exactly the names that hook accepts. Transports need not implement it: they
    are listed from the ``pipekernel.transports`` entry points.
    """


@hookspec
def pipekernel_parallelize_stage(module: Any, mesh: Any, engine: StageView) -> None:
    """Apply torch's own parallelism to this rank's stage, in place.

    Called once per engine, on every rank, after the stage's layers are built and
    made equal across ranks (the seeding rule, or a broadcast from the first
    replica) and *before* the precision policy prepares them and the optimizer is
    built over ``module.parameters()``; every implementation is called, in pluggy's
    order (``tryfirst`` ones first: the built-in DTensor tensor parallelism is
    ``tryfirst``, the built-in FSDP2 ``trylast``, as torchtitan applies TP before
    FSDP).

    :param module: the stage's :class:`~pipekernel.model.module.StageModule`: its
        layers are children named by global layer index (``module.get_submodule("3")``),
        its tied layers are in ``module.tied_modules``. Change it in place (e.g.
        ``fully_shard``, ``parallelize_module``); do not replace the object.
    :param mesh: the engine's :class:`~torch.distributed.device_mesh.DeviceMesh` with the
        dims ``("pp", "dp_replicate", "dp_shard", "tp")`` (size-1 dims kept; see
        :mod:`pipekernel.grid.mesh`), or ``None`` when the transport cannot carry one. It is
        built when the engine is asked for torch parallelism (``data_parallel_shard``,
        ``tensor_parallel_plan``) or when a plugin outside ``pipekernel.plugins``
        implements this hook; otherwise ``None``.
    :param engine: the engine being built, as a :class:`pipekernel.plugin.StageView`
        (place, layout, ``parallel`` options, precision, transport, grid and mesh, this
        stage's module; no optimizer, runtime or counters yet).
    :returns: ignored.

    Use in plugins
    ==============
    Float8 training, a wrapping policy of your own, activation checkpointing per
    layer. What crosses stages stays plain tensors: a layer that receives a stage's
    input must accept a plain tensor (DTensor plans: ``input_layouts`` do it).
    ``fully_shard`` on any module of the stage is driven by the engine's schedule
    whoever applied it (:mod:`pipekernel.grid.stage_parallel`: gradients
    reduce-scattered once per batch after the stage's last backward, not per
    micro-batch); apply it to the stage ``module`` last, so that it is the root. A
    parameter FSDP2 does not manage keeps the engine's own data-parallel mean.
    Raise :class:`~pipekernel.errors.ConfigError` for what you cannot do.
    """


# ---------------------------------------------------------------------------
# Observers (every implementation is called)
# ---------------------------------------------------------------------------


@hookspec
def pipekernel_before_instruction(instruction: Instruction, stage: int) -> None:
    """Called right before an instruction's handler runs.

    Called once per instruction of every step, on every rank; every
    implementation is called. Only called when at least one plugin implements
    it: the kernel skips the call entirely otherwise.

    :param instruction: the instruction about to run.
    :param stage: this rank's pipeline stage.
    :returns: ignored.

    With :func:`pipekernel_after_instruction` this is two hook calls per
    instruction, so the kernel resolves the implementations
    once per ``run`` and calls plain ones directly (pluggy's order and argument
    subsets; ``wrapper=True`` implementations still go through pluggy). A plugin
    registered during a batch is seen from the next batch on.

    Use in plugins
    ==============
    Tracing and monitoring. Keep it cheap: it runs dozens of times per batch
    (the monitor's pair of hooks costs about 1.4 us per instruction).
    An exception raised here stops the batch with an error naming the
    instruction.
    """


@hookspec
def pipekernel_after_instruction(instruction: Instruction, stage: int, seconds: float) -> None:
    """Called right after an instruction's handler returned.

    Called once per instruction whose handler returned without an error;
    every implementation is called, and only when one exists.

    :param instruction: the instruction that ran.
    :param stage: this rank's pipeline stage.
    :param seconds: wall time of the handler, not counting the hooks (for
        communication: the time to post it, or to wait for it for a receive).
    :returns: ignored.

    Use in plugins
    ==============
    Timers and per-instruction metrics; pair it with
    :func:`pipekernel_before_instruction`.
    """


@hookspec
def pipekernel_after_train_batch(engine: EngineView, loss: Any,
                                 metrics: Mapping[str, Any]) -> None:
    """Called on every rank after ``train_batch`` finished.

    Called once per ``train_batch``, after the optimizer step; every
    implementation is called.

    :param engine: this rank's engine, read through :class:`pipekernel.plugin.EngineView`.
    :param loss: the 0-dim loss tensor (same value on every rank).
    :param metrics: ``{"step": int, "seconds": float, "skipped": bool, ...}``;
        plugins may read it, other plugins may have added keys.

    Use in plugins
    ==============
    Logging sinks (TensorBoard, files, stdout). Write from one rank (e.g.
    ``engine.rank == 0``) to avoid duplicate lines.
    """


# ---------------------------------------------------------------------------
# Life cycle and diagnostics (every implementation is called)
# ---------------------------------------------------------------------------


@hookspec
def pipekernel_configure(engine: EngineView) -> None:
    """The engine is built: everything a plugin may want to look at exists.

    Called once per engine, on every rank, at the end of
    ``PipelineEngine.__init__`` (module, transport, topology, optimizer,
    runtime and kernel are all set; no batch has run yet).

    :param engine: this rank's engine, read through :class:`pipekernel.plugin.EngineView`
        (the object is the :class:`pipekernel.PipelineEngine`; what the view lists is the
        contract).

    Use in plugins
    ==============
    Keep a reference to the engine (rank, stage, transport, topology), open
    files, start threads. A collective over ``engine.transport`` is allowed
    only if the plugin is registered on every rank, which is how engines are
    built (same arguments everywhere).
    """


@hookspec
def pipekernel_unconfigure(engine: EngineView) -> None:
    """The engine is closing.

    Called once, on every rank, from ``PipelineEngine.close()`` after in-flight
    sends finished and *before* the transport is released, so collectives over
    ``engine.transport`` still work.

    :param engine: this rank's engine, read through :class:`pipekernel.plugin.EngineView`
        (the object is the :class:`pipekernel.PipelineEngine`; what the view lists is the
        contract).

    Use in plugins
    ==============
    Flush and close files, stop threads, merge per-rank results.
    """


@hookspec
def pipekernel_before_train_batch(engine: EngineView) -> None:
    """Called on every rank when ``train_batch`` starts, before any instruction runs.

    Instructions seen between this hook and :func:`pipekernel_after_train_batch`
    belong to one training step; ``eval_batch`` does not call it.

    :param engine: this rank's engine, read through :class:`pipekernel.plugin.EngineView`.
    :returns: ignored.

    Use in plugins
    ==============
    Reset per-step counters and start step timers (the monitor also resets the
    CUDA peak-memory statistics here).
    """


@hookspec
def pipekernel_instruction_error(instruction: Instruction, stage: int, error: Any) -> None:
    """An instruction failed; ``error`` is about to propagate.

    Called on the failing rank only, once per failure, by the kernel after it
    filled in the error's location (rank, stage, step, micro-batch,
    instruction) and right before it raises. Not called on success, so it costs
    nothing on the hot path.

    :param instruction: the instruction whose handler failed.
    :param stage: this rank's pipeline stage.
    :param error: the :class:`~pipekernel.errors.PipelineError` that will be
        raised (a :class:`~pipekernel.errors.TransportTimeout` for a receive
        that timed out).

    Use in plugins
    ==============
    Add diagnostics with ``error.add_detail(text)`` (printed under the
    message), e.g. where every other rank is in its schedule. Must not raise and
    must not block for long: the rank is already failing.
    """
