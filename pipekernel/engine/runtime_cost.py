"""What the runtime itself costs per instruction, measured at plan time (layer 3 glue).

The planner's layer profile times each layer alone; a step also pays what no layer
does: the kernel loop's dispatch of every instruction, the loss (with the labels) on
the last stage, and each transfer's trip through the wire's :class:`~pipekernel.comm.wire.Channel`
(flatten, pack, header, unpack) beyond the raw message the link's ping-pong times.
:func:`measure_runtime` times those through the real pieces (the :class:`~pipekernel.kernel.loop.Kernel`
on a program of no-op instructions, the module's ``loss_fn``, a Channel ping-pong
between ranks 0 and 1) and :class:`RuntimeCosts` carries them to
:func:`~pipekernel.engine.planner.search`, which adds them per instruction to the
simulation (:func:`price`). Nothing here is fitted to a machine: every number is
measured where the plan is made.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["RuntimeCosts", "measure_runtime", "measure_dispatch", "price"]


@dataclass(frozen=True)
class RuntimeCosts:
    """Seconds the runtime spends per instruction beyond the profiled layers and link.

    :param dispatch_s: the kernel loop's cost of one instruction (every compute and
        transfer instruction pays it on its stage).
    :param loss_forward_s: the loss on one micro-batch's outputs with its labels (the last
        part's ``Forward`` pays it); :param loss_backward_s: its backward (the last part's
        ``Backward`` / ``BackwardInput``).
    :param wire_s: one transfer's trip through the wire beyond the raw message (packing on
        the sender, unpacking on the receiver, waking a peer that has waited: half on each
        side, like a host link).
    """

    dispatch_s: float = 0.0
    loss_forward_s: float = 0.0
    loss_backward_s: float = 0.0
    wire_s: float = 0.0


def price(table: dict[tuple[int, ...], dict[type, float]], host: dict[type, float],
          runtime: RuntimeCosts | None, last: tuple[int, int]) -> None:
    """Add ``runtime`` to a candidate's simulation prices, in place: ``table``
    (``{(stage, chunk): {compute class: seconds}}``), ``host`` (``{transfer class:
    seconds on the stage}``); ``last`` is the ``(stage, chunk)`` of the last part (the loss)."""
    if runtime is None:
        return
    from pipekernel.schedules.instructions import (Backward, BackwardInput, RecvActivation,
                                                   RecvGrad, SendActivation, SendGrad)
    for key, prices in table.items():
        for cls in prices:
            prices[cls] += runtime.dispatch_s
    if last in table:
        prices = table[last]
        from pipekernel.schedules.instructions import Forward
        for cls, extra in ((Forward, runtime.loss_forward_s), (Backward, runtime.loss_backward_s),
                           (BackwardInput, runtime.loss_backward_s)):
            if cls in prices:
                prices[cls] += extra
    for cls in (SendActivation, SendGrad, RecvActivation, RecvGrad):
        host[cls] = host.get(cls, 0.0) + runtime.dispatch_s + runtime.wire_s / 2


def device_clock(device: Any, clock: Callable[[], float] | None = None) -> Callable[[], float]:
    """``clock`` (default ``time.perf_counter``) that, on a CUDA ``device``, first waits for
    the device's queued work, so that a reading is when the work is done, not when the host
    queued it; elsewhere ``clock`` itself. Every plan-time measurement reads time through it."""
    import torch

    now = clock or time.perf_counter
    if torch.device(device or "cpu").type != "cuda":
        return now

    def synced() -> float:
        torch.cuda.synchronize(device)
        return now()
    return synced


def measure_dispatch(*, instructions: int = 64, repeats: int = 5,
                     clock: Callable[[], float] | None = None) -> float:
    """Seconds the :class:`~pipekernel.kernel.loop.Kernel` spends per instruction: a
    program of ``instructions`` no-op ``Forward`` s run through it (median of ``repeats``,
    after one untimed run), divided by its length."""
    from pipekernel.kernel.loop import Kernel
    from pipekernel.schedules.instructions import Forward

    now = clock or time.perf_counter
    kernel = Kernel({Forward: lambda instruction: None})
    program = [[Forward(k % 8)] for k in range(instructions)]
    kernel.run(program)
    times = []
    for _ in range(repeats):
        start = now()
        kernel.run(program)
        times.append((now() - start) / instructions)
    return statistics.median(times)


def _loss_times(module: Any, sample: Any, labels: Any, device: Any, repeats: int,
                warmup: int, now: Callable[[], float]) -> tuple[float, float]:
    """``(forward, backward)`` seconds of ``module.loss_fn`` on the model's outputs for
    ``sample`` and ``labels`` (``(0, 0)`` without a loss or labels)."""
    import torch

    loss_fn = getattr(module, "loss_fn", None)
    if loss_fn is None or labels is None:
        return 0.0, 0.0
    where = device or "cpu"
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        value = _to(sample, where)
        for index in range(len(module.layers)):
            layer, _ = module.measured_layer(index, where)
            value = layer(*value) if isinstance(value, tuple) else layer(value)
            del layer
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        return 0.0, 0.0
    labels = _to(labels, where)
    now = device_clock(where, now)
    forward, backward = [], []
    for i in range(warmup + repeats):
        out = value.detach().requires_grad_()
        start = now()
        loss = loss_fn(out, labels)
        middle = now()
        loss.backward()
        end = now()
        if i >= warmup:
            forward.append(middle - start)
            backward.append(end - middle)
    return statistics.median(forward), statistics.median(backward)


def _to(value: Any, device: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value


def _busy(seconds: float) -> None:
    """Keep the core for ``seconds`` (real time), as an instruction's compute does."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _wire_s(transport: Any, nbytes: float, repeats: int, warmup: int,
            now: Callable[[], float], work_s: float = 0.0) -> float:
    """What one transfer of ``nbytes`` (a float tensor) through the wire's Channel takes
    beyond a raw message of its bytes, one way, between ranks 0 and 1 (both call it): each
    round a raw ping-pong, back to back, then a Channel one in which each side first
    computes for ``work_s`` (as a stage runs an instruction before it sends: the peer has
    been waiting, and on a busy host waking it costs time a tight ping-pong never sees),
    less that work; the median of the rounds' differences after ``warmup`` (on a loaded
    host the mean is one descheduled round's)."""
    import torch

    from pipekernel.comm.transport import P2POp
    from pipekernel.comm.wire import Channel

    peer = 1 - transport.rank
    out, back = Channel(transport, peer), Channel(transport, peer)
    value = torch.zeros(max(int(nbytes) // 4, 1), device=transport.device)
    raw = torch.zeros(value.numel() * 4, dtype=torch.uint8, device=transport.device)
    now = device_clock(transport.device, now)

    def send() -> None:
        _busy(work_s)
        data, control = out.send_ops(value)
        handles = [*transport.control.batch_isend_irecv(control)] if control else []
        handles += transport.batch_isend_irecv(data) if data else []
        for handle in handles:
            handle.wait()

    def recv() -> None:
        pending = back.recv_ops()
        if pending.control_ops:
            pending.control_handles = list(
                transport.control.batch_isend_irecv(pending.control_ops))
        if pending.ops:
            pending.handles = list(transport.batch_isend_irecv(pending.ops))
        back.finish(pending)

    def raw_op(op: str) -> Callable[[], None]:
        def run() -> None:
            for handle in transport.batch_isend_irecv([P2POp(op, raw, peer)]):
                handle.wait()
        return run

    def round_trip(ops: tuple[Callable[[], None], Callable[[], None]]) -> float:
        start = now()
        for op in (ops if transport.rank == 0 else ops[::-1]):
            op()
        return (now() - start) / 2

    extra = []
    for _ in range(warmup + repeats):
        bare = round_trip((raw_op("send"), raw_op("recv")))
        extra.append(round_trip((send, recv)) - work_s - bare)
    return max(statistics.median(extra[warmup:]), 0.0)


def measure_runtime(module: Any, sample: Any, labels: Any = None, transport: Any = None,
                    device: Any = None, *, link: Any = None, nbytes: float = 0.0,
                    work_s: float = 0.0,
                    repeats: int = 5, warmup: int = 2,
                    clock: Callable[[], float] | None = None) -> RuntimeCosts:
    """The runtime's costs per instruction (:class:`RuntimeCosts`), the same on every rank.

    Global rank 0 times the kernel's dispatch (:func:`measure_dispatch`) and the module's
    loss on ``sample``'s outputs with ``labels`` (none: no loss term); with a ``link``
    (the measured :class:`~pipekernel.engine.planner.Link`: the raw message, which the
    wire adds to) and two or more ranks, ranks 0 and 1 time a transfer of ``nbytes``
    through the wire's Channel, each side computing ``work_s`` before it sends (a typical
    instruction's seconds), beside a raw message of those bytes, and keep the difference
    (the wire and the peer's wake-up). Rank 0 broadcasts. Collective: every rank of
    ``transport`` calls it at the same point.
    """
    import torch

    now = clock or time.perf_counter
    rank = getattr(transport, "rank", 0)
    values = torch.zeros(4, dtype=torch.float64)
    if rank == 0:
        values[0] = measure_dispatch(repeats=repeats, clock=now)
        values[1], values[2] = _loss_times(module, sample, labels, device, repeats, warmup, now)
    many = transport is not None and getattr(transport, "world_size", 1) > 1
    if many and link is not None and rank in (0, 1):
        values[3] = _wire_s(transport, nbytes, repeats, warmup, now, work_s)
    if many:
        moved = values.to(transport.device)
        transport.broadcast(moved, 0)
        values = moved.cpu()
    dispatch, loss_f, loss_b, wire = (float(v) for v in values.tolist())
    return RuntimeCosts(dispatch, loss_f, loss_b, wire)
