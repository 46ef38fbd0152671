"""DeepSpeed pipeline checkpoints, converted to pipekernel's format and loaded at any
stage count.

What DeepSpeed 0.19's pipeline engine writes under ``DIR/TAG`` (``DIR/latest`` names
``TAG``): ``layer_XX-model_states.pt`` per layer with state (the layer's ``state_dict``;
a tied module once per stage holding it, under the first of its occurrences there that
runs the module itself; with tensor parallelism ``layer_XX-model_YY-model_states.pt``)
and ``mp_rank_XX_model_states.pt`` per pipeline stage (its optimizer ``state_dict``,
``lr_scheduler``, ``global_steps``, ``skipped_steps``, ``global_samples``, ``ds_config``,
the script's ``client_state`` keys).

What :func:`convert` carries over (``docs/deepspeed.md`` has the table):

* **weights**: always (one tensor-parallel shard only: ``model_00``; more shards are
  refused by name, pipekernel cannot merge DeepSpeed's shards);
* **optimizer state** (``exp_avg``, ``exp_avg_sq``, ``step`` and each parameter's group
  hyperparameters): when the model is known (``module=``, as ``load_checkpoint`` does)
  and the stage's optimizer state is a plain ``torch.optim`` state dict (fp32, ZeRO
  stage 0) of one param group (with several, DeepSpeed's numbering follows the script's
  grouping, which the checkpoint does not record: refused by name). DeepSpeed keys it by position in each stage's ``parameters()`` order; that
  order is rebuilt from DeepSpeed's partition of the module for the checkpoint's stage
  count and checked tensor by tensor against the saved shapes. fp16/bf16 optimizer
  wrappers and ZeRO partitions are refused by name (load with
  ``load_optimizer_states=False``);
* **LR scheduler** (``last_batch_iteration``: the classes of
  :mod:`pipekernel.deepspeed.lr_schedules` share DeepSpeed's state), **counters**
  (``global_steps``, ``skipped_steps``; ``global_samples`` as the data position) and the
  **client state**;
* not: RNG states (DeepSpeed does not save them), the fp16 loss scale, data-loader state.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import pipekernel as pk
from pipekernel.engine.checkpoint_files import (LAYER_FORMAT_VERSION, _write_file, layer_file,
                                                rank_file)
from pipekernel.engine.checkpoint_data import load_file
from pipekernel.errors import ConfigError, DataError, PipelineError, UntrustedCheckpointError

from .config import batch_sizes

__all__ = ["convert", "load", "is_deepspeed_checkpoint", "DS_KEYS", "SAFE_GLOBALS", "SWITCH"]

_LAYER = re.compile(r"^layer_(\d+)(?:-model_(\d+))?-model_states\.pt$")
_RANK = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
#: Keys DeepSpeed writes in every ``mp_rank`` file; the others are the client state.
DS_KEYS = ("module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
           "shared_params", "frozen_param_fragments", "lr_scheduler", "data_sampler",
           "random_ltd", "sparse_tensor_module_names", "skipped_steps", "global_steps",
           "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
           "checkpoint_parallel_dimensions")


def _tag(root: str, tag: str | None) -> str:
    if tag is not None:
        return str(tag)
    try:
        with open(os.path.join(root, "latest")) as f:
            return f.read().strip()
    except FileNotFoundError:
        raise DataError(f"no checkpoint in {root}: {os.path.join(root, 'latest')} does not "
                        "exist", hint="pass tag= or the directory DeepSpeed saved to") from None


def is_deepspeed_checkpoint(directory: str) -> bool:
    """Whether ``directory`` (a tag's directory) holds DeepSpeed pipeline files and not
    pipekernel's own (``save_checkpoint`` writes both: pipekernel's then load)."""
    if os.path.exists(os.path.join(directory, "meta.json")):
        return False
    return os.path.isdir(directory) and any(_LAYER.match(n) or _RANK.match(n)
                                            for n in os.listdir(directory))


@dataclass
class FragmentAddress:
    """Stands in for DeepSpeed's ``deepspeed.utils.tensor_fragment.fragment_address`` (two
    ints, where a parameter lies in a flat fp32 partition) when an ``mp_rank`` file is read
    as data: no DeepSpeed import, nothing that runs."""

    numel: int
    start: int


#: The non-tensor globals DeepSpeed 0.19 pickles into the files pipekernel reads, allowed
#: by name for those reads only: ``fragment_address`` (the ``param_slice_mappings`` of a
#: bf16 run's ``mp_rank`` files). Found by saving real DeepSpeed 0.19.8 pipeline
#: checkpoints at fp32, fp16, bf16, ZeRO-1 and bf16 + ZeRO-1
#: (``tests/fixtures/deepspeed/probe_globals.py``); its ZeRO ``*optim_states.pt`` files,
#: which pipekernel does not read, also pickle ``LossScaler`` and ``ZeroStageEnum``.
SAFE_GLOBALS = [(FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address")]

#: The switches that load a DeepSpeed checkpoint that is not data only.
SWITCH = ('trust_checkpoint=True (engine.load_checkpoint / convert), or "'
          + "pipekernel_trust_checkpoints" + '": true in the DeepSpeed config')


def _torch_load(path: str, trust: bool = False) -> dict:
    """A DeepSpeed checkpoint file as data only (:data:`SAFE_GLOBALS` allowed), all of
    it when ``trust``; ``DataError`` naming the file when missing, corrupt, not a dict, or
    (``UntrustedCheckpointError``) not data only."""
    try:
        loaded = load_file(path, path, trust=trust, allowed=SAFE_GLOBALS, switch=SWITCH)
    except PipelineError:
        raise
    except FileNotFoundError:
        raise DataError(f"checkpoint file {path} is missing",
                        hint="the checkpoint is incomplete: copy the whole tag directory"
                        ) from None
    except Exception as err:  # noqa: BLE001 - torch raises many types for a bad zip
        raise DataError(f"checkpoint file {path} is truncated or corrupt: {err}",
                        hint="copy the file again, or load an older tag") from err
    if not isinstance(loaded, dict):
        raise DataError(f"checkpoint file {path} holds a {type(loaded).__name__}, not the "
                        "dict DeepSpeed writes", hint="pass a directory DeepSpeed's "
                        "save_checkpoint wrote")
    return loaded


def _layer_state(path: str, trust: bool) -> dict[str, torch.Tensor]:
    """A ``layer_XX-model_states.pt`` file: a layer's ``state_dict`` (tensors by name)."""
    state = _torch_load(path, trust)
    if not all(isinstance(k, str) and torch.is_tensor(v) for k, v in state.items()):
        raise DataError(f"checkpoint file {path} is not a layer's state_dict (tensors by "
                        "name)", hint="pass a directory DeepSpeed's save_checkpoint wrote")
    return state


def _scan(directory: str) -> tuple[dict[int, str], dict[int, str]]:
    """``({layer: file}, {stage: mp_rank file})`` of a DeepSpeed tag directory."""
    layers: dict[int, str] = {}
    ranks: dict[int, str] = {}
    for name in sorted(os.listdir(directory)):
        if m := _LAYER.match(name):
            if m.group(2) not in (None, "00"):
                raise ConfigError(f"{os.path.join(directory, name)} is tensor-parallel shard "
                                  f"{int(m.group(2))} of layer {int(m.group(1))}: merging "
                                  "DeepSpeed's tensor-parallel shards is not implemented",
                                  hint="convert a checkpoint saved without tensor parallelism")
            layers[int(m.group(1))] = os.path.join(directory, name)
        elif m := _RANK.match(name):
            ranks[int(m.group(1))] = os.path.join(directory, name)
    if not layers:
        raise DataError(f"{directory} holds no DeepSpeed layer files (layer_XX-model_states.pt)",
                        hint="pass the directory DeepSpeed's save_checkpoint wrote")
    return layers, ranks


def _ds_parameter_names(module: Any, bounds: list[int], stage: int) -> list[str]:
    """Stage ``stage``'s parameters in DeepSpeed's ``parameters()`` order (the loss module,
    then ``tied_modules`` in order of first use, then the other layers by index), named
    as pipekernel names them (``"{layer}.{name}"``; a tied one under its first layer)."""
    specs, first = module._layer_specs, {}
    for i, spec in enumerate(specs):
        if isinstance(spec, pk.TiedLayerSpec):
            first.setdefault(spec.key, i)
    tied, plain = [], []
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        for i in range(bounds[stage], bounds[stage + 1]):
            spec = specs[i]
            if isinstance(spec, pk.TiedLayerSpec):
                if all(key != spec.key for key, _ in tied):
                    tied.append((spec.key, spec.build()))
            elif isinstance(spec, (pk.LayerSpec, nn.Module)):
                plain.append((i, spec.build() if isinstance(spec, pk.LayerSpec) else spec))
    names = [f"{first[key]}.{n}" for key, m in tied for n, _ in m.named_parameters()]
    return names + [f"{i}.{n}" for i, m in plain for n, _ in m.named_parameters()]


def _optimizer_by_name(module: Any, ranks: dict[int, str], shapes: dict[str, list],
                       trust: bool = False) -> tuple[dict[str, Any], dict[str, dict]]:
    """``({parameter name: its optimizer state}, {name: its group's hyperparameters})``
    from every stage's ``mp_rank`` file (see the module docstring for when it applies)."""
    with torch.random.fork_rng(devices=[]):
        bounds = module.partition(len(ranks))
    state_by_name: dict[str, Any] = {}
    hyper_by_name: dict[str, dict] = {}
    for stage, path in sorted(ranks.items()):
        saved = _torch_load(path, trust).get("optimizer")
        if not (isinstance(saved, dict) and set(saved) == {"state", "param_groups"}):
            kinds = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
            raise ConfigError(f"{path}: the optimizer state is not a plain torch.optim state "
                              f"dict (keys {kinds}: an fp16/bf16 wrapper or ZeRO partitions), "
                              "which pipekernel cannot map to parameters",
                              hint="load the weights only: load_checkpoint(..., "
                                   "load_optimizer_states=False)")
        if len(saved["param_groups"]) > 1:
            # DeepSpeed numbers parameters group after group, in the order the script
            # listed them: which parameter is in which group is not in the checkpoint
            raise ConfigError(f"{path}: the optimizer state of stage {stage} has "
                              f"{len(saved['param_groups'])} param groups, and DeepSpeed "
                              "numbers parameters group by group in the order the script "
                              "built them, which cannot be rebuilt from the model",
                              hint="load the weights only: load_checkpoint(..., "
                                   "load_optimizer_states=False)")
        names = _ds_parameter_names(module, bounds, stage)
        for group in saved["param_groups"]:
            hyper = {k: v for k, v in group.items() if k != "params"}
            for index in group["params"]:
                if index >= len(names):
                    _mismatch(path, stage, bounds, f"parameter #{index}", len(names))
                name = names[index]
                state = saved["state"].get(index)
                if state is not None and "exp_avg" in state and \
                        list(state["exp_avg"].shape) != shapes.get(name):
                    _mismatch(path, stage, bounds, f"{name} {list(state['exp_avg'].shape)} vs "
                                                   f"{shapes.get(name)}", len(names))
                if name not in hyper_by_name:  # a tied copy: the first stage's
                    hyper_by_name[name] = hyper
                    if state is not None:
                        state_by_name[name] = state
    return state_by_name, hyper_by_name


def _mismatch(path: str, stage: int, bounds: list[int], what: str, count: int) -> None:
    raise ConfigError(f"{path}: the optimizer state of stage {stage} does not line up with "
                      f"this model partitioned as DeepSpeed did ({bounds}, {count} "
                      f"parameters): {what}",
                      hint="build the PipelineModule with the layers and partition_method "
                           "the checkpoint was trained with, or load_optimizer_states=False")


def _layer_entries(module: Any, layers: dict[int, str], num_layers: int
                   ) -> tuple[list[dict], dict[int, str]]:
    """pipekernel's per-layer metadata and ``{canonical layer: DeepSpeed file}``: with the
    model, a tied module lives under its first layer (taken from whichever of its layers
    DeepSpeed wrote)."""
    entries, sources = [], {}
    specs = module._layer_specs if module is not None else None
    first: dict[str, int] = {}
    for i in range(num_layers):
        spec = specs[i] if specs is not None else None
        entry: dict[str, Any] = {"index": i, "canonical": i,
                                 "type": getattr(getattr(spec, "typename", type(spec)),
                                                 "__name__", "?") if spec is not None else "?"}
        if isinstance(spec, pk.TiedLayerSpec):
            canonical = first.setdefault(spec.key, i)
            entry.update(tied=spec.key, canonical=canonical)
            if i in layers and canonical not in sources:
                sources[canonical] = layers[i]
        elif i in layers:
            sources[i] = layers[i]
        entries.append(entry)
    for entry in entries:
        if entry["canonical"] == entry["index"] and entry["index"] in sources:
            entry["file"] = layer_file(entry["index"])
    return entries, sources


def convert(ds_dir: str | os.PathLike, pk_dir: str | os.PathLike, tag: str | None = None, *,
            module: Any = None, num_layers: int | None = None,
            optimizer: bool = True, trust_checkpoint: bool = False) -> str:
    """Write DeepSpeed checkpoint ``ds_dir/tag`` (default: ``ds_dir/latest``) as a
    pipekernel checkpoint ``pk_dir/tag`` (and ``pk_dir/latest``), loadable at any stage
    count by ``engine.load_checkpoint(pk_dir)`` or :func:`pipekernel.load_sequential`.

    :param module: the :class:`~pipekernel.deepspeed.pipe.PipelineModule` it was trained
        with: needed for the optimizer state and to place tied modules; without it only
        weights, scheduler and counters are converted.
    :param num_layers: the model's layer count (default: the module's, else the highest
        layer file + 1: pass it when the last layers have no weights).
    :param optimizer: convert the optimizer state (needs ``module``).
    :param trust_checkpoint: unpickle the files fully; by default they load as data only
        (tensors and :data:`SAFE_GLOBALS`), and a file that would run code is refused.
    :returns: the pipekernel checkpoint directory.
    :raises DataError: missing, corrupt or not data-only files (named).
    :raises ConfigError: what cannot be converted, named.
    """
    ds_root, pk_root = os.fspath(ds_dir), os.fspath(pk_dir)
    tag = _tag(ds_root, tag)
    layers, ranks = _scan(os.path.join(ds_root, tag))
    count = (num_layers or (len(module._layer_specs) if module is not None else None)
             or max(layers) + 1)
    entries, sources = _layer_entries(module, layers, count)
    trust = bool(trust_checkpoint)
    _check_complete(os.path.join(ds_root, tag), module, entries, sources, ranks)
    states = {index: _layer_state(path, trust) for index, path in sources.items()}
    _check_shapes(module, states, sources)
    shapes = {f"{i}.{k}": list(v.shape) for i, sd in states.items() for k, v in sd.items()}
    opt, hyper = (_optimizer_by_name(module, ranks, shapes, trust)
                  if optimizer and module is not None and ranks else ({}, {}))
    first = _torch_load(ranks[min(ranks)], trust) if ranks else {}
    _check_counters(first, ranks[min(ranks)] if ranks else "")
    for entry in entries:
        if "file" in entry:
            entry["shapes"] = {k: list(v.shape) for k, v in states[entry["index"]].items()}
    out = os.path.join(pk_root, tag)
    os.makedirs(out, exist_ok=True)
    for index, state in states.items():
        _write_file(os.path.join(out, layer_file(index)), {
            "layer": index, "state": state,
            "optimizer": {k: opt[f"{index}.{k}"] for k in state if f"{index}.{k}" in opt},
            "param_groups": {k: hyper[f"{index}.{k}"] for k in state
                             if f"{index}.{k}" in hyper}})
    _write_file(os.path.join(out, rank_file(0)), _rank_payload(first))
    _write_file(os.path.join(out, "meta.json"),
                json.dumps(_meta(first, entries, len(ranks))).encode())
    _write_file(os.path.join(pk_root, "latest"), (tag + "\n").encode())
    return out


def _check_complete(directory: str, module: Any, entries: list[dict], sources: dict[int, str],
                    ranks: dict[int, str]) -> None:
    """``DataError`` naming the first file a complete checkpoint has and ``directory``
    lacks: an ``mp_rank`` file of a stage below the highest, or (with the model) the file
    of a layer with weights."""
    for stage in range(max(ranks, default=-1) + 1):
        if stage not in ranks:
            raise DataError(f"checkpoint file {os.path.join(directory, _rank_name(stage))} "
                            "is missing", hint="the checkpoint is incomplete: copy the whole "
                                               "tag directory")
    if module is None:
        return
    specs = module._layer_specs
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        for entry in entries:
            index = entry["index"]
            if entry["canonical"] != index or index in sources:
                continue
            spec = specs[index]
            layer = spec.build() if isinstance(spec, pk.LayerSpec) else spec
            if isinstance(layer, nn.Module) and layer.state_dict():
                name = f"layer_{index:02d}-model_states.pt"
                raise DataError(f"checkpoint file {os.path.join(directory, name)} (layer "
                                f"{index}, {type(layer).__name__}) is missing",
                                hint="the checkpoint is incomplete, or of another model: copy "
                                     "the whole tag directory")


def _check_shapes(module: Any, states: dict[int, dict], sources: dict[int, str]) -> None:
    """With the model: ``DataError`` naming the first layer file whose tensors are not
    the layer's (names or shapes), before anything is converted or loaded."""
    if module is None:
        return
    specs = module._layer_specs
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        for index, state in sorted(states.items()):
            spec = specs[index] if index < len(specs) else None
            layer = spec.build() if isinstance(spec, pk.LayerSpec) else spec
            if not isinstance(layer, nn.Module):
                continue
            ours = {k: list(v.shape) for k, v in layer.state_dict().items()}
            theirs = {k: list(v.shape) for k, v in state.items()}
            for key in [*ours, *(k for k in theirs if k not in ours)]:
                if ours.get(key) != theirs.get(key):
                    raise DataError(f"checkpoint file {sources[index]} holds {key!r} of shape "
                                    f"{theirs.get(key, 'missing')} and layer {index} "
                                    f"({type(layer).__name__}) has {ours.get(key, 'missing')}",
                                    hint="load it into the model it was saved from (the same "
                                         "layers and sizes)")


def _rank_name(stage: int) -> str:
    return f"mp_rank_{stage:02d}_model_states.pt"


def _check_counters(first: dict, path: str) -> None:
    """``DataError`` unless the counters and the scheduler state of an ``mp_rank`` file
    have DeepSpeed's types (checked before anything is written or applied)."""
    for key in ("global_steps", "skipped_steps", "global_samples", "dp_world_size"):
        value = first.get(key, 0)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 0):
            raise DataError(f"checkpoint file {path}: {key!r} is {value!r}, not a count",
                            hint="pass a directory DeepSpeed's save_checkpoint wrote")
    for key in ("lr_scheduler", "ds_config"):
        if not isinstance(first.get(key) or {}, dict):
            raise DataError(f"checkpoint file {path}: {key!r} is a "
                            f"{type(first.get(key)).__name__}, not a dict",
                            hint="pass a directory DeepSpeed's save_checkpoint wrote")


def _rank_payload(first: dict) -> dict:
    config = first.get("ds_config") or {}
    dp = int(first.get("dp_world_size", 1) or 1)
    try:
        _, micro, _ = batch_sizes(config, dp)
        position = int(first.get("global_samples", 0)) // (micro * dp)
    except (ConfigError, TypeError):
        position = None
    payload = {"rank": 0, "stage": 0, "data_parallel_rank": 0,
               "global_steps": int(first.get("global_steps", 0)),
               "skipped_steps": int(first.get("skipped_steps", 0)), "precision": {},
               "lr_scheduler": first.get("lr_scheduler"),
               "client_state": {k: v for k, v in first.items() if k not in DS_KEYS}}
    if position is not None:
        payload["data_position"] = position
    return payload


def _meta(first: dict, entries: list[dict], stages: int) -> dict:
    return {"format_version": LAYER_FORMAT_VERSION, "pipekernel_version": pk.__version__,
            "torch_version": torch.__version__, "source": "deepspeed " +
            str(first.get("ds_version", "?")),
            # never equal to a running engine's layout: no RNG restore, rank 0's file
            "topology": {"num_stages": stages, "source": "deepspeed",
                         "data_parallel_size": int(first.get("dp_world_size", 1) or 1)},
            "schedule": "1f1b", "micro_batches": None, "precision": None,
            "optimizer": None, "lr_scheduler": None,
            "global_steps": int(first.get("global_steps", 0)),
            "skipped_steps": int(first.get("skipped_steps", 0)),
            "num_layers": len(entries), "layers": entries,
            "files": sorted([e["file"] for e in entries if "file" in e] + [rank_file(0)])}


def load(shim: Any, root: str | os.PathLike, tag: str | None = None, *, optimizer: bool = True,
         lr_scheduler: bool = True, counters: bool = True,
         trust_checkpoint: bool = False) -> tuple[str, Any]:
    """``engine.load_checkpoint`` of :class:`~pipekernel.deepspeed.engine.PipelineEngine`:
    a pipekernel checkpoint loads directly, a DeepSpeed one through :func:`convert` into a
    temporary directory of this rank. Every rank calls it. Data only unless
    ``trust_checkpoint`` (an ``UntrustedCheckpointError`` names the facade's switches).

    :returns: ``(directory, client_state)``.
    """
    try:
        return _load(shim, root, tag, optimizer, lr_scheduler, counters, trust_checkpoint)
    except UntrustedCheckpointError as err:
        err.hint = (f"if the checkpoint comes from a source you trust, load it with {SWITCH}; "
                    "otherwise do not load it (nothing was loaded)")
        raise


def _load(shim: Any, root: str | os.PathLike, tag: str | None, optimizer: bool,
          lr_scheduler: bool, counters: bool, trust: bool) -> tuple[str, Any]:
    root = os.fspath(root)
    tag = _tag(root, tag)
    directory = os.path.join(root, tag)
    engine = shim.engine
    keep = _Kept(engine, optimizer, lr_scheduler, counters)
    if not is_deepspeed_checkpoint(directory):
        info = engine.load_checkpoint(root, tag, trust_checkpoint=trust)
        keep.restore()
        return info["directory"], info["client_state"]
    scratch = tempfile.mkdtemp(prefix="pk-from-deepspeed-")
    try:
        convert(root, scratch, tag, module=shim.module, optimizer=optimizer,
                trust_checkpoint=trust)
        info = engine.load_checkpoint(scratch, tag, trust_checkpoint=trust)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    keep.restore()
    return directory, info["client_state"]


class _Kept:
    """What ``load_checkpoint`` was asked not to load, put back after the load."""

    def __init__(self, engine: Any, optimizer: bool, lr_scheduler: bool, counters: bool) -> None:
        import copy
        self.engine = engine
        self.optimizer = (None if optimizer or engine.optimizer is None
                          else copy.deepcopy(engine.optimizer.state_dict()))
        self.scheduler = (None if lr_scheduler or engine.lr_scheduler is None
                          else engine.lr_scheduler.state_dict())
        self.counters = (None if counters else (engine.global_steps, engine.skipped_steps,
                                                engine.trained_micro_batches))

    def restore(self) -> None:
        if self.optimizer is not None:
            self.engine.optimizer.load_state_dict(self.optimizer)
        if self.scheduler is not None:
            self.engine.lr_scheduler.load_state_dict(self.scheduler)
        if self.counters is not None:
            (self.engine.global_steps, self.engine.skipped_steps,
             self.engine.trained_micro_batches) = self.counters
