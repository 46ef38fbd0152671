"""Partition methods: exact balancing, each method beats uniform on unequal layers,
profile agrees across ranks, the report, and clear errors."""
from __future__ import annotations

import itertools
import logging
import os
import math
import random

import pytest
import torch
from torch import nn

import pipekernel as pk
from pipekernel.plugin import make_plugin_manager
from pipekernel.plugins.partition import balance, measure_layers, stage_costs
from pipekernel.testing import run_ranks


# ---------------------------------------------------------------------------
# exact balancing against brute force
# ---------------------------------------------------------------------------

def brute_force(weights, stages, acts=None, in_flight=None):
    n = len(weights)
    best = math.inf
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *cuts, n]
        best = min(best, max(stage_costs(bounds, weights, acts, in_flight)))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_balance_is_optimal_on_random_costs(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 10)
    stages = rng.randint(1, n)
    kind = seed % 3  # floats, small integers (many ties), zeros mixed in
    if kind == 0:
        weights = [rng.random() * 10 for _ in range(n)]
    elif kind == 1:
        weights = [float(rng.randint(1, 4)) for _ in range(n)]
    else:
        weights = [rng.choice([0.0, 0.0, rng.random()]) for _ in range(n)]
    bounds = balance(weights, stages)
    assert len(bounds) == stages + 1 and bounds[0] == 0 and bounds[-1] == n
    assert all(a < b for a, b in zip(bounds, bounds[1:])), f"empty stage in {bounds}"
    got = max(stage_costs(bounds, weights))
    assert math.isclose(got, brute_force(weights, stages), rel_tol=1e-9, abs_tol=1e-12)


@pytest.mark.parametrize("order", ["1f1b", "increasing", "random"])
@pytest.mark.parametrize("seed", range(20))
def test_balance_with_in_flight_activations_is_optimal(seed, order):
    # the in-flight counts 1F1B gives (falling by stage), rising ones and any order: the
    # best cost of the first stages is not monotone in the layers they cover when the
    # counts differ, which a binary search over the cut got wrong (76 of 3000 cases)
    rng = random.Random(1000 + seed)
    n = rng.randint(2, 9)
    stages = rng.randint(2, n)
    weights = [rng.random() * 5 for _ in range(n)]
    acts = [rng.random() * 3 for _ in range(n)]
    counts = [rng.randint(1, 2 * stages) for _ in range(stages)]
    in_flight = {"1f1b": [stages - s for s in range(stages)],
                 "increasing": sorted(counts), "random": counts}[order]
    bounds = balance(weights, stages, acts, in_flight)
    assert all(a < b for a, b in zip(bounds, bounds[1:]))
    got = max(stage_costs(bounds, weights, acts, in_flight))
    assert math.isclose(got, brute_force(weights, stages, acts, in_flight), rel_tol=1e-9)


def test_balance_with_in_flight_counts_finds_the_cut_a_search_misses():
    # a binary search over the cut returned [0, 1, 2, 3, 5] here (largest stage 16)
    weights, acts, in_flight = [2.0, 4.0, 6.0, 1.0, 3.0], [3.0, 3.0, 2.0, 3.0, 1.0], [1, 4, 3, 2]
    bounds = balance(weights, 4, acts, in_flight)
    assert bounds == [0, 2, 3, 4, 5]
    assert stage_costs(bounds, weights, acts, in_flight) == [12.0, 14.0, 10.0, 5.0]


def test_balance_scales_to_many_layers():
    weights = [float((i * 7919) % 13 + 1) for i in range(2000)]
    bounds = balance(weights, 16)
    costs = stage_costs(bounds, weights)
    assert len(bounds) == 17 and max(costs) >= sum(weights) / 16
    assert max(costs) <= sum(weights) / 16 + max(weights)  # within one layer of perfect


# ---------------------------------------------------------------------------
# a model with deliberately unequal layers
# ---------------------------------------------------------------------------

class Wide(nn.Module):
    """Much more parameters, compute and activation memory than a Small layer."""

    def __init__(self, dim=16, hidden=1024):
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Small(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def unequal(partition, layers=None):
    layers = layers or [pk.LayerSpec(Wide), pk.LayerSpec(Wide),
                        *[pk.LayerSpec(Small) for _ in range(6)]]
    return pk.PipelineModule(layers, loss_fn=nn.MSELoss(), partition=partition, seed=3)


SAMPLE = torch.randn(64, 16)


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def costs_of(method, stages=2):
    """The partition of ``method`` and the per-layer costs it balanced."""
    module = unequal(method)
    context = pk.PartitionContext(module=module, num_stages=stages)
    bounds = module.partition(stages, context=context)
    return bounds, context.layer_costs, context


@pytest.mark.parametrize("method", [
    # profile is tested with a fake clock below: real timings depend on the machine's load
    "parameters", "type:wide", "memory", pk.memory(SAMPLE),
    pk.balance([9, 9, 1, 1, 1, 1, 1, 1]), pk.balance(lambda layer: 9.0 if layer.typename is Wide
                                                     else 1.0),
    lambda layer: 9.0 if layer.typename is Wide else 1.0,
], ids=["parameters", "type", "memory-no-sample", "memory", "balance-list",
        "balance-callable", "callable"])
def test_each_method_beats_uniform_on_unequal_layers(method):
    bounds, costs, _ = costs_of(method)
    uniform = unequal("uniform").partition(2)
    assert uniform == [0, 4, 8]  # both wide layers on stage 0
    ours = max(stage_costs(bounds, costs))
    theirs = max(stage_costs(uniform, costs))
    assert ours < theirs, (bounds, costs)
    assert bounds[1] == 1, "the two wide layers belong on different stages"


class FakeClock:
    """Seconds that pass only when a :class:`Timed` layer runs (forward or backward)."""

    def __init__(self):
        self.now, self.calls = 0.0, 0
        self.spike_at = None  # the call whose repetition takes an extra 100 s

    def __call__(self):
        self.calls += 1
        if self.calls == self.spike_at:
            self.now += 100.0
        return self.now


class _Advance(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, clock, seconds):
        ctx.clock, ctx.seconds = clock, seconds
        clock.now += seconds / 2
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.now += ctx.seconds / 2
        return grad, None, None


class Timed(nn.Module):
    """A layer that costs ``seconds`` on the fake clock, half forward, half backward."""

    def __init__(self, clock, seconds):
        super().__init__()
        self.clock, self.seconds = clock, seconds
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return _Advance.apply(self.lin(x), self.clock, self.seconds)


@pytest.mark.parametrize("spike", [False, True])
def test_profile_balances_the_seconds_its_clock_measures(spike):
    clock = FakeClock()
    if spike:
        clock.spike_at = 6  # the end of layer 0's second timed repetition (warmup 1)
    costs = [0.9, 0.9, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]
    layers = [pk.LayerSpec(Timed, clock, c) for c in costs]
    module = pk.PipelineModule(layers, loss_fn=nn.MSELoss(), seed=3,
                               partition=pk.profile(SAMPLE, repeats=3, warmup=1, clock=clock))
    context = pk.PartitionContext(module=module, num_stages=2)
    bounds = module.partition(2, context=context)
    # the median of three repetitions: one 100 s outlier does not move it
    assert context.layer_costs == pytest.approx(costs, abs=1e-12)
    assert bounds == [0, 1, 8]  # 0.9 | 0.9 + 6 x 0.1: the two slow layers apart
    # start, end of forward and end of backward of every repetition
    assert clock.calls == 3 * 4 * len(costs)
    assert context.layer_forward_seconds == pytest.approx([c / 2 for c in costs], abs=1e-12)
    # what crosses a boundary after each layer, for the planner's transfer model
    assert context.layer_output_bytes == [SAMPLE.numel() * 4.0] * len(costs)


def test_memory_gives_early_stages_fewer_layers_under_1f1b():
    layers = [pk.LayerSpec(Small) for _ in range(12)]
    module = unequal(pk.memory(torch.randn(512, 16)), layers)
    context = pk.PartitionContext(module=module, num_stages=3)  # in flight: 3, 2, 1
    bounds = module.partition(3, context=context)
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    assert sizes[0] < sizes[1] < sizes[2], bounds
    # with every stage keeping the same number in flight (GPipe), layers split evenly
    context = pk.PartitionContext(module=module, num_stages=3, in_flight=[4, 4, 4])
    assert module.partition(3, context=context) == [0, 4, 8, 12]


def test_measured_methods_handle_tied_layers_and_integer_inputs():
    from models import tied_lm

    ids = torch.randint(0, 13, (3, 6))
    for method in (pk.memory(ids), pk.profile(ids, repeats=2)):
        module = tied_lm()
        module.partition_method = method
        context = pk.PartitionContext(module=module, num_stages=3)
        bounds = module.partition(3, context=context)
        assert len(bounds) == 4 and all(a < b for a, b in zip(bounds, bounds[1:]))
        assert len(context.layer_costs) == len(module.layers)
        assert context.layer_activation_bytes[-1] > 0  # the head saves the hidden state


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_profile_and_memory_measure_on_cuda():
    # sizes where a Wide layer's compute, not the launches, sets its time on a GPU: at the
    # CPU tests' 64 x 16 an H200 timed every layer at about its launch cost and profile
    # balanced 5 layers against 3 ([0, 5, 8]; the first run of gpu/check.sh)
    dim = 256
    layers = [pk.LayerSpec(Wide, dim, 16384), pk.LayerSpec(Wide, dim, 16384),
              *[pk.LayerSpec(Small, dim) for _ in range(6)]]
    sample = torch.randn(4096, dim, device="cuda")
    seconds, static, act = measure_layers(unequal("uniform", layers), sample, "cuda",
                                          repeats=3)
    assert all(t > 0 for t in seconds) and seconds[0] > seconds[-1]
    assert act[0] > 0 and static[0] > static[-1]
    module = unequal(pk.profile(sample, repeats=3), layers)
    context = pk.PartitionContext(module=module, num_stages=2, device=torch.device("cuda"))
    assert module.partition(2, context=context) == [0, 1, 8]


def test_measure_layers_counts_activations_once_and_optimizer_state():
    module = unequal("uniform", [pk.LayerSpec(Small), pk.LayerSpec(Small)])
    x = torch.randn(10, 16)
    _, static, act = measure_layers(module, x, time_it=False,
                                    optimizer=lambda p: torch.optim.Adam(p))
    param_bytes = (16 * 16 + 16) * 4
    # params + grads + Adam's two moments (+ its scalar step counters)
    assert 4 * param_bytes <= static[0] <= 4 * param_bytes + 64
    _, static_sgd, _ = measure_layers(module, x, time_it=False,
                                      optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    assert static_sgd[0] == 2 * param_bytes  # plain SGD keeps no state
    # layer 0 saves its input and its tanh output; layer 1 reuses that output as input
    assert act[0] == 2 * 10 * 16 * 4
    assert act[1] == 10 * 16 * 4


def test_measuring_leaves_the_global_rng_and_user_modules_alone():
    own = nn.Linear(16, 16)
    before = own.weight.detach().clone()
    module = unequal(pk.memory(SAMPLE), [own, pk.LayerSpec(Small)])
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    module.partition(2, context=pk.PartitionContext(
        module=module, num_stages=2, optimizer=lambda p: torch.optim.SGD(p, lr=1.0)))
    assert torch.equal(torch.rand(3), expected)
    assert torch.equal(own.weight, before)


# ---------------------------------------------------------------------------
# plugins and the report
# ---------------------------------------------------------------------------

class HeadAlone:
    """A third-party method by name: the last layer gets its own stage."""

    @pk.hookimpl
    def pipekernel_partition(self, method, layers, num_stages, context):
        if method != "head-alone":
            return None
        context.layer_costs, context.cost_unit = [1.0] * len(layers), "layers"
        return [*balance([1.0] * (len(layers) - 1), num_stages - 1), len(layers)]


def test_third_party_method_by_name_and_report():
    module = unequal("head-alone")
    pm = make_plugin_manager([HeadAlone()])
    context = pk.PartitionContext(module=module, num_stages=3)
    bounds = module.partition(3, pm, context)
    assert bounds[-2:] == [7, 8]
    report = pk.PartitionReport.build(module, bounds, context)
    assert sorted(s.num_layers for s in report.stages) == [1, 3, 4]
    assert report.stages[-1].num_layers == 1
    assert sum(s.parameters for s in report.stages) == sum(module.parameter_counts())
    assert report.imbalance == pytest.approx(4 / (8 / 3))
    assert report.memory_imbalance is None  # the plugin gave no memory estimate
    text = report.format()
    assert "'head-alone'" in text and "7-7" in text and "imbalance" in text


def test_report_of_memory_method_counts_in_flight_activations():
    bounds, costs, context = costs_of(pk.memory(SAMPLE), stages=2)
    report = pk.PartitionReport.build(context.module, bounds, context)
    for s, stage in enumerate(report.stages):
        lo, hi = bounds[s], bounds[s + 1]
        expected = sum(context.layer_static_bytes[lo:hi]) + \
            context.in_flight[s] * sum(context.layer_activation_bytes[lo:hi])
        assert stage.memory_bytes == pytest.approx(expected)
        assert stage.cost == pytest.approx(expected)  # memory balances exactly these bytes
    assert report.as_dict()["stages"][0]["layers"] == [0, 0]


# ---------------------------------------------------------------------------
# clear errors
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("partition,stages,match", [
    ("type:(unclosed", 2, "invalid regex"),
    ("type:NoSuchLayer", 2, "matches no layer type"),
    ([0, 5, 3, 8], 3, "not increasing"),
    ([0, 4, 4, 8], 3, "not increasing"),
    ([0, 4, 7], 2, "do not cover all 8 layers"),
    ([1, 4, 8], 2, "do not cover all 8 layers"),
    ([0, 8], 2, "describe 1 stages"),
    ([0, 4.0, 8], 2, "must be integers"),
    ("profile", 2, "needs a sample"),
    (pk.balance([1, 2]), 2, "2 costs for 8 layers"),
    (pk.balance([1, 1, 1, -1, 1, 1, 1, 1]), 2, "finite and >= 0"),
    (pk.balance(lambda layer: layer.missing), 2, "cost function failed on layer 0"),
    (pk.profile(torch.randn(4, 3)), 2, "layer 0 .Wide. failed on the sample"),
    ("no-such-method", 2, "no partition plugin understands"),
])
def test_partition_errors_are_clear(partition, stages, match):
    with pytest.raises(pk.ConfigError, match=match) as info:
        unequal(partition).partition(stages)
    assert "how to fix" in str(info.value)


def test_more_stages_than_layers():
    with pytest.raises(pk.ConfigError, match="cannot split 8 layers into 9 stages"):
        unequal("uniform").partition(9)
    with pytest.raises(pk.ConfigError, match="cannot split 3 layers into 4 stages"):
        balance([1, 2, 3], 4)


# ---------------------------------------------------------------------------
# every rank agrees on a measured partition
# ---------------------------------------------------------------------------

def profile_worker(stages, fail):
    torch.manual_seed(100 + int(os.environ["RANK"]))
    # equal layers: which partition wins is decided by timing noise, different on each rank
    layers = [pk.LayerSpec(Small) for _ in range(9)]
    sample = torch.randn(3, 5) if fail else torch.randn(32, 16)
    module = pk.PipelineModule(layers, loss_fn=nn.MSELoss(), seed=1,
                               partition=pk.profile(sample, repeats=3))
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logger = logging.getLogger("pipekernel.partition")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    engine = pk.PipelineEngine(module, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                               micro_batches=2, timeout=60)
    logger.removeHandler(handler)
    if logged:  # only rank 0 logs the report
        assert len(logged) == 1 and "seconds" in logged[0] and int(os.environ["RANK"]) == 0
    else:
        assert int(os.environ["RANK"]) != 0, "rank 0 must log the partition report"
    g = torch.Generator().manual_seed(0)  # the same micro-batches on every stage
    data = [(torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)) for _ in range(2)]
    loss = engine.train_batch(iter(data)).item()
    report = engine.partition_report.as_dict()
    engine.close()
    return engine.bounds, report, loss


def test_profile_gives_the_same_partition_on_every_rank():
    results = run_ranks(profile_worker, 3, 3, False, timeout=300)
    bounds, report, loss = results[0]
    assert report["cost_unit"] == "seconds" and len(report["stages"]) == 3
    for other_bounds, other_report, other_loss in results[1:]:
        assert other_bounds == bounds
        assert other_report == report  # the measured seconds too: measured once, broadcast
        assert other_loss == loss


def test_profile_failure_on_rank_0_reaches_every_rank():
    with pytest.raises(Exception, match="failed on the sample|rank 0 failed"):
        run_ranks(profile_worker, 2, 2, True, timeout=300)
