"""Embedding level 1: use only pipekernel's schedules and simulator, with your own runtime.

A host framework that has its own execution engine can still take the
schedule (which instruction runs when, in which buffer) from pipekernel. Here
the "framework" is a toy: stage ``s`` multiplies its input by a scalar weight
``w[s]``, the loss is ``0.5 * (y - label)**2``, and each stage runs in its own
thread with queues as links. It executes the instructions of any registered
training schedule and gets the same gradients as a plain sequential
computation. No torch is used by the host.

Run: ``python examples/embed_schedules.py``
"""
from __future__ import annotations

import queue
import threading

from pipekernel.schedules import instructions as isa
from pipekernel.schedules import BUILTIN_SCHEDULES, format_grid, simulate


class ToyStage:
    """The host's own runtime for one stage: buffers, links and one handler per instruction."""

    def __init__(self, stage, weights, data, links):
        self.stage, self.w, self.data, self.links = stage, weights[stage], data, links
        self.last = stage == len(weights) - 1
        self.grad_w, self.buffers, self.losses = 0.0, {}, []
        self.handlers = {
            isa.LoadMicroBatch: self.load, isa.RecvActivation: self.recv_act,
            isa.Forward: self.forward, isa.SendActivation: self.send_act,
            isa.RecvGrad: self.recv_grad, isa.Backward: self.backward,
            isa.SendGrad: self.send_grad, isa.ReduceTiedGrads: lambda i: None,
            isa.ReduceGrads: lambda i: None, isa.OptimizerStep: lambda i: None,
        }

    def run(self, steps):
        for step in steps:
            for instruction in step:
                self.handlers[type(instruction)](instruction)

    def slot(self, i):
        return self.buffers.setdefault(i.buffer, {})

    def load(self, i):
        x, label = self.data[i.micro_batch]
        self.buffers[i.buffer] = {"x": x, "label": label} if self.stage == 0 else \
            {**self.slot(i), "label": label}

    def recv_act(self, i):
        self.slot(i)["x"] = self.links[("act", self.stage)].get(timeout=10)

    def forward(self, i):
        b = self.slot(i)
        b["y"] = self.w * b["x"]
        if self.last:
            self.losses.append(0.5 * (b["y"] - b["label"]) ** 2)

    def send_act(self, i):
        self.links[("act", self.stage + 1)].put(self.slot(i)["y"])

    def recv_grad(self, i):
        self.slot(i)["dy"] = self.links[("grad", self.stage)].get(timeout=10)

    def backward(self, i):
        b = self.slot(i)
        dy = b["y"] - b["label"] if self.last else b["dy"]
        self.grad_w += dy * b["x"]
        b["dx"] = dy * self.w

    def send_grad(self, i):
        self.links[("grad", self.stage - 1)].put(self.slot(i)["dx"])


def run(schedule="1f1b", weights=(0.5, -1.5, 2.0, 0.75), micro_batches=6):
    """Train one batch with the host runtime; returns ``(losses, weight gradients)``."""
    data = [(1.0 + m, 0.25 * m) for m in range(micro_batches)]
    cls, n = BUILTIN_SCHEDULES[schedule], len(weights)
    links = {(kind, s): queue.Queue() for kind in ("act", "grad") for s in range(n)}
    stages = [ToyStage(s, list(weights), data, links) for s in range(n)]
    threads = [threading.Thread(target=st.run, args=(cls(n, s, micro_batches).steps(),))
               for s, st in enumerate(stages)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return stages[-1].losses, [st.grad_w for st in stages]


def sequential(weights=(0.5, -1.5, 2.0, 0.75), micro_batches=6):
    """The same computation without a pipeline: the oracle."""
    losses, grads = [], [0.0] * len(weights)
    for m in range(micro_batches):
        x, label = 1.0 + m, 0.25 * m
        inputs = []
        for w in weights:
            inputs.append(x)
            x = w * x
        losses.append(0.5 * (x - label) ** 2)
        dy = x - label
        for s in reversed(range(len(weights))):
            grads[s] += dy * inputs[s]
            dy *= weights[s]
    return losses, grads


if __name__ == "__main__":
    for name in ("1f1b", "gpipe"):
        result = simulate(BUILTIN_SCHEDULES[name], 4, 6)
        print(f"{name}: bubble {result.bubble_fraction:.3f}, buffers {result.buffers}")
        print(format_grid(result))
        print("host runtime gradients:", run(name)[1])
    print("sequential gradients:  ", sequential()[1])
