"""Partitioning vocabulary: requests a user passes as ``partition=``, the context a
partition plugin receives, and the report the engine keeps.

The core only *describes* partitions; the built-in plugin
(``pipekernel.plugins.partition``) serves the requests, and any plugin may serve
them instead (``pipekernel_partition`` is ``firstresult``).

* ``partition=pk.balance(costs)``: balance user costs (a list with one number per
  layer, or ``cost(layer) -> float``). A bare callable works too.
* ``partition=pk.profile(sample)``: measure each layer's forward + backward time on
  ``sample`` (one micro-batch of first-stage inputs) on the device it will run on,
  and balance time. Measured once, on global rank 0, and broadcast, so every rank
  gets the same partition.
* ``partition=pk.memory(sample)``: balance parameter + gradient + optimizer-state
  bytes plus activation bytes times the micro-batches the schedule keeps in flight
  on each stage (1F1B: ``stages - stage``, so early stages get fewer layers).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Balance", "Profile", "Memory", "balance", "profile", "memory",
           "PartitionContext", "PartitionReport", "StageReport"]


@dataclass(frozen=True)
class Balance:
    """Request: balance ``costs`` (one number per layer, or ``cost(layer) -> float``)."""

    costs: Sequence[float] | Callable[[Any], float]
    unit: str = "cost"


@dataclass(frozen=True)
class Profile:
    """Request: balance measured forward + backward seconds per layer.

    :param sample: first-stage inputs of one micro-batch (tensor or tuple).
    :param repeats: timed repetitions per layer; the median is used.
    :param warmup: untimed repetitions before them.
    :param split_backward: also time each layer's backward split into its input and
        weight passes (zero-bubble schedules; for the schedule planner).
    :param clock: seconds now, read after the device is synchronised around each timed
        part of a repetition; ``None`` is :func:`time.perf_counter`. Tests inject a
        fake clock so a partition does not depend on the machine's load.
    """

    sample: Any
    repeats: int = 5
    warmup: int = 1
    split_backward: bool = False
    clock: Callable[[], float] | None = None


@dataclass(frozen=True)
class Memory:
    """Request: balance estimated bytes per stage.

    Stage bytes = Σ (parameters + gradients + optimizer state + buffers)
    + in_flight(stage) × Σ activation bytes saved for backward per micro-batch.

    :param sample: first-stage inputs of one micro-batch; ``None`` leaves
        activations out (parameter state only).
    :param optimizer_states: optimizer-state bytes per parameter byte; ``None``
        measures it with the engine's optimizer factory (one step on a throwaway
        copy of each layer) when ``sample`` is given, and assumes 2 (Adam)
        otherwise.
    """

    sample: Any = None
    optimizer_states: float | None = None


def balance(costs: Sequence[float] | Callable[[Any], float], unit: str = "cost") -> Balance:
    """``partition=pk.balance([...])``: minimise the largest stage sum of ``costs``."""
    return Balance(costs, unit)


def profile(sample: Any, repeats: int = 5, warmup: int = 1,
            clock: Callable[[], float] | None = None) -> Profile:
    """``partition=pk.profile(sample_inputs)``: balance measured time (see :class:`Profile`)."""
    return Profile(sample, repeats, warmup, clock=clock)


def memory(sample: Any = None, optimizer_states: float | None = None) -> Memory:
    """``partition=pk.memory(sample_inputs)``: balance estimated memory (see :class:`Memory`)."""
    return Memory(sample, optimizer_states)


@dataclass
class PartitionContext:
    """What a partition plugin may use, and where it leaves its estimates.

    Inputs (set by the caller; a plugin may rely on every field, ``None`` where said):

    :param module: the :class:`~pipekernel.PipelineModule` being split.
    :param num_stages: the number of stages.
    :param transport: the engine's transport (``None`` outside an engine). Every
        rank of the world calls the partition hook at the same point, so a plugin
        may use world collectives (``broadcast`` from rank 0) to agree.
    :param device: the device this rank runs on (``torch.device``).
    :param rank: this process's global rank (0 outside an engine).
    :param micro_batches: micro-batches per training batch.
    :param in_flight: per part (stage), the most micro-batches whose graph it holds at once
        under the training schedule (:func:`~pipekernel.schedules.sim_memory.live_graphs`:
        from its forward to its backward or deferred weight pass, per chunk, not the
        stage's whole count); outside an engine, 1F1B with at least ``num_stages``
        micro-batches: ``num_stages - stage``.
    :param optimizer: the engine's optimizer factory ``params -> Optimizer``, or ``None``.

    Outputs (optional; a plugin sets them for the partition report, one entry per layer):

    :param layer_costs: the cost the plugin balanced, and ``cost_unit`` its unit.
    :param layer_static_bytes: parameter + gradient + optimizer-state + buffer bytes.
    :param layer_activation_bytes: bytes saved for backward per micro-batch.
    :param layer_forward_seconds: measured forward seconds (``pk.profile``; the rest of
        ``layer_costs`` is the backward), for the schedule planner.
    :param layer_split_backward_seconds: ``(input pass, weight pass)`` seconds of the
        split backward (``Profile(split_backward=True)``).
    :param layer_output_bytes: bytes of the tensors a layer returns for one micro-batch
        (``pk.profile``): what crosses a stage boundary after it, for the planner.
    :param layer_weight_state_bytes: bytes a split backward's input pass keeps per layer
        for its weight pass (``Profile(split_backward=True)``), for the memory model.
    """

    module: Any
    num_stages: int
    transport: Any = None
    device: Any = None
    rank: int = 0
    micro_batches: int = 1
    in_flight: list[int] | None = None
    optimizer: Callable[..., Any] | None = None
    layer_costs: list[float] | None = None
    cost_unit: str = ""
    layer_static_bytes: list[float] | None = None
    layer_activation_bytes: list[float] | None = None
    layer_forward_seconds: list[float] | None = None
    layer_split_backward_seconds: list[tuple[float, float]] | None = None
    layer_output_bytes: list[float] | None = None
    layer_weight_state_bytes: list[float] | None = None
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.in_flight is None:
            self.in_flight = [self.num_stages - s for s in range(self.num_stages)]
        if self.device is None:
            import torch
            self.device = torch.device("cpu")


@dataclass(frozen=True)
class StageReport:
    """One stage of a partition."""

    stage: int
    first_layer: int
    last_layer: int          # inclusive
    parameters: int
    cost: float | None
    memory_bytes: float | None

    @property
    def num_layers(self) -> int:
        return self.last_layer - self.first_layer + 1


@dataclass(frozen=True)
class PartitionReport:
    """What a partition gave: per stage layers, parameters, cost and memory.

    ``engine.partition_report`` on every rank (identical everywhere); rank 0 logs
    ``format()`` on the ``pipekernel.partition`` logger at INFO.
    """

    method: str
    bounds: list[int]
    stages: list[StageReport]
    cost_unit: str
    notes: list[str]
    #: per pipeline stage, the memory model's predicted bytes at the stage's peak by
    #: category (``params``, ``grads``, ``optimizer``, ``saved``, ``buffers``: the
    #: categories the :class:`~pipekernel.plugins.memory.MemoryMeter` measures; see
    #: :mod:`pipekernel.schedules.sim_memory`); ``None`` where the partition measured no
    #: bytes (e.g. ``"uniform"``, explicit bounds)
    stage_memory: list[dict[str, float]] | None = None

    @property
    def imbalance(self) -> float | None:
        """Largest stage cost / mean stage cost (1.0 is perfect); ``None`` without costs."""
        return _ratio([s.cost for s in self.stages])

    @property
    def memory_imbalance(self) -> float | None:
        """Largest stage memory / mean stage memory; ``None`` without estimates."""
        return _ratio([s.memory_bytes for s in self.stages])

    @classmethod
    def build(cls, module: Any, bounds: Sequence[int], context: PartitionContext,
              stage_memory: list[dict[str, float]] | None = None) -> PartitionReport:
        """The report of ``bounds``, from the estimates a plugin left on ``context``
        (``stage_memory``: the memory model's per-stage categories, :attr:`stage_memory`)."""
        counts = module.parameter_counts()
        costs, unit = context.layer_costs, context.cost_unit
        if costs is None:  # the plugin gave no cost: parameters are the best generic proxy
            costs, unit = [float(c) for c in counts], "parameters"
        static, act = context.layer_static_bytes, context.layer_activation_bytes
        stages = []
        for s in range(len(bounds) - 1):
            lo, hi = bounds[s], bounds[s + 1]
            mem = None
            if static is not None:
                mem = sum(static[lo:hi])
                if act is not None:
                    mem += context.in_flight[s] * sum(act[lo:hi])  # type: ignore[index]
            stages.append(StageReport(s, lo, hi - 1, sum(counts[lo:hi]), sum(costs[lo:hi]), mem))
        return cls(_describe(module.partition_method), list(bounds), stages, unit,
                   list(context.notes), stage_memory)

    def format(self) -> str:
        """A small table, one line per stage."""
        lines = [f"partition {self.method}: bounds {self.bounds}"]
        lines.append(f"{'stage':>5} {'layers':>11} {'params':>12} {self.cost_unit or 'cost':>14} "
                     f"{'memory':>10}")
        for s in self.stages:
            cost = "-" if s.cost is None else f"{s.cost:.6g}"
            mem = "-" if s.memory_bytes is None else format_bytes(s.memory_bytes)
            lines.append(f"{s.stage:>5} {f'{s.first_layer}-{s.last_layer}':>11} "
                         f"{s.parameters:>12,} {cost:>14} {mem:>10}")
        summary = "imbalance (max/mean): cost " + _fmt(self.imbalance)
        summary += ", memory " + _fmt(self.memory_imbalance)
        lines.append(summary)
        if self.stage_memory:
            lines.append("predicted memory per pipeline stage at its peak (the schedule's "
                         "replay; saved = activations saved for backward, buffers = the "
                         "runtime's):")
            lines.append(f"{'stage':>5}" + "".join(f"{k:>11}" for k in MEMORY_CATEGORIES)
                         + f"{'peak':>11}")
            for number, row in enumerate(self.stage_memory):
                lines.append(f"{number:>5}" + "".join(f"{format_bytes(row[k]):>11}"
                                                      for k in MEMORY_CATEGORIES)
                             + f"{format_bytes(sum(row.values())):>11}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """Plain data (for logging sinks and JSON)."""
        return {"method": self.method, "bounds": self.bounds, "cost_unit": self.cost_unit,
                "imbalance": self.imbalance, "memory_imbalance": self.memory_imbalance,
                "notes": self.notes,
                "stages": [{"stage": s.stage, "layers": [s.first_layer, s.last_layer],
                            "parameters": s.parameters, "cost": s.cost,
                            "memory_bytes": s.memory_bytes} for s in self.stages],
                "stage_memory": self.stage_memory}


#: the partition report's memory categories, in the meter's order
MEMORY_CATEGORIES = ("params", "grads", "optimizer", "saved", "buffers")


def _ratio(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    if not values or len(known) < len(values):
        return None
    mean = sum(known) / len(known)
    return max(known) / mean if mean > 0 else 1.0


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def format_bytes(n: float | None) -> str:
    """``n`` bytes for people: ``"12.6 KiB"``, ``"688 B"``; ``"none"`` for ``None`` (the one
    format of partition reports, plans and memory budgets)."""
    if n is None:
        return "none"
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _describe(method: Any) -> str:
    if isinstance(method, Profile):
        return f"profile(repeats={method.repeats})"
    if isinstance(method, Memory):
        return "memory(" + ("sample" if method.sample is not None else "no sample") + ")"
    if isinstance(method, Balance):
        return "balance(" + ("callable" if callable(method.costs) else "costs") + ")"
    if callable(method) and not isinstance(method, str):
        return f"cost function {getattr(method, '__name__', type(method).__name__)}"
    return repr(method)
