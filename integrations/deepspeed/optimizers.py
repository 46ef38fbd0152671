"""The optimizer a DeepSpeed config or ``initialize(optimizer=...)`` asks for, as the
``factory(params) -> Optimizer`` pipekernel's engine builds over each stage's parameters
(fp32 master copies under bf16/fp16, one shard under ZeRO-1).

DeepSpeed's rules (``deepspeed/runtime/engine.py``, ``_configure_basic_optimizer``):
``type`` ``Adam``/``AdamW`` (any case) read ``adam_w_mode`` (default ``true``: decoupled
weight decay, so ``Adam`` means AdamW unless ``adam_w_mode: false``) and ``torch_adam``
(``true``: ``torch.optim.Adam``/``AdamW``; ``false``: DeepSpeed's fused kernel, the same
update, which pipekernel runs as the ``torch.optim`` class too). Any other ``type`` is the
``torch.optim`` class of that name, as in DeepSpeed. ``max_grad_norm`` in ``params`` is
refused with DeepSpeed's message.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from pipekernel.errors import ConfigError

__all__ = ["optimizer_factory", "from_config", "with_groups"]

Factory = Callable[[list], torch.optim.Optimizer]


def from_config(section: dict) -> tuple[type, dict]:
    """``(optimizer class, keyword arguments)`` for a config's ``optimizer`` section."""
    kind, params = str(section["type"]), dict(section["params"])
    if "max_grad_norm" in params:
        raise ConfigError("'max_grad_norm' is not supported as an optimizer parameter, please "
                          "switch to using the deepspeed parameter 'gradient_clipping'",
                          hint='move it to "gradient_clipping": <value>')
    if kind.lower() in ("adam", "adamw"):
        adam_w_mode = params.pop("adam_w_mode", True)
        params.pop("torch_adam", False)  # fused or torch: the same update here
        params.pop("fp32_optimizer_states", None)
        decoupled = kind.lower() == "adamw" or adam_w_mode
        cls: Any = torch.optim.AdamW if decoupled else torch.optim.Adam
    else:
        cls = getattr(torch.optim, kind, None)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise ConfigError(f"optimizer.type {kind!r} is not implemented by "
                              "pipekernel.deepspeed", hint="use Adam, AdamW or a torch.optim "
                              "class name, or pass initialize(..., optimizer=...)")
    if "betas" in params and isinstance(params["betas"], list):
        params["betas"] = tuple(params["betas"])
    try:  # reject unknown params now, not at the first step
        cls([torch.nn.Parameter(torch.zeros(1))], **params)
    except TypeError as err:
        raise ConfigError(f"optimizer.params of {kind} has a key {cls.__name__} does not "
                          f"take: {err}", hint="see the torch.optim class's arguments") from err
    return cls, params


def with_groups(make: Callable[[Any], torch.optim.Optimizer], model_parameters: Any,
                stage_parameters: Callable[[], list]) -> Factory:
    """A factory that builds ``make(groups)`` where ``groups`` are ``model_parameters``
    (tensors or param-group dicts, as the script gave DeepSpeed) translated to the tensors
    the engine trains (``params``: the stage's parameters in order, or their fp32
    masters). Without ``model_parameters``: ``make(params)``. Parameters the script left
    out of ``model_parameters`` are not optimized, as in DeepSpeed.

    :param stage_parameters: returns the stage module's parameters, in the order of
        the ``params`` the engine passes (called when the engine builds the optimizer).
    """
    if model_parameters is not None:
        model_parameters = list(model_parameters)  # a generator is read once

    def factory(params: list) -> torch.optim.Optimizer:
        if model_parameters is None:
            return make(params)
        stage = stage_parameters()
        if len(stage) != len(params):  # a ZeRO shard: the groups cannot be mapped
            return make(params)
        target = {id(p): q for p, q in zip(stage, params)}
        groups = model_parameters
        if groups and isinstance(groups[0], dict):
            translated = [{**g, "params": [target[id(p)] for p in g["params"]
                                           if id(p) in target]} for g in groups]
            return make([g for g in translated if g["params"]])
        return make([target[id(p)] for p in groups if id(p) in target])
    return factory


def optimizer_factory(section: dict | None, optimizer: Any, model_parameters: Any,
                      stage_parameters: Callable[[], list], keep_built: bool = True
                      ) -> Factory | torch.optim.Optimizer | None:
    """The factory for ``initialize``: the config's ``optimizer`` section, or the
    ``optimizer=`` argument (a factory ``f(params)``, or a built ``torch.optim``
    optimizer: used as is with ``keep_built`` (fp32, no ZeRO: it steps the module's own
    parameters), else rebuilt from its class and param groups over the engine's tensors
    (the fp32 masters, a ZeRO shard)); ``None`` when neither is given.

    :raises ConfigError: both given (DeepSpeed refuses that too), or a bad section.
    """
    if section is not None and optimizer is not None:
        raise ConfigError("an optimizer is given both in the config and as initialize("
                          "optimizer=...)", hint="keep one of them")
    if section is not None:
        cls, kwargs = from_config(section)
        return with_groups(lambda groups: cls(groups, **kwargs), model_parameters,
                           stage_parameters)
    if optimizer is None:
        return None
    if isinstance(optimizer, torch.optim.Optimizer) and keep_built:
        return optimizer
    if isinstance(optimizer, torch.optim.Optimizer):
        cls, defaults = type(optimizer), dict(optimizer.defaults)
        groups = _groups_of(optimizer)
        return with_groups(lambda g: cls(g, **defaults), groups, stage_parameters)
    if callable(optimizer):
        return with_groups(optimizer, model_parameters, stage_parameters)
    raise ConfigError(f"optimizer must be a torch optimizer or a callable, got {optimizer!r}",
                      hint="pass a torch.optim optimizer, a function params -> optimizer, or name "
                           "one in the config")


def _groups_of(optimizer: torch.optim.Optimizer) -> list[dict] | Iterable:
    """The built optimizer's param groups with their own hyperparameters."""
    return [dict(group) for group in optimizer.param_groups]
