"""Activation checkpointing whose recompute leaves no trace in module state.

A checkpointed run of layers is recomputed in backward, and every side effect of its
forward would happen again: BatchNorm's running statistics and ``num_batches_tracked``,
a counter a layer keeps in a buffer, a cache it refreshes. :func:`checkpoint` runs a
segment under non-reentrant ``torch.utils.checkpoint`` (RNG state preserved, so dropout
draws the same masks) and keeps the state exactly what one process without
recomputation would have:

* **Buffers** (any registered buffer, whatever the layer's class). The original forward
  reads every buffer's version counter (``tensor._version``, a host-side integer, no
  device sync) and identity before and after; a buffer whose counter moved or which was
  rebound was *written by the forward*. Only such buffers cost anything: a copy of each
  as it was before the forward is kept with the micro-batch's graph (the first forward of
  a segment copies all of the segment's buffers once and compares values, one host
  synchronisation, to learn which are written: some kernels write without moving the
  version counter, BatchNorm's running statistics among them). The
  recompute runs with those buffers bound to fresh copies of their pre-forward values,
  so it computes what the original forward computed (a layer whose output depends on
  its counter included) and writes into throwaway copies; the live buffers are bound
  back afterwards, untouched. A buffer a layer writes for the first time after a
  segment's first forward is watched from then on; that one micro-batch's recompute
  reads its live value.
* **Python attributes** cannot be put back from outside. At the first recompute of each
  segment, the plain values of every module's ``__dict__`` (numbers, strings, bools,
  ``None``, tensors held as plain attributes) are compared before and after; one the
  recompute changed (``self.steps += 1``) raises :class:`~pipekernel.errors.ConfigError`
  naming the stage, the layer and the attribute — an error rather than a warning, as the
  model would otherwise silently differ from one trained without checkpointing. A value
  set once (a lazy initialisation at the first call) is not changed by the recompute
  and passes. Side effects outside the module (I/O, a global list, a mutable container
  attribute appended to) cannot be seen: such a layer must not be checkpointed.

Layers sharing one module between a paired forward running in another thread
(:func:`pipekernel.overlap_all_to_all`) and a recompute see the throwaway copies during
the recompute; the two halves of a pair are different chunks, so only a module tied
across chunks is affected.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from pipekernel.errors import ConfigError
from pipekernel.nested import map_tensors

__all__ = ["checkpoint", "SegmentWatch"]

_PLAIN = (bool, int, float, complex, str, bytes, type(None))
Slot = tuple[nn.Module, str]


#: Told of each checkpointed segment's input, which the recompute's closure keeps alive
#: where autograd's pack hooks cannot see it: the stage's recording memory ledgers
#: (``pipekernel.stage.memory``) add themselves while they record.
KEPT_INPUT_OBSERVERS: list[Callable[[Any], None]] = []


class SegmentWatch:
    """What one checkpointed segment's forward writes, learned at its first forward.

    :param layers: ``(global layer index, layer)`` of the segment, in order.
    :param stage: the stage holding it (for error messages).
    """

    def __init__(self, layers: Sequence[tuple[int, Any]], stage: int) -> None:
        self.stage = stage
        self.owner: dict[int, tuple[int, nn.Module]] = {}  # id(module) -> (index, layer)
        self.modules: list[nn.Module] = []
        for index, layer in layers:
            if isinstance(layer, nn.Module):
                for module in layer.modules():
                    if id(module) not in self.owner:
                        self.owner[id(module)] = (index, layer)
                        self.modules.append(module)
        self.written: set[tuple[int, str]] | None = None  # (id(module), name); None: unknown
        self.attributes_checked = False

    def buffers(self) -> dict[tuple[int, str], tuple[Slot, torch.Tensor, int]]:
        """Every buffer now: ``{(id(module), name): ((module, name), tensor, version)}``."""
        return {(id(m), name): ((m, name), t, t._version)
                for m in self.modules for name, t in m._buffers.items() if t is not None}


class _Run:
    """One micro-batch's checkpointed call of a segment: the first call is the original
    forward, every later one a recompute (a split backward may recompute twice)."""

    def __init__(self, fn: Callable[[Any], Any], watch: SegmentWatch) -> None:
        self.fn, self.watch = fn, watch
        self.saved: dict[Slot, torch.Tensor] | None = None  # pre-forward copies

    def __call__(self, x: Any) -> Any:
        if self.saved is None:
            return self._forward(x)
        return self._recompute(x, self.saved)

    def _forward(self, x: Any) -> Any:
        watch = self.watch
        before = watch.buffers()
        keep = before if watch.written is None else \
            {key: before[key] for key in watch.written if key in before}
        copies: dict[int, torch.Tensor] = {}  # one copy per tensor (shared buffers)
        for observe in KEPT_INPUT_OBSERVERS:  # the recompute keeps the input: it is saved
            observe(x)
        with torch.no_grad():
            for _, tensor, _ in keep.values():
                if id(tensor) not in copies:
                    copies[id(tensor)] = tensor.clone()
        out = self.fn(x)
        written = {key for key, ((m, name), tensor, version) in before.items()
                   if m._buffers.get(name) is not tensor or tensor._version != version}
        if watch.written is None:
            # Some kernels write without moving the version counter (BatchNorm's running
            # mean and variance): the first forward compares values too, once per segment.
            with torch.no_grad():
                written |= {key for key, (_, tensor, _) in before.items()
                            if key not in written and not torch.equal(copies[id(tensor)], tensor)}
        watch.written = written = written | (watch.written or set())
        self.saved = {before[key][0]: copies[id(before[key][1])]
                      for key in written if key in before and id(before[key][1]) in copies}
        return out

    def _recompute(self, x: Any, saved: dict[Slot, torch.Tensor]) -> Any:
        # a saved slot is a buffer the forward wrote: a tensor (nn.Module's _buffers also
        # holds None for a registered-but-unset buffer, never one a forward wrote)
        live: dict[Slot, torch.Tensor] = {
            slot: slot[0]._buffers[slot[1]] for slot in saved}  # type: ignore[misc]
        versions = [(slot, t, t._version) for slot, t in live.items()]
        fresh: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for (module, name), copy in saved.items():
                module._buffers[name] = fresh.setdefault(id(copy), copy.clone())
        attributes = None if self.watch.attributes_checked else _attributes(self.watch)
        try:
            return self.fn(x)
        finally:
            for (module, name), tensor in live.items():
                module._buffers[name] = tensor
            if attributes is not None:
                self.watch.attributes_checked = True
                _check_attributes(self.watch, attributes)
            _check_untouched(self.watch, versions)


def _attributes(watch: SegmentWatch) -> dict[tuple[int, str], tuple[Any, int | None]]:
    """The plain values of the segment's modules' ``__dict__``: ``(value, version)``."""
    out: dict[tuple[int, str], tuple[Any, int | None]] = {}
    for module in watch.modules:
        for key, value in vars(module).items():
            if isinstance(value, torch.Tensor):
                out[id(module), key] = (value, value._version)
            elif isinstance(value, _PLAIN):
                out[id(module), key] = (value, None)
    return out


def _same(old: tuple[Any, int | None], new: tuple[Any, int | None] | None) -> bool:
    if new is None:
        return False
    if old[1] is not None or new[1] is not None:  # tensors: the same one, unwritten
        return old[0] is new[0] and old[1] == new[1]
    return old[0] is new[0] or (type(old[0]) is type(new[0]) and old[0] == new[0])


def _check_attributes(watch: SegmentWatch, before: dict) -> None:
    after = _attributes(watch)
    for key in sorted(set(before) | set(after), key=lambda k: (watch.owner[k[0]][0], k[1])):
        if key in before and _same(before[key], after.get(key)):
            continue
        index, layer = watch.owner[key[0]]
        path = _path(layer, key[0])
        raise ConfigError(
            f"stage {watch.stage}: layer {index} ({type(layer).__name__}) changed its Python "
            f"attribute {path + key[1]!r} again when activation checkpointing recomputed its "
            f"forward in backward (from {_show(before.get(key))} to {_show(after.get(key))}): "
            "the engine cannot undo that, and the model would differ from one trained "
            "without checkpointing",
            hint=f"keep that state in a buffer (self.register_buffer({key[1]!r}, "
                 "torch.tensor(...)) and update it in place), which a recompute leaves as it "
                 "was, or train this model without activation checkpointing "
                 "(activation_checkpoint_interval=0)")


def _check_untouched(watch: SegmentWatch, versions: list) -> None:
    for (module, name), tensor, version in versions:
        if tensor._version != version:  # written through an alias the layer holds
            index, layer = watch.owner[id(module)]
            raise ConfigError(
                f"stage {watch.stage}: layer {index} ({type(layer).__name__}) wrote its "
                f"buffer {_path(layer, id(module)) + name!r} through another reference "
                "while activation checkpointing recomputed its forward: the recompute "
                "would count twice",
                hint="write the buffer through the module attribute that registers it, "
                     "or train without activation checkpointing "
                     "(activation_checkpoint_interval=0)")


def _path(layer: nn.Module, module_id: int) -> str:
    """``"bn."`` for a submodule ``bn`` of ``layer``; ``""`` for the layer itself."""
    for name, module in layer.named_modules():
        if id(module) == module_id:
            return f"{name}." if name else ""
    return ""


def _show(entry: tuple[Any, int | None] | None) -> str:
    if entry is None:
        return "(unset)"
    return f"a tensor (version {entry[1]})" if entry[1] is not None else repr(entry[0])[:40]


def checkpoint(fn: Callable[[Any], Any], x: Any, watch: SegmentWatch) -> Any:
    """``fn(x)`` under non-reentrant activation checkpointing (RNG state preserved), its
    recompute leaving buffers as they are and refusing a changed Python attribute (see
    the module's docstring). ``watch`` is the segment's, kept across micro-batches.

    The checkpoint keeps a view of ``x`` (same storage, a tensor object of its own), so the
    memory meter counts the input from the forward until the checkpoint drops it, not for
    as long as the caller holds ``x`` (a data iterator's whole batch on the first stage)."""
    return torch.utils.checkpoint.checkpoint(_Run(fn, watch), map_tensors(_view, x),
                                             use_reentrant=False, preserve_rng_state=True)


def _view(t: torch.Tensor) -> torch.Tensor:
    return t.view_as(t)
