"""The stage runtime (layer 2): buffers and the handlers of the core instructions.

Talks to peers only through a :class:`~pipekernel.comm.transport.Transport`; knows
nothing of schedules — it executes whatever instructions the kernel hands it,
and posts communication by the :class:`~pipekernel.schedules.program.Program` the engine
gives it (read, never changed or cached here; :meth:`StageRuntime.bind` makes the runtime's
binding of it once): each posting point's sends and receives go out as one group
(``batch_isend_irecv``), receives ahead of the compute that needs them, and a
receive is waited on only at its own instruction. Sends never block compute:
their handles are kept until the batch ends. Skip connections between parts are
transfers like the others; what they carry and where it goes is
:mod:`pipekernel.model.skip_routing`'s business.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

from pipekernel.schedules import instructions as isa
from pipekernel.stage.device import to_device
from pipekernel.errors import ConfigError, DataError, PipelineError
from pipekernel.model.aux_loss import attach as attach_aux
from pipekernel.model.aux_loss import collecting as collect_aux
from pipekernel.stage.loss import TokenLoss
from pipekernel.stage.fingerprint import fingerprint
from pipekernel.schedules.program import Program
from pipekernel.schedules.placement import position
from pipekernel.model.skip_routing import SkipRouter, SkipState
from pipekernel.grid.topology import Topology
from pipekernel.step.optimizer_step import BatchLosses
from pipekernel.comm.wire import Channel, flatten
from pipekernel.nested import describe, map_tensors
from pipekernel.grid import expert_parallel
from pipekernel.stage.paired import PairedExecutor

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


#: How a send names what it carries in errors (the kernel adds stage and micro-batch).
_WHAT = {isa.SendActivation: "outputs", isa.SendGrad: "input gradients",
         isa.SendSkip: "stashed skip values", isa.SendSkipGrad: "skip gradients"}


class Bound(NamedTuple):
    """A program bound to one runtime (:meth:`StageRuntime.bind`): per stream index the
    channel of a remote transfer (``channels``) and the group posted there (``groups``, as
    ``(index, is_send, channel, what)``); the parameters whose gradients are final before
    the program's last weight-gradient instruction (``settled``)."""

    channels: tuple[Channel | None, ...]
    groups: tuple[tuple[tuple, ...], ...]
    settled: tuple = ()


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
    :param before_last_backward: ``before_last_backward(settled)`` is called right before
        the last instruction of the batch that produces weight gradients on this stage (to
        start reductions), with the program's ``settled`` parameters.
    :param after_last_backward: called right after that instruction and the
        precision's ``after_backward`` (gradients are final there, fp32 masters included).
    :param wire: an object with ``split(obj)`` (what is sent for ``obj``) and
        ``join(obj)`` (what a received object stands for), e.g. the partitioned
        activations of :mod:`pipekernel.grid.partitioned`; ``None``: objects travel as they are.
        Skip connections travel as they are.
    :param skips: the :class:`~pipekernel.model.skip_routing.SkipRouter` of a model with skip
        connections between parts (``None``: none).
    :param params_of: ``params -> the tensors autograd holds for them`` at a split
        backward (FSDP2's unsharded parameters: :mod:`pipekernel.grid.stage_parallel`);
        ``None``: the parameters themselves.
    """

    def __init__(self, module: torch.nn.Module, topology: Topology, transport: Any,
                 loss_fn: Callable | None, precision: Any, *, chunks: int = 1,
                 placement: str = "loop",
                 before_last_backward: Callable[[tuple], None] | None = None,
                 after_last_backward: Callable[[], None] | None = None,
                 wire: Any = None, skips: SkipRouter | None = None,
                 params_of: Callable[[list], list] | None = None,
                 losses: BatchLosses | None = None, tokens: bool = False) -> None:
        self.module, self.topology, self.transport = module, topology, transport
        self.tokens = tokens and loss_fn is not None
        self.loss_fn = TokenLoss(loss_fn) if self.tokens else loss_fn  # type: ignore[arg-type]
        self.precision = precision
        self.stage, self.chunks, self.placement = topology.stage, chunks, placement
        num_stages = topology.pipe_size
        self.positions = [position(self.stage, c, num_stages, placement) for c in range(chunks)]
        last = num_stages * chunks - 1
        self.first_chunk = self.positions.index(0) if 0 in self.positions else None
        self.last_chunk = self.positions.index(last) if last in self.positions else None
        self.is_first, self.is_last = self.first_chunk is not None, self.last_chunk is not None
        self.parts = [module.part(c) if hasattr(module, "part") else module
                      for c in range(chunks)]
        self._part_params = [list(part.parameters()) for part in self.parts]
        self._params_of = params_of
        self._before_last_backward = before_last_backward
        self._after_last_backward = after_last_backward
        self._split = wire.split if wire is not None else _same
        self._join = wire.join if wire is not None else _same
        self._skips = skips
        self._channels: dict[tuple[type, int, int | None], Channel] = {}
        self.buffers: list[Buffer] = []
        self.labels: dict[int, Any] = {}
        self.data_iter: Iterator | None = None
        self.micro_batches = 1
        self.compute_loss = True
        self.keep_outputs = False
        #: the batch's losses: the batch step's (it clears them), filled here
        self.losses = losses if losses is not None else BatchLosses()
        self._counts: dict[int, torch.Tensor] = {}  # micro-batch -> its tokens, till recorded
        self.outputs: list[Any] = []
        self.check_data = False
        self._fingerprints: dict[int, torch.Tensor] = {}  # micro-batch -> labels' fingerprint
        self._program: Program | None = None  # the batch's (the engine's, read only)
        self._bound: Bound | None = None  # its binding here (bind())
        self._at = -1             # stream index of the instruction running now (enter())
        self._recvs: dict[int, Any] = {}   # stream index -> PendingRecv
        self._sends: list[tuple] = []      # (handle, tensor, what) of sends in flight
        self._local: dict[tuple, Any] = {}  # hand-offs to this stage
        self._paired = PairedExecutor(self, getattr(module, "overlapped_forward_backward", None))

    # -- batch lifecycle ---------------------------------------------------
    def begin(self, data_iter: Iterator | None, micro_batches: int, program: Program,
              bound: Bound, *, compute_loss: bool = True, keep_outputs: bool = False,
              check_data: bool = False) -> None:
        """Start a batch that runs ``program.stream`` (compiled by the engine once per
        schedule and count; ``bound``: its :meth:`bind` here, made as often).

        With ``check_data``, each activation carries the fingerprint of the labels the
        first stage read with its inputs, and the last stage compares it with its own
        (see :func:`pipekernel.stage.fingerprint.fingerprint`); every rank of a pipeline must pass
        the same value. The losses computed go into :attr:`losses` (the
        :class:`~pipekernel.step.optimizer_step.BatchLosses` given at construction, which
        the batch step clears at the start of each batch), which :meth:`end` returns.
        """
        self.flush()
        self.check_data, self._fingerprints = check_data, {}
        self.data_iter, self.micro_batches = data_iter, micro_batches
        self.compute_loss, self.keep_outputs = compute_loss, keep_outputs
        self.buffers = [_EMPTY] * program.num_buffers  # _fill replaces an empty slot on first use
        self.outputs, self.labels = [], {}
        self._program, self._bound, self._at, self._recvs, self._local = program, bound, -1, \
            {}, {}
        self._counts = {}

    def bind(self, program: Program, settled: tuple = ()) -> Bound:
        """``program`` bound to this runtime (:class:`Bound`): its channels (one per channel
        key, made on first use and shared by every program of this stage) by stream index,
        and its groups with them."""
        mine = [self._channel(spec) for spec in program.channels]
        channels = tuple(None if number is None else mine[number]
                         for number in program.channel_of)
        groups = tuple(tuple((index, program.channels[program.channel_of[index]].send,
                              channels[index], _WHAT.get(type(program.stream[index]), "value"))
                             for index in group) for group in program.posts)
        return Bound(channels, groups, settled)

    def enter(self, index: int) -> None:
        """The kernel is about to run ``plan.stream[index]``: post every group due there.
        (The kernel calls it before each instruction, whoever handles it.)"""
        self._at = index
        group = self._bound.groups[index]
        if group:
            self._post_group(group)

    def end(self) -> BatchLosses:
        """Finish the batch (wait for the sends still in flight); its losses."""
        self.flush()
        return self.losses

    def inputs_of(self, instruction: isa.MicroBatchInstruction) -> Any:
        """The inputs the buffer of ``instruction``'s micro-batch holds now (``None``: none
        yet, or another micro-batch's slot), for observers such as the monitor."""
        buffer = self.buffers[instruction.buffer]
        if buffer.micro_batch != instruction.micro_batch or buffer.chunk != instruction.chunk:
            return None
        return buffer.inputs

    def payload_bytes(self) -> dict[str, int]:
        """Tensor bytes this stage sent to its peers so far, by dtype name."""
        total: dict[str, int] = {}
        for channel in self._channels.values():
            for name, count in channel.payload.items():
                total[name] = total.get(name, 0) + count
        return total

    def flush(self) -> None:
        """Wait for every send still in flight."""
        sends, self._sends = self._sends, []
        for handle, _, _ in sends:
            handle.wait()

    def _prune_sends(self) -> None:
        """Drop the sends that completed (``wait()`` re-raises a failed one), so a send
        buffer lives exactly as long as its transfer: a query, no device sync."""
        if any(handle.is_completed() for handle, _, _ in self._sends):
            for handle, _, _ in self._sends:
                if handle.is_completed():
                    handle.wait()
            self._sends = [s for s in self._sends if not s[0].is_completed()]

    def _settle_sends(self, what: tuple) -> None:
        """Wait for the sends of ``what`` (``(micro-batch, chunk)`` of an activation whose
        gradient just arrived): the peer computed that gradient from them, so they were
        received and ``wait`` returns at once. A gloo send reports ``is_completed()`` only
        after ``wait()``, so without this every activation sent stayed in memory until the
        step's end (under 1F1B, a stage's memory grew with the micro-batch count)."""
        if any(s[2] == what for s in self._sends):
            for handle, _, key in self._sends:
                if key == what:
                    handle.wait()
            self._sends = [s for s in self._sends if s[2] != what]

    def held_tensors(self) -> list[Any]:
        """What the runtime holds now, for memory accounting (stage/memory.py): every
        buffer's fields (inputs, outputs held until sent, gradients, skip stashes, the
        weight-pass state), posted receives, send buffers whose transfer has not
        completed, and hand-offs within the stage."""
        self._prune_sends()
        held: list[Any] = [b for b in self.buffers if b is not _EMPTY]
        held += [t for _, t, _ in self._sends]
        held += list(self._recvs.values())
        held += list(self._local.values())
        held += list(self.labels.values())
        return held

    def abandon(self) -> None:
        """Forget every transfer in flight after a failure (nothing waits on them any
        more; the process group is destroyed by the transport's ``close()``)."""
        self._sends, self._recvs, self._local = [], {}, {}

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

    # -- posting by the plan -------------------------------------------------
    def _channel(self, spec: Any) -> Channel:
        """The channel of ``spec`` (a :class:`~pipekernel.schedules.program.ChannelSpec`),
        made on first use."""
        channel = self._channels.get(spec.key)
        if channel is None:
            channel = Channel(self.transport, self.topology.stage_rank(spec.peer_stage),
                              tag=spec.lane)
            self._channels[spec.key] = channel
        return channel

    def _post_group(self, group: Sequence[tuple]) -> None:
        """Post one group: every op of ``group`` on the data lane in one call (and the
        headers on the control lane, when the transport has one, just before)."""
        data: list[Any] = []
        control: list[Any] = []
        spans = []
        stream = self._program.stream
        for index, is_send, channel, what in group:
            if is_send:
                pending = None
                ops, ctrl = channel.send_ops(self._payload(stream[index]), what)
            else:
                pending = channel.recv_ops()
                self._recvs[index] = pending
                ops, ctrl = pending.ops, pending.control_ops
            spans.append((pending, index, len(data), len(ops), len(control), len(ctrl)))
            data += ops
            control += ctrl
        control_handles = self.transport.control.batch_isend_irecv(control) if control else []
        handles = self.transport.batch_isend_irecv(data) if data else []
        self._prune_sends()
        for pending, index, d0, dn, c0, cn in spans:
            if pending is None:
                ins = stream[index]
                carried = (ins.micro_batch, ins.chunk) \
                    if isinstance(ins, isa.SendActivation) else None
                self._sends += [(h, op.tensor, carried) for h, op in
                                zip(handles[d0:d0 + dn], data[d0:d0 + dn])]
                self._sends += [(h, op.tensor, carried) for h, op in
                                zip(control_handles[c0:c0 + cn], control[c0:c0 + cn])]
            else:
                pending.handles = handles[d0:d0 + dn]
                pending.control_handles = control_handles[c0:c0 + cn]

    def _payload(self, instruction: isa.Instruction) -> Any:
        buffer = self._slot(instruction)
        if isinstance(instruction, isa.SkipInstruction):
            return self._skips.payload(instruction, buffer.skips)
        if isinstance(instruction, isa.SendActivation):
            if self.check_data:
                flatten(buffer.outputs, "outputs")  # names the path without the wrapper
                return self._split((buffer.outputs, self._fingerprint(instruction.micro_batch)))
            return self._split(buffer.outputs)
        return self._split(buffer.input_grads)

    def _fingerprint(self, micro_batch: int) -> torch.Tensor:
        fp = self._fingerprints.get(micro_batch)
        if fp is None:
            fp = torch.zeros(2, dtype=torch.int64, device=self.transport.device)
        return fp

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

    def _receive(self, instruction: isa.MicroBatchInstruction) -> Any:
        index = self._at
        if self._program.local[index]:
            if index not in self._local:
                raise PipelineError(f"{instruction} on stage {self.stage} comes before the "
                                    "matching send on this stage",
                                    hint="check the schedule with pipekernel.schedules.simulate")
            return self._local.pop(index)
        pending = self._recvs.pop(index)
        obj = self._join(self._bound.channels[index].finish(pending))
        if self.check_data and isinstance(instruction, isa.RecvActivation):
            obj, self._fingerprints[instruction.micro_batch] = obj
        return obj

    def _send(self, instruction: isa.MicroBatchInstruction, obj: Any) -> None:
        program = self._program
        if program.local[self._at]:
            fills = program.handoffs[self._at]  # the receive it fills
            if fills is not None:
                self._local[fills] = _detach_like(obj)

    # -- handlers ----------------------------------------------------------
    def load_micro_batch(self, instruction: isa.LoadMicroBatch) -> None:
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
        buffer = self._fill(instruction)
        if self.is_first and instruction.chunk == self.first_chunk:
            flatten(inputs, "inputs")
            buffer.inputs = _to(inputs, device)
            if self.check_data:
                self._fingerprints[instruction.micro_batch] = \
                    fingerprint(labels).to(device, non_blocking=True)
        if self.is_last and labels is not None:
            flatten(labels, "labels")
            self.labels[instruction.micro_batch] = _to(labels, device)

    def forward(self, instruction: isa.Forward) -> None:
        buffer = self.forward_inputs(instruction)
        chunk = instruction.chunk
        with collect_aux() as aux:
            if self._skips is None:
                outputs = self.run_part(chunk, buffer.inputs)
            else:
                outputs = self._forward_with_skips(buffer, chunk, instruction.micro_batch)
        self.forward_done(instruction, buffer, outputs, aux)

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
        with expert_parallel.lane(chunk):
            return self.precision.forward(self.parts[chunk], inputs,
                                          first=chunk == self.first_chunk,
                                          last=chunk == self.last_chunk)

    def forward_done(self, instruction: isa.Forward, buffer: Buffer, outputs: Any,
                     aux: list[torch.Tensor], loss: Any = None) -> None:
        """What follows a forward: its aux losses kept, on the last position its loss
        computed (or ``loss``, when a paired executor computed it) and reported."""
        buffer.outputs = outputs
        last = instruction.chunk == self.last_chunk
        if aux:
            self._keep_aux(buffer, aux, instruction, last)
        if last:
            if self.keep_outputs:
                self.outputs.append(buffer.outputs)
            labels = self.labels.get(instruction.micro_batch)
            if self.compute_loss:  # first: labels of the wrong structure fail in loss_fn
                buffer.loss, tokens = self._loss(buffer, instruction.micro_batch, loss)
                self.losses.add(buffer.loss.detach(), instruction.micro_batch, tokens)
                if buffer.aux is not None:  # the objective backwarded here
                    buffer.loss = buffer.loss + buffer.aux.to(buffer.loss.dtype)
            if self.check_data:
                self._check_labels(instruction.micro_batch, labels)

    def _keep_aux(self, buffer: Buffer, aux: list[torch.Tensor],
                  instruction: isa.Forward, last: bool) -> None:
        """The aux losses a chunk's forward added (:mod:`pipekernel.model.aux_loss`):
        reported with the batch's losses, and their gradient made part of this stage's
        backward — added to the loss on the chunk computing it, else attached to the
        chunk's output. Nothing of it travels to another stage."""
        if self.tokens:
            raise ConfigError(
                f"an auxiliary loss (pk.add_aux_loss) with loss_reduction='tokens' on stage "
                f"{self.stage}, micro-batch {instruction.micro_batch}: the token mean "
                f"rescales every gradient after the backward, aux losses included",
                hint="use loss_reduction='mean' with auxiliary losses")
        total = torch.stack([a.float() for a in aux]).sum()  # float32, as the losses
        self.losses.add_aux(total.detach(), instruction.micro_batch)
        if not (torch.is_grad_enabled() and total.requires_grad):
            return  # evaluation, or a constant: reported only
        if last:
            buffer.aux = total
            return
        seed = self.precision.scale_loss(
            torch.ones((), dtype=torch.float32, device=total.device) / self.micro_batches)
        attached = attach_aux(buffer.outputs, total, seed.detach())
        if attached is None:
            raise PipelineError(
                f"stage {self.stage} chunk {instruction.chunk} added an auxiliary loss but "
                f"none of its outputs requires grad, so its backward never runs",
                hint="pk.add_aux_loss needs the chunk's output to depend on trained tensors")
        buffer.outputs = attached

    def _forward_with_skips(self, buffer: Buffer, chunk: int, micro_batch: int) -> Any:
        """The forward inside the skip scope: pops find what ``RecvSkip`` brought, and
        what the layers stash for later parts is kept for ``SendSkip``."""
        if buffer.skips is None:
            buffer.skips = SkipState()
        with self._skips.scope(buffer.skips, micro_batch) as scope:
            outputs = self.run_part(chunk, buffer.inputs)
        self._skips.after_forward(scope, buffer.skips, chunk, torch.is_grad_enabled())
        return outputs

    def _check_labels(self, micro_batch: int, labels: Any) -> None:
        """Last stage, check steps: the labels read here are those the first stage read
        with this micro-batch's inputs (one host synchronisation per micro-batch)."""
        theirs = self._fingerprints.pop(micro_batch, None)
        if theirs is None or labels is None:
            return
        theirs = theirs.cpu()
        if not int(theirs[0]):
            return  # the first stage read no labels (None): nothing to compare
        if not torch.equal(theirs, fingerprint(labels).cpu()):
            raise DataError(
                f"micro-batch {micro_batch}: the labels the last stage read are not the ones "
                f"the first stage read with that micro-batch's inputs (their fingerprints "
                f"differ): the data iterators of the first and the last stage do not yield "
                f"the same micro-batches in the same order",
                hint="give both stages the same data in the same order (e.g. the same "
                     "sampler seed, or shuffle=False); pass check_data_steps=0 to the engine "
                     "to turn this check off")

    def _loss(self, buffer: Buffer, micro_batch: int, given: Any = None
              ) -> tuple[torch.Tensor, Any]:
        """The micro-batch's loss (``given``: the paired executor's ``loss0``) and, under
        ``loss_reduction="tokens"``, its token count (0-dim float64; else ``None``)."""
        labels = self.labels.pop(micro_batch, None)
        if given is not None:
            given = self._scalar(given, "overlapped_forward_backward's loss0")
        else:
            given = self.loss_of(buffer.outputs, labels, micro_batch)
        return given, self._counts.pop(micro_batch, None)

    def loss_of(self, outputs: Any, labels: Any, micro_batch: int) -> torch.Tensor:
        """``loss_fn(outputs, labels)``, checked: a 0-dim tensor, failures named. Under
        ``loss_reduction="tokens"`` the loss sum; its count waits for the micro-batch's
        record in :attr:`losses`."""
        try:
            loss = self.loss_fn(outputs, labels)  # type: ignore[misc]
        except Exception as err:
            raise DataError(
                f"loss_fn(outputs, labels) failed for micro-batch {micro_batch}: "
                f"{type(err).__name__}: {err} (outputs: {describe(outputs)}, "
                f"labels: {describe(labels)})",
                hint="make the labels from the data iterator match what loss_fn expects"
            ) from err
        if self.tokens:
            loss, self._counts[micro_batch] = loss
        return self._scalar(loss, "loss_fn")

    @staticmethod
    def _scalar(loss: Any, what: str) -> torch.Tensor:
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
            raise DataError(f"{what} returned {describe(loss)}, expected a scalar tensor",
                            hint="reduce the loss to a 0-dim tensor (e.g. .mean())")
        return loss.reshape(())

    def _before_weights(self, instruction: isa.Instruction) -> None:
        if self._before_last_backward is not None and self._at == self._program.last_weight:
            self._before_last_backward(self._bound.settled)

    def _after_weights(self, instruction: isa.Instruction) -> None:
        if self._after_last_backward is not None and self._at == self._program.last_weight:
            self._after_last_backward()

    def backward(self, instruction: isa.Backward) -> None:
        buffer = self.backward_begin(instruction)
        loss, outputs, grads = self.backward_roots(instruction, buffer)
        with expert_parallel.lane(instruction.chunk):
            if loss is not None:
                loss.backward()
            elif outputs:
                torch.autograd.backward(outputs, grads)
        self.backward_done(instruction, buffer)

    def backward_begin(self, instruction: isa.Backward) -> Buffer:
        """The buffer of ``instruction`` (and the reducers told when it is the last)."""
        buffer = self._slot(instruction)
        self._before_weights(instruction)
        return buffer

    def backward_roots(self, instruction: isa.Backward,
                       buffer: Buffer) -> tuple[torch.Tensor | None, list, list]:
        """What the backward starts from: ``(scaled loss, [], [])`` at the last position,
        else ``(None, outputs, their gradients)``."""
        if instruction.chunk == self.last_chunk:
            return self.precision.scale_loss(buffer.loss / self.micro_batches), [], []
        outputs, grads = self._roots(buffer)
        return None, outputs, grads

    def backward_done(self, instruction: isa.Backward, buffer: Buffer) -> None:
        """What follows a backward: the precision's hook, the inputs' gradients kept."""
        chunk = instruction.chunk
        self.precision.after_backward(self.module)
        self._after_weights(instruction)
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
            loss = self.precision.scale_loss(buffer.loss / self.micro_batches)
            grads, buffer.split = backward_input([], [], inputs, self._weights(chunk),
                                                 loss=loss)
        else:
            outputs, output_grads = self._roots(buffer)
            grads, buffer.split = backward_input(outputs, output_grads, inputs,
                                                 self._weights(chunk))
        if leaves:
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
        self._before_weights(instruction)
        backward_weight(buffer.split)
        buffer.split = None
        self.precision.after_backward(self.module)
        self._after_weights(instruction)

    def send_activation(self, instruction: isa.SendActivation) -> None:
        buffer = self._slot(instruction)
        self._send(instruction, buffer.outputs)
        if not torch.is_grad_enabled():
            buffer.outputs = None  # inference: nothing else needs it

    def recv_activation(self, instruction: isa.RecvActivation) -> None:
        obj = self._receive(instruction)
        self._fill(instruction).inputs = obj

    def send_grad(self, instruction: isa.SendGrad) -> None:
        buffer = self._slot(instruction)
        self._send(instruction, buffer.input_grads)
        buffer.inputs = buffer.input_grads = None

    def recv_grad(self, instruction: isa.RecvGrad) -> None:
        obj = self._receive(instruction)
        self._slot(instruction).output_grads = obj
        self._settle_sends((instruction.micro_batch, instruction.chunk))

    def send_skip(self, instruction: isa.SkipInstruction) -> None:
        """``SendSkip`` / ``SendSkipGrad``: what the forward stashed for a later part, or
        the gradients of what an earlier part sent (:mod:`pipekernel.model.skip_routing`)."""
        state = self._slot(instruction).skips
        self._send(instruction, self._skips.payload(instruction, state))
        self._skips.sent(instruction, state, torch.is_grad_enabled())

    def recv_skip(self, instruction: isa.SkipInstruction) -> None:
        """``RecvSkip`` / ``RecvSkipGrad``: keep what arrived for the forward or backward."""
        obj = self._receive(instruction)
        buffer = self._fill(instruction)
        if buffer.skips is None:
            buffer.skips = SkipState()
        self._skips.deliver(instruction, buffer.skips, obj)


_EMPTY = Buffer()  # an unfilled slot: matches no micro-batch, never written to


def _same(obj: Any) -> Any:
    return obj


def _detach_like(obj: Any) -> Any:
    """A hand-off to another chunk of this stage: new autograd leaves sharing storage."""
    return map_tensors(lambda t: t.detach().requires_grad_(t.requires_grad), obj)


