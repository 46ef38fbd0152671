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

from pipekernel.errors import ConfigError, DataError

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
    """The weights of a directory ``from_pretrained`` loads, read tensor by tensor.

    Keys go through transformers' own conversion (``conversion_mapping`` and
    ``core_model_loading``, as ``from_pretrained`` applies them): renamings, the base-model
    prefix added or stripped (GPT-2 checkpoints without ``transformer.``), converters such
    as the per-expert MoE keys of the hub layout fused into one tensor, a tied weight saved
    under either name. Each stage reads only the checkpoint tensors its modules need.

    :param directory: holds ``config.json`` and ``model.safetensors`` or
        ``model.safetensors.index.json`` with its shards.
    :param config: the config (default: read from ``directory``).
    """

    def __init__(self, directory: str | os.PathLike, config: Any = None) -> None:
        from transformers import AutoConfig
        self.directory = os.fspath(directory)
        super().__init__(config if config is not None else AutoConfig.from_pretrained(self.directory))
        self.files = _weight_map(self.directory)
        self.plan, self.converters = _conversion_plan(self.model, self.files)

    def fill(self, path: str, module: nn.Module) -> None:
        from safetensors import safe_open
        state = module.state_dict(keep_vars=True)
        wanted = {f"{path}.{name}": name for name in state}
        handles: dict[str, Any] = {}

        def read(key: str) -> torch.Tensor:
            filename = os.path.join(self.directory, self.files[key])
            try:
                if filename not in handles:
                    handles[filename] = safe_open(filename, framework="pt")
                tensor = handles[filename].get_tensor(key)
            except Exception as err:  # noqa: BLE001 - safetensors' and the OS's errors
                raise _unreadable(filename, key, err) from err
            self.bytes_read += tensor.numel() * tensor.element_size()
            return tensor

        values = {}
        for target in _needed(self.plan, wanted, self.model):
            values.update(self._convert(target, read))
        with torch.no_grad():
            for full, name in wanted.items():
                key = full if full in values else next(
                    (a for a in _aliases(self.model, full) if a in values), None)
                if key is None:
                    raise ConfigError(f"the checkpoint {self.directory!r} has no tensor for "
                                      f"{full!r} (after transformers' key conversion)",
                                      hint="load a checkpoint saved from the same model "
                                           "configuration")
                if values[key].shape != state[name].shape:
                    where = self.files.get(key, "converted")
                    raise DataError(f"the checkpoint {self.directory!r} holds {key!r} of shape "
                                    f"{list(values[key].shape)} ({where}) and the model's "
                                    f"{full!r} is {list(state[name].shape)}",
                                    hint="load a checkpoint saved from the same model "
                                         "configuration (config.json)")
                state[name].copy_(values[key])

    def _convert(self, target: str, read: Any) -> dict[str, torch.Tensor]:
        """``{model key: tensor}`` the checkpoint tensors behind ``target`` become."""
        sources = self.plan[target]
        pattern = sources[0][1]
        if pattern is None:
            return {target: read(sources[0][0])}
        converter = copy.deepcopy(self.converters[pattern])
        for key, source_pattern in sources:
            converter.add_tensor(target, key, source_pattern, lambda key=key: read(key))
        out = converter.convert(target, model=self.model, config=self.model.config)
        return {k: v[0] if isinstance(v, list) else v for k, v in out.items()}


def _conversion_plan(model: nn.Module, files: dict[str, str]
                     ) -> tuple[dict[str, list[tuple[str, str | None]]], dict[str, Any]]:
    """``{model key: [(checkpoint key, converter pattern or None)]}`` by transformers' own
    renaming (``rename_source_key``, as ``convert_and_load_state_dict_in_model`` does), and
    the converters by pattern. Marks the conversions used on ``model`` as ``from_pretrained``
    does (``_weight_conversions``), so saving reverts exactly those."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (WeightConverter, WeightRenaming,
                                                 dot_natural_key, rename_source_key)
    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    meta_state = model.state_dict()
    prefix = model.base_model_prefix
    plan: dict[str, list[tuple[str, str | None]]] = {}
    for key in sorted(files, key=dot_natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, meta_state)
        if renamed not in meta_state and key in meta_state:
            renamed, pattern = rename_source_key(key, [], [], prefix, meta_state)
        if renamed in meta_state:
            plan.setdefault(renamed, []).append((key, pattern))
    model._weight_conversions = [m for m in mapping if m.was_used()]
    return plan, by_pattern


def _needed(plan: dict[str, list], wanted: dict[str, str], model: nn.Module) -> list[str]:
    """The plan's targets that produce a key of ``wanted`` (a converter with several
    targets is keyed by its first: every target under the same module path counts)."""
    roots = {k.rpartition(".")[0] for k in wanted}
    aliases = {a for k in wanted for a in _aliases(model, k)}
    return [t for t in plan if t in wanted or t in aliases
            or t.rpartition(".")[0] in roots or any(t.startswith(r + ".") for r in roots)]


def _unreadable(path: str, key: str, error: BaseException) -> DataError:
    what = "is missing" if isinstance(error, FileNotFoundError) else \
        f"is truncated or corrupt ({type(error).__name__}: {error})"
    return DataError(f"checkpoint file {path} (tensor {key!r}) {what}",
                     hint="copy the checkpoint directory again (every shard its index names)")


def _weight_map(directory: str) -> dict[str, str]:
    """``{tensor name: safetensors file}`` of a checkpoint directory. Only safetensors is
    read (it holds no code); a directory of pickled ``.bin`` files is refused by name."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                found = json.load(f)["weight_map"]
            if not isinstance(found, dict) or not all(isinstance(v, str) for v in found.values()):
                raise TypeError(f"weight_map is a {type(found).__name__} of non-file names")
            return dict(found)
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise DataError(f"checkpoint index {index} is truncated or corrupt: "
                            f"{type(err).__name__}: {err}",
                            hint="save the model again with save_pretrained(path)") from err
    single = os.path.join(directory, "model.safetensors")
    if os.path.exists(single):
        from safetensors import safe_open
        try:
            with safe_open(single, framework="pt") as f:
                return {key: "model.safetensors" for key in f.keys()}
        except Exception as err:  # noqa: BLE001 - safetensors' errors
            raise _unreadable(single, "*", err) from err
    others = sorted(n for n in os.listdir(directory) if n.endswith((".bin", ".pt", ".pth",
                                                                     ".ckpt")))
    raise DataError(f"{directory!r} holds no model.safetensors nor "
                    "model.safetensors.index.json"
                    + (f" (it holds {', '.join(others[:3])}: pickles, which pipekernel does "
                       "not unpickle)" if others else ""),
                    hint="save the model with save_pretrained(path) (safetensors, the default), "
                         "or pass the loaded model itself")


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
