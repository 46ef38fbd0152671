"""The stage runtime (layer 2): buffers, batch lifecycle and the handlers of the core
instructions.

Knows nothing of schedules — it executes whatever instructions the kernel hands it, by the
:class:`~pipekernel.schedules.program.Program` the engine gives it per batch (read, never
changed; the micro-batch and buffer counts are the program's). Its other jobs are parts
with small interfaces: :class:`~pipekernel.stage.transfers.Transfers` posts, waits on and
hands off what travels between stages; :class:`~pipekernel.stage.loss.LossKeeper` keeps
labels, losses, token counts, aux losses and the labels' fingerprints;
:class:`~pipekernel.stage.paired.PairedExecutor` runs ``ForwardBackward`` pairs through the
:class:`~pipekernel.stage.paired.PairedStage` this runtime provides. What skip connections
carry and where it goes is :mod:`pipekernel.model.skip_routing`'s business.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, NoReturn

import torch

from pipekernel.comm.wire import flatten
from pipekernel.errors import DataError, PipelineError
from pipekernel.grid import expert_parallel
from pipekernel.grid.topology import Topology
from pipekernel.model.aux_loss import COLLECTOR as AUX_COLLECTOR
from pipekernel.model.skip_routing import SkipRouter, SkipState
from pipekernel.nested import map_tensors
from pipekernel.schedules import instructions as isa
from pipekernel.schedules.placement import position
from pipekernel.schedules.program import Program
from pipekernel.stage.device import to_device
from pipekernel.stage.loss import LossKeeper
from pipekernel.stage.paired import PairedExecutor
from pipekernel.stage.sequence import KVPrefix, SequenceChunk, chunk_scope
from pipekernel.stage.transfers import Transfers
from pipekernel.step.optimizer_step import BatchLosses

__all__ = ["StageRuntime", "Buffer"]


class Buffer:
    """One in-flight micro-batch of one chunk on this stage."""

    __slots__ = ("micro_batch", "chunk", "inputs", "outputs", "loss", "output_grads",
                 "input_grads", "split", "skips", "aux")

    def __init__(self, micro_batch: int = -1, chunk: int = 0) -> None:
        self.micro_batch, self.chunk = micro_batch, chunk
        self.inputs: Any = None
        self.outputs: Any = None
        self.loss: torch.Tensor | None = None
        self.output_grads: Any = None   # gradients received for ``outputs``
        self.input_grads: Any = None    # gradients computed for ``inputs``
        self.split: Any = None          # BackwardInput's state, until BackwardWeight
        self.skips: SkipState | None = None  # skip connections in and out (skip_routing)
        self.aux: torch.Tensor | None = None  # the chunk's aux losses, added to its loss


def _to(obj: Any, device: torch.device) -> Any:
    return map_tensors(lambda t: to_device(t, device), obj)  # pinned, non-blocking to a GPU


class Bound(NamedTuple):
    """A program bound to one runtime (:meth:`StageRuntime.bind`): per stream index the
    channel of a remote transfer (``channels``) and the group posted there (``groups``, as
    ``(index, is_send, channel, what)``) (:meth:`~pipekernel.stage.transfers.Transfers.bind`);
    per stream index, the sends waited once the receive there arrived (``release``:
    :func:`~pipekernel.schedules.send_release.release_points`)."""

    channels: tuple[Any, ...]
    groups: tuple[tuple[tuple, ...], ...]
    release: tuple[tuple[int, ...], ...] = ()


def _grad_tensors(obj: Any) -> list[torch.Tensor]:
    """The float tensors of ``obj`` that carry gradients."""
    tensors, _ = flatten(obj)
    return [t for t in tensors if t.requires_grad]


class StageRuntime:
    """Executes the core instructions for one stage of one pipeline.

    :param module: the stage's layers (a :class:`~pipekernel.model.module.StageModule`,
        one part per chunk).
    :param topology: this rank's place in the grid.
    :param transport: the communication backend.
    :param loss_fn: ``loss_fn(outputs, labels)``; used at the last pipeline position.
    :param precision: the :class:`~pipekernel.step.precision.Precision` policy (forward,
        loss scaling, gradient accumulation).
    :param chunks: parts per stage; :param placement: which parts
        (:mod:`pipekernel.schedules.placement`).
    :param skips: the :class:`~pipekernel.model.skip_routing.SkipRouter` of a model with skip
        connections between parts (``None``: none).
    :param params_of: ``params -> the tensors autograd holds for them`` at a split
        backward (FSDP2's unsharded parameters: :mod:`pipekernel.grid.stage_parallel`);
        ``None``: the parameters themselves.
    :param tokens: ``loss_reduction="tokens"`` (see :mod:`pipekernel.stage.loss`).
    :param offload: the stage's :class:`~pipekernel.stage.offload.ActivationOffload`
        (``None``: saved activations stay on the device).
    """

    def __init__(self, module: torch.nn.Module, topology: Topology, transport: Any,
                 loss_fn: Callable | None, precision: Any, *, chunks: int = 1,
                 placement: str = "loop",
                 skips: SkipRouter | None = None,
                 params_of: Callable[[list], list] | None = None,
                 tokens: bool = False, offload: Any = None) -> None:
        self.module, self.topology, self.transport = module, topology, transport
        self.precision = precision
        self.stage, self.chunks, self.placement = topology.stage, chunks, placement
        num_stages = topology.pipe_size
        self.positions = [position(self.stage, c, num_stages, placement) for c in range(chunks)]
        last = num_stages * chunks - 1
        self.first_chunk = self.positions.index(0) if 0 in self.positions else None
        self.last_chunk = self.positions.index(last) if last in self.positions else None
        self.is_first, self.is_last = self.first_chunk is not None, self.last_chunk is not None
        part = getattr(module, "part", None)  # a chunked module's parts; else itself
        self.parts = [part(c) if part is not None else module for c in range(chunks)]
        self._part_params = [list(part.parameters()) for part in self.parts]
        self._params_of = params_of
        self._skips = skips
        #: schedule-aware activation offload (pipekernel.stage.offload), or None
        self.offload = offload
        #: labels, losses, token counts, aux losses and fingerprints of the batch
        self.loss_keeper = LossKeeper(loss_fn, precision, tokens=tokens, stage=self.stage)
        #: what travels between stages
        self.transfers = Transfers(transport, topology.stage_rank, self._payload)
        self.buffers: list[Buffer] = []
        self.data_iter: Iterator | None = None
        # the batch's program (the engine's, read only) and its binding here: begin() sets
        # both before any handler runs
        self._program: Program = None  # type: ignore[assignment]
        self._bound: Bound = None  # type: ignore[assignment]
        self._at = -1             # stream index of the instruction running now (enter())
        self._units = 1  # what the losses divide by: the program's micro-batches x seq_chunks
        self.seq_chunks = 1  # sequence chunks per micro-batch (Seq1F1B): units are chunks
        self._prefixes: dict[int, KVPrefix] = {}  # micro-batch -> its KV prefix here
        #: the sentinel's hashes of this batch's transfers (``add(instruction, position,
        #: obj)``; :class:`pipekernel.engine.sentinel.TransferSums`), or ``None``: set by
        #: the engine for a checked step's batch only
        self.transfer_sums: Any = None
        self._paired = PairedExecutor(
            self, getattr(module, "overlapped_forward_backward", None),
            where=f"stage {self.stage}", skips=skips is not None,
            sharded=(params_of is not None or topology.model_size > 1
                     or topology.shard_size > 1))

    # -- batch lifecycle ---------------------------------------------------
    def begin(self, data_iter: Iterator | None, program: Program, bound: Bound, *,
              compute_loss: bool = True, keep_outputs: bool = False,
              check_data: bool = False, seq_chunks: int = 1) -> None:
        """Start a batch that runs ``program.stream`` (compiled by the engine once per
        schedule and count; ``bound``: its :meth:`bind` here, made as often), its
        micro-batches read from ``data_iter``.

        With ``check_data``, each activation carries the fingerprint of the labels the
        first stage read with its inputs, and the last stage compares it with its own
        (see :func:`pipekernel.stage.fingerprint.fingerprint`); every rank of a pipeline must pass
        the same value. :meth:`end` returns the losses computed.

        With ``seq_chunks > 1`` (:mod:`pipekernel.stage.sequence`) the program's units are
        sequence chunks of its micro-batches, and every forward runs in its chunk's scope,
        the micro-batch's KV prefix kept on this stage until its chunk 0's backward.
        """
        # a received object is itself unless it carries a fingerprint or is hashed
        self.transfers.begin(program, bound.channels, self._arrived
                             if check_data or self.transfer_sums is not None else None,
                             bound.release)
        self.loss_keeper.begin(compute_loss=compute_loss, keep_outputs=keep_outputs,
                               check_data=check_data)
        self.data_iter = data_iter
        # _fill replaces an empty slot on first use
        self.buffers = [_EMPTY] * (program.num_buffers or 0)
        self._program, self._bound, self._at = program, bound, -1
        self._units = program.micro_batches * seq_chunks
        self.seq_chunks, self._prefixes = seq_chunks, {}
        if self.offload is not None:
            self.offload.begin(program.stream, self.module.parameters())

    @property
    def micro_batches(self) -> int:
        """The running (or last) batch's unit count: its program's micro-batches (times
        ``seq_chunks``)."""
        return self._units

    @property
    def outputs(self) -> list[Any]:
        """The last position's outputs of the last batch run with ``keep_outputs``."""
        return self.loss_keeper.outputs

    def bind(self, program: Program, programs: Sequence[Program] = ()) -> Bound:
        """``program`` bound to this runtime (:class:`Bound`): its transfers' channels and
        groups, and where its sends are waited (from ``programs``, every stage's; ``()``:
        at the step's end)."""
        return Bound(*self.transfers.bind(program, programs))

    def enter(self, index: int) -> None:
        """The kernel is about to run ``plan.stream[index]``: post every group due there.
        (The kernel calls it before each instruction, whoever handles it.)"""
        self._at = index
        group = self._bound.groups[index]
        if group:
            self.transfers.post(group)
        if self.offload is not None:
            self.offload.enter(index)

    def end(self) -> BatchLosses:
        """Finish the batch (wait for the sends still in flight); its losses."""
        self.transfers.flush()
        if self.offload is not None:
            self.offload.end()
        return self.loss_keeper.record

    def inputs_of(self, instruction: isa.MicroBatchInstruction) -> Any:
        """The inputs the buffer of ``instruction``'s micro-batch holds now (``None``: none
        yet, or another micro-batch's slot), for observers such as the monitor."""
        buffer = self.buffers[instruction.buffer]
        if buffer.micro_batch != instruction.micro_batch or buffer.chunk != instruction.chunk:
            return None
        return buffer.inputs

    def payload_bytes(self) -> dict[str, int]:
        """Tensor bytes this stage sent to its peers so far, by dtype name."""
        return self.transfers.payload_bytes()

    def flush(self) -> None:
        """Wait for every send still in flight."""
        self.transfers.flush()

    def held_tensors(self) -> list[Any]:
        """What the runtime holds now, for memory accounting (stage/memory.py): every
        buffer's fields (inputs, outputs held until sent, gradients, skip stashes, the
        weight-pass state), send buffers whose transfer has not completed, posted
        receives, hand-offs within the stage, and labels waiting for their loss."""
        held: list[Any] = [b for b in self.buffers if b is not _EMPTY]
        for prefix in self._prefixes.values():
            held += prefix.tensors()
        return held + self.transfers.held() + self.loss_keeper.held()

    def abandon(self) -> None:
        """Forget every transfer in flight after a failure (nothing waits on them any
        more; the process group is destroyed by the transport's ``close()``)."""
        self.transfers.abandon()
        self._prefixes = {}
        if self.offload is not None:
            self.offload.end()

    def handlers(self) -> dict[type, Callable[[Any], Any]]:
        table: dict[type, Callable[[Any], Any]] = {
            isa.LoadMicroBatch: self.load_micro_batch, isa.Forward: self.forward,
            isa.Backward: self.backward, isa.BackwardInput: self.backward_input,
            isa.BackwardWeight: self.backward_weight, isa.SendActivation: self.send_activation,
            isa.RecvActivation: self.recv_activation, isa.SendGrad: self.send_grad,
            isa.RecvGrad: self.recv_grad, isa.SendSkip: self.send_skip,
            isa.RecvSkip: self.recv_skip, isa.SendSkipGrad: self.send_skip,
            isa.RecvSkipGrad: self.recv_skip, isa.ForwardBackward: self.forward_backward,
        }
        return table

    @property
    def pairs(self) -> bool:
        """Whether this stage runs a schedule's ``ForwardBackward`` as one instruction (a
        model-supplied ``overlapped_forward_backward``); without, the engine splits each
        pair back into its two steps (:func:`pipekernel.schedules.ordered.unpair`)."""
        return self._paired.fn is not None

    def forward_backward(self, instruction: isa.ForwardBackward) -> None:
        """A paired forward and backward, run by the stage's paired executor."""
        self._paired.run(instruction)

    # -- what travels (Transfers' callbacks) --------------------------------------------
    def _payload(self, instruction: isa.MicroBatchInstruction) -> Any:
        """What the posted send ``instruction`` carries."""
        buffer = self._slot(instruction)
        if isinstance(instruction, isa.SkipInstruction):
            return self._skips.payload(instruction, buffer.skips)  # type: ignore[union-attr]
        activation = isinstance(instruction, isa.SendActivation)
        obj = buffer.outputs if activation else buffer.input_grads
        if self.transfer_sums is not None:  # a checked step: hashed as the model made it
            self.transfer_sums.add(instruction, self.positions[instruction.chunk], obj)
        if activation and self.loss_keeper.check_data:
            flatten(obj, "outputs")  # names the path without the wrapper
            return obj, self.loss_keeper.fingerprint(instruction.micro_batch,
                                                     self.transport.device)
        return obj

    def _arrived(self, instruction: isa.MicroBatchInstruction, obj: Any) -> Any:
        """What a received ``obj`` stands for: under ``check_data`` an activation's
        fingerprint taken off; hashed on a checked step."""
        if self.loss_keeper.check_data and isinstance(instruction, isa.RecvActivation):
            obj, fp = obj
            self.loss_keeper.received(instruction.micro_batch, fp)
        if self.transfer_sums is not None:
            self.transfer_sums.add(instruction, self.positions[instruction.chunk], obj)
        return obj

    def _slot(self, instruction: isa.MicroBatchInstruction) -> Buffer:
        buffer = self.buffers[instruction.buffer]
        if buffer.micro_batch != instruction.micro_batch or buffer.chunk != instruction.chunk:
            raise PipelineError(
                f"buffer {instruction.buffer} holds micro-batch {buffer.micro_batch} chunk "
                f"{buffer.chunk}, not micro-batch {instruction.micro_batch} chunk "
                f"{instruction.chunk}",
                hint="the schedule uses a buffer before filling it; check it with "
                     "pipekernel.schedules.simulate")
        return buffer

    def _fill(self, instruction: isa.MicroBatchInstruction) -> Buffer:
        buffer = self.buffers[instruction.buffer]
        if buffer.micro_batch != instruction.micro_batch or buffer.chunk != instruction.chunk:
            buffer = self.buffers[instruction.buffer] = Buffer(instruction.micro_batch,
                                                               instruction.chunk)
        return buffer

    # -- handlers ----------------------------------------------------------
    def load_micro_batch(self, instruction: isa.LoadMicroBatch) -> None:
        try:
            item = next(self.data_iter)  # type: ignore[arg-type]
        except StopIteration:
            count = self._units // self.seq_chunks  # units are chunks (seq_chunks)
            raise DataError(
                f"the data iterator ran out at micro-batch "
                f"{instruction.micro_batch // self.seq_chunks} of {count}",
                hint=f"give each train_batch/eval_batch an iterator with at least "
                     f"{count} micro-batches (e.g. itertools.cycle(loader))") from None
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
        buffer = self._fill(instruction)
        first = self.is_first and instruction.chunk == self.first_chunk
        if first:
            flatten(inputs, "inputs")
            buffer.inputs = _to(inputs, device)
        if labels is not None and (self.is_last or first and self.loss_keeper.check_data):
            self.loss_keeper.read(instruction.micro_batch, labels, device, first,
                                  self.is_last)

    def forward(self, instruction: isa.Forward) -> None:
        buffer = self.forward_inputs(instruction)
        chunk = instruction.chunk
        aux: list[torch.Tensor] = []
        token = AUX_COLLECTOR.set(aux)  # what aux_loss.collecting() does, without its calls
        try:
            if self.offload is not None:
                with self.offload.packing((instruction.micro_batch, chunk)), \
                        self._sequence_scope(instruction):
                    outputs = self._forward_part(buffer, chunk, instruction.micro_batch)
            elif self.seq_chunks == 1:  # no sequence chunk: no scope to open
                outputs = self._forward_part(buffer, chunk, instruction.micro_batch)
            else:
                with self._sequence_scope(instruction):
                    outputs = self._forward_part(buffer, chunk, instruction.micro_batch)
        finally:
            AUX_COLLECTOR.reset(token)
        self.forward_done(instruction, buffer, outputs, aux)
        if self.offload is not None:  # what the runtime holds stays on the device
            self.offload.after_forward((instruction.micro_batch, chunk), self.held_tensors())

    def _forward_part(self, buffer: Buffer, chunk: int, micro_batch: int) -> Any:
        if self._skips is None:
            return self.run_part(chunk, buffer.inputs)
        return self._forward_with_skips(self._skips, buffer, chunk, micro_batch)

    def forward_inputs(self, instruction: isa.Forward) -> Buffer:
        """The buffer of ``instruction``, its inputs there (the paired executor's part)."""
        buffer = self._slot(instruction)
        if buffer.inputs is None:
            raise PipelineError("forward before the inputs arrived",
                                hint="the schedule must load or receive before Forward")
        return buffer

    def run_part(self, chunk: int, inputs: Any) -> Any:
        """``chunk``'s layers on ``inputs`` through the precision policy, its expert
        all-to-alls on the chunk's lane (:func:`pipekernel.grid.expert_parallel.lane`)."""
        # the chunk's lane, as expert_parallel.lane(chunk) without a context manager's
        # calls; one chunk: lane 0, the default, nothing to set
        token = expert_parallel.LANE.set(chunk) if self.chunks > 1 else None
        try:
            return self.precision.forward(self.parts[chunk], inputs,
                                          first=chunk == self.first_chunk,
                                          last=chunk == self.last_chunk)
        finally:
            if token is not None:
                expert_parallel.LANE.reset(token)

    def part_parameters(self, chunk: int) -> list[torch.Tensor]:
        """``chunk``'s parameters (the paired executor's ``module1.parameters()``)."""
        return list(self._part_params[chunk])

    def criterion(self, instruction: isa.Forward) -> tuple[Callable | None, Any]:
        """``(criterion0, labels0)`` of a paired forward half (see
        :meth:`~pipekernel.stage.loss.LossKeeper.criterion`); ``(None, None)`` off the
        last position."""
        if instruction.chunk != self.last_chunk:
            return None, None
        return self.loss_keeper.criterion(instruction.micro_batch)

    def forward_done(self, instruction: isa.Forward, buffer: Buffer, outputs: Any,
                     aux: list[torch.Tensor], loss: Any = None) -> None:
        """What follows a forward: its aux losses kept, on the last position its loss
        computed (or ``loss``, when a paired executor computed it) and reported."""
        buffer.outputs = outputs
        last = instruction.chunk == self.last_chunk
        if aux:
            self.loss_keeper.aux(buffer, aux, instruction.micro_batch, instruction.chunk,
                                 last, self._units)
        if last:
            self.loss_keeper.finish(instruction.micro_batch, buffer, loss)

    def _sequence_scope(self, instruction: isa.MicroBatchInstruction) -> Any:
        """The scope of the forward's sequence chunk (nothing without ``seq_chunks``)."""
        if self.seq_chunks == 1:
            return contextlib.nullcontext()
        micro_batch, index = divmod(instruction.micro_batch, self.seq_chunks)
        prefix = self._prefixes.setdefault(micro_batch, KVPrefix())
        return chunk_scope(SequenceChunk(index, self.seq_chunks, prefix), self.stage,
                           instruction.micro_batch)

    def _prefix_roots(self, instruction: isa.Backward) -> tuple[list, list]:
        """The keys and values of the chunk being backwarded, with the gradients the
        later chunks gave them (``([], [])`` without ``seq_chunks``)."""
        if self.seq_chunks == 1:
            return [], []
        micro_batch, index = divmod(instruction.micro_batch, self.seq_chunks)
        prefix = self._prefixes.get(micro_batch)
        return prefix.roots(index) if prefix is not None else ([], [])

    def _release_prefix(self, instruction: isa.Backward) -> None:
        """The chunk's entries dropped after its backward, the micro-batch's after
        chunk 0's (its last)."""
        if self.seq_chunks == 1:
            return
        micro_batch, index = divmod(instruction.micro_batch, self.seq_chunks)
        prefix = self._prefixes.get(micro_batch)
        if prefix is not None:
            prefix.release(index)
            if index == 0:
                del self._prefixes[micro_batch]

    def _forward_with_skips(self, router: SkipRouter, buffer: Buffer, chunk: int,
                            micro_batch: int) -> Any:
        """The forward inside the skip scope: pops find what ``RecvSkip`` brought, and
        what the layers stash for later parts is kept for ``SendSkip``."""
        if buffer.skips is None:
            buffer.skips = SkipState()
        with router.scope(buffer.skips, micro_batch) as scope:
            outputs = self.run_part(chunk, buffer.inputs)
        router.after_forward(scope, buffer.skips, chunk, torch.is_grad_enabled())
        return outputs

    def backward(self, instruction: isa.Backward) -> None:
        buffer = self.backward_begin(instruction)
        loss, outputs, grads = self.backward_roots(instruction, buffer)
        if loss is not None:
            outputs, grads = [loss], [None]
        keys, key_grads = self._prefix_roots(instruction) if self.seq_chunks > 1 else ([], [])
        token = expert_parallel.LANE.set(instruction.chunk) if self.chunks > 1 else None
        try:  # the chunk's lane, as in run_part
            if outputs or keys:
                torch.autograd.backward([*outputs, *keys], [*grads, *key_grads])
        finally:
            if token is not None:
                expert_parallel.LANE.reset(token)
        if self.seq_chunks > 1:
            self._release_prefix(instruction)
        self.backward_done(instruction, buffer)

    def backward_begin(self, instruction: isa.Backward) -> Buffer:
        """The buffer of ``instruction`` (the paired executor's part)."""
        return self._slot(instruction)

    def backward_roots(self, instruction: isa.Backward,
                       buffer: Buffer) -> tuple[torch.Tensor | None, list, list]:
        """What the backward starts from: ``(scaled loss, [], [])`` at the last position,
        else ``(None, outputs, their gradients)``."""
        if instruction.chunk == self.last_chunk:
            loss = buffer.loss if buffer.loss is not None else self._no_loss(buffer)
            return self.precision.scale_loss(loss / self._units), [], []
        outputs, grads = self._roots(buffer)
        return None, outputs, grads

    def backward_done(self, instruction: isa.Backward, buffer: Buffer) -> None:
        """What follows a backward: the precision's hook, the inputs' gradients kept."""
        chunk = instruction.chunk
        self.precision.after_backward(self.module)
        if chunk != self.first_chunk:
            inputs = _grad_tensors(buffer.inputs)
            buffer.input_grads = tuple(t.grad if t.grad is not None else torch.zeros_like(t)
                                       for t in inputs)
        if self._skips is not None:
            self._skips.set_grads(buffer.skips, self._skips.leaves(buffer.skips))
        buffer.outputs = buffer.loss = buffer.output_grads = buffer.aux = None

    def _roots(self, buffer: Buffer) -> tuple[list[torch.Tensor], list[Any]]:
        """What a backward not at the last position starts from: the outputs and the
        stashed skip tensors that require grad, with their received gradients."""
        outputs, grads = _grad_tensors(buffer.outputs), list(buffer.output_grads)
        if self._skips is not None:
            stashed, theirs = self._skips.roots(buffer.skips)
            outputs, grads = outputs + stashed, grads + theirs
        return outputs, grads

    def backward_input(self, instruction: isa.BackwardInput) -> None:
        from pipekernel.stage.split_backward import backward_input

        buffer = self._slot(instruction)
        chunk = instruction.chunk
        inputs = _grad_tensors(buffer.inputs) if chunk != self.first_chunk else []
        count = len(inputs)
        leaves = self._skips.leaves(buffer.skips) if self._skips is not None else []
        for _, tensors in leaves:
            inputs += tensors
        if chunk == self.last_chunk:
            loss = self.precision.scale_loss(
                (buffer.loss if buffer.loss is not None else self._no_loss(buffer)) / self._units)
            grads, buffer.split = backward_input([], [], inputs, self._weights(chunk),
                                                 loss=loss)
        else:
            outputs, output_grads = self._roots(buffer)
            grads, buffer.split = backward_input(outputs, output_grads, inputs,
                                                 self._weights(chunk))
        if leaves and self._skips is not None:
            self._skips.set_grads(buffer.skips, leaves, grads[count:])
        if chunk != self.first_chunk:
            buffer.input_grads = tuple(grads[:count])
        buffer.outputs = buffer.loss = buffer.output_grads = buffer.aux = None

    def _weights(self, chunk: int) -> list[torch.Tensor]:
        """The parameters of ``chunk`` as the autograd graph holds them."""
        params = self._part_params[chunk]
        return params if self._params_of is None else self._params_of(params)

    def backward_weight(self, instruction: isa.BackwardWeight) -> None:
        from pipekernel.stage.split_backward import backward_weight

        buffer = self._slot(instruction)
        if buffer.split is None:
            raise PipelineError(f"{instruction} before its BackwardInput",
                                hint="a schedule runs BackwardInput before BackwardWeight")
        backward_weight(buffer.split)
        buffer.split = None
        self.precision.after_backward(self.module)

    def send_activation(self, instruction: isa.SendActivation) -> None:
        buffer = self._slot(instruction)
        self.transfers.send(self._at, buffer.outputs)
        if not torch.is_grad_enabled():
            buffer.outputs = None  # inference: nothing else needs it

    def recv_activation(self, instruction: isa.RecvActivation) -> None:
        obj = self.transfers.receive(self._at, instruction)
        self._fill(instruction).inputs = obj

    def send_grad(self, instruction: isa.SendGrad) -> None:
        buffer = self._slot(instruction)
        self.transfers.send(self._at, buffer.input_grads)
        buffer.inputs = buffer.input_grads = None

    def recv_grad(self, instruction: isa.RecvGrad) -> None:
        obj = self.transfers.receive(self._at, instruction)
        self._slot(instruction).output_grads = obj
        self.transfers.settle((instruction.micro_batch, instruction.chunk))

    def send_skip(self, instruction: isa.SkipInstruction) -> None:
        """``SendSkip`` / ``SendSkipGrad``: what the forward stashed for a later part, or
        the gradients of what an earlier part sent (:mod:`pipekernel.model.skip_routing`)."""
        state, router = self._slot(instruction).skips, self._router(instruction)
        if state is None:
            raise PipelineError(f"{instruction} before the forward that stashes its values "
                                f"(stage {self.stage})",
                                hint="check the schedule with pipekernel.schedules.simulate")
        self.transfers.send(self._at, router.payload(instruction, state))
        router.sent(instruction, state, torch.is_grad_enabled())

    def recv_skip(self, instruction: isa.SkipInstruction) -> None:
        """``RecvSkip`` / ``RecvSkipGrad``: keep what arrived for the forward or backward."""
        obj = self.transfers.receive(self._at, instruction)
        buffer = self._fill(instruction)
        if buffer.skips is None:
            buffer.skips = SkipState()
        self._router(instruction).deliver(instruction, buffer.skips, obj)

    def _router(self, instruction: isa.SkipInstruction) -> SkipRouter:
        """The skip router a skip ``instruction`` needs (error: the stage has none)."""
        if self._skips is None:
            raise PipelineError(f"{instruction} on stage {self.stage}, which routes no skip "
                                "connections", hint="build the program from this model's "
                                "skip layout (pipekernel.model.skips)")
        return self._skips

    def _no_loss(self, buffer: Buffer) -> NoReturn:
        """A backward at the last part before its loss: the error (a call only then)."""
        raise PipelineError(f"backward of micro-batch {buffer.micro_batch} on stage "
                            f"{self.stage} before its loss was computed",
                            hint="check the schedule with pipekernel.schedules.simulate")


_EMPTY = Buffer()  # an unfilled slot: matches no micro-batch, never written to
