"""Cost of the monitor plugin per instruction, and per training step.

1. Kernel loop, no-op handlers (the worst case: nothing to hide the hooks behind):
   no plugin / an empty plugin with both instruction hooks (pluggy's own cost) /
   the Monitor (pluggy + timers + event list). Reported: ns per instruction.
2. A real 2-stage run on gloo (CPU): step time without and with the Monitor
   (csv + jsonl + trace sinks), same model and data, alternating runs.

Run:  python benchmarks/monitor_overhead.py [--instructions 200000] [--steps 30]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from torch import nn

import pipekernel as pk
from pipekernel.schedules import instructions as isa
from pipekernel.kernel.loop import Kernel
from pipekernel.extend.manager import make_plugin_manager
from pipekernel.plugins.monitor import Monitor
from pipekernel.testing import run_ranks


class EmptyHooks:
    @pk.hookimpl
    def pipekernel_before_instruction(self, instruction):
        pass

    @pk.hookimpl
    def pipekernel_after_instruction(self, instruction, seconds):
        pass


def kernel_ns(plugins, n: int, repeats: int = 5) -> float:
    pm = make_plugin_manager(plugins, autoload=False)
    noop = lambda instruction: None  # noqa: E731
    kernel = Kernel({isa.Forward: noop, isa.Backward: noop, isa.RecvActivation: noop},
                    hook=pm.hook, rank=0, stage=0)
    step = [isa.RecvActivation(0), isa.Forward(0), isa.Backward(0), isa.Forward(1)]
    steps = [step] * (n // len(step))
    best = float("inf")
    for _ in range(repeats):
        for p in plugins:  # keep the monitor's event list from growing across repeats
            if isinstance(p, Monitor):
                p._events = []
        start = time.perf_counter()
        kernel.run(steps)
        best = min(best, time.perf_counter() - start)
    return best / (len(steps) * len(step)) * 1e9


def train_worker(monitor: bool, steps: int, out_dir: str, width: int, micro_batches: int):
    layers = []
    for _ in range(8):
        layers += [pk.LayerSpec(nn.Linear, width, width), torch.tanh]
    module = pk.PipelineModule(layers, loss_fn=nn.MSELoss(), num_stages=2, partition="uniform",
                               seed=0)
    plugins = [Monitor(out_dir=out_dir, sinks=("csv", "jsonl", "trace"), heartbeat=1.0)] \
        if monitor else []
    engine = pk.PipelineEngine(module, optimizer=lambda p: torch.optim.SGD(p, lr=1e-3),
                               micro_batches=micro_batches, plugins=plugins, timeout=120)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(16, width, generator=g), torch.randn(16, width, generator=g))
            for _ in range(micro_batches)]
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.train_batch(iter(data))
        times.append(time.perf_counter() - start)
    instructions = len(engine._program(engine.schedule_cls).stream)
    engine.close()
    return statistics.median(times[2:]), instructions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instructions", type=int, default=200_000)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--micro-batches", type=int, default=8)
    args = parser.parse_args()

    base = kernel_ns([], args.instructions)
    empty = kernel_ns([EmptyHooks()], args.instructions)
    mon = kernel_ns([Monitor(sinks=(), heartbeat=0)], args.instructions)
    print("1. kernel loop, no-op handlers, ns per instruction (best of 5)")
    print(f"   no plugin            {base:8.0f}")
    print(f"   empty hooks (pluggy) {empty:8.0f}   +{empty - base:.0f} ns")
    print(f"   Monitor              {mon:8.0f}   +{mon - base:.0f} ns "
          f"(monitor's own work: +{mon - empty:.0f} ns)")

    print(f"2. 2-stage gloo run, width {args.width}, {args.micro_batches} micro-batches, "
          f"median step of {args.steps} (first 2 dropped), {args.rounds} alternating rounds")
    off, on = [], []
    with tempfile.TemporaryDirectory() as out:
        for _ in range(args.rounds):
            for monitor, bucket in ((False, off), (True, on)):
                results = run_ranks(train_worker, 2, monitor, args.steps, out, args.width,
                                    args.micro_batches, timeout=600)
                bucket.append(max(r[0] for r in results))
                instructions = max(r[1] for r in results)
    a, b = statistics.median(off), statistics.median(on)
    print(f"   without monitor {a * 1e3:8.2f} ms/step")
    print(f"   with monitor    {b * 1e3:8.2f} ms/step   ratio {b / a:.3f} "
          f"({(b - a) / instructions * 1e6:+.1f} us per instruction, "
          f"{instructions} instructions per step on the busiest stage)")


if __name__ == "__main__":
    main()
