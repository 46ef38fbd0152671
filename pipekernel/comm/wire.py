"""The wire protocol between stages: nested tuples, lists and dicts of tensors of any dtype.

What crosses: a tensor, or tuples, lists and dicts (``str`` keys) of tensors nested
to any depth; small Python scalars (``None``, ``bool``, ``int``, ``float``) may sit
among them and travel *in the metadata* (:func:`flatten`). The receiver gets the
same object back: dicts with the same keys in the same order, lists as lists,
tuples as tuples, scalars as the same values.

A *channel* is one stream of transfers in one direction with one peer (the
activations of one chunk, or its gradients); it remembers the metadata
(structure — containers, dict keys, scalar values —, dtypes, shapes,
requires_grad flags) of its last transfer. A changed key set, a new scalar value or
a new shape is a metadata change like any other. Receives
are posted *before* the data exists (see :mod:`pipekernel.schedules.comm`), so
the receiver sizes them from that remembered metadata, and the fast path — the
metadata did not change — is **one message per transfer and no round trip**:

* every tensor of the transfer is packed into one byte buffer (each at a 16-byte
  aligned offset; the receiver unpacks zero-copy views), so a transfer is one
  message whatever its number of tensors;
* a 16-byte header says whether the metadata changed. Where the header lives
  depends on where the data lives, so that reading it never touches a device:
  - **fused** (the data is on the CPU, e.g. gloo): the header is the first 16
    bytes of the same message;
  - **control lane** (the data is on a device, e.g. NCCL): the header travels on
    ``transport.control``, a host transport over the same ranks, and the data
    message is the packed tensors alone. The host reads the header from host
    memory: no ``.item()``, ``int(tensor)`` or ``.tolist()`` on device tensors.

When the metadata changed (first use, a new sequence length, ...), the sender
knows what the receiver posted — a message sized for the metadata it sent last
(16 bytes, or nothing on a control lane, when it sent none) — and still sends
exactly that *void* message, flagged in its header, so the pre-posted receive
matches; then the new metadata and the data follow as extra messages on the
host lane (the same lane when fused), all with the channel's tag. Those extra
messages are why the communication plan keeps at most one receive per channel
posted ahead: a receive posted further ahead would take them. No manual reset
exists or is needed.

On a control lane (device data) the data message has a **capacity**: the largest
payload the channel carried so far, which both ends track alike (the receiver
posts that many bytes, the sender sends that many, the payload at the front). A
change whose payload fits the capacity (a shorter sequence, another dtype of no
more bytes) sends its data *in* the posted device message; only the header and the
new metadata cross the host lane (header code 2). Only a payload larger than any
before (and the first transfer) takes the host path above (code 1): extra device
messages posted late would break the lane's posting order that the schedule proof
relies on (a late device receive can deadlock under rendezvous sends), so the data
goes through host memory then, and the capacity grows to it. The price of the
capacity is padding: after a long sequence, shorter ones move the long one's bytes
(as padding to the longest length would) instead of a device->host->device copy
each time the length changes.
"""
from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import torch

from pipekernel.errors import DataError
from pipekernel.comm.transport import P2POp
from pipekernel.nested import map_tensors  # re-exported: the wire's users walk with it

__all__ = ["flatten", "unflatten", "map_tensors", "encode", "decode", "Channel", "PendingRecv",
           "HEADER_BYTES"]

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
           torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128]
_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}
_NAMES = {dtype: str(dtype).replace("torch.", "") for dtype in _DTYPES}
# structure codes in the metadata (a tensor leaf is 0)
_TUPLE, _DICT, _LIST, _NONE, _BOOL, _INT, _FLOAT = -1, -2, -3, -4, -5, -6, -7
_CONTAINERS = {_TUPLE: "tuple", _LIST: "list"}
_INT64 = (-(1 << 63), (1 << 63) - 1)
#: Size of the header of every transfer (two int64: changed flag, metadata length).
HEADER_BYTES = 16
_ALIGN = 16


def flatten(obj: Any, where: str = "value") -> tuple[list[torch.Tensor], Any]:
    """Split ``obj`` into ``(tensors, structure)``.

    ``obj`` is a tensor, a small Python scalar (``None``, ``bool``, ``int``, ``float``:
    carried in the structure, so in the metadata), or a tuple, list or dict (``str``
    keys) of those, nested to any depth. The structure is hashable and compares equal
    for objects of the same shape, keys and scalar values.

    :param where: how to name ``obj`` in an error (``"outputs"``); nested values are
        named by their path (``outputs["mask"][1]``).
    :raises DataError: for any other value (naming its path) or a non-``str`` key.
    """
    if isinstance(obj, torch.Tensor):
        return [obj], None
    if isinstance(obj, (tuple, list)):
        tensors, parts = [], []
        for i, item in enumerate(obj):
            flat, part = flatten(item, f"{where}[{i}]")
            tensors += flat
            parts.append((len(flat), part))
        return tensors, ("tuple" if isinstance(obj, tuple) else "list", tuple(parts))
    if isinstance(obj, dict):
        tensors, parts = [], []
        for key, item in obj.items():
            if not isinstance(key, str):
                raise DataError(f"{where} has the key {key!r} ({type(key).__name__}); only str "
                                "keys can cross a stage boundary",
                                hint="use str keys in dicts that layers return")
            flat, part = flatten(item, f"{where}[{key!r}]")
            tensors += flat
            parts.append((len(flat), part))
        return tensors, ("dict", tuple(obj), tuple(parts))
    if obj is None or isinstance(obj, (bool, float)) or (
            isinstance(obj, int) and _INT64[0] <= obj <= _INT64[1]):
        return [], _value(obj)
    raise DataError(f"{where} is a {type(obj).__name__}; only tensors, None, bool, int (64-bit), "
                    "float and (nested) tuples, lists and dicts of them can cross a stage "
                    "boundary",
                    hint="return tensors (or tuples/dicts of them) from the layers at stage "
                         "boundaries; encode other values as tensors")


def _value(obj: Any) -> tuple:
    """The structure node of a scalar: ``("value", obj, exact)``, where ``exact`` tells
    apart what ``==`` does not and the metadata does (``1``/``True``/``1.0``, ``0.0``/``-0.0``),
    so that equal structures always encode the same."""
    exact = struct.pack("<d", obj) if type(obj) is float else type(obj)
    return ("value", obj, exact)


def unflatten(tensors: list[torch.Tensor], structure: Any) -> Any:
    """Inverse of :func:`flatten`."""
    if structure is None:
        return tensors[0]
    kind = structure[0]
    if kind == "value":
        return structure[1]
    out, start = [], 0
    for count, part in structure[-1]:
        out.append(unflatten(tensors[start:start + count], part))
        start += count
    if kind == "dict":
        return dict(zip(structure[1], out))
    return tuple(out) if kind == "tuple" else out


def _encode_structure(structure: Any, out: list[int]) -> None:
    if structure is None:
        out.append(0)
        return
    kind = structure[0]
    if kind == "value":
        _encode_value(structure[1], out)
        return
    parts = structure[-1]
    out += [_DICT if kind == "dict" else _TUPLE if kind == "tuple" else _LIST, len(parts)]
    keys = structure[1] if kind == "dict" else None
    for i, (count, part) in enumerate(parts):
        if keys is not None:
            raw = keys[i].encode()
            out += [len(raw), *raw]
        out.append(count)
        _encode_structure(part, out)


def _encode_value(value: Any, out: list[int]) -> None:
    if value is None:
        out.append(_NONE)
    elif isinstance(value, bool):
        out += [_BOOL, int(value)]
    elif isinstance(value, int):
        out += [_INT, value]
    else:
        out += [_FLOAT, struct.unpack("<q", struct.pack("<d", value))[0]]


def _decode_structure(data: list[int], pos: int) -> tuple[Any, int]:
    code = data[pos]
    if code == 0:
        return None, pos + 1
    if code == _NONE:
        return _value(None), pos + 1
    if code in (_BOOL, _INT, _FLOAT):
        raw = data[pos + 1]
        value = bool(raw) if code == _BOOL else raw if code == _INT else \
            struct.unpack("<d", struct.pack("<q", raw))[0]
        return _value(value), pos + 2
    parts, keys, pos = [], [], pos + 2
    for _ in range(data[pos - 1]):
        if code == _DICT:
            length = data[pos]
            keys.append(bytes(data[pos + 1:pos + 1 + length]).decode())
            pos += 1 + length
        count = data[pos]
        part, pos = _decode_structure(data, pos + 1)
        parts.append((count, part))
    if code == _DICT:
        return ("dict", tuple(keys), tuple(parts)), pos
    return (_CONTAINERS[code], tuple(parts)), pos


def encode(tensors: list[torch.Tensor], structure: Any) -> list[int]:
    """Metadata as ints: structure (keys and scalar values included), then per tensor
    dtype, requires_grad, ndim, shape."""
    out: list[int] = []
    _encode_structure(structure, out)
    out.append(len(tensors))
    for t in tensors:
        if t.dtype not in _CODE:
            raise DataError(f"dtype {t.dtype} cannot cross a stage boundary",
                            hint=f"use one of {', '.join(str(d) for d in _DTYPES)}")
        out += [_CODE[t.dtype], int(t.requires_grad), t.dim(), *t.shape]
    return out


def decode(data: list[int]) -> tuple[list[tuple[torch.dtype, bool, tuple[int, ...]]], Any]:
    """Inverse of :func:`encode`: ``([(dtype, requires_grad, shape)], structure)``."""
    structure, pos = _decode_structure(data, 0)
    specs = []
    for _ in range(data[pos]):
        code, grad, ndim = data[pos + 1:pos + 4]
        specs.append((_DTYPES[code], bool(grad), tuple(data[pos + 4:pos + 4 + ndim])))
        pos += 3 + ndim
    return specs, structure


class _Layout:
    """Where each tensor of a transfer sits in the packed buffer."""

    __slots__ = ("specs", "structure", "offsets", "payload", "dtype_bytes")

    def __init__(self, meta: list[int], start: int) -> None:
        self.specs, self.structure = decode(meta)
        self.offsets, offset = [], start
        self.dtype_bytes: dict[str, int] = {}  # tensor bytes by dtype name, per transfer
        for dtype, _, shape in self.specs:
            numel = 1
            for n in shape:
                numel *= n
            self.offsets.append((offset, numel * dtype.itemsize))
            offset += -(-numel * dtype.itemsize // _ALIGN) * _ALIGN
            name = _NAMES[dtype]
            self.dtype_bytes[name] = self.dtype_bytes.get(name, 0) + numel * dtype.itemsize
        self.payload = offset  # total bytes, header included when ``start`` is

    def unpack(self, buf: torch.Tensor) -> Any:
        tensors = []
        for (dtype, grad, shape), (offset, nbytes) in zip(self.specs, self.offsets):
            t = buf[offset:offset + nbytes].view(dtype).view(shape)
            if grad:
                t.requires_grad_(True)
            tensors.append(t)
        return unflatten(tensors, self.structure)

    def pack(self, tensors: list[torch.Tensor], buf: torch.Tensor) -> None:
        for t, (dtype, _, shape), (offset, nbytes) in zip(tensors, self.specs, self.offsets):
            buf[offset:offset + nbytes].view(dtype).view(shape).copy_(t.detach())


class PendingRecv:
    """A receive the runtime posted ahead: its ops, then its handles once posted."""

    __slots__ = ("ops", "control_ops", "handles", "control_handles", "buf", "header")

    def __init__(self) -> None:
        self.ops: list[P2POp] = []
        self.control_ops: list[P2POp] = []
        self.handles: list[Any] = []
        self.control_handles: list[Any] = []
        self.buf: torch.Tensor | None = None
        self.header: torch.Tensor | None = None


class Channel:
    """One direction of one kind of traffic with one peer, remembering the last metadata.

    The runtime asks for the ops of a transfer (:meth:`send_ops`,
    :meth:`recv_ops`), posts them in groups with the ops of other channels, and
    finishes a receive with :meth:`finish` once its data is needed.

    :param transport: the data lane.
    :param peer: the peer's rank in ``transport``'s world.
    :param control: the host lane for headers (``transport.control`` by default;
        ``None`` or the data transport itself means fused headers).
    :param tag: the channel's lane on both transports (see :mod:`pipekernel.comm.transport`).
    """

    def __init__(self, transport: Any, peer: int, control: Any = None, tag: int = 0) -> None:
        self.transport, self.peer, self.tag = transport, peer, tag
        control = control if control is not None else getattr(transport, "control", None)
        self.control = None if control is transport else control
        self._start = 0 if self.control is not None else HEADER_BYTES
        self._sent_meta: list[int] | None = None
        self._sent_key: tuple | None = None  # what _sent_meta encodes, compared per transfer
        self._sent_layout: _Layout | None = None
        self._recv_layout: _Layout | None = None
        # control lane only: bytes of the device data message, the same on both ends
        self._sent_cap = self._recv_cap = 0
        #: Bytes this channel put on the wire (data, headers and metadata), for benchmarks.
        self.bytes_sent = 0
        #: Tensor bytes sent, by dtype name (``"bfloat16"``, ...): what the packed
        #: messages carry, which the transport only sees as bytes.
        self.payload: dict[str, int] = {}

    # -- sending -----------------------------------------------------------------------
    def send_ops(self, obj: Any, where: str = "value") -> tuple[list[P2POp], list[P2POp]]:
        """``(data-lane ops, control-lane ops)`` that carry ``obj``; the caller posts them
        (in this order within its group) and keeps them alive until waited on.
        ``where`` names ``obj`` in the error a value that cannot cross raises."""
        tensors, structure = flatten(obj, where)
        # The metadata is encoded only when it changed: the key (the structure, hashable
        # and compared in C, and each tensor's dtype, flag and shape) is what it encodes.
        key = (structure, [(t.dtype, t.requires_grad, t.shape) for t in tensors])
        if key == self._sent_key:
            # set together with _sent_key (never None once a key matched)
            layout: _Layout = self._sent_layout  # type: ignore[assignment]
            self._count(layout.dtype_bytes)
            if self.control is not None:
                return self._in_place(tensors, layout, _UNCHANGED, [])
            buf = torch.empty(layout.payload, dtype=torch.uint8, device=self.transport.device)
            layout.pack(tensors, buf)
            buf[:HEADER_BYTES].zero_()
            self.bytes_sent += layout.payload
            return [P2POp("send", buf, self.peer, self.tag)], []
        meta = encode(tensors, structure)
        layout = _Layout(meta, self._start)
        if self.control is not None and self._sent_layout is not None \
                and layout.payload <= self._sent_cap:  # fits the posted device message
            meta_tensor = torch.tensor(meta, dtype=torch.int64)
            self.bytes_sent += meta_tensor.numel() * 8
            ops = self._in_place(tensors, layout, _header(2, len(meta)),
                                 [P2POp("send", meta_tensor, self.peer, self.tag)])
            self._sent_meta, self._sent_layout = meta, layout
        else:
            ops = self._changed(tensors, meta, self._start)
        self._sent_key = key
        self._count(self._sent_layout.dtype_bytes)  # type: ignore[union-attr]  # both branches set it
        return ops

    def _in_place(self, tensors: list[torch.Tensor], layout: _Layout, header: torch.Tensor,
                  extra: list[P2POp]) -> tuple[list[P2POp], list[P2POp]]:
        """Control lane: the data in one device message of the channel's capacity; the
        header (and ``extra``: new metadata) on the host lane."""
        buf = torch.empty(self._sent_cap, dtype=torch.uint8, device=self.transport.device)
        layout.pack(tensors, buf)
        self.bytes_sent += self._sent_cap + HEADER_BYTES
        return ([P2POp("send", buf, self.peer, self.tag)],
                [P2POp("send", header, self.peer, self.tag), *extra])

    def _count(self, dtype_bytes: dict[str, int]) -> None:
        payload = self.payload
        for name, nbytes in dtype_bytes.items():
            payload[name] = payload.get(name, 0) + nbytes

    def _changed(self, tensors: list[torch.Tensor], meta: list[int], start: int
                 ) -> tuple[list[P2POp], list[P2POp]]:
        """The slow path: a void message the size the receiver posted, then the metadata
        and the data on the host lane (the data lane itself when fused)."""
        old = self._sent_layout
        layout = _Layout(meta, start)
        host = torch.device("cpu")
        data_ops: list[P2POp] = []
        control_ops: list[P2POp] = []
        if self.control is None:
            device = self.transport.device
            meta_tensor = torch.tensor(meta, dtype=torch.int64, device=device)
            void = torch.zeros(old.payload if old is not None else HEADER_BYTES, dtype=torch.uint8,
                               device=device)
            void[:HEADER_BYTES].view(torch.int64).copy_(_header(1, len(meta)))
            buf = torch.empty(layout.payload, dtype=torch.uint8, device=device)
            buf[:HEADER_BYTES].zero_()
            layout.pack(tensors, buf)
            data_ops = [P2POp("send", void, self.peer, self.tag), P2POp("send", meta_tensor, self.peer, self.tag),
                        P2POp("send", buf, self.peer, self.tag)]
            self.bytes_sent += void.numel() + meta_tensor.numel() * 8 + buf.numel()
        else:
            meta_tensor = torch.tensor(meta, dtype=torch.int64)
            if old is not None:  # the receiver posted a data receive of the capacity
                data_ops.append(P2POp("send", torch.empty(self._sent_cap, dtype=torch.uint8,
                                                          device=self.transport.device),
                                      self.peer, self.tag))
                self.bytes_sent += self._sent_cap
            self._sent_cap = max(self._sent_cap, layout.payload)
            buf = torch.empty(layout.payload, dtype=torch.uint8, device=host)
            layout.pack([t.detach().to(host) for t in tensors], buf)
            control_ops = [P2POp("send", _header(1, len(meta)), self.peer, self.tag),
                           P2POp("send", meta_tensor, self.peer, self.tag), P2POp("send", buf, self.peer, self.tag)]
            self.bytes_sent += HEADER_BYTES + meta_tensor.numel() * 8 + buf.numel()
        self._sent_meta, self._sent_layout = meta, layout
        return data_ops, control_ops

    # -- receiving ---------------------------------------------------------------------
    def recv_ops(self) -> PendingRecv:
        """The ops of the next receive, sized from the remembered metadata."""
        pending, layout = PendingRecv(), self._recv_layout
        if self.control is None:
            size = layout.payload if layout is not None else HEADER_BYTES
            pending.buf = torch.empty(size, dtype=torch.uint8, device=self.transport.device)
            pending.ops.append(P2POp("recv", pending.buf, self.peer, self.tag))
        else:
            pending.header = torch.empty(2, dtype=torch.int64)
            pending.control_ops.append(P2POp("recv", pending.header, self.peer, self.tag))
            if layout is not None:
                pending.buf = torch.empty(self._recv_cap, dtype=torch.uint8,
                                          device=self.transport.device)
                pending.ops.append(P2POp("recv", pending.buf, self.peer, self.tag))
        return pending

    def finish(self, pending: PendingRecv) -> Any:
        """Wait for a posted receive and return the object; float tensors flagged
        ``requires_grad`` come back as leaves that require grad."""
        for handle in pending.control_handles:
            handle.wait()
        for handle in pending.handles:
            handle.wait()
        # post() sets buf (the header leads it) without a control lane, header with one
        buf: torch.Tensor = pending.buf  # type: ignore[assignment]
        if self.control is None:
            changed, length = buf[:HEADER_BYTES].view(torch.int64).tolist()  # host memory
        else:
            changed, length = pending.header.tolist()  # type: ignore[union-attr]  # host memory
        if not changed:
            if self._recv_layout is None:
                raise DataError(f"rank {self.transport.rank} got no metadata from rank "
                                f"{self.peer}",
                                hint="both sides must use the same pipekernel wire protocol")
            return self._recv_layout.unpack(buf)
        lane = self.control if self.control is not None else self.transport
        meta = torch.empty(length, dtype=torch.int64, device=lane.device)
        lane.irecv(meta, self.peer, self.tag).wait()
        layout = _Layout(meta.tolist(), self._start)  # host memory
        self._recv_layout = layout
        if changed == 2:  # the data came in the posted device message
            return layout.unpack(buf)
        buf = torch.empty(layout.payload, dtype=torch.uint8, device=lane.device)
        lane.irecv(buf, self.peer, self.tag).wait()
        if self.control is not None:
            self._recv_cap = max(self._recv_cap, layout.payload)
            buf = buf.to(self.transport.device)
        return layout.unpack(buf)


def _header(changed: int, length: int) -> torch.Tensor:
    return torch.tensor([changed, length], dtype=torch.int64)


#: The header of every unchanged transfer on a control lane: only ever sent (read), so one
#: tensor serves every transfer of every channel.
_UNCHANGED = _header(0, 0)
