"""Failing loud and fast: abort propagation and the start-up consistency check (the
data-alignment fingerprint lives with the stage, :mod:`pipekernel.stage.fingerprint`).

* :class:`AbortBoard` — when an instruction fails on one rank, that rank writes
  its error under one key of the store every rank shares (``transport.store``);
  every other rank's blocked waits look at that key between slices (see
  :func:`pipekernel.comm.transport.wait_polling`) and raise a
  :class:`~pipekernel.errors.PeerAbort` naming the failing rank, stage,
  micro-batch and instruction — within about a second, not after the timeout.
  Nothing is read while no wait blocks: the hot path pays nothing.
* :func:`check_consistency` (:mod:`pipekernel.comm.agreement`) — one all-reduce of a hash of the fields every rank
  must agree on (schedule, chunks, micro-batches, stages, partition bounds, layer
  count, precision, pipekernel version); only on a mismatch a detailed exchange
  follows, and every rank raises a ``ConfigError`` naming the fields and the
  ranks that differ.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from pipekernel.comm.attempt import attempt_prefix, store_host
from pipekernel.comm.agreement import all_gather_objects, check_consistency  # noqa: F401
from pipekernel.errors import PeerAbort, TransportError, TransportTimeout, describe_where

__all__ = ["AbortBoard", "engine_board", "root_cause", "check_consistency", "all_gather_objects"]

#: the failing rank's location fields an abort record carries (rank aside)
_LOCATION = ("stage", "train_step", "eval_after", "step", "micro_batch", "instruction")


class AbortBoard:
    """The first failure of a group of ranks, published through a shared store.

    :param store: a ``torch.distributed.Store``-like object or ``None`` (then
        publishing and checking do nothing: ranks end by their own timeouts).
    :param prefix: keys live under it; unique per engine (all ranks build
        engines in the same order).
    :param rank: this rank.
    """

    def __init__(self, store: Any, prefix: str, rank: int) -> None:
        self.store, self.prefix, self.rank = store, prefix, rank
        self._key = f"{prefix}/abort"
        self.published = False
        #: the record naming the store's host, once its store was found gone
        self.host_gone: dict[str, Any] | None = None

    def publish(self, error: BaseException) -> None:
        """Tell the other ranks that this one failed (the first publisher wins); not
        for a :class:`TransportTimeout` or a :class:`PeerAbort`."""
        # a timeout is a symptom (every rank waiting on the slow one times out by
        # itself, naming its own peer); an abort seen from another rank is not ours
        if self.store is None or self.published or isinstance(error, (PeerAbort,
                                                                       TransportTimeout)):
            return
        self.published = True
        record = {
            "rank": getattr(error, "rank", None) if getattr(error, "rank", None) is not None
            else self.rank,
            "type": type(error).__name__,
            "message": getattr(error, "message", str(error)),
            "hint": getattr(error, "hint", None),
            "peer": getattr(error, "peer", None),
        }
        for key in _LOCATION:
            value = getattr(error, key, None)
            record[key] = None if value is None else (value if isinstance(value, int)
                                                      else str(value))
        try:
            if self.store.add(f"{self.prefix}/abort_count", 1) == 1:
                self.store.set(self._key, json.dumps(record))
        except Exception:  # the store is gone: the others end by their timeouts
            pass

    def check(self) -> None:
        """Raise :class:`PeerAbort` if some rank published a failure, or if the store's
        host is a rank (rank 0 of a raw ``env://`` launch) and its store is gone: that
        rank died, which is the failure to name (not the closed connection)."""
        if self.host_gone is not None:
            raise peer_abort(self.host_gone, self.rank)
        store = self.store
        if store is None:
            return
        try:
            if not store.check([self._key]):
                return
            record = json.loads(store.get(self._key).decode())
        except Exception as err:  # store unreachable: its host died; stop asking
            self.store = None
            host = store_host()
            if host is None or host == self.rank:
                return
            self.host_gone = {
                "rank": host, "type": "StoreHostGone", "lost": True,
                "message": f"the store's host, rank {host}, is gone: rank {host} died or "
                           f"failed first (the store connection failed: "
                           f"{str(err).splitlines()[0][:80]})",
                "hint": "look at its log and exit code; under torchrun the agent hosts the "
                        "store instead, and --max-restarts restarts a job that lost a rank "
                        "(docs/faults.md)"}
            raise peer_abort(self.host_gone, self.rank) from err
        if record.get("rank") == self.rank:
            return  # our own failure: the original error is on its way up
        raise peer_abort(record, self.rank)


def peer_abort(record: Mapping[str, Any], seen_by: int) -> PeerAbort:
    where = describe_where({k: record.get(k) for k in _LOCATION})
    message = record["message"] if record.get("lost") else (
        f"rank {record['rank']} failed first{f' ({where})' if where else ''} with "
        f"{record['type']}: {record['message']}")
    hint = record.get("hint") or f"look at rank {record['rank']}'s log and traceback"
    return PeerAbort(message, hint=f"rank {record['rank']}: {hint}",
                     error_type=record["type"], seen_by=seen_by, rank=record["rank"],
                     stage=record.get("stage"), step=record.get("step"),
                     train_step=record.get("train_step"), eval_after=record.get("eval_after"),
                     micro_batch=record.get("micro_batch"),
                     instruction=record.get("instruction"))


def root_cause(err: BaseException, transport: Any, board: AbortBoard, rank: int
               ) -> BaseException:
    """A transport failure is usually a symptom (the peer that failed closed its
    connections): the failure another rank published on ``board``, if any, else ``err``.
    Most waits check that themselves; sends, collectives and posting errors land here. A
    device transport's overdue transfer (``transport.failure``) wins over what the host
    hit after the watch aborted the communicators."""
    failure = getattr(transport, "failure", None)
    if failure is not None and failure is not err and not isinstance(err, PeerAbort):
        return failure
    if not isinstance(err, TransportError):
        return err
    try:
        board.check()
    except PeerAbort as abort:
        abort.add_detail(f"rank {rank} then failed too"
                         + (f" at {err.instruction}" if err.instruction is not None
                            else "") + f": {err.message[:200]}")
        return abort
    return err


_ENGINES: dict[Any, int] = {}


def engine_board(transport: Any) -> AbortBoard:
    """The engine's board of first failures, checked by every lane of ``transport``."""
    board = AbortBoard(getattr(transport, "store", None), _board_prefix(transport),
                       transport.rank)
    for lane in {id(t): t for t in (transport, getattr(transport, "control", None))
                 if t is not None}.values():
        if hasattr(lane, "abort_check"):
            lane.abort_check = board.check
    return board


def _board_prefix(transport: Any) -> str:
    """Store keys for one engine: this attempt of the job (see
    :mod:`pipekernel.comm.attempt`), the ranks the engine spans and how many engines this
    process built over them before (every rank builds its engines in the same order)."""
    ranks = tuple(transport.global_rank(r) for r in range(transport.world_size)) \
        if hasattr(transport, "global_rank") else (transport.world_size,)
    count = _ENGINES.get(ranks, 0)
    _ENGINES[ranks] = count + 1
    name = hashlib.sha1(repr(ranks).encode()).hexdigest()[:10]
    # keyed by attempt: a restarted job must not read a dead attempt's abort
    return f"{attempt_prefix()}/engine/{name}/{count}"
