"""Checkpoints: save a pipeline, resume it bit-exactly, load it at another shape.

The format is pipekernel's own, one directory per checkpoint (a *tag*) under a
checkpoint root, plus a ``latest`` pointer::

    root/
      latest                 text file: the tag of the newest complete checkpoint
      global_step12/
        meta.json            format version, topology, schedule, chunks, bounds, layer
                             count, every layer's tensor shapes, counters, versions
        layer-00003.pt       one per global layer with state (tied weights once): the
                             layer's state_dict (fp32 master values under low precision),
                             the optimizer state of each of its parameters and that
                             parameter's param-group hyperparameters, keyed by name
        rank-00001.pt        one per rank: RNG states (CPU, CUDA, Python), the
                             precision policy's own state (loss scale, ...), the LR
                             scheduler, the data-parallel rank and data position

Shards live in memory, never in these files: on save ZeRO-1's optimizer state is put
together by its collective ``state_dict``, expert slices are gathered, and DTensors
(FSDP2's shards, a tensor-parallel plan's) are gathered whole over their mesh; data-parallel
and tensor-parallel rank 0 writes. On load each rank cuts its own shards (DTensor stages
through torch's ``set_state_dict``, :func:`pipekernel.engine.checkpoint_dcp.load_layer_files`).
So a checkpoint loads at any layout, with or without ZeRO, FSDP2 or a plan, and as one
plain model.

**One writer** (issue 45). These files are the one format pipekernel writes. Directories of
``torch.distributed.checkpoint`` (DCP), which sharded stages wrote before, are still read
(``meta["format"] == "dcp"``: :mod:`pipekernel.engine.checkpoint_dcp`). Why these files
and not DCP: they are written and read over any transport (DCP needs
``torch.distributed``'s default group under the engine: not ``cupy-nccl``, not a
``transport_options`` group), they load into every layout (DCP's state-dict API cannot
map ZeRO-1's optimizer), and each is one ``torch.load`` under ``weights_only`` (DCP's
metadata is a pickle that may name other files). The trade-off: a layer is written by one
rank, gathered whole in its memory first (no parallel writes within a layer), which
matters for single layers of many gigabytes.

What a caller may rely on:

* **Atomic.** Files are written under ``root/.tmp-<tag>``, each fsynced; every rank
  reports success or failure through one all-reduce; only when all succeeded does
  rank 0 rename the directory to ``root/<tag>``, fsync the root and then replace
  ``latest`` (written to a temporary file, fsynced, ``os.replace``). A crash or an
  error at any point leaves ``latest`` on the previous complete checkpoint.
* **Every rank agrees.** :func:`save` and :func:`load` are collective: an error on
  one rank (no space, no permission, a missing file) is raised on *every* rank, with
  the failing rank's message, and nothing is half-applied.
* **Partitioning-independent.** Weights are keyed by global layer index and optimizer
  state by parameter name (``"{layer}.{name}"``, a tied weight under its first
  layer), so a checkpoint saved at P stages x D replicas x T tensor-parallel ranks
  (any schedule, any chunks, ZeRO-1, FSDP2 or not) loads at P' x D' x T', and
  :func:`load_sequential` loads it as one plain model.
* **Bit-exact resume at the same shape.** Loading into the same stages, replicas,
  schedule placement, chunks and bounds restores every rank's RNG states too, so
  training continues exactly as if never stopped (fp32 with dropout, fp16 with its
  loss scale). After a reshape the weights and optimizer state are exact, but RNG
  streams are per rank and not restored (a stage that now runs other layers draws
  its dropout masks in another order), and a different data-parallel degree sums
  gradients in another order, so later steps agree to round-off, not bitwise.
"""
from __future__ import annotations

import errno
import json
import os
import random
import shutil
import uuid
from functools import partial
from typing import Any

import torch
from torch import nn

from pipekernel.engine import checkpoint_dcp
from pipekernel.engine.checkpoint_layout import (MASTERS, _log, apply_rank_state,
                                                 on_every_rank, check_model, has_state, layout,
                                                 loaded, local_layers, same_layout)
from pipekernel.grid import expert_parallel
from pipekernel.engine.checkpoint_files import (FORMAT_VERSION, LAYER_FORMAT_VERSION,
                                                _fsync_dir, _read_layer, _read_rank,
                                                _write_file, latest_tag, layer_file,
                                                rank_file, read_meta)
from pipekernel.comm.agreement import check_consistency
from pipekernel.errors import ConfigError, PipelineError
from pipekernel.extend.views import EngineView
from pipekernel.nested import map_tensors

__all__ = ["FORMAT_VERSION", "save", "load", "resume", "load_sequential", "read_meta",
           "latest_tag"]



# -- names: global layer and parameter names on one stage -----------------------------------

def _layer_meta(module: Any) -> list[dict[str, Any]]:
    """Per global layer: type, tie, the file holding it and its tensors' shapes (from a
    meta-device build: nothing is allocated)."""
    from pipekernel.model.module import TiedLayerSpec
    num = len(module.layers)
    with torch.device("meta"):
        full = module.build_stage(0, [0, num])
    canonical = {int(name): (index, layer) for name, index, layer in local_layers(full, module)}
    out = []
    for i, spec in enumerate(module.layers):
        typename = getattr(spec, "typename", type(spec))
        entry: dict[str, Any] = {"index": i, "type": getattr(typename, "__name__", str(typename))}
        if isinstance(spec, TiedLayerSpec):
            entry["tied"], entry["canonical"] = spec.key, module._first_tied[spec.key]
        else:
            entry["canonical"] = i
        if i in canonical and canonical[i][0] == i and has_state(canonical[i][1]):
            entry["file"] = layer_file(i)
            entry["shapes"] = {k: list(v.shape) for k, v in canonical[i][1].state_dict().items()}
        out.append(entry)
    return out


# -- save --------------------------------------------------------------------------------

def _optimizer_params(optimizer: Any) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _group_of(optimizer: Any) -> dict[int, dict[str, Any]]:
    out = {}
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        for p in group["params"]:
            out[id(p)] = hyper
    return out


def _cpu(obj: Any) -> Any:
    return map_tensors(lambda t: t.detach().to("cpu", copy=True), obj)


def _whole(obj: Any) -> Any:
    """``obj`` with every DTensor (FSDP2 shards, a tensor-parallel plan's) gathered whole:
    collective over each DTensor's mesh, in the order of ``obj`` (the same on every rank
    of the stage)."""
    from torch.distributed.tensor import DTensor

    return map_tensors(lambda t: t.full_tensor() if isinstance(t, DTensor) else t, obj)


def _ep(engine: EngineView) -> expert_parallel.ExpertParallelGroup:
    """The engine's expert-parallel group (the trivial one of size 1 where it has none)."""
    group = engine.ep_group
    return group if group is not None else expert_parallel.ExpertParallelGroup()


def _layer_payloads(engine: EngineView) -> dict[int, dict[str, Any]]:
    """The layer files this rank writes (data-parallel and tensor-parallel rank 0,
    canonical layers only), with whole tensors: ZeRO-1 shards (a collective
    ``state_dict``), DTensors (gathered over their mesh) and expert slices (gathered) put
    together."""
    precision, optimizer = engine.precision, engine.optimizer
    opt_state = optimizer.state_dict()["state"] if optimizer is not None else {}
    ep = _ep(engine)
    sharded = any(hasattr(t, "full_tensor") for t in engine.module.state_dict().values())
    if engine.data_parallel_rank >= ep.size and not sharded:
        return {}  # the first expert-parallel group gathers; DTensors gather on every rank
    index_of = ({id(p): i for i, p in enumerate(_optimizer_params(optimizer))}
                if optimizer is not None else {})
    groups = _group_of(optimizer) if optimizer is not None else {}
    payloads = {}
    for name, index, layer in local_layers(engine.module, engine.pipeline_module):
        if int(name) != index or not has_state(layer):
            continue
        state = layer.state_dict()
        optim, hyper = {}, {}
        for sub, param in layer.named_parameters():
            master = precision.master(param)
            if master is not param:
                state[sub] = master  # the fp32 value, not its low-precision cast
            i = index_of.get(id(master))
            if i is not None:
                hyper[sub] = groups[id(master)]
                if i in opt_state:
                    optim[sub] = opt_state[i]
        state, optim = _whole(state), _whole(optim)
        state, optim = expert_parallel.gather_layer_state(layer, state, optim, ep)
        payloads[index] = _cpu({"layer": index, "state": state, "optimizer": optim,
                                "param_groups": hyper})
    writes = engine.data_parallel_rank == 0 and engine.topology.model_rank == 0
    return payloads if writes else {}


def _rng_state(device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda" and torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _rank_payload(engine: EngineView, client_state: Any) -> dict[str, Any]:
    precision_state = dict(engine.precision.state_dict())
    precision_state.pop(MASTERS, None)  # kept per parameter in the layer files
    scheduler = engine.lr_scheduler
    return _cpu({
        "rank": engine.rank, "stage": engine.stage,
        "data_parallel_rank": engine.data_parallel_rank,
        "global_steps": engine.global_steps, "skipped_steps": engine.skipped_steps,
        "data_position": engine.trained_micro_batches,
        "rng": _rng_state(torch.device(engine.transport.device)),
        "precision": precision_state,
        "lr_scheduler": scheduler.state_dict() if scheduler is not None else None,
        "client_state": client_state,
    })


def _meta(engine: EngineView) -> dict[str, Any]:
    import pipekernel
    module = engine.pipeline_module
    layers = _layer_meta(module)
    return {
        "format_version": LAYER_FORMAT_VERSION, "pipekernel_version": pipekernel.__version__,
        "torch_version": torch.__version__,
        "topology": layout(engine), "schedule": engine.schedule_cls.name,
        "part_stages": list(engine.part_stages), "micro_batches": engine.micro_batches,
        "precision": engine.precision.name,
        "optimizer": type(engine.optimizer).__name__ if engine.optimizer is not None else None,
        "lr_scheduler": (type(engine.lr_scheduler).__name__
                         if engine.lr_scheduler is not None else None),
        "global_steps": engine.global_steps, "skipped_steps": engine.skipped_steps,
        "num_layers": len(module.layers), "layers": layers,
        "files": sorted([entry["file"] for entry in layers if "file" in entry]
                        + [rank_file(r) for r in range(engine.transport.world_size)]),
    }


def _check_tag(tag: str) -> None:
    if not tag or tag in (".", "..", "latest") or "/" in tag or os.sep in tag \
            or tag.startswith("."):
        raise ConfigError(f"invalid checkpoint tag {tag!r}",
                          hint="a tag is one directory name, e.g. 'global_step100'")


def _publish(root: str, tag: str, tmp: str, final: str) -> None:
    """Rank 0, every rank's files written: move ``tmp`` to ``final`` (replacing an older
    save of ``tag``), then point ``root/latest`` at it — each step atomic and synced."""
    _fsync_dir(tmp)
    trash = None
    if os.path.lexists(final):
        trash = os.path.join(root, f".old-{tag}-{uuid.uuid4().hex[:8]}")
        os.rename(final, trash)
    os.rename(tmp, final)
    _fsync_dir(root)
    pointer = os.path.join(root, f".latest-{uuid.uuid4().hex[:8]}")
    _write_file(pointer, (tag + "\n").encode())
    os.replace(pointer, os.path.join(root, "latest"))
    _fsync_dir(root)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def save(engine: EngineView, root: str | os.PathLike, tag: str | None = None,
         client_state: Any = None, format: str | None = None) -> str:  # noqa: A002
    """Write a checkpoint of ``engine`` to ``root/tag`` and point ``root/latest`` at it.

    Collective: every rank of the engine calls it with the same ``root`` and ``tag``
    (default ``f"global_step{engine.global_steps}"``). ``client_state`` (tensors,
    numbers, strings, lists, dicts) is stored per rank and returned by :func:`load`.
    Saving an existing tag replaces it. Every engine writes pipekernel's layer files,
    sharded stages (FSDP2, DTensor plans, expert slices) gathered whole; ``format``:
    ``None`` (checkpoints of ``torch.distributed.checkpoint`` are read, not written:
    docs/checkpoints.md, "One writer").

    :returns: the checkpoint directory, on every rank.
    :raises ConfigError: on every rank when any rank could not write (the reason and
        rank in the message); ``latest`` and the previous checkpoints are untouched.
    """
    root = os.fspath(root)
    tag = tag if tag is not None else f"global_step{engine.global_steps}"
    if format is not None:
        raise ConfigError(f"save_checkpoint: format={format!r}: pipekernel writes one "
                          f"checkpoint format, its layer files (sharded stages gathered "
                          f"whole); checkpoints of torch.distributed.checkpoint (format='dcp' "
                          f"before) are read, not written",
                          hint="drop format=; every checkpoint loads at any layout "
                               "(docs/checkpoints.md, 'One writer')", rank=engine.rank)
    rank, transport = engine.rank, engine.transport
    final = os.path.join(root, tag)
    tmp = os.path.join(root, f".tmp-{tag}")

    def prepare() -> tuple[dict, dict, bytes | None]:
        _check_tag(tag)
        engine.runtime.flush()
        layers = _layer_payloads(engine)
        mine = _rank_payload(engine, client_state)
        meta = json.dumps(_meta(engine), indent=1).encode() if rank == 0 else None
        if rank == 0:
            os.makedirs(root, exist_ok=True)
            if os.path.lexists(tmp):
                shutil.rmtree(tmp)
            os.mkdir(tmp)
        return layers, mine, meta

    layers, mine, meta = on_every_rank(transport, prepare, wrap=partial(_wrap, root, "prepare"))

    def write() -> None:
        if meta is not None:
            _write_file(os.path.join(tmp, "meta.json"), meta)
        for index, payload in sorted(layers.items()):
            _write_file(os.path.join(tmp, layer_file(index)), payload)
        _write_file(os.path.join(tmp, rank_file(rank)), mine)

    on_every_rank(transport, write, wrap=partial(_wrap, root, "write"))
    on_every_rank(transport, lambda: _publish(root, tag, tmp, final) if rank == 0 else None,
                  wrap=partial(_wrap, root, "publish"))
    return final


def _wrap(root: str, phase: str, error: BaseException) -> BaseException:
    """An ``OSError`` becomes a ``ConfigError`` saying what could not be written and why."""
    if isinstance(error, PipelineError):
        return error
    if isinstance(error, OSError):
        reason = {errno.ENOSPC: "the disk is full", errno.EACCES: "permission denied",
                  errno.EROFS: "the file system is read-only",
                  errno.EDQUOT: "the disk quota is exceeded"}.get(error.errno or -1, "")
        return ConfigError(
            f"cannot save the checkpoint under {root} ({phase}): "
            f"{reason + ': ' if reason else ''}{error}",
            hint="free space or fix permissions on the checkpoint directory, or save "
                 "elsewhere; the previous checkpoint and 'latest' are unchanged")
    return ConfigError(f"cannot save the checkpoint under {root} ({phase}): "
                       f"{type(error).__name__}: {error}",
                       hint="the previous checkpoint and 'latest' are unchanged")


# -- load --------------------------------------------------------------------------------

def load(engine: EngineView, root: str | os.PathLike, tag: str | None = None, *,
         trust_checkpoint: bool = False) -> dict[str, Any]:
    """Load checkpoint ``tag`` (default: the one ``root/latest`` names) into ``engine``.

    Collective: every rank calls it. Each rank reads the layer files of the layers it
    holds, whatever shape the checkpoint was saved at; weights, optimizer state (by
    parameter name), the precision policy's state, the LR scheduler and the step
    counters are restored. RNG states are restored when the shape (stages, replicas,
    chunks, placement, bounds) is the one saved, which makes the resume bit-exact.
    Nothing changes on any rank unless every rank could read everything it needs. Files
    load as data only; ``trust_checkpoint=True`` unpickles fully (docs/checkpoints.md).

    :returns: ``{"directory", "tag", "global_steps", "skipped_steps", "data_position"
        (micro-batches this replica had consumed), "client_state" (this rank's, or
        rank 0's after a reshape), "exact" (same shape: RNG restored), "meta"}``.
    :raises DataError: a missing, corrupt or ill-typed file (names it and the layer);
        ``UntrustedCheckpointError`` one not data only (names the global and the switch).
    :raises ConfigError: another model (names the layer and the shapes), a newer format.
    """
    root = os.fspath(root)
    rank, transport, trust = engine.rank, engine.transport, bool(trust_checkpoint)
    found = on_every_rank(transport, read_meta, root, tag)
    if checkpoint_dcp.is_dcp(found[1]):  # a DCP directory (written before issue 45)
        return checkpoint_dcp.load(engine, root, tag, *found, trust=trust)
    if checkpoint_dcp.sharded(engine):  # DTensor stages: shards cut from whole tensors
        return checkpoint_dcp.load_layer_files(engine, *found, trust=trust)
    local = local_layers(engine.module, engine.pipeline_module)
    ep = _ep(engine)

    def read() -> tuple:
        directory, meta = read_meta(root, tag)
        needed = sorted({index for _, index, layer in local if has_state(layer)})
        canonical_layers: dict[int, nn.Module] = {}
        for name, index, layer in local:
            canonical_layers.setdefault(index, layer)
        check_model(meta, engine.pipeline_module, directory,
                     [(i, canonical_layers[i]) for i in needed],
                     lambda layer: expert_parallel.full_shapes(
                         layer, ep, {k: list(v.shape) for k, v in layer.state_dict().items()}))
        payloads = {i: _read_layer(directory, meta, i, trust) for i in needed}
        exact = same_layout(meta["topology"], layout(engine))
        mine = _read_rank(directory, rank if exact else 0, trust)
        return directory, meta, payloads, mine, exact

    directory, meta, payloads, mine, exact = on_every_rank(transport, read)
    on_every_rank(transport, _apply, engine, local, payloads, mine, exact, meta)
    _log.info("rank %d loaded checkpoint %s (step %d%s)", rank, directory, meta["global_steps"],
              "" if exact else f", reshaped from {meta['topology']['num_stages']} stages x "
                               f"{meta['topology']['data_parallel_size']} replicas")
    return loaded(engine, directory, meta, mine, exact)


def resume(engine: EngineView, root: str | os.PathLike, *,
           trust_checkpoint: bool = False) -> dict[str, Any] | None:
    """Load the checkpoint ``root/latest`` names if there is one: the one call that makes
    a job (re)started by torchrun, a scheduler or by hand continue where it left off.

    Collective: every rank calls it with the same ``root``. The ranks first agree (one
    small all-reduce) on which checkpoint they see, then load it as :func:`load` does
    (bit-exact at the same shape). Training continues at ``engine.global_steps``.

    :returns: :func:`load`'s dict, or ``None`` when ``root/latest`` exists on no rank
        (a fresh start: nothing changed).
    :raises ConfigError: the ranks see different checkpoints (or some none): ``root``
        must be one directory every rank shares.
    :raises DataError: ``latest`` names a missing or truncated checkpoint.
    """
    root = os.fspath(root)
    tag = on_every_rank(engine.transport, lambda: latest_tag(root) if os.path.exists(
        os.path.join(root, "latest")) else None)
    try:
        check_consistency(engine.transport, {"latest": tag},
                          f"view of the checkpoints under {root}")
    except ConfigError as err:
        err.hint = (f"{root} must be one directory every rank shares (a shared file "
                    "system), or hold the same checkpoints on every node")
        raise
    return None if tag is None else load(engine, root, tag, trust_checkpoint=trust_checkpoint)


def _apply(engine: EngineView, local: list, payloads: dict, mine: dict, exact: bool,
           meta: dict) -> None:
    precision, optimizer = engine.precision, engine.optimizer
    masters: dict[str, torch.Tensor] = {}
    local_param_names: dict[int, str] = {}
    named_state, groups = {}, {}
    with torch.no_grad():
        for name, index, layer in local:
            payload = payloads.get(index)
            if payload is None:
                continue
            state, optim = expert_parallel.shard_layer_state(
                layer, payload["state"], payload["optimizer"], _ep(engine))
            payload = {**payload, "state": state, "optimizer": optim}
            try:
                layer.load_state_dict(payload["state"], strict=True)
            except RuntimeError as err:
                raise ConfigError(f"layer {index} does not match checkpoint file "
                                  f"{layer_file(index)}: {err}",
                                  hint="load it with the layer list it was saved from") from err
            for sub, param in layer.named_parameters():
                full = f"{name}.{sub}"
                if precision.master(param) is not param and sub in payload["state"]:
                    masters[full] = payload["state"][sub]
                local_param_names[id(precision.master(param))] = f"{index}.{sub}"
                if sub in payload["optimizer"]:
                    named_state[f"{index}.{sub}"] = payload["optimizer"][sub]
                if sub in payload["param_groups"]:
                    groups[f"{index}.{sub}"] = payload["param_groups"][sub]
    precision.load_state_dict({**mine.get("precision", {}), MASTERS: masters})
    if optimizer is not None:
        _load_optimizer(optimizer, local_param_names, named_state, groups)
    apply_rank_state(engine, mine, exact, meta)


def _load_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str],
                    named_state: dict[str, Any], groups: dict[str, dict]) -> None:
    """Load per-name state into ``optimizer``: torch keys its state by the index of a
    parameter in ``param_groups`` order, so indices are rebuilt on this side."""
    state, index = {}, 0
    param_groups = []
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        ids = []
        for p in group["params"]:
            name = names.get(id(p))
            if name in named_state:
                state[index] = named_state[name]
            ids.append(index)
            index += 1
        saved = next((groups[names[id(p)]] for p in group["params"]
                      if names.get(id(p)) in groups), None)
        if saved is not None:
            hyper.update(saved)
        param_groups.append({**hyper, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})


# -- inference ---------------------------------------------------------------------------

def load_sequential(root: str | os.PathLike, module: Any, tag: str | None = None,
                    device: torch.device | str | None = None, *,
                    trust_checkpoint: bool = False) -> nn.Module:
    """The whole model of checkpoint ``tag`` (default ``latest``) as one
    :class:`~pipekernel.model.module.StageModule` — chained like ``nn.Sequential``,
    ``state_dict`` keys ``"{global layer}.{name}"`` — with the checkpoint's weights
    (fp32 masters for low-precision training), in eval mode. No process group is
    needed: it runs in any single process (inference, export).

    :param module: the :class:`~pipekernel.PipelineModule` the checkpoint was saved
        from (its layer list; the partitioning does not matter).
    :param trust_checkpoint: unpickle everything (only for files from a source you trust);
        by default the files load as data only, as in :func:`load`.
    :raises DataError: a missing, truncated or corrupt file, or one that is not data only.
    :raises ConfigError: another model.
    """
    root = os.fspath(root)
    directory, meta = read_meta(root, tag)
    if checkpoint_dcp.is_dcp(meta):  # saved by sharded stages: DCP reads whole tensors
        full = checkpoint_dcp.load_sequential(directory, meta, module, trust=trust_checkpoint)
        return (full.to(device) if device is not None else full).eval()
    num = len(module.layers)
    if meta["num_layers"] != num:
        check_model(meta, module, directory, [])
    full = module.build_stage(0, [0, num])
    local = local_layers(full, module)
    check_model(meta, module, directory,
                 [(index, layer) for name, index, layer in local
                  if int(name) == index and has_state(layer)])
    states = {index: _read_layer(directory, meta, index, trust_checkpoint)["state"]
              for name, index, layer in local if int(name) == index and has_state(layer)}
    with torch.no_grad():  # every file read (and checked) before the first is applied
        for name, index, layer in local:
            if index in states and int(name) == index:
                layer.load_state_dict(states[index])
    if device is not None:
        full = full.to(device)
    return full.eval()
