"""Layer 0: the simulator's work grows linearly in the instructions it proves (issue 29, item 7:
planning at the scale users grow into). No wall clock: the work is the number of Python lines
the simulator executes (``sys.settrace`` line events, deterministic), counted for a plan and
for one with twice the micro-batches, and for one with twice the stages; the grid printer is
counted the same way. Also: the cyclic collector (whose scans of the live simulation grew
faster than the plan) is off during a simulation and restored after."""
from __future__ import annotations

import gc
import sys

import pytest

from pipekernel.schedules.instructions import ForwardBackward

from pipekernel.schedules import BUILTIN_SCHEDULES, format_grid, simulate


def _lines(fn, *args, **kwargs) -> tuple[int, object]:
    """How many lines ``fn(*args, **kwargs)`` executes (every frame it enters)."""
    count = 0

    def trace(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return trace

    sys.settrace(trace)
    try:
        out = fn(*args, **kwargs)
    finally:
        sys.settrace(None)
    return count, out


def _instructions(result) -> int:
    """Instructions simulated, a ``ForwardBackward`` as its two halves (it runs as both)."""
    return sum(len(step) + sum(isinstance(i, ForwardBackward) for i in step)
               for steps in result.steps for step in steps)


def _work(cls, stages: int, micro_batches: int) -> tuple[int, int]:
    chunks = cls.default_chunks
    simulate(cls, stages, micro_batches, chunks)  # warm the caches (lane map, zbv's plan)
    lines, result = _lines(simulate, cls, stages, micro_batches, chunks)
    return lines, _instructions(result)


@pytest.mark.parametrize("name", ["1f1b", "interleaved", "zbv", "dualpipev", "zb-h1"])
def test_work_per_instruction_does_not_grow_with_the_plan(name):
    cls = BUILTIN_SCHEDULES[name]
    base, n0 = _work(cls, 8, 32)
    for stages, micro_batches in ((8, 64), (16, 32)):
        lines, n = _work(cls, stages, micro_batches)
        assert 1.8 <= n / n0 <= 2.2  # twice the instructions (near enough)
        growth = (lines / base) / (n / n0)
        assert growth <= 1.15, (f"{name} {stages}x{micro_batches}: {lines} lines for {n} "
                                f"instructions, {base} for {n0} at 8x32")


def test_the_grid_is_linear_in_the_columns_it_prints():
    cls = BUILTIN_SCHEDULES["1f1b"]
    small, large = simulate(cls, 4, 50), simulate(cls, 4, 100)
    a, _ = _lines(format_grid, small)
    b, _ = _lines(format_grid, large)
    assert b / a <= 2.3


def test_the_cyclic_collector_is_off_during_a_simulation_and_restored_after():
    seen = []
    cls = BUILTIN_SCHEDULES["1f1b"]

    class Watching(cls):
        def steps(self):
            seen.append(gc.isenabled())
            return super().steps()

    assert gc.isenabled()
    simulate(Watching, 3, 4)
    assert seen == [False] * 3 and gc.isenabled()
    gc.disable()
    try:
        simulate(Watching, 3, 4)
        assert not gc.isenabled()  # a caller's choice is kept
    finally:
        gc.enable()
