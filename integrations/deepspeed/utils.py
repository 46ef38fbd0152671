"""``deepspeed.utils`` names scripts import: :class:`RepeatingLoader`, :func:`log_dist`,
``logger`` (DeepSpeed's: the logger named ``"DeepSpeed"``)."""
from __future__ import annotations

import logging

import torch

from .data import RepeatingLoader

__all__ = ["RepeatingLoader", "log_dist", "logger"]

logger = logging.getLogger("DeepSpeed")


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``"[Rank R] message"`` on the ranks in ``ranks`` (``[-1]``: every rank; every
    process when ``torch.distributed`` has not started), as DeepSpeed's ``log_dist``."""
    started = torch.distributed.is_available() and torch.distributed.is_initialized()
    rank = torch.distributed.get_rank() if started else -1
    ranks = ranks or []
    if not started or (ranks and (ranks[0] == -1 or rank in set(ranks))):
        logger.log(level, f"[Rank {rank}] {message}")
