"""The pipeline layers a causal LM becomes, each holding its modules under their own paths.

Every layer here is a *mirror*: its submodules sit at the paths they have in the Hugging
Face model (``model.layers.3``, ``lm_head``), so a stage's ``state_dict`` key
``"{layer index}.{name}"`` is the Hugging Face key ``name`` behind the index, which is
what loading and :func:`~pipekernel.hf.save_pretrained` rely on.

The chain, with what travels between layers (and so between stages):

1. :class:`Embed` — the input embeddings: ``{"input_ids", "attention_mask", ...}`` ->
   ``{"inputs_embeds", "attention_mask", ...}``.
2. :class:`Prologue` — the base model's own ``forward``, calling decoder layer 0 itself
   and, for every later layer, a recorder: whatever the family computes before its layers
   (learned positions, rotary ``(cos, sin)``, the causal/padding mask, scaling, dropout) is
   computed by its own code, and what each layer was called with is recorded. Out goes a dict
   ``{"hidden": h, "values": (...), "calls": ((arg slots), {kwarg: slot}) per layer}``:
   the distinct values once, and for each decoder layer where its arguments are.
3. :class:`Decoder` — one Hugging Face decoder layer, called exactly as the base model
   would call it.
4. :class:`Epilogue` — the base model's children that run after the layers (final norm).
   The prologue and the epilogue are one pipeline layer with the first and the last
   decoder layer (:class:`Chain`).
5. the output projection and what the model's forward does after it
   (:mod:`pipekernel.hf.head`).
"""
from __future__ import annotations

import copy
import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from pipekernel.errors import ConfigError
from pipekernel.model.aux_loss import add_aux_loss
from pipekernel.stage.sequence import sequence_chunk

from pipekernel.hf import prefix as prefixes
from pipekernel.hf import router as routing

__all__ = ["Mirror", "Embed", "Prologue", "Decoder", "Epilogue", "Chain", "embed_tokens"]


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
    sequence_chunk()  # position-wise: runs on sequence chunks as on whole sequences
    rest = {k: v for k, v in inputs.items() if k != "input_ids"}
    return {"inputs_embeds": layer.target(inputs["input_ids"]), **rest}


class _Log:
    """What the base model's forward did with its decoder layers, while the prologue runs it:
    each layer's call (``(args, kwargs, hidden in)``), the first layer's real output, and
    the last hidden state handed back (to prove it reached the next layer unchanged)."""

    def __init__(self) -> None:
        self.calls: list = []
        self.first: Any = None
        self.hidden: Any = None
        self.returned: Any = None
        self.changed: list[int] = []

    def clear(self) -> None:
        self.calls, self.first, self.hidden, self.returned, self.changed = [], None, None, None, []

    def record(self, args: tuple, kwargs: dict) -> Any:
        if args:
            hidden, rest, named = args[0], args[1:], kwargs
        else:
            named = dict(kwargs)
            hidden, rest = named.pop("hidden_states"), ()
        if self.calls and hidden is not self.returned:
            self.changed.append(len(self.calls))
        self.calls.append((rest, named, hidden))
        return hidden


class _StandIn(nn.Module):
    """Stands where a decoder layer stood in the base model; the base model's forward may read
    the layer's attributes (``attention_type``, ``block_type``): they are the layer's."""

    def __init__(self, layer: nn.Module, log: _Log) -> None:
        super().__init__()
        self.__dict__["layer"], self.__dict__["log"] = layer, log

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["layer"], name)


class _First(_StandIn):
    """Decoder layer 0 itself, run where the base model runs it; its output tells the others'
    recorders what to return (a tensor, or a tuple as Bloom's and Falcon's blocks return)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.log.record(args, kwargs)
        out = self.layer(*args, **kwargs)
        self.log.first = out
        self.log.returned = self.log.hidden = out[0] if isinstance(out, (tuple, list)) else out
        return out


class _Recorder(_StandIn):
    """Stands in for a later decoder layer (``layer``: the base model's, never called): records
    its arguments, returns its input in the structure the first layer returned."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden = self.log.record(args, kwargs)
        self.log.returned = hidden
        first = self.log.first
        return type(first)((hidden, *first[1:])) if isinstance(first, (tuple, list)) else hidden


class _NotCalled(nn.Module):
    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError(f"the base model called {self.what} in its forward with "
                          "inputs_embeds given", hint="name the pieces with pipeline_module"
                                                      "(..., tail=[...]) or write LayerSpecs")


class Prologue(Mirror):
    """What the base model computes before its first decoder layer, by its own ``forward``,
    and the first decoder layer itself, called by that forward.

    :param base: the base model (any device: only its ``forward`` and config are used;
        its children are replaced in a shallow copy).
    :param children: ``{path: module}`` of the materialised children that run before the
        layers (e.g. learned positions, rotary embeddings).
    :param first: the materialised decoder layer 0 (``{layers}.0``).
    :param router: the router auxiliary loss to carry (:mod:`pipekernel.hf.router`), or
        ``None``.
    """

    def __init__(self, base: nn.Module, base_path: str, children: dict[str, nn.Module],
                 layers: str, num_layers: int, embed: str, tail: Sequence[str],
                 first: nn.Module, router: routing.RouterAux | None = None) -> None:
        super().__init__({**children, f"{layers}.0": first})
        self.__dict__["log"] = log = _Log()
        self.__dict__["router"], self.__dict__["first"] = router, first
        shell = copy.copy(base)
        shell._modules = dict(base._modules)
        shell._parameters, shell._buffers = dict(base._parameters), dict(base._buffers)
        prefix = base_path + "." if base_path else ""
        for path, module in children.items():
            shell._modules[path[len(prefix):]] = module
        self.layers_key = layers[len(prefix):]
        base_layers = base._modules[self.layers_key]
        #: keyword options of the base model's forward: no cache
        self.options = {"use_cache": False} \
            if "use_cache" in inspect.signature(base.forward).parameters else {}
        shell._modules[self.layers_key] = nn.ModuleList(
            [_First(first, log), *(_Recorder(layer, log) for layer in base_layers[1:])])
        shell._modules[embed[len(prefix):]] = _NotCalled(f"the input embeddings {embed!r}")
        for path in tail:
            if path not in children:  # a stateless module run on both sides stays
                shell._modules[path[len(prefix):]] = nn.Identity()
        self.__dict__["shell"] = shell
        self.__dict__["checked"] = False
        self.num_layers = num_layers
        #: the keyword the base model takes a cache by (``None``: it takes none)
        self.cache_kwarg = prefixes.cache_kwarg(base.forward)
        self._names = {module: path for path, module in children.items() if path not in tail}

    def forward(self, inputs: dict[str, Any]) -> dict[str, Any]:
        self.shell.training = self.training
        self.log.clear()
        order: list[Any] = []
        hooks = [] if self.checked else self._watch(order)
        partial = None if self.router is None \
            else routing.start(inputs, inputs["inputs_embeds"].device, self.router.masked)
        inputs, options, cache = self._chunked(inputs)
        try:
            _, partial = routing.routed(self.router, 0, self.first, partial,
                                        lambda: self.shell(**inputs, **options))
        finally:
            for hook in hooks:
                hook.remove()
        if not self.checked:
            self._check_order(order)
            self._check_calls()
        out = _pack(self.log.calls, self.log.hidden, cache)
        if partial is not None:
            out["router"] = partial
        return out

    def _chunked(self, inputs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], Any]:
        """Inside a sequence chunk: the inputs with the padding mask of the whole prefix, and
        the options handing the base model a :class:`~pipekernel.hf.prefix.PrefixCache`, so
        its positions and mask are offset by the earlier chunks and its layers read their
        keys and values. Otherwise the inputs and options as they are, no cache."""
        chunk = sequence_chunk()
        if chunk is None:
            return inputs, self.options, None
        if self.cache_kwarg is None:
            raise ConfigError(f"{type(self.shell).__name__}.forward takes no cache, so its "
                              "layers cannot read the key/value prefix of earlier sequence "
                              "chunks", hint="train with seq_chunks=1 (docs/sequences.md)")
        past = chunk.index * inputs["inputs_embeds"].shape[1]
        cache = prefixes.PrefixCache(chunk, self.num_layers, past)
        options = {**self.options, self.cache_kwarg: cache}
        if "use_cache" in options:
            options["use_cache"] = True  # some forwards drop a cache they are not to use
        return prefixes.with_mask_prefix(chunk, inputs), options, cache

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

    def _check_calls(self) -> None:
        """The layers form a chain the pipeline can cut: each called once, in order, with
        the hidden state the previous one returned and nothing else it returned."""
        log, where = self.log, f"{type(self.shell).__name__}.forward"
        if len(log.calls) != self.num_layers:
            raise ConfigError(f"{where} called {len(log.calls)} decoder layers of "
                              f"{self.num_layers} (layer drop, or layers run more than once)",
                              hint="set the config's layerdrop to 0; a model that does not "
                                   "call each layer once in order cannot be split here")
        if log.changed:
            raise ConfigError(f"{where} changes the hidden state between decoder layers "
                              f"(before layer {log.changed[0]}), which a pipeline of its layers "
                              "would not reproduce", hint="write the model as LayerSpecs")
        extra = [v for v in (log.first[1:] if isinstance(log.first, (tuple, list)) else ())
                 if isinstance(v, torch.Tensor)]
        for j, (args, kwargs, _) in enumerate(log.calls[1:], 1):
            if any(v is e for v in (*args, *kwargs.values()) for e in extra):
                raise ConfigError(f"{where} passes what decoder layer {j - 1} returned besides "
                                  f"the hidden state to layer {j}, which cannot be reproduced",
                                  hint="write the model as LayerSpecs")
        self.__dict__["checked"] = True


def _pack(calls: list, hidden: torch.Tensor, cache: Any = None) -> dict[str, Any]:
    """The recorded calls as ``{"hidden", "values", "calls"}`` (each distinct value once).
    In a sequence chunk, ``cache`` (the :class:`~pipekernel.hf.prefix.PrefixCache` the base
    model was handed) travels as its prefix length, and ``"caches"`` says, per layer, where
    each call took it (``{keyword or argument index: slot}``): each stage hands its own
    layers a cache of its own there."""
    values: list[Any] = []
    slot: dict[int, int] = {}

    def place(name: str, value: Any) -> int:
        if cache is not None and value is cache:
            values.append(cache.past)
            return len(values) - 1
        key = id(value)
        if key not in slot or isinstance(value, (bool, int, float)):
            _check_carriable(name, value)
            slot[key] = len(values)
            values.append(value)
        return slot[key]

    layout, caches = [], []
    for args, kwargs, _ in calls:
        slots = tuple(place(f"argument {i + 1}", a) for i, a in enumerate(args))
        named = {k: place(repr(k), v) for k, v in kwargs.items()}
        layout.append((slots, named))
        if cache is not None:
            caches.append({**{str(i): s for i, (a, s) in enumerate(zip(args, slots))
                              if a is cache},
                           **{k: named[k] for k, v in kwargs.items() if v is cache}})
    out = {"hidden": hidden, "values": tuple(values), "calls": tuple(layout)}
    if cache is not None:
        out["caches"] = tuple(caches)
    return out


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
    """Decoder layer ``index``, called with the arguments the prologue recorded for it;
    with ``router``, its router logits are added to the partial sums ``x["router"]``."""

    def __init__(self, path: str, module: nn.Module, index: int,
                 router: routing.RouterAux | None = None) -> None:
        super().__init__({path: module})
        self.__dict__["target"], self.__dict__["router"] = module, router
        self.index = index

    def forward(self, x: dict[str, Any]) -> dict[str, Any]:
        slots, named = x["calls"][self.index]
        values = x["values"]
        args = [values[i] for i in slots]
        kwargs = {k: values[i] for k, i in named.items()}
        chunk = sequence_chunk()
        if chunk is not None:  # where the base model passed its cache: one of this stage's
            where = x.get("caches", ())[self.index] if "caches" in x else {}
            if not where:
                raise ConfigError(f"decoder layer {self.index} got no cache from the base "
                                  "model in a sequence chunk, so it cannot read the key/value "
                                  "prefix of earlier chunks", hint="train with seq_chunks=1")
            for key, i in where.items():
                cache = prefixes.PrefixCache(chunk, self.index + 1, values[i])
                if key.isdigit():
                    args[int(key)] = cache
                else:
                    kwargs[key] = cache
        out, partial = routing.routed(
            self.router, self.index, self.target, x.get("router"),
            lambda: self.target(x["hidden"], *args, **kwargs))
        out = {**x, "hidden": out[0] if isinstance(out, (tuple, list)) else out}
        if partial is not None:
            out["router"] = partial
        return out


class Epilogue(Mirror):
    """The base model's children that run after the layers (the final norm), in order;
    with ``router``, the router auxiliary loss of every layer's partial sums is added to
    the objective here (:func:`pipekernel.add_aux_loss`)."""

    def __init__(self, modules: dict[str, nn.Module],
                 router: routing.RouterAux | None = None) -> None:
        super().__init__(modules)
        self.__dict__["steps"], self.__dict__["router"] = list(modules.values()), router

    def forward(self, x: dict[str, Any]) -> torch.Tensor:
        if self.router is not None and x.get("router") is not None:
            value = routing.aux_value(x["router"], self.router)
            if value is not None:
                add_aux_loss(self.router.coef * value)
        sequence_chunk()  # position-wise: runs on sequence chunks as on whole sequences
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
