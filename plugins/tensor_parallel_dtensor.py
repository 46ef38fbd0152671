"""DTensor tensor parallelism inside each pipeline stage: ``PipelineEngine(...,
tensor_parallel_size=T, tensor_parallel_plan={pattern: ParallelStyle})``.

An implementation of :func:`~pipekernel.extend.hookspecs.pipekernel_parallelize_stage`
(``tryfirst``: before FSDP2, as torchtitan orders them) that applies torch's
``parallelize_module`` to the stage over ``mesh["tp"]``. Patterns are
``parallelize_module``'s: module names relative to the stage, split at dots, each piece an
``fnmatch`` pattern (``"*.fc1"`` is the ``fc1`` of every layer). A stage holds only its
layers, so each stage applies the entries that match there; an entry that matches no
module on *any* stage is a :class:`~pipekernel.errors.ConfigError` (one all-reduce of the
match counts), and so is a ``Colwise``/``Rowwise`` style on a ``Linear`` or ``Embedding``
whose sharded dimension ``T`` does not divide.

``tensor_parallel_plan="hf"`` takes a Hugging Face model's own plan (its config's
``base_model_tp_plan``, a pipeline made by :func:`pipekernel.hf.pipeline_module`), each key
placed under the base model's path inside the stage's layers (``"layers.*.mlp.up_proj"``
becomes ``"*.model.layers.*.mlp.up_proj"``) and each style name mapped to torch's
(:data:`HF_STYLES`: ``colwise``, ``rowwise``); a plan with any other style (sequence
parallel, ``gather``, ...) is refused by name.

What crosses stages stays plain tensors: ``ColwiseParallel``/``RowwiseParallel`` take and
give plain (replicated) tensors by default (``use_local_output=True``), and the engine's
wire never sees a DTensor. The parameters become DTensors over ``mesh["tp"]``; the
optimizer steps them, clipping sums their local shards
(:func:`~pipekernel.grid.mesh.local_share`).
"""
from __future__ import annotations

from fnmatch import fnmatch
from typing import Any

import torch

from pipekernel.errors import ConfigError
from pipekernel.plugin import StageView, hookimpl

__all__ = ["HF_STYLES", "hf_plan", "matches", "pipekernel_parallelize_stage"]

#: Hugging Face TP style names this maps (to ``torch.distributed.tensor.parallel`` classes).
HF_STYLES = {"colwise": "ColwiseParallel", "rowwise": "RowwiseParallel"}


def hf_plan(pipeline_module: Any) -> dict[str, Any]:
    """The DTensor plan of a Hugging Face pipeline's own ``base_model_tp_plan``."""
    import torch.distributed.tensor.parallel as tp

    config = getattr(pipeline_module, "config", None)
    structure = getattr(pipeline_module, "structure", None)
    plan = getattr(config, "base_model_tp_plan", None)
    if structure is None or not plan:
        raise ConfigError("tensor_parallel_plan='hf' needs a Hugging Face pipeline "
                          "(pipekernel.hf.pipeline_module) whose config has a "
                          "base_model_tp_plan" + ("" if structure is None else
                                                  f" ({type(config).__name__} has none)"),
                          hint="pass the plan itself: tensor_parallel_plan={pattern: "
                               "ColwiseParallel(), ...}")
    out = {}
    for key, style in plan.items():
        if style not in HF_STYLES:
            raise ConfigError(f"tensor_parallel_plan='hf': {type(config).__name__}'s plan "
                              f"entry {key!r}: {style!r} is not mapped (only "
                              f"{', '.join(HF_STYLES)})",
                              hint="pass a plan of your own with torch ParallelStyles")
        prefix = f"*.{structure.base}." if structure.base else "*."
        out[prefix + key] = getattr(tp, HF_STYLES[style])()
    return out


def matches(module: torch.nn.Module, pattern: str) -> list[str]:
    """The names of ``module``'s submodules ``pattern`` selects (``parallelize_module``'s
    rule: as many dot-separated pieces, each matched with ``fnmatch``)."""
    tokens = pattern.split(".")
    return [name for name, _ in module.named_modules() if name and len(name.split(".")) ==
            len(tokens) and all(fnmatch(a, b) for a, b in zip(name.split("."), tokens))]


_SHARDED_DIM = {"ColwiseParallel": {"Linear": ("out_features", 0), "Embedding":
                                    ("embedding_dim", 1)},
                "RowwiseParallel": {"Linear": ("in_features", 1), "Embedding":
                                    ("num_embeddings", 0)}}


def _check_divisible(module: torch.nn.Module, name: str, style: Any, size: int,
                     where: dict) -> None:
    sub = module.get_submodule(name)
    rule = _SHARDED_DIM.get(type(style).__name__, {})
    for cls in type(sub).__mro__:
        if cls.__name__ in rule:
            field, _ = rule[cls.__name__]
            value = getattr(sub, field)
            if value % size:
                raise ConfigError(
                    f"tensor_parallel_plan: {type(style).__name__} on {name!r} "
                    f"({type(sub).__name__}) shards {field}={value}, which "
                    f"tensor_parallel_size={size} does not divide",
                    hint=f"choose a tensor_parallel_size dividing {value}, or leave "
                         f"{name!r} out of the plan", **where)
            return


def _check_heads(config: Any, size: int, where: dict) -> None:
    """Attention heads split whole: ``T`` divides the query and the key/value heads (a
    Linear's features alone may divide while a head would be cut in two)."""
    for field in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, field, None)
        if isinstance(heads, int) and heads % size:
            raise ConfigError(f"tensor_parallel_plan='hf': {field}={heads} of "
                              f"{type(config).__name__} is not divisible by "
                              f"tensor_parallel_size={size}",
                              hint=f"choose a tensor_parallel_size dividing {heads}", **where)


@hookimpl(tryfirst=True)
def pipekernel_parallelize_stage(module: Any, mesh: Any, engine: StageView) -> None:
    plan = engine.parallel.tensor_parallel_plan
    if plan is None:
        return
    where = {"rank": engine.transport.rank, "stage": engine.stage}
    if plan == "hf":
        plan = hf_plan(engine.pipeline_module)
        _check_heads(engine.pipeline_module.config, engine.parallel.tensor_parallel_size,
                     where)
    engine.grid.require_mesh("tensor_parallel_plan", rank=where["rank"])
    from torch.distributed.tensor.parallel import parallelize_module

    found = {pattern: matches(module, pattern) for pattern in plan}
    counts = torch.tensor([len(found[p]) for p in plan], dtype=torch.float64,
                          device=engine.transport.device)
    engine.transport.all_reduce(counts)  # an entry may match on another stage only
    unmatched = [p for p, n in zip(plan, counts.tolist()) if n == 0]
    if unmatched:
        names = sorted({n.split(".", 1)[-1] for n, _ in module.named_modules() if "." in n})
        raise ConfigError(f"tensor_parallel_plan entries {unmatched} match no module on any "
                          f"stage", hint=f"names are relative to the stage, whose children "
                          f"are the global layer indices (e.g. '*.{names[0]}')" if names else
                          "check the pattern", **where)
    size = mesh["tp"].size()
    mine = {}
    for pattern, style in plan.items():
        for name in found[pattern]:
            _check_divisible(module, name, style, size, where)
            mine[name] = style
    if mine:
        parallelize_module(module, mesh["tp"], mine)
