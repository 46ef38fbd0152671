"""The one agreement-across-ranks helper module (pipekernel.comm.agreement, issue 29
item 3): values and errors exchanged between ranks, every rank raising the same error."""
from __future__ import annotations

import pytest

from pipekernel.testing import run_ranks


class Unpicklable(Exception):
    def __init__(self, message):
        super().__init__(message)
        self.lock = __import__("threading").Lock()  # does not pickle


def _worker():
    import torch

    from pipekernel.comm.agreement import (all_gather_objects, broadcast_object,
                                             compute_on_one, raise_on_every_rank)
    from pipekernel.errors import ConfigError, DataError
    from pipekernel.transports.gloo import GlooTransport

    torch.set_num_threads(1)
    transport = GlooTransport(timeout=60)
    rank, out = transport.rank, {}
    out["gather"] = all_gather_objects(transport, {"rank": rank})
    out["broadcast"] = broadcast_object(transport, ("from", rank), 1)
    out["value"] = compute_on_one(transport, lambda: [rank, 2.5], 0)
    raise_on_every_rank(transport, None)  # nobody failed: returns

    def fails():
        raise DataError("bad sample", hint="fix it")

    def fails_unpicklable():
        raise Unpicklable("locked")

    for name, compute in (("remote", fails), ("unpicklable", fails_unpicklable)):
        try:
            compute_on_one(transport, compute, 0)
        except Exception as err:  # noqa: BLE001
            out[name] = (type(err).__name__, str(err))
    try:
        raise_on_every_rank(transport, ValueError("disk full") if rank == 1 else None)
    except ConfigError as err:
        out["raised"] = (err.rank, str(err))
    transport.close()
    return out


@pytest.mark.multirank
def test_values_and_errors_reach_every_rank():
    first, second = run_ranks(_worker, 2, timeout=180)
    for out in (first, second):
        assert out["gather"] == [{"rank": 0}, {"rank": 1}]
        assert out["broadcast"] == ("from", 1)
        assert out["value"] == [0, 2.5]  # rank 0's
        assert out["raised"][0] == 1 and "ValueError: disk full" in out["raised"][1]
    assert first["remote"][0] == "DataError" and second["remote"][0] == "DataError"
    assert "raised on rank 0, seen by rank 1" in second["remote"][1]
    assert first["unpicklable"][0] == "Unpicklable"  # rank 0 raises its own error as it was
    assert second["unpicklable"][0] == "ConfigError" and "locked" in second["unpicklable"][1]
