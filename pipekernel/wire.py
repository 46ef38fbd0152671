"""The wire protocol between stages: nested tuples of tensors of any dtype.

Each transfer on a channel (one direction between two ranks) is:

1. a tag: a 1-element int64 tensor, ``0`` if the structure/dtypes/shapes/
   requires_grad flags equal those of the previous transfer on this channel,
   else ``n``, the length of the metadata that follows;
2. the metadata (``n`` int64s), only when it changed;
3. one message per tensor.

So metadata is exchanged on first use and whenever it changes (e.g. a new
sequence length), never otherwise, and no manual reset exists or is needed.
The tag is the one extra word a receiver needs to know whether new metadata
comes.
"""
from __future__ import annotations

from typing import Any

import torch

from pipekernel.errors import DataError

__all__ = ["flatten", "unflatten", "encode", "decode", "Channel"]

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
           torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128]
_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}
_TUPLE = -1


def flatten(obj: Any, where: str = "value") -> tuple[list[torch.Tensor], Any]:
    """Split a tensor or nested tuple/list of tensors into ``(tensors, structure)``."""
    if isinstance(obj, torch.Tensor):
        return [obj], None
    if isinstance(obj, (tuple, list)):
        tensors, parts = [], []
        for i, item in enumerate(obj):
            flat, part = flatten(item, f"{where}[{i}]")
            tensors += flat
            parts.append((len(flat), part))
        return tensors, tuple(parts)
    raise DataError(f"{where} is a {type(obj).__name__}; only tensors and (nested) tuples of "
                    "tensors can cross a stage boundary",
                    hint="return tensors (or tuples of them) from the layers at stage "
                         "boundaries; encode other values as tensors")


def unflatten(tensors: list[torch.Tensor], structure: Any) -> Any:
    """Inverse of :func:`flatten`."""
    if structure is None:
        return tensors[0]
    out, start = [], 0
    for count, part in structure:
        out.append(unflatten(tensors[start:start + count], part))
        start += count
    return tuple(out)


def _encode_structure(structure: Any, out: list[int]) -> None:
    if structure is None:
        out.append(0)
        return
    out += [_TUPLE, len(structure)]
    for count, part in structure:
        out.append(count)
        _encode_structure(part, out)


def _decode_structure(data: list[int], pos: int) -> tuple[Any, int]:
    if data[pos] == 0:
        return None, pos + 1
    parts, pos = [], pos + 2
    for _ in range(data[pos - 1]):
        count = data[pos]
        part, pos = _decode_structure(data, pos + 1)
        parts.append((count, part))
    return tuple(parts), pos


def encode(tensors: list[torch.Tensor], structure: Any) -> list[int]:
    """Metadata as ints: structure, then per tensor dtype, requires_grad, ndim, shape."""
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


class Channel:
    """One direction of traffic with one peer, remembering the last metadata."""

    def __init__(self, transport: Any, peer: int) -> None:
        self.transport, self.peer = transport, peer
        self._sent_meta: list[int] | None = None
        self._recv_meta: tuple[list, Any] | None = None

    def send(self, obj: Any) -> list[Any]:
        """Post every message of ``obj``; returns the handles (the caller keeps them, and
        the tensors alive, until it waits on them)."""
        tensors, structure = flatten(obj)
        meta = encode(tensors, structure)
        device = self.transport.device
        handles = []
        if meta == self._sent_meta:
            handles.append(self.transport.isend(torch.zeros(1, dtype=torch.int64, device=device),
                                                self.peer))
        else:
            header = torch.tensor([len(meta), *meta], dtype=torch.int64, device=device)
            handles.append(self.transport.isend(header[:1], self.peer))
            handles.append(self.transport.isend(header[1:], self.peer))
            self._sent_meta = meta
        for t in tensors:
            handles.append(self.transport.isend(t.detach().contiguous(), self.peer))
        return handles

    def recv(self) -> Any:
        """Receive one object; float tensors flagged ``requires_grad`` come back as leaves
        that require grad."""
        device = self.transport.device
        tag = torch.zeros(1, dtype=torch.int64, device=device)
        self.transport.irecv(tag, self.peer).wait()
        if int(tag) > 0:
            meta = torch.empty(int(tag), dtype=torch.int64, device=device)
            self.transport.irecv(meta, self.peer).wait()
            self._recv_meta = decode(meta.tolist())
        elif self._recv_meta is None:
            raise DataError(f"rank {self.transport.rank} got no metadata from rank {self.peer}",
                            hint="both sides must use the same pipekernel wire protocol")
        specs, structure = self._recv_meta
        tensors = [torch.empty(shape, dtype=dtype, device=device) for dtype, _, shape in specs]
        handles = [self.transport.irecv(t, self.peer) for t in tensors]
        for handle in handles:
            handle.wait()
        for t, (_, grad, _) in zip(tensors, specs):
            t.requires_grad_(grad)
        return unflatten(tensors, structure)
