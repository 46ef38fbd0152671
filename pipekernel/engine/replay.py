"""The replay check (:meth:`PipelineEngine.verify_batch`): run one batch through the
schedule, then run it again on every stage in the plainest order, and compare.

During the verified batch only, each stage records what its compute instructions saw: per
chunk and micro-batch a copy of the inputs (before the forward could change them in
place), the labels at the last position, the RNG state (CPU and the device's) at the
forward, and the output gradients at the backward; and, through forward hooks on every
module of the stage, a summary of each module's output at every call (the forward, and a
checkpoint's recompute inside the backward). The batch runs as a train batch would, except
that no gradient is reduced (tied or data-parallel) and the optimizer does not step.

Then each stage, alone, replays: for each chunk and micro-batch, the chunk's layers in
order on the recorded inputs with the recorded RNG state (no checkpointing, no split
backward, no pairs, no overlap), the loss (``loss / micro_batches`` through the precision's
loss scaling) or the recorded output gradients, one full backward, the precision's
``after_backward``. Its gradients must equal what the schedule accumulated (a tolerance
per dtype for the summation order). A layer whose forward is not a function of its
inputs, parameters, buffers and the engine's RNG — a call counter kept outside its
buffers, its own random generator, a global — computes something else in the replay (or
in its recompute), and so does a runtime that dropped or rescaled a micro-batch's
gradient. The stages then agree in one all-reduce; a mismatch raises
:class:`~pipekernel.errors.ConsistencyError` (``check="replay"``) on every rank, naming the
stage, the rank and the module: the first module (forward order) whose output changed for
the same inputs, else the last layer (forward order: the first the backward reaches) whose
gradient differs.

What cannot be replayed is refused before anything runs (:func:`check_replayable`).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from pipekernel.engine.replay_compare import agree, compare, put_grads, take_grads
from pipekernel.errors import ConfigError
from pipekernel.model.module import _run_calls
from pipekernel.nested import map_tensors
from pipekernel.schedules import instructions as isa
from pipekernel.stage.runtime import _grad_tensors
from pipekernel.model.aux_loss import attach as attach_aux
from pipekernel.model.aux_loss import collecting as collect_aux

__all__ = ["check_replayable", "Recorder", "verify"]


def check_replayable(engine: Any) -> None:
    """``ConfigError`` (the same on every rank: the configuration is agreed) when a stage
    of ``engine`` cannot replay its batch, saying why and what to change."""
    parallel, why = engine.parallel, None
    if parallel.data_parallel_shard > 1:
        why = ("data_parallel_shard > 1: FSDP2 reduce-scatters the gradients inside the "
               "backward, so no rank holds the gradients the schedule accumulated",
               "verify with data_parallel_size (replicas) instead of shards")
    elif parallel.tensor_parallel_size > 1:
        why = ("tensor_parallel_size > 1: the layers run collectives inside the forward "
               "and backward, which a replay on one stage cannot pair with its peers",
               "verify the same model with tensor_parallel_size=1")
    elif parallel.expert_parallel_size > 1:
        why = ("expert_parallel_size > 1: the experts' all-to-alls need every member of "
               "the expert group", "verify with expert_parallel_size=1")
    elif getattr(engine.schedule_cls, "seq_chunks", 1) > 1:
        why = ("seq_chunks > 1: a sequence chunk's forward reads the earlier chunks' keys "
               "and values (its KV prefix), which a replay of one unit does not have",
               "verify the same model with seq_chunks=1")
    elif engine.skip_edges:
        why = (f"skip connections between stages ({engine.skip_edges}): a part's inputs "
               "include what other parts stashed", "verify a model without pk.skippable "
               "connections across stages")
    elif engine.runtime.pairs:
        why = ("the model supplies overlapped_forward_backward: a paired instruction runs "
               "the forward and backward halves together",
               "verify without overlapped_forward_backward (the engine then runs each pair "
               "as its two steps)")
    elif engine.optimizer is None:
        why = ("the engine has no optimizer: the replay checks a train batch",
               "pass optimizer=... to the engine")
    if why is not None:
        raise ConfigError(f"verify_batch cannot replay this engine's batches: {why[0]}",
                          hint=why[1], rank=engine.rank, stage=engine.stage)


def summary(obj: Any) -> torch.Tensor | None:
    """Three float64 numbers per floating-point tensor of ``obj`` (sum, sum of absolute
    values, a position-weighted sum), on the device; ``None`` when it holds none."""
    parts = []
    for t in _floats(obj):
        flat = t.detach().reshape(-1).double()
        weights = torch.linspace(-1.0, 1.0, flat.numel(), dtype=torch.float64,
                                 device=flat.device)
        parts += [flat.sum(), flat.abs().sum(), (flat * weights).sum()]
    return torch.stack(parts) if parts else None


def _floats(obj: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_tensors(lambda t: found.append(t) if t.is_floating_point() else None, obj)
    return found


def _copy(obj: Any) -> Any:
    """A detached copy of ``obj``'s tensors, each keeping its ``requires_grad``."""
    return map_tensors(lambda t: t.detach().clone().requires_grad_(t.requires_grad), obj)


@dataclass
class _Seen:
    """What one chunk's micro-batch saw in the schedule."""

    inputs: Any = None
    labels: Any = None
    rng: tuple = ()
    output_grads: Any = None
    #: phase ("forward", "backward": a recompute, "replay") -> [(module, output summary)]
    #: in the order the calls ended
    calls: dict[str, list] = field(default_factory=dict)


class Recorder:
    """Records one batch on one stage (installed by :func:`verify` for that batch only)."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.runtime = engine, engine.runtime
        self.seen: dict[tuple[int, int], _Seen] = {}
        self.at: tuple[_Seen, str] | None = None  # whose modules run now, in which phase
        self.device = engine.transport.device
        self.names: dict[int, str] = {}
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []

    def rng_state(self) -> tuple:
        """The CPU RNG state and the device's (``None`` off CUDA)."""
        cuda = (torch.cuda.get_rng_state(self.device)
                if torch.device(self.device).type == "cuda" else None)
        return torch.get_rng_state(), cuda

    def set_rng(self, state: tuple) -> None:
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], self.device)

    @contextlib.contextmanager
    def hooked(self) -> Iterator[None]:
        """Forward hooks on every module of the stage (summaries into :attr:`at`)."""
        for name, module in self.engine.module.named_modules():
            if name:
                self.names[id(module)] = name
                self._hooks.append(module.register_forward_hook(self._called))
        try:
            yield
        finally:
            for hook in self._hooks:
                hook.remove()
            self._hooks = []

    def _called(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.at is not None:
            seen, phase = self.at
            seen.calls.setdefault(phase, []).append((self.names[id(module)], summary(output)))

    def wrap(self, program: Any, handlers: Any) -> tuple:
        """``program``'s ``handlers`` (by stream index), its compute handlers recording
        and its reductions and optimizer step left out."""
        handlers = list(handlers)
        for index, ins in enumerate(program.stream):
            if isinstance(ins, _NOT_REPLAYED):
                handlers[index] = _nothing
            elif isinstance(ins, isa.Forward):
                handlers[index] = self._forward(handlers[index])
            elif isinstance(ins, (isa.Backward, isa.BackwardInput, isa.BackwardWeight)):
                handlers[index] = self._backward(handlers[index])
        return tuple(handlers)

    def _forward(self, handler: Any) -> Any:
        def run(ins: Any) -> None:
            runtime = self.runtime
            seen = self.seen.setdefault((ins.chunk, ins.micro_batch), _Seen())
            seen.inputs = _copy(runtime.forward_inputs(ins).inputs)
            if ins.chunk == runtime.last_chunk:
                seen.labels = runtime.loss_keeper.labels.get(ins.micro_batch)
            seen.rng = self.rng_state()
            self.at = seen, "forward"
            try:
                handler(ins)
            finally:
                self.at = None
        return run

    def _backward(self, handler: Any) -> Any:
        def run(ins: Any) -> None:
            seen = self.seen[(ins.chunk, ins.micro_batch)]
            buffer = self.runtime.buffers[ins.buffer]
            if not isinstance(ins, isa.BackwardWeight) and buffer.output_grads is not None:
                seen.output_grads = _copy(buffer.output_grads)
            self.at = seen, "backward"  # a checkpoint's recompute runs here
            try:
                handler(ins)
            finally:
                self.at = None
        return run


#: a verified batch's reductions (the data-parallel reducer's points among them) and step
_NOT_REPLAYED = (isa.ReduceTiedGrads, isa.ArmGradReduce, isa.LaunchGradReduce, isa.ReduceGrads,
                 isa.OptimizerStep)


def _nothing(ins: Any) -> None:
    """The reductions and the optimizer step of a verified batch: not run."""


def verify(engine: Any, data_iter: Any) -> torch.Tensor:
    """The body of :meth:`PipelineEngine.verify_batch` (every rank together)."""
    check_replayable(engine)
    recorder = Recorder(engine)
    engine.module.train()
    pending = take_grads(engine)  # gradients accumulated before (a host's accumulation)
    try:
        with recorder.hooked():
            loss = engine._run(engine.schedule_cls, data_iter, True, False,
                               wrap=recorder.wrap)
            scheduled = take_grads(engine)
            after = recorder.rng_state()
            try:
                replayed = replay(engine, recorder)
            finally:
                recorder.set_rng(after)
    finally:
        put_grads(engine, pending)  # the batch's and the replay's dropped: nothing stepped
    found = compare(engine, recorder, scheduled, replayed)
    agree(engine, found)
    return loss


def replay(engine: Any, recorder: Recorder) -> dict[str, torch.Tensor | None]:
    """Each recorded chunk and micro-batch again, in order, plainly; the gradients."""
    runtime, precision = engine.runtime, engine.precision
    order = sorted(recorder.seen, key=lambda key: (runtime.positions[key[0]], key[1]))
    for chunk, micro_batch in order:
        seen = recorder.seen[(chunk, micro_batch)]
        recorder.set_rng(seen.rng)
        recorder.at = seen, "replay"
        try:
            outputs, aux = _plain_forward(engine, chunk, _copy(seen.inputs))
        finally:
            recorder.at = None
        _plain_backward(engine, chunk, micro_batch, seen, outputs, aux)
        precision.after_backward(engine.module)
    return take_grads(engine)


class _Plain:
    """A chunk's layers called one after the other: no checkpointing (what the
    precision's ``forward`` calls; ``parameters()`` for policies that look)."""

    def __init__(self, part: Any) -> None:
        self.part = part

    def __call__(self, x: Any) -> Any:
        return _run_calls(self.part._calls, x)

    def parameters(self) -> Any:
        return iter(self.part.parameters())


def _plain_forward(engine: Any, chunk: int, inputs: Any) -> tuple[Any, list]:
    runtime = engine.runtime
    part = runtime.parts[chunk]
    with collect_aux() as aux:
        outputs = engine.precision.forward(_Plain(part), inputs,
                                           first=chunk == runtime.first_chunk,
                                           last=chunk == runtime.last_chunk)
    return outputs, aux


def _plain_backward(engine: Any, chunk: int, micro_batch: int, seen: _Seen, outputs: Any,
                    aux: list) -> None:
    """The full backward of one replayed micro-batch, as one process would run it."""
    runtime, precision = engine.runtime, engine.precision
    total = torch.stack([a.float() for a in aux]).sum() if aux else None
    if chunk == runtime.last_chunk:
        # a token count is not kept: the schedule's is used
        loss = runtime.loss_keeper.loss_of(outputs, seen.labels, micro_batch, keep_count=False)
        if total is not None:
            loss = loss + total.to(loss.dtype)
        precision.scale_loss(loss / engine.micro_batches).backward()
        return
    if total is not None and total.requires_grad:
        seed = precision.scale_loss(torch.ones((), dtype=torch.float32, device=total.device)
                                    / engine.micro_batches)
        outputs = attach_aux(outputs, total, seed.detach())
    roots = _grad_tensors(outputs)
    if roots and seen.output_grads is not None:
        torch.autograd.backward(roots, list(seen.output_grads))
