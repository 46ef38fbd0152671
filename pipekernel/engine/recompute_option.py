"""The engine's ``recompute`` option: activation recomputation chosen per stage.

``PipelineEngine(recompute=...)`` says, for each stage, every how many layers a forward
keeps only its input and recomputes the rest in backward (non-reentrant checkpointing,
:mod:`pipekernel.model.recompute`): ``0`` keeps every activation, ``1`` recomputes every
layer from its own input, ``n`` every run of ``n`` layers from the run's input. A stage's
interval applies to every chunk it holds.

What wins, first to last: the engine's ``recompute`` (an int for every stage, or one per
stage); ``schedule=pk.auto(memory_budget=...)``'s choice (it searches recomputation per
stage when the engine's ``recompute`` is not given); the module's
``activation_checkpoint_interval`` on every stage (the default: one mechanism, not two).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipekernel.errors import ConfigError

__all__ = ["resolve_recompute", "format_recompute"]

_NAMED = {"none": 0, "off": 0, "all": 1, "every": 1, "every-layer": 1}


def resolve_recompute(recompute: Any, num_stages: int, default: int) -> tuple[int, ...]:
    """Per stage, its checkpoint interval (``0``: none).

    :param recompute: ``None`` (the module's ``default`` on every stage), an int ``>= 0``
        or ``"none"``/``"all"`` for every stage, or a sequence of them, one per stage.
    :raises ConfigError: anything else, or a sequence of the wrong length.
    """
    if recompute is None:
        return (default,) * num_stages
    if isinstance(recompute, (str, int)) and not isinstance(recompute, bool):
        return (_one(recompute, "recompute"),) * num_stages
    if isinstance(recompute, Sequence):
        if len(recompute) != num_stages:
            raise ConfigError(f"recompute={list(recompute)!r} gives {len(recompute)} "
                              f"stage(s); the pipeline has {num_stages}",
                              hint=f"give one interval per stage ({num_stages} entries; 0: "
                                   "keep every activation, 1: recompute every layer), or "
                                   "one int for every stage")
        return tuple(_one(v, f"recompute[{s}]") for s, v in enumerate(recompute))
    raise ConfigError(f"recompute must be None, an int >= 0, 'none', 'all' or one per "
                      f"stage, got {recompute!r}",
                      hint="e.g. recompute=1 (every layer on every stage) or recompute="
                           "[1, 0] (stage 0 only)")


def _one(value: Any, where: str) -> int:
    if isinstance(value, str) and value.strip().lower() in _NAMED:
        return _NAMED[value.strip().lower()]
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise ConfigError(f"{where} must be an int >= 0 (the checkpoint interval in layers; 0: "
                      f"none), 'none' or 'all', got {value!r}",
                      hint="0 keeps every activation, 1 recomputes every layer, n every run "
                           "of n layers")


def format_recompute(intervals: Sequence[int]) -> str:
    """``"stage 0: every 1 layer(s), stage 1: none"`` (``"none"`` when no stage recomputes)."""
    if not any(intervals):
        return "none"
    return ", ".join(f"stage {s}: " + (f"every {k} layer(s)" if k else "none")
                     for s, k in enumerate(intervals))
