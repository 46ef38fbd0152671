"""``schedule="auto"``: choose schedule × chunks × partition (× micro-batches) from measured costs.

:func:`plan_module` profiles the layers once per candidate micro-batch size (the
partition plugin's ``pk.profile``: measured on global rank 0 and broadcast, so every
rank holds the same numbers), then :func:`search` simulates every candidate with
those costs (:func:`~pipekernel.schedules.simulate` with per-stage compute costs)
and ranks them: the fastest predicted step whose per-stage memory fits the budget
wins; ties go to the name, then fewer chunks, then fewer micro-batches, then the
partition's name, so every rank picks the same plan.

The model behind a prediction (see ``docs/planning.md``):

* a micro-batch's forward on a part costs the sum of its layers' measured forward
  seconds, its backward the sum of the rest of the measured forward + backward;
  a split backward spends half of it (times ``split_overhead``) in ``BackwardInput``
  and half in ``BackwardWeight``;
* the optimizer step adds the slowest stage's step once the pipeline drains: each layer's
  step measured alone (:func:`measure_optimizer`), summed over the stage, less the fixed
  per-step cost its layers would each pay if stepped apart;
* a transfer across a stage boundary costs ``transfer_s`` plus the :class:`Link`'s
  ``message_s + byte_s × bytes`` (the boundary layer's measured output; under
  ``pk.launch``/torchrun the link is measured by a ping-pong between ranks 0 and 1 of
  the transport). On a host transport (gloo) the link's seconds occupy the stages,
  half on the sender (packing, writing) and half on the receiver (reading, unpacking):
  many small micro-batches pay for it. On a device transport they are latency, which
  the stages do not wait for unless they need the data;
* the runtime's own costs per instruction (:mod:`pipekernel.engine.runtime_cost`, measured
  on the real pieces unless ``pk.auto(measure_runtime=False)``): the kernel's dispatch on
  every instruction, the loss with the request's labels on the last part's forward and
  backward, and a transfer's trip through the wire's Channel beyond the raw link, half on
  each side;
* with ``expert_parallel_size > 1``, each layer's expert all-to-alls (dispatch and
  combine, and their backward) are timed apart on every rank in an expert-parallel
  group like the engine's (:mod:`pipekernel.engine.all_to_all_cost`; the profile itself
  runs on rank 0 with every expert local) and add to its forward and backward (the
  backward's to ``BackwardInput``);
* a ``ForwardBackward`` (the pairs of dualpipev and zbv) runs as its two steps unless the model
  supplies ``overlapped_forward_backward`` (``pk.overlap_all_to_all`` or its own): then
  it is one step, priced ``F + B - min(a2a(F), compute(B)) - min(a2a(B), compute(F))``
  (:func:`~pipekernel.engine.all_to_all_cost.pair_cost`), so ``auto`` sees what the
  overlap hides;
* the global batch per replica is fixed (``micro_batches × rows of the sample``):
  ``m`` micro-batches each hold ``batch / m`` rows, profiled at that size;
* an engine never changes what a batch is: it trains the micro-batches the user's iterator
  gives (``runs=micro_batches``), so it chooses among the candidates at that count only;
  other counts (``pk.auto(micro_batches=[...])``) are priced as *what-ifs*, listed and
  never run. ``pipekernel plan``, which trains nothing, chooses among every count;
* a stage's memory is its layers' parameter + gradient + optimizer-state bytes plus
  the simulated peak of live micro-batches × the activation bytes of one
  micro-batch of its chunks (averaged over chunks).

Layer 0 + 3 glue: :func:`search` is pure (costs in, plan out) and unit-testable
with injected costs; :func:`plan_module` reaches the profiler and the balancer
through the plugin manager, never by importing a plugin.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipekernel.engine.all_to_all_cost import overlaps_same_chunk, pair_table
from pipekernel.engine.recompute_option import format_recompute, resolve_recompute
from pipekernel.engine.runtime_cost import RuntimeCosts, device_clock, price
from pipekernel.errors import ConfigError, PipelineError
from pipekernel.schedules.instructions import (Backward, BackwardInput, BackwardWeight, Forward, RecvActivation,
                                     RecvGrad, SendActivation, SendGrad)
from pipekernel.schedules.placement import locate
from pipekernel.schedules.sim_memory import live_graphs, part_bytes, stage_memory
from pipekernel.schedules.simulator import simulate
from pipekernel.model.partitioning import format_bytes

__all__ = ["Auto", "auto", "LayerCosts", "Link", "Candidate", "Plan", "search", "plan_module",
           "measure_link", "measure_optimizer", "is_auto"]


@dataclass(frozen=True)
class Auto:
    """Request: ``schedule=pk.auto(...)`` (``schedule="auto"`` is ``pk.auto()``).

    :param memory_budget: bytes per stage a plan may use (``None``: no limit).
    :param schedules: training schedule names to consider (default: every
        registered training schedule).
    :param chunks: chunks (virtual stages) per stage to consider, where a schedule
        supports them.
    :param micro_batches: micro-batch counts to price (each must divide the batch). An
        engine trains its own ``micro_batches`` (the batch the iterator gives), so it
        chooses among that count only and lists the others as what-ifs; default there:
        only its count. ``pipekernel plan`` (no training) chooses among them all;
        default there: half, once, twice and four times the base count, those that
        divide the batch.
    :param sample: one micro-batch of first-stage inputs at the engine's
        ``micro_batches`` (default: the sample of ``partition=pk.profile(sample)``).
    :param labels: one micro-batch of labels, the same rows (what the last stage loads and
        the loss saves, counted in its memory); ``None``: labels are not counted.
    :param transfer_s: seconds one activation or gradient transfer takes, beyond the
        measured link (latency the stages do not spend).
    :param measure_link: time the transport's transfers (message cost and bandwidth)
        with a ping-pong between ranks 0 and 1 and add them to the model (default);
        ``False`` leaves them out.
    :param split_overhead: how much longer a split backward (``BackwardInput`` +
        ``BackwardWeight``) takes than one full backward, where the profile did not time
        the split itself (the built-in profiler does).
    :param repeats: timed repetitions per layer (median); :param warmup: untimed ones.
    :param measure_runtime: time the runtime's own per-instruction costs (the kernel's
        dispatch, the loss with ``labels``, a transfer through the wire's Channel; see
        :mod:`pipekernel.engine.runtime_cost`) and add them to the simulation (default);
        ``False`` leaves them out.
    """

    memory_budget: float | None = None
    schedules: Sequence[str] | None = None
    chunks: Sequence[int] = (1, 2)
    micro_batches: Sequence[int] | None = None
    sample: Any = None
    labels: Any = None
    transfer_s: float = 0.0
    measure_link: bool = True
    split_overhead: float = 1.0
    repeats: int = 3
    warmup: int = 1
    measure_runtime: bool = True


def auto(memory_budget: float | None = None, **options: Any) -> Auto:
    """``schedule=pk.auto(memory_budget=..., ...)``: let the planner choose (see :class:`Auto`)."""
    return Auto(memory_budget=memory_budget, **options)


def is_auto(schedule: Any) -> bool:
    """Whether ``schedule`` asks the planner (``"auto"`` or an :class:`Auto`)."""
    return isinstance(schedule, Auto) or schedule == "auto"


@dataclass(frozen=True)
class LayerCosts:
    """Per-layer costs of one micro-batch (one entry per layer).

    :param forward_s: forward seconds. :param backward_s: backward seconds.
    :param static_bytes: parameter + gradient + optimizer-state + buffer bytes.
    :param activation_bytes: bytes saved for backward per micro-batch.
    :param split_s: ``(input pass, weight pass)`` seconds of the split backward, when
        measured (else half the backward each, times ``split_overhead``).
    """

    forward_s: Sequence[float]
    backward_s: Sequence[float]
    static_bytes: Sequence[float]
    activation_bytes: Sequence[float]
    split_s: Sequence[tuple[float, float]] | None = None
    #: bytes of the tensors each layer returns (what crosses a boundary after it)
    output_bytes: Sequence[float] | None = None
    #: ``(forward, backward)`` seconds of each layer's expert all-to-alls (dispatch and
    #: combine), measured apart from ``forward_s`` / ``backward_s`` (the compute), which
    #: they add to; ``None``: no expert parallelism
    all_to_all_s: Sequence[tuple[float, float]] | None = None
    #: bytes a split backward's input pass keeps per layer for its weight pass (the split
    #: nodes' recorded gradients); ``None``: not measured (counted as nothing)
    weight_state_bytes: Sequence[float] | None = None
    #: bytes of one micro-batch of the first layer's inputs, and of its labels (which the
    #: loss saves): the first and last stage's share of the memory model
    input_bytes: float = 0.0
    label_bytes: float = 0.0
    #: the module's ``activation_checkpoint_interval`` (each part keeps only the input of
    #: every run of that many layers)
    checkpoint_interval: int = 0
    #: per layer, its parameters' gradient bytes (part of ``static_bytes``, but absent
    #: until a stage's first backward writes them); ``None``: counted as always there
    grad_bytes: Sequence[float] | None = None
    #: per layer, the seconds of one optimizer step on its parameters alone (measured,
    #: state already made), and the fixed part of any step (a step over two layers costs
    #: the sum of theirs less it); ``None``: the step is not counted
    optimizer_s: Sequence[float] | None = None
    optimizer_fixed_s: float = 0.0

    def all_to_all_share(self) -> tuple[float, float]:
        """``(all-to-all seconds, all seconds)`` of one micro-batch's forward + backward."""
        a2a = sum(f + b for f, b in self.all_to_all_s or ())
        return a2a, sum(self.forward_s) + sum(self.backward_s) + a2a


@dataclass(frozen=True)
class Link:
    """What one transfer of ``n`` bytes between two stages costs: ``message_s + byte_s × n``.

    :param on_host: the transport's host does the transfer (gloo: it packs, writes, reads
        and unpacks), so the seconds occupy the sending and the receiving stage, half
        each; ``False`` (a device transport) makes them latency.
    """

    message_s: float = 0.0
    byte_s: float = 0.0
    on_host: bool = True

    def seconds(self, nbytes: float) -> float:
        return self.message_s + self.byte_s * nbytes


@dataclass(frozen=True)
class Candidate:
    """One point of the search and what the simulator predicts for it.

    ``predicted_step_s`` is ``None`` when the candidate cannot run (``note`` says why);
    ``stage_bytes`` is the predicted memory per stage.
    """

    schedule: str
    chunks: int
    micro_batches: int
    partition: str
    bounds: tuple[int, ...] = ()
    predicted_step_s: float | None = None
    stage_bytes: tuple[float, ...] = ()
    fits: bool = False
    note: str = ""
    #: priced at a micro-batch count the engine does not run (it trains the user's
    #: count): listed for comparison, never chosen
    what_if: bool = False
    #: what ``predicted_step_s`` adds up, in seconds: ``pipeline`` (the simulated
    #: makespan) and ``optimizer`` (the slowest stage's measured optimizer step)
    terms: Mapping[str, float] = field(default_factory=dict)
    #: per stage, the predicted bytes at its peak by category: ``static`` (parameters,
    #: gradients, optimizer state), ``saved`` and ``buffers`` (see
    #: :mod:`pipekernel.schedules.sim_memory`)
    stage_memory: tuple[Mapping[str, float], ...] = ()
    #: per stage, its activation checkpoint interval (``0``: none; see
    #: :mod:`pipekernel.engine.recompute_option`)
    recompute: tuple[int, ...] = ()

    @property
    def peak_bytes(self) -> float | None:
        """The largest stage's predicted memory."""
        return max(self.stage_bytes) if self.stage_bytes else None

    def rank_key(self) -> tuple:
        """Sort key: runnable first, then those that may run (not what-ifs), fitting
        first, then faster, then deterministic ties."""
        runnable = self.predicted_step_s is not None
        return (not runnable, self.what_if, not self.fits,
                self.predicted_step_s if runnable else 0.0,
                self.schedule, self.chunks, self.micro_batches, self.partition,
                sum(self.recompute), self.recompute)

    def key(self) -> tuple:
        """What identifies the pipeline it would run (the plan's choice)."""
        return self.schedule, self.chunks, self.micro_batches, self.bounds, self.recompute


@dataclass(frozen=True)
class Plan:
    """What ``schedule="auto"`` chose (``engine.plan``), with every candidate ranked."""

    schedule: str
    chunks: int
    micro_batches: int
    partition: str
    bounds: tuple[int, ...]
    predicted_step_s: float
    memory_budget: float | None
    candidates: tuple[Candidate, ...] = field(repr=False, default=())
    #: the per-layer costs the search used, by micro-batch count
    costs: Mapping[int, LayerCosts] = field(repr=False, default_factory=dict)
    #: the transfer model the search used (``None``: transfers free but ``transfer_s``)
    link: Link | None = None
    #: the name of the model's ``overlapped_forward_backward`` (``""``: none, the pairs
    #: run as their two steps)
    executor: str = ""
    #: the micro-batch count an engine trains (its own; the plan was chosen at it), or
    #: ``None`` where any count could be chosen (``pipekernel plan``)
    runs: int | None = None
    #: per stage, its activation checkpoint interval (``0``: none)
    recompute: tuple[int, ...] = ()
    #: what the prediction leaves out for this model (printed under the plan's header)
    notes: tuple[str, ...] = ()
    #: the runtime's per-instruction costs the search added (``None``: not measured)
    runtime: RuntimeCosts | None = None

    @property
    def breakdown(self) -> Mapping[str, float]:
        """The chosen candidate's terms of ``predicted_step_s`` (:attr:`Candidate.terms`)."""
        chosen = next((c for c in self.candidates if (c.schedule, c.chunks, c.micro_batches,
                       c.bounds) == (self.schedule, self.chunks, self.micro_batches,
                                     self.bounds)), None)
        return dict(chosen.terms) if chosen is not None else {}

    def fields(self) -> dict[str, Any]:
        """The choice as plain values (every rank must hold the same)."""
        return {"schedule": self.schedule, "chunks": self.chunks,
                "micro_batches": self.micro_batches, "bounds": list(self.bounds),
                "recompute": list(self.recompute)}

    def key(self) -> tuple:
        """What identifies the chosen pipeline (as :meth:`Candidate.key`)."""
        return self.schedule, self.chunks, self.micro_batches, self.bounds, self.recompute

    def announce(self) -> str:
        """One line for the start of a run: what was chosen, and that the batch is the
        user's (with the fastest what-if count, when one is predicted faster)."""
        text = (f"pipekernel: schedule 'auto' chose {self.schedule}, chunks {self.chunks}, "
                f"partition {self.partition} {list(self.bounds)}, recompute "
                f"{format_recompute(self.recompute)}, predicted "
                f"{1e3 * self.predicted_step_s:.2f} ms/step")
        if self.runs is None:
            return f"{text}, at {self.micro_batches} micro-batches per step"
        text += (f", for your {self.runs} micro-batches per step (auto never changes the "
                 f"batch: each step trains the {self.runs} micro-batches your iterator gives)")
        faster = [(c.predicted_step_s, c) for c in self.candidates if c.what_if and c.fits
                  and c.predicted_step_s is not None
                  and c.predicted_step_s < self.predicted_step_s]
        if faster:
            seconds, f = min(faster, key=lambda pair: pair[0])
            text += (f"; {f.micro_batches} micro-batches would be predicted "
                     f"{1e3 * seconds:.2f} ms/step ({f.schedule}, chunks {f.chunks}): "
                     f"give the same batch as {f.micro_batches} micro-batches and "
                     f"micro_batches={f.micro_batches} to use it")
        return text

    def format(self, top: int | None = None) -> str:
        """The ranked candidates as a text table (the chosen one first, marked ``*``)."""
        budget = "none" if self.memory_budget is None else format_bytes(self.memory_budget)
        lines = [f"plan: {self.schedule}, chunks {self.chunks}, {self.micro_batches} "
                 f"micro-batches, partition {self.partition} {list(self.bounds)}: predicted "
                 f"{1e3 * self.predicted_step_s:.2f} ms/step (memory budget per stage: {budget})",
                 f"  recompute: {format_recompute(self.recompute)}",
                 *(f"  note: {note}" for note in self.notes),
                 *([f"  transfers: {1e6 * self.link.message_s:.0f} us per message + "
                    f"{1e6 * self.link.byte_s * 2 ** 20:.0f} us per MiB, "
                    f"{'on the stages (host transport)' if self.link.on_host else 'latency'}"]
                   if self.link is not None else []),
                 *([f"  runtime per instruction: dispatch {1e6 * r.dispatch_s:.1f} us, loss "
                    f"{1e6 * r.loss_forward_s:.0f} + {1e6 * r.loss_backward_s:.0f} us "
                    f"(forward + backward, last part), wire {1e6 * r.wire_s:.0f} us per "
                    f"transfer"] if (r := self.runtime) is not None else []),
                 *self._all_to_all_line(),
                 *self._memory_lines(),
                 f"  {'#':>3} {'schedule':<12} {'chunks':>6} {'micro':>5} {'partition':<9} "
                 f"{'recompute':<10} {'pred ms':>9} {'peak mem':>10}  note"]
        shown = self.candidates if top is None else self.candidates[:top]
        for i, c in enumerate(shown, 1):
            mark = "*" if c.key() == self.key() else " "
            pred = f"{1e3 * c.predicted_step_s:9.2f}" if c.predicted_step_s is not None \
                else f"{'-':>9}"
            peak = format_bytes(c.peak_bytes) if c.peak_bytes is not None else "-"
            note = c.note or ("" if c.fits else "over budget")
            redo = ",".join(str(k) for k in c.recompute) if any(c.recompute) else "-"
            lines.append(f"{mark} {i:>3} {c.schedule:<12} {c.chunks:>6} {c.micro_batches:>5} "
                         f"{c.partition:<9} {redo:<10} {pred} {peak:>10}  {note}".rstrip())
        return "\n".join(lines)

    def _memory_lines(self) -> list[str]:
        """The chosen plan's predicted bytes per stage by category (at the stage's peak)."""
        chosen = next((c for c in self.candidates if c.key() == self.key()), None)
        if chosen is None or not chosen.stage_memory:
            return []
        lines = ["  predicted memory per stage at its peak (static = parameters + optimizer "
                 "state; saved = activations saved for backward; buffers = the runtime's):"]
        for s, row in enumerate(chosen.stage_memory):
            every = chosen.recompute[s] if s < len(chosen.recompute) else 0
            lines.append(f"    stage {s}: " + ", ".join(
                f"{k} {format_bytes(v)}" for k, v in row.items())
                + f", peak {format_bytes(sum(row.values()))}; recompute "
                + (f"every {every} layer(s)" if every else "none"))
        return lines

    def _all_to_all_line(self) -> list[str]:
        costs = self.costs.get(self.micro_batches)
        if costs is None or not costs.all_to_all_s:
            return []
        a2a, total = costs.all_to_all_share()
        pairs = (f"pairs overlapped by {self.executor}" if self.executor
                 else "pairs run as their two steps (no overlapped_forward_backward)")
        return [f"  expert all-to-all: {1e3 * a2a:.2f} of {1e3 * total:.2f} ms forward + "
                f"backward per micro-batch ({100 * a2a / total if total else 0:.0f}%); {pairs}"]


Balancer = Callable[[Sequence[float], int], Sequence[int]]


def search(costs: Mapping[int, LayerCosts], num_stages: int, schedules: Mapping[str, Any], *,
           balance: Balancer, chunks: Sequence[int] = (1, 2),
           memory_budget: float | None = None, transfer_s: float = 0.0,
           split_overhead: float = 1.0, link: Link | None = None,
           executor: Callable[..., Any] | None = None, runs: int | None = None,
           recompute: Sequence[int] | None = None,
           runtime: RuntimeCosts | None = None) -> Plan:
    """Simulate every candidate under ``costs`` and pick the fastest that fits.

    :param costs: ``{micro-batch count: per-layer costs of one such micro-batch}``.
    :param num_stages: pipeline stages.
    :param schedules: ``{name: schedule class}`` (training schedules).
    :param balance: ``(per-layer weights, parts) -> boundaries`` (the exact balancer).
    :param chunks: chunk counts to try (each schedule keeps those it supports).
    :param memory_budget: bytes per stage (``None``: no limit).
    :param transfer_s: seconds per transfer (latency).
    :param split_overhead: split backward time over full backward time.
    :param link: the transport's cost per transfer by size (``None``: free); the bytes
        of a boundary come from ``costs[m].output_bytes``.
    :param executor: the model's ``overlapped_forward_backward`` (``None``: none): a
        ``ForwardBackward`` then runs as one step, priced by
        :func:`~pipekernel.engine.all_to_all_cost.pair_cost` (its halves' all-to-alls
        hidden under each other's compute); without one it runs as its two steps.
    :param runs: the micro-batch count that will run (an engine's: the batch its iterator
        gives); the plan is chosen among the candidates at it, the other counts are
        listed as what-ifs (``Candidate.what_if``). ``None``: any count may be chosen.
    :param recompute: per stage, its activation checkpoint interval, fixed (the engine's
        ``recompute``). ``None``: every stage at the module's interval
        (``costs[m].checkpoint_interval``), unless that candidate is over
        ``memory_budget``: then recomputation is searched per stage (:func:`_recompute`).
    :param runtime: the runtime's own costs per instruction (dispatch, loss, wire),
        added to every candidate's simulation (:func:`~pipekernel.engine.runtime_cost.price`);
        ``None``: none.
    :raises ConfigError: nothing runnable, or nothing within ``memory_budget``.
    """
    fixed = None if recompute is None else resolve_recompute(list(recompute), num_stages, 0)
    found: list[Candidate] = []
    streams: dict[tuple, str] = {}
    for name, cls in sorted(schedules.items()):
        for c in sorted({c for c in chunks if cls.min_chunks <= c <= cls.max_chunks}):
            for m, layer_costs in sorted(costs.items()):
                # another name for the same pipeline (interleaved with one chunk is 1F1B):
                # listed, not simulated again, so the ranking holds each pipeline once
                key = _streams(cls, num_stages, m, c)
                if key is not None and key in streams:
                    found.append(Candidate(name, c, m, "-",
                                           note=f"the same instruction streams as {streams[key]}"))
                    continue
                if key is not None:
                    streams[key] = f"{name} (chunks {c})"
                found += _candidates(name, cls, c, m, layer_costs, num_stages, balance,
                                     memory_budget, (transfer_s, split_overhead, link,
                                                     executor, runtime), fixed)
    ranked = tuple(sorted(_what_ifs(found, runs), key=Candidate.rank_key))
    best, seconds = _best(ranked, num_stages, memory_budget, runs)
    return Plan(best.schedule, best.chunks, best.micro_batches, best.partition, best.bounds,
                seconds, memory_budget, ranked, dict(costs), link,
                getattr(executor, "__name__", type(executor).__name__) if executor else "",
                runs, best.recompute, runtime=runtime)


def _what_ifs(found: list[Candidate], runs: int | None) -> list[Candidate]:
    """``found`` with the candidates at another count than ``runs`` marked what-ifs."""
    if runs is None:
        return found
    return [c if c.micro_batches == runs else dataclasses.replace(
        c, what_if=True, note=f"what-if: the engine runs {runs}"
                              + (f"; {c.note}" if c.note else "")) for c in found]


def _best(ranked: tuple[Candidate, ...], num_stages: int, budget: float | None,
          runs: int | None) -> tuple[Candidate, float]:
    """The first of ``ranked`` and its predicted seconds, if it may run (at ``runs``
    micro-batches, within ``budget``)."""
    best = ranked[0] if ranked else None
    at = f" at {runs} micro-batches (the engine's count)" if runs is not None else ""
    if best is None or best.predicted_step_s is None or best.what_if:
        reasons = "; ".join(sorted({f"{c.schedule}: {c.note}" for c in ranked
                                    if not c.what_if})) or "none"
        raise ConfigError(f"schedule='auto' found no runnable candidate for {num_stages} "
                          f"stage(s){at} ({reasons})",
                          hint="widen pk.auto(schedules=..., chunks=...)" if runs is not None
                          else "widen pk.auto(schedules=..., chunks=..., micro_batches=...)")
    if not best.fits:
        # recomputation on every stage included: the search adds that candidate wherever
        # nothing less fits, so the smallest budget is true with it
        sizes = [c.peak_bytes for c in ranked if c.peak_bytes and not c.what_if]
        other = next((c for c in ranked if c.what_if and c.fits
                      and c.predicted_step_s is not None), None)
        raise ConfigError(
            f"schedule='auto': no candidate{at} fits memory_budget={format_bytes(budget)} per "
            f"stage; the smallest budget that would fit is "
            f"{format_bytes(min(sizes) * (1 + MEMORY_MARGIN))} (its largest stage is predicted "
            f"at {format_bytes(min(sizes))}, plus the model's {MEMORY_MARGIN:.0%} margin)"
            + (f" ({other.micro_batches} micro-batches would fit: {other.schedule}, "
               f"{format_bytes(other.peak_bytes)})" if other is not None else ""),
            hint="raise memory_budget, use more stages, or give the batch as more "
                 "(smaller) micro-batches (recomputation on every stage is already counted"
                 " where the engine's recompute leaves it to the planner)")
    return best, best.predicted_step_s


def _streams(cls: Any, num_stages: int, m: int, chunks: int) -> tuple | None:
    """What a schedule makes every stage run (placement and steps), ``None`` if it cannot."""
    try:
        return (getattr(cls, "placement", "loop"), chunks, m,
                tuple(tuple(tuple(step) for step in cls(num_stages, s, m, chunks).steps())
                      for s in range(num_stages)))
    except PipelineError:
        return None


def _candidates(name: str, cls: Any, chunks: int, m: int, costs: LayerCosts, num_stages: int,
                balance: Balancer, budget: float | None,
                model: tuple, fixed: tuple[int, ...] | None = None) -> list[Candidate]:
    """The candidates of one (schedule, chunks, micro-batches): one per distinct partition,
    and per partition over ``budget``, the least recomputation that fits
    (:func:`_recompute`)."""
    parts = num_stages * chunks
    if parts > len(costs.forward_s):
        return [Candidate(name, chunks, m, "-", note=f"{parts} parts > "
                          f"{len(costs.forward_s)} layers")]
    try:
        live = live_graphs(cls, num_stages, m, chunks)  # per part: its chunk's graphs at once
    except PipelineError as err:
        return [Candidate(name, chunks, m, "-", note=err.message.split("\n")[0])]
    a2a = costs.all_to_all_s or [(0.0, 0.0)] * len(costs.forward_s)
    time_w = [f + b + af + ab for f, b, (af, ab) in zip(costs.forward_s, costs.backward_s, a2a)]
    mean_in_flight = sum(live.values()) / len(live)
    memory_w = [s + mean_in_flight * a for s, a in zip(costs.static_bytes,
                                                         costs.activation_bytes)]
    # under a budget the planner chooses from none up (the fastest that fits); without
    # one every stage keeps the module's interval
    base = fixed or ((0,) if budget is not None else (costs.checkpoint_interval,)) * num_stages
    out: list[Candidate] = []
    seen: set[tuple[int, ...]] = set()
    for label, weights in (("time", time_w), ("memory", memory_w)):
        bounds = tuple(int(b) for b in balance(weights, parts))
        if bounds in seen:
            continue
        seen.add(bounds)
        evaluate = functools.partial(_evaluate, name, cls, chunks, m, label, bounds, costs,
                                     num_stages, budget, model)
        first = evaluate(base)
        out.append(first)
        if fixed is None and not first.fits and first.predicted_step_s is not None:
            out += _recompute(evaluate, first, num_stages, costs.checkpoint_interval)
    return out


def _recompute(evaluate: Callable[[tuple[int, ...]], Candidate], over: Candidate,
               num_stages: int, interval: int) -> list[Candidate]:
    """The candidate ``evaluate`` prices with the least recomputation that fits its budget
    (else with recomputation on every stage, the least memory the search can offer).

    Stages switch recomputation on one at a time, those whose saved activations are the
    most at their peak first (under 1F1B the early stages, which hold more micro-batches),
    each at the module's interval, or every layer (``1``) where the module has none. Each
    stage switched on only adds a forward to its backward, so the first that fits is the
    fastest of the sequence. A larger interval keeps less between forward and backward
    but recomputes a whole run inside one backward, where the meter (and the model) do
    not see it, so the search never goes past the module's interval."""
    every = interval or 1
    order = sorted(range(num_stages), key=lambda s: (-over.stage_memory[s].get("saved", 0.0), s))
    intervals = [0] * num_stages
    last = None
    for stage in order:
        intervals[stage] = every
        last = evaluate(tuple(intervals))
        if last.fits:
            return [last]
    return [last] if last is not None else []


def _evaluate(name: str, cls: Any, chunks: int, m: int, label: str, bounds: tuple[int, ...],
              costs: LayerCosts, num_stages: int, budget: float | None,
              model: tuple, recompute: tuple[int, ...]) -> Candidate:
    """Simulate one candidate: its step time and per-stage memory, with ``recompute`` (per
    stage, its checkpoint interval): a recomputed part's ``Backward`` and
    ``BackwardInput`` cost one more forward, and so does its ``BackwardWeight`` (a
    separate autograd call, which recomputes the segments again)."""
    transfer_s, split, link, executor, runtime = model
    placement = getattr(cls, "placement", "loop")
    table: dict[tuple[int, ...], dict[type, float]] = {}
    parts: dict[tuple[int, int], tuple[float, float, float, float]] = {}
    static = [0.0] * num_stages
    for p in range(num_stages * chunks):
        stage, chunk = locate(p, num_stages, placement)
        lo, hi = bounds[p], bounds[p + 1]
        f, b = sum(costs.forward_s[lo:hi]), sum(costs.backward_s[lo:hi])
        if costs.split_s is not None:
            i, w = (sum(pair[k] for pair in costs.split_s[lo:hi]) for k in (0, 1))
        else:
            i = w = split * b / 2
        # the all-to-alls add to the compute; their backward is on the input-gradient path
        fa, ba = (sum(pair[k] for pair in (costs.all_to_all_s or ())[lo:hi]) for k in (0, 1))
        redo = f + fa if recompute[stage] else 0.0
        parts[(stage, chunk)] = (f, fa, b + redo, ba)
        table[(stage, chunk)] = {Forward: f + fa, Backward: b + ba + redo,
                                 BackwardInput: i + ba + redo, BackwardWeight: w + redo}
        static[stage] += sum(costs.static_bytes[lo:hi])
    transfers: dict[type, float] = {SendActivation: transfer_s, SendGrad: transfer_s,
                                    RecvActivation: 0.0, RecvGrad: 0.0}
    host: dict[type, float] = {}
    if link is not None:
        # every boundary of a transformer-like model carries the same bytes; where they
        # differ, the mean over this partition's cuts stands for all of them
        cuts = [costs.output_bytes[b - 1] for b in bounds[1:-1]] if costs.output_bytes else []
        seconds = link.seconds(sum(cuts) / len(cuts) if cuts else 0.0)
        if link.on_host:
            host = {k: seconds / 2 for k in (SendActivation, SendGrad, RecvActivation, RecvGrad)}
        else:
            transfers[SendActivation] += seconds
            transfers[SendGrad] += seconds
    if executor is not None:
        for key, prices in pair_table(parts, overlaps_same_chunk(executor)).items():
            table[key] = prices
    price(table, host, runtime, locate(num_stages * chunks - 1, num_stages, placement))
    try:
        result = simulate(cls, num_stages, m, chunks, costs=transfers, stage_costs=table,
                          host_costs=host, paired=executor is not None)
    except PipelineError as err:
        return Candidate(name, chunks, m, label, bounds, note=err.message.split("\n")[0],
                         recompute=recompute)
    memory = _stage_memory(cls, num_stages, m, chunks, bounds, costs, static, recompute)
    stage_bytes = tuple(sum(row.values()) for row in memory)
    fits = budget is None or max(stage_bytes) * (1 + MEMORY_MARGIN) <= budget
    terms = {"pipeline": result.makespan, "optimizer": _optimizer_s(costs, bounds, num_stages,
                                                                    chunks, placement)}
    return Candidate(name, chunks, m, label, bounds, sum(terms.values()), stage_bytes, fits,
                     stage_memory=memory, terms=terms, recompute=recompute)


def _optimizer_s(costs: LayerCosts, bounds: tuple[int, ...], num_stages: int, chunks: int,
                 placement: str) -> float:
    """The slowest stage's optimizer step: the sum of its layers' measured steps, less the
    fixed cost of every step but one (one step runs over all of a stage's parameters), and
    never less than its dearest layer's."""
    if costs.optimizer_s is None:
        return 0.0
    steps: list[list[float]] = [[] for _ in range(num_stages)]
    for p in range(num_stages * chunks):
        stage = locate(p, num_stages, placement)[0]
        steps[stage] += [t for t in costs.optimizer_s[bounds[p]:bounds[p + 1]] if t > 0]
    return max((max(sum(t) - (len(t) - 1) * costs.optimizer_fixed_s, max(t))
                for t in steps if t), default=0.0)


#: a plan fits a budget when its largest stage's prediction, plus this share, does: the
#: memory model is within 5% of the measured peak on every stage the tests measure
#: (``tests/test_memory_model.py``), so the measured peak of a fitting plan fits too
MEMORY_MARGIN = 0.05


def _stage_memory(cls: Any, num_stages: int, m: int, chunks: int, bounds: tuple[int, ...],
                  costs: LayerCosts, static: list[float],
                  recompute: tuple[int, ...]) -> tuple[dict[str, float], ...]:
    """Per stage ``{"static", "grads", "saved", "buffers"}`` bytes at its predicted peak: the
    parameters and optimizer state plus the replay of its program (:func:`~pipekernel.schedules.sim_memory.stage_memory`)."""
    outputs = costs.output_bytes or [0.0] * len(costs.activation_bytes)
    parts = part_bytes(bounds, num_stages, chunks, getattr(cls, "placement", "loop"),
                       saved=costs.activation_bytes, outputs=outputs,
                       weight_states=costs.weight_state_bytes, input_bytes=costs.input_bytes,
                       label_bytes=costs.label_bytes,
                       checkpoint_interval=recompute, grads=costs.grad_bytes)
    peaks = stage_memory(cls, num_stages, m, chunks, parts)
    fixed = list(static)  # less the gradients, which the replay places in time
    for (stage, _), part in parts.items():
        fixed[stage] -= part.grads
    return tuple({"static": fixed[s], **peaks[s]} for s in range(num_stages))


# -- the engine's (and the CLI's) way in: profile through the plugins, then search --------

def _sample_of(module: Any, request: Auto, profile: type) -> Any:
    """The micro-batch to profile: the request's, else the module's profile partition's."""
    sample = request.sample
    if sample is None and isinstance(getattr(module, "partition_method", None), profile):
        sample = module.partition_method.sample
    if sample is None:
        raise ConfigError("schedule='auto' needs a sample micro-batch to profile the layers",
                          hint="pass schedule=pk.auto(sample=inputs) or "
                               "partition=pk.profile(inputs) (one micro-batch of inputs)")
    return sample


def _counts(request: Auto, micro_batches: int, rows: int, runs: int | None) -> list[int]:
    """The micro-batch counts to profile, each dividing the batch's rows (``runs``, the
    count an engine trains, always among them)."""
    total = rows * micro_batches
    if runs is not None:
        default = [runs]
    else:
        default = [n for n in (micro_batches // 2, micro_batches, 2 * micro_batches,
                               4 * micro_batches) if n >= 1 and total % n == 0]
    counts = sorted(set(request.micro_batches or default) | ({runs} if runs else set()))
    for n in counts:
        if not isinstance(n, int) or n < 1 or total % n:
            raise ConfigError(f"pk.auto(micro_batches=...) has {n!r}, which does not divide "
                              f"the batch of {total} rows ({micro_batches} micro-batches x "
                              f"{rows} rows of the sample)",
                              hint="give micro-batch counts that divide the batch")
    return counts


def plan_module(module: Any, request: Auto, *, num_stages: int, micro_batches: int, pm: Any,
                transport: Any = None, device: Any = None, optimizer: Any = None,
                expert_parallel_size: int = 1, topology: Any = None,
                runs: int | None = None, recompute: Sequence[int] | None = None) -> Plan:
    """Profile ``module``'s layers for each candidate micro-batch size and :func:`search`.

    Every rank of ``transport`` must call it at the same point (the profile is measured
    on global rank 0 and broadcast by the partition plugin, so all ranks get the same
    costs and the same plan).

    :param micro_batches: the engine's count; the sample is one micro-batch of it.
    :param runs: the count that will train (an engine passes its ``micro_batches``: it
        never changes what a batch is); the plan is chosen at it, other counts of the
        request are what-ifs. ``None`` (``pipekernel plan``): any count may be chosen.
    :param expert_parallel_size: the engine's ``E``; above 1 (with ``topology``, the
        engine's), every rank also times its expert-parallel layers' all-to-alls
        (:func:`~pipekernel.engine.all_to_all_cost.measure_all_to_all`) into
        ``LayerCosts.all_to_all_s``.
    :param recompute: per stage, a fixed checkpoint interval (the engine's ``recompute``);
        ``None``: the planner chooses (see :func:`search`).
    """
    from pipekernel.model.partitioning import Balance, PartitionContext, Profile

    sample = _sample_of(module, request, Profile)
    rows = _rows(sample)
    total = rows * micro_batches
    counts = _counts(request, micro_batches, rows, runs)
    if transport is not None:  # every rank profiles the same sizes, in the same order
        from pipekernel.engine.faults import check_consistency
        check_consistency(transport, {"sample rows": rows, "micro-batch counts": counts},
                          "schedule='auto' request")
    ep_group = None
    if expert_parallel_size > 1 and topology is not None and transport is not None:
        from pipekernel.engine.all_to_all_cost import planner_group
        ep_group = planner_group(topology, transport, expert_parallel_size)
    costs = _with_optimizer(_profiles(module, request, sample, total, counts, pm,
                                      (transport, device, optimizer, ep_group)),
                            module, optimizer, transport, device, request)
    schedules = _schedules(request, pm)
    cache: dict[tuple, list[int]] = {}

    def balance(weights: Sequence[float], parts: int) -> list[int]:
        key = (tuple(weights), parts)
        if key not in cache:
            ctx = PartitionContext(module=module, num_stages=parts)
            cache[key] = list(pm.hook.pipekernel_partition(
                method=Balance(list(weights), "planner"), layers=module.layers,
                num_stages=parts, context=ctx))
        return cache[key]

    notes, recompute = _skip_notes(module, num_stages, recompute)
    link = _link(request, transport, costs)
    runtime = _runtime(module, request, sample, (transport, device, link), costs,
                       (num_stages, runs or micro_batches))
    plan = search(costs, num_stages, schedules, balance=balance,
                  chunks=request.chunks, memory_budget=request.memory_budget,
                  transfer_s=request.transfer_s, split_overhead=request.split_overhead,
                  link=link, executor=getattr(module, "overlapped_forward_backward", None),
                  runs=runs, recompute=recompute, runtime=runtime)
    return dataclasses.replace(plan, notes=notes) if notes else plan


def _largest_output(costs: Mapping[int, LayerCosts]) -> float:
    """The largest bytes any layer returns, over every micro-batch count profiled."""
    return max((max(c.output_bytes) for c in costs.values() if c.output_bytes), default=0.0)


def _runtime(module: Any, request: Auto, sample: Any, where: tuple,
             costs: Mapping[int, LayerCosts], shape: tuple[int, int]) -> RuntimeCosts | None:
    """The runtime's per-instruction costs (:func:`~pipekernel.engine.runtime_cost.measure_runtime`;
    ``None`` when the request leaves them out), the wire timed with a stage's mean
    instruction at the count that runs (its share of a forward and a backward) between
    transfers. ``where``: ``(transport, device, link)``; ``shape``: ``(stages, count)``.
    Collective."""
    if not request.measure_runtime:
        return None
    from pipekernel.engine.runtime_cost import measure_runtime
    transport, device, link = where
    num_stages, count = shape
    mine = costs.get(count) or next(iter(costs.values()))
    work = (sum(mine.forward_s) + sum(mine.backward_s)) / (2 * max(num_stages, 1))
    return measure_runtime(module, sample, request.labels, transport, device, link=link,
                           nbytes=_largest_output(costs), work_s=work, repeats=max(3 * request.repeats, 9),
                           warmup=max(request.warmup, 2))  # small and cheap: more rounds


def _link(request: Auto, transport: Any, costs: Mapping[int, LayerCosts]) -> Link | None:
    """The transport's measured transfer cost (``None``: not measured)."""
    if not (request.measure_link and transport is not None and transport.world_size > 1):
        return None
    return measure_link(transport, _largest_output(costs))


def _skip_notes(module: Any, num_stages: int, recompute: Sequence[int] | None
                ) -> tuple[tuple[str, ...], Sequence[int] | None]:
    """What the plan of a model with skip connections says it leaves out, and the
    recompute to search under (none: a recompute cannot run with skips)."""
    if not getattr(module, "skip_names", None):
        return (), recompute
    notes = (f"skip connections' stashes ({', '.join(sorted(module.skip_names))}) are not "
             "in the memory model; recomputation is not searched (it cannot run with skip "
             "connections)",)
    return notes, (0,) * num_stages if recompute is None else recompute


def _profiles(module: Any, request: Auto, sample: Any, total: int, counts: list[int], pm: Any,
              where: tuple) -> dict[int, LayerCosts]:
    """Per micro-batch count, the layers' costs at that size (:func:`_profile`), with the
    request's labels' bytes."""
    return {n: dataclasses.replace(
        _profile(module, request, _resize(sample, total // n), n, pm, where),
        label_bytes=_nbytes(_resize(request.labels, total // n))
        if request.labels is not None else 0.0) for n in counts}


def _with_optimizer(costs: dict[int, LayerCosts], module: Any, optimizer: Any, transport: Any,
                    device: Any, request: Auto) -> dict[int, LayerCosts]:
    """``costs`` with the optimizer's step per layer (:func:`measure_optimizer`: the same
    for every micro-batch count, measured once); unchanged without an optimizer."""
    if optimizer is None:
        return costs
    steps, fixed = measure_optimizer(module, optimizer, transport, device,
                                     repeats=request.repeats, warmup=request.warmup)
    return {n: dataclasses.replace(c, optimizer_s=steps, optimizer_fixed_s=fixed)
            for n, c in costs.items()}


def _schedules(request: Auto, pm: Any) -> dict[str, Any]:
    """``{name: class}`` of the schedules to search (the request's, else every training one)."""
    from pipekernel.extend.manager import registered_schedules

    table = registered_schedules(pm)
    names = request.schedules or [k for k, cls in table.items() if getattr(cls, "trains", True)]
    unknown = [k for k in names if k not in table]
    if unknown:
        raise ConfigError(f"pk.auto(schedules=...) names unknown schedule(s) {unknown}",
                          hint=f"available: {', '.join(sorted(table))}")
    return {k: table[k] for k in names}


def _profile(module: Any, request: Auto, sample: Any, n: int, pm: Any, where: tuple) -> LayerCosts:
    """The layer costs of one micro-batch ``sample`` (``n`` per batch), all-to-alls included."""
    from pipekernel.model.partitioning import PartitionContext, Profile

    transport, device, optimizer, ep_group = where
    context = PartitionContext(module=module, num_stages=1, transport=transport,
                               device=device, rank=getattr(transport, "rank", 0),
                               micro_batches=n, optimizer=optimizer)
    pm.hook.pipekernel_partition(
        method=Profile(sample, request.repeats, request.warmup, split_backward=True),
        layers=module.layers, num_stages=1, context=context)
    costs = dataclasses.replace(
        _layer_costs(context), input_bytes=_nbytes(sample),
        checkpoint_interval=getattr(module, "activation_checkpoint_interval", 0) or 0,
        grad_bytes=_grad_bytes(module))
    return _with_all_to_all(costs, module, sample, ep_group, transport, device, request)


def _grad_bytes(module: Any) -> list[float] | None:
    """Per layer, its gradients' bytes (fp32: what the optimizer steps on)."""
    counts = getattr(module, "parameter_counts", None)
    return [4.0 * c for c in counts()] if callable(counts) else None


def _nbytes(sample: Any) -> float:
    """Bytes of the tensors in ``sample`` (one micro-batch of inputs)."""
    import torch

    if isinstance(sample, torch.Tensor):
        return float(sample.numel() * sample.element_size())
    items = sample.values() if isinstance(sample, dict) else \
        sample if isinstance(sample, (tuple, list)) else ()
    return float(sum(_nbytes(item) for item in items))


def _with_all_to_all(costs: LayerCosts, module: Any, sample: Any, ep_group: Any, transport: Any,
                     device: Any, request: Auto) -> LayerCosts:
    """``costs`` with the expert all-to-alls measured on ``ep_group`` (none: unchanged)."""
    if ep_group is None:
        return costs
    from pipekernel.engine.all_to_all_cost import measure_all_to_all
    measured = measure_all_to_all(module, sample, ep_group, transport=transport,
                                  device=device or "cpu", repeats=request.repeats,
                                  warmup=request.warmup)
    return dataclasses.replace(costs, all_to_all_s=measured)


def measure_optimizer(module: Any, optimizer: Callable[..., Any], transport: Any = None,
                      device: Any = None, *, repeats: int = 3, warmup: int = 1,
                      clock: Callable[[], float] | None = None) -> tuple[list[float], float]:
    """``(per layer, the seconds of one optimizer step on its parameters; the fixed part of
    a step)``: each layer built alone (one at a time) and stepped by ``optimizer`` with
    zero gradients, ``warmup`` untimed steps (the state is made) then the median of
    ``repeats``; the fixed part is the sum of two layers' steps less one step over both (the
    per-call cost a stage's single step pays once). Measured on global rank 0 of
    ``transport`` and broadcast (collective: every rank calls it); a layer without
    trainable parameters costs 0."""
    import statistics
    import time

    import torch

    now = clock or time.perf_counter
    rank = getattr(transport, "rank", 0)
    count = len(module.layers)
    values = torch.zeros(count + 1, dtype=torch.float64)
    if rank == 0:
        where = device or "cpu"
        now = device_clock(where, now)

        def timed(params: list) -> float:
            for p in params:
                p.grad = torch.zeros_like(p)
            opt = optimizer(params)
            times = []
            for i in range(warmup + repeats):
                start = now()
                opt.step()
                if i >= warmup:
                    times.append(now() - start)
            return statistics.median(times)

        kept: list[list] = []  # two layers' parameters, for the fixed part
        with torch.random.fork_rng(devices=[]):
            for index in range(count):
                layer, _ = module.measured_layer(index, where)
                params = [p for p in layer.parameters() if p.requires_grad] \
                    if isinstance(layer, torch.nn.Module) else []
                if params:
                    values[index] = timed(params)
                    if len(kept) < 2:
                        kept.append([p.detach().clone().requires_grad_() for p in params])
                del layer
        if len(kept) == 2:  # at most the cheaper step (a noisy pair cannot make it more)
            pair = timed(kept[0] + kept[1])
            single = [timed(k) for k in kept]
            values[count] = min(max(sum(single) - pair, 0.0), min(single))
    if transport is not None and getattr(transport, "world_size", 1) > 1:
        moved = values.to(transport.device)
        transport.broadcast(moved, 0)
        values = moved.cpu()
    out = [float(v) for v in values.tolist()]
    return out[:count], out[count]


def measure_link(transport: Any, nbytes: float, *, repeats: int = 10, warmup: int = 2,
                 clock: Callable[[], float] | None = None) -> Link:
    """Time one-way transfers between ranks 0 and 1 of ``transport``; every rank gets the same.

    A ping-pong of a 64-byte message and of one of ``nbytes`` (at least 64 KiB) gives the
    cost per message and per byte (half a round trip each, median of ``repeats`` after
    ``warmup``); rank 0 broadcasts them. Collective: every rank calls it at the same point.
    """
    import time

    import torch

    from pipekernel.comm.transport import P2POp

    now = clock or time.perf_counter
    device = transport.device
    cuda = getattr(device, "type", str(device)) == "cuda"
    now = device_clock(device, now)
    sizes = (64, max(int(nbytes), 1 << 16))
    one_way = []
    if transport.rank in (0, 1):
        peer = 1 - transport.rank
        for size in sizes:
            buf = torch.zeros(size, dtype=torch.uint8, device=device)
            times = []
            for _ in range(warmup + repeats):
                start = now()
                for op in (("send", "recv") if transport.rank == 0 else ("recv", "send")):
                    for handle in transport.batch_isend_irecv([P2POp(op, buf, peer)]):
                        handle.wait()
                times.append((now() - start) / 2)
            one_way.append(sorted(times[warmup:])[repeats // 2])
    result = torch.zeros(2, dtype=torch.float64, device=device)
    if transport.rank == 0:
        byte_s = max(one_way[1] - one_way[0], 0.0) / (sizes[1] - sizes[0])
        result[0], result[1] = max(one_way[0] - byte_s * sizes[0], 0.0), byte_s
    transport.broadcast(result, 0)
    message_s, byte_s = (float(v) for v in result.cpu().tolist())
    return Link(message_s, byte_s, on_host=not cuda)


def _layer_costs(context: Any) -> LayerCosts:
    total = context.layer_costs
    if total is None or context.layer_static_bytes is None:
        raise ConfigError("the partition plugin returned no measured layer costs for "
                          "pk.profile", hint="the built-in partition plugin measures them; "
                                             "a plugin replacing it must set them too")
    forward = context.layer_forward_seconds or [t / 3 for t in total]  # B ~ 2F if unknown
    act = context.layer_activation_bytes or [0.0] * len(total)
    split = getattr(context, "layer_split_backward_seconds", None)
    outputs = getattr(context, "layer_output_bytes", None)
    states = getattr(context, "layer_weight_state_bytes", None)
    return LayerCosts([float(f) for f in forward],
                      [max(float(t) - float(f), 0.0) for t, f in zip(total, forward)],
                      [float(s) for s in context.layer_static_bytes], [float(a) for a in act],
                      [(float(i), float(w)) for i, w in split] if split else None,
                      [float(b) for b in outputs] if outputs else None,
                      weight_state_bytes=[float(b) for b in states] if states else None)


def _rows(sample: Any) -> int:
    import torch

    if isinstance(sample, torch.Tensor):
        return sample.shape[0] if sample.dim() else 1
    items = sample.values() if isinstance(sample, dict) else \
        sample if isinstance(sample, (tuple, list)) else ()
    for item in items:
        if isinstance(item, torch.Tensor) and item.dim():
            return item.shape[0]
    raise ConfigError("schedule='auto': the sample holds no tensor with a batch dimension",
                      hint="give one micro-batch of inputs (a tensor, or a tuple or dict of "
                           "tensors)")


def _resize(sample: Any, rows: int) -> Any:
    """``sample`` with ``rows`` rows along dim 0 (repeated, then cut)."""
    import torch

    if isinstance(sample, torch.Tensor) and sample.dim():
        reps = -(-rows // sample.shape[0])
        return sample.repeat(reps, *([1] * (sample.dim() - 1)))[:rows]
    if isinstance(sample, (tuple, list)):
        return type(sample)(_resize(s, rows) for s in sample)
    if isinstance(sample, dict):
        return {key: _resize(value, rows) for key, value in sample.items()}
    return sample
