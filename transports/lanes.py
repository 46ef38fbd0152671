"""Splitting a posting group of point-to-point ops by lane (tag).

Device transports keep one communicator per lane (NCCL has no tags and runs a
communicator's operations in order); a posting group becomes one group call
per lane it uses.
"""
from __future__ import annotations

from collections.abc import Sequence

from pipekernel.errors import ConfigError
from pipekernel.comm import P2POp

__all__ = ["split_by_lane"]


def split_by_lane(ops: Sequence[P2POp], lanes: int) -> dict[int, list[tuple[int, P2POp]]]:
    """``{tag: [(index in ops, op)]}`` in order of first use; checks op kinds and tags."""
    by_lane: dict[int, list[tuple[int, P2POp]]] = {}
    for index, op in enumerate(ops):
        if op.op not in ("send", "recv"):
            raise ConfigError(f"P2POp.op must be 'send' or 'recv', got {op.op!r}",
                              hint="build each P2POp with op='send' or op='recv'")
        if not 0 <= op.tag < lanes:
            raise ConfigError(f"the transport has {lanes} lanes, tag {op.tag} asked for",
                              hint="raise transport_options={'lanes': ...}")
        by_lane.setdefault(op.tag, []).append((index, op))
    return by_lane
