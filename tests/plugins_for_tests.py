"""Plugins used by several tests (module level, so spawned workers can unpickle them)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pipekernel as pk
from pipekernel.step.precision import Precision
from pipekernel.schedules.instructions import Instruction, OptimizerStep
from pipekernel.schedules import OneFOneB


class Recorder:
    """Records every instruction, its timing and every finished batch."""

    def __init__(self, name: str = "recorder") -> None:
        self.name = name
        self.before: list[tuple[str, int]] = []
        self.after: list[tuple[str, int, float]] = []
        self.batches: list[tuple[float, dict]] = []

    @pk.hookimpl
    def pipekernel_before_instruction(self, instruction, stage):
        self.before.append((str(instruction), stage))

    @pk.hookimpl
    def pipekernel_after_instruction(self, instruction, stage, seconds):
        self.after.append((str(instruction), stage, seconds))

    @pk.hookimpl
    def pipekernel_after_train_batch(self, engine, loss, metrics):
        self.batches.append((loss.item(), {**metrics, "stage": engine.stage}))

    def state(self) -> dict:
        return {"before": self.before, "after": self.after, "batches": self.batches}


@dataclass(frozen=True, slots=True)
class ScaleGrads(Instruction):
    """A new instruction type: multiply this stage's gradients by ``factor``."""

    factor: float = 0.5
    short: ClassVar[str] = "SCALE"


class ScaledOneFOneB(OneFOneB):
    """1F1B that scales the gradients right before the optimizer step."""

    name = "1f1b-scaled"

    def steps(self):
        steps = super().steps()
        last = steps[-1]
        last.insert(next(i for i, x in enumerate(last) if isinstance(x, OptimizerStep)),
                    ScaleGrads(0.5))
        return steps


class ScaledGradsPlugin:
    """Adds the ``ScaleGrads`` instruction (with its handler) and the ``1f1b-scaled`` schedule."""

    name = "scaled-grads"

    @pk.hookimpl
    def pipekernel_register_schedules(self):
        return {ScaledOneFOneB.name: ScaledOneFOneB}

    @pk.hookimpl
    def pipekernel_register_instructions(self, runtime):
        def scale(instruction: ScaleGrads) -> None:
            for p in runtime.module.parameters():
                if p.grad is not None:
                    p.grad.mul_(instruction.factor)
        return {ScaleGrads: scale}


def flat(steps) -> list[str]:
    return [str(i) for step in steps for i in step]


class OverriddenFP32(Precision):
    """What :class:`FP32Override` returns: recognisable by its type."""


class FP32Override:
    """Stands in for an installed plugin that replaces the built-in ``fp32`` policy."""

    @pk.hookimpl
    def pipekernel_make_precision(self, name, options):
        return OverriddenFP32() if name == "fp32" else None
