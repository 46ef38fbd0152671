"""DeepSpeed's checkpoint files, written by ``save_checkpoint`` beside pipekernel's, so
that DeepSpeed's own engine loads what a pipekernel run saved.

DeepSpeed 0.19's pipeline engine writes, under ``DIR/TAG``, per pipeline stage and from
its data-parallel rank 0 (``deepspeed/runtime/pipe/module.py`` ``save_state_dict``,
``runtime/engine.py`` ``_save_checkpoint``):

* ``layer_XX-model_states.pt`` for each of the stage's layers that is a module, the
  module's ``state_dict`` (a parameterless module writes an empty one; a function or a
  tied module called through ``forward_fn`` writes nothing; a tied module called itself
  writes under each of its layers on the stage);
* ``mp_rank_XX_model_states.pt`` (``XX`` the stage): the optimizer's ``state_dict``,
  the LR scheduler's, the counters, the batch and grid sizes, the config and the
  script's ``client_state`` keys.

The same is written here. pipekernel's own files (``meta.json``, ``layer-NNNNN.pt``,
``rank-NNNNN.pt``) stay the ones pipekernel loads (bit-exact resume, any stage count);
DeepSpeed ignores them. Weights are fp32 master values under fp16/bf16. The optimizer
state is DeepSpeed's only for fp32 without ZeRO, where pipekernel's optimizer is a plain
``torch.optim`` optimizer over the module's own parameters in the script's order, as
DeepSpeed's is; otherwise ``optimizer`` is ``None`` and DeepSpeed loads the checkpoint
with ``load_optimizer_states=False`` (its fp16/bf16 wrappers and ZeRO partitions have
formats of their own). The DeepSpeed files are written after pipekernel's checkpoint is
published: a crash in between leaves a complete pipekernel checkpoint without them.
"""
from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from pipekernel.errors import ConfigError

__all__ = ["write_deepspeed_files", "write_layer_files", "check_client_state", "DS_VERSION"]

#: The DeepSpeed version whose layout is written (``ds_version`` in the ``mp_rank`` files).
DS_VERSION = "0.19.8"


def check_client_state(client_state: Any) -> dict:
    """The client state DeepSpeed accepts (a dict without its reserved key), checked
    before anything is written."""
    if not isinstance(client_state, dict):
        raise ConfigError(f"client_state must be a dict, got {type(client_state).__name__}",
                          hint="pass client_state={...} (a dict of picklable values) or nothing")
    if "checkpoint_parallel_dimensions" in client_state:  # DeepSpeed's KeyError, by name
        raise ConfigError("client_state contains reserved checkpoint key: "
                          "checkpoint_parallel_dimensions", hint="rename it")
    return client_state


def write_deepspeed_files(shim: Any, directory: str, client_state: dict) -> None:
    """Write this stage's DeepSpeed files into ``directory`` (data-parallel rank 0 of
    each stage writes). Collective: an error on any rank is raised on every rank."""
    engine = shim.engine
    error: BaseException | None = None
    if engine.data_parallel_rank == 0:
        try:
            shim._curr_ckpt_path = directory  # DeepSpeed's hand-over to module_state_dict
            try:
                shim.module_state_dict()
            finally:
                shim._curr_ckpt_path = None
            torch.save(_rank_state(shim, client_state),
                       os.path.join(directory, f"mp_rank_{shim.stage_id:02d}_model_states.pt"))
        except Exception as err:  # noqa: BLE001 - every rank must hear of it
            error = err
    _agree(engine, error, directory)


def _agree(engine: Any, error: BaseException | None, directory: str) -> None:
    transport = engine.transport
    flags = torch.zeros(transport.world_size, dtype=torch.float32, device=transport.device)
    if error is not None:
        flags[engine.rank] = 1.0
    transport.all_reduce(flags)
    failed = [r for r, v in enumerate(flags.cpu().tolist()) if v > 0]
    if failed:
        why = f": {type(error).__name__}: {error}" if error is not None else ""
        raise ConfigError(f"writing DeepSpeed's checkpoint files into {directory} failed on "
                          f"rank(s) {failed}{why}", rank=engine.rank,
                          hint="pipekernel's own files of this checkpoint are complete and "
                               "load; free space or fix permissions and save again")


def _master_state(precision: Any, layer: nn.Module) -> dict[str, torch.Tensor]:
    """``layer.state_dict()`` on the CPU, fp32 master values for low-precision params."""
    state = layer.state_dict()
    for name, param in layer.named_parameters():
        if name in state:
            state[name] = precision.master(param)
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


def write_layer_files(shim: Any, directory: str) -> None:
    """This stage's ``layer_XX[-model_YY]-model_states.pt`` files, as DeepSpeed's
    ``save_state_dict`` (data-parallel rank 0 writes them)."""
    if shim.engine.data_parallel_rank != 0:
        return
    precision, module = shim.engine.precision, shim.module
    rank_repr = module.topology().get_rank_repr(rank=module.global_rank)
    suffix = (f"-{rank_repr}" if rank_repr else "") + "-model_states.pt"
    for index, layer, forward_fn in module._calls:
        if forward_fn is None and isinstance(layer, nn.Module):
            torch.save(_master_state(precision, layer),
                       os.path.join(directory, f"layer_{index:02d}{suffix}"))


def _buffer_names(module: nn.Module) -> list[str]:
    """DeepSpeed's ``_get_buffer_names``: persistent buffers, module tree order."""
    names: list[str] = []

    def walk(m: nn.Module, prefix: str) -> None:
        for name, buf in m.named_buffers(recurse=False):
            if buf is not None and name not in m._non_persistent_buffers_set:
                names.append(prefix + name)
        for name, child in m.named_children():
            if child is not None:
                walk(child, prefix + name + ".")
    walk(module, "")
    return names


def _optimizer_state(shim: Any) -> dict | None:
    """The optimizer's ``state_dict`` when it is the one DeepSpeed would save (see the
    module docstring), else ``None``."""
    engine, settings = shim.engine, shim._config
    optimizer = engine.optimizer
    if optimizer is None or settings.precision != "fp32" or settings.zero_stage != 0:
        return None
    own = {id(p) for p in shim.module.parameters()}
    if not all(id(p) in own for g in optimizer.param_groups for p in g["params"]):
        return None
    return _cpu(optimizer.state_dict())


def _cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_cpu(v) for v in obj]
    return obj


def _rank_state(shim: Any, client_state: dict) -> dict:
    """DeepSpeed's ``_common_checkpoint_state`` for this stage, updated with the client
    state (as DeepSpeed: a client key replaces a DeepSpeed key of the same name)."""
    engine, settings = shim.engine, shim._config
    scheduler = engine.lr_scheduler
    state = {"module": None, "buffer_names": _buffer_names(shim.module),
             "optimizer": _optimizer_state(shim), "param_shapes": None,
             "frozen_param_shapes": None, "shared_params": None,
             "frozen_param_fragments": None,
             "lr_scheduler": _cpu(scheduler.state_dict()) if scheduler is not None else None,
             "data_sampler": None, "random_ltd": None,
             "skipped_steps": engine.skipped_steps, "global_steps": engine.global_steps,
             "global_samples": shim.global_samples, "dp_world_size": shim.dp_world_size,
             "mp_world_size": shim.num_stages,
             "checkpoint_parallel_dimensions": {"pp_degree": shim.num_stages, "tp_degree": 1},
             "ds_config": settings.raw, "ds_version": DS_VERSION}
    state.update(client_state)
    return state
