"""A program loaded into one engine (layer 1: no torch).

:class:`LoadedProgram` is a :class:`~pipekernel.schedules.program.Program` with what one
engine's kernel and stage runtime need at each stream index resolved: the handler of
each instruction, the runtime's channel of each remote transfer and the groups it posts,
the parameters settled before the stage's last backward. The engine builds one per
(schedule, micro-batch count) and keeps it — the one cache; the kernel and the runtime
only read it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipekernel.schedules.instructions import Instruction
from pipekernel.schedules.program import Program

__all__ = ["LoadedProgram"]


@dataclass(frozen=True)
class LoadedProgram:
    """``program`` bound to one engine's kernel and runtime.

    * ``handlers[i]``: the kernel's handler of ``program.stream[i]`` (``None`` when an
      instruction has none: the loop then reports it at that instruction);
    * ``channels[i]``: the runtime's channel of the remote transfer ``stream[i]``, else
      ``None``; ``groups[i]``: what the runtime posts right before ``stream[i]`` (its own
      records, one per index of ``program.posts[i]``);
    * ``settled``: the parameters whose gradients are final before the stage's last
      weight-gradient instruction (``program.last_weight``), for the reducer to start on.
    """

    program: Program
    handlers: tuple[Callable[[Instruction], Any], ...] | None
    channels: tuple[Any, ...]
    groups: tuple[tuple[Any, ...], ...]
    settled: tuple[Any, ...] = ()

    @property
    def stream(self) -> tuple[Instruction, ...]:
        return self.program.stream

    @property
    def step_of(self) -> tuple[int, ...]:
        return self.program.step_of

    @property
    def last_weight(self) -> int:
        return self.program.last_weight
