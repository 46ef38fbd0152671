"""Embedding level 2: pipekernel's instruction loop (the Kernel) with the host's own handlers.

The Kernel knows nothing of models or transports: it dispatches each
instruction to a handler from a table the host fills, calls the monitoring
hooks of the host's plugins around each one, and turns failures into errors
that name the step and instruction. Here a host trains a model with gradient
accumulation on one process by running the GPipe schedule of a one-stage
pipeline through its own handlers, and times every instruction with a plugin
on a plugin manager that loads nothing else (autoload off).

Run: ``python examples/embed_kernel.py``
"""
from __future__ import annotations

import collections

import torch

import pipekernel as pk
from pipekernel.plugin import Kernel, make_plugin_manager
from pipekernel.schedules import instructions as isa
from pipekernel.schedules import GPipe


class Timer:
    """A host plugin: total seconds per instruction kind."""

    def __init__(self):
        self.seconds = collections.Counter()

    @pk.hookimpl
    def pipekernel_after_instruction(self, instruction, stage, seconds):
        self.seconds[type(instruction).__name__] += seconds


class HostHandlers:
    """The host's own execution of the instructions: plain PyTorch on one process."""

    def __init__(self, model, optimizer, micro_batches):
        self.model, self.optimizer, self.micro_batches = model, optimizer, micro_batches
        self.inputs, self.losses, self.data = {}, [], None

    def table(self):
        return {isa.LoadMicroBatch: self.load, isa.Forward: self.forward,
                isa.Backward: self.backward, isa.ReduceTiedGrads: lambda i: None,
                isa.ReduceGrads: lambda i: None, isa.OptimizerStep: self.step}

    def load(self, i):
        self.inputs[i.buffer] = next(self.data)

    def forward(self, i):
        x, y = self.inputs[i.buffer]
        self.inputs[i.buffer] = torch.nn.functional.mse_loss(self.model(x), y)

    def backward(self, i):
        loss = self.inputs.pop(i.buffer)
        (loss / self.micro_batches).backward()
        self.losses.append(loss.item())

    def step(self, i):
        self.optimizer.step()
        self.optimizer.zero_grad()


def batches(steps, micro_batches):
    g = torch.Generator().manual_seed(0)
    return [[(torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g))
             for _ in range(micro_batches)] for _ in range(steps)]


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def train(steps=4, micro_batches=3):
    """Returns (mean loss per step, the Timer plugin)."""
    model = make_model()
    host = HostHandlers(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batches)
    timer = Timer()
    pm = make_plugin_manager([timer], autoload=False)
    kernel = Kernel(host.table(), hook=pm.hook, rank=0, stage=0)
    program = GPipe(1, 0, micro_batches).steps()
    means = []
    for items in batches(steps, micro_batches):
        host.data, host.losses = iter(items), []
        kernel.run(program)
        means.append(sum(host.losses) / micro_batches)
    return means, timer


def plain_loop(steps=4, micro_batches=3):
    """The same training without pipekernel: the oracle."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    means = []
    for items in batches(steps, micro_batches):
        total = 0.0
        for x, y in items:
            loss = torch.nn.functional.mse_loss(model(x), y)
            (loss / micro_batches).backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        means.append(total / micro_batches)
    return means


if __name__ == "__main__":
    losses, timer = train()
    print("kernel + host handlers:", [f"{x:.4f}" for x in losses])
    print("plain loop:            ", [f"{x:.4f}" for x in plain_loop()])
    print("seconds per instruction:", dict(timer.seconds))
