"""The engine's programs, one per (schedule, micro-batch count): compiled once
(:mod:`pipekernel.schedules.program`) and kept, with what this engine's kernel (a handler per
index) and runtime (:meth:`~pipekernel.stage.runtime.StageRuntime.bind`) resolved of them,
in the engine's one cache (``engine._programs``), and the checks a new count passes first.
The functions read the engine's documented attributes and its ``state``."""
from __future__ import annotations

from typing import Any

from pipekernel.comm.agreement import check_consistency
from pipekernel.errors import positive_int
from pipekernel.schedules.program import Program, compile_program
from pipekernel.model.skip_routing import check_schedules

__all__ = ["check_micro_batch_count", "check_micro_batches", "agree_micro_batches",
           "program_of", "load_program"]


def check_micro_batch_count(micro_batches: Any, rank: int | None,
                            stage: int | None = None) -> None:
    """``ConfigError`` unless ``micro_batches`` is a positive int."""
    positive_int("micro_batches", micro_batches, rank=rank, stage=stage,
                 hint="pass micro_batches=N, the number of micro-batches each train_batch/"
                      "eval_batch reads from its iterator (e.g. 4; at least the number of "
                      "stages keeps every stage busy)")


def check_micro_batches(engine: Any, micro_batches: Any) -> None:
    """Refuse a count that is not a positive int or that a schedule refuses; prove the skip
    routing for a new count (once per count)."""
    check_micro_batch_count(micro_batches, engine.rank, engine.stage)
    for cls in (engine.schedule_cls, engine.eval_schedule_cls):  # their own clear errors
        cls(engine.num_stages, engine.stage, micro_batches, engine.chunks)
    if engine.skip_edges and micro_batches not in engine.state.skips_proven:
        # the skips' routing proven for the new count too (once per count)
        check_schedules([engine.schedule_cls, engine.eval_schedule_cls], engine.num_stages,
                        micro_batches, engine.chunks, engine.skip_edges)
        engine.state.skips_proven.add(micro_batches)


def agree_micro_batches(engine: Any) -> None:
    """When the count changed since the last batch, check that every rank changed it."""
    if engine.micro_batches == engine.state.checked_micro_batches:
        return
    check_consistency(engine.transport, {"micro_batches": engine.micro_batches},
                      "micro-batch count (set_micro_batches(n) or train_batch(..., "
                      "micro_batches=n) must change it on every rank for the same batch)")
    engine.state.checked_micro_batches = engine.micro_batches


def program_of(engine: Any, cls: Any) -> tuple[Program, Any, Any]:
    """``(program, handlers, bound)`` of schedule ``cls`` for the current micro-batch count
    (compiled and loaded once per schedule and count; :func:`load_program`)."""
    key = (cls, engine.micro_batches)
    loaded = engine._programs.get(key)
    if loaded is None:
        # every stage's program: where a send may be waited depends on when its peer posts
        # the receive (:func:`~pipekernel.schedules.send_release.release_points`)
        programs = tuple(compile_program(
            cls, stage=stage, num_stages=engine.num_stages,
            micro_batches=engine.micro_batches, chunks=engine.chunks,
            placement=engine.placement, skips=engine.skip_edges, paired=engine.runtime.pairs,
            sharded=engine.stage_parallel is not None,
            data_parallel=overlaps_reduction(engine.grad_reducer))
            for stage in range(engine.num_stages))
        loaded = engine._programs[key] = load_program(engine, programs[engine.stage], programs)
    return loaded


def overlaps_reduction(reducer: Any) -> bool:
    """Whether the data-parallel ``reducer`` (``None``: none) overlaps the backward, so the
    programs hold its arm and launch points (:mod:`pipekernel.schedules.data_parallel`)."""
    return reducer is not None and reducer.bucket_bytes > 0


def load_program(engine: Any, program: Program,
                 programs: tuple[Program, ...] = ()) -> tuple[Program, Any, Any]:
    """``(program, handlers, bound)``: ``program`` with the kernel's handler of each
    instruction (``None`` when one has none: the loop reports it there) and the runtime's
    binding (its channels and groups, and where its sends are waited: ``programs``, every
    stage's program of the same pipeline; ``()``: sends are waited at the step's end,
    activations' when their gradient arrives)."""
    return (program, engine.kernel.resolve(program.stream),
            engine.runtime.bind(program, programs))
