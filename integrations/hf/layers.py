"""The pipeline layers a causal LM becomes, each holding its modules under their own paths.

Every layer here is a *mirror*: its submodules sit at the paths they have in the Hugging
Face model (``model.layers.3``, ``lm_head``), so a stage's ``state_dict`` key
``"{layer index}.{name}"`` is the Hugging Face key ``name`` behind the index, which is
what loading and :func:`~pipekernel.hf.save_pretrained` rely on.

The chain, with what travels between layers (and so between stages):

1. :class:`Embed` — the input embeddings: ``{"input_ids", "attention_mask", ...}`` ->
   ``{"inputs_embeds", "attention_mask", ...}``.
2. :class:`Prologue` — the base model's own ``forward`` with every decoder layer replaced
   by a recorder: whatever the family computes before its layers (learned positions,
   rotary ``(cos, sin)``, the causal/padding mask, scaling, dropout) is computed by its
   own code, and what each layer was called with is recorded. Out goes a dict
   ``{"hidden": h, "values": (...), "calls": ((arg slots), {kwarg: slot}) per layer}``:
   the distinct values once, and for each decoder layer where its arguments are.
3. :class:`Decoder` — one Hugging Face decoder layer, called exactly as the base model
   would call it.
4. :class:`Epilogue` — the base model's children that run after the layers (final norm).
   The prologue and the epilogue are one pipeline layer with the first and the last
   decoder layer (:class:`Chain`).
5. the output projection (:class:`Mirror` of ``lm_head``, or the tied embeddings through
   :func:`tied_logits`).
"""
from __future__ import annotations

import copy
import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipekernel.errors import ConfigError

__all__ = ["Mirror", "Embed", "Prologue", "Decoder", "Epilogue", "Chain", "Head", "tied_logits",
           "embed_tokens"]


class Mirror(nn.Module):
    """Holds modules at their Hugging Face paths (``state_dict`` keys are Hugging Face keys).

    :param modules: ``{path: module}``.
    """

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        super().__init__()
        self.paths = list(modules)
        for path, module in modules.items():
            _place(self, path, module)

    def at(self, path: str) -> nn.Module:
        return self.get_submodule(path)


def _place(root: nn.Module, path: str, module: nn.Module) -> None:
    *parents, name = path.split(".")
    for part in parents:
        if part not in root._modules:
            root.add_module(part, nn.Module())
        root = root._modules[part]
    root.add_module(name, module)


class Embed(Mirror):
    """The input embeddings; passes the other inputs on for the prologue."""

    def __init__(self, path: str, module: nn.Module) -> None:
        super().__init__({path: module})
        self.__dict__["target"] = module  # not registered twice

    def forward(self, inputs: dict[str, Any]) -> dict[str, Any]:
        return embed_tokens(self, inputs)


def embed_tokens(layer: Embed, inputs: Any) -> dict[str, Any]:
    """``{"input_ids", ...}`` -> ``{"inputs_embeds", ...}`` through ``layer``'s embeddings."""
    if not isinstance(inputs, dict) or "input_ids" not in inputs:
        got = sorted(inputs) if isinstance(inputs, dict) else type(inputs).__name__
        raise ConfigError(f"the first stage's inputs must be a dict with 'input_ids', got {got}",
                          hint="yield Hugging Face style dicts {'input_ids', 'attention_mask', "
                               "'labels'} (see pipekernel.hf.split_batch)")
    rest = {k: v for k, v in inputs.items() if k != "input_ids"}
    return {"inputs_embeds": layer.target(inputs["input_ids"]), **rest}


def tied_logits(layer: Embed, hidden: torch.Tensor) -> torch.Tensor:
    """The output projection through the input embeddings' weight (tied embeddings)."""
    return F.linear(hidden, layer.target.weight)


class _Recorder(nn.Module):
    """Stands in for decoder layer ``index``: records its arguments, returns its input."""

    def __init__(self, sink: list) -> None:
        super().__init__()
        self.sink = sink

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if args:
            hidden, rest = args[0], args[1:]
        else:
            hidden, rest = kwargs.pop("hidden_states"), ()
        self.sink.append((rest, kwargs, hidden))
        return hidden


class _NotCalled(nn.Module):
    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError(f"the base model called {self.what} in its forward with "
                          "inputs_embeds given", hint="name the pieces with pipeline_module"
                                                      "(..., tail=[...]) or write LayerSpecs")


class Prologue(Mirror):
    """What the base model computes before its first decoder layer, by its own ``forward``.

    :param base: the base model (any device: only its ``forward`` and config are used;
        its children are replaced in a shallow copy).
    :param children: ``{path: module}`` of the materialised children that run before the
        layers (e.g. learned positions, rotary embeddings).
    :param names: the base model's child names of the layers, the embeddings and the tail.
    """

    def __init__(self, base: nn.Module, base_path: str, children: dict[str, nn.Module],
                 layers: str, num_layers: int, embed: str, tail: Sequence[str]) -> None:
        super().__init__(children)
        self.__dict__["sink"] = sink = []
        shell = copy.copy(base)
        shell._modules = dict(base._modules)
        shell._parameters, shell._buffers = dict(base._parameters), dict(base._buffers)
        prefix = base_path + "." if base_path else ""
        for path, module in children.items():
            shell._modules[path[len(prefix):]] = module
        self.layers_key = layers[len(prefix):]
        #: keyword options of the base model's forward: no cache
        self.options = {"use_cache": False} \
            if "use_cache" in inspect.signature(base.forward).parameters else {}
        shell._modules[self.layers_key] = nn.ModuleList(
            [_Recorder(sink) for _ in range(num_layers)])
        shell._modules[embed[len(prefix):]] = _NotCalled(f"the input embeddings {embed!r}")
        for path in tail:
            shell._modules[path[len(prefix):]] = nn.Identity()
        self.__dict__["shell"] = shell
        self.__dict__["checked"] = False
        self._names = {module: path for path, module in children.items()}

    def forward(self, inputs: dict[str, Any]) -> dict[str, Any]:
        self.shell.training = self.training
        self.sink.clear()
        order: list[Any] = []
        hooks = [] if self.checked else self._watch(order)
        try:
            self.shell(**inputs, **self.options)
        finally:
            for hook in hooks:
                hook.remove()
        if not self.checked:
            self._check_order(order)
        return _pack(self.sink)

    def _watch(self, order: list[Any]) -> list[Any]:
        """Hooks noting the order in which the children and the first layer run (``None``)."""
        hooks = [m.register_forward_pre_hook(lambda mod, args, path=p: order.append(path))
                 for m, p in self._names.items()]
        first = self.shell._modules[self.layers_key][0]
        return hooks + [first.register_forward_pre_hook(lambda mod, args: order.append(None))]

    def _check_order(self, order: list[Any]) -> None:
        first = order.index(None) if None in order else len(order)
        late = [p for p in order[first + 1:] if p is not None]
        if late:
            raise ConfigError(f"{', '.join(map(repr, sorted(set(late))))} ran after the decoder "
                              "layers, but was taken for a module that runs before them",
                              hint="name the modules that run after the layers: "
                                   "pipeline_module(..., tail=[...]) in the order they run")
        self.__dict__["checked"] = True


def _pack(calls: list) -> dict[str, Any]:
    """The recorded calls as ``{"hidden", "values", "calls"}`` (each distinct value once)."""
    values: list[Any] = []
    slot: dict[int, int] = {}

    def place(name: str, value: Any) -> int:
        key = id(value)
        if key not in slot or isinstance(value, (bool, int, float)):
            _check_carriable(name, value)
            slot[key] = len(values)
            values.append(value)
        return slot[key]

    layout = []
    for args, kwargs, _ in calls:
        layout.append((tuple(place(f"argument {i + 1}", a) for i, a in enumerate(args)),
                       {k: place(repr(k), v) for k, v in kwargs.items()}))
    return {"hidden": calls[0][2], "values": tuple(values), "calls": tuple(layout)}


def _check_carriable(name: str, value: Any) -> None:
    if value is None or isinstance(value, (bool, int, float, torch.Tensor)):
        return
    if isinstance(value, (tuple, list)):
        for item in value:
            _check_carriable(name, item)
        return
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        for item in value.values():
            _check_carriable(name, item)
        return
    raise ConfigError(f"the decoder layers' {name} is a {type(value).__name__}, which cannot "
                      "travel between pipeline stages (tensors, numbers, None and tuples or "
                      "dicts of them can)",
                      hint="load the model with attn_implementation='sdpa' or 'eager' (a flex "
                           "attention BlockMask cannot travel) and without a cache")


class Decoder(Mirror):
    """Decoder layer ``index``, called with the arguments the prologue recorded for it."""

    def __init__(self, path: str, module: nn.Module, index: int) -> None:
        super().__init__({path: module})
        self.__dict__["target"] = module
        self.index = index

    def forward(self, x: dict[str, Any]) -> dict[str, Any]:
        slots, named = x["calls"][self.index]
        values = x["values"]
        out = self.target(x["hidden"], *(values[i] for i in slots),
                          **{k: values[i] for k, i in named.items()})
        return {**x, "hidden": out[0] if isinstance(out, tuple) else out}


class Epilogue(Mirror):
    """The base model's children that run after the layers (the final norm), in order."""

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        super().__init__(modules)
        self.__dict__["steps"] = list(modules.values())

    def forward(self, x: dict[str, Any]) -> torch.Tensor:
        hidden = x["hidden"]
        for module in self.steps:
            hidden = module(hidden)
        return hidden


class Chain(Mirror):
    """Several of the above as one pipeline layer: the prologue with the first decoder layer,
    the epilogue with the last, so every pipeline layer holds parameters (a stage of only
    rotary embeddings would have nothing to train)."""

    def __init__(self, parts: Sequence[Mirror]) -> None:
        super().__init__({path: part.at(path) for part in parts for path in part.paths})
        self.__dict__["parts"] = list(parts)

    def forward(self, x: Any) -> Any:
        for part in self.parts:
            part.training = self.training
            x = part(x)
        return x


class Head(Mirror):
    """The output projection (untied)."""

    def __init__(self, path: str, module: nn.Module) -> None:
        super().__init__({path: module})
        self.__dict__["target"] = module

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target(hidden)
