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

from pipekernel.lightning.batches import split_batch

__all__ = ["OutputBroadcast", "PredictMixin", "to_device", "concat"]


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


class PredictMixin:
    """The prediction half of :class:`~pipekernel.lightning.PipelineStrategy`."""

    def predict_batch(self, batch: Any, micro_batches: int | None = None) -> Any:
        """The model's outputs for ``batch`` (the last stage's, micro-batches joined along
        the batch dimension), on **every** rank of the replica (see
        :mod:`pipekernel.lightning.predict`). ``batch`` is the inputs, or ``(inputs,
        labels)`` (the labels are not used). Call it on every rank."""
        engine = self._need_engine("predict_batch")
        inputs = batch[0] if isinstance(batch, (tuple, list)) and len(batch) == 2 else batch
        count = micro_batches or engine.micro_batches
        items = split_batch((inputs, inputs), count, "predict_batch")
        with torch.inference_mode(False):
            _, outputs = engine.eval_batch(iter(items), compute_loss=False,
                                           return_outputs=True, micro_batches=micro_batches)
        if self._broadcast is None:
            self._broadcast = OutputBroadcast(engine)
        return self._broadcast(concat(outputs) if outputs is not None else None)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """A module without its own ``predict_step`` predicts through the pipeline
        (Lightning's default would call ``self(batch)``, one stage's layers at best)."""
        from lightning.pytorch.core.module import LightningModule
        module = self.lightning_module
        if type(module).predict_step is LightningModule.predict_step:
            batch = args[0] if args else kwargs["batch"]
            return self.predict_batch(batch)
        return super().predict_step(*args, **kwargs)
