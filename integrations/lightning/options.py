"""The Trainer's options mapped onto the engine's (``precision``, ``gradient_clip_val``,
``accumulate_grad_batches``), or refused by name where the pipeline cannot mean the same.

* ``Trainer(precision="bf16-mixed")``: Lightning's autocast with fp32 weights, gradients
  and optimizer is pipekernel's ``"amp-bf16"`` policy; activations cross between stages in
  fp32 (``wire_dtype=torch.float32``), so the next stage sees exactly the values one
  process would (a bf16 value is exact in fp32). ``"32-true"``: fp32. Other Lightning
  precisions are refused with the pipekernel policy to use instead.
* ``Trainer(gradient_clip_val=v)``: ``"norm"`` (default) is the engine's ``max_grad_norm``,
  clipping to the **whole model's** norm like ``clip_grad_norm_`` on one process;
  ``"value"`` clamps each gradient element (:class:`~pipekernel.lightning.stepping.StepControl`).
* ``Trainer(accumulate_grad_batches=k)``: ``k`` batches per optimizer step, exactly as in
  one process (see :mod:`pipekernel.lightning.stepping`); the engine's gradient buckets
  do not overlap the backward then (``grad_bucket_mb=0``: the reduction waits for the
  window's last batch).
"""
from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.core.module import LightningModule

from pipekernel.errors import ConfigError

__all__ = ["engine_precision", "trainer_step_options"]

_INSTEAD = {
    "16-mixed": "PipelineStrategy(precision='fp16') (fp16 weights with fp32 masters and "
                "dynamic loss scaling) or Trainer(precision='bf16-mixed')",
    "bf16-true": "PipelineStrategy(precision='bf16') (bf16 weights with fp32 master "
                 "weights the optimizer steps)",
    "16-true": "PipelineStrategy(precision='fp16')",
    "64-true": "Trainer(precision='32-true')",
}


def engine_precision(plugin: Any, engine_options: dict[str, Any]) -> dict[str, Any]:
    """Engine options for the Trainer's precision plugin (``{}`` for fp32)."""
    name = str(getattr(plugin, "precision", "32-true"))
    if name in ("32-true", "32"):
        return {}
    if name not in ("bf16-mixed",):
        raise ConfigError(f"Trainer(precision={name!r}) has no pipeline equivalent with the "
                          "same numbers",
                          hint="use " + _INSTEAD.get(name, "Trainer(precision='bf16-mixed') "
                                                     "or a PipelineStrategy(precision=...)"))
    if "precision" in engine_options or "precision_options" in engine_options:
        raise ConfigError(f"Trainer(precision={name!r}) and PipelineStrategy(precision="
                          f"{engine_options.get('precision')!r}) both choose a precision",
                          hint="give it in one place only")
    return {"precision": "amp-bf16", "precision_options": {"wire_dtype": torch.float32}}


def trainer_step_options(trainer: Any, module: Any, engine_options: dict[str, Any]
                         ) -> tuple[dict[str, Any], float | None]:
    """``(engine options, clip value)`` for the Trainer's clipping and accumulation."""
    options: dict[str, Any] = {}
    clip, algorithm = trainer.gradient_clip_val, trainer.gradient_clip_algorithm
    name = type(module).__name__
    if type(module).configure_gradient_clipping is not LightningModule.configure_gradient_clipping:
        raise ConfigError(f"{name} overrides configure_gradient_clipping, which would see "
                          "this stage's gradients only",
                          hint="drop the override and use Trainer(gradient_clip_val=..., "
                               "gradient_clip_algorithm='norm'/'value') (the whole model's "
                               "norm), or PipelineStrategy(max_grad_norm=...)")
    value = None
    if clip:
        if "max_grad_norm" in engine_options:
            raise ConfigError("Trainer(gradient_clip_val=...) and PipelineStrategy("
                              "max_grad_norm=...) both clip", hint="give it in one place only")
        if str(algorithm or "norm") == "norm":
            options["max_grad_norm"] = float(clip)
        else:
            value = float(clip)
    if trainer.accumulate_grad_batches > 1:
        options["grad_bucket_mb"] = 0  # reductions wait for the window's last batch
    return options, value
