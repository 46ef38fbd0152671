"""A LightningModule whose layers live in ``__init__``, under the pipeline and in one process.

A module written the usual way builds its layers in ``__init__`` (``self.net =
nn.Sequential(...)``); ``configure_model()`` then only lists them for the pipeline:
``return pk.PipelineModule(list(self.net), loss_fn=self.loss_fn)``. Under
``PipelineStrategy`` every rank holds this stage's layers as ``self.pipeline``; the module's
own references to pipeline layers (``self.net[2]``, ...) are replaced by
:class:`RunsInPipeline` placeholders, so ``self.parameters()`` are the stage's and a
forward through ``self.net`` outside the pipeline fails by name instead of running other
stages' untrained copies. :func:`layer_names` remembers where each layer sat, so the
checkpoint file holds the whole model under the module's own names and
``LightningModule.load_from_checkpoint`` loads it in one process unchanged.

For models built only stage by stage (``LayerSpec``), :func:`attach_whole_model` gives
one process (no ``PipelineStrategy``: inference, ``load_from_checkpoint``) the whole
model as ``self.pipeline``, under the names the checkpoint file uses.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from pipekernel.errors import ConfigError

__all__ = ["RunsInPipeline", "detach_pipeline_layers", "restore_layers", "attach_whole_model"]


class RunsInPipeline(nn.Module):
    """Stands where a layer of the pipeline sat in the LightningModule (on this rank the
    layer runs inside the engine, or on another stage)."""

    def __init__(self, name: str, layer: nn.Module) -> None:
        super().__init__()
        self.layer_name = name
        # not a submodule: the LightningModule's parameters stay the stage's; a later
        # configure_model() listing self.net again gets the layer back (restore_layers)
        self.__dict__["layer"] = layer

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError(
            f"{self.layer_name} is a layer of the pipeline: under PipelineStrategy it runs "
            "inside the engine (on its stage), not through the LightningModule's forward",
            hint="in training_step write loss = self.trainer.strategy.train_batch(batch); "
                 "in validation_step/test_step self.trainer.strategy.eval_batch(batch); in "
                 "predict_step self.trainer.strategy.predict_batch(batch) (or leave "
                 "predict_step out)")


def detach_pipeline_layers(module: nn.Module, pipeline: Any, keep: str) -> dict[int, str]:
    """Replace every submodule of ``module`` that is a layer object of ``pipeline`` with a
    :class:`RunsInPipeline` (except under the attribute ``keep``, the stage).

    :returns: ``{global layer index: the layer's name in module}`` (the first name of a
        layer that sits in several places), for the whole-model checkpoint file.
    """
    index_of = {id(layer): i for i, layer in enumerate(pipeline.layers)
                if isinstance(layer, nn.Module)}
    names: dict[int, str] = {}
    found = []
    for name, sub in module.named_modules(remove_duplicate=False):
        if not name or name == keep or name.startswith(keep + "."):
            continue
        if id(sub) in index_of:
            names.setdefault(index_of[id(sub)], name)
            found.append(name)
    for name in found:
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        if isinstance(parent._modules.get(attr), RunsInPipeline):
            continue
        parent._modules[attr] = RunsInPipeline(name, parent._modules[attr])
    return names


def restore_layers(pipeline: Any) -> None:
    """A ``configure_model()`` called again (another fit, validate, predict) lists the
    placeholders :func:`detach_pipeline_layers` left: put the layers back in the list."""
    pipeline.layers = [layer.layer if isinstance(layer, RunsInPipeline) else layer
                       for layer in pipeline.layers]


def attach_whole_model(module: nn.Module, pipeline: Any, attribute: str = "pipeline") -> Any:
    """Use in ``configure_model()`` of a module whose layers are ``LayerSpec``\\ s::

        def configure_model(self):
            if self._pipe is None:
                self._pipe = pk.PipelineModule([pk.LayerSpec(...), ...], loss_fn=...)
            return attach_whole_model(self, self._pipe)

    Under ``PipelineStrategy`` it returns ``pipeline`` and does nothing else (the strategy
    attaches the stage). In any other process (no Trainer, another strategy:
    ``load_from_checkpoint``, inference) it also builds **every** layer as
    ``module.<attribute>`` (keys ``"<attribute>.<layer>.<name>"``, as the checkpoint file
    of ``PipelineStrategy`` stores them), once; ``module.<attribute>(inputs)`` runs the
    whole model.
    """
    trainer = getattr(module, "_trainer", None)
    strategy = getattr(trainer, "strategy", None) if trainer is not None else None
    if getattr(strategy, "strategy_name", None) == "pipekernel":
        return pipeline
    if getattr(module, attribute, None) is None:
        whole = pipeline.build_stage(0, [0, len(pipeline.layers)])
        setattr(module, attribute, whole)
    return pipeline
