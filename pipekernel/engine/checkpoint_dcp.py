"""Checkpoints of sharded stages through ``torch.distributed.checkpoint`` (DCP).

An engine whose stages hold torch parallelism — FSDP2 (``data_parallel_shard=N``), a
DTensor plan (``tensor_parallel_plan=``), a user's ``pipekernel_parallelize_stage`` — has
DTensor parameters and optimizer state: :func:`pipekernel.engine.checkpoint.save` sends
it here (:func:`wanted`, or ``format="dcp"``), and
:func:`pipekernel.engine.checkpoint.load` sends every checkpoint whose ``meta.json`` says
``"format": "dcp"``. The checkpoint keeps pipekernel's conventions (a tag directory under a root,
``meta.json``, one ``rank-NNNNN.pt`` per rank, written under ``.tmp-<tag>`` and renamed
into place when every rank succeeded, then ``latest``; ``resume``, ``keep_last``) and
puts the tensors in **one DCP directory for the whole job**::

    root/global_step12/
      meta.json          "format": "dcp", the layout (stages x replicas x shards x tp)
      rank-00001.pt      RNG, precision, LR scheduler, counters, client_state (as always)
      dcp/               DCP's files: .metadata and one __R_0.distcp per writing rank
                         keys "model.{layer}.{name}", "optim.state.{layer}.{name}.{key}",
                         "optim.param_groups.{layer}.{name}.{hyperparameter}"

Why one directory and not one per stage: the keys are pipeline-independent already (a
global layer index, a tied weight under its first layer), so DCP's global plan does the
whole mapping — each writer saves its local shards once (replicas and the copies of tied
weights on several stages deduplicated by DCP), and a loading rank at *any* stages x
shards x tp layout reads the pieces of the keys it holds, from whichever files hold
them. Per-stage directories would tie the files to the partitioning, and loading at
another number of stages would have to open several directories and map keys itself.

The model and optimizer go through
``torch.distributed.checkpoint.state_dict.get_state_dict`` / ``set_state_dict`` with
``flatten_optimizer_state_dict=True``: optimizer state *and* param-group hyperparameters
keyed per parameter name, as pipekernel's own format keys them — a param group is a
per-stage list, which a job-wide DCP key could not hold.

Same layout (stages, replicas, shards, tp, schedule placement, chunks, bounds): every
tensor is restored bit for bit and every rank its RNG, so training continues exactly.
Another layout: weights and optimizer state are exact (DCP reshards every DTensor);
later steps agree to round-off. A DCP checkpoint also loads into an engine without any
torch parallelism (the tensors read whole), :func:`pipekernel.load_sequential` reads
it in one process, and :func:`pipekernel.hf.save_pretrained` gathers full tensors.

Expert parallelism (``expert_parallel_size=E``) keeps each rank's slice of an expert stack
as a plain tensor; here it is shown to DCP as a DTensor ``Shard(dim)`` over a 1-D mesh of
the rank's expert-parallel group, of the whole stack's shape (the parameter and its
optimizer state of the parameter's shape; :func:`_expert_views`), so the checkpoint holds
whole stacks, each rank writes its own slice, and a load at any ``E`` — into FSDP2 at
``E = 1`` too — reads its own. An EP engine without DTensors saves here when asked
(``save_checkpoint(format="dcp")``), pipekernel's layer files otherwise.

Precision policies that keep fp32 masters outside the module (``bf16``/``fp16`` on every
parameter FSDP2 does not manage: all of them under expert parallelism, tied layers under
FSDP2) have the optimizer step the masters, which ``get_state_dict`` cannot name. While
the state dicts are taken and set, each such parameter is replaced in its module by its
master (:func:`_masters_shown`): the checkpoint's ``model.`` key holds the fp32 master
and ``optim.`` its optimizer state under the parameter's own name — what pipekernel's
layer files hold, and FSDP2 under ``bf16`` (its fp32 shards are the masters) — so an
expert slice's master is shown to DCP as the same ``Shard(dim)`` view, and the
checkpoint loads at any layout, into ``fp32`` too; after a load each low-precision
parameter is set from its master (it is the master's cast, not saved).

What DCP cannot map is refused by name (:func:`check_engine`): ZeRO-1 shards tensors
outside DTensor, and a precision policy
whose master is not of its parameter's shape cannot be keyed by the parameter's name.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from pipekernel.engine import checkpoint as _ckpt
from pipekernel.engine import checkpoint_data
from pipekernel.engine.checkpoint_files import FORMAT_VERSION, rank_file
from pipekernel.errors import ConfigError, DataError, PipelineError
from pipekernel.grid import expert_parallel

__all__ = ["DCP_DIR", "FORMAT", "check_engine", "is_dcp", "load", "load_sequential", "save",
           "wanted"]

#: The ``"format"`` of a DCP checkpoint's ``meta.json`` (absent: pipekernel's layer files).
FORMAT = "dcp"
#: The subdirectory of a checkpoint holding DCP's files.
DCP_DIR = "dcp"


def wanted(engine: Any) -> bool:
    """Whether ``engine`` saves through DCP: some stage holds DTensors or FSDP2 modules.
    Collective when the engine has a DeviceMesh (one all-reduce of one flag); without one
    nothing can be sharded by torch and pipekernel's layer files are written."""
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


def layout(engine: Any) -> dict[str, Any]:
    """The layout a DCP checkpoint records: pipekernel's, with the shard count and the
    expert-parallel size."""
    return {**_ckpt._layout(engine), "data_parallel_shard": engine.parallel.data_parallel_shard,
            "expert_parallel_size": engine.parallel.expert_parallel_size}


def check_forced(engine: Any) -> None:
    """``ConfigError`` when ``save_checkpoint(format="dcp")`` asks for DCP where it cannot
    run: DCP's collectives need torch.distributed's default group under the transport."""
    from pipekernel.grid.mesh import mesh_unavailable

    why = mesh_unavailable(engine.transport)
    if why:
        raise ConfigError(f"save_checkpoint(format='dcp'): {why}, and "
                          f"torch.distributed.checkpoint writes through that group",
                          hint="use transport='gloo' or 'nccl' over the whole job, or "
                               "format=None (pipekernel's layer files)",
                          rank=engine.rank, stage=engine.stage)


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
            for name, index, _ in _ckpt._local_layers(engine.module, engine.pipeline_module)}


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


def _meta(engine: Any) -> dict[str, Any]:
    meta = _ckpt._meta(engine)
    for entry in meta["layers"]:
        entry.pop("file", None)  # the tensors are in dcp/, not in layer files
    meta.update(format=FORMAT, format_version=FORMAT_VERSION, topology=layout(engine),
                files=sorted([f"{DCP_DIR}/.metadata"]
                             + [rank_file(r) for r in range(engine.transport.world_size)]))
    return meta


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


# -- save ----------------------------------------------------------------------------------

def save(engine: Any, root: str, tag: str, client_state: Any = None) -> str:
    """:func:`pipekernel.engine.checkpoint.save` of an engine that :func:`wanted` DCP:
    the same contract (collective, atomic, ``latest``, an error on every rank)."""
    import torch.distributed.checkpoint as dcp

    rank, transport = engine.rank, engine.transport
    final, tmp = os.path.join(root, tag), os.path.join(root, f".tmp-{tag}")

    def prepare() -> tuple[dict, dict, bytes | None]:
        _ckpt._check_tag(tag)
        check_forced(engine)
        check_engine(engine, "save_checkpoint")
        engine.runtime.flush()
        state, _ = _state(engine)
        mine = _ckpt._rank_payload(engine, client_state)
        meta = json.dumps(_meta(engine), indent=1).encode() if rank == 0 else None
        if rank == 0:
            os.makedirs(root, exist_ok=True)
            if os.path.lexists(tmp):
                shutil.rmtree(tmp)
            os.makedirs(os.path.join(tmp, DCP_DIR))
        return state, mine, meta

    prepared, error = _ckpt._attempt(prepare)
    _ckpt._agree(transport, _ckpt._wrap(error, root, "prepare"), rank)
    state, mine, meta = prepared

    def write() -> None:
        if meta is not None:
            _ckpt._write_file(os.path.join(tmp, "meta.json"), meta)
        _ckpt._write_file(os.path.join(tmp, rank_file(rank)), mine)

    _, error = _ckpt._attempt(write)
    _ckpt._agree(transport, _ckpt._wrap(error, root, "write"), rank)
    # collective, and DCP raises a failure on every rank itself; then one agreement more
    _, error = _ckpt._attempt(lambda: _dcp(dcp.save, state,
                                           checkpoint_id=os.path.join(tmp, DCP_DIR)))
    _ckpt._agree(transport, _ckpt._wrap(error, root, "write (torch.distributed.checkpoint)"),
                 rank)
    _, error = _ckpt._attempt(lambda: _ckpt._publish(root, tag, tmp, final) if rank == 0
                              else None)
    _ckpt._agree(transport, _ckpt._wrap(error, root, "publish"), rank)
    return final


# -- load ----------------------------------------------------------------------------------

def _same_layout(saved: dict[str, Any], ours: dict[str, Any]) -> bool:
    return {"data_parallel_shard": 1, "expert_parallel_size": 1, **saved} == ours


def _read(engine: Any, directory: str, meta: dict, trust: bool = False) -> tuple[dict, bool]:
    """This rank's file (its own at the same layout, rank 0's otherwise), after checking
    that the model is the checkpoint's (shapes are the whole tensors')."""
    local = _ckpt._local_layers(engine.module, engine.pipeline_module)
    canonical: dict[int, Any] = {}
    for _, index, layer in local:
        if _ckpt._has_state(layer):
            canonical.setdefault(index, layer)
    _ckpt._check_model(meta, engine.pipeline_module, directory, sorted(canonical.items()),
                       lambda layer: expert_parallel.full_shapes(
                           layer, engine.ep_group,
                           {k: list(v.shape) for k, v in layer.state_dict().items()}))
    exact = _same_layout(meta["topology"], layout(engine))
    return _ckpt._read_rank(directory, engine.rank if exact else 0, trust), exact


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

    result, error = _ckpt._attempt(read)
    _ckpt._agree(transport, error, rank)
    mine, exact = result
    # collective (DCP agrees on its read plan and raises on every rank itself)
    _, error = _ckpt._attempt(_load_tensors, engine, directory, trust)
    _ckpt._agree(transport, _read_error(error, directory), rank)
    _, error = _ckpt._attempt(_apply_counters, engine, mine, exact, meta)
    _ckpt._agree(transport, error, rank)
    _ckpt._log.info("rank %d loaded DCP checkpoint %s (step %d%s)", rank, directory,
                    meta["global_steps"], "" if exact else ", another layout")
    return {"directory": directory, "tag": os.path.basename(directory),
            "global_steps": meta["global_steps"], "skipped_steps": meta["skipped_steps"],
            "data_position": engine.trained_micro_batches,
            "client_state": mine.get("client_state"), "exact": exact, "meta": meta}


def _read_error(error: BaseException | None, directory: str) -> BaseException | None:
    if error is None or isinstance(error, (ConfigError, DataError)):
        return error
    return DataError(f"cannot read the DCP checkpoint {directory}/{DCP_DIR}: "
                     f"{type(error).__name__}: {error}",
                     hint="the checkpoint is incomplete or of another model; load an older "
                          "tag (engine.load_checkpoint(root, tag=...))")


def _apply_counters(engine: Any, mine: dict, exact: bool, meta: dict) -> None:
    """What the rank file holds: precision state (not its masters), LR scheduler,
    counters, and the RNG states when the layout is the one saved."""
    precision_state = {k: v for k, v in mine.get("precision", {}).items()
                       if k != _ckpt._MASTERS}
    if precision_state:
        engine.precision.load_state_dict(precision_state)
    scheduler_state = mine.get("lr_scheduler")
    if engine.lr_scheduler is not None and scheduler_state is not None:
        engine.lr_scheduler.load_state_dict(scheduler_state)
    engine.global_steps = int(meta["global_steps"])
    engine.skipped_steps = int(meta["skipped_steps"])
    engine.trained_micro_batches = int(mine.get("data_position",
                                                meta["global_steps"] * engine.micro_batches))
    if exact:
        _ckpt._restore_rng(engine, mine["rng"])


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
    """Load a checkpoint of pipekernel's layer files (saved without sharding) into an
    engine with sharded stages: each rank reads the whole tensors of its layers and
    ``set_state_dict(full_state_dict=True)`` cuts its shards. The layout differs from the
    saved one by construction, so RNG states are not restored."""
    rank, transport = engine.rank, engine.transport

    def read() -> tuple[dict, dict]:
        check_engine(engine, "load_checkpoint")
        mine, _ = _read(engine, directory, meta, trust)
        local = _ckpt._local_layers(engine.module, engine.pipeline_module)
        needed = sorted({index for _, index, layer in local if _ckpt._has_state(layer)})
        return mine, {i: _ckpt._read_layer(directory, meta, i, trust) for i in needed}

    result, error = _ckpt._attempt(read)
    _ckpt._agree(transport, error, rank)
    mine, payloads = result
    _, error = _ckpt._attempt(_set_full, engine, payloads)
    _ckpt._agree(transport, error, rank)
    _, error = _ckpt._attempt(_apply_counters, engine, mine, False, meta)
    _ckpt._agree(transport, error, rank)
    return {"directory": directory, "tag": os.path.basename(directory),
            "global_steps": meta["global_steps"], "skipped_steps": meta["skipped_steps"],
            "data_position": engine.trained_micro_batches,
            "client_state": mine.get("client_state"), "exact": False, "meta": meta}


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
    layers = [(index, layer) for name, index, layer in _ckpt._local_layers(full, module)
              if int(name) == index and _ckpt._has_state(layer)]
    _ckpt._check_model(meta, module, directory, layers)
    state = {f"model.{index}.{key}": value for index, layer in layers
             for key, value in layer.state_dict().items()}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            _dcp(checkpoint_data.dcp_load, state, os.path.join(directory, DCP_DIR), trust,
                 no_dist=True)
    except Exception as err:  # noqa: BLE001 - DCP raises many types for a bad directory
        raise _read_error(err, directory) from err
    with torch.no_grad():
        for index, layer in layers:
            prefix = f"model.{index}."
            layer.load_state_dict({k[len(prefix):]: v for k, v in state.items()
                                   if k.startswith(prefix)})
    return full

