"""Refuse at build time what the pipeline would not reproduce: run it once, in one process.

:func:`probe` chains the pipeline's layers in this process on a tiny input and compares
their logits with the model's own ``forward``: whatever a family does that the layer chain
misses (an operation between its layers, something after its output projection that its
forward does not do through the shell, layers called out of order) is a ``ConfigError`` on
every rank before the first step, never a silent mismatch. With the model in memory the
probe borrows its modules (no copy) and compares numbers; with a meta model (a directory
or a config) it runs on the meta device, which proves the structure (the order of calls,
the chain of hidden states) but not the numbers.

:func:`probe_packed` runs the same chain on a packed row (two documents, ``position_ids``
restarting, no mask): what it cannot reproduce there is refused by name when a packed
micro-batch comes (the layers train unpacked batches as before).

:func:`check_config` refuses by name what a config asks for and the pipeline does not do.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pipekernel.errors import ConfigError
from pipekernel.model.aux_loss import aux_losses

__all__ = ["probe", "probe_packed", "check_config"]

_DOCS = "see docs/hf.md, 'What is refused'"
_UNSET = object()


def check_config(model: nn.Module) -> None:
    """Refuse a config whose training the pipeline does not reproduce, naming the option:
    ``layerdrop > 0`` (layers are skipped at random in training). A router auxiliary loss
    (``output_router_logits=True``) is :func:`pipekernel.hf.router.find_router_aux`'s.
    """
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    name = type(model).__name__
    for key, value in text.to_dict().items():
        if key.endswith("layerdrop") and isinstance(value, (int, float)) and value > 0:
            raise ConfigError(f"{name} has {key}={value}: its forward skips decoder layers at "
                              "random in training, which a pipeline of its layers cannot",
                              hint=f"set config.{key}=0; {_DOCS}")


def probe(model: nn.Module, chain: list, tied: bool, loss: bool = True) -> None:
    """Run ``chain`` (the pipeline's layers, built on ``model``'s own modules) on a tiny input
    and compare with ``model``'s forward; ``tied``: the last entry is ``(embed layer,
    forward_fn)``; ``loss``: the pipeline's loss is :func:`~pipekernel.hf.causal_lm_loss`,
    so the model's own loss must be that.

    :raises ConfigError: a layer's own check failed, or the logits differ.
    """
    param = next(iter(model.parameters()), None)
    meta = param is None or param.device.type == "meta"
    device = torch.device("meta") if meta else param.device
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.arange(1, 5, device=device).remainder(vocab)[None]
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    was = model.training
    model.eval()
    try:
        with torch.no_grad(), aux_losses() as aux:
            out = None if meta else model(**inputs, labels=ids)
            got = _run(chain, inputs, model, meta)
    finally:
        model.train(was)
    if got is not None:
        _compare(model, got, out.logits)
        if loss:
            _compare_loss(model, out, ids, sum(float(a) for a in aux))


def probe_packed(model: nn.Module, chain: list) -> str | None:
    """Why ``chain`` does not reproduce ``model``'s forward on a packed row, or ``None``
    (it does, or the meta device cannot tell). The row: two documents of three tokens,
    ``position_ids`` ``[0, 1, 2, 0, 1, 2]``, no ``attention_mask``, as
    ``DataCollatorWithFlattening`` yields; the forward runs with ``use_cache=False``, as
    HF's ``Trainer`` and TRL train (with a cache transformers does not split the documents).
    """
    param = next(iter(model.parameters()), None)
    if param is None or param.device.type == "meta":
        return None
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.arange(1, 7, device=param.device).remainder(vocab)[None]
    inputs = {"input_ids": ids, "position_ids": torch.arange(6, device=param.device)[None] % 3}
    was, cached = model.training, model.config.__dict__.get("use_cache", _UNSET)
    model.eval()
    model.config.use_cache = False  # as HF's Trainer sets it, whatever forward takes
    try:
        with torch.no_grad(), aux_losses():
            try:
                ref = model(**inputs).logits
            except Exception as e:  # noqa: BLE001 - the model itself cannot: say so
                return f"its own forward fails on a packed row ({type(e).__name__}: {e})"[:300]
            try:
                _compare(model, _run(chain, inputs, model, False), ref)
            except ConfigError as e:
                return f"on a packed row, {e.message}"
    finally:
        model.train(was)
        if cached is _UNSET:
            del model.config.use_cache
        else:
            model.config.use_cache = cached
    return None


def _run(chain: list, inputs: dict, model: nn.Module, meta: bool) -> torch.Tensor | None:
    """The chain's logits; ``None`` where the meta device cannot tell."""
    x: Any = inputs
    try:
        for layer in chain:
            x = layer[1](layer[0], x) if isinstance(layer, tuple) else layer(x)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the model's forward runs, its layers do not
        if meta:
            return None  # the meta device cannot run everything: no verdict
        raise ConfigError(f"{type(model).__name__}'s layers, run as a pipeline, fail where its "
                          f"forward runs: {type(e).__name__}: {e}"[:400],
                          hint="its decoder layers need something the base model's forward "
                               f"does not pass them (e.g. input_ids); {_DOCS}") from e
    return None if meta else x


def _compare_loss(model: nn.Module, out: Any, labels: torch.Tensor, aux: float) -> None:
    """The model's own loss is the shifted causal-LM loss the pipeline computes (plus the
    auxiliary losses its layers added, ``aux``)."""
    from pipekernel.hf.loss import causal_lm_loss
    if getattr(out, "loss", None) is None:
        return
    total, count = causal_lm_loss(out.logits, labels)
    mine, theirs = (total / count).item() + aux, out.loss.float().item()
    if abs(mine - theirs) > 1e-4 * max(1.0, abs(theirs)):
        raise ConfigError(f"{type(model).__name__}.forward's loss ({theirs:.6g} on the probe) is "
                          f"not the shifted causal-LM loss the pipeline computes ({mine:.6g})",
                          hint="pass loss_fn=... to pipeline_module computing the model's loss "
                               f"from (logits, labels); {_DOCS}")


def _compare(model: nn.Module, got: torch.Tensor, ref: torch.Tensor) -> None:
    name = type(model).__name__
    if got.shape != ref.shape:
        raise ConfigError(f"the pipeline's logits have shape {tuple(got.shape)}, "
                          f"{name}.forward's {tuple(ref.shape)}", hint=_DOCS)
    scale = ref.abs().max().item() or 1.0
    diff = (got.float() - ref.float()).abs().max().item()
    tolerance = 1e-4 if ref.dtype == torch.float32 else 3e-2
    if diff > tolerance * scale:
        raise ConfigError(f"the pipeline's logits differ from {name}.forward's by {diff:.3g} "
                          f"(largest logit {scale:.3g}): the model computes something the "
                          "chain of its layers does not reproduce",
                          hint=f"write the model as LayerSpecs; {_DOCS}")
