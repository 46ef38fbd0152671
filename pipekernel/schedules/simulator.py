"""Run every stage's schedule together, without a runtime (layer 0: no torch).

:func:`simulate` executes all stages' programs at once, event-driven — the
:class:`~pipekernel.schedules.program.Program` each stage's engine runs, lowered by the same
function (:func:`~pipekernel.schedules.program.lower`) — and proves that a schedule

* matches every send with a receive, with the same kind, micro-batch and chunk,
  and leaves no message unreceived;
* never deadlocks under NCCL's rules;
* forwards every micro-batch exactly once per (stage, chunk) and, when it
  trains, backwards it exactly once (``Backward``, or ``BackwardInput`` then
  ``BackwardWeight``) after its forward and, except at the last pipeline
  position, after its ``RecvGrad``;
* never overwrites a buffer that still holds a live micro-batch (until its
  backward when training; until its forward and send for inference).

Communication semantics, ``"rendezvous"`` (the only one: the strictest any transport has,
NCCL with one communicator per lane, and gloo for large messages — the contract in
:mod:`pipekernel.comm.transport`). Each stage runs its program's
:class:`~pipekernel.schedules.program.Program`'s posting plan, the one its runtime posts (or
the program the ``posting=`` hook makes, to check another policy):

* before ``stream[i]`` runs, the group ``posts[i]`` is posted (non-blocking); a
  receive instruction waits for its own transfer to complete; a send never
  blocks the poster's compute;
* matching is FIFO per ordered pair of stages and *lane* (``plan.lanes``, the
  transport tag of the transfer's channel, :mod:`pipekernel.schedules.lanes`),
  and tagless within a lane: the k-th send from A to B on a lane matches the
  k-th receive B posted from A on that lane, whatever it says. A plan without
  lanes puts all of a stage's traffic on one lane (a transport without tags).
  A pair that disagrees (kind, micro-batch, chunk) is reported with both
  instructions;
* a transfer completes only when both of its operations are *active*. A lane is
  **one ordered stream per rank, whatever the peer**: a group's operations on
  one lane form one *unit* (to any number of peers), and at a rank a unit becomes
  active only when every earlier unit of that rank on that lane has completed (a
  lane's operations complete in posting order; operations posted together
  progress together). Units on different lanes are independent;
* a local hand-off (``plan.local[i]``, a stage that is its own peer) completes
  at once; its receive needs the send to have run;
* ``ReduceTiedGrads`` and ``OptimizerStep`` are world collectives (every stage
  must enter them, in the same order), as is the implicit loss all-reduce that
  ends every batch (after the stage waited for its sends). ``ReduceGrads`` is
  a data-parallel collective: the replicas run the same stream, so it is a
  blocking point without a cross-stage dependency. A stage in a collective
  runs nothing further, but what it posted still progresses;
* timing: a transfer completes at ``max(post times, unit starts)`` plus the
  costs of its send and receive classes; compute starts when its inputs are
  there. A deadlock is reported with the stuck stages, what each waits for,
  and the wait-for *cycle* through units, peers and collectives.

Virtual stages: pipeline positions and peers come from the schedule's
``placement`` (:mod:`pipekernel.schedules.placement`).

Skip connections: with ``skips=[(producer, consumer), ...]`` (pipeline positions)
each stage's steps get the skip transfers the engine inserts
(:func:`~pipekernel.schedules.skips.add_skip_transfers`) and the plan gives each
edge its lanes; they are matched, posted and checked like the activations and
gradients (local hand-offs included). An edge whose consumer does not come after
its producer is rejected before simulating.

All problems are collected and raised as one :class:`ScheduleError`.

Cost: linear in the instructions of the plan (every stage's stream), with the cyclic
garbage collector off while it runs. With the programs' own plans (no ``posting=``), a plan
with nothing to report is proved and timed by a fast path
(:mod:`pipekernel.schedules.sim_fast`: each stage's stream checked on its own and compiled
once into the entries that move time); whenever it finds something to report, the full
simulation (:mod:`pipekernel.schedules.sim_rendezvous`) runs and reports it.
``benchmarks/planner_scale.py`` prints the growth,
``tests/test_simulator_scale.py`` proves it by counting executed lines, and
``tests/test_simulator_frozen.py`` holds the answers fixed.
"""
from __future__ import annotations

import gc
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager

from pipekernel.errors import ConfigError, ScheduleError
from pipekernel.schedules.instructions import ForwardBackward, Instruction
from pipekernel.schedules.placement import check_placement
from pipekernel.schedules.program import Program, lower
from pipekernel.schedules.sim_base import (COMPUTE, DEFAULT_COSTS, SEMANTICS, WORLD_COLLECTIVES,
                                           SimulationResult, format_grid)
from pipekernel.schedules.sim_fast import _Fast
from pipekernel.schedules.sim_rendezvous import _Rendezvous
from pipekernel.schedules.skips import check_skip_edges

__all__ = ["simulate", "SimulationResult", "format_grid", "COMPUTE", "DEFAULT_COSTS",
           "SEMANTICS", "WORLD_COLLECTIVES"]


def simulate(schedule: Callable[..., object], num_stages: int, micro_batches: int,
             chunks: int = 1, costs: Mapping[type, float] | None = None,
             semantics: str = "rendezvous",
             posting: Callable[..., Program] | None = None,
             stage_costs: Mapping[tuple[int, ...], Mapping[type, float]] | None = None,
             skips: Sequence[Sequence[int]] = (),
             host_costs: Mapping[type, float] | None = None,
             paired: bool | None = None, sharded: bool = False,
             data_parallel: bool = False) -> SimulationResult:
    """Simulate ``schedule`` on every stage of a pipeline and check it.

    :param schedule: a :class:`~pipekernel.schedules.base.Schedule` subclass, or
        any callable ``(num_stages, stage, micro_batches, chunks)`` returning an
        object with ``steps()`` (and optionally ``trains``, ``num_buffers()``).
        Without ``trains``, the schedule trains if it emits any backward. Its
        ``placement`` attribute (default ``"loop"``) places the chunks.
    :param costs: ``{instruction class: duration}`` overriding
        :data:`DEFAULT_COSTS` (compute 1, everything else 0). Under rendezvous,
        the costs of a send's and a receive's classes add up to the duration of
        their transfer and do not occupy either stage.
    :param stage_costs: ``{(stage, chunk): {instruction class: duration}}``: compute
        costs of one stage's chunk (e.g. measured, for a partition whose stages
        differ), overriding ``costs`` for the classes listed there; a key ``(stage,
        forward chunk, backward chunk)`` with ``{ForwardBackward: duration}`` prices
        that stage's pairs of those chunks, ahead of ``costs``.
    :param semantics: ``"rendezvous"``, the only one (see the module docstring; the
        lenient ``"buffered"`` model, which passed plans that hang on NCCL, is gone).
    :param posting: a function that makes each stage's
        :class:`~pipekernel.schedules.program.Program` from its program's steps, called like
        :func:`~pipekernel.schedules.program.plan_communication` — to check another posting
        policy. Default: each program as compiled, the one the runtime posts.
    :param skips: skip edges ``(producer position, consumer position)``
        (:mod:`pipekernel.schedules.skips`): each stage's steps get the skip
        transfers the engine inserts, and the plan their lanes, before simulating.
    :param host_costs: ``{send or receive class: seconds}`` the stage
        itself spends on a transfer to or from another stage (packing and posting a
        send, unpacking a receive once its data is there): unlike ``costs`` they
        occupy the stage, delaying what it runs next. Local hand-offs cost nothing.
    :param paired: whether a ``ForwardBackward`` step runs as one overlapped pair (what
        the engine runs when the model supplies ``overlapped_forward_backward``) or as
        its two steps, forward then backward
        (:func:`~pipekernel.schedules.ordered.unpaired_steps`: what the engine runs by
        default; for ``zbv``, its plan without pairs). ``None`` (default): paired exactly
        when ``costs`` or ``stage_costs`` price ``ForwardBackward`` (the overlap you
        model), so the default answer is the engine's default program.
    :param sharded: the programs of FSDP2-sharded stages (:mod:`~pipekernel.schedules.sharded`);
        :param data_parallel: of replicated stages overlapping their gradient reduction
        (:mod:`~pipekernel.schedules.data_parallel`); their instructions priced by ``costs``.
    :raises ConfigError: for invalid sizes, costs, semantics or placement.
    :raises ScheduleError: for a skip edge whose consumer does not come after its
        producer (or outside the pipeline); then listing every problem found
        (mismatched sends and receives, deadlock with the stuck stages, the cycle and
        the grid so far, missing or repeated forwards/backwards, overwritten live buffers).
    """
    _check_sizes(num_stages, micro_batches, chunks)
    _check_semantics(semantics)
    paired = _priced_pairs(costs, stage_costs) if paired is None else paired
    return _checked(schedule, num_stages, micro_batches, chunks, costs, posting,
                    stage_costs, skips, host_costs, paired, sharded, data_parallel)


def _checked(schedule, num_stages, micro_batches, chunks, costs, posting,
             stage_costs, skips, host_costs, paired=False, sharded=False,
             data_parallel=False) -> SimulationResult:
    """:func:`simulate` once its arguments are checked: the programs (:func:`_programs`),
    then the simulation, with the collector off throughout. The schedule objects are made and
    dropped inside it: what they cache (their built steps) is garbage once the programs are
    made, freed as the simulation returns rather than scanned by the collector the moment it
    is back on."""
    # a sequence-chunked schedule (Seq1F1B) numbers its units, m * k of them, as micro-batches
    units = micro_batches * getattr(schedule, "seq_chunks", 1)
    with _no_cyclic_gc():
        return _simulate(schedule,
                         *_programs(schedule, num_stages, micro_batches, chunks, skips, paired,
                                    sharded, data_parallel),
                         costs, posting, stage_costs, host_costs,
                         (num_stages, units, chunks))


def _programs(schedule, num_stages, micro_batches, chunks, skips, paired,
              sharded, data_parallel=False
              ) -> tuple[tuple[Program, ...], str, list[tuple[int, int]]]:
    """``(programs, placement, edges)``: each stage's
    :class:`~pipekernel.schedules.program.Program`, lowered as the engine lowers it
    (:func:`~pipekernel.schedules.program.lower`, unpaired and with the skip transfers as
    asked), the placement and the checked skip edges."""
    objects = [schedule(num_stages, s, micro_batches, chunks) for s in range(num_stages)]
    placement = getattr(schedule, "placement", "") or getattr(objects[0], "placement", "loop")
    check_placement(placement, chunks)
    edges = check_skip_edges(skips, num_stages * chunks)
    programs = tuple(lower(obj, stage=s, num_stages=num_stages, micro_batches=micro_batches,
                           chunks=chunks, placement=placement, skips=edges, paired=paired,
                           sharded=sharded, data_parallel=data_parallel)
                     for s, obj in enumerate(objects))
    return programs, placement, edges


def _priced_pairs(costs, stage_costs) -> bool:
    """Whether the costs price ``ForwardBackward`` (the overlap a paired executor buys)."""
    return ForwardBackward in (costs or {}) or any(
        ForwardBackward in table for table in (stage_costs or {}).values())


@contextmanager
def _no_cyclic_gc():
    """The cyclic garbage collector off while a simulation runs: it builds hundreds of
    thousands of objects that all stay alive until it ends (ops, units, timelines), which
    the collector would scan again and again — time that grows faster than the plan.
    The collector's state is restored after; the few cycles (an op and its mate) are then
    collected as usual."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _simulate(schedule, programs, placement, edges, costs, posting, stage_costs, host_costs,
              sizes) -> SimulationResult:
    """The fast path (:mod:`~pipekernel.schedules.sim_fast`) for the programs' own plans, the
    full simulation when it has something to report (or for another posting policy)."""
    num_stages, micro_batches, chunks = sizes
    table = _cost_table(costs)
    tables: dict[str, dict] = {}  # simulate's keyword -> its cost table(s)
    if stage_costs:
        tables["stage_costs"] = {key: _cost_table(t, base={}) for key, t in stage_costs.items()}
    if host_costs:
        tables["host_costs"] = _cost_table(host_costs, base={})
    if posting is None:
        fast = _Fast(num_stages, micro_batches, chunks, table, programs, placement)
        fast.skips = edges
        fast.__dict__.update(tables)
        result = fast.prove()
        if result is not None:
            return result
    sim = _Rendezvous(num_stages, micro_batches, chunks, table, programs, placement)
    sim.skips = edges
    sim.posting = posting
    sim.__dict__.update(tables)
    sim.run()
    if sim.problems:
        raise _error(schedule, num_stages, micro_batches, chunks, sim.problems)
    return sim.result()


def _check_semantics(semantics: str) -> None:
    if semantics not in SEMANTICS:
        raise ConfigError(f"simulate: unknown semantics {semantics!r}",
                          hint=f"use {SEMANTICS[0]!r} (the default): the lenient 'buffered' "
                               "model is gone, it passed plans that hang on NCCL")


def _check_sizes(num_stages: int, micro_batches: int, chunks: int) -> None:
    for what, value in (("num_stages", num_stages), ("micro_batches", micro_batches),
                        ("chunks", chunks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"simulate: {what} must be an int >= 1, got {value!r}",
                              hint=f"pass {what}=1 or more")


def _cost_table(costs: Mapping[type, float] | None,
                base: Mapping[type, float] = DEFAULT_COSTS) -> dict[type, float]:
    table = dict(base)
    for cls, cost in (costs or {}).items():
        if not (isinstance(cls, type) and issubclass(cls, Instruction)):
            raise ConfigError(f"simulate: cost key {cls!r} is not an instruction class",
                              hint="key costs by class, e.g. {Forward: 1.0, Backward: 2.0}")
        if not isinstance(cost, (int, float)) or cost < 0:
            raise ConfigError(f"simulate: cost of {cls.__name__} must be a number >= 0, "
                              f"got {cost!r}", hint="use non-negative durations")
        table[cls] = float(cost)
    return table


def _error(schedule, num_stages, micro_batches, chunks, problems) -> ScheduleError:
    name = getattr(schedule, "name", "") or getattr(schedule, "__name__", repr(schedule))
    lines = "\n".join(f"  - {p}" for p in problems)
    hint = ("fix the schedule's steps(); every send needs a matching receive in the same "
            "order, and a buffer may be reused only after its micro-batch is done; a send "
            "completes only when its receive is posted and every operation its stage and the "
            "receiver's posted earlier on the same lane (to any peer) has completed")
    return ScheduleError(
        f"schedule {name!r} is invalid for {num_stages} stage(s) x {micro_batches} "
        f"micro-batch(es) x {chunks} chunk(s) (rendezvous sends): {len(problems)} "
        f"problem(s):\n{lines}", hint=hint)
