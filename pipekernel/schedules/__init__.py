"""Schedules and the schedule simulator (layer 0: pure Python, no torch).

Public names: :class:`Schedule` (the contract), the built-in schedules
:class:`OneFOneB`, :class:`GPipe`, :class:`Inference`, :class:`Interleaved1F1B`
(``"interleaved"``), :class:`ZBH1` (``"zb-h1"``), :class:`ZBH2` (``"zb-h2"``), :class:`ZBV`
(``"zbv"``), :class:`DualPipeV` (``"dualpipev"``), :class:`VMin` (``"v-min"``) and
:class:`VHalf` (``"v-half"``), the registry
``BUILTIN_SCHEDULES`` (name -> class), and :func:`simulate`,
:class:`SimulationResult`, :func:`format_grid`.
"""
from __future__ import annotations

from pipekernel.schedules.base import Schedule
from pipekernel.schedules.controllable import VHalf, VMin
from pipekernel.schedules.dualpipe import DualPipeV
from pipekernel.schedules.interleaved import Interleaved1F1B
from pipekernel.schedules.pipeline import GPipe, Inference, OneFOneB
from pipekernel.schedules.simulator import SimulationResult, format_grid, simulate
from pipekernel.schedules.zero_bubble import ZBH1, ZBH2, ZBV

__all__ = ["Schedule", "OneFOneB", "GPipe", "Inference", "Interleaved1F1B", "ZBH1", "ZBH2",
           "ZBV", "DualPipeV", "VMin", "VHalf", "simulate", "SimulationResult", "format_grid",
           "BUILTIN_SCHEDULES"]

#: The schedules that ship with pipekernel, by registered name.
BUILTIN_SCHEDULES: dict[str, type[Schedule]] = {
    OneFOneB.name: OneFOneB, GPipe.name: GPipe, Inference.name: Inference,
    Interleaved1F1B.name: Interleaved1F1B, ZBH1.name: ZBH1, ZBH2.name: ZBH2, ZBV.name: ZBV,
    DualPipeV.name: DualPipeV, VMin.name: VMin, VHalf.name: VHalf,
}
