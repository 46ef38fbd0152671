"""The stage runtime (layer 2): buffers and the handlers of the core instructions.

Talks to peers only through a :class:`~pipekernel.transport.Transport`; knows
nothing of schedules — it executes whatever instructions the kernel hands it.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from pipekernel import instructions as isa
from pipekernel.errors import DataError, PipelineError
from pipekernel.topology import Topology
from pipekernel.wire import Channel, flatten

__all__ = ["StageRuntime", "Buffer"]


@dataclass
class Buffer:
    """One in-flight micro-batch on this stage."""

    micro_batch: int = -1
    inputs: Any = None
    labels: Any = None
    outputs: Any = None
    loss: torch.Tensor | None = None
    output_grads: Any = None   # gradients received for ``outputs``
    input_grads: Any = None    # gradients computed for ``inputs``
    pending: list[Any] = field(default_factory=list)  # sends still in flight from this slot

    def reuse(self, micro_batch: int) -> None:
        for handle in self.pending:
            handle.wait()  # a send's completion is checked when its slot is reused
        self.__init__(micro_batch)


def _to(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    return tuple(_to(o, device) for o in obj)


def _grad_tensors(obj: Any) -> list[torch.Tensor]:
    """The float tensors of ``obj`` that carry gradients."""
    tensors, _ = flatten(obj)
    return [t for t in tensors if t.requires_grad]


class StageRuntime:
    """Executes the core instructions for one stage of one pipeline.

    :param module: the stage's layers.
    :param topology: this rank's place in the grid.
    :param transport: the communication backend.
    :param loss_fn: ``loss_fn(outputs, labels)``; used on the last stage.
    :param precision: the :class:`~pipekernel.precision.Precision` policy (forward,
        loss scaling, gradient accumulation).
    :param reduce_tied: callable summing tied gradients across stages.
    :param reduce_grads: callable averaging gradients across replicas.
    :param optimizer_step: callable stepping the optimizer.
    :param before_last_backward: called right before this stage's last backward of
        the batch (e.g. to arm gradient-bucket hooks); ``None``: nothing.
    :param after_last_backward: called right after that backward and the precision's
        ``after_backward`` (gradients are final there, masters included).
    """

    def __init__(self, module: torch.nn.Module, topology: Topology, transport: Any,
                 loss_fn: Callable | None, precision: Any, *,
                 reduce_tied: Callable[[], None], reduce_grads: Callable[[], None],
                 optimizer_step: Callable[[], None],
                 before_last_backward: Callable[[], None] | None = None,
                 after_last_backward: Callable[[], None] | None = None) -> None:
        self.module, self.topology, self.transport = module, topology, transport
        self.loss_fn, self.precision = loss_fn, precision
        self.stage = topology.stage
        self.is_first, self.is_last = topology.is_first_stage, topology.is_last_stage
        prev_rank = topology.stage_rank(self.stage - 1) if not self.is_first else None
        next_rank = topology.stage_rank(self.stage + 1) if not self.is_last else None
        self.channels = {
            "act_in": Channel(transport, prev_rank) if prev_rank is not None else None,
            "act_out": Channel(transport, next_rank) if next_rank is not None else None,
            "grad_in": Channel(transport, next_rank) if next_rank is not None else None,
            "grad_out": Channel(transport, prev_rank) if prev_rank is not None else None,
        }
        self._reduce_tied, self._reduce_grads = reduce_tied, reduce_grads
        self._optimizer_step = optimizer_step
        self._before_last_backward, self._after_last_backward = (before_last_backward,
                                                                 after_last_backward)
        self._backwards_run = 0
        self.buffers: list[Buffer] = []
        self.data_iter: Iterator | None = None
        self.micro_batches = 1
        self.compute_loss = True
        self.keep_outputs = False
        self.losses: list[torch.Tensor] = []
        self.outputs: list[Any] = []

    # -- batch lifecycle ---------------------------------------------------
    def begin(self, data_iter: Iterator | None, micro_batches: int, num_buffers: int, *,
              compute_loss: bool = True, keep_outputs: bool = False) -> None:
        self.data_iter, self.micro_batches = data_iter, micro_batches
        self.compute_loss, self.keep_outputs = compute_loss, keep_outputs
        self.flush()
        self.buffers = [Buffer() for _ in range(num_buffers)]
        self.losses, self.outputs = [], []
        self._backwards_run = 0

    def flush(self) -> None:
        """Wait for every send still in flight."""
        for buffer in self.buffers:
            buffer.reuse(-1)

    def handlers(self) -> dict[type, Callable[[Any], Any]]:
        return {
            isa.LoadMicroBatch: self.load_micro_batch, isa.Forward: self.forward,
            isa.Backward: self.backward, isa.SendActivation: self.send_activation,
            isa.RecvActivation: self.recv_activation, isa.SendGrad: self.send_grad,
            isa.RecvGrad: self.recv_grad,
            isa.ReduceTiedGrads: lambda _: self._reduce_tied(),
            isa.ReduceGrads: lambda _: self._reduce_grads(),
            isa.OptimizerStep: lambda _: self._optimizer_step(),
        }

    def _slot(self, instruction: isa.MicroBatchInstruction) -> Buffer:
        buffer = self.buffers[instruction.buffer]
        if buffer.micro_batch != instruction.micro_batch:
            raise PipelineError(
                f"buffer {instruction.buffer} holds micro-batch {buffer.micro_batch}, "
                f"not {instruction.micro_batch}",
                hint="the schedule uses a buffer before filling it; check it with "
                     "pipekernel.schedules.simulate")
        return buffer

    def _fill(self, instruction: isa.MicroBatchInstruction) -> Buffer:
        buffer = self.buffers[instruction.buffer]
        if buffer.micro_batch != instruction.micro_batch:
            buffer.reuse(instruction.micro_batch)
        return buffer

    # -- handlers ----------------------------------------------------------
    def load_micro_batch(self, instruction: isa.LoadMicroBatch) -> None:
        buffer = self._fill(instruction)
        try:
            item = next(self.data_iter)  # type: ignore[arg-type]
        except StopIteration:
            raise DataError(
                f"the data iterator ran out at micro-batch {instruction.micro_batch} of "
                f"{self.micro_batches}",
                hint=f"give each train_batch/eval_batch an iterator with at least "
                     f"{self.micro_batches} micro-batches (e.g. itertools.cycle(loader))") from None
        except TypeError as err:
            raise DataError(f"data_iter is not an iterator: {err}",
                            hint="pass iter(loader), not the loader itself") from err
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise DataError(
                f"micro-batch {instruction.micro_batch} is a {type(item).__name__}"
                + (f" of length {len(item)}" if isinstance(item, (tuple, list)) else "")
                + ", expected (inputs, labels)",
                hint="make the iterator yield (inputs, labels) pairs; use None for unused parts")
        inputs, labels = item
        device = self.transport.device
        if self.is_first:
            flatten(inputs, "inputs")
            buffer.inputs = _to(inputs, device)
        if self.is_last and labels is not None:
            flatten(labels, "labels")
            buffer.labels = _to(labels, device)

    def forward(self, instruction: isa.Forward) -> None:
        buffer = self._slot(instruction)
        if buffer.inputs is None:
            raise PipelineError("forward before the inputs arrived",
                                hint="the schedule must load or receive before Forward")
        buffer.outputs = self.precision.forward(self.module, buffer.inputs, first=self.is_first,
                                                last=self.is_last)
        if self.is_last:
            if self.keep_outputs:
                self.outputs.append(buffer.outputs)
            if self.compute_loss:
                buffer.loss = self._loss(buffer, instruction.micro_batch)
                self.losses.append(buffer.loss.detach())

    def _loss(self, buffer: Buffer, micro_batch: int) -> torch.Tensor:
        try:
            loss = self.loss_fn(buffer.outputs, buffer.labels)  # type: ignore[misc]
        except Exception as err:
            raise DataError(
                f"loss_fn(outputs, labels) failed for micro-batch {micro_batch}: "
                f"{type(err).__name__}: {err} (outputs: {_describe(buffer.outputs)}, "
                f"labels: {_describe(buffer.labels)})",
                hint="make the labels from the data iterator match what loss_fn expects"
            ) from err
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
            raise DataError(f"loss_fn returned {_describe(loss)}, expected a scalar tensor",
                            hint="reduce the loss to a 0-dim tensor (e.g. .mean())")
        return loss.reshape(())

    def _is_last_backward(self, instruction: isa.Backward) -> bool:
        """Count ``instruction`` and say whether it is this stage's last backward of the
        batch (one per micro-batch; called once per backward instruction)."""
        self._backwards_run += 1
        return self._backwards_run == self.micro_batches

    def backward(self, instruction: isa.Backward) -> None:
        buffer = self._slot(instruction)
        last = self._is_last_backward(instruction)
        if last and self._before_last_backward is not None:
            self._before_last_backward()
        if self.is_last:
            scaled = self.precision.scale_loss(buffer.loss / self.micro_batches)
            scaled.backward()
        else:
            outputs = _grad_tensors(buffer.outputs)
            if outputs:
                torch.autograd.backward(outputs, list(buffer.output_grads))
        self.precision.after_backward(self.module)
        if last and self._after_last_backward is not None:
            self._after_last_backward()
        if not self.is_first:
            inputs = _grad_tensors(buffer.inputs)
            buffer.input_grads = tuple(t.grad if t.grad is not None else torch.zeros_like(t)
                                       for t in inputs)
        buffer.outputs = buffer.loss = buffer.output_grads = None

    def send_activation(self, instruction: isa.SendActivation) -> None:
        buffer = self._slot(instruction)
        buffer.pending += self.channels["act_out"].send(buffer.outputs)

    def recv_activation(self, instruction: isa.RecvActivation) -> None:
        buffer = self._fill(instruction)
        buffer.inputs = self.channels["act_in"].recv()

    def send_grad(self, instruction: isa.SendGrad) -> None:
        buffer = self._slot(instruction)
        buffer.pending += self.channels["grad_out"].send(buffer.input_grads)
        buffer.inputs = None

    def recv_grad(self, instruction: isa.RecvGrad) -> None:
        buffer = self._slot(instruction)
        buffer.output_grads = self.channels["grad_in"].recv()


def _describe(obj: Any) -> str:
    if isinstance(obj, torch.Tensor):
        return f"tensor{tuple(obj.shape)} {obj.dtype}"
    if isinstance(obj, (tuple, list)):
        return "(" + ", ".join(_describe(o) for o in obj) + ")"
    return type(obj).__name__
