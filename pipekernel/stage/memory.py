"""Exact accounting of one stage's memory by category (host or device, any allocator).

A :class:`MemoryLedger` counts *storages*, never tensors: each storage once, under the
first category that holds it, in this order:

* ``params``: the stage's parameters;
* ``grads``: their ``.grad`` tensors;
* ``optimizer``: every tensor in the optimizer's ``state``;
* ``saved``: tensors autograd saved for a backward, from the moment it saves them (a
  ``saved_tensors_hooks`` pack) until autograd drops it (a ``weakref.finalize`` on the
  detached alias the hook hands autograd); a checkpointed segment's input counts here too
  (it is what the recompute keeps, :data:`pipekernel.model.recompute.KEPT_INPUT_OBSERVERS`);
* ``buffers``: what the pipeline runtime itself holds (received activations and
  gradients, outputs held until sent, skip stashes, the weight-pass state's gradients,
  send buffers until their transfer completes, hand-offs within the stage).

``sample()`` sums the categories (the union of storages, so a received activation that a
layer also saved counts once) and keeps the step's peak. Nothing here allocates tensors or
synchronizes a device: a sample walks Python references only.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable

import torch

from pipekernel.model.recompute import KEPT_INPUT_OBSERVERS

__all__ = ["CATEGORIES", "MemoryLedger", "tensors_in"]

#: Category names in claiming order (a storage belongs to the first that holds it).
CATEGORIES = ("params", "grads", "optimizer", "saved", "buffers")

def tensors_in(obj: Any, _depth: int = 0) -> Iterable[torch.Tensor]:
    """Every tensor reachable in ``obj`` through tuples, lists, dicts, sets and objects
    with ``__slots__`` or ``__dict__`` (bounded depth: a runtime buffer's fields)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif _depth > 8 or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from tensors_in(value, _depth + 1)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for value in obj:
            yield from tensors_in(value, _depth + 1)
    elif hasattr(obj, "__slots__"):
        for name in obj.__slots__:
            yield from tensors_in(getattr(obj, name, None), _depth + 1)
    elif hasattr(obj, "__dict__") and not callable(obj):
        for value in vars(obj).values():
            yield from tensors_in(value, _depth + 1)


class MemoryLedger:
    """One stage's memory by category during a step (see the module docstring).

    :param params: returns the stage's parameters (called at every sample: cheap).
    :param optimizer: returns the optimizer (or ``None``); its ``state`` is walked.
    :param buffers: returns the runtime's held tensors (``runtime.held_tensors()``).
    """

    def __init__(self, params: Callable[[], Iterable[torch.Tensor]],
                 optimizer: Callable[[], Any], buffers: Callable[[], Iterable[Any]]) -> None:
        self._params, self._optimizer, self._buffers = params, optimizer, buffers
        self._saved: dict[int, list[int]] = {}  # storage data_ptr -> [bytes, live tensors]
        self._hooks: Any = None
        self.recording = False
        self._skip: set[int] = set()  # parameter storages: counted as params, never saved
        self.peak: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self.peak_total = 0
        self.samples = 0

    # ------------------------------------------------------------ recording
    def start(self, saved: bool = True) -> None:
        """Reset the peak and, with ``saved``, record saved tensors from now (the calling
        thread); without, ``metrics()`` leaves ``memory_saved_bytes`` out.

        The pack hook gives autograd a detached alias of each tensor (same storage), never
        the tensor itself: an op's saved output would otherwise hold its own ``grad_fn``, a
        cycle only a backward without ``retain_graph`` breaks — the split backward's input
        pass retains the graph, so every input-path activation would leak."""
        self.peak, self.peak_total, self.samples = dict.fromkeys(CATEGORIES, 0), 0, 0
        self._skip = {p.untyped_storage().data_ptr() for p in self._params()}
        self.recording = saved
        if saved and self._hooks is None:
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
            self._hooks.__enter__()
            KEPT_INPUT_OBSERVERS.append(self.note_saved)

    def stop(self) -> None:
        """Stop recording new saved tensors (those recorded stay counted until freed)."""
        if self._hooks is not None:
            hooks, self._hooks = self._hooks, None
            hooks.__exit__(None, None, None)
            if self.note_saved in KEPT_INPUT_OBSERVERS:
                KEPT_INPUT_OBSERVERS.remove(self.note_saved)

    def note_saved(self, obj: Any) -> None:
        """Count the tensors of ``obj`` as saved for backward (what autograd's pack hook
        cannot see: a checkpointed segment's input, kept by the recompute's closure)."""
        for tensor in tensors_in(obj):
            self.pack(tensor)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        # A detached alias (same storage and version counter, no grad_fn): a pack hook
        # that returns an op's own output keeps that output's grad_fn alive from the node
        # that saved it, a cycle of C++ references no collector sees. A backward without
        # retain_graph breaks it (the node releases what it saved); the split backward's
        # input pass retains the graph and the weight pass never runs those nodes again,
        # so without the alias every input-path activation of a split schedule leaked.
        alias = tensor.detach()
        self.pack(alias)
        return alias

    def pack(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage as saved until every tensor so recorded is freed."""
        storage = tensor.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self._skip:
            return
        entry = self._saved.get(key)
        if entry is None:
            entry = self._saved[key] = [size, 0]
        entry[1] += 1
        weakref.finalize(tensor, self._release, key, entry)

    def _release(self, key: int, entry: list[int]) -> None:
        entry[1] -= 1
        if entry[1] == 0 and self._saved.get(key) is entry:
            del self._saved[key]

    # -------------------------------------------------------------- sampling
    def now(self) -> dict[str, int]:
        """Bytes held now by category, each storage once."""
        seen: set[int] = set()
        totals = dict.fromkeys(CATEGORIES, 0)

        def claim(category: str, tensors: Iterable[torch.Tensor]) -> None:
            for tensor in tensors:
                storage = tensor.untyped_storage()
                key = storage.data_ptr()
                if key not in seen and storage.nbytes():
                    seen.add(key)
                    totals[category] += storage.nbytes()

        params = list(self._params())
        claim("params", params)
        claim("grads", [p.grad for p in params if p.grad is not None])
        optimizer = self._optimizer()
        if optimizer is not None:
            claim("optimizer", tensors_in(list(optimizer.state.values())))
        for key, (size, _) in list(self._saved.items()):
            if key not in seen:
                seen.add(key)
                totals["saved"] += size
        claim("buffers", tensors_in(list(self._buffers())))
        return totals

    def sample(self) -> int:
        """Take a sample; keep it as the step's peak if its sum is the largest so far."""
        totals = self.now()
        total = sum(totals.values())
        self.samples += 1
        if total > self.peak_total:
            self.peak, self.peak_total = totals, total
        return total

    def metrics(self) -> dict[str, int]:
        """The step's peak, flat (``memory_peak_bytes`` and each category's bytes at it,
        ``memory_<category>_bytes``), for ``train_batch``'s metrics."""
        out = {f"memory_{name}_bytes": self.peak[name] for name in CATEGORIES
               if name != "saved" or self.recording}
        out["memory_peak_bytes"] = self.peak_total
        return out


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
