"""``trainer.predict`` through the pipeline: the last stage's outputs on every rank.

Lightning's DDP strategy gives each rank the predictions of the samples *its* sampler
dealt it (nothing is gathered across ranks; ``BasePredictionWriter`` writes per rank). The
pipeline keeps that contract per data-parallel replica: the stages of one replica read the
same samples, the last stage computes the outputs, and :class:`OutputBroadcast` sends them
to the replica's other stages, so ``trainer.predict`` returns on **every** rank the list of
per-batch outputs of the samples that rank's replica read -- rank 0 (what a spawned run
returns to the main process) included. Never one stage's activations.
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["OutputBroadcast", "to_device"]


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` (tensors in tuples, lists, dicts) with every tensor on ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return type(obj)((k, to_device(v, device)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(to_device(v, device) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


def concat(outputs: list[Any]) -> Any:
    """Micro-batch outputs joined along the batch dimension (nested structures followed)."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outputs) if first.dim() else torch.stack(outputs)
    if isinstance(first, dict):
        return type(first)((k, concat([o[k] for o in outputs])) for k in first)
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(concat(list(parts)) for parts in zip(*outputs)))
    if isinstance(first, (tuple, list)):
        return type(first)(concat(list(parts)) for parts in zip(*outputs))
    return outputs


class OutputBroadcast:
    """Sends the last stage's outputs of a batch to the other stages of its replica
    (one ``torch.distributed`` group per pipeline, created on every rank in the same
    order the first time)."""

    def __init__(self, engine: Any) -> None:
        import torch.distributed as dist
        topology = engine.topology
        self.group: Any = None
        self.src = topology.stage_rank(engine.num_stages - 1)
        groups = topology.pipe_groups()
        if len(groups) > 1:  # with one pipeline the world is the group
            for ranks in groups:
                group = dist.new_group(ranks)
                if engine.rank in ranks:
                    self.group = group
        self.rank, self.device = engine.rank, engine.transport.device

    def __call__(self, outputs: Any) -> Any:
        import torch.distributed as dist
        if self.src == self.rank == 0 and dist.get_world_size() == 1:
            return outputs
        box = [to_device(outputs, torch.device("cpu")) if self.rank == self.src else None]
        device = self.device if torch.device(self.device).type == "cuda" else None
        dist.broadcast_object_list(box, src=self.src, group=self.group, device=device)
        return to_device(box[0], self.device)
