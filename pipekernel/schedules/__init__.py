"""Schedules and the schedule simulator (layer 0: pure Python, no torch).

Public names: :class:`Schedule` (the contract), the built-in schedules
:class:`OneFOneB`, :class:`GPipe`, :class:`Inference`, the registry
``BUILTIN_SCHEDULES`` (name -> class), and :func:`simulate`,
:class:`SimulationResult`, :func:`format_grid`.
"""
from __future__ import annotations

from pipekernel.schedules.base import Schedule
from pipekernel.schedules.pipeline import GPipe, Inference, OneFOneB
from pipekernel.schedules.simulator import SimulationResult, format_grid, simulate

__all__ = ["Schedule", "OneFOneB", "GPipe", "Inference", "simulate", "SimulationResult",
           "format_grid", "BUILTIN_SCHEDULES"]

#: The schedules that ship with pipekernel, by registered name.
BUILTIN_SCHEDULES: dict[str, type[Schedule]] = {
    OneFOneB.name: OneFOneB, GPipe.name: GPipe, Inference.name: Inference,
}
