"""The monitor's clocks: where an instruction's time is measured.

On the CPU an instruction takes the time its handler ran on the host
(``time.perf_counter``). On a GPU the handler only *queues* kernels: host time
would be launch time, GPU work would show up later as "wait", and the bubble
would look larger than it is. There the time is measured where the work runs,
with CUDA events recorded on torch's current stream before and after each
instruction; they are read once per step, at its end (one host sync per step,
only with a monitor).

Both timers have one shape, so the monitor never branches on the device:

* ``mark()``: a point in time (a step's start or end);
* ``start(host)`` / ``stop(start, seconds)``: the marks around one instruction
  (``host`` is ``perf_counter()`` at its start, ``seconds`` the kernel's host
  measurement, which the host timer uses as is);
* ``resolve(anchor, spans, end)``: ``([(offset, seconds)], total)``, every span's
  start as seconds after ``anchor`` and its length, and ``end - anchor``.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["HostTimer", "CudaTimer", "make_timer"]


class HostTimer:
    """``time.perf_counter`` (the CPU's timer); ``clock`` is a fake in tests."""

    on_device = False

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock

    def mark(self) -> float:
        return self.clock()

    def start(self, host: float) -> float:
        return host

    def stop(self, start: float, seconds: float) -> float:
        return start + seconds

    def resolve(self, anchor: float, spans: Sequence[tuple[float, float]], end: float
                ) -> tuple[list[tuple[float, float]], float]:
        return [(s - anchor, e - s) for s, e in spans], end - anchor


class CudaTimer:
    """CUDA events on the current stream (see the module docstring).

    :param event: factory of timing events (``torch.cuda.Event(enable_timing=True)``
        by default; a fake in tests), each with ``record()``, ``synchronize()`` and
        ``elapsed_time(other)`` in milliseconds.
    """

    on_device = True

    def __init__(self, event: Callable[[], Any] | None = None) -> None:
        if event is None:
            import torch

            def event() -> Any:
                return torch.cuda.Event(enable_timing=True)
        self.event = event

    def mark(self) -> Any:
        ev = self.event()
        ev.record()
        return ev

    def start(self, host: float) -> Any:
        return self.mark()

    def stop(self, start: Any, seconds: float) -> Any:
        return self.mark()

    def resolve(self, anchor: Any, spans: Sequence[tuple[Any, Any]], end: Any
                ) -> tuple[list[tuple[float, float]], float]:
        end.synchronize()  # the one host sync of the step: every earlier event is done too
        out = [(anchor.elapsed_time(s) / 1e3, s.elapsed_time(e) / 1e3) for s, e in spans]
        return out, anchor.elapsed_time(end) / 1e3


def make_timer(device: Any, clock: Callable[[], float] = time.perf_counter
               ) -> HostTimer | CudaTimer:
    """The timer for a stage whose tensors live on ``device`` (``clock``: the host timer's)."""
    return CudaTimer() if getattr(device, "type", "cpu") == "cuda" else HostTimer(clock)
