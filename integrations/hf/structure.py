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
import re
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
    layers, run after them, in the order they run).

    Where each runs, by the first of these that knows: HF's ``base_model_pp_plan`` of the
    config (the modules in the order they run), the base model's ``forward`` source (where
    ``self.<child>(`` is first called relative to the layer list), the registration order (a
    child with state registered after the layers runs after them; stateless ones before)."""
    prefix = base_path + "." if base_path else ""
    names = [prefix + n for n, _ in base.named_children() if prefix + n not in (layers, embed)]
    if tail is not None:
        unknown = [t for t in tail if t not in names]
        if unknown:
            raise ConfigError(f"tail={list(tail)!r}: {', '.join(map(repr, unknown))} is not a "
                              f"child of the base model {base_path!r}; its children are "
                              f"{', '.join(map(repr, names))}", hint=_HINT)
        return tuple(n for n in names if n not in tail), tuple(tail)
    key = layers[len(prefix):]
    rules = (_plan_positions(base, key), _source_positions(base, key),
             _registration_positions(base, key))
    before, behind = [], []
    both = _called_on_both_sides(base, key)
    for name in names:
        child = name[len(prefix):]
        rule = next(r for r in rules if child in r)
        (behind if rule[child] > rule[key] else before).append(name)
        if child in both and name in before:
            if any(True for _ in base.get_submodule(child).parameters()):
                raise ConfigError(f"{name!r} runs both before and after the decoder layers and "
                                  "holds parameters, which two stages would have to share",
                                  hint=_HINT)
            behind.append(name)  # stateless (Nanochat's norm): each side runs its own copy
    rule = next((r for r in rules if all(n[len(prefix):] in r for n in behind)), rules[-1])
    order = {n: rule.get(n[len(prefix):], len(rule)) for n in behind}
    for name in behind:
        if name[len(prefix):] in both:
            order[name] = len(rule) + 1
    return tuple(before), tuple(sorted(behind, key=order.__getitem__))


def _plan_positions(base: nn.Module, key: str) -> dict[str, int]:
    """``{child: position}`` in the config's ``base_model_pp_plan`` (empty without one)."""
    config = getattr(base, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    plan = getattr(text, "base_model_pp_plan", None) or {}
    order = {name: i for i, name in enumerate(plan)}
    return order if key in order else {}


def _source_positions(base: nn.Module, key: str) -> dict[str, int]:
    """``{child: where the forward source first calls self.<child>(}``, the layer list at the
    first ``self.<layers>`` (empty when the source is unavailable or names no layer list)."""
    try:
        source = inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        return {}
    layers = re.search(rf"self\.{re.escape(key)}\b", source)
    if layers is None:
        return {}
    found = {key: layers.start()}
    for name, _ in base.named_children():
        call = re.search(rf"self\.{re.escape(name)}\s*\(", source)
        if call is not None and name != key:
            found[name] = call.start()
    return found


def _called_on_both_sides(base: nn.Module, key: str) -> set[str]:
    """The children the forward source calls both before and after the first ``self.<layers>``."""
    try:
        source = inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        return set()
    layers = re.search(rf"self\.{re.escape(key)}\b", source)
    if layers is None:
        return set()
    found = set()
    for name, _ in base.named_children():
        calls = [m.start() for m in re.finditer(rf"self\.{re.escape(name)}\s*\(", source)]
        if calls and min(calls) < layers.start() < max(calls):
            found.add(name)
    return found


def _registration_positions(base: nn.Module, key: str) -> dict[str, int]:
    """Registration order, every stateless child counted as running first."""
    order = [n for n, _ in base.named_children()]
    found = {}
    for i, name in enumerate(order):
        child = base.get_submodule(name)
        stateful = any(True for _ in child.parameters()) or bool(child.state_dict())
        found[name] = i if stateful or name == key else -1
    return found


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
