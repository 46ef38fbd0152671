"""CUDA-aware pieces that run on the CPU: pinned non-blocking host->device copies,
low-precision policies casting float buffers (not integer ones), and layer building
that restores the CPU RNG and leaves CUDA's alone until CUDA is initialised."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import pipekernel as pk
from pipekernel.model import module as pk_module
from pipekernel.stage.device import to_device
from pipekernel.plugins.precision import FP16, LowPrecision


# -- host -> device copies ------------------------------------------------------------
class FakeCpuTensor:
    """Records what to_device does to a CPU tensor bound for a GPU."""

    def __init__(self, pinned=False):
        self.device, self.pinned, self.calls = torch.device("cpu"), pinned, []

    def is_pinned(self):
        return self.pinned

    def pin_memory(self):
        self.calls.append("pin_memory")
        return FakeCpuTensor(pinned=True)

    def to(self, device, non_blocking=False):
        self.calls.append(("to", str(device), non_blocking, self.pinned))
        return "on " + str(device)

    def new_empty(self, shape, pin_memory=False):
        self.calls.append(("new_empty", pin_memory))
        self.staging = FakeCpuTensor(pinned=pin_memory)
        return self.staging

    def copy_(self, source):
        self.calls.append(("copy_", source))
        return self

    shape = (3,)


def test_cpu_to_cuda_copies_go_through_pinned_memory_without_blocking():
    t = FakeCpuTensor()
    pinned = []
    t.pin_memory = lambda: pinned.append(FakeCpuTensor(pinned=True)) or pinned[-1]
    assert to_device(t, torch.device("cuda", 0)) == "on cuda:0"
    assert t.calls == []  # the unpinned source itself is not copied to the device
    assert pinned[0].calls == [("to", "cuda:0", True, True)]


def test_an_already_pinned_tensor_is_staged_in_a_buffer_of_its_own():
    # the caller (a DataLoader(pin_memory=True)) may refill its pinned buffer as soon as
    # to_device returns, before the non-blocking copy ran: that copy reads a fresh one
    t = FakeCpuTensor(pinned=True)
    to_device(t, torch.device("cuda", 1))
    assert t.calls == [("new_empty", True)]  # the caller's tensor never goes to the device
    assert t.staging.calls == [("copy_", t), ("to", "cuda:1", True, True)]


def test_cpu_to_cpu_is_a_no_op():
    x = torch.arange(3)
    assert to_device(x, torch.device("cpu")) is x


# -- low precision and buffers ----------------------------------------------------------
class WithBuffers(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("scale", torch.full((3,), 0.5))
        self.register_buffer("count", torch.tensor(7, dtype=torch.long))
        self.register_buffer("mask", torch.tensor([True, False, True]))
        self.norm = nn.BatchNorm1d(3)

    def forward(self, x):
        return self.norm(self.lin(x) * self.scale)


@pytest.mark.parametrize("policy,dtype", [(LowPrecision, torch.bfloat16), (FP16, torch.float16)])
def test_low_precision_casts_float_buffers_and_leaves_integer_buffers(policy, dtype):
    module = WithBuffers()
    policy().prepare(module)
    assert module.scale.dtype == dtype and module.lin.weight.dtype == dtype
    assert module.norm.running_mean.dtype == dtype and module.norm.running_var.dtype == dtype
    assert module.count.dtype == torch.long and module.count.item() == 7
    assert module.norm.num_batches_tracked.dtype == torch.long
    assert module.mask.dtype == torch.bool
    assert module.scale.tolist() == [0.5] * 3
    # the forward runs in one dtype (a float32 buffer times a bf16 activation would promote)
    out = module(torch.randn(4, 3, dtype=dtype))
    assert out.dtype == dtype


def test_buffers_of_modules_kept_in_fp32_stay_fp32():
    class KeepNorm(LowPrecision):
        def keeps_fp32(self, name, module):
            return isinstance(module, nn.BatchNorm1d)

    module = WithBuffers()
    KeepNorm().prepare(module)
    assert module.norm.running_mean.dtype == torch.float32
    assert module.scale.dtype == torch.bfloat16


# -- RNG while building layers ----------------------------------------------------------
def _module():
    return pk.PipelineModule([pk.LayerSpec(nn.Linear, 4, 4) for _ in range(4)],
                             loss_fn=nn.MSELoss(), num_stages=2, seed=123)


def test_building_a_stage_restores_the_cpu_rng_and_follows_the_seeding_rule():
    torch.manual_seed(5)
    before = torch.get_rng_state()
    stage = _module().build_stage(1, [0, 2, 4])
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(123 + 2)
    assert torch.equal(stage.state_dict()["2.weight"], nn.Linear(4, 4).weight)


def test_before_cuda_is_initialised_building_does_not_queue_cuda_seeds(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: calls.append(seed))
    assert pk_module.seeded_cuda_devices() == []
    _module().build_stage(0, [0, 2, 4])
    assert calls == []


def test_once_cuda_is_initialised_its_generators_are_seeded_and_forked(monkeypatch):
    seeds, forked = [], []
    real_fork = torch.random.fork_rng

    def fork_rng(devices=None, enabled=True, **kw):
        forked.append(list(devices))
        return real_fork(devices=[], enabled=enabled)

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: seeds.append(seed))
    monkeypatch.setattr(torch.random, "fork_rng", fork_rng)
    _module().build_stage(1, [0, 2, 4])
    assert forked == [[0, 1]]  # every device's state is saved and restored
    assert seeds == [125, 126]  # layer i after seed + i, on CUDA as on the CPU
