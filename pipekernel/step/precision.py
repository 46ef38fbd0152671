"""The ``Precision`` protocol: how a stage's numbers are represented and stepped.

A precision policy is made by the ``pipekernel_make_precision`` hook from the
engine's ``precision=`` name and ``precision_options=``. The core calls it at
fixed points and never looks inside; the policies themselves (``fp32``,
``bf16``, ``fp16``, ``amp-bf16``) are plugins.

When the engine calls what (one rank, one ``train_batch``)::

    prepare(module)                         once, after tied copies and replicas were synced
    optimizer_parameters(module)            once, to build the optimizer
    forward(module, inputs, first, last)    per Forward instruction (train and eval)
    scale_loss(loss)                        per Backward on the last stage
    after_backward(module)                  per Backward, after autograd ran
    master(param)                           whenever the engine needs the gradient of ``param``
                                            (tied/data-parallel reduction, clipping)
    unscale_(params) -> bool | None         once per OptimizerStep, before clipping
    step(optimizer)                         once per OptimizerStep unless skipped
    update(skipped)                         once per OptimizerStep, after the world agreed
    metrics()                               once per train_batch (merged into the hook's metrics)
    state_dict() / load_state_dict(state)   by checkpointing code

The step protocol is what lets a policy skip a step on *every* rank together:
each rank's ``unscale_`` reports only its own overflow; the engine sums the
flags (and the squared gradient norm, when clipping) in **one** all-reduce over
the whole world, so every stage and replica reaches the same decision, then
calls ``step`` (or not) and ``update(skipped)`` on every rank.

Implementers subclass :class:`Precision` and override what they change; the
defaults are the identity policy (fp32). The core checks at engine start that a
policy has every method below.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from pipekernel.nested import map_tensors

__all__ = ["Precision", "REQUIRED", "cast_floats"]

#: Methods every precision policy has (the engine checks them when it starts).
REQUIRED = ("prepare", "optimizer_parameters", "master", "forward", "scale_loss",
            "after_backward", "unscale_", "step", "update", "metrics", "state_dict",
            "load_state_dict")


def cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    """``obj`` (a tensor or nested tuple/list/dict of tensors) with every floating-point
    tensor cast to ``dtype``; other tensors and values unchanged. The cast is part
    of the autograd graph, and a tensor already of ``dtype`` is returned as is."""
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype
                       else t, obj)


class Precision:
    """Base class of precision policies; as is, the fp32 identity policy.

    A caller (the engine) may rely on: ``master(p)`` is the tensor whose
    ``.grad`` holds ``p``'s accumulated gradient between the last
    ``after_backward`` and ``step``, and which the optimizer updates; after
    ``step`` the module's parameters equal (a cast of) the masters.
    """

    #: The name the policy is selected by (for messages and metrics).
    name = "fp32"

    def prepare(self, module: torch.nn.Module) -> None:
        """Cast the stage's parameters and set up master copies. Called once, after
        tied copies and data-parallel replicas were made equal (in fp32)."""

    def optimizer_parameters(self, module: torch.nn.Module) -> list[torch.Tensor]:
        """The tensors the optimizer steps on (fp32 masters for low-precision policies)."""
        return list(module.parameters())

    def master(self, param: torch.Tensor) -> torch.Tensor:
        """The optimizer's tensor for the module parameter ``param`` (``param`` itself
        when the policy keeps no separate copy)."""
        return param

    def forward(self, module: torch.nn.Module, inputs: Any, *, first: bool, last: bool) -> Any:
        """Run the stage's forward. ``first``: ``inputs`` come from the data iterator;
        ``last``: the result goes to ``loss_fn`` (else it is sent to the next stage,
        so its float dtype is the dtype on the wire)."""
        return module(inputs)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The tensor ``backward()`` is called on (loss scaling multiplies here)."""
        return loss

    def after_backward(self, module: torch.nn.Module) -> None:
        """Called after each micro-batch's backward (e.g. move low-precision
        gradients into fp32 accumulators)."""

    def unscale_(self, params: Iterable[torch.Tensor]) -> bool | None:
        """Unscale the gradients of ``params`` (the optimizer's parameters) in place.

        :returns: ``True`` if this rank found an inf/NaN, ``False`` if not, or
            ``None`` if the policy never skips a step (then the engine does not
            communicate for it).
        """
        return None

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Step the optimizer and bring the module's parameters up to date."""
        optimizer.step()

    def update(self, skipped: bool) -> None:
        """Called on every rank after every step, taken or ``skipped`` (the same value
        on every rank): adjust the loss scale."""

    def metrics(self) -> dict[str, Any]:
        """Numbers to report per step, e.g. ``{"loss_scale": 65536.0}``."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """The policy's state a checkpoint must keep (loss scale, trackers, masters)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
