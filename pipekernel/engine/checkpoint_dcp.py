"""Sharded stages and checkpoints: reading ``torch.distributed.checkpoint`` (DCP)
directories, and putting whole tensors into DTensor stages.

An engine whose stages hold torch parallelism — FSDP2 (``data_parallel_shard=N``), a
DTensor plan (``tensor_parallel_plan=``), a user's ``pipekernel_parallelize_stage`` — has
DTensor parameters and optimizer state. It *writes* pipekernel's layer files like every
engine (:func:`pipekernel.engine.checkpoint.save` gathers each DTensor whole), and
*loads* through torch's ``set_state_dict``: :func:`load_layer_files` cuts each rank's
shards from the whole tensors read (:func:`sharded` says which engines, collectively).

**DCP directories** — what pipekernel wrote for sharded stages before issue 45 (and for
``save_checkpoint(format="dcp")``) — stay readable, into any engine:
:func:`pipekernel.engine.checkpoint.load` sends every checkpoint whose ``meta.json`` says
``"format": "dcp"`` to :func:`load`, and ``load_sequential`` to :func:`load_sequential`::

    root/global_step12/
      meta.json          "format": "dcp", the layout (stages x replicas x shards x tp)
      rank-00001.pt      RNG, precision, LR scheduler, counters, client_state (as always)
      dcp/               DCP's files: .metadata and one __R_0.distcp per writing rank
                         keys "model.{layer}.{name}", "optim.state.{layer}.{name}.{key}",
                         "optim.param_groups.{layer}.{name}.{hyperparameter}"

The keys are pipeline-independent (a global layer index, a tied weight under its first
layer), so DCP's read plan maps them to any stages x shards x tp layout. The model and
optimizer go through ``get_state_dict`` / ``set_state_dict`` with
``flatten_optimizer_state_dict=True`` (state and param-group hyperparameters keyed per
parameter name, as the layer files key them). At the layout saved every tensor is
restored bit for bit and every rank its RNG; at another, weights and optimizer state are
exact and later steps agree to round-off. Data only unless trusted
(:func:`pipekernel.engine.checkpoint_data.dcp_load`).

Expert slices (``expert_parallel_size=E``) were written as DTensor ``Shard(dim)`` views over
the rank's expert-parallel group, of the whole stack's shape (:func:`_expert_views`), so a
load at any ``E`` reads its own slice. Precision policies that keep fp32 masters outside
the module have each such parameter replaced in its module by its master while the state
dicts are taken and set (:func:`_masters_shown`): the checkpoint's ``model.`` key is the
master, as in the layer files; after a load each low-precision parameter is set from it.

What ``get_state_dict`` cannot map is refused by name (:func:`check_engine`): ZeRO-1
(torch's ZeroRedundancyOptimizer) and masters not of their parameter's shape.
"""
from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch

from pipekernel.engine import checkpoint_data
from pipekernel.engine.checkpoint_files import _read_layer, _read_rank
from pipekernel.engine.checkpoint_layout import (MASTERS, _log, apply_rank_state,
                                                 on_every_rank, check_model, has_state, layout,
                                                 loaded, local_layers, same_layout)
from pipekernel.errors import ConfigError, DataError, PipelineError
from pipekernel.grid import expert_parallel

__all__ = ["DCP_DIR", "FORMAT", "check_engine", "is_dcp", "load", "load_layer_files",
           "load_sequential", "sharded"]

#: The ``"format"`` of a DCP checkpoint's ``meta.json`` (absent: pipekernel's layer files).
FORMAT = "dcp"
#: The subdirectory of a checkpoint holding DCP's files.
DCP_DIR = "dcp"


def sharded(engine: Any) -> bool:
    """Whether some stage of ``engine`` holds DTensors or FSDP2 modules (then a load goes
    through torch's ``set_state_dict``, :func:`load_layer_files`). Collective when the
    engine has a DeviceMesh (one all-reduce of one flag: every rank takes the same path);
    without one nothing can be sharded by torch."""
    if getattr(getattr(engine, "grid", None), "mesh", None) is None:
        return False
    mine = getattr(engine, "stage_parallel", None) is not None or any(
        hasattr(t, "full_tensor") for t in engine.module.state_dict().values())
    flag = torch.tensor([1.0 if mine else 0.0], device=engine.transport.device)
    engine.transport.all_reduce(flag)
    return bool(flag.item() > 0)


def is_dcp(meta: dict[str, Any]) -> bool:
    """Whether checkpoint metadata ``meta`` is of a DCP checkpoint."""
    return meta.get("format") == FORMAT


def check_engine(engine: Any, what: str) -> None:
    """``ConfigError`` naming the fix when ``engine`` shards or keeps state in a way DCP's
    state-dict API cannot map (see the module docstring)."""
    parallel, where = engine.parallel, {"rank": engine.rank, "stage": engine.stage}
    if parallel.zero_stage:
        raise ConfigError(f"{what}: ZeRO-1 (zero_stage={parallel.zero_stage}) shards the "
                          f"optimizer state outside DTensor, which a DCP checkpoint cannot "
                          f"map", hint="load with zero_stage=0, or shard with "
                                       "data_parallel_shard=N (FSDP2) instead", **where)
    odd = [name for name, param, master in _masters(engine) if master.shape != param.shape]
    if odd:
        raise ConfigError(f"{what}: precision={engine.precision.name!r} keeps masters of "
                          f"another shape than their parameters ({', '.join(odd[:3])}), which "
                          f"a DCP checkpoint cannot key by the parameter's name",
                          hint="keep one master of the parameter's shape per parameter, or "
                               "use format=None (pipekernel's layer files)", **where)


# -- masters: the fp32 tensors the optimizer steps, shown to DCP as the module's ------------

def _masters(engine: Any) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(name, parameter, master)`` of each stage parameter the precision policy steps
    through a tensor of its own (``bf16``/``fp16``: an fp32 master outside the module)."""
    master = engine.precision.master
    return [(name, param, held) for name, param in engine.module.named_parameters()
            if (held := master(param)) is not param]


@contextlib.contextmanager
def _masters_shown(engine: Any, loaded: bool = False) -> Iterator[None]:
    """Inside: every stage parameter with a master replaced in its module by the master,
    so ``get_state_dict``/``set_state_dict`` name the masters — the fp32 values and the
    optimizer state the optimizer keeps for them — by the parameter's own FQN, as
    pipekernel's layer files do (the low-precision parameter is the master's cast, not
    saved). On leaving the parameters are put back, and with ``loaded`` set from their
    masters (after a load)."""
    masters = {id(param): master for _, param, master in _masters(engine)}
    swapped = [(sub, leaf, value) for sub in engine.module.modules()
               for leaf, value in sub._parameters.items()
               if value is not None and id(value) in masters]
    for sub, leaf, value in swapped:
        sub._parameters[leaf] = masters[id(value)]
    try:
        yield
    finally:
        for sub, leaf, value in swapped:
            sub._parameters[leaf] = value
    if loaded:
        with torch.no_grad():
            for _, param, master in _masters(engine):
                param.copy_(master)


# -- names: a stage's keys <-> the checkpoint's (canonical layer) keys ------------------------

def _canonical_layer(engine: Any) -> dict[str, str]:
    """The stage's registered layer name -> the canonical global layer it is saved under."""
    return {name: str(index)
            for name, index, _ in local_layers(engine.module, engine.pipeline_module)}


def _rename(key: str, layers: dict[str, str], at: int) -> str:
    parts = key.split(".")
    parts[at] = layers.get(parts[at], parts[at])
    return ".".join(parts)


def _state(engine: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """``({checkpoint key: tensor or value}, {the stage's key: checkpoint key})`` of the
    stage's model and optimizer, from ``get_state_dict`` (DTensors stay sharded); the
    stage's keys are prefixed ``model.``/``optim.`` too. Keys of a tied weight held twice
    by one stage collapse into one checkpoint key."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    optimizers = [engine.optimizer] if engine.optimizer is not None else []
    with _masters_shown(engine):
        model, optim = get_state_dict(engine.module, optimizers, options=options)
    layers = _canonical_layer(engine)
    state: dict[str, Any] = {}
    keys: dict[str, str] = {}
    for prefix, part, at in (("model", model, 0), ("optim", optim, 1)):
        for key, value in part.items():
            name = f"{prefix}.{_rename(key, layers, at)}"
            state[name] = value
            keys[f"{prefix}.{key}"] = name
    _expert_views(engine, state, keys)
    return state, keys


# -- experts: a rank's slice shown to DCP as a DTensor over its expert-parallel group ----------

def _experts(engine: Any) -> dict[str, tuple[torch.Tensor, int]]:
    """The stage's expert slices (``{parameter name: (parameter, expert dim)}``) when the
    engine spreads experts over ranks, else ``{}``."""
    ep = getattr(engine, "ep_group", None)
    if ep is None or ep.size == 1:
        return {}
    return {name: (param, param.expert_parallel_dim)
            for name, param in engine.module.named_parameters()
            if expert_parallel.is_expert(param)}


def _expert_of(key: str, experts: dict[str, tuple[torch.Tensor, int]]) -> Any:
    """``(parameter, dim)`` when the stage key ``key`` (``model.{name}``,
    ``optim.state.{name}.{k}``) is an expert parameter or its optimizer state."""
    if key.startswith("model."):
        return experts.get(key[len("model."):])
    if key.startswith("optim.state."):
        return experts.get(key[len("optim.state."):].rpartition(".")[0])
    return None


def _ep_mesh(engine: Any) -> Any:
    """A 1-D DeviceMesh over this rank's expert-parallel group (made once per engine)."""
    ep = engine.ep_group
    mesh = getattr(ep, "_dcp_mesh", None)
    if mesh is None:
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh.from_group(ep.handle, torch.device(engine.transport.device).type,
                                     mesh_dim_names=("ep",))
        ep._dcp_mesh = mesh
    return mesh


def _expert_views(engine: Any, state: dict[str, Any], keys: dict[str, str]) -> None:
    """Each expert slice in ``state`` — the parameter and its optimizer state of the
    parameter's shape (``step`` stays a plain number) — replaced by a DTensor
    ``Shard(dim)`` over the expert-parallel group, of the whole stack's shape: DCP writes
    every rank's slice of one global tensor (the expert-data-parallel copies once) and
    reads into any expert-parallel size its slice. ``dcp.load`` reads into the view's local
    tensor, which :func:`_set_state` unwraps and copies into the stage."""
    experts = _experts(engine)
    if not experts:
        return
    from torch.distributed.tensor import DTensor, Shard

    mesh, size = _ep_mesh(engine), engine.ep_group.size
    for key, name in keys.items():
        found, value = _expert_of(key, experts), state[name]
        if found is None or not torch.is_tensor(value) or isinstance(value, DTensor) \
                or value.shape != found[0].shape or value.dim() == 0:
            continue
        shape = list(value.shape)
        shape[found[1]] *= size
        stride = torch.empty(shape, device="meta").stride()
        state[name] = DTensor.from_local(value.contiguous(), mesh, [Shard(found[1])],
                                         run_check=False, shape=torch.Size(shape),
                                         stride=stride)


def _plain_experts(engine: Any, state: dict[str, Any], keys: dict[str, str]) -> dict[str, Any]:
    """``state`` with the expert views of :func:`_expert_views` back to this rank's slices
    (the stage's parameters and optimizer state are plain tensors)."""
    experts = _experts(engine)
    if not experts:
        return state
    from torch.distributed.tensor import DTensor

    state = dict(state)
    for key, name in keys.items():
        if _expert_of(key, experts) is not None and isinstance(state[name], DTensor):
            state[name] = state[name].to_local()
    return state


def _dcp(call: Any, *args: Any, **kwargs: Any) -> Any:
    """``call(*args, **kwargs)`` (``dcp.save``/``dcp.load``), with DCP's
    ``CheckpointException`` — a ``BaseException``, raised on every rank — turned into the
    lowest failing rank's own error (an ``OSError`` stays one, so the message says why:
    no space, no permission), its rank in the message."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return call(*args, **kwargs)
    except CheckpointException as err:
        rank, (cause, _) = min(err.failures.items())
        if isinstance(cause, PipelineError):  # ours (a refused or corrupt file): as it is
            raise cause from err
        if isinstance(cause, OSError):
            raise type(cause)(cause.errno, f"{cause.strerror or cause} (on rank {rank})",
                              cause.filename) from err
        raise RuntimeError(f"on rank {rank}: {type(cause).__name__}: {cause}") from err


# -- load ----------------------------------------------------------------------------------

def _read(engine: Any, directory: str, meta: dict, trust: bool = False) -> tuple[dict, bool]:
    """This rank's file (its own at the same layout, rank 0's otherwise), after checking
    that the model is the checkpoint's (shapes are the whole tensors')."""
    local = local_layers(engine.module, engine.pipeline_module)
    canonical: dict[int, Any] = {}
    for _, index, layer in local:
        if has_state(layer):
            canonical.setdefault(index, layer)
    check_model(meta, engine.pipeline_module, directory, sorted(canonical.items()),
                       lambda layer: expert_parallel.full_shapes(
                           layer, engine.ep_group,
                           {k: list(v.shape) for k, v in layer.state_dict().items()}))
    exact = same_layout(meta["topology"], layout(engine))
    return _read_rank(directory, engine.rank if exact else 0, trust), exact


def _load_tensors(engine: Any, directory: str, trust: bool = False) -> None:
    """DCP reads the checkpoint into this rank's state (its DTensors' local shards, whole
    tensors elsewhere), which ``set_state_dict`` then puts into the stage and optimizer."""
    state, keys = _state(engine)
    # read into copies, not into the stage's tensors (get_state_dict's values are them):
    # a file refused or corrupt half-way then changes nothing; the cost is a second copy
    # of this rank's model and optimizer state while the load runs
    state = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in state.items()}
    # data only unless trusted: DCP alone unpickles its metadata and non-tensor values fully
    _dcp(checkpoint_data.dcp_load, state, os.path.join(directory, DCP_DIR), trust)
    _set_state(engine, state, keys)


def _set_state(engine: Any, state: dict[str, Any], keys: dict[str, str]) -> None:
    """``set_state_dict`` of ``state`` (checkpoint keys; ``keys``: :func:`_state`'s map)
    into the stage and its optimizer."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    state = _plain_experts(engine, state, keys)
    model = {key[len("model."):]: state[name] for key, name in keys.items()
             if key.startswith("model.")}
    optim = {key[len("optim."):]: state[name] for key, name in keys.items()
             if key.startswith("optim.")}
    optimizers = [engine.optimizer] if engine.optimizer is not None else []
    with _masters_shown(engine, loaded=True):
        set_state_dict(engine.module, optimizers, model_state_dict=model,
                       optim_state_dict=optim if optimizers else {},
                       options=StateDictOptions(flatten_optimizer_state_dict=True))


def load(engine: Any, root: str, tag: str | None, directory: str, meta: dict, *,
         trust: bool = False) -> dict[str, Any]:
    """:func:`pipekernel.engine.checkpoint.load` of a DCP checkpoint (``meta`` read from
    ``directory``), into an engine of any layout DCP maps: the same contract."""
    rank, transport = engine.rank, engine.transport

    def read() -> tuple[dict, bool]:
        check_engine(engine, "load_checkpoint")
        return _read(engine, directory, meta, trust)

    mine, exact = on_every_rank(transport, read)
    # collective (DCP agrees on its read plan and raises on every rank itself)
    on_every_rank(transport, _load_tensors, engine, directory, trust,
                  wrap=partial(_read_error, directory))
    on_every_rank(transport, _apply_counters, engine, mine, exact, meta)
    _log.info("rank %d loaded DCP checkpoint %s (step %d%s)", rank, directory,
                    meta["global_steps"], "" if exact else ", another layout")
    return loaded(engine, directory, meta, mine, exact)


def _read_error(directory: str, error: BaseException) -> BaseException:
    if isinstance(error, (ConfigError, DataError)):
        return error
    return DataError(f"cannot read the DCP checkpoint {directory}/{DCP_DIR}: "
                     f"{type(error).__name__}: {error}",
                     hint="the checkpoint is incomplete or of another model; load an older "
                          "tag (engine.load_checkpoint(root, tag=...))")


def _apply_counters(engine: Any, mine: dict, exact: bool, meta: dict) -> None:
    """What the rank file holds: precision state (not its masters: they came with the
    tensors), then :func:`~pipekernel.engine.checkpoint_layout.apply_rank_state`."""
    precision_state = {k: v for k, v in mine.get("precision", {}).items() if k != MASTERS}
    if precision_state:
        engine.precision.load_state_dict(precision_state)
    apply_rank_state(engine, mine, exact, meta)


# -- pipekernel's layer files into sharded stages ----------------------------------------------

def _from_layer_files(key: str, payloads: dict[int, dict]) -> Any:
    """The value of checkpoint key ``key`` (``model.{layer}.{name}``,
    ``optim.state.{layer}.{name}.{k}``, ``optim.param_groups.{layer}.{name}.{k}``) in
    pipekernel's layer files (``None``: not there)."""
    parts = key.split(".")
    if parts[0] == "model":
        return payloads.get(int(parts[1]), {}).get("state", {}).get(".".join(parts[2:]))
    field = {"state": "optimizer", "param_groups": "param_groups"}[parts[1]]
    sub, name = ".".join(parts[3:-1]), parts[-1]
    return payloads.get(int(parts[2]), {}).get(field, {}).get(sub, {}).get(name)


def load_layer_files(engine: Any, directory: str, meta: dict, *,
                     trust: bool = False) -> dict[str, Any]:
    """Load a checkpoint of pipekernel's layer files into an engine with sharded stages:
    each rank reads the whole tensors of its layers and cuts its shards
    (:func:`_set_full`); at the layout saved (the same stages, replicas, shards, tp, chunks
    and bounds) every rank reads its own rank file and RNG states, so the resume is
    bit-exact, as for unsharded stages."""
    transport = engine.transport

    def read() -> tuple[dict, bool, dict]:
        check_engine(engine, "load_checkpoint")
        mine, exact = _read(engine, directory, meta, trust)
        local = local_layers(engine.module, engine.pipeline_module)
        needed = sorted({index for _, index, layer in local if has_state(layer)})
        return mine, exact, {i: _read_layer(directory, meta, i, trust) for i in needed}

    mine, exact, payloads = on_every_rank(transport, read)
    on_every_rank(transport, _set_full, engine, payloads)
    on_every_rank(transport, _apply_counters, engine, mine, exact, meta)
    return loaded(engine, directory, meta, mine, exact)


def _set_full(engine: Any, payloads: dict[int, dict]) -> None:
    """Each sharded tensor of the stage cut from the whole one read (every rank has it:
    ``distribute_tensor(src_data_rank=None)`` slices locally, no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    state, keys = _state(engine)
    for name, template in state.items():
        value = _from_layer_files(name, payloads)
        if value is None:
            continue  # a parameter the saved optimizer had not stepped: keep the fresh state
        if isinstance(template, DTensor):
            value = distribute_tensor(value.to(template.device, template.dtype),
                                      template.device_mesh, template.placements,
                                      src_data_rank=None)
        elif torch.is_tensor(template) and torch.is_tensor(value):
            value = value.to(template.device, template.dtype)
        state[name] = value
    _set_state(engine, state, keys)


# -- one process --------------------------------------------------------------------------

def load_sequential(directory: str, meta: dict, module: Any, *,
                    trust: bool = False) -> torch.nn.Module:
    """The whole model of a DCP checkpoint as one stage (see
    :func:`pipekernel.engine.checkpoint.load_sequential`), read in this process alone."""
    num = len(module.layers)
    full = module.build_stage(0, [0, num])
    layers = [(index, layer) for name, index, layer in local_layers(full, module)
              if int(name) == index and has_state(layer)]
    check_model(meta, module, directory, layers)
    state = {f"model.{index}.{key}": value for index, layer in layers
             for key, value in layer.state_dict().items()}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            _dcp(checkpoint_data.dcp_load, state, os.path.join(directory, DCP_DIR), trust,
                 no_dist=True)
    except Exception as err:  # noqa: BLE001 - DCP raises many types for a bad directory
        raise _read_error(directory, err) from err
    with torch.no_grad():
        for index, layer in layers:
            prefix = f"model.{index}."
            layer.load_state_dict({k[len(prefix):]: v for k, v in state.items()
                                   if k.startswith(prefix)})
    return full

