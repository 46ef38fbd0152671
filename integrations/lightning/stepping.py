"""The engine's optimizer step as Lightning's automatic optimization expects it.

:class:`StepControl` is an engine plugin that takes over the three instructions that end a
training batch (``ReduceTiedGrads``, ``ReduceGrads``, ``OptimizerStep``, through
``pipekernel_register_instructions``, the hook's documented way to override a core
handler) so that the Trainer's options keep their meaning under the pipeline:

* ``Trainer(accumulate_grad_batches=k)``: for the first ``k - 1`` batches of a window the
  pipeline runs forward and backward only (no reduction, no step: the gradients stay
  local and add up, as in one process); the ``k``-th batch reduces the sum over replicas
  and tied stages once, scales it by ``1/k`` (Lightning divides every batch's loss by
  ``k``, including a shorter last window of an epoch) and steps.
* Lightning's ``on_before_optimizer_step`` hooks run right before the engine's step, with
  gradients reduced over replicas and scaled as above; :attr:`StepControl.grad_norm` is then
  the **whole model's** 2-norm (every stage, tied weights once, fp16 loss scale removed).
* ``Trainer(gradient_clip_val=v, gradient_clip_algorithm="value")``: every gradient
  element clamped to ``[-v, v]`` after those hooks (elementwise, so a stage clamps its
  own exactly as one process would); ``"norm"`` is the engine's ``max_grad_norm``.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from pipekernel.extend.hookspecs import hookimpl
from pipekernel.schedules.instructions import OptimizerStep, ReduceGrads, ReduceTiedGrads

__all__ = ["StepControl", "whole_grad_norm", "grad_norm"]


def whole_grad_norm(engine: Any) -> float | None:
    """The 2-norm of the whole model's gradient (every stage and replica, tied weights
    counted once), as ``torch.nn.utils.clip_grad_norm_`` would return it in one process.
    Collective: every rank calls it, at the step (after the reductions).
    ``None`` under ``loss_reduction="tokens"`` (the gradients are divided by the token
    count only inside the step)."""
    if engine.loss_reduction == "tokens":
        return None
    local = engine.batch_step.local_grad_norm_sq()  # this rank's share (pipekernel.step)
    vec = torch.zeros(1, dtype=torch.float64, device=engine.transport.device)
    if local is not None:
        vec[0] = local
    engine.transport.all_reduce(vec)
    scaler = getattr(engine.precision, "scaler", None)  # fp16: gradients are still scaled
    scale = float(scaler.scale) if scaler is not None else 1.0
    return math.sqrt(float(vec[0])) / scale


class StepControl:
    """Engine plugin: accumulation across batches, Lightning's hooks at the step, the
    whole model's gradient norm, value clipping (see the module docstring)."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        #: the running batch only accumulates gradients (no reduction, no step)
        self.accumulating = False
        #: factor on the accumulated gradients before the step (``1 / k``)
        self.grad_scale = 1.0
        #: clamp gradient elements to ``[-clip_value, clip_value]`` (``None``: no)
        self.clip_value: float | None = None
        #: the whole model's gradient 2-norm at the last step (before clipping)
        self.grad_norm: float | None = None

    @hookimpl
    def pipekernel_register_instructions(self, runtime: Any) -> dict[type, Any]:
        return {ReduceTiedGrads: self._reduce_tied, ReduceGrads: self._reduce,
                OptimizerStep: self._step}

    def _core(self, cls: type) -> Any:
        return self.strategy.engine.batch_step.handlers()[cls]

    def _reduce_tied(self, instruction: Any) -> None:
        if not self.accumulating:
            self._core(ReduceTiedGrads)(instruction)

    def _reduce(self, instruction: Any) -> None:
        if not self.accumulating:
            self._core(ReduceGrads)(instruction)

    def _step(self, instruction: Any) -> None:
        if self.accumulating:
            return  # the gradients stay for the window's last batch
        engine = self.strategy.engine
        grads = [p.grad for group in engine.optimizer.param_groups for p in group["params"]
                 if p.grad is not None]
        if self.grad_scale != 1.0:
            for grad in grads:
                grad.mul_(self.grad_scale)
        self.grad_norm = whole_grad_norm(engine)
        self.strategy._before_optimizer_step()
        if self.clip_value is not None:
            scaler = getattr(engine.precision, "scaler", None)
            bound = self.clip_value * (float(scaler.scale) if scaler is not None else 1.0)
            for grad in grads:
                grad.clamp_(-bound, bound)
        self._core(OptimizerStep)(instruction)


def grad_norm(module: Any, norm_type: float | str = 2.0) -> dict[str, float]:
    """Drop-in for ``lightning.pytorch.utilities.grad_norm`` under ``PipelineStrategy``:
    ``{"grad_{p}_norm/{name}": norm}`` for this rank's stage's parameters (each exact),
    and ``"grad_{p}_norm_total"``: the **whole model's** norm (every stage), where
    Lightning's would give this stage's only. Call it in ``on_before_optimizer_step``;
    only ``norm_type=2`` has a whole-model total (computed at the step, no collective here).

    :raises ValueError: another ``norm_type``, or no step is running.
    """
    from pipekernel.errors import ConfigError
    if float(norm_type) != 2.0:
        raise ConfigError(f"pipekernel.lightning.grad_norm(norm_type={norm_type!r}): only the "
                          "2-norm of the whole model is computed at the step",
                          hint="use norm_type=2")
    control = getattr(module.trainer.strategy, "step_control", None)
    if control is None or control.grad_norm is None:
        raise ConfigError("pipekernel.lightning.grad_norm() needs a running step of "
                          "PipelineStrategy", hint="call it in on_before_optimizer_step")
    master = module.trainer.strategy.engine.precision.master  # bf16: grads on fp32 masters
    grads = {name: master(p).grad for name, p in module.named_parameters()}
    norms = {f"grad_2.0_norm/{name}": float(g.detach().double().norm())
             for name, g in grads.items() if g is not None}
    norms["grad_2.0_norm_total"] = control.grad_norm
    return norms
