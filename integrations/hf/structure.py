"""Find the pieces of a decoder-only causal LM from its module tree, not its class name.

What a Hugging Face causal LM looks like, whatever the family (Llama, Mistral, Qwen, Gemma,
Phi-3, GPT-2, GPT-NeoX, ...): one ``ModuleList`` of identical decoder layers inside a *base
model*; the base model's other children run either before the layers (input embeddings,
learned positions, rotary embeddings, dropout) or after them (the final norm); an output
projection (``get_output_embeddings()``) outside the base model turns hidden states into
logits, possibly sharing its weight with the input embeddings.

:func:`find_structure` returns these as module paths (:class:`Structure`); anything that does
not fit raises :class:`~pipekernel.errors.ConfigError` saying what was not found and how to
name the pieces instead (``layers=``, ``tail=``).
"""
from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from pipekernel.errors import ConfigError

__all__ = ["Structure", "find_structure"]

_HINT = ("pipeline_module works on decoder-only causal LMs that keep their decoder layers in "
         "one nn.ModuleList; name the pieces yourself with pipeline_module(..., "
         "layers='model.layers', tail=['model.norm']), or write the model as LayerSpecs "
         "(pk.PipelineModule)")


@dataclass(frozen=True)
class Structure:
    """Where the pieces of a causal LM sit, as module paths of the ``*ForCausalLM`` model.

    :param base: the base model (``"model"``), whose ``forward`` takes ``inputs_embeds``.
    :param layers: its ``ModuleList`` of decoder layers (``"model.layers"``).
    :param num_layers: how many decoder layers it holds.
    :param embed: the input embeddings (``"model.embed_tokens"``), a child of ``base``.
    :param prologue: the base model's other children that run before the layers
        (``"model.rotary_emb"``, ``"transformer.wpe"``), in registration order.
    :param tail: its children that run after the layers, in the order they run
        (``"model.norm"``).
    :param lm_head: the output projection (``"lm_head"``).
    :param tied: the output projection's weight *is* the input embeddings' weight.
    """

    base: str
    layers: str
    num_layers: int
    embed: str
    prologue: tuple[str, ...]
    tail: tuple[str, ...]
    lm_head: str
    tied: bool

    def child(self, path: str) -> str:
        """``path``'s name relative to the base model (``"model.norm"`` -> ``"norm"``)."""
        return path[len(self.base) + 1:] if self.base else path


def find_structure(model: nn.Module, *, layers: str | None = None,
                   tail: Sequence[str] | None = None) -> Structure:
    """The :class:`Structure` of ``model`` (a ``*ForCausalLM``, on any device, meta included).

    :param layers: the decoder layers' ``ModuleList`` path, when the search finds none or
        several.
    :param tail: the base model's children that run after the layers, in order, when their
        registration order does not tell (default: the children with parameters
        registered after the layer list).
    :raises ConfigError: a piece is missing or ambiguous, naming it and what was found.
    """
    layers = layers if layers is not None else _find_layers(model)
    layer_list = _get(model, layers, "the decoder layers")
    if not isinstance(layer_list, nn.ModuleList) or len(layer_list) == 0:
        raise ConfigError(f"{layers!r} is a {type(layer_list).__name__}, not a non-empty "
                          "nn.ModuleList of decoder layers", hint=_HINT)
    base_path = layers.rpartition(".")[0]
    base = model.get_submodule(base_path) if base_path else model
    if "inputs_embeds" not in inspect.signature(base.forward).parameters:
        raise ConfigError(f"the base model {base_path!r} ({type(base).__name__}) does not take "
                          "inputs_embeds", hint=_HINT)
    if any(True for _ in base.parameters(recurse=False)):
        raise ConfigError(f"the base model {base_path!r} holds parameters of its own", hint=_HINT)
    embed = _path_of(model, model.get_input_embeddings(), "input embeddings")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        raise ConfigError(f"{type(model).__name__} has no output embeddings "
                          "(get_output_embeddings() is None): not a causal LM", hint=_HINT)
    lm_head = _path_of(model, head, "output embeddings (lm_head)")
    if embed.rpartition(".")[0] != base_path:
        raise ConfigError(f"the input embeddings {embed!r} are not a child of the base model "
                          f"{base_path!r}", hint=_HINT)
    _check_outside(model, base_path, lm_head)
    children = _split_children(base, base_path, layers, embed, tail)
    tied = getattr(head, "weight", None) is not None \
        and head.weight is getattr(model.get_input_embeddings(), "weight", None)
    if tied and any(n != "weight" for n, _ in head.named_parameters()):
        raise ConfigError(f"the output projection {lm_head!r} shares its weight with the input "
                          "embeddings and has other parameters too (a bias)", hint=_HINT)
    return Structure(base=base_path, layers=layers, num_layers=len(layer_list), embed=embed,
                     prologue=children[0], tail=children[1], lm_head=lm_head, tied=tied)


def _find_layers(model: nn.Module) -> str:
    """The one outermost ``ModuleList`` of identical modules with parameters."""
    found = []
    for name, module in model.named_modules():
        if not (isinstance(module, nn.ModuleList) and len(module) > 0):
            continue
        if any(name.startswith(outer + ".") for outer in found):
            continue  # e.g. the experts inside a decoder layer
        if len({type(m) for m in module}) == 1 and any(True for _ in module.parameters()):
            found.append(name)
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    count = getattr(text, "num_hidden_layers", None)
    if count is not None and len(found) > 1:
        found = [n for n in found if len(model.get_submodule(n)) == count]
    if len(found) != 1:
        what = "no nn.ModuleList of decoder layers" if not found else \
            f"several candidate layer lists: {', '.join(map(repr, found))}"
        raise ConfigError(f"{type(model).__name__}: found {what}",
                          hint=_HINT + " (or pass layers='<path of the ModuleList>')")
    return found[0]


def _split_children(base: nn.Module, base_path: str, layers: str, embed: str,
                    tail: Sequence[str] | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The base model's children other than the layers and the embeddings: (run before the
    layers, run after them). Stateless children (rotary embeddings, dropout) run before."""
    prefix = base_path + "." if base_path else ""
    names = [prefix + n for n, _ in base.named_children() if prefix + n not in (layers, embed)]
    if tail is not None:
        unknown = [t for t in tail if t not in names]
        if unknown:
            raise ConfigError(f"tail={list(tail)!r}: {', '.join(map(repr, unknown))} is not a "
                              f"child of the base model {base_path!r}; its children are "
                              f"{', '.join(map(repr, names))}", hint=_HINT)
        return tuple(n for n in names if n not in tail), tuple(tail)
    order = [prefix + n for n, _ in base.named_children()]
    after = order.index(layers)
    before, behind = [], []
    for name in names:
        child = base.get_submodule(name[len(prefix):])
        stateful = any(True for _ in child.parameters()) or bool(child.state_dict())
        (behind if stateful and order.index(name) > after else before).append(name)
    return tuple(before), tuple(behind)


def _path_of(model: nn.Module, target: nn.Module | None, what: str) -> str:
    for name, module in model.named_modules():
        if module is target and target is not None:
            return name
    raise ConfigError(f"{type(model).__name__}: the {what} were not found among its modules",
                      hint=_HINT)


def _get(model: nn.Module, path: str, what: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        raise ConfigError(f"{type(model).__name__} has no module {path!r} ({what})",
                          hint=_HINT) from None


def _check_outside(model: nn.Module, base_path: str, lm_head: str) -> None:
    """Nothing with parameters outside the base model but the output projection."""
    for name, child in model.named_children():
        if name in (base_path.partition(".")[0], lm_head.partition(".")[0]):
            continue
        if any(True for _ in child.parameters()):
            raise ConfigError(f"{type(model).__name__}.{name} holds parameters outside the base "
                              f"model {base_path!r} and the output projection {lm_head!r}",
                              hint=_HINT)
