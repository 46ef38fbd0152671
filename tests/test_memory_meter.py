"""Exact memory accounting by category (pipekernel.stage.memory, plugins/memory.py)."""
from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import pipekernel as pk
from pipekernel.plugins.memory import MemoryMeter
from pipekernel.stage.memory import MemoryLedger
from pipekernel.testing import run_ranks

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def _ledger(module, optimizer=None, held=()):
    return MemoryLedger(module.parameters, lambda: optimizer, lambda: list(held))


def test_saved_tensors_counted_once_from_save_until_freed():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    ledger = _ledger(net)
    ledger.start()
    x = torch.randn(5, 8)
    out = net(x)
    now = ledger.now()
    # Linear saves its input (x: 5x8), tanh its output (5x16), the second Linear its
    # input (the same 5x16 storage: once); the weights are params, never saved.
    assert now["saved"] == (5 * 8 + 5 * 16) * 4
    assert now["params"] == sum(p.numel() for p in net.parameters()) * 4
    assert now["grads"] == 0
    out.sum().backward()
    del out
    now = ledger.now()
    assert now["saved"] == 5 * 8 * 4  # the graph freed tanh's output; x is still alive
    del x
    now = ledger.now()
    assert now["saved"] == 0  # counted until freed
    assert now["grads"] == now["params"]
    ledger.stop()
    y = net(torch.randn(5, 8))  # not recording any more
    assert ledger.now()["saved"] == 0
    del y


def test_shared_storage_claimed_by_first_category_and_peak_kept():
    net = nn.Linear(4, 4)
    opt = torch.optim.Adam(net.parameters())
    net(torch.randn(2, 4)).sum().backward()
    opt.step()
    held = [net.weight, torch.zeros(3)]  # a parameter held by the runtime: params only
    ledger = _ledger(net, opt, held)
    ledger.start()
    total = ledger.sample()
    params = 20 * 4
    # Adam: exp_avg and exp_avg_sq per parameter, plus a 0-dim float32 step each
    assert ledger.peak == {"params": params, "grads": params, "optimizer": 2 * params + 2 * 4,
                           "saved": 0, "buffers": 12}
    assert total == ledger.peak_total == sum(ledger.peak.values())
    held.pop()
    assert ledger.sample() == total - 12
    assert ledger.peak_total == total  # the peak stays
    assert ledger.metrics()["memory_peak_bytes"] == total
    ledger.stop()


class Block(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


def _worker(schedule, micro_batches, interval):
    meter = MemoryMeter()
    layers = [pk.LayerSpec(nn.Linear, 8, 16), *[pk.LayerSpec(Block) for _ in range(5)],
              pk.LayerSpec(nn.Linear, 16, 4)]
    module = pk.PipelineModule(layers, loss_fn=nn.MSELoss(), partition="uniform", seed=3,
                               activation_checkpoint_interval=interval)
    engine = pk.PipelineEngine(module, optimizer=lambda p: torch.optim.Adam(p, lr=1e-3),
                               micro_batches=micro_batches, schedule=schedule,
                               plugins=[meter], timeout=60)
    seen = []

    class Keep:
        @pk.hookimpl
        def pipekernel_after_train_batch(self, engine, loss, metrics):
            seen.append(dict(metrics))

    engine.pm.register(Keep())
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        batch = [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g))
                 for _ in range(micro_batches)]
        engine.train_batch(iter(batch))
    params = sum(p.numel() * 4 for p in engine.module.parameters())
    engine.close()
    del batch  # the user's inputs and labels, which autograd saved too
    runtime = engine.runtime  # the last batch's buffers and data stay until the next one
    runtime.buffers, runtime.data_iter, runtime.loss_keeper.labels = [], None, {}
    gc.collect()
    after = meter.ledger.now()
    tensors = len(list(engine.module.parameters()))
    return seen[-1], params, tensors, after, meter.ledger.samples


@pytest.mark.parametrize("interval", [0, 1])
def test_engine_reports_memory_by_category(interval):
    results = run_ranks(_worker, 2, "1f1b", 4, interval)
    for metrics, params, tensors, after, samples in results:
        assert metrics["memory_params_bytes"] == params
        # Adam: exp_avg and exp_avg_sq, and a 0-dim float32 step per parameter tensor
        assert metrics["memory_optimizer_bytes"] == 2 * params + 4 * tensors
        assert metrics["memory_grads_bytes"] == params  # grads live at the step's peak
        assert metrics["memory_saved_bytes"] > 0
        assert metrics["memory_peak_bytes"] == sum(
            metrics[f"memory_{c}_bytes"] for c in ("params", "grads", "optimizer", "saved",
                                                   "buffers"))
        assert after["saved"] == 0  # nothing saved outlives the runtime's buffers
        assert samples > 10
    print([r[0] for r in results])


def test_split_backward_schedules_report_no_saved_category():
    # saved_tensors_hooks + the split backward never free the packed tensors: the meter
    # must not record them there (it would leak), and says so by leaving the key out
    metrics, params, _, after, _ = run_ranks(_worker, 2, "zb-h1", 4, 0)[1]
    assert "memory_saved_bytes" not in metrics
    assert metrics["memory_params_bytes"] == params
    assert metrics["memory_peak_bytes"] == sum(
        metrics[f"memory_{c}_bytes"] for c in ("params", "grads", "optimizer", "buffers"))
