"""Sequence chunks (Seq1F1B) for Hugging Face families: a key/value prefix cache adapter.

Under ``seq_chunks=k`` every micro-batch reaches the stages as ``k`` chunks in order
(:mod:`pipekernel.stage.sequence`). A Hugging Face attention reads the keys and values of
earlier tokens through the ``Cache`` it is handed (``cache`` / ``past_key_values``): it calls
``cache.update(key, value, layer_idx)`` and attends over what comes back, and the base model
offsets the positions (``position_ids``, rotary) and the causal mask by
``cache.get_seq_length()`` / ``cache.get_mask_sizes()``. :class:`PrefixCache` is such a cache
whose ``update`` is :meth:`SequenceChunk.extend <pipekernel.stage.sequence.SequenceChunk.extend>`:
the earlier chunks' keys and values joined with this chunk's, kept with their autograd graph,
so the gradients reach the earlier chunks exactly as for pipekernel's own attention; and whose
lengths are the prefix's (``chunk index * chunk length``), so every position and mask is the
one the whole sequence gets. Nothing is detached and nothing is cached across micro-batches.

Whether a family's attention really reads it so is not assumed: :func:`probe_chunks` runs the
family's own layers on a small random batch whole and in 2 and 4 chunks and compares outputs
and gradients (``pipeline_module`` asks it when ``seq_chunks > 1`` is first requested). A family
that differs (a recurrent state, a cache type of its own, positions from somewhere else) is
refused by name with what the probe found.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin

from pipekernel.errors import ConfigError, DataError
from pipekernel.stage.sequence import KVPrefix, SequenceChunk, chunk_scope

from pipekernel.hf.loss import SHIFTED
from pipekernel.hf.packing import FLASH_KEYS, document_starts

__all__ = ["PrefixCache", "cache_kwarg", "with_mask_prefix", "shift_labels", "prepare_chunks",
           "probe_chunks"]

#: The keyword a decoder layer / base model takes its cache by (transformers 5.x, then 4.x).
CACHE_KWARGS = ("cache", "past_key_values")
_MASK = "pipekernel.hf.attention_mask"


class _PrefixLayer(CacheLayerMixin):
    """One attention layer's view of the prefix: ``update`` joins the earlier chunks' keys
    and values with these (:meth:`SequenceChunk.extend`), the lengths are the prefix's."""

    is_sliding = False

    def __init__(self, chunk: SequenceChunk, index: int, past: int) -> None:
        super().__init__()
        self.chunk, self.index, self.past = chunk, index, past

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        # keyed by the layer index: a stage's KVPrefix is its own, the index is unique on it
        return self.chunk.extend(("hf", self.index), key_states, value_states, dim=-2)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.past + query_length, 0

    def get_seq_length(self) -> int:
        return self.past

    def get_max_length(self) -> int:
        return -1


class PrefixCache(Cache):
    """The ``Cache`` a chunk's decoder layers are handed: layer ``i``'s ``update`` extends
    the micro-batch's key/value prefix on this stage; every length is ``past`` (the tokens of
    the earlier chunks).

    :param chunk: the chunk being forwarded (:func:`pipekernel.sequence_chunk`).
    :param layers: how many layer indices it answers (``0 .. layers - 1``).
    :param past: the earlier chunks' tokens (``chunk.index * chunk length``).
    """

    def __init__(self, chunk: SequenceChunk, layers: int, past: int) -> None:
        super().__init__(layers=[_PrefixLayer(chunk, i, past) for i in range(layers)])
        self.past = past


def cache_kwarg(fn: Callable[..., Any]) -> str | None:
    """The keyword ``fn`` takes a cache by (``cache``, or ``past_key_values`` before
    transformers 5.x), ``None`` when it takes none."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    return next((name for name in CACHE_KWARGS if name in params), None)


def with_mask_prefix(chunk: SequenceChunk, inputs: dict[str, Any]) -> dict[str, Any]:
    """``inputs`` with a 2-D ``attention_mask`` (padding) joined to the earlier chunks':
    with a cache, transformers reads the mask over the keys, prefix included."""
    mask = inputs.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return inputs
    joined, _ = chunk.extend(_MASK, mask, mask, dim=-1)
    return {**inputs, "attention_mask": joined}


def shift_labels(item: Any) -> Any:
    """``(inputs, labels)`` -> ``(inputs, {SHIFTED: labels[:, 1:] then -100})``: the label
    each position predicts, so that cutting the sequence into chunks keeps every prediction
    across a chunk boundary (:func:`~pipekernel.hf.causal_lm_loss` takes either form)."""
    if not (isinstance(item, tuple) and len(item) == 2):
        return item
    inputs, labels = item
    if not isinstance(labels, torch.Tensor) or labels.dim() < 2:
        return item
    tail = torch.full_like(labels[:, :1], -100)
    return inputs, {SHIFTED: torch.cat([labels[:, 1:], tail], dim=1)}


def prepare_chunks(item: Any) -> Any:
    """A micro-batch ``(inputs, labels)`` about to be cut into sequence chunks: refuse what
    the chunks cannot reproduce, shift the labels (:func:`shift_labels`).

    :raises DataError: packed rows (``position_ids`` restarting inside a row: with a cache,
        transformers masks across documents) or flash-attention keys (they describe the
        whole row, not a chunk)."""
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], Mapping):
        inputs = item[0]
        flash = [k for k in FLASH_KEYS if inputs.get(k) is not None]
        pos = inputs.get("position_ids")
        if flash or (isinstance(pos, torch.Tensor) and pos.dim() >= 1 and pos.shape[-1] > 1
                     and bool(document_starts(pos).any())):
            raise DataError(
                "packed rows (several documents per row: position_ids restarting"
                f"{', ' + ', '.join(flash) if flash else ''}) with seq_chunks > 1: a chunk "
                "reads the earlier chunks through a key/value cache, and with a cache "
                "transformers masks across the documents of a row",
                hint="train packed rows with seq_chunks=1, or long unpacked rows with "
                     "seq_chunks (docs/sequences.md)")
    return shift_labels(item)


# ---------------------------------------------------------------------------- the probe

def probe_chunks(name: str, hidden_size: int, layers: Iterator[tuple[str, nn.Module]],
                 config: Any, length: int = 8) -> str | None:
    """Why the family's layers do not reproduce the whole sequence in chunks, or ``None``.

    :param layers: ``(path, layer)`` in order: first the prologue (the base model's forward
        with decoder layer 0), then each later decoder layer (:class:`~pipekernel.hf.layers.
        Decoder`); each is made when asked and dropped after its check, so at most one
        decoder layer is held (a model read from a directory is read layer by layer).

    Each layer runs on a random ``(2, length)`` batch (the second row right-padded) whole and
    in 2 and 4 chunks, the backward of the chunks in reverse as Seq1F1B runs them; outputs,
    input gradients and parameter gradients must agree (fp32: 1e-6 of the largest value on
    the CPU, 1e-4 on an accelerator, whose kernels may differ with a mask; 16-bit: 3e-2). A
    configured attention window is narrowed to 3 tokens for the probe, so that windows
    across chunk boundaries are checked.
    """
    restore = _narrow_window(config)
    try:
        return _probe(name, hidden_size, layers, length)
    finally:
        restore()


def _probe(name: str, hidden_size: int, layers: Iterator[tuple[str, nn.Module]],
           length: int) -> str | None:
    gen = torch.Generator().manual_seed(0)
    whole_x: dict[str, Any] = {}
    chunked_x: dict[int, list[dict[str, Any]]] = {}
    hidden_key = "inputs_embeds"
    for path, layer in layers:
        if not whole_x:  # the prologue's parameters say the device and dtype
            param = next(iter(layer.parameters()), None)
            device = param.device if param is not None else torch.device("cpu")
            dtype = param.dtype if param is not None and param.is_floating_point() \
                else torch.float32
            embeds = torch.randn(2, length, hidden_size, generator=gen).to(device, dtype)
            mask = torch.ones(2, length, dtype=torch.long, device=device)
            mask[1, -2:] = 0  # a right-padded row: the padding mask must cover the prefix
            whole_x = {"inputs_embeds": embeds, "attention_mask": mask}
            chunked_x = {k: [{"inputs_embeds": embeds[:, j * length // k:(j + 1) * length // k],
                              "attention_mask": mask[:, j * length // k:(j + 1) * length // k]}
                             for j in range(k)] for k in (2, 4)}
        outs: dict[Any, Any] = {}
        try:
            why = _check_layer(layer, whole_x, chunked_x, hidden_key, gen, dtype, outs)
        except ConfigError as e:
            why = e.message
        except Exception as e:  # noqa: BLE001 - the family's own code refuses a cache: say so
            why = f"{type(e).__name__}: {e}"
        if why is not None:
            return (f"{name}: {path} run in sequence chunks through a key/value prefix cache "
                    f"does not reproduce the whole sequence ({why})")[:600]
        if hidden_key == "inputs_embeds":  # the prologue ran: the later layers take its dict
            whole_x = _detached(outs[None])
            chunked_x = {k: [_detached(o) for o in outs[k]] for k in chunked_x}
            hidden_key = "hidden"
    return None


def _check_layer(layer: nn.Module, whole_x: dict[str, Any],
                 chunked_x: dict[int, list[dict[str, Any]]], hidden_key: str,
                 gen: torch.Generator, dtype: torch.dtype, outs: dict[Any, Any]) -> str | None:
    """Whether ``layer`` gives the same outputs and gradients whole and in chunks; its
    outputs (the prologue's dict, for the later layers) go into ``outs`` (``None``: whole,
    ``k``: the ``k`` chunks')."""
    was = layer.training
    layer.eval()  # no dropout: the two runs must draw nothing
    params = [p for p in layer.parameters() if p.requires_grad]
    saved = [p.grad for p in params]
    try:
        hidden = whole_x[hidden_key].detach().clone().requires_grad_(True)
        out = layer({**whole_x, hidden_key: hidden})
        result = _hidden_of(out)
        grad_out = torch.randn(result.shape, generator=gen).to(result.device, result.dtype)
        for p in params:
            p.grad = None
        torch.autograd.backward([result], [grad_out])
        ref = [result.detach(), hidden.grad, *(_grad(p) for p in params)]
        outs[None] = out
        for k, parts in chunked_x.items():
            for p in params:
                p.grad = None
            size = result.shape[1] // k
            prefix = KVPrefix()
            leaves, chunk_outs, results = [], [], []
            for j, x in enumerate(parts):
                leaf = x[hidden_key].detach().clone().requires_grad_(True)
                chunk = SequenceChunk(j, k, prefix)
                with chunk_scope(chunk, 0, j):
                    o = layer({**x, hidden_key: leaf})
                leaves.append(leaf)
                chunk_outs.append(o)
                results.append(_hidden_of(o))
            for j in reversed(range(k)):  # Seq1F1B's order: the later chunks first
                tensors, grads = prefix.roots(j)
                torch.autograd.backward(
                    [results[j], *tensors],
                    [grad_out[:, j * size:(j + 1) * size], *grads])
                prefix.release(j)
            got = [torch.cat([r.detach() for r in results], 1),
                   torch.cat([leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                              for leaf in leaves], 1),
                   *(_grad(p) for p in params)]
            outs[k] = chunk_outs
            for j, (a, b) in enumerate(zip(ref, got)):
                why = _differ(a, b, dtype)
                if why:
                    what = ("outputs", "input gradients")[j] if j < 2 else "parameter gradients"
                    return f"k={k}: {what} {why}"
        return None
    finally:
        for p, g in zip(params, saved):
            p.grad = g
        layer.train(was)


def _grad(p: torch.Tensor) -> torch.Tensor:
    return p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)


def _hidden_of(out: Any) -> torch.Tensor:
    hidden = out["hidden"] if isinstance(out, Mapping) else out
    return hidden[0] if isinstance(hidden, (tuple, list)) else hidden


def _detached(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {k: _detached(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_detached(v) for v in x)
    return x.detach() if isinstance(x, torch.Tensor) else x


def _differ(ref: torch.Tensor, got: torch.Tensor, dtype: torch.dtype) -> str | None:
    if ref.shape != got.shape:
        return f"have shape {tuple(got.shape)}, whole {tuple(ref.shape)}"
    scale = max(1.0, ref.abs().max().item())
    diff = (ref.float() - got.float()).abs().max().item()
    # fp32 on the CPU: the same kernels whole and chunked, ~1e-7 apart. Elsewhere the chunks
    # may take other kernels than the whole sequence (a fused attention with a mask and
    # without, TF32 matmuls): a mismatch of structure (a prefix ignored, positions not
    # offset) is still far above these (0.04 for Llama's positions not offset, fp32)
    tolerance = (1e-6 if ref.device.type == "cpu" else 1e-4) if dtype == torch.float32 \
        else 3e-2
    if not diff <= tolerance * scale:  # NaN differs too
        return f"differ by {diff:.3g} (largest {scale:.3g})"
    return None


def _narrow_window(config: Any) -> Callable[[], None]:
    """Set an attention window of the (text) config to 3 tokens; returns the undo."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    old = getattr(text, "sliding_window", None)
    if not isinstance(old, int) or isinstance(old, bool) or old <= 3:
        return lambda: None
    text.sliding_window = 3

    def undo() -> None:
        text.sliding_window = old
    return undo
