"""Where the model's parts live: the one place that maps pipeline positions to ranks
(layer 0: no torch).

A schedule with ``chunks = v`` splits the layers into ``num_stages * v`` *parts*
(pipeline positions ``0 .. num_stages * v - 1``); activations flow from position
``p`` to ``p + 1`` and gradients from ``p`` to ``p - 1``. Each rank (stage) holds
``v`` parts, its chunks ``0 .. v - 1``. The schedule's ``placement`` says which:

* ``"loop"`` (interleaved 1F1B, Narayanan et al. 2021): chunk ``c`` of stage ``s``
  is position ``c * num_stages + s`` — stage ``s`` holds ``s, s + S, s + 2S, ...``.
* ``"v"`` (ZB-V, DualPipeV; two chunks): chunk 0 of stage ``s`` is position ``s``,
  chunk 1 is ``2 * num_stages - 1 - s``, so the first and the last part live on
  stage 0 and the turn of the V (positions ``S - 1`` and ``S``) on the last stage.

The partitioner builds parts in position order, the runtime builds the parts of
its stage with :func:`parts_of`, and the simulator and the communication plan
find peers with :func:`peer`; none of them computes positions another way.
"""
from __future__ import annotations

from pipekernel.errors import ConfigError

__all__ = ["PLACEMENTS", "position", "locate", "parts_of", "peer", "check_placement"]

#: Placement names every layer understands.
PLACEMENTS = ("loop", "v")


def check_placement(placement: str, chunks: int) -> None:
    """Raise ``ConfigError`` if ``placement`` cannot hold ``chunks`` chunks per stage."""
    if placement not in PLACEMENTS:
        raise ConfigError(f"unknown placement {placement!r}",
                          hint=f"a schedule's placement is one of {', '.join(PLACEMENTS)}")
    if placement == "v" and chunks != 2:
        raise ConfigError(f"placement 'v' holds exactly 2 chunks per stage, got chunks={chunks}",
                          hint="use chunks=2 with V-shaped schedules (zbv, dualpipev)")


def position(stage: int, chunk: int, num_stages: int, placement: str = "loop") -> int:
    """The pipeline position of ``chunk`` on ``stage``."""
    if placement == "v":
        return stage if chunk == 0 else 2 * num_stages - 1 - stage
    return chunk * num_stages + stage


def locate(pos: int, num_stages: int, placement: str = "loop") -> tuple[int, int]:
    """``(stage, chunk)`` holding pipeline position ``pos`` (inverse of :func:`position`)."""
    if placement == "v":
        return (pos, 0) if pos < num_stages else (2 * num_stages - 1 - pos, 1)
    return pos % num_stages, pos // num_stages


def parts_of(stage: int, num_stages: int, chunks: int, placement: str = "loop") -> list[int]:
    """Positions held by ``stage``, by chunk: ``parts_of(s, ...)[c] == position(s, c, ...)``."""
    return [position(stage, c, num_stages, placement) for c in range(chunks)]


def peer(stage: int, chunk: int, delta: int, num_stages: int, chunks: int,
         placement: str = "loop") -> tuple[int, int] | None:
    """``(stage, chunk)`` of position ``position(stage, chunk) + delta``, or ``None`` past
    either end of the pipeline. ``delta`` is ``+1`` for activations, ``-1`` for gradients."""
    pos = position(stage, chunk, num_stages, placement) + delta
    if not 0 <= pos < num_stages * chunks:
        return None
    return locate(pos, num_stages, placement)
