"""Bucketed, overlapped gradient reduction over a group of replicas (layer 2).

:class:`GradReducer` averages (or sums) the gradients of a fixed list of
parameters over a transport group, in **buckets** of about ``bucket_bytes``,
the way ``torch.nn.parallel.DistributedDataParallel`` does:

* The **layout is fixed at construction** from the parameter list (every
  parameter that requires a gradient, bucketed in reverse order, so the last
  layers — whose gradients are ready first in backward — fill the first
  bucket). It is therefore the same on every replica: a parameter with no
  gradient on this replica (unused in its forward) is reduced as zeros, and
  gets the reduced gradient afterwards if any replica had one. A parameter that
  no replica gave a gradient keeps ``grad=None`` (so the optimizer skips it, as
  it would in one process). Each bucket carries one presence flag per
  parameter for that (a few extra elements; read back — a device sync — only
  on a replica that lacked a gradient).
* **When buckets start** (``transport.iall_reduce``), always in bucket order
  so every replica starts the same collectives in the same order:

  1. ``arm()`` — the ``ArmGradReduce`` instruction, right before the stage's last
     backward of the batch (:mod:`pipekernel.schedules.data_parallel`) —
     registers ``register_post_accumulate_grad_hook`` hooks on the parameters
     whose gradient lives on the parameter itself (the optimizer's tensor, as
     under fp32 and ``amp-bf16``). A bucket starts, *during* that backward, as
     soon as all its gradients are final and every earlier bucket started.
     Earlier micro-batches run no hook at all.
  2. ``backward_done()`` — the ``LaunchGradReduce`` instruction, after that last
     backward and the precision's ``after_backward`` in it — starts every bucket not
     started yet except the late ones. This is where gradients held on fp32
     **master copies** (``bf16``, ``fp16``) start: the precision writes them in
     ``after_backward``, after autograd finished, so no autograd hook can see them
     final. It also starts buckets held back by a parameter unused on this replica.
  3. ``finish()`` — called by the ``ReduceGrads`` instruction — starts what is
     left: the **late** parameters (tied weights, whose gradients are still
     summed across stages by ``ReduceTiedGrads`` after the backward), and
     everything when the overlap is off (``bucket_bytes=0``: one flat bucket
     per dtype, reduced here); then waits for every bucket in order, scales by
     ``1 / world`` (one ``mul_`` per bucket) and copies the results back into
     the gradients (``torch._foreach_copy_`` onto views made once).

A caller that never calls ``arm``/``backward_done`` still gets correct
results from ``finish`` alone, just without overlap.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import torch

from pipekernel.errors import PipelineError

__all__ = ["GradReducer", "settled_parameters"]

_HOOKED, _AFTER_BACKWARD, _LATE = 0, 1, 2
_KINDS = {_HOOKED: "hooked", _AFTER_BACKWARD: "after_backward", _LATE: "late"}


class _Bucket:
    """Some parameters' gradients, flattened into one buffer with a presence flag each."""

    __slots__ = ("kind", "members", "masters", "sizes", "buffer", "data", "flags", "views",
                 "remaining", "handle", "missing")

    def __init__(self, kind: int, members: list[int], masters: list[torch.Tensor]) -> None:
        self.kind, self.members, self.masters = kind, members, masters
        self.sizes = [m.numel() for m in masters]
        numel = sum(self.sizes)
        first = masters[0]
        self.buffer = torch.zeros(numel + len(masters), dtype=first.dtype, device=first.device)
        self.data, self.flags = self.buffer[:numel], self.buffer[numel:]
        self.views = [v.view(m.shape) for v, m in zip(self.data.split(self.sizes), masters)]
        self.remaining = len(members)
        self.handle: Any = None
        self.missing: list[int] = []

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class GradReducer:
    """Reduce the gradients of ``params`` over ``group`` in buckets (see the module docstring).

    :param params: the parameters, in the module's order (``module.parameters()``);
        those that do not require a gradient are left out. Every member of the
        group must pass the same list (same shapes and dtypes, same order).
    :param transport: a :class:`~pipekernel.comm.transport.Transport` (``iall_reduce``).
    :param group: the transport group to reduce over (``None``: its world).
    :param world: the group's size (the averaging divisor).
    :param bucket_bytes: bucket capacity in bytes; ``0`` turns the overlap off
        (one bucket per dtype and device, reduced in :meth:`finish`).
    :param master: ``param -> tensor whose .grad holds param's gradient``
        (``precision.master``; default: the parameter itself).
    :param late: parameters to reduce only in :meth:`finish` (tied weights).
    :param average: divide by ``world`` (data parallelism); ``False``: sum.
    :param names: parameter names for error messages (same order as ``params``).
    """

    def __init__(self, params: Iterable[torch.Tensor], transport: Any, group: Any, world: int,
                 bucket_bytes: int, *, master: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 late: Iterable[torch.Tensor] = (), average: bool = True,
                 names: Sequence[str] | None = None) -> None:
        params = list(params)
        names = list(names) if names is not None else [f"#{i}" for i in range(len(params))]
        seen: set[int] = set()
        keep = []
        for p, name in zip(params, names):
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                keep.append((p, name))
        self.params = [p for p, _ in keep]
        self.names = [name for _, name in keep]
        self.transport, self.group, self.world = transport, group, world
        self.bucket_bytes = int(bucket_bytes)
        self.scale = 1.0 / world if average else None
        master = master or (lambda p: p)
        self.masters = [master(p) for p in self.params]
        late_ids = {id(p) for p in late}

        def kind(i: int) -> int:
            if self.bucket_bytes <= 0 or id(self.params[i]) in late_ids:
                return _LATE
            return _HOOKED if self.masters[i] is self.params[i] else _AFTER_BACKWARD

        kinds = [kind(i) for i in range(len(self.params))]
        capacity = self.bucket_bytes if self.bucket_bytes > 0 else float("inf")
        #: Buckets in launch order: hooked, then after-backward, then late ones.
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        for k in (_HOOKED, _AFTER_BACKWARD, _LATE):
            members: list[int] = []
            size = 0
            for i in reversed(range(len(self.params))):  # backward order, as DDP
                if kinds[i] != k:
                    continue
                m = self.masters[i]
                nbytes = m.numel() * m.element_size()
                if members and (size + nbytes > capacity or not _same_kind(self.masters[
                        members[0]], m)):
                    self._add_bucket(k, members)
                    members, size = [], 0
                members.append(i)
                size += nbytes
            if members:
                self._add_bucket(k, members)
        self._hooked = [i for i, k in enumerate(kinds) if k == _HOOKED]
        self._hooks: list[Any] = []
        self._fired: dict[int, bool] = {}
        self._next = 0
        self._late_accumulations: list[int] = []
        self._launches: list[str] = []
        #: When each bucket of the last finished reduction started, in bucket order:
        #: ``"backward"`` (from a gradient hook), ``"after_backward"`` or ``"finish"``.
        self.last_launches: list[str] = []

    def _add_bucket(self, kind: int, members: list[int]) -> None:
        bucket = _Bucket(kind, members, [self.masters[i] for i in members])
        self.buckets.append(bucket)
        for i in members:
            self._bucket_of[i] = bucket

    # -- the three calls --------------------------------------------------------
    def arm(self, final: Iterable[torch.Tensor] = ()) -> None:
        """Call right before the last backward of the batch (``ArmGradReduce``): buckets
        of parameters whose gradient lives on the parameter start from gradient hooks as
        they fill.

        :param final: parameters whose gradients are final already (e.g. those of a
            model chunk whose last backward ran earlier): they count as ready now,
            so their buckets need not wait for the end of the backward.
        """
        self._disarm()
        self._reset()
        if not self._hooked:
            return
        self._fired = dict.fromkeys(self._hooked, False)
        done = {id(p) for p in final}
        self._hooks = [self.params[i].register_post_accumulate_grad_hook(partial(self._on_grad, i))
                       for i in self._hooked if id(self.params[i]) not in done]
        for i in self._hooked:
            if id(self.params[i]) in done:
                self._on_grad(i, self.params[i])

    def backward_done(self) -> None:
        """Call after the last backward (and the precision's ``after_backward``;
        ``LaunchGradReduce``): start
        every bucket but the late ones."""
        self._disarm()
        self._launch_while(lambda b: b.kind != _LATE, "after_backward")

    def finish(self) -> None:
        """Start what is left, wait for every bucket, scale and write the gradients back."""
        self._disarm()
        self._launch_while(lambda b: True, "finish")
        try:
            for bucket in self.buckets:
                self._write_back(bucket)
        finally:
            for bucket in self.buckets:
                bucket.handle = None
            self.last_launches, late = self._launches, self._late_accumulations
            self._reset()
        if late:
            names = ", ".join(self.names[i] for i in sorted(set(late)))
            raise PipelineError(
                f"parameter(s) {names} received gradient after their bucket's all-reduce "
                f"had started (a gradient accumulated twice in one backward, e.g. under "
                f"reentrant activation checkpointing); their reduced gradients are wrong",
                hint="turn the overlap off with grad_bucket_mb=0, or use non-reentrant "
                     "checkpointing (torch.utils.checkpoint(..., use_reentrant=False))")

    # -- internals ------------------------------------------------------------------
    def _reset(self) -> None:
        self._next = 0
        self._launches = []
        self._late_accumulations = []
        for bucket in self.buckets:
            bucket.remaining = len(bucket.members)
            bucket.handle = None

    def _disarm(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _on_grad(self, i: int, _param: torch.Tensor) -> None:
        bucket = self._bucket_of[i]
        if self._fired[i]:
            if bucket.handle is not None:  # too late: its bucket is already on the wire
                self._late_accumulations.append(i)
            return
        self._fired[i] = True
        bucket.remaining -= 1
        if bucket.remaining == 0:
            self._launch_while(lambda b: b.kind == _HOOKED and b.remaining == 0, "backward")

    def _launch_while(self, ready: Callable[[_Bucket], bool], when: str) -> None:
        """Start buckets in order from the first one not started, while ``ready``."""
        while self._next < len(self.buckets) and ready(self.buckets[self._next]):
            self._launch(self.buckets[self._next])
            self._launches.append(when)
            self._next += 1

    def _launch(self, bucket: _Bucket) -> None:
        held = [m.grad for m in bucket.masters]
        missing = [k for k, g in enumerate(held) if g is None]
        # none is None unless missing, and then the missing ones are filled just below
        grads: list[torch.Tensor] = held  # type: ignore[assignment]
        if missing:  # zeros in the same layout, so every replica reduces the same buffer
            zero = bucket.data.new_zeros(())
            grads = [zero.expand(n) if g is None else g for g, n in zip(held, bucket.sizes)]
        torch.cat([g.reshape(-1) for g in grads], out=bucket.data)
        bucket.flags.fill_(1)
        for k in missing:  # fills: indexing with a host list would copy it to the device
            bucket.flags[k] = 0
        bucket.missing = missing
        bucket.handle = self.transport.iall_reduce(bucket.buffer, "sum", self.group)

    def _write_back(self, bucket: _Bucket) -> None:
        bucket.handle.wait()
        if self.scale is not None:
            bucket.data.mul_(self.scale)
        if not bucket.missing:
            # no gradient missing here: every master has one (_launch checked)
            torch._foreach_copy_([m.grad for m in bucket.masters], bucket.views)  # type: ignore[misc]
            return
        present = bucket.flags.tolist()  # a device sync, only where this replica lacked grads
        missing = set(bucket.missing)
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for k, m in enumerate(bucket.masters):
            if k not in missing and m.grad is not None:  # not missing: it has a gradient
                dst.append(m.grad)
                src.append(bucket.views[k])
            elif present[k] > 0:  # another replica had one: take the reduced gradient
                m.grad = bucket.views[k].clone()
        if dst:
            torch._foreach_copy_(dst, src)

    # -- introspection ------------------------------------------------------------------
    def layout(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order (the same on every replica)."""
        return [[self.names[i] for i in bucket.members] for bucket in self.buckets]

    def __repr__(self) -> str:
        kinds = [_KINDS[b.kind] for b in self.buckets]
        return (f"GradReducer({len(self.params)} parameters, {len(self.buckets)} buckets "
                f"{[b.nbytes for b in self.buckets]} bytes, {kinds}, "
                f"world={self.world})")


def settled_parameters(last_chunk: int | None, parts: Sequence[Iterable[torch.Tensor]]
                       ) -> list[torch.Tensor]:
    """The parameters whose gradients are final before the stage's last backward.

    :param last_chunk: the chunk of the stage's last ``Backward``/``BackwardWeight`` of
        the batch (``None``: the stage runs no backward).
    :param parts: the parameters of each chunk the stage holds (``parts[chunk]``).

    A stage holding several chunks (interleaved, zbv) runs each chunk's last backward at
    a different time: only ``last_chunk`` still accumulates when
    :meth:`GradReducer.arm` is called; every other chunk's parameters (not shared with
    it) are settled, so passing them as ``final`` lets their buckets start at once
    instead of after the whole backward.
    """
    if last_chunk is None or len(parts) < 2:
        return []
    busy = {id(p) for p in parts[last_chunk]}
    seen: set[int] = set()
    out = []
    for chunk, params in enumerate(parts):
        if chunk == last_chunk:
            continue
        for p in params:
            if id(p) not in busy and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def _same_kind(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.device == b.device
