"""``steps_per_print`` and ``wall_clock_breakdown``: DeepSpeed's progress lines, printed by
global rank 0 every ``steps_per_print`` steps.

``steps: N loss: L iter time (s): T samples/sec: S`` is DeepSpeed's line (the mean time
per step since the last line; samples/s over ``train_batch_size``). With
``wall_clock_breakdown`` a second line gives the seconds this rank spent per instruction
kind since the last line (pipekernel's counterpart of DeepSpeed's send/recv timers: the
``pipekernel_after_instruction`` hook's measurements).
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import pipekernel as pk

__all__ = ["StepReport", "InstructionTimes"]


class InstructionTimes:
    """Seconds per instruction kind (registered only with ``wall_clock_breakdown``: the
    kernel skips the hook entirely when no plugin implements it)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @pk.hookimpl
    def pipekernel_after_instruction(self, instruction: Any, seconds: float) -> None:
        self.seconds[type(instruction).__name__] += seconds


class StepReport:
    """A pipekernel plugin printing DeepSpeed's step lines (see the module docstring).

    :param out: where lines go (default ``print``); tests pass a list's ``append``.
    """

    def __init__(self, steps_per_print: int | None, train_batch_size: int,
                 times: InstructionTimes | None = None, out: Any = print) -> None:
        self.every, self.batch, self.times, self.out = steps_per_print, train_batch_size, \
            times, out
        self.since = time.perf_counter()

    @pk.hookimpl
    def pipekernel_after_train_batch(self, engine: Any, loss: Any) -> None:
        if not self.every or engine.global_steps % self.every:
            return
        now = time.perf_counter()
        step_time, self.since = (now - self.since) / self.every, now
        if engine.rank == 0:
            self.out(f"steps: {engine.global_steps} loss: {float(loss):0.4f} "
                     f"iter time (s): {step_time:0.3f} "
                     f"samples/sec: {self.batch / max(step_time, 1e-12):0.3f}")
            if self.times is not None:
                self.out("time (s) per instruction: " + " | ".join(
                    f"{name}: {total:0.3f}" for name, total in sorted(self.times.seconds.items())))
        if self.times is not None:
            self.times.seconds.clear()
