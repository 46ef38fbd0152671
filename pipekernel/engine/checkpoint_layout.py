"""What both checkpoint readers (pipekernel's layer files, :mod:`pipekernel.engine.checkpoint`;
DCP directories, :mod:`pipekernel.engine.checkpoint_dcp`) and the writer share: which global
layer each module of a stage is, the layout a checkpoint records and when a load is at the
same one, the model check, the agreement of every rank on a step's outcome, and the rank
file's counters, LR scheduler and RNG states put back."""
from __future__ import annotations

import logging
import os
import random
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from pipekernel.comm.agreement import raise_on_every_rank
from pipekernel.errors import ConfigError

__all__ = ["MASTERS", "local_layers", "has_state", "on_every_rank", "layout",
           "same_layout", "check_model", "restore_rng", "apply_rank_state"]

_log = logging.getLogger("pipekernel.engine.checkpoint")
#: The key of the precision policy's fp32 masters in its ``state_dict`` (kept per
#: parameter in the checkpoint's tensors, not in the rank files).
MASTERS = "master_weights"


def local_layers(stage: nn.Module, module: Any) -> list[tuple[str, int, nn.Module]]:
    """``(registered name, canonical global layer, layer)`` for each module of ``stage``;
    a tied module's canonical layer is the first global occurrence of its key."""
    tied = {id(m): key for key, m in getattr(stage, "tied_modules", {}).items()}
    first = getattr(module, "_first_tied", {})
    out: list[tuple[str, int, nn.Module]] = []
    for name, layer in stage._modules.items():
        if layer is None:  # a slot registered empty holds no state
            continue
        key = tied.get(id(layer))
        out.append((name, int(first[key]) if key is not None else int(name), layer))
    return out


def has_state(layer: nn.Module) -> bool:
    return len(layer.state_dict()) > 0


def on_every_rank(transport: Any, fn: Any, *args: Any,
                  wrap: Callable[[BaseException], BaseException | None] | None = None) -> Any:
    """``fn(*args)`` here, then agreement: if any rank's ``fn`` failed, every rank raises
    the lowest failing rank's error (through ``wrap``, where given), with its rank
    (:func:`pipekernel.comm.agreement.raise_on_every_rank`); else ``fn``'s result."""
    try:
        result, error = fn(*args), None
    except Exception as err:  # noqa: BLE001 - every error travels to every rank
        result, error = None, wrap(err) if wrap is not None else err
    raise_on_every_rank(transport, error, hint="look at this rank's traceback above: its "
                        "checkpoint step failed there; every rank stopped with it")
    return result


def layout(engine: Any) -> dict[str, Any]:
    """The layout a checkpoint records: stages, replicas (``data_parallel_size`` counts
    every data-parallel rank), world, chunks, placement, bounds, tensor-parallel size, rank
    order, FSDP2 shards and the expert-parallel size."""
    topo, parallel = engine.topology, engine.parallel
    return {"num_stages": engine.num_stages, "data_parallel_size": engine.data_parallel_size,
            "world_size": engine.transport.world_size, "chunks": engine.chunks,
            "placement": engine.placement, "bounds": list(engine.bounds),
            "tensor_parallel_size": topo.model_size, "rank_order": topo.order,
            "data_parallel_shard": parallel.data_parallel_shard,
            "expert_parallel_size": parallel.expert_parallel_size}


def same_layout(saved: dict[str, Any], ours: dict[str, Any]) -> bool:
    """Same shape and the same rank for every position (then RNG states are restored).
    Keys a checkpoint predates take the value they had then: the rank order
    ``"tp-pp-dp"``, one tensor-parallel rank, no shards, no expert parallelism; with one
    replica and one tensor-parallel rank every order is the same."""
    saved = {"tensor_parallel_size": 1, "rank_order": "tp-pp-dp", "data_parallel_shard": 1,
             "expert_parallel_size": 1, **saved}
    if ours["data_parallel_size"] == 1 and ours["tensor_parallel_size"] == 1:
        saved, ours = ({k: v for k, v in d.items() if k != "rank_order"} for d in (saved, ours))
    return saved == ours


def check_model(meta: dict, module: Any, directory: str,
                 layers: Iterable[tuple[int, nn.Module]], shapes_of: Any = None) -> None:
    """``ConfigError`` naming the first layer whose tensors differ from the checkpoint's
    (``shapes_of(layer)``: the whole shapes of its ``state_dict``; default: as they are)."""
    if meta["num_layers"] != len(module.layers):
        raise ConfigError(f"checkpoint {directory} holds a model of {meta['num_layers']} "
                          f"layers and this PipelineModule has {len(module.layers)}",
                          hint="load it with the layer list it was saved from")
    for index, layer in layers:
        saved = meta["layers"][index]
        ours = (shapes_of(layer) if shapes_of is not None
                else {k: list(v.shape) for k, v in layer.state_dict().items()})
        theirs = saved.get("shapes", {})
        for key in [*ours, *(k for k in theirs if k not in ours)]:
            if ours.get(key) != theirs.get(key):
                raise ConfigError(
                    f"checkpoint {directory} is of another model: layer {index} "
                    f"({saved['type']} in the checkpoint, {type(layer).__name__} here) "
                    f"has {key!r} of shape {theirs.get(key, 'missing')} in the checkpoint "
                    f"and {ours.get(key, 'missing')} here",
                    hint="load it with the layer list it was saved from")


def restore_rng(engine: Any, rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["cpu"])
    random.setstate(_python_state(rng["python"]))
    device = torch.device(engine.transport.device)
    if "cuda" in rng and device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], device)


def _python_state(state: Any) -> tuple:
    version, internal, gauss = state
    return version, tuple(internal), gauss


def apply_rank_state(engine: Any, mine: dict, exact: bool, meta: dict) -> None:
    """What a rank file holds besides the precision policy's state: the LR scheduler,
    the counters, and the RNG states when the layout is the one saved (``exact``)."""
    scheduler_state = mine.get("lr_scheduler")
    if engine.lr_scheduler is not None and scheduler_state is not None:
        engine.lr_scheduler.load_state_dict(scheduler_state)
    engine.restore_counters(int(meta["global_steps"]), int(meta["skipped_steps"]),
                            int(mine.get("data_position",
                                         meta["global_steps"] * engine.micro_batches)))
    if exact:
        restore_rng(engine, mine["rng"])


def loaded(engine: Any, directory: str, meta: dict, mine: dict, exact: bool) -> dict[str, Any]:
    """What ``load_checkpoint`` returns, whichever format was read (the keys:
    :func:`pipekernel.engine.checkpoint.load_checkpoint`)."""
    return {"directory": directory, "tag": os.path.basename(directory),
            "global_steps": meta["global_steps"], "skipped_steps": meta["skipped_steps"],
            "data_position": engine.trained_micro_batches,
            "client_state": mine.get("client_state"), "exact": exact, "meta": meta}
