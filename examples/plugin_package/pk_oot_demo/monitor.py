"""The ``oot_monitor`` plugin: sees every instruction and every finished batch."""
from __future__ import annotations

import logging

import pipekernel as pk

log = logging.getLogger("pk_oot_demo")


class InstructionMonitor:
    """The entry point names the class, so every engine gets its own instance."""

    def __init__(self):
        self.seen: list[str] = []
        self.seconds = 0.0
        self.batches = 0

    @pk.hookimpl
    def pipekernel_after_instruction(self, instruction, stage, seconds):
        self.seen.append(str(instruction))
        self.seconds += seconds

    @pk.hookimpl
    def pipekernel_after_train_batch(self, engine, loss, metrics):
        self.batches += 1
        if engine.rank == 0:
            log.info("step %d: loss %.4f, %d instructions, %.3fs in handlers",
                     metrics["step"], loss.item(), len(self.seen), self.seconds)
