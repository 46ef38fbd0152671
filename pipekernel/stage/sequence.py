"""Sequence chunks of a micro-batch and the KV prefix their attention reads (Seq1F1B).

With ``seq_chunks=k`` (:class:`~pipekernel.schedules.sequence.Seq1F1B`) every micro-batch
is cut along dim 1 into ``k`` equal chunks (:func:`split_sequences`) that go through the
pipeline one after the other. A layer learns which chunk it runs on from
:func:`sequence_chunk` — ``None`` outside a chunked forward, so the same layer runs whole
sequences as before — and a causal attention layer reads the keys and values of the
chunks before it with :meth:`SequenceChunk.extend`::

    chunk = pk.sequence_chunk()
    if chunk is not None:
        k, v = chunk.extend(self, k, v)        # (.., prefix + length, d)
        mask = pk.prefix_causal_mask(q.shape[-2], k.shape[-2], q.device)

**Exact gradients.** ``extend`` keeps, per layer and chunk, the chunk's keys and values
twice: as computed (in the chunk's autograd graph) and as a detached leaf that the later
chunks concatenate. A later chunk's backward (they run first: the backward goes in reverse
chunk order) accumulates its gradient into the leaf's ``.grad``; the chunk's own backward
then starts from its outputs *and* from its keys and values with those gradients
(:meth:`KVPrefix.roots`), so every gradient is the one the unsplit micro-batch gets. A
chunk's entries are dropped after its backward, the micro-batch's prefix after chunk 0's.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch

from pipekernel.errors import ConfigError, DataError, PipelineError
from pipekernel.nested import map_tensors, tensors_of

__all__ = ["SequenceChunk", "KVPrefix", "sequence_chunk", "prefix_causal_mask",
           "split_sequences", "chunk_scope"]

_CURRENT: contextvars.ContextVar[SequenceChunk | None] = contextvars.ContextVar(
    "pipekernel_sequence_chunk", default=None)


class KVPrefix:
    """One micro-batch's keys and values on one stage: per layer, one entry per chunk
    forwarded so far, ``(key leaf, value leaf, key, value)`` (the last two ``None`` without
    autograd). Held by the stage runtime from chunk 0's forward to chunk 0's backward."""

    __slots__ = ("layers",)

    def __init__(self) -> None:
        self.layers: dict[Any, list[tuple | None]] = {}

    def roots(self, chunk: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """What chunk ``chunk``'s backward starts from besides its outputs: its keys and
        values, with the gradients the later chunks accumulated into their leaves."""
        tensors, grads = [], []
        for entries in self.layers.values():
            entry = entries[chunk] if chunk < len(entries) else None
            if entry is None or entry[2] is None:
                continue
            for leaf, computed in ((entry[0], entry[2]), (entry[1], entry[3])):
                if leaf.grad is not None and computed.requires_grad:
                    tensors.append(computed)
                    grads.append(leaf.grad)
        return tensors, grads

    def release(self, chunk: int) -> None:
        """Forget chunk ``chunk``'s entries (its backward ran)."""
        for entries in self.layers.values():
            if chunk < len(entries):
                entries[chunk] = None

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor held (the leaves' accumulated gradients too), for the ledger."""
        held = []
        for entries in self.layers.values():
            for entry in entries:
                if entry is not None:
                    held += [t for t in entry if t is not None]
                    held += [t.grad for t in entry[:2] if t.grad is not None]
        return held


class SequenceChunk:
    """Chunk ``index`` of ``count`` of the micro-batch a stage is forwarding, with the
    micro-batch's :class:`KVPrefix` on this stage. ``asked`` says whether a layer read it
    (the runtime refuses a stage whose layers never do: see :func:`chunk_scope`)."""

    __slots__ = ("index", "count", "prefix", "asked")

    def __init__(self, index: int, count: int, prefix: KVPrefix) -> None:
        self.index, self.count, self.prefix, self.asked = index, count, prefix, False

    def positions(self, length: int, device: Any = None) -> torch.Tensor:
        """Absolute positions of this chunk's ``length`` tokens (chunks are equal):
        ``index * length .. (index + 1) * length - 1``."""
        start = self.index * length
        return torch.arange(start, start + length, device=device)

    def extend(self, layer: Any, key: torch.Tensor, value: torch.Tensor, dim: int = -2
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s keys and values of the chunks before this one and of this one,
        concatenated along ``dim`` (the sequence dimension); keeps this chunk's for the
        later ones. ``layer`` names the attention (any hashable: the module itself).

        :raises PipelineError: ``layer`` called out of chunk order (twice in one chunk's
            forward, or a chunk skipped)."""
        entries = self.prefix.layers.setdefault(layer, [])
        if len(entries) != self.index:
            raise PipelineError(
                f"sequence chunk {self.index}: {type(layer).__name__} extended its key/value "
                f"prefix {len(entries)} time(s) before, expected {self.index}",
                hint="call SequenceChunk.extend once per attention layer and chunk, with "
                     "the layer itself as its name")
        if torch.is_grad_enabled() and (key.requires_grad or value.requires_grad):
            entries.append((key.detach().requires_grad_(key.requires_grad),
                            value.detach().requires_grad_(value.requires_grad), key, value))
        else:
            entries.append((key.detach(), value.detach(), None, None))
        if not self.index:
            return key, value
        keys, values = [], []
        for entry in entries[:-1]:
            if entry is None:  # released: that chunk's backward ran
                raise PipelineError(
                    f"sequence chunk {self.index}: an earlier chunk's backward ran before "
                    f"this forward", hint="run every forward of a micro-batch's chunks "
                                          "before their backwards (Seq1F1B does)")
            keys.append(entry[0])
            values.append(entry[1])
        return torch.cat([*keys, key], dim), torch.cat([*values, value], dim)


def sequence_chunk() -> SequenceChunk | None:
    """The sequence chunk being forwarded on this stage (``seq_chunks > 1``), else ``None``."""
    chunk = _CURRENT.get()
    if chunk is not None:
        chunk.asked = True
    return chunk


def prefix_causal_mask(queries: int, keys: int, device: Any = None) -> torch.Tensor:
    """``(queries, keys)`` bools for ``scaled_dot_product_attention``'s ``attn_mask``: the
    last ``queries`` positions of ``keys`` attend causally (query ``i`` sees keys
    ``<= keys - queries + i``). ``is_causal=True`` would align them at the top instead."""
    rows = torch.arange(queries, device=device)[:, None] + (keys - queries)
    return torch.arange(keys, device=device)[None, :] <= rows


@contextlib.contextmanager
def chunk_scope(chunk: SequenceChunk, stage: int, unit: int) -> Iterator[None]:
    """:func:`sequence_chunk` answers ``chunk`` inside; a forward in which no layer of the
    stage asked is refused — its attention would see this chunk alone."""
    token = _CURRENT.set(chunk)
    try:
        yield
    finally:
        _CURRENT.reset(token)
    if not chunk.asked:
        raise ConfigError(
            f"stage {stage}: no layer read pk.sequence_chunk() in the forward of sequence "
            f"chunk {chunk.index} of {chunk.count} (unit {unit}): an attention that cannot "
            f"take the key/value prefix of the earlier chunks would attend within the "
            f"chunk alone and train another model", stage=stage,
            hint="train with seq_chunks=1, or make the stage's attention read the prefix "
                 "(pk.sequence_chunk().extend(self, k, v), docs/sequences.md); a stage of "
                 "position-wise layers only says it runs on chunks by calling "
                 "pk.sequence_chunk() in one of them")


def split_sequences(data_iter: Iterator, seq_chunks: int,
                    mean_loss: bool = False) -> Iterator[tuple[Any, Any]]:
    """Each ``(inputs, labels)`` of ``data_iter`` as ``seq_chunks`` pairs, every tensor of
    two or more dimensions cut into equal chunks along dim 1 (the sequence); other values
    (1-D tensors, non-tensors) go with every chunk.

    :param mean_loss: the loss is ``loss_reduction="mean"``: a micro-batch's loss is then
        the mean of its chunks' means, the sequence's mean only when every chunk counts as
        many labels, so chunks that count different numbers of ``-100`` are refused.
    :raises DataError: sequence lengths that differ within a micro-batch, or one that
        ``seq_chunks`` does not divide; with ``mean_loss``, ignored labels (``-100``)
        spread unevenly over the chunks."""
    for index, item in enumerate(data_iter):
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            yield item  # the runtime names what is wrong with it
            continue
        length = _length(item, index, seq_chunks)
        size = length // seq_chunks if length else 0
        chunks = [tuple(map_tensors(lambda t: t.narrow(1, j * size, size)
                                    if t.dim() >= 2 else t, part) for part in item)
                  for j in range(seq_chunks)]
        if mean_loss:
            _check_even_labels(chunks, index, seq_chunks)
        yield from chunks


def _check_even_labels(chunks: list[tuple[Any, ...]], index: int, seq_chunks: int) -> None:
    """Under a mean loss, every chunk of micro-batch ``index`` counts as many labels that
    are not ``-100`` (the ignore index of torch's and Hugging Face's losses)."""
    counts = [sum(int((t != -100).sum()) for t in tensors_of(chunk[1])
                  if t.dim() >= 2 and not t.is_floating_point()) for chunk in chunks]
    if len(set(counts)) > 1:
        raise DataError(f"micro-batch {index}: its {seq_chunks} sequence chunks count "
                        f"{counts} labels that are not -100; under loss_reduction='mean' a "
                        f"micro-batch's loss would be the mean of its chunks' means, not "
                        f"the sequence's mean, and train another model",
                        hint="pass loss_reduction='tokens' (the loss_fn returns the sum "
                             "and the label count, docs/sequences.md), or seq_chunks=1")


def _length(item: Any, index: int, seq_chunks: int) -> int:
    """The sequence length (dim 1) every 2-D-or-more tensor of ``item`` shares."""
    lengths = {t.shape[1] for t in tensors_of(item) if t.dim() >= 2}
    if len(lengths) > 1:
        raise DataError(f"micro-batch {index}: its tensors have sequence lengths (dim 1) "
                        f"{sorted(lengths)}; seq_chunks={seq_chunks} cuts them all alike",
                        hint="give every tensor of two or more dimensions the sequence "
                             "along dim 1, with one length per micro-batch")
    length = lengths.pop() if lengths else 0
    if length % seq_chunks:
        fits = length - length % seq_chunks
        raise DataError(f"micro-batch {index}: sequence length {length} is not a multiple "
                        f"of seq_chunks={seq_chunks} (no remainder chunk: every chunk has "
                        f"the same length)",
                        hint=f"pad or cut the sequences to a multiple of {seq_chunks} (e.g. "
                             f"{fits} or {fits + seq_chunks}, padding labelled -100 under "
                             f"loss_reduction='tokens'), or pick a seq_chunks that divides "
                             f"{length}")
    return length
