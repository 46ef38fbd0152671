"""activation_checkpoint_interval: same training as without it (dropout on), less memory."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import pipekernel as pk
from pipekernel.testing import TensorBytes, assert_parity, reference_train, run_ranks


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


class DropBlock(nn.Module):
    def __init__(self, dim=32, p=0.3):
        super().__init__()
        self.lin, self.drop = nn.Linear(dim, dim), nn.Dropout(p)

    def forward(self, x):
        return x + torch.tanh(self.drop(self.lin(x)))


def model(interval, depth=6, partition="uniform"):
    layers = [pk.LayerSpec(nn.Linear, 8, 32), *[pk.LayerSpec(DropBlock) for _ in range(depth)],
              nn.Dropout(0.2), pk.LayerSpec(nn.Linear, 32, 4)]
    return pk.PipelineModule(layers, loss_fn=nn.MSELoss(), partition=partition, seed=11,
                             activation_checkpoint_interval=interval)


def data(step, micro_batches=3):
    g = torch.Generator().manual_seed(step)
    return [(torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g))
            for _ in range(micro_batches)]


def adam(params):
    return torch.optim.AdamW(params, lr=1e-2)


def train_one_process(interval, seed=0):
    torch.manual_seed(seed)
    return reference_train(model(interval), adam, [[data(s)] for s in range(3)], 3)


@pytest.mark.parametrize("interval", [1, 2, 3, 100])
def test_checkpointed_training_equals_plain_training_with_dropout(interval):
    losses, params = train_one_process(0)
    ck_losses, ck_params = train_one_process(interval)
    assert_parity(ck_losses, losses, ck_params, params, rtol=1e-6, atol=1e-7)
    # the comparison is meaningful: dropout changes the result with another seed
    other, _ = train_one_process(0, seed=1)
    assert abs(other[0] - losses[0]) > 1e-6


def test_checkpointing_keeps_less_in_memory():
    def peak(interval):
        torch.manual_seed(0)
        stage = model(interval, depth=12).build_stage(0, [0, 15])
        x = torch.randn(256, 8)
        with TensorBytes() as counter:
            stage(x).sum().backward()
        return counter.peak

    plain, every_4 = peak(0), peak(4)
    assert every_4 < 0.7 * plain, (plain, every_4)


def test_no_checkpointing_without_grad():
    stage = model(2).build_stage(0, [0, 9]).eval()
    x = torch.randn(4, 8)
    with torch.no_grad():
        out = stage(x)
    assert out.shape == (4, 4) and not out.requires_grad


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_checkpointing_lowers_the_cuda_peak_memory():
    def peak(interval):
        torch.manual_seed(0)
        stage = model(interval, depth=12).build_stage(0, [0, 15]).cuda()
        x = torch.randn(8192, 8, device="cuda")
        stage(x).sum().backward()  # warm-up: cuBLAS workspace, allocator pools
        stage.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()  # parameters and input
        stage(x).sum().backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    plain, every_4 = peak(0), peak(4)
    assert every_4 < 0.7 * plain, (plain, every_4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_checkpointed_equals_plain_on_cuda_with_dropout():
    def run(interval):
        torch.manual_seed(0)
        stage = model(interval).build_stage(0, [0, 9]).cuda()
        x = torch.randn(16, 8, device="cuda")
        stage(x).pow(2).mean().backward()
        return {k: p.grad.detach().clone() for k, p in stage.named_parameters()}

    plain, checkpointed = run(0), run(2)
    for key, grad in plain.items():
        torch.testing.assert_close(checkpointed[key], grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_invalid_interval(bad):
    with pytest.raises(pk.ConfigError, match="activation_checkpoint_interval"):
        model(bad)


def pipeline_worker(interval):
    torch.manual_seed(7 + int(os.environ["RANK"]))  # each stage its own dropout stream
    engine = pk.PipelineEngine(model(interval), optimizer=adam, micro_batches=3, timeout=60)
    losses = [engine.train_batch(iter(data(s))).item() for s in range(3)]
    eval_loss = engine.eval_batch(iter(data(9))).item()
    state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    engine.close()
    return losses, eval_loss, state


def test_pipeline_checkpointed_equals_plain_with_dropout():
    plain = run_ranks(pipeline_worker, 2, 0)
    checkpointed = run_ranks(pipeline_worker, 2, 2)
    for (losses, eval_loss, state), (ck_losses, ck_eval, ck_state) in zip(plain, checkpointed):
        assert_parity(ck_losses, losses, ck_state, state, rtol=1e-6, atol=1e-7)
        assert ck_eval == pytest.approx(eval_loss, rel=1e-6)
