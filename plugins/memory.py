"""Exact memory accounting by category, per step: ``plugins=[MemoryMeter()]``.

Each stage's parameters, gradients, optimizer state, activations saved for backward and
the runtime's own buffers (see :mod:`pipekernel.stage.memory`), sampled before and after
every instruction; the peak of their sum during the step, with each category's bytes at
that peak, lands in ``train_batch``'s metrics (``memory_peak_bytes``,
``memory_params_bytes``, ``memory_grads_bytes``, ``memory_optimizer_bytes``,
``memory_saved_bytes``, ``memory_buffers_bytes``) and so in the monitor's records.

Opt-in, not on by default: a saved-tensor hook is a Python call per tensor autograd saves
and a sample walks the stage's parameters and buffers twice per instruction, which a
step with many small instructions notices; ``benchmarks/memory_table.py`` shows the
numbers. Byte counts are exact and device independent (storages, not an allocator's
rounding); on CUDA the monitor's ``peak_memory_mb`` is the allocator's figure beside them.
Every schedule is measured, the split backward's (zero-bubble, V) included: the ledger's
pack hook hands autograd a detached alias, so the input pass's retained graph holds no
reference cycle (see :meth:`~pipekernel.stage.memory.MemoryLedger.start`).
"""
from __future__ import annotations

from typing import Any, Mapping

from pipekernel.plugin import EngineView, MemoryLedger, hookimpl

__all__ = ["MemoryMeter"]


class MemoryMeter:
    """Measures each step's memory by category (see the module docstring).

    After a step, ``last`` holds the metrics it added (``{}`` before the first) and
    ``ledger`` the :class:`~pipekernel.stage.memory.MemoryLedger` (``ledger.now()``: the
    bytes held at this moment).
    """

    def __init__(self) -> None:
        self.ledger: MemoryLedger | None = None
        self.last: dict[str, int] = {}
        self._on = False

    @hookimpl
    def pipekernel_configure(self, engine: EngineView) -> None:
        module = engine.module
        self.ledger = MemoryLedger(module.parameters, lambda: engine.optimizer,
                                   engine.runtime.held_tensors)

    @hookimpl
    def pipekernel_before_train_batch(self, engine: EngineView) -> None:
        if self.ledger is not None:
            self.ledger.start()
            self.ledger.sample()
            self._on = True

    @hookimpl
    def pipekernel_before_instruction(self, instruction: Any) -> None:
        if self._on:
            self.ledger.sample()  # type: ignore[union-attr]

    @hookimpl
    def pipekernel_after_instruction(self, instruction: Any, seconds: float) -> None:
        if self._on:
            self.ledger.sample()  # type: ignore[union-attr]

    @hookimpl(tryfirst=True)  # before the monitor reads the metrics
    def pipekernel_after_train_batch(self, engine: EngineView, loss: Any,
                                     metrics: Mapping) -> None:
        if not self._on:
            return
        self._on = False
        ledger = self.ledger
        ledger.sample()  # type: ignore[union-attr]
        ledger.stop()  # type: ignore[union-attr]
        self.last = ledger.metrics()  # type: ignore[union-attr]
        if isinstance(metrics, dict):
            metrics.update(self.last)

    @hookimpl
    def pipekernel_unconfigure(self, engine: EngineView) -> None:
        if self.ledger is not None:
            self.ledger.stop()
            self._on = False
