"""Agreement across ranks: the one place where ranks exchange Python values and errors.

* :func:`broadcast_object` — one rank's picklable value on every rank;
* :func:`all_gather_objects` — every rank's value, by rank, on every rank;
* :func:`check_consistency` — raise on every rank if the ranks disagree on some fields
  (one small all-reduce when they agree);
* :func:`raise_on_every_rank` — after each rank tried something, raise on every rank if
  any failed (one small all-reduce when none did), with the lowest failing rank's error;
* :func:`compute_on_one` — compute a value on one rank and give it (or its error) to all.

All are collectives over a transport (``rank``, ``world_size``, ``device``,
``all_reduce``, ``broadcast``): every rank calls them in the same order.
"""
from __future__ import annotations

import hashlib
import json
import pickle
from collections.abc import Callable, Mapping
from typing import Any

import torch

from pipekernel.errors import ConfigError, PipelineError

__all__ = ["broadcast_object", "all_gather_objects", "check_consistency",
           "raise_on_every_rank", "compute_on_one"]


def _pickle_from(transport: Any, obj: Any, src: int, size: int) -> Any:
    """Broadcast ``size`` pickled bytes of ``obj`` from ``src``; the value on every rank."""
    device = transport.device
    if transport.rank == src:
        buf = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    else:
        buf = torch.empty(size, dtype=torch.uint8, device=device)
    transport.broadcast(buf, src)
    return obj if transport.rank == src else pickle.loads(buf.cpu().numpy().tobytes())


def broadcast_object(transport: Any, obj: Any, src: int) -> Any:
    """Rank ``src``'s picklable ``obj`` on every rank (two broadcasts: size, bytes)."""
    size = len(pickle.dumps(obj)) if transport.rank == src else 0
    sizes = torch.tensor([size], dtype=torch.int64, device=transport.device)
    transport.broadcast(sizes, src)
    return _pickle_from(transport, obj, src, int(sizes.item()))


def all_gather_objects(transport: Any, obj: Any) -> list[Any]:
    """Every rank's picklable ``obj``, by rank, on every rank (collectives only)."""
    rank, world = transport.rank, transport.world_size
    sizes = torch.zeros(world, dtype=torch.int64, device=transport.device)
    sizes[rank] = len(pickle.dumps(obj))
    transport.all_reduce(sizes)
    return [_pickle_from(transport, obj, src, size) for src, size in enumerate(sizes.tolist())]


def _digest(fields: Mapping[str, Any]) -> int:
    text = json.dumps(fields, sort_keys=True, default=repr)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def check_consistency(transport: Any, fields: Mapping[str, Any], what: str = "configuration"
                      ) -> None:
    """Raise ``ConfigError`` on every rank if ranks disagree on any of ``fields``.

    One all-reduce of ``[h, -h]`` with ``max`` (``h`` a 56-bit hash of the
    fields) tells whether all agree; only then the fields themselves are
    exchanged, to name what differs and where.
    """
    if transport.world_size == 1:
        return
    h = _digest(fields)
    both = torch.tensor([h, -h], dtype=torch.int64, device=transport.device)
    transport.all_reduce(both, "max")
    high, low = both.tolist()
    if high == h and -low == h:
        return
    every = all_gather_objects(transport, dict(fields))
    lines = []
    for key in sorted({k for f in every for k in f}):
        values: dict[str, list[int]] = {}
        for r, f in enumerate(every):
            values.setdefault(repr(f.get(key, "<missing>")), []).append(r)
        if len(values) > 1:
            lines.append(f"{key}: " + "; ".join(f"{v} on rank{'s' if len(rs) > 1 else ''} "
                                                 f"{', '.join(map(str, rs))}"
                                                 for v, rs in values.items()))
    raise ConfigError(f"the ranks disagree on their {what}:\n    " + "\n    ".join(lines),
                      hint="construct the engine with the same arguments (and the same "
                           "pipekernel version) on every rank",
                      rank=transport.rank)


def _portable(error: BaseException, rank: int, hint: str) -> PipelineError:
    """``error`` as a picklable :class:`PipelineError` located at ``rank`` (its text in a
    ``ConfigError`` when it is another error or does not pickle)."""
    if isinstance(error, PipelineError):
        error.locate(rank=rank)
        try:
            pickle.dumps(error)
            return error
        except Exception:  # noqa: BLE001 - an attribute that does not travel
            pass
    portable = ConfigError(f"{type(error).__name__}: {error}", hint=hint)
    portable.locate(rank=rank)
    return portable


def _raise_from(transport: Any, error: BaseException | None, first: int, failed: list[int],
                hint: str, keep_own: bool = False) -> None:
    """Raise on every rank: its own error where it has one (``keep_own``: as raised, else
    made portable), rank ``first``'s error elsewhere."""
    rank = transport.rank
    portable = _portable(error, rank, hint) if error is not None else None
    remote = broadcast_object(transport, portable if rank == first else None, first)
    if error is not None:
        raise (error if keep_own else portable)  # type: ignore[misc]
    others = f" (ranks {', '.join(map(str, failed))} failed)" if len(failed) > 1 else ""
    if isinstance(remote, PipelineError):
        remote.add_detail(f"raised on rank {first}, seen by rank {rank}{others}")
    raise remote


def raise_on_every_rank(transport: Any, error: BaseException | None, hint: str = "look at "
                        "the failing rank's traceback: every rank stopped with it") -> None:
    """Raise on every rank if any rank has ``error`` (the lowest failing rank's error, with
    its rank; a rank's own error where it has one); return normally when all succeeded.
    One all-reduce when all succeeded, two broadcasts more when not."""
    world = transport.world_size
    flags = torch.zeros(world, dtype=torch.float32, device=transport.device)
    if error is not None:
        flags[transport.rank] = 1.0
    transport.all_reduce(flags)
    failed = [r for r, v in enumerate(flags.cpu().tolist()) if v > 0]
    if failed:
        _raise_from(transport, error, failed[0], failed, hint)


def compute_on_one(transport: Any, compute: Callable[[], Any], src: int = 0,
                   hint: str = "look at that rank's error: it says what went wrong") -> Any:
    """``compute()`` run on rank ``src`` only, its (picklable) value returned on every rank;
    a failure there is raised on every rank (two broadcasts either way)."""
    value, error = None, None
    if transport.rank == src:
        try:
            value = compute()
        except Exception as err:  # noqa: BLE001 - tell the others before raising
            error = err
    ok, value = broadcast_object(transport, (error is None, value) if transport.rank == src
                                 else None, src)
    if not ok:
        _raise_from(transport, error, src, [src], hint, keep_own=True)
    return value
