"""activation_checkpoint_interval over layers that work in place: ``nn.ReLU(inplace=True)``
as a layer of its own, a block that adds in place (to its input and to its own result).

Checkpointing keeps a segment's input by reference and runs the segment again in
backward; a segment whose first layer modifies that input in place used to corrupt it
(``RuntimeError: ... modified by an inplace operation``, or a recomputation from the
modified values). The oracle is one process training without checkpointing.
"""
from __future__ import annotations

import os

import pytest
import torch
from sweep import Sweep
from torch import nn

import pipekernel as pk
from pipekernel.testing import assert_parity, reference_train

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

BOUNDS = [0, 5, 10]  # 2 stages; with interval 1 or 2 an in-place layer starts a segment


class ShiftAddBlock(nn.Module):
    """Adds a parameter to its input in place (valid: nothing saved that input), then a
    residual added in place to its own linear output."""

    def __init__(self, dim=16):
        super().__init__()
        self.lin, self.shift = nn.Linear(dim, dim), nn.Parameter(torch.full((dim,), 0.1))

    def forward(self, x):
        x += self.shift
        h = self.lin(x)
        h += x
        return h


def relu():
    return pk.LayerSpec(nn.ReLU, inplace=True)


def model(interval, partition=BOUNDS):
    layers = [pk.LayerSpec(nn.Linear, 8, 16), relu(), pk.LayerSpec(nn.Linear, 16, 16),
              pk.LayerSpec(ShiftAddBlock), relu(),
              pk.LayerSpec(nn.Linear, 16, 16), pk.LayerSpec(ShiftAddBlock), relu(),
              pk.LayerSpec(nn.Linear, 16, 16), pk.LayerSpec(nn.Linear, 16, 4)]
    return pk.PipelineModule(layers, loss_fn=nn.MSELoss(), partition=partition, seed=5,
                             activation_checkpoint_interval=interval)


def data(step, micro_batches=4):
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(3, 8, generator=g), torch.randn(3, 4, generator=g))
            for _ in range(micro_batches)]


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


STEPS = 3


def one_process(interval):
    return reference_train(model(interval, partition="uniform"), sgd,
                           [[data(s)] for s in range(STEPS)], 4)


@pytest.mark.parametrize("interval", [1, 2, 3])
def test_one_process_checkpointed_equals_plain(interval):
    losses, params = one_process(0)
    ck_losses, ck_params = one_process(interval)
    assert_parity(ck_losses, losses, ck_params, params, rtol=1e-6, atol=1e-7)


def test_a_layer_modifying_the_stage_input_does_not_change_the_caller_tensor():
    """The segment runs on its own copy: the caller's tensor (the checkpoint's saved
    input) keeps its values, through forward and the recomputation in backward."""
    stage = model(1).build_stage(0, [1, 5])  # ReLU(inplace=True) first
    x = torch.randn(3, 16, requires_grad=True)
    before = x.detach().clone()
    stage(x).sum().backward()
    assert torch.equal(x.detach(), before)
    plain = model(0).build_stage(0, [1, 5])
    plain.load_state_dict(stage.state_dict())
    y = before.clone().requires_grad_()
    plain(y.clone()).sum().backward()  # the clone: in-place on a leaf is refused
    torch.testing.assert_close(x.grad, y.grad, rtol=0, atol=0)


def pipeline_worker(interval, schedule):
    torch.manual_seed(3)
    engine = pk.PipelineEngine(model(interval), optimizer=sgd, micro_batches=4,
                               schedule=schedule, timeout=60)
    losses = [engine.train_batch(iter(data(s))).item() for s in range(STEPS)]
    state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    engine.close()
    return int(os.environ["RANK"]), losses, state


SWEEP = Sweep()  # the four cases below in one world of 2 ranks
PIPELINES = {(interval, schedule): SWEEP.case(f"interval-{interval}-{schedule}", 2,
                                              pipeline_worker, interval, schedule)
             for schedule in ("1f1b", "zb-h1") for interval in (1, 2)}


@pytest.mark.parametrize("interval,schedule", list(PIPELINES))
def test_two_stages_checkpointed_equal_one_process_plain(interval, schedule):
    losses, params = one_process(0)
    results = SWEEP.results(PIPELINES[interval, schedule])
    seen = set()
    for _, stage_losses, state in results:
        assert_parity(stage_losses, losses, state, params, rtol=1e-6, atol=1e-7)
        seen |= set(state)
    assert seen == set(params)  # every parameter compared
