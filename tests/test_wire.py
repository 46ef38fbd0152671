"""The wire protocol: one message per transfer on the fast path, metadata re-exchanged
when it changes, headers on a host control lane when the transport has one."""
from __future__ import annotations

import pytest
import torch

from pipekernel.testing import run_ranks
from pipekernel.transport import P2POp
from pipekernel.wire import HEADER_BYTES, Channel


class Counting:
    """A transport wrapper that counts the messages and bytes posted through it."""

    def __init__(self, inner, name="data"):
        self.inner, self.name = inner, name
        self.rank, self.world_size, self.device = inner.rank, inner.world_size, inner.device
        self.timeout = inner.timeout
        self.messages = 0
        self.bytes = 0

    def batch_isend_irecv(self, ops):
        for op in ops:
            if op.op == "send":
                self.messages += 1
                self.bytes += op.tensor.numel() * op.tensor.element_size()
        return self.inner.batch_isend_irecv(ops)

    def isend(self, tensor, dst, tag=0):
        self.messages += 1
        self.bytes += tensor.numel() * tensor.element_size()
        return self.inner.isend(tensor, dst, tag)

    def irecv(self, tensor, src, tag=0):
        return self.inner.irecv(tensor, src, tag)


def _objects(step):
    """A sequence of transfers whose metadata changes now and then: same, same, new
    length, new dtype, a tuple with a bool mask and int ids, back to the first."""
    g = torch.Generator().manual_seed(step)
    shapes = [(4, 6), (4, 6), (4, 9), (4, 9), None, (4, 6)]
    out = []
    for i, shape in enumerate(shapes):
        if shape is None:
            h = torch.randn(2, 3, generator=g)
            out.append((h, h > 0, torch.arange(5), torch.tensor(7.0)))
        else:
            dtype = torch.float64 if i == 3 else torch.float32
            out.append(torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(i != 3))
    return out


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return (a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.detach(), b.detach())
                and a.requires_grad == b.requires_grad)
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))


def _exchange(with_control):
    from pipekernel.transports.gloo import GlooTransport
    import torch.distributed as dist

    transport = GlooTransport(timeout=30)
    data = Counting(transport)
    control = None
    if with_control:
        inner = GlooTransport.__new__(GlooTransport)
        inner.__dict__.update(transport.__dict__)
        inner.group = dist.new_group([0, 1])  # a second lane over the same ranks
        inner._global, inner._owns_group = None, False
        control = Counting(inner, "control")
    peer = 1 - transport.rank
    channel = Channel(data, peer, control=control)
    results = []
    for obj in _objects(0):
        if transport.rank == 0:
            ops, ctrl = channel.send_ops(obj)
            handles = (control.batch_isend_irecv(ctrl) if ctrl else []) + \
                data.batch_isend_irecv(ops)
            for h in handles:
                h.wait()
        else:
            pending = channel.recv_ops()
            pending.control_handles = control.batch_isend_irecv(pending.control_ops) \
                if control is not None and pending.control_ops else []
            pending.handles = data.batch_isend_irecv(pending.ops) if pending.ops else []
            results.append(channel.finish(pending))
    counts = (data.messages, data.bytes, control.messages if control else 0)
    transport.close()
    return results, counts


@pytest.mark.parametrize("with_control", [False, True], ids=["fused", "control-lane"])
def test_transfers_round_trip_and_metadata_follows_changes(with_control):
    (_, sent), (received, _) = run_ranks(_exchange, 2, with_control, timeout=120)
    expected = _objects(0)
    assert len(received) == len(expected)
    for i, (got, want) in enumerate(zip(received, expected)):
        assert _same(got, want), f"transfer {i} arrived changed"
    messages, _, control_messages = sent[0], sent[1], sent[2]
    # 6 transfers, 5 of them with new metadata (first, new length, new dtype and no grad,
    # tuple, back): the fast path is 1 data message, a change costs void + metadata + data.
    changes = 5
    fast = len(expected) - changes
    if not with_control:
        assert messages == fast + 3 * changes
        assert control_messages == 0
    else:
        # data lane: one message per fast transfer, one void per change after the first
        assert messages == fast + (changes - 1)
        assert control_messages == len(expected) + 2 * changes


def _fast_path_bytes():
    from pipekernel.transports.gloo import GlooTransport

    transport = GlooTransport(timeout=30)
    data = Counting(transport)
    channel = Channel(data, 1 - transport.rank)
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))  # 60 bytes: padded to 64

    def transfer():
        if transport.rank == 0:
            ops, _ = channel.send_ops(x)
            for h in data.batch_isend_irecv(ops):
                h.wait()
        else:
            pending = channel.recv_ops()
            pending.handles = data.batch_isend_irecv(pending.ops)
            assert torch.equal(channel.finish(pending), x)

    for _ in range(3):
        transfer()
    first = data.bytes
    before = data.messages
    transfer()
    result = (data.messages - before, data.bytes - first)
    transport.close()
    return result


def test_fast_path_is_one_message_with_a_16_byte_header():
    sender, _ = run_ranks(_fast_path_bytes, 2, timeout=60)
    assert sender == (1, HEADER_BYTES + 64)


def test_p2pop_is_a_plain_record():
    op = P2POp("send", torch.zeros(1), 3)
    assert (op.op, op.peer) == ("send", 3)
