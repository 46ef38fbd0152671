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
from typing import Any

import torch
from torch import nn

import pipekernel as pk
from pipekernel.engine.checkpoint_files import (LAYER_FORMAT_VERSION, _write_file, layer_file,
                                                rank_file)
from pipekernel.errors import ConfigError, DataError

from .config import batch_sizes

__all__ = ["convert", "load", "is_deepspeed_checkpoint", "DS_KEYS"]

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


def _torch_load(path: str) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise DataError(f"checkpoint file {path} is missing") from None
    except Exception:  # noqa: BLE001 - DeepSpeed pickles more than tensors in mp_rank files
        try:
            return torch.load(path, map_location="cpu", weights_only=False)
        except Exception as err:  # noqa: BLE001
            raise DataError(f"checkpoint file {path} is truncated or corrupt: {err}") from err


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


def _optimizer_by_name(module: Any, ranks: dict[int, str], shapes: dict[str, list]
                       ) -> tuple[dict[str, Any], dict[str, dict]]:
    """``({parameter name: its optimizer state}, {name: its group's hyperparameters})``
    from every stage's ``mp_rank`` file (see the module docstring for when it applies)."""
    with torch.random.fork_rng(devices=[]):
        bounds = module.partition(len(ranks))
    state_by_name: dict[str, Any] = {}
    hyper_by_name: dict[str, dict] = {}
    for stage, path in sorted(ranks.items()):
        saved = _torch_load(path).get("optimizer")
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
            optimizer: bool = True) -> str:
    """Write DeepSpeed checkpoint ``ds_dir/tag`` (default: ``ds_dir/latest``) as a
    pipekernel checkpoint ``pk_dir/tag`` (and ``pk_dir/latest``), loadable at any stage
    count by ``engine.load_checkpoint(pk_dir)`` or :func:`pipekernel.load_sequential`.

    :param module: the :class:`~pipekernel.deepspeed.pipe.PipelineModule` it was trained
        with: needed for the optimizer state and to place tied modules; without it only
        weights, scheduler and counters are converted.
    :param num_layers: the model's layer count (default: the module's, else the highest
        layer file + 1: pass it when the last layers have no weights).
    :param optimizer: convert the optimizer state (needs ``module``).
    :returns: the pipekernel checkpoint directory.
    :raises DataError: missing files. :raises ConfigError: what cannot be converted, named.
    """
    ds_root, pk_root = os.fspath(ds_dir), os.fspath(pk_dir)
    tag = _tag(ds_root, tag)
    layers, ranks = _scan(os.path.join(ds_root, tag))
    count = (num_layers or (len(module._layer_specs) if module is not None else None)
             or max(layers) + 1)
    entries, sources = _layer_entries(module, layers, count)
    states = {index: _torch_load(path) for index, path in sources.items()}
    shapes = {f"{i}.{k}": list(v.shape) for i, sd in states.items() for k, v in sd.items()}
    opt, hyper = (_optimizer_by_name(module, ranks, shapes)
                  if optimizer and module is not None and ranks else ({}, {}))
    first = _torch_load(ranks[min(ranks)]) if ranks else {}
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
         lr_scheduler: bool = True, counters: bool = True) -> tuple[str, Any]:
    """``engine.load_checkpoint`` of :class:`~pipekernel.deepspeed.engine.PipelineEngine`:
    a pipekernel checkpoint loads directly, a DeepSpeed one through :func:`convert` into a
    temporary directory of this rank. Every rank calls it.

    :returns: ``(directory, client_state)``.
    """
    root = os.fspath(root)
    tag = _tag(root, tag)
    directory = os.path.join(root, tag)
    engine = shim.engine
    keep = _Kept(engine, optimizer, lr_scheduler, counters)
    if not is_deepspeed_checkpoint(directory):
        info = engine.load_checkpoint(root, tag)
        keep.restore()
        return info["directory"], info["client_state"]
    scratch = tempfile.mkdtemp(prefix="pk-from-deepspeed-")
    try:
        convert(root, scratch, tag, module=shim.module, optimizer=optimizer)
        info = engine.load_checkpoint(scratch, tag)
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
