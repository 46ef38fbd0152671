"""Activation checkpointing leaves no trace in module state (issue 49).

A recomputed forward runs the layers again; every write a forward makes to a buffer
(BatchNorm's running statistics and ``num_batches_tracked``, a counter a layer keeps)
must happen once per micro-batch, as in one process without recomputation, under every
schedule (full backward, split backward, paired forward-and-backward) and interval. A
Python attribute that a recompute changes cannot be undone: it is refused by name.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import pipekernel as pk
from pipekernel.testing import assert_parity, reference_eval, reference_train, run_ranks


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

WIDTH = 8


class NormBlock(nn.Module):
    """Residual ``Linear + BatchNorm1d`` (with dropout where asked)."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.lin, self.bn, self.drop = nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Dropout(p)

    def forward(self, x):
        return x + self.drop(self.bn(self.lin(x)))


class Norm2d(nn.Module):
    """``BatchNorm2d`` over the features seen as 2 channels of 2x2 pixels."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(2, momentum=0.3)

    def forward(self, x):
        return self.bn(x.view(x.shape[0], 2, 2, WIDTH // 4)).reshape(x.shape[0], WIDTH)


class Counter(nn.Module):
    """Counts its training forwards in a registered buffer, and its output depends on the
    count: a recompute must see the count the original forward saw, and add nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if self.training:
            self.calls += 1
        return x + torch.tanh(self.lin(x)) * (1.0 + 0.1 * self.calls)


def bn_model(interval: int, p: float = 0.0) -> pk.PipelineModule:
    layers = [pk.LayerSpec(nn.Linear, 4, WIDTH), pk.LayerSpec(NormBlock, p),
              pk.LayerSpec(Norm2d), pk.LayerSpec(Counter), pk.LayerSpec(NormBlock, p),
              pk.LayerSpec(Counter), pk.LayerSpec(Norm2d), pk.LayerSpec(nn.Linear, WIDTH, 3)]
    return pk.PipelineModule(layers, loss_fn=nn.MSELoss(), partition="uniform", seed=5,
                             activation_checkpoint_interval=interval)


def data(step: int, micro_batches: int = 4):
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(6, 4, generator=g), torch.randn(6, 3, generator=g))
            for _ in range(micro_batches)]


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def assert_state_equal(state, reference, where):
    """Every entry (parameters and buffers): integer buffers exactly, floats to ~1e-6."""
    assert set(state) <= set(reference), where
    for key, value in state.items():
        if value.is_floating_point():
            torch.testing.assert_close(value, reference[key], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, key=key: f"{where}: {key}: {m}")
        else:
            assert torch.equal(value, reference[key]), (where, key, value, reference[key])


@pytest.mark.parametrize("interval", [1, 3])
def test_one_process_checkpointing_keeps_buffers_and_dropout_masks(interval):
    """With dropout on, one process: the recompute draws the same masks and the buffers
    end as without checkpointing, bit for bit in the counters."""
    def train(k):
        torch.manual_seed(0)
        return reference_train(bn_model(k, p=0.3), sgd, [[data(s)] for s in range(2)], 4)

    losses, state = train(0)
    ck_losses, ck_state = train(interval)
    assert_parity(ck_losses, losses, ck_state, state, rtol=1e-6, atol=1e-7)
    assert_state_equal(ck_state, state, f"interval {interval}")
    assert int(state["3.calls"]) == 8 and int(state["1.bn.num_batches_tracked"]) == 8


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_checkpointing_keeps_buffers_and_dropout_masks():
    """cuDNN's BatchNorm writes the running statistics its own way: the same outcome."""
    def train(k):
        torch.manual_seed(0)
        return reference_train(bn_model(k, p=0.3), sgd, [[data(s)] for s in range(2)], 4,
                               device="cuda")

    losses, state = train(0)
    ck_losses, ck_state = train(1)
    assert_parity(ck_losses, losses, ck_state, state, rtol=1e-5, atol=1e-6)
    assert_state_equal(ck_state, state, "cuda")


CASES = [("1f1b", None, 1), ("interleaved", 2, 1), ("zb-h1", None, 1), ("zbv", 2, 1),
         ("dualpipev", 2, 1), ("1f1b", None, 3), ("zbv", 2, 2)]
STEPS = 2


def _worker(cases):
    out = []
    for schedule, chunks, interval in cases:
        engine = pk.PipelineEngine(bn_model(interval), optimizer=sgd, micro_batches=4,
                                   schedule=schedule, chunks=chunks, timeout=60)
        losses = [engine.train_batch(iter(data(s))).item() for s in range(STEPS)]
        eval_loss = engine.eval_batch(iter(data(99)), micro_batches=4).item()
        out.append((losses, {k: v.detach().clone() for k, v in engine.module.state_dict().items()},
                    eval_loss))
        engine.close()
    return out


def test_buffers_under_every_schedule_equal_one_process_without_checkpointing():
    module = bn_model(0)
    ref_losses, ref_state = reference_train(module, sgd, [[data(s)] for s in range(STEPS)], 4)
    ref_eval, _ = reference_eval(module, ref_state, data(99))
    results = run_ranks(_worker, 2, CASES, timeout=300)
    for index, case in enumerate(CASES):
        covered = set()
        for rank_results in results:
            losses, state, eval_loss = rank_results[index]
            assert_parity(losses, ref_losses, state, ref_state)
            assert_state_equal(state, ref_state, case)
            assert eval_loss == pytest.approx(ref_eval, rel=1e-5), case
            covered |= set(state)
        assert covered == set(ref_state), case


class StepAttribute(nn.Module):
    """Keeps a plain Python counter: a side effect a recompute would repeat."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.steps = nn.Linear(WIDTH, WIDTH), 0

    def forward(self, x):
        self.steps += 1
        return torch.tanh(self.lin(x))


class LazyShape(nn.Module):
    """Records the width it saw at its first call only: the recompute changes nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.seen_width = nn.Linear(WIDTH, WIDTH), None

    def forward(self, x):
        if self.seen_width is None:
            self.seen_width = x.shape[-1]
        return torch.tanh(self.lin(x))


def _stage(layer_cls, interval):
    torch.manual_seed(0)
    layers = [pk.LayerSpec(nn.Linear, 4, WIDTH), pk.LayerSpec(layer_cls),
              pk.LayerSpec(nn.Linear, WIDTH, 3)]
    module = pk.PipelineModule(layers, loss_fn=nn.MSELoss(), seed=1,
                               activation_checkpoint_interval=interval)
    return module.build_stage(0, [0, 3])


def test_a_python_attribute_the_recompute_changes_is_refused_by_name():
    stage = _stage(StepAttribute, 1)
    x = torch.randn(6, 4)
    out = stage(x)
    with pytest.raises(pk.ConfigError) as info:
        out.sum().backward()
    text = str(info.value)
    assert "layer 1 (StepAttribute)" in text and "stage 0" in text and "'steps'" in text
    assert "register_buffer" in text and "activation_checkpoint_interval" in text
    # without checkpointing the same layer trains (its attribute counts each forward once)
    plain = _stage(StepAttribute, 0)
    plain(x).sum().backward()
    assert plain._modules["1"].steps == 1


def test_an_attribute_set_once_at_the_first_call_is_no_side_effect_of_the_recompute():
    stage = _stage(LazyShape, 1)
    for _ in range(2):
        stage(torch.randn(6, 4)).sum().backward()
    assert stage._modules["1"].seen_width == WIDTH


def test_deepspeeds_recomputed_runs_keep_buffers_too():
    """The DeepSpeed compatibility checkpoints its own runs of layers: the same mechanism."""
    from pipekernel.deepspeed.pipe import _Recomputed

    def run(recomputed):
        torch.manual_seed(0)
        block = NormBlock()
        call = _Recomputed([(1, block, None)], 0) if recomputed else (lambda m, v: m(v))
        for x, _ in data(0):
            call(block, x.repeat(1, 2)).pow(2).mean().backward()
        return block.state_dict()

    plain, recomputed = run(False), run(True)
    assert int(recomputed["bn.num_batches_tracked"]) == 4
    assert_state_equal(recomputed, plain, "deepspeed")
