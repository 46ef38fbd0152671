"""Auxiliary losses that stay on the stage that computes them (``pk.add_aux_loss``).

A layer adds a term to the training objective from inside its forward — a mixture of
experts' load-balancing loss, a router's z-loss — with::

    import pipekernel as pk

    def forward(self, x):
        probs = self.router(x).softmax(-1)
        pk.add_aux_loss(self.coef * balance_loss(probs))   # a one-element tensor
        ...

The objective each micro-batch contributes is then ``loss + Σ aux`` (every aux loss of
every stage), with the gradient scaling of the main loss: one process computing
``loss + aux`` per micro-batch with gradient accumulation is what the pipeline matches.

**Nothing crosses a stage.** As Megatron-core's ``MoEAuxLossAutoScaler`` does, the stage
runtime collects the aux losses of a chunk's forward and attaches their sum to the
chunk's output with :class:`AttachAux`, an autograd function that is the identity
forward and, in backward, hands the output's gradient on unchanged and gives the aux
loss the gradient ``d(scaled objective)/d(aux)`` — the same ``1 / micro_batches`` (times
the precision's loss scale) the main loss's backward starts from. The aux loss's
gradient therefore flows in the stage's own backward, whichever pass runs it (a full
``Backward``, or ``BackwardInput`` then ``BackwardWeight`` of the split backward: the
attach node sits on the input path, so the router's weight gradient is produced in the
weight pass like any other). On the chunk that computes the main loss the sum is added
to that loss instead. Data-parallel averaging then treats both alike.

**Recompute adds nothing.** Activation checkpointing re-runs a layer's forward inside
the backward; :func:`add_aux_loss` ignores calls made while autograd runs a backward
(and calls outside a collector), so every aux loss counts once.

**Reported apart.** The loss ``train_batch`` returns includes the aux losses (summed over
stages, averaged over micro-batches and replicas like the main loss); the aux part alone
is ``metrics["aux_loss"]`` in ``pipekernel_after_train_batch`` (and so in the monitor's
records).

Outside an engine, :func:`aux_losses` collects them for a plain forward (the parity
reference uses it)::

    with pk.aux_losses() as aux:
        loss = loss_fn(model(x), y) + sum(aux)
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch

from pipekernel.errors import DataError
from pipekernel.nested import map_tensors

__all__ = ["add_aux_loss", "aux_losses", "AttachAux", "attach", "collecting"]

_COLLECTOR: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "pipekernel_aux_losses", default=None)


def _in_backward() -> bool:
    """Whether autograd is running a backward here (a checkpoint's recompute)."""
    return torch._C._current_graph_task_id() != -1


def add_aux_loss(value: torch.Tensor) -> None:
    """Add ``value`` (a one-element tensor) to the objective of the current micro-batch.

    Call it from a layer's forward. Inside an engine's forward the value is collected
    for the stage's backward and reported with the batch's loss; inside :func:`aux_losses`
    it is appended to that list; elsewhere (a plain forward, a checkpoint's recompute
    during backward) the call does nothing.

    :raises DataError: ``value`` is not a tensor with one element.
    """
    into = _COLLECTOR.get()
    if into is None or _in_backward():
        return
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        got = (f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
               else type(value).__name__)
        raise DataError(f"add_aux_loss needs a one-element tensor, got {got}",
                        hint="reduce the auxiliary loss to a scalar (e.g. .sum() or .mean())")
    if not value.is_floating_point():
        raise DataError(f"add_aux_loss needs a floating-point tensor, got {value.dtype}",
                        hint="compute the auxiliary loss in float (e.g. .float())")
    into.append(value.reshape(()))


@contextlib.contextmanager
def aux_losses() -> Iterator[list[torch.Tensor]]:
    """Collect the :func:`add_aux_loss` calls made inside the block into the list it yields
    (for a forward outside an engine, e.g. a one-process reference)."""
    found: list[torch.Tensor] = []
    token = _COLLECTOR.set(found)
    try:
        yield found
    finally:
        _COLLECTOR.reset(token)


collecting = aux_losses  # what the stage runtime opens around a chunk's forward


class AttachAux(torch.autograd.Function):
    """``output`` unchanged; in backward the aux loss gets ``seed`` as its gradient (the
    scale the main loss's backward starts from) and ``output`` its own gradient."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, aux: torch.Tensor,
                seed: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(seed)
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (seed,) = ctx.saved_tensors
        return grad, seed, None


def attach(outputs: Any, aux: torch.Tensor, seed: torch.Tensor) -> Any:
    """``outputs`` with ``aux`` attached to its first tensor that requires grad (whose
    backward the runtime always runs: the next stage sends a gradient for it, zeros if
    unused). ``None`` when no tensor of ``outputs`` requires grad."""
    done: list[Any] = []

    def one(t: torch.Tensor) -> torch.Tensor:
        if done or not t.requires_grad:
            return t
        done.append(True)
        return AttachAux.apply(t, aux, seed.to(aux.dtype))

    attached = map_tensors(one, outputs)
    return attached if done else None
