"""The stage runtime's side of skip connections (layer 2): what one stage keeps,
sends and receives for the skip edges (:mod:`pipekernel.model.skips`) that start or end
at its chunks.

The runtime (:mod:`pipekernel.stage.runtime`) posts the transfers like any other
(``SendSkip``/``RecvSkip``/``SendSkipGrad``/``RecvSkipGrad``, inserted by
:func:`pipekernel.schedules.skips.add_skip_transfers`) and asks a
:class:`SkipRouter` for their payloads and where their data goes:

* forward of a chunk: :meth:`SkipRouter.scope` opens the
  :class:`~pipekernel.model.skips.SkipScope` the layers stash into and pop from, seeded
  with what ``RecvSkip`` delivered; :meth:`SkipRouter.after_forward` keeps, per
  consumer position, the stashed values that leave the part;
* backward of a chunk: :meth:`SkipRouter.roots` adds the stashed tensors and the
  gradients ``RecvSkipGrad`` delivered to the backward's roots (producer);
  :meth:`SkipRouter.leaves` lists the received tensors whose gradients
  ``SendSkipGrad`` sends back (consumer).
"""
from __future__ import annotations

from typing import Any

import torch

from pipekernel.schedules import instructions as isa
from pipekernel.errors import ConfigError, PipelineError
from pipekernel.model.skips import SkipLayout, SkipScope
from pipekernel.comm.wire import flatten

__all__ = ["SkipRouter", "SkipState"]


def _grad_tensors(obj: Any) -> list[torch.Tensor]:
    tensors, _ = flatten(obj)
    return [t for t in tensors if t.requires_grad]


class SkipState:
    """One micro-batch of one chunk: skip values in and out, and their gradients.

    ``received[p]``: ``{name: value}`` from producer position ``p`` (autograd leaves),
    moved to ``leaves[p]`` by the forward (kept for the backward when training);
    ``sent[q]``: ``{name: value}`` stashed for consumer ``q`` (in the graph);
    ``grads_in[q]``: gradients of ``sent[q]``'s tensors that require grad;
    ``grads_out[p]``: gradients of ``received[p]``'s, to send back.
    """

    __slots__ = ("received", "leaves", "sent", "grads_in", "grads_out")

    def __init__(self) -> None:
        self.received: dict[int, Any] = {}
        self.leaves: dict[int, Any] = {}
        self.sent: dict[int, Any] = {}
        self.grads_in: dict[int, Any] = {}
        self.grads_out: dict[int, Any] = {}


class SkipRouter:
    """Skip bookkeeping for one stage.

    :param layout: where the model's skip connections go
        (:meth:`~pipekernel.model.module.PipelineModule.skip_layout`).
    :param declarations: ``{global layer index: (stash, pop)}`` of this stage's layers.
    :param positions: the pipeline position of each chunk of this stage.
    :param stage: this stage (for messages).
    """

    def __init__(self, layout: SkipLayout, declarations: dict[int, Any],
                 positions: list[int], stage: int) -> None:
        self.layout, self.declarations = layout, declarations
        self.positions, self.stage = positions, stage

    @property
    def edges(self) -> list[tuple[int, int]]:
        return self.layout.edges

    # -- forward -------------------------------------------------------------------------
    def scope(self, state: SkipState | None, micro_batch: int) -> SkipScope:
        """The scope one chunk's forward runs in, seeded with what it received."""
        incoming: dict[str, Any] = {}
        for values in (state.received.values() if state is not None else ()):
            incoming.update(values)
        return SkipScope(self.declarations, incoming,
                         where=f"stage {self.stage} micro-batch {micro_batch}")

    def after_forward(self, scope: SkipScope, state: SkipState, chunk: int,
                      training: bool) -> None:
        """Keep what leaves the part, by consumer; check nothing else was left."""
        pos = self.positions[chunk]
        leaving = dict(scope.stashed)
        for edge in self.layout.out_of(pos):
            state.sent[edge[1]] = {name: leaving.pop(name) for name in self.layout.names_of[edge]}
        if training:
            state.leaves.update(state.received)
        state.received.clear()
        if leaving:  # stashed here for a layer of this part that did not pop it
            raise ConfigError(f"stage {self.stage} chunk {chunk}: {sorted(leaving)} stashed "
                              "and never popped", hint="every stashed name must be popped")

    # -- payloads and deliveries -----------------------------------------------------------
    def payload(self, instruction: isa.SkipInstruction, state: SkipState | None) -> Any:
        """What a ``SendSkip`` / ``SendSkipGrad`` carries."""
        table = (state.sent if isinstance(instruction, isa.SendSkip) else state.grads_out) \
            if state is not None else {}
        if instruction.peer not in table:
            raise PipelineError(f"{instruction} on stage {self.stage}: nothing to send "
                                f"(no forward/backward of micro-batch {instruction.micro_batch} "
                                "produced it)",
                                hint="check the schedule with pipekernel.schedules.simulate")
        return table[instruction.peer]

    def deliver(self, instruction: isa.SkipInstruction, state: SkipState, obj: Any) -> None:
        """Keep what a ``RecvSkip`` / ``RecvSkipGrad`` brought."""
        if isinstance(instruction, isa.RecvSkip):
            state.received[instruction.peer] = obj
        else:
            state.grads_in[instruction.peer] = obj

    def sent(self, instruction: isa.SkipInstruction, state: SkipState, training: bool) -> None:
        """After a send: drop what nobody needs any more."""
        if isinstance(instruction, isa.SendSkipGrad):
            state.grads_out.pop(instruction.peer, None)
        elif not training:
            state.sent.pop(instruction.peer, None)

    # -- backward --------------------------------------------------------------------------
    def roots(self, state: SkipState | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Producer: the stashed tensors that require grad and their received gradients."""
        tensors: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        if state is None:
            return tensors, grads
        for q in sorted(state.sent):
            mine, theirs = _grad_tensors(state.sent[q]), list(state.grads_in.get(q, ()))
            if len(mine) != len(theirs):
                raise PipelineError(f"stage {self.stage}: {len(theirs)} skip gradient(s) came "
                                    f"back from position {q} for {len(mine)} stashed tensor(s) "
                                    "that require grad",
                                    hint="both ends must run the same pipekernel version")
            tensors += mine
            grads += theirs
        state.sent.clear()
        state.grads_in.clear()
        return tensors, grads

    def leaves(self, state: SkipState | None) -> list[tuple[int, list[torch.Tensor]]]:
        """Consumer: ``[(producer position, received tensors that require grad)]``."""
        if state is None:
            return []
        return [(p, _grad_tensors(values)) for p, values in sorted(state.leaves.items())]

    def set_grads(self, state: SkipState | None,
                  leaves: list[tuple[int, list[torch.Tensor]]],
                  grads: list[torch.Tensor] | None = None) -> None:
        """Consumer: the gradients to send back, from ``grads`` (split backward) or the
        leaves' ``.grad`` (zeros where autograd gave none)."""
        if state is None:
            return
        at = 0
        for p, tensors in leaves:
            if grads is not None:
                state.grads_out[p] = tuple(grads[at:at + len(tensors)])
                at += len(tensors)
            else:
                state.grads_out[p] = tuple(t.grad if t.grad is not None else torch.zeros_like(t)
                                           for t in tensors)
        state.leaves.clear()


def router_for(module: Any, bounds: list[int], stage_module: Any, positions: list[int],
               stage: int) -> SkipRouter | None:
    """The router of one stage, or ``None`` when no skip connection crosses parts
    (stash and pop within one part need no runtime: the stage module keeps them)."""
    layout = module.skip_layout(bounds)
    if not layout.edges:
        return None
    return SkipRouter(layout, stage_module.skip_declarations, positions, stage)


def check_schedules(schedules: list[Any], num_stages: int, micro_batches: int, chunks: int,
                    edges: list[tuple[int, int]]) -> None:
    """Before the first batch: every schedule the engine runs is deadlock-free with the
    skip edges (rendezvous semantics; :func:`~pipekernel.schedules.simulate`; the
    engine opened the skip channels' lanes before). Raises ``ConfigError``."""
    from pipekernel.errors import ScheduleError
    from pipekernel.schedules.simulator import simulate

    for cls in schedules:
        try:
            simulate(cls, num_stages, micro_batches, chunks, skips=edges)
        except ScheduleError as err:
            raise ConfigError(
                f"schedule {getattr(cls, 'name', cls)!r} cannot route the skip connections "
                f"{edges} (producer position -> consumer position): {err.message}",
                hint="use one of the built-in schedules (they all support skips) or move the "
                     "layers that stash and pop") from err
