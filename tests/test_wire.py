"""The wire protocol: one message per transfer on the fast path, metadata re-exchanged
when it changes, headers on a host control lane when the transport has one."""
from __future__ import annotations

import pytest
import torch

from pipekernel.testing import run_ranks
from pipekernel.comm.transport import P2POp
from pipekernel.errors import DataError
from pipekernel.comm.wire import HEADER_BYTES, Channel, decode, encode, flatten, map_tensors, unflatten


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
    (_, sent), (received, _) = run_ranks(_exchange, 2, with_control, timeout=300)
    expected = _objects(0)
    assert len(received) == len(expected)
    for i, (got, want) in enumerate(zip(received, expected)):
        assert _same(got, want), f"transfer {i} arrived changed"
    messages, _, control_messages = sent[0], sent[1], sent[2]
    # 6 transfers, 5 of them with new metadata (first, new length, new dtype and no grad,
    # tuple, back); 3 of those outgrew every earlier payload (first, (4,9) float32, (4,9)
    # float64): the tuple and the return to (4,6) fit the posted message
    changes, grew = 5, 3
    fast = len(expected) - changes
    if not with_control:
        # the fast path is 1 data message; a change that fits too (its metadata rides in
        # front of the data); one that outgrew costs void + metadata + data
        assert messages == fast + (changes - grew) + 3 * grew
        assert control_messages == 0
    else:
        # data lane: one message per transfer after the first (the data, or a void); the
        # host lane: a header each, metadata per change, the data only when it outgrew
        assert messages == fast + (changes - 1)
        assert control_messages == len(expected) + changes + grew


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
    sender, _ = run_ranks(_fast_path_bytes, 2, timeout=300)
    assert sender == (1, HEADER_BYTES + 64)


def test_p2pop_is_a_plain_record():
    op = P2POp("send", torch.zeros(1), 3)
    assert (op.op, op.peer) == ("send", 3)


# -- structures: dicts, lists, scalars (in one process, over a loopback pair) -------------

class _Loopback:
    """Both ends of a pair in one process: FIFO per (src, dst, tag), receives matched lazily
    at wait(), sizes checked (what a real transport would truncate or hang on)."""

    class _Handle:
        def __init__(self, fn=None):
            self.fn = fn

        def wait(self):
            if self.fn is not None:
                self.fn()
                self.fn = None

        def is_completed(self):
            return self.fn is None

    def __init__(self, rank, queues, counts):
        self.rank, self.world_size, self.device = rank, 2, torch.device("cpu")
        self.queues, self.counts = queues, counts

    def batch_isend_irecv(self, ops):
        return [self.isend(op.tensor, op.peer, op.tag) if op.op == "send"
                else self.irecv(op.tensor, op.peer, op.tag) for op in ops]

    def isend(self, tensor, dst, tag=0):
        self.queues.setdefault((self.rank, dst, tag), []).append(tensor.clone())
        self.counts["messages"] += 1
        return self._Handle()

    def irecv(self, tensor, src, tag=0):
        def fill():
            sent = self.queues[(src, self.rank, tag)].pop(0)
            assert sent.shape == tensor.shape and sent.dtype == tensor.dtype, (sent, tensor)
            tensor.copy_(sent)
        return self._Handle(fill)


def _pair():
    queues, counts = {}, {"messages": 0}
    a, b = _Loopback(0, queues, counts), _Loopback(1, queues, counts)
    return Channel(a, 1), Channel(b, 0), counts


def _transfer(sender, receiver, obj):
    ops, _ = sender.send_ops(obj)
    handles = sender.transport.batch_isend_irecv(ops)
    pending = receiver.recv_ops()
    pending.handles = receiver.transport.batch_isend_irecv(pending.ops)
    got = receiver.finish(pending)
    for h in handles:
        h.wait()
    return got


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.detach(), b.detach()) and a.requires_grad == b.requires_grad)
    if isinstance(a, dict):
        return (isinstance(b, dict) and list(a) == list(b)
                and all(_equal(a[k], b[k]) for k in a))
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _nested(length=6, extra=False):
    g = torch.Generator().manual_seed(length)
    h = torch.randn(2, length, generator=g).requires_grad_()
    obj = {"hidden": h, "aux": {"mask": h.detach() > 0, "pos": torch.arange(length)},
           "layers": [torch.randn(3, generator=g, dtype=torch.float64), (torch.ones(1),)],
           "scale": 0.5, "step": 3, "causal": True, "cache": None}
    if extra:
        obj["aux"]["segment"] = torch.zeros(length, dtype=torch.int32)
    return obj


def test_nested_dicts_lists_and_scalars_round_trip_with_keys_in_order():
    sender, receiver, _ = _pair()
    want = _nested()
    got = _transfer(sender, receiver, want)
    assert _equal(got, want), got
    assert list(got) == ["hidden", "aux", "layers", "scale", "step", "causal", "cache"]
    assert isinstance(got["layers"], list) and isinstance(got["layers"][1], tuple)
    assert got["hidden"].requires_grad and not got["aux"]["mask"].requires_grad


def test_a_key_set_change_is_a_metadata_change_and_only_it_costs_extra_messages():
    sender, receiver, counts = _pair()
    sequence = [_nested(), _nested(), _nested(extra=True), _nested(extra=True), _nested(),
                {**_nested(), "step": 4}, {**_nested(), "step": 4}]
    per_transfer = []
    for obj in sequence:
        before = counts["messages"]
        assert _equal(_transfer(sender, receiver, obj), obj)
        per_transfer.append(counts["messages"] - before)
    # fused headers: the fast path is 1 message, and so is a change that fits the posted
    # message (its metadata in front of the data); one larger than any before is void +
    # metadata + data (3): the first and the one with the extra key
    assert per_transfer == [3, 1, 3, 1, 1, 1, 1]
    assert sender.changes == 4  # first, extra key, back, new scalar: each one detected


def _control_pair():
    """Loopback data lanes plus loopback host lanes (headers), counting host bytes."""
    queues, counts = {}, {"messages": 0}
    host_queues, host_counts = {}, {"messages": 0}
    a, b = _Loopback(0, queues, counts), _Loopback(1, queues, counts)
    ca, cb = _Loopback(0, host_queues, host_counts), _Loopback(1, host_queues, host_counts)
    return Channel(a, 1, control=ca), Channel(b, 0, control=cb), counts, host_counts


def _control_transfer(sender, receiver, obj):
    ops, ctrl = sender.send_ops(obj)
    handles = sender.control.batch_isend_irecv(ctrl) + sender.transport.batch_isend_irecv(ops)
    pending = receiver.recv_ops()
    pending.control_handles = receiver.control.batch_isend_irecv(pending.control_ops)
    pending.handles = receiver.transport.batch_isend_irecv(pending.ops)
    got = receiver.finish(pending)
    for h in handles:
        h.wait()
    return got, [op.tensor.numel() * op.tensor.element_size() for op in ctrl]


def test_a_new_sequence_length_sends_only_header_and_shape_on_the_host_lane():
    """Control lane (device data): a length change whose payload fits the largest one so
    far ships its data in the posted device message; only the header and the metadata
    cross the host lane. Only a payload larger than ever before goes through the host."""
    sender, receiver, counts, host = _control_pair()
    lengths = [8, 8, 5, 12, 3, 12, 7, 7]
    kinds = []
    for i, length in enumerate(lengths):
        obj = {"h": torch.randn(2, length, generator=torch.Generator().manual_seed(i)),
               "ids": torch.arange(length)}
        got, host_sizes = _control_transfer(sender, receiver, obj)
        assert _equal(got, obj), (i, got)
        kinds.append({1: "fast", 2: "shape", 3: "host data"}[len(host_sizes)])
        if kinds[-1] == "shape":  # the header and the metadata, nothing else
            assert host_sizes == [HEADER_BYTES, 8 * len(sender._sent_meta)]
    assert kinds == ["host data", "fast", "shape", "host data", "shape", "shape", "shape",
                     "fast"]
    assert counts["messages"] == len(lengths) - 1  # one device message per transfer after the first


def test_renamed_key_with_the_same_tensors_is_detected():
    sender, receiver, counts = _pair()
    x = torch.ones(2, 2)
    _transfer(sender, receiver, {"a": x})
    got = _transfer(sender, receiver, {"b": x})
    assert list(got) == ["b"]


def test_scalars_equal_in_python_but_not_on_the_wire_are_a_metadata_change():
    """The fast path compares a key, not the encoded metadata: ``1 == True == 1.0`` and
    ``0.0 == -0.0`` in Python, so the key must still tell them apart."""
    sender, receiver, counts = _pair()
    x = torch.ones(2)
    per_transfer = []
    for value in [1, True, 1.0, 1.0, 0.0, -0.0, -0.0, 1]:
        before = counts["messages"]
        got = _transfer(sender, receiver, (x, value))
        assert type(got[1]) is type(value) and str(got[1]) == str(value), (got, value)
        per_transfer.append(counts["messages"] - before)
    # each change is detected (6 of 8); past the first two (the second grows the message
    # to hold its metadata too) each fits the posted message: 1 message, as the fast path
    assert sender.changes == 6
    assert per_transfer == [3, 3, 1, 1, 1, 1, 1, 1]


@pytest.mark.parametrize("value,path", [({"a": {"b": "text"}}, r"outputs\['a'\]\['b'\] is a str"),
                                        ({"a": [torch.ones(1), object()]}, r"outputs\['a'\]\[1\]"),
                                        ({1: torch.ones(1)}, r"outputs has the key 1 \(int\)"),
                                        ({"big": 1 << 70}, r"outputs\['big'\] is a int")])
def test_values_that_cannot_cross_name_their_path(value, path):
    sender, _, _ = _pair()
    with pytest.raises(DataError, match=path):
        sender.send_ops(value, "outputs")


def test_structure_metadata_round_trips():
    obj = _nested(extra=True)
    tensors, structure = flatten(obj)
    specs, decoded = decode(encode(tensors, structure))
    assert decoded == structure
    assert _equal(unflatten(tensors, decoded), obj)
    assert map_tensors(lambda t: t.shape, {"a": (torch.ones(2),), "b": 1}) == \
        {"a": (torch.Size([2]),), "b": 1}


class _Notes(torch.nn.Linear):
    def forward(self, x):
        return {"hidden": super().forward(x), "note": "not a tensor"}


class _Pick(torch.nn.Linear):
    def __init__(self, n):
        super().__init__(n, n)

    def forward(self, d):
        return super().forward(d["hidden"])


def _bad_boundary_worker():
    import pipekernel as pk

    torch.set_num_threads(1)
    module = pk.PipelineModule([_Notes(3, 3), pk.LayerSpec(_Pick, 3)], loss_fn=torch.nn.MSELoss(),
                               num_stages=2, partition=[0, 1, 2])
    engine = pk.PipelineEngine(module, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                               micro_batches=2, timeout=30)
    engine.train_batch(iter([(torch.ones(2, 3), torch.zeros(2, 3))] * 2))


def test_a_value_that_cannot_cross_names_stage_micro_batch_and_key():
    import pipekernel as pk

    with pytest.raises(pk.RankError) as info:
        run_ranks(_bad_boundary_worker, 2, timeout=300)
    text = str(info.value.original)
    assert "outputs['note'] is a str" in text
    assert "stage 0" in text and "micro-batch 0" in text and "SEND_F0" in text
