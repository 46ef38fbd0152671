"""``save_pretrained``: a trained pipeline back to a Hugging Face directory.

Every stage writes its own safetensors shard (the first replica only; a tied weight by
the first stage holding it), then global rank 0 writes ``config.json`` and
``model.safetensors.index.json``: the directory ``AutoModelForCausalLM.from_pretrained``
loads, and :func:`pipekernel.hf.pipeline_module` loads stage by stage. The path must be
on a file system every rank sees.
"""
from __future__ import annotations

import json
import os
from typing import Any

import torch

from pipekernel.errors import ConfigError
from pipekernel.grid import expert_parallel
from pipekernel.model.module import TiedLayerSpec

__all__ = ["save_pretrained", "stage_state"]

INDEX = "model.safetensors.index.json"


def save_pretrained(engine: Any, path: str | os.PathLike) -> str:
    """Write the pipeline's weights and config to ``path`` in the Hugging Face format.

    Every rank of the engine calls it (two barriers). Weights are the fp32 masters under
    low precision, else the parameters as they are; the DTensors of sharded stages (FSDP2,
    a DTensor plan) are gathered whole first (a collective over each stage's mesh), and so
    are expert slices (``expert_parallel_size > 1``: a collective over each expert-parallel
    group), so the files hold every expert.

    :param engine: a :class:`~pipekernel.PipelineEngine` over a module from
        :func:`~pipekernel.hf.pipeline_module`.
    :returns: ``path`` as a string.
    :raises ConfigError: the engine's module was not made by ``pipeline_module``, or it
        is tensor parallel with pipekernel's own layers (not a DTensor plan).
    """
    module = engine.pipeline_module
    if not hasattr(module, "structure"):
        raise ConfigError("save_pretrained needs an engine over pipekernel.hf.pipeline_module"
                          f"(...), got a {type(module).__name__}", rank=engine.rank,
                          hint="build the module with pipekernel.hf.pipeline_module(model)")
    if engine.parallel.tensor_parallel_size > 1 and engine.parallel.tensor_parallel_plan is None:
        raise ConfigError("save_pretrained does not gather the shards of pipekernel's own "
                          "tensor-parallel layers", rank=engine.rank,
                          hint="save with engine.save_checkpoint instead, or give tensor "
                               "parallelism as a DTensor plan (tensor_parallel_plan=), whose "
                               "shards save_pretrained gathers")
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    stages = engine.num_stages
    # DTensors (FSDP2, a DTensor plan): every rank of the stage gathers them (collective)
    sharded = any(hasattr(t, "full_tensor") for t in engine.module.state_dict().values())
    writes = engine.data_parallel_rank == 0 and engine.topology.model_rank == 0
    if writes or sharded or _ep(engine).size > 1:
        state = stage_state(engine)
        if state and writes:
            from safetensors.torch import save_file
            save_file(state, os.path.join(path, _shard(engine.stage, stages)),
                      metadata={"format": "pt"})
    engine.transport.barrier()
    if engine.transport.rank == 0:
        _write_index(path, stages)
        config = module.config
        config.architectures = [type(module.source.model).__name__]
        config.save_pretrained(path)
    engine.transport.barrier()
    return path


def stage_state(engine: Any) -> dict[str, torch.Tensor]:
    """This stage's tensors as Hugging Face's ``save_pretrained`` writes them (masters under
    low precision), on the CPU: a tied weight only on the first stage holding it, the
    model's ``_keys_to_ignore_on_save`` left out, and transformers' own weight conversions
    reverted (``revert_weight_conversion``: e.g. fused MoE experts back to one key per
    expert, the hub layout), so the key set is the one HF writes for the same model."""
    module = engine.pipeline_module
    tied = module.tied_stages(engine.bounds, engine.part_stages.__getitem__)
    skip = {str(i) for i, spec in enumerate(module.layers) if isinstance(spec, TiedLayerSpec)
            and tied[spec.key][0] != engine.stage}
    params = dict(engine.module.named_parameters())
    masters = {name: engine.precision.master(p) for name, p in params.items()}
    state = {}
    for name, tensor in engine.module.state_dict().items():
        index, _, key = name.partition(".")
        if index in skip:
            continue
        value = masters.get(name, tensor)
        if hasattr(value, "full_tensor"):  # a DTensor: the whole tensor (collective)
            value = value.full_tensor()
        dim = getattr(params.get(name), "expert_parallel_dim", None)
        if dim is not None:  # this rank's experts: every expert (collective)
            value = expert_parallel.gather_slices(value.detach(), dim, _ep(engine))
        state[key] = value.detach().to("cpu", copy=True).contiguous()
    return _as_hf_writes(module.source.model, state)


def _ep(engine: Any) -> Any:
    return getattr(engine, "ep_group", None) or expert_parallel.group()


def _as_hf_writes(model: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from transformers.core_model_loading import revert_weight_conversion
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    if not state:
        return state
    state = revert_weight_conversion(model, state)
    return {k: v.contiguous() for k, v in state.items()}


def _shard(stage: int, stages: int) -> str:
    return f"model-{stage + 1:05d}-of-{stages:05d}.safetensors"


def _write_index(path: str, stages: int) -> None:
    from safetensors import safe_open
    weight_map, total = {}, 0
    for stage in range(stages):
        name = _shard(stage, stages)
        if not os.path.exists(os.path.join(path, name)):
            continue  # a stage without weights
        with safe_open(os.path.join(path, name), framework="pt") as f:
            for key in f.keys():
                weight_map[key] = name
                shape = f.get_slice(key).get_shape()
                dtype = f.get_slice(key).get_dtype()
                total += _numel(shape) * _itemsize(dtype)
    with open(os.path.join(path, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
                  f, indent=2)


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype: str) -> int:
    return {"F64": 8, "F32": 4, "I64": 8, "I32": 4, "F16": 2, "BF16": 2, "I16": 2, "U8": 1,
            "I8": 1, "BOOL": 1}.get(dtype, 4)
