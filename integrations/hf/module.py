"""``pipeline_module``: a Hugging Face causal LM as a :class:`~pipekernel.PipelineModule`.

The layer list (see :mod:`pipekernel.hf.layers`): the input embeddings, every decoder
layer (the first with the prologue: what the base model computes before its layers; the
last with the epilogue: the final norm), the output projection. Each is a ``LayerSpec`` whose factory asks the weight source
(:mod:`pipekernel.hf.weights`) for its own modules only, so a stage materialises its own
layers and nothing else. Tied input/output embeddings are one ``TiedLayerSpec`` key.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from pipekernel.grid import expert_parallel
from pipekernel.model.module import LayerSpec, PipelineModule, TiedLayerSpec

from pipekernel.hf.batches import split_batch
from pipekernel.hf.experts import check_model, shard_experts
from pipekernel.hf.head import Head, TiedHead
from pipekernel.hf import prefix as prefixes
from pipekernel.hf.layers import Chain, Decoder, Embed, Epilogue, Prologue, embed_tokens
from pipekernel.hf.loss import causal_lm_loss, causal_lm_mean_loss
from pipekernel.hf.probe import check_config, probe, probe_packed
from pipekernel.hf.router import RouterAux, find_router_aux
from pipekernel.hf.structure import Structure, find_structure
from pipekernel.hf.weights import make_source

__all__ = ["pipeline_module", "HFPipelineModule"]

#: The tied-layer key of tied input/output embeddings.
TIED_KEY = "embeddings"


class HFPipelineModule(PipelineModule):
    """A :class:`~pipekernel.PipelineModule` made by :func:`pipeline_module`, with what
    :func:`~pipekernel.hf.save_pretrained` needs: the config and the structure.

    :ivar config: the model's ``transformers`` config.
    :ivar structure: the :class:`~pipekernel.hf.structure.Structure` found.
    :ivar source: the weight source (``source.bytes_read``: checkpoint bytes read so far).
    :ivar router_aux: the router auxiliary loss the layers carry and add
        (:mod:`pipekernel.hf.router`), ``None`` when the model's forward adds none.
    :ivar packing_refused: why packed rows are refused (the build-time probe found that
        the pipeline does not reproduce the model's forward on one), ``None`` when they train.
    :ivar sequence_chunks_refused: why the engine's ``seq_chunks > 1`` is refused, ``None``
        when the family's layers reproduce the whole sequence in chunks. Decided on first
        read (the engine reads it only for ``seq_chunks > 1``) by
        :func:`~pipekernel.hf.prefix.probe_chunks`: the family's own layers, run whole and in
        chunks through a key/value prefix cache, must give the same outputs and gradients.
    """

    config: Any
    structure: Structure
    source: Any
    router_aux: RouterAux | None
    packing_refused: str | None
    _chunks_probe: Callable[[], str | None] | None = None
    _chunks_refused: str | None = None

    @property  # type: ignore[override]
    def sequence_chunks_refused(self) -> str | None:
        if self._chunks_probe is not None:  # once, on first read: every rank alike
            probe_once, self._chunks_probe = self._chunks_probe, None
            self._chunks_refused = probe_once()
        return self._chunks_refused

    @sequence_chunks_refused.setter
    def sequence_chunks_refused(self, value: str | None) -> None:
        self._chunks_probe, self._chunks_refused = None, value


def pipeline_module(model_or_path: Any, *, num_stages: int | None = None,
                    partition: Any = "parameters", layers: str | None = None,
                    tail: Sequence[str] | None = None, check: bool = True,
                    **options: Any) -> HFPipelineModule:
    """A pipeline of a Hugging Face decoder-only causal LM, found by its structure.

    :param model_or_path: a ``*ForCausalLM`` model (its modules are copied, it stays
        untouched), a ``save_pretrained`` directory (each stage reads only its own
        tensors from the safetensors files) or a ``transformers`` config (random weights,
        drawn by the model's ``_init_weights`` under ``seed``).
    :param num_stages: pipeline stages (default: the engine's world size / replicas).
    :param partition: as :class:`~pipekernel.PipelineModule` (default ``"parameters"``).
    :param layers: the path of the decoder layers' ``ModuleList``, when the search does
        not find exactly one (e.g. ``"model.layers"``).
    :param tail: the base model's children that run after the layers, in order, when
        HF's ``base_model_pp_plan``, the base model's ``forward`` source and the registration
        order do not say (e.g. ``["model.decoder.final_layer_norm"]``).
    :param check: run the layers once at build time on a tiny input against the model's own
        ``forward`` (:func:`~pipekernel.hf.probe.probe`: numbers with a model in memory, the
        structure with a directory or a config), so what cannot be reproduced is refused on
        every rank before the first step; and once on a packed row
        (:func:`~pipekernel.hf.probe.probe_packed`): where that differs, packed micro-batches
        are refused by name (``module.packing_refused`` says why).
    :param options: further :class:`~pipekernel.PipelineModule` options (``seed``,
        ``activation_checkpoint_interval``); ``loss_fn`` defaults to
        :func:`~pipekernel.hf.causal_lm_loss` (use ``loss_reduction="tokens"`` in the engine)
        and ``batch_fn`` to :func:`~pipekernel.hf.split_batch`.
    :raises ConfigError: the model is not a decoder-only causal LM this can split, naming
        the piece that was not found, or it does something the pipeline would not reproduce
        (MoE router auxiliary losses, layer drop, logits that differ from its forward's).

    The layers: ``[embeddings, prologue + decoder 0, decoder 1, ..., decoder N-1 + epilogue,
    head]`` (every layer holds parameters; see :mod:`pipekernel.hf.layers`).
    """
    given = dict(options)
    source = make_source(model_or_path)
    structure = find_structure(source.model, layers=layers, tail=tail)
    check_config(source.model)
    router = find_router_aux(source.model, structure.base, structure.layers,
                             structure.num_layers)
    refused = None
    if check:
        chain = _chain(_layer_specs(_Borrowed(source.model), structure, router))
        probe(source.model, chain, structure.tied, loss="loss_fn" not in options)
        refused = probe_packed(source.model, chain)
        if refused is not None:
            refused = f"{type(source.model).__name__}: {refused}"
    specs = _layer_specs(source, structure, router)
    # with a router aux loss the objective is the model's own per-micro-batch loss, the
    # token mean plus the aux loss (loss_reduction="mean"; see docs/hf.md)
    options.setdefault("loss_fn", causal_lm_loss if router is None else causal_lm_mean_loss)
    options.setdefault("batch_fn", split_batch if refused is None
                       else functools.partial(split_batch, refuse_packed=refused))
    module = HFPipelineModule(specs, num_stages=num_stages, partition=partition, **options)
    module.config, module.structure, module.source = source.config, structure, source
    module.router_aux, module.packing_refused = router, refused
    module._chunks_probe = functools.partial(_chunks_verdict, source, structure, router,
                                             custom_loss="loss_fn" in given)
    module.sequence_chunk_fn = prefixes.prepare_chunks
    return module


def _chunks_verdict(source: Any, s: Structure, router: RouterAux | None,
                    custom_loss: bool) -> str | None:
    """Why ``seq_chunks > 1`` is refused for this model, or ``None``
    (:func:`~pipekernel.hf.prefix.probe_chunks` on its own layers)."""
    name = type(source.model).__name__
    if custom_loss:
        return (f"{name}: a loss_fn of your own gets each chunk's logits and labels alone, "
                f"and Hugging Face style labels are shifted inside the loss, so the "
                f"prediction across every cut would be lost; the default causal_lm_loss "
                f"takes the labels shifted before the cut")
    if router is not None:
        return (f"{name}: its router auxiliary loss is a mean over the micro-batch's tokens, "
                f"which each chunk would take over its own tokens alone")
    param = next(iter(source.model.parameters()), None)
    lender = source if param is None or param.device.type == "meta" \
        else _Borrowed(source.model)

    def layers() -> Any:
        base = source.model.get_submodule(s.base) if s.base else source.model
        yield (f"{s.layers}.0 (with {type(base).__name__}.forward)",
               Prologue(base, s.base, {p: lender.build(p) for p in s.prologue}, s.layers,
                        s.num_layers, s.embed, s.tail, lender.build(f"{s.layers}.0")))
        for j in range(1, s.num_layers):
            path = f"{s.layers}.{j}"
            yield path, Decoder(path, lender.build(path), j)

    hidden = source.model.get_input_embeddings().weight.shape[1]
    return prefixes.probe_chunks(name, hidden, layers(), source.config)


def _layer_specs(source: Any, s: Structure, router: RouterAux | None) -> list[LayerSpec]:
    def check() -> None:  # every stage builds a layer: every rank refuses alike
        check_model(source.model, s.layers, s.num_layers, expert_parallel.group().size)

    def embed() -> nn.Module:
        check()
        return Embed(s.embed, source.build(s.embed))

    def prologue(first: nn.Module) -> nn.Module:
        base = source.model.get_submodule(s.base) if s.base else source.model
        return Prologue(base, s.base, {p: source.build(p) for p in s.prologue}, s.layers,
                        s.num_layers, s.embed, s.tail, first, router)

    def decoder(j: int) -> Callable[[], nn.Module]:
        def make() -> nn.Module:
            check()
            path = f"{s.layers}.{j}"
            module = source.build(path)
            shard_experts(module, path, getattr(source, "config", None))
            parts = [prologue(module) if j == 0 else Decoder(path, module, j, router)]
            if j == s.num_layers - 1:
                parts.append(Epilogue({p: source.build(p) for p in s.tail}, router))
            return Chain(parts) if len(parts) > 1 else parts[0]
        make.__name__ = f"Decoder{j}"
        return make

    def head() -> nn.Module:
        check()
        return Head(source.model, s.base, s.lm_head, source.build(s.lm_head))

    for fn, name in ((embed, "Embed"), (head, "Head")):
        fn.__name__ = name
    first = TiedLayerSpec(TIED_KEY, embed, forward_fn=embed_tokens) if s.tied else LayerSpec(embed)
    last = TiedLayerSpec(TIED_KEY, embed, forward_fn=TiedHead(source.model, s.base, s.lm_head)) \
        if s.tied else LayerSpec(head)
    return [first, *(LayerSpec(decoder(j)) for j in range(s.num_layers)), last]


class _Borrowed:
    """A source lending the model's own modules (the build-time probe copies nothing)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def build(self, path: str) -> nn.Module:
        return self.model.get_submodule(path)


def _chain(specs: list[LayerSpec]) -> list[Any]:
    """The layers of ``specs`` built once each; a tied occurrence as ``(module, forward_fn)``."""
    built: dict[str, nn.Module] = {}
    chain: list[Any] = []
    for spec in specs:
        if isinstance(spec, TiedLayerSpec):
            layer = built.setdefault(spec.key, spec.build())
            chain.append((layer, spec.forward_fn) if spec.forward_fn else layer)
        else:
            chain.append(spec.build())
    return chain
