"""The engine's mutable per-run state: one small object, everything else is the frozen
:class:`~pipekernel.engine.assembly.Assembly`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["RunState"]


@dataclass
class RunState:
    """What changes as an engine runs.

    :ivar micro_batches: the count the next batch runs (``set_micro_batches``).
    :ivar global_steps: optimizer steps run (skipped ones included).
    :ivar skipped_steps: of which the precision or ``nonfinite="skip"`` skipped.
    :ivar trained_micro_batches: micro-batches each replica trained on so far.
    :ivar last_loss: the last ``train_batch``'s loss (0-dim tensor), or ``None``.
    :ivar last_grad_norm: the global gradient norm of the last step (when clipping).
    :ivar batches_run: batches (train or eval) started, for ``check_data_steps``.
    :ivar checked_micro_batches: the count every rank last agreed on.
    :ivar skips_proven: counts whose skip routing was simulated.
    :ivar failed: the error that ended the last batch (then ``close()`` does not
        communicate).
    :ivar unconfigured: ``pipekernel_unconfigure`` ran.
    """

    micro_batches: int
    global_steps: int = 0
    skipped_steps: int = 0
    trained_micro_batches: int = 0
    last_loss: Any = None
    last_grad_norm: float | None = None
    batches_run: int = 0
    checked_micro_batches: int = 0
    skips_proven: set[int] = field(default_factory=set)
    failed: BaseException | None = None
    unconfigured: bool = False
