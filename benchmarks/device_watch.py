"""What the device watch costs: the nccl and cupy-nccl transports' timeouts.

A device transport's ``wait()`` hands each transfer to a
:class:`~pipekernel.transports.device_watch.DeviceWatch` instead of blocking
the host (see ``transports/device_watch.py``). This measures, on real CUDA
events where there is a GPU (fake ones elsewhere):

* ``watch_us``: the hot-path cost per wait (the registration);
* ``poll_us``: one round of the watch thread over ``--inflight`` items in
  flight (``event.query()`` each), which runs once per ``watch_interval``.

Usage: ``python benchmarks/device_watch.py [--waits 20000] [--inflight 64]``
(prints one Markdown table row; ``gpu/check.sh`` runs it on the GPU).
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from pipekernel.transports.device_watch import DeviceWatch


class _FakeEvent:
    def query(self) -> bool:
        return False


def measure(make_event: Callable[[], Any], waits: int, inflight: int) -> dict[str, float]:
    """Per-wait registration and per-round polling cost, in microseconds."""
    watch = DeviceWatch(0, lambda event: bool(event.query()), thread=False)
    events = [make_event() for _ in range(waits)]
    start = time.perf_counter()
    for event in events:
        watch.watch(event, 300.0, "receive from", 1)
    watch_us = (time.perf_counter() - start) / waits * 1e6
    watch = DeviceWatch(0, lambda event: bool(event.query()), thread=False)
    for event in events[:inflight]:
        watch.watch(event, 300.0, "receive from", 1)
    rounds = 200
    start = time.perf_counter()
    for _ in range(rounds):
        watch.poll()
    poll_us = (time.perf_counter() - start) / rounds * 1e6
    return {"watch_us": watch_us, "poll_us": poll_us, "inflight": float(watch.pending())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waits", type=int, default=20000)
    parser.add_argument("--inflight", type=int, default=64)
    args = parser.parse_args(argv)
    import torch

    if torch.cuda.is_available():
        stream = torch.cuda.Stream()

        def make_event() -> Any:  # pending: recorded after a sleeping kernel on a side stream
            event = torch.cuda.Event()
            event.record(stream)
            return event

        with torch.cuda.stream(stream):
            torch.cuda._sleep(int(2e9))  # keep the events pending while we measure
        device = torch.cuda.get_device_name(0)
    else:
        make_event, device = _FakeEvent, "cpu (fake events)"
    result = measure(make_event, args.waits, args.inflight)
    print("| device | watch per wait (us) | poll of %d in flight (us) |" % args.inflight)
    print("| --- | ---: | ---: |")
    print(f"| {device} | {result['watch_us']:.2f} | {result['poll_us']:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
