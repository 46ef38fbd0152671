"""Cost of the plugin surface on the instruction loop, per instruction.

Runs the Kernel over no-op handlers (so only dispatch and hooks are timed) with
(a) no plugin manager, (b) a plugin manager whose plugins implement no
per-instruction hook (the kernel skips the hook calls), (c) one monitor plugin
implementing before/after_instruction, (d) three such plugins. Prints ns per
instruction and the ratio to (a), all from one run.

Run: python benchmarks/plugin_overhead.py [--instructions 200000]
"""
from __future__ import annotations

import argparse
import time

import pipekernel as pk
from pipekernel.plugin import Kernel, make_plugin_manager
from pipekernel.schedules import instructions as isa


class Counter:
    def __init__(self):
        self.n = 0

    @pk.hookimpl
    def pipekernel_before_instruction(self, instruction, stage):
        self.n += 1

    @pk.hookimpl
    def pipekernel_after_instruction(self, instruction, stage, seconds):
        self.n += 1


def per_instruction_ns(hook, steps, repeats=5) -> float:
    handlers = {cls: (lambda i: None) for cls in (isa.Forward, isa.Backward, isa.SendActivation)}
    kernel = Kernel(handlers, hook=hook, rank=0, stage=0)
    count = sum(len(s) for s in steps)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        kernel.run(steps)
        best = min(best, time.perf_counter() - start)
    return best / count * 1e9


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--instructions", type=int, default=200_000)
    n = parser.parse_args().instructions // 3
    steps = [[isa.Forward(m), isa.SendActivation(m), isa.Backward(m)] for m in range(n)]
    cases = {
        "no plugin manager": None,
        "plugin manager, no instruction hooks": make_plugin_manager(autoload=False).hook,
        "1 monitor plugin": make_plugin_manager([Counter()], autoload=False).hook,
        "3 monitor plugins": make_plugin_manager([Counter(), Counter(), Counter()],
                                                    autoload=False).hook,
    }
    results = {name: per_instruction_ns(hook, steps) for name, hook in cases.items()}
    base = results["no plugin manager"]
    print(f"{'case':<40} {'ns/instruction':>15} {'ratio':>7}")
    for name, ns in results.items():
        print(f"{name:<40} {ns:>15.0f} {ns / base:>7.2f}")


if __name__ == "__main__":
    main()
