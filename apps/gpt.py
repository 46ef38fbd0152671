"""A small GPT-style byte-level language model as a pipekernel layer list.

Bytes, not a learned character table: the vocabulary (256) is the same on every
rank and every machine whatever the corpus, so no rank has to agree with another
on it, and any file (UTF-8 or not) can be trained on.

Long sequences (``seq_chunks``): the embeddings take a chunk's absolute positions and every
block's attention reads the keys and values of the chunks before it
(:func:`pipekernel.sequence_chunk`).

Packed rows (``pipekernel train --pack``): the layers also take the dict
:func:`pipekernel.pack` makes (``{"input_ids", "position_ids"}``); the embeddings read
the positions restarting per document and hand ``{"hidden", "documents"}`` on, so every
block, on whatever stage, attends within documents (:func:`pipekernel.document_mask`), and
:func:`packed_token_loss` counts the labelled tokens (``loss_reduction="tokens"``).
"""
from __future__ import annotations


import torch
from torch import nn
from torch.nn import functional as F

import pipekernel as pk
from pipekernel.stage.sequence import SequenceChunk

__all__ = ["VOCAB", "Embed", "Block", "MoEBlock", "Head", "gpt_layers", "gpt_module",
           "token_loss", "packed_token_loss", "generate"]

#: Byte-level vocabulary.
VOCAB = 256


class Embed(nn.Module):
    """Token + learned position embedding: ``(B, T) int64 -> (B, T, dim)``; a packed
    ``{"input_ids", "position_ids"}`` -> ``{"hidden", "documents"}``."""

    def __init__(self, vocab: int, dim: int, context: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(context, dim)
        nn.init.normal_(self.tokens.weight, std=0.02)
        nn.init.normal_(self.positions.weight, std=0.02)

    def forward(self, ids: torch.Tensor | dict) -> torch.Tensor | dict:
        if isinstance(ids, dict):  # a packed row: positions restart at every document
            pos = ids["position_ids"]
            return {"hidden": self.tokens(ids["input_ids"]) + self.positions(pos),
                    "documents": pk.document_ids(pos)}
        chunk = pk.sequence_chunk()  # a sequence chunk (seq_chunks): its own positions
        positions = chunk.positions(ids.shape[1], ids.device) if chunk is not None \
            else torch.arange(ids.shape[1], device=ids.device)
        return self.tokens(ids) + self.positions(positions)


class Block(nn.Module):
    """Pre-norm transformer block: causal multi-head self-attention, then an MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise pk.ConfigError(f"model width {dim} is not divisible by {heads} heads",
                                 hint="pick --dim as a multiple of --heads")
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp: nn.Module = self._mlp(dim)

    def _mlp(self, dim: int) -> nn.Module:
        return nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, h: torch.Tensor | dict) -> torch.Tensor | dict:
        chunk = pk.sequence_chunk()
        if isinstance(h, dict):  # packed: the boundaries came with the activations
            if chunk is not None:
                raise pk.ConfigError("packed rows with seq_chunks: the documents of the "
                                     "earlier chunks do not travel with the prefix",
                                     hint="train packed rows with seq_chunks=1")
            mask = pk.document_mask(h["documents"])
            return {**h, "hidden": self._block(h["hidden"], mask, None)}
        return self._block(h, None, chunk)

    def _block(self, h: torch.Tensor, mask: torch.Tensor | None,
               chunk: SequenceChunk | None) -> torch.Tensor:
        batch, length, dim = h.shape
        q, k, v = self.qkv(self.norm1(h)).split(dim, dim=-1)
        q, k, v = (t.view(batch, length, self.heads, dim // self.heads).transpose(1, 2)
                   for t in (q, k, v))
        if chunk is not None:  # a sequence chunk: the keys and values of those before too
            k, v = chunk.extend(self, k, v)
            if chunk.index:
                mask = pk.prefix_causal_mask(length, k.shape[-2], h.device)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        h = h + self.proj(attn.transpose(1, 2).reshape(batch, length, dim))
        return h + self.mlp(self.norm2(h))


class MoEBlock(Block):
    """A :class:`Block` whose MLP is a :class:`pipekernel.MoE` of ``experts`` experts
    (``top_k`` per token; its load-balancing loss goes through ``pk.add_aux_loss``)."""

    def __init__(self, dim: int, heads: int, experts: int, top_k: int = 2,
                 aux_loss_coef: float = 0.01) -> None:
        self._moe = (experts, top_k, aux_loss_coef)
        super().__init__(dim, heads)

    def _mlp(self, dim: int) -> nn.Module:
        experts, top_k, coef = self._moe
        return pk.MoE(dim, 2 * dim, experts, top_k=top_k, aux_loss_coef=coef)


class Head(nn.Module):
    """Final norm and projection to byte logits: ``(B, T, dim) -> (B, T, vocab)``."""

    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.norm, self.out = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, h: torch.Tensor | dict) -> torch.Tensor:
        pk.sequence_chunk()  # position-wise: runs on sequence chunks as on whole sequences
        return self.out(self.norm(h["hidden"] if isinstance(h, dict) else h))


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy over every position."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def packed_token_loss(logits: torch.Tensor, labels: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of the next-byte losses, labelled tokens)`` of packed rows, labels -100 at each
    document's end and on padding (``loss_reduction="tokens"``)."""
    labels = labels.reshape(-1)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels,
                           ignore_index=-100,
                           reduction="sum")
    return loss, (labels != -100).sum()


def gpt_layers(dim: int, layers: int, heads: int, context: int, *, experts: int = 0,
               top_k: int = 2) -> list[pk.LayerSpec]:
    """``[Embed, Block x layers, Head]`` as layer specs; with ``experts``, every block's
    MLP is a mixture of that many experts (:class:`MoEBlock`)."""
    block = [pk.LayerSpec(MoEBlock, dim, heads, experts, top_k) if experts
             else pk.LayerSpec(Block, dim, heads) for _ in range(layers)]
    return [pk.LayerSpec(Embed, VOCAB, dim, context), *block, pk.LayerSpec(Head, dim, VOCAB)]


def gpt_module(dim: int, layers: int, heads: int, context: int, *, num_stages: int | None,
               partition: object = "parameters", seed: int = 0, experts: int = 0,
               top_k: int = 2, pack: bool = False) -> pk.PipelineModule:
    """The model as a seeded :class:`pipekernel.PipelineModule` (``experts``: MoE blocks;
    ``pack``: trained on packed rows, :func:`packed_token_loss`)."""
    return pk.PipelineModule(gpt_layers(dim, layers, heads, context, experts=experts,
                                        top_k=top_k),
                             loss_fn=packed_token_loss if pack else token_loss,
                             num_stages=num_stages, partition=partition, seed=seed)


@torch.no_grad()
def generate(model: nn.Module, prompt: bytes, length: int, context: int, *,
             temperature: float = 0.8, seed: int = 0) -> bytes:
    """Sample ``length`` bytes after ``prompt`` from a full (single-stage) model."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.tensor(list(prompt) or [10], dtype=torch.long)[None]
    device = next(model.parameters()).device
    model.eval()
    out = []
    for _ in range(length):
        logits = model(ids[:, -context:].to(device))[0, -1].float().cpu()
        probs = torch.softmax(logits / max(temperature, 1e-6), dim=-1)
        nxt = torch.multinomial(probs, 1, generator=generator)
        out.append(int(nxt))
        ids = torch.cat([ids, nxt[None]], dim=1)
    return bytes(out)

