"""Where a stage's weights come from: each pipeline layer materialises only its own modules.

Every rank holds the whole model *on the meta device* (its structure, no memory). A
pipeline layer asks its source for the modules it owns, by path:

* :class:`ModelSource` — an in-memory model: a copy of the module (the given model is
  left untouched, so it can serve as the one-process reference);
* :class:`CheckpointSource` — a ``save_pretrained`` directory: the meta module is
  materialised empty and only its own tensors are read from the safetensors files with
  ``safe_open`` (``bytes_read`` counts them);
* :class:`ConfigSource` — a config: random weights by the model's own ``_init_weights``.

Built under ``torch.device("meta")`` (pipekernel counts parameters that way) every source
returns the meta module, reading nothing.
"""
from __future__ import annotations

import copy
import json
import os
from typing import Any

import torch
from torch import nn

from pipekernel.errors import ConfigError

__all__ = ["ModelSource", "CheckpointSource", "ConfigSource", "make_source", "meta_model"]


def meta_model(config: Any) -> nn.Module:
    """The ``AutoModelForCausalLM`` of ``config`` on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _target_device() -> torch.device:
    return torch.get_default_device()


class ModelSource:
    """Copies of an in-memory model's modules.

    :param model: the ``*ForCausalLM`` model (any device; copies go to the default device).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model, self.config = model, model.config
        self.bytes_read = 0

    def build(self, path: str) -> nn.Module:
        device = _target_device()
        module = self.model.get_submodule(path)
        if device.type == "meta":  # counting parameters: copy no data
            memo = {id(t): _meta_like(t) for t in (*module.parameters(), *module.buffers())}
            return copy.deepcopy(module, memo)
        return copy.deepcopy(module).to(device)


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    empty = torch.empty_like(t, device="meta")
    return nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) \
        else empty


class _MetaSource:
    """Materialises the meta model's modules: empty, then buffers by ``_init_weights``."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.model = meta_model(config)
        self.bytes_read = 0

    def build(self, path: str) -> nn.Module:
        module = copy.deepcopy(self.model.get_submodule(path))
        device = _target_device()
        if device.type == "meta":
            return module
        module.to_empty(device=device)
        with torch.no_grad():
            for sub in module.modules():  # non-persistent buffers (rotary inv_freq) and weights
                self.model._init_weights(sub)
        self.fill(path, module)
        return module

    def fill(self, path: str, module: nn.Module) -> None:
        """Overwrite ``module``'s state (its meta-built weights) from the source."""


class ConfigSource(_MetaSource):
    """Random weights for ``config``, as the model's ``_init_weights`` draws them (under the
    pipeline's seeding rule: layer ``i`` after ``torch.manual_seed(seed + i)``)."""


class CheckpointSource(_MetaSource):
    """The weights of a ``save_pretrained`` directory, read tensor by tensor.

    :param directory: holds ``config.json`` and ``model.safetensors`` or
        ``model.safetensors.index.json`` with its shards.
    :param config: the config (default: read from ``directory``).
    """

    def __init__(self, directory: str | os.PathLike, config: Any = None) -> None:
        from transformers import AutoConfig
        self.directory = os.fspath(directory)
        super().__init__(config if config is not None else AutoConfig.from_pretrained(self.directory))
        self.files = _weight_map(self.directory)

    def fill(self, path: str, module: nn.Module) -> None:
        from safetensors import safe_open
        state = module.state_dict(keep_vars=True)
        by_file: dict[str, list[str]] = {}
        for name in state:
            key = _checkpoint_key(self.files, f"{path}.{name}", self.model)
            by_file.setdefault(self.files[key], []).append(name)
        with torch.no_grad():
            for filename, names in by_file.items():
                with safe_open(os.path.join(self.directory, filename), framework="pt") as f:
                    for name in names:
                        tensor = f.get_tensor(_checkpoint_key(self.files, f"{path}.{name}",
                                                              self.model))
                        self.bytes_read += tensor.numel() * tensor.element_size()
                        state[name].copy_(tensor)


def _weight_map(directory: str) -> dict[str, str]:
    """``{tensor name: safetensors file}`` of a checkpoint directory."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return dict(json.load(f)["weight_map"])
    single = os.path.join(directory, "model.safetensors")
    if os.path.exists(single):
        from safetensors import safe_open
        with safe_open(single, framework="pt") as f:
            return {key: "model.safetensors" for key in f.keys()}
    raise ConfigError(f"{directory!r} holds no model.safetensors nor "
                      "model.safetensors.index.json",
                      hint="save the model with save_pretrained(path) (safetensors, the default), "
                           "or pass the loaded model itself")


def _checkpoint_key(files: dict[str, str], key: str, model: nn.Module) -> str:
    """``key`` as the checkpoint names it: tied weights are saved once, under either name."""
    if key in files:
        return key
    for alias in _aliases(model, key):
        if alias in files:
            return alias
    raise ConfigError(f"the checkpoint has no tensor {key!r}",
                      hint="load a checkpoint saved from the same model configuration")


def _aliases(model: nn.Module, key: str) -> list[str]:
    """The other names of the tensor ``key`` in ``model`` (tied parameters)."""
    try:
        target = model.get_parameter(key)
    except AttributeError:
        return []
    return [name for name, p in model.named_parameters(remove_duplicate=False)
            if p is target and name != key]


def make_source(model_or_path: Any) -> ModelSource | CheckpointSource | ConfigSource:
    """The source for ``pipeline_module``'s first argument: a model, a directory, or a config."""
    if isinstance(model_or_path, nn.Module):
        if not hasattr(model_or_path, "config"):
            raise ConfigError(f"{type(model_or_path).__name__} has no .config: not a Hugging "
                              "Face model", hint="pass a transformers *ForCausalLM model, a "
                                                 "save_pretrained directory or a config")
        return ModelSource(model_or_path)
    if isinstance(model_or_path, (str, os.PathLike)):
        if not os.path.isdir(model_or_path):
            raise ConfigError(f"{os.fspath(model_or_path)!r} is not a directory",
                              hint="pass a save_pretrained directory (nothing is downloaded), "
                                   "a model or a config")
        return CheckpointSource(model_or_path)
    if hasattr(model_or_path, "to_dict") and hasattr(model_or_path, "model_type"):
        return ConfigSource(model_or_path)
    raise ConfigError(f"pipeline_module got a {type(model_or_path).__name__}",
                      hint="pass a transformers *ForCausalLM model, a save_pretrained directory "
                           "or a transformers config")
