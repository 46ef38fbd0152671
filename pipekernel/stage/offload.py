"""Schedule-aware activation offload (PipeOffload, ICML 2025): ``PipelineEngine(...,
offload=True)`` or ``offload=pk.Offload(min_distance=2, prefetch=1)``.

Which parts move and when is decided from the compiled program
(:func:`pipekernel.schedules.offload_plan.offload_points`): a part whose backward is at
least ``min_distance`` compute instructions after its forward. While such a part's forward
runs, a ``saved_tensors_hooks`` pair keyed to that part takes what autograd saves; right
after the forward, every saved storage the runtime does not hold anyway (the part's
inputs and outputs stay on the device: moving them would free nothing) is copied to host
memory by a :class:`Mover` and the device copy dropped. ``prefetch`` compute instructions
before the part's backward the copy back is posted; autograd's unpack hook waits for it
(on CUDA: an event, the host never blocks). Each storage moves once (a view keeps its
offset and strides), so what leaves the device is exactly the bytes the part saved there.

Movers: :class:`CudaMover` (pinned host buffers, ``copy_(non_blocking=True)`` on a side
stream, CUDA events) on a GPU; :class:`ModelMover` on any device, a *model* of the move
for tests and dry runs: the storage is copied to a separate host pool, counted by
:meth:`Mover.host_bytes` and never by the memory ledger's device categories. Without a
mover and without CUDA, ``offload=`` is a ``ConfigError``.

What offload does not move: parameters, the runtime's buffers (received inputs, outputs
held until sent), what a paired ``ForwardBackward`` saves, and what a checkpointed segment
saves under torch's checkpoint hooks (innermost: they take those tensors first).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Protocol

import torch

from pipekernel.errors import ConfigError
from pipekernel.model.recompute import KEPT_INPUT_OBSERVERS
from pipekernel.schedules.offload_plan import OffloadPoints, check_offload_numbers, offload_points

__all__ = ["Offload", "Mover", "CudaMover", "ModelMover", "ActivationOffload", "make_offload"]


class Mover(Protocol):
    """Moves one storage's bytes (a 1-D ``uint8`` tensor) out and back.

    ``out(data)`` returns a host handle (the copy may still be in flight); ``back(host)``
    posts the copy back and returns ``(device bytes, ticket)``: the bytes are safe to read
    on the current stream once ``ready(ticket)`` returned; ``host_bytes()`` is what the
    host holds now (a host copy counts until the handle, and any ticket holding it, is
    freed)."""

    def out(self, data: torch.Tensor) -> Any: ...

    def back(self, host: Any) -> tuple[torch.Tensor, Any]: ...

    def ready(self, ticket: Any) -> None: ...

    def host_bytes(self) -> int: ...


@dataclass(frozen=True)
class Offload:
    """The offload knob (see the module docstring).

    :param min_distance: offload a part whose backward is this many compute instructions
        or more after its forward (>= 1).
    :param prefetch: post the copy back this many compute instructions before the
        backward (>= 0; 0: right before it, no overlap).
    :param mover: how bytes move; ``None``: :class:`CudaMover` on the stage's CUDA device
        (a ``ConfigError`` without CUDA). :class:`ModelMover` runs on any device.
    """

    min_distance: int = 2
    prefetch: int = 1
    mover: Any = None


def make_offload(offload: Any, device: torch.device, stage: int | None = None
                 ) -> ActivationOffload | None:
    """The runtime's offload for the engine's ``offload=`` (``None``/``False``: none;
    ``True``: :class:`Offload`'s defaults) on ``device``."""
    if offload is None or offload is False:
        return None
    if offload is True:
        offload = Offload()
    if not isinstance(offload, Offload):
        raise ConfigError(f"offload must be True, False, None or pk.Offload(...), got "
                          f"{offload!r}", hint="e.g. offload=True, or "
                          "offload=pk.Offload(min_distance=2, prefetch=1)", stage=stage)
    check_offload_numbers(offload.min_distance, offload.prefetch)
    mover = offload.mover
    if mover is None:
        if device.type != "cuda":
            raise ConfigError(
                f"offload needs CUDA: on {device.type} the activations already live in host "
                "memory, and there is no device memory to save", stage=stage,
                hint="run on a GPU (transport='nccl' or 'staged'), or drop offload=; to "
                     "fewer activations on CPU use activation_checkpoint_interval")
        mover = CudaMover(device)
    return ActivationOffload(mover, offload.min_distance, offload.prefetch)


class CudaMover:
    """Pinned host buffers and a side stream: copies out start after the current stream's
    work so far (an event), copies back are waited for by the current stream (an event);
    the host never blocks. A device block read by the side stream is kept from reuse until
    that read ends (``record_stream``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._host = 0

    def out(self, data: torch.Tensor) -> Any:
        host = torch.empty(data.numel(), dtype=torch.uint8, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host.copy_(data, non_blocking=True)
        data.record_stream(self.stream)
        done = torch.cuda.Event()
        done.record(self.stream)
        self._host += host.numel()
        return _Hosted(host, done, self)

    def back(self, host: Any) -> tuple[torch.Tensor, Any]:
        data = torch.empty(host.data.numel(), dtype=torch.uint8, device=self.device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            data.copy_(host.data, non_blocking=True)
        data.record_stream(self.stream)
        done = torch.cuda.Event()
        done.record(self.stream)
        return data, (done, host)  # the pinned copy lives until the backward waited

    def ready(self, ticket: Any) -> None:
        torch.cuda.current_stream(self.device).wait_event(ticket[0])

    def host_bytes(self) -> int:
        return self._host


class ModelMover:
    """A model of the move for any device: the bytes are copied into a separate host pool
    (counted by :meth:`host_bytes`, freed when the part's graph drops its handle) and
    copied back on ``back``; nothing is asynchronous. Bit-exact, and the memory ledger
    sees the device storage freed exactly as on a GPU."""

    def __init__(self) -> None:
        self._host = 0
        self.moves = 0  # storages moved out so far

    def out(self, data: torch.Tensor) -> Any:
        self.moves += 1
        self._host += data.numel()
        return _Hosted(data.clone(), None, self)

    def back(self, host: Any) -> tuple[torch.Tensor, Any]:
        return host.data.clone(), None

    def ready(self, ticket: Any) -> None:
        return None

    def host_bytes(self) -> int:
        return self._host


class _Hosted:
    """One storage's host copy; its bytes leave the mover's count when it is freed."""

    __slots__ = ("data", "done", "owner")

    def __init__(self, data: torch.Tensor, done: Any, owner: Any) -> None:
        self.data, self.done, self.owner = data, done, owner

    def __del__(self) -> None:
        self.owner._host -= self.data.numel()


class _Storage:
    """One saved storage of an offloaded part: on the device (``device``), on the host
    (``host``) or coming back (``ticket``)."""

    __slots__ = ("device", "host", "ticket")

    def __init__(self, device: torch.Tensor) -> None:
        self.device: torch.Tensor | None = device  # 1-D uint8 over the whole storage
        self.host: Any = None
        self.ticket: Any = None


class _Saved:
    """What autograd holds for one saved tensor of an offloaded part: its storage's entry
    and how the tensor views it."""

    __slots__ = ("storage", "dtype", "offset", "size", "stride")

    def __init__(self, tensor: torch.Tensor, storage: _Storage) -> None:
        self.storage, self.dtype, self.offset = storage, tensor.dtype, tensor.storage_offset()
        self.size, self.stride = tensor.size(), tensor.stride()


class ActivationOffload:
    """The runtime's side of offload: the pack/unpack hooks of offloaded parts, the move
    after their forward, the copy back at their prefetch point (see the module docstring).

    :param mover: a :class:`Mover`.
    """

    def __init__(self, mover: Any, min_distance: int = 2, prefetch: int = 1) -> None:
        self.mover, self.min_distance, self.prefetch = mover, min_distance, prefetch
        self._points: dict[int, OffloadPoints] = {}  # id(program stream) -> its points
        self._streams: list[Any] = []  # those streams, kept alive: their ids stay theirs
        self.points: OffloadPoints | None = None
        self._parts: dict[tuple[int, int], dict[int, _Storage]] = {}
        self._skip: set[int] = set()
        #: bytes moved out per part in the last batch (what left the device)
        self.moved: dict[tuple[int, int], int] = {}

    def begin(self, stream: Any, params: Any) -> None:
        """A batch of ``stream`` starts (its points computed once per stream)."""
        points = self._points.get(id(stream))
        if points is None:
            points = self._points[id(stream)] = offload_points(stream, self.min_distance,
                                                               self.prefetch)
            self._streams.append(stream)
        self.points, self._parts, self.moved = points, {}, {}
        self._skip = {p.untyped_storage().data_ptr() for p in params}

    def packing(self, key: tuple[int, int]) -> Any:
        """The hooks for the forward of part ``key`` (a no-op context when it stays)."""
        if self.points is None or key not in self.points.parts:
            return contextlib.nullcontext()
        storages: dict[int, _Storage] = self._parts.setdefault(key, {})
        return self._hooks(storages)

    @contextlib.contextmanager
    def _hooks(self, storages: dict[int, _Storage]) -> Iterator[None]:
        # autograd keeps the pack hook beside every tensor it saved: the hook reaches the
        # part's entries through ``holder``, emptied after the forward, or each saved
        # tensor would keep every storage of its part alive until the last is freed
        holder = [storages]

        def pack(tensor: torch.Tensor) -> Any:
            storage = tensor.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in self._skip or storage.nbytes() == 0:
                return tensor.detach()
            entries = holder[0]
            entry = entries.get(ptr)
            if entry is None:  # the storage's bytes: what moves (no grad_fn: no cycle)
                data = torch.empty(0, dtype=torch.uint8, device=tensor.device)
                entry = entries[ptr] = _Storage(data.set_(storage))
                for observe in KEPT_INPUT_OBSERVERS:  # the memory ledger counts it saved
                    observe(entry.device)
            return _Saved(tensor, entry)

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
                yield
        finally:
            holder.clear()

    def _unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        entry = saved.storage
        if entry.device is None:  # not prefetched (a backward earlier than planned)
            self._back(entry)
        if entry.ticket is not None:
            self.mover.ready(entry.ticket)
            entry.ticket = None
        assert entry.device is not None  # _back set it
        out = torch.empty(0, dtype=saved.dtype, device=entry.device.device)
        return out.set_(entry.device.untyped_storage(), saved.offset, saved.size, saved.stride)

    def after_forward(self, key: tuple[int, int], held: Any) -> None:
        """Move part ``key``'s saved storages out, except those in ``held`` (what the
        runtime keeps on the device anyway)."""
        storages = self._parts.get(key)
        if not storages:
            return
        from pipekernel.stage.memory import tensors_in

        kept = {t.untyped_storage().data_ptr() for t in tensors_in(held)}
        moved = 0
        for ptr, entry in list(storages.items()):
            if ptr in kept or entry.device is None:
                continue
            entry.host = self.mover.out(entry.device)
            moved += entry.device.numel()
            entry.device = None
        self.moved[key] = moved
        if not moved:  # nothing left the device: nothing to fetch back
            del self._parts[key]

    def enter(self, index: int) -> None:
        """Post the copy back of every part whose prefetch point is ``stream[index]``."""
        keys = self.points.prefetch_at.get(index) if self.points is not None else None
        for key in keys or ():
            # forgotten here: from now on only the part's graph holds its storages
            for entry in self._parts.pop(key, {}).values():
                if entry.device is None:
                    self._back(entry)

    def _back(self, entry: _Storage) -> None:
        """Post ``entry``'s copy back; its device bytes count as saved from now."""
        entry.device, entry.ticket = self.mover.back(entry.host)
        entry.host = None
        for observe in KEPT_INPUT_OBSERVERS:
            observe(entry.device)

    def end(self) -> None:
        """The batch is over (or abandoned): forget its parts."""
        self._parts = {}
