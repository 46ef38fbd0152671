"""The paired executor: how a stage runs a ``ForwardBackward`` (the overlapped pairs of
``dualpipev`` and ``zbv``), and :func:`overlap_all_to_all`, the built-in overlap for expert-parallel
layers.

**The contract** is DeepSeek DualPipe's ``overlapped_forward_backward``, adapted to
pipekernel's layers (one argument per call, the loss already scaled). A model supplies it
as ``PipelineModule(..., overlapped_forward_backward=fn)`` or as a method of a
``PipelineModule`` subclass; the stage calls, for each pair::

    outputs0, loss0 = fn(module0, inputs0, criterion0, labels0,
                         module1, loss1, outputs1, output_grads1)

* ``module0(inputs0)`` runs the forward half's layers (through the precision policy; its
  auxiliary losses are collected there) and returns its outputs;
* ``criterion0(outputs0, labels0)`` is the checked loss when the forward half is the last
  pipeline position and the batch computes losses, else ``None`` (then return ``None``);
* ``module1`` is the backward half's part (``module1.chunk``, ``module1.parameters()``);
  its backward is ``loss1.backward()`` when ``loss1`` is not ``None`` (the last position:
  the micro-batch's loss, divided and scaled as pipekernel does), else
  ``torch.autograd.backward(outputs1, output_grads1)`` (when ``outputs1`` is not empty) —
  :func:`run_backward` does exactly that.

``fn`` must call ``module0`` once and run the backward once; what it returns is kept as
the forward's outputs (and loss). Everything around — receiving, sending, the gradients
of the backward's inputs, the data-parallel reducers' cue — is the stage's, as for the two
instructions alone. :func:`sequential` is the contract's reference (DualPipe's example).

**Without one** (the default) the stage runs the forward instruction's handler, then the
backward's: a ``ForwardBackward`` computes bit for bit what the two steps did.

**Overlap of expert all-to-alls.** :func:`overlap_all_to_all` runs the forward half in a
worker thread while the caller runs the backward half. The two halves of a ``dualpipev``
pair are different chunks, and each chunk's expert all-to-alls travel on the chunk's own
process group (a lane, :func:`pipekernel.grid.expert_parallel.lane`; autograd posts a
backward's all-to-all on the group its forward used), so while one half waits on its
dispatch or combine the other computes, and each group still sees the same collectives
in the same order on every member. The results are those of :func:`sequential`, bit for
bit: nothing is shared between the halves but read-only parameters. It refuses stages
whose layers issue other collectives during compute (tensor parallelism, ZeRO-3 /
stage-parallel sharding) and skip connections. On a GPU both threads launch on the
caller's device and stream (correct whatever the interleaving; the collectives overlap,
the kernels of one stream do not); it is measured and tested on gloo only so far, and
NCCL may hang when two communicators' operations meet in different orders on different
ranks with too few SMs free for both.
"""
from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch

from pipekernel.errors import ConfigError, PipelineError
from pipekernel.model.aux_loss import collecting as collect_aux

__all__ = ["PairedExecutor", "PairedStage", "sequential", "overlap_all_to_all", "run_backward"]


def run_backward(loss1: torch.Tensor | None, outputs1: list, output_grads1: list) -> None:
    """The backward half of the contract: ``loss1.backward()``, or the outputs' backward."""
    if loss1 is not None:
        loss1.backward()
    elif outputs1:
        torch.autograd.backward(outputs1, output_grads1)


def sequential(module0: Callable, inputs0: Any, criterion0: Callable | None, labels0: Any,
               module1: Any, loss1: torch.Tensor | None, outputs1: list,
               output_grads1: list) -> tuple[Any, torch.Tensor | None]:
    """The contract's reference: the forward half, its loss, then the backward half."""
    outputs0 = module0(inputs0)
    loss0 = criterion0(outputs0, labels0) if criterion0 is not None else None
    run_backward(loss1, outputs1, output_grads1)
    return outputs0, loss0


def overlap_all_to_all(module0: Callable, inputs0: Any, criterion0: Callable | None,
                       labels0: Any, module1: Any, loss1: torch.Tensor | None, outputs1: list,
                       output_grads1: list) -> tuple[Any, torch.Tensor | None]:
    """The forward half in a worker thread, the backward half here, at the same time
    (see the module docstring); the halves of one chunk's lane run one after the other."""
    if getattr(module0, "chunk", None) == getattr(module1, "chunk", None):
        return sequential(module0, inputs0, criterion0, labels0, module1, loss1, outputs1,
                          output_grads1)
    box: dict[str, Any] = {}
    # the current CUDA device is per thread: the worker computes on the caller's
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

    def forward() -> None:
        try:
            if device is not None:
                torch.cuda.set_device(device)
            outputs0 = module0(inputs0)
            box["out"] = (outputs0, criterion0(outputs0, labels0)
                          if criterion0 is not None else None)
        except BaseException as err:  # re-raised in the caller
            box["err"] = err

    worker = threading.Thread(target=contextvars.copy_context().run, args=(forward,),
                              name="pipekernel-paired-forward", daemon=True)
    worker.start()
    try:
        run_backward(loss1, outputs1, output_grads1)
    finally:
        worker.join()
    if "err" in box:
        raise box["err"]
    return box["out"]


overlap_all_to_all.needs_private_collectives = True  # type: ignore[attr-defined]


class PairedStage(Protocol):
    """What the paired executor uses of a stage (the
    :class:`~pipekernel.stage.runtime.StageRuntime` provides it), and nothing else."""

    def forward(self, instruction: Any) -> None:
        """The forward instruction's handler (a pair run without ``fn``)."""

    def backward(self, instruction: Any) -> None:
        """The backward instruction's handler (a pair run without ``fn``)."""

    def forward_inputs(self, instruction: Any) -> Any:
        """The forward half's buffer, its inputs there (``.inputs``)."""

    def criterion(self, instruction: Any) -> tuple[Callable | None, Any]:
        """``(criterion0, labels0)`` of the forward half, ``(None, None)`` without a loss."""

    def run_part(self, chunk: int, inputs: Any) -> Any:
        """``chunk``'s layers on ``inputs`` (``module0`` / ``module1`` of the contract)."""

    def part_parameters(self, chunk: int) -> list[torch.Tensor]:
        """``chunk``'s parameters."""

    def forward_done(self, instruction: Any, buffer: Any, outputs: Any,
                     aux: list[torch.Tensor], loss: Any = None) -> None:
        """What follows the forward half (its outputs, aux losses and ``loss0`` kept)."""

    def backward_begin(self, instruction: Any) -> Any:
        """The backward half's buffer (and the reducers told when it is the last)."""

    def backward_roots(self, instruction: Any, buffer: Any) -> tuple[Any, list, list]:
        """``(loss1, outputs1, output_grads1)`` of the backward half."""

    def backward_done(self, instruction: Any, buffer: Any) -> None:
        """What follows the backward half (its inputs' gradients kept)."""


class _Half:
    """``module0`` / ``module1`` of the contract: one chunk's part of the stage."""

    def __init__(self, stage: PairedStage, chunk: int) -> None:
        self._stage, self.chunk = stage, chunk
        self.calls, self.outputs = 0, None
        self.aux: list[Any] = []

    def __call__(self, inputs: Any) -> Any:
        with collect_aux() as aux:
            self.outputs = self._stage.run_part(self.chunk, inputs)
        self.calls, self.aux = self.calls + 1, self.aux + list(aux)
        return self.outputs

    def parameters(self) -> list[torch.Tensor]:
        return self._stage.part_parameters(self.chunk)


class PairedExecutor:
    """Runs a stage's ``ForwardBackward`` instructions (see the module docstring).

    :param stage: the stage's part the executor uses (:class:`PairedStage`).
    :param fn: the model's ``overlapped_forward_backward``, or ``None`` (the forward's
        handler, then the backward's).
    :param where: the stage, for errors; :param skips: whether the model has skip
        connections; :param sharded: whether the stage's layers issue collectives of their
        own (tensor parallelism, sharded parameters).
    :raises ConfigError: ``fn`` is not callable, the model has skip connections, or
        ``fn`` needs the halves' collectives to itself (:func:`overlap_all_to_all`) on a
        stage with tensor parallelism or sharded parameters.
    """

    def __init__(self, stage: PairedStage, fn: Callable[..., Any] | None, *, where: str,
                 skips: bool = False, sharded: bool = False) -> None:
        self.stage, self.fn = stage, fn
        if fn is None:
            return
        if not callable(fn):
            raise ConfigError(f"{where}: overlapped_forward_backward is a "
                              f"{type(fn).__name__}, not a callable",
                              hint="pass a function with DualPipe's signature (module0, "
                                   "inputs0, criterion0, labels0, module1, loss1, outputs1, "
                                   "output_grads1), e.g. pk.overlap_all_to_all, or None")
        if skips:
            raise ConfigError(f"{where}: overlapped_forward_backward with skip connections",
                              hint="drop overlapped_forward_backward (the pairs then run "
                                   "one after the other) or the skip connections")
        if getattr(fn, "needs_private_collectives", False) and sharded:
            raise ConfigError(
                f"{where}: {getattr(fn, '__name__', fn)!r} runs a pair's halves at the same "
                f"time, and this stage's layers issue tensor-parallel or sharding collectives "
                f"that the halves would post in different orders on different ranks",
                hint="use it with data and expert parallelism only (tensor_parallel_size=1, "
                     "no ZeRO-3 / stage sharding), or drop overlapped_forward_backward")

    def run(self, pair: Any) -> None:
        """Run ``pair`` (a :class:`~pipekernel.schedules.instructions.ForwardBackward`)."""
        rt, f, b = self.stage, pair.forward, pair.backward
        if self.fn is None:
            rt.forward(f)
            rt.backward(b)
            return
        f_buf = rt.forward_inputs(f)
        b_buf = rt.backward_begin(b)
        loss1, outputs1, grads1 = rt.backward_roots(b, b_buf)
        criterion0, labels0 = rt.criterion(f)
        module0, module1 = _Half(rt, f.chunk), _Half(rt, b.chunk)
        result = self.fn(module0, f_buf.inputs, criterion0, labels0, module1, loss1,
                         outputs1, grads1)
        outputs0, loss0 = self._check(result, module0, module1)
        rt.forward_done(f, f_buf, outputs0, module0.aux,
                        loss0 if criterion0 is not None else None)
        rt.backward_done(b, b_buf)

    def _check(self, result: Any, module0: _Half, module1: _Half) -> tuple[Any, Any]:
        name = getattr(self.fn, "__name__", repr(self.fn))
        if not (isinstance(result, tuple) and len(result) == 2):
            raise ConfigError(f"overlapped_forward_backward {name!r} returned "
                              f"{type(result).__name__}, expected (outputs0, loss0)",
                              hint="return module0's outputs and criterion0's loss (or None)")
        if module0.calls != 1:
            raise PipelineError(f"overlapped_forward_backward {name!r} called module0 "
                                f"{module0.calls} times, expected once",
                                hint="run the forward half exactly once per pair")
        return result
