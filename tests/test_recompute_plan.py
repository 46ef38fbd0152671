"""Recomputation as a plan knob (issue 46, items 4 and 5): the engine's per-stage
``recompute``, the planner's time and memory model of it, and ``pk.auto(memory_budget=...)``
choosing it. Exact accounting (the ledger's bytes, the simulator's units); no timing."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import pipekernel as pk
from pipekernel.engine.planner import MEMORY_MARGIN, LayerCosts, search
from pipekernel.engine.recompute_option import format_recompute, resolve_recompute
from pipekernel.errors import ConfigError
from pipekernel.model.partitioning import format_bytes
from pipekernel.plugins.partition import balance
from pipekernel.schedules import BUILTIN_SCHEDULES
from pipekernel.schedules.sim_memory import part_bytes
from pipekernel.testing import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import memory_table as table  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

TRAINING = {k: v for k, v in BUILTIN_SCHEDULES.items() if v.trains}


# -- the option ---------------------------------------------------------------------------

def test_recompute_option_resolves_per_stage_and_refuses_by_name():
    assert resolve_recompute(None, 3, 2) == (2, 2, 2)  # the module's interval: the default
    assert resolve_recompute(1, 3, 0) == (1, 1, 1)
    assert resolve_recompute("all", 2, 0) == (1, 1)
    assert resolve_recompute([1, "none", "3"], 3, 2) == (1, 0, 3)  # the engine's wins
    assert format_recompute((1, 0)) == "stage 0: every 1 layer(s), stage 1: none"
    assert format_recompute((0, 0)) == "none"
    with pytest.raises(ConfigError, match=r"gives 2 stage\(s\); the pipeline has 3"):
        resolve_recompute([1, 0], 3, 0)
    with pytest.raises(ConfigError, match=r"recompute\[1\] must be an int >= 0"):
        resolve_recompute([1, -1], 2, 0)
    with pytest.raises(ConfigError, match="recompute must be None"):
        resolve_recompute(1.5, 2, 0)
    with pytest.raises(ConfigError, match="recompute must be None, an int >= 0"):
        resolve_recompute(True, 2, 0)


def test_the_command_lines_recompute_reads_as_the_engines():
    from pipekernel.apps.train import recompute_option

    assert recompute_option("") is None  # the planner's, or the module's
    assert recompute_option("1") == 1 and recompute_option("all") == "all"
    assert recompute_option("1,0") == [1, 0]
    assert resolve_recompute(recompute_option("1, none"), 2, 0) == (1, 0)


# -- the model: memory and time -----------------------------------------------------------

def test_a_recomputed_stage_keeps_only_its_layers_inputs():
    saved, outputs = [100.0] * 4, [10.0] * 4
    parts = part_bytes([0, 2, 4], 2, 1, "loop", saved=saved, outputs=outputs, input_bytes=5.0,
                       checkpoint_interval=(1, 0))
    assert parts[(0, 0)].saved == 5.0 + 10.0  # the inputs of layers 0 and 1
    assert parts[(1, 0)].saved == 200.0       # stage 1 keeps everything
    every = part_bytes([0, 2, 4], 2, 1, "loop", saved=saved, outputs=outputs, input_bytes=5.0,
                       checkpoint_interval=2)  # one int: every stage (the module's knob)
    assert every[(0, 0)].saved == 5.0 and every[(1, 0)].saved == 10.0


def _costs(layers=8, m=4, act=1000.0, out=10.0):
    return {m: LayerCosts([1.0] * layers, [2.0] * layers, [100.0] * layers, [act] * layers,
                          output_bytes=[out] * layers)}


def test_a_recomputed_backward_costs_one_more_forward():
    only = {"1f1b": TRAINING["1f1b"]}
    plain = search(_costs(), 2, only, balance=balance, recompute=(0, 0))
    both = search(_costs(), 2, only, balance=balance, recompute=(1, 1))
    # 1F1B, 2 stages, 4 micro-batches, 4 layers a stage: (m + p - 1) x (F + B) = 5 x 12;
    # recomputed, every backward runs the forward again: 5 x 16
    assert plain.predicted_step_s == pytest.approx(60.0)
    assert both.predicted_step_s == pytest.approx(80.0)
    assert both.recompute == (1, 1) and both.fields()["recompute"] == [1, 1]
    assert max(both.candidates[0].stage_bytes) < max(plain.candidates[0].stage_bytes)
    # a split backward recomputes in its input pass and again in its weight pass
    zb = {"zb-h1": TRAINING["zb-h1"]}
    split = search(_costs(), 2, zb, balance=balance, recompute=(0, 0)).predicted_step_s
    redo = search(_costs(), 2, zb, balance=balance, recompute=(1, 1)).predicted_step_s
    assert redo - split >= 4 * 2 * 4.0 - 1e-9  # >= m x (I + W) extra forwards of 4 layers


def test_under_a_budget_auto_recomputes_the_fullest_stage_first():
    only = {"1f1b": TRAINING["1f1b"]}
    costs = _costs()
    free = search(costs, 2, only, balance=balance)
    assert free.recompute == (0, 0)  # no budget: nothing recomputed (the module has none)
    peaks = {r: max(search(costs, 2, only, balance=balance, recompute=r).candidates[0]
                    .stage_bytes) for r in ((0, 0), (1, 0), (1, 1))}
    assert peaks[(1, 1)] < peaks[(1, 0)] < peaks[(0, 0)]
    # stage 0 of 1F1B holds p micro-batches, stage 1 one: it is recomputed first
    plan = search(costs, 2, only, balance=balance, memory_budget=peaks[(1, 0)] * 1.06)
    assert plan.recompute == (1, 0)
    assert plan.predicted_step_s > free.predicted_step_s
    text = plan.format()
    assert "recompute: stage 0: every 1 layer(s), stage 1: none" in text
    assert "stage 0: static" in text and "; recompute every 1 layer(s)" in text
    assert "pipekernel: schedule 'auto' chose 1f1b" in plan.announce()
    # the engine's recompute fixes it: the search does not change it
    with pytest.raises(ConfigError, match="no candidate fits"):
        search(costs, 2, only, balance=balance, memory_budget=peaks[(1, 0)] * 1.06,
               recompute=(0, 0))


def test_a_budget_nothing_fits_names_the_smallest_with_recompute_counted():
    only = {"1f1b": TRAINING["1f1b"], "gpipe": TRAINING["gpipe"]}
    costs = _costs()
    with pytest.raises(ConfigError) as err:
        search(costs, 2, only, balance=balance, memory_budget=1.0)
    text = str(err.value)
    assert "smallest budget that would fit is" in text
    least = min(max(c.stage_bytes) for c in search(costs, 2, only, balance=balance,
                                                    recompute=(1, 1)).candidates
                if c.stage_bytes)
    assert format_bytes(least * (1 + MEMORY_MARGIN)) in text
    # and that budget is indeed enough: the search then fits, recomputing
    plan = search(costs, 2, only, balance=balance, memory_budget=least * (1 + MEMORY_MARGIN))
    assert any(plan.recompute)


# -- the engine: parity and measured bytes ------------------------------------------------

class DropBlock(nn.Module):
    def __init__(self, dim=16, p=0.3):
        super().__init__()
        self.lin, self.drop = nn.Linear(dim, dim), nn.Dropout(p)

    def forward(self, x):
        return x + torch.tanh(self.drop(self.lin(x)))


def _model(depth):
    layers = [pk.LayerSpec(nn.Linear, 8, 16), *[pk.LayerSpec(DropBlock) for _ in range(depth)],
              pk.LayerSpec(nn.Linear, 16, 4)]
    return pk.PipelineModule(layers, loss_fn=nn.MSELoss(), partition="uniform", seed=5)


def _parity_worker(schedule, chunks, micro_batches):
    results = {}
    try:
        pk.PipelineEngine(_model(4), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                          micro_batches=micro_batches, transport="gloo", timeout=120,
                          recompute=[1, 0, 1])
        results["refused"] = ""
    except ConfigError as err:
        results["refused"] = str(err)
    for recompute in (None, [1, 0], [0, 2]):
        torch.manual_seed(1)  # dropout draws the same masks in every run
        engine = pk.PipelineEngine(_model(4 * chunks), optimizer=lambda p: torch.optim.AdamW(
            p, lr=1e-2), micro_batches=micro_batches, schedule=schedule,
            chunks=chunks if chunks > 1 else None, transport="gloo", timeout=120,
            recompute=recompute)
        losses = []
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            batch = [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g))
                     for _ in range(micro_batches)]
            losses.append(float(engine.train_batch(iter(batch))))
        results[str(recompute)] = (losses, {k: v.clone() for k, v in
                                            engine.module.state_dict().items()},
                                   engine.recompute)
        engine.close()
    return results


@pytest.mark.multirank
@pytest.mark.parametrize("schedule,chunks,micro_batches", [
    ("1f1b", 1, 4), ("zbv", 2, 4), ("gpipe", 1, 4), ("interleaved", 2, 4), ("zb-h1", 1, 4),
    ("zb-h2", 1, 4), ("dualpipev", 2, 4), ("v-half", 2, 4), ("v-min", 2, 4)])
def test_recompute_on_some_stages_trains_bit_identically(schedule, chunks, micro_batches):
    for rank, results in enumerate(run_ranks(_parity_worker, 2, schedule, chunks,
                                             micro_batches)):
        losses, params, _ = results["None"]
        for given, intervals in (("[1, 0]", (1, 0)), ("[0, 2]", (0, 2))):
            other, other_params, used = results[given]
            assert used == intervals
            assert other == losses, (rank, given)  # bit-identical losses
            assert params.keys() == other_params.keys()
            for key in params:
                assert torch.equal(params[key], other_params[key]), (rank, given, key)
        assert results["None"][2] == (0, 0)
        assert "gives 3 stage(s); the pipeline has 2" in results["refused"]


@pytest.mark.multirank
def test_recompute_on_one_stage_predicted_as_measured():
    # the ledger's exact bytes against the model, recompute on one stage and off on the
    # other, for 1f1b and zbv: the static state exact, the peak within the model's margin
    cells = [("1f1b", 2, 4, (1, 0)), ("zbv", 2, 4, (0, 1)), ("zb-h1", 2, 4, (1, 0))]
    rows = table.compare(cells, 2)
    for cell, stage, measured, predicted in rows:
        assert predicted is not None, (cell, measured.get("refused"))
        ratio, dynamic = table.ratios(measured, predicted)
        assert abs(ratio - 1) <= MEMORY_MARGIN, (cell, stage, measured, predicted)
        assert abs(dynamic - 1) <= 0.15, (cell, stage, measured, predicted)
        # parameters, optimizer state and gradients: exact
        assert measured["memory_params_bytes"] + measured["memory_optimizer_bytes"] == \
            predicted["static"] and measured["memory_grads_bytes"] == predicted["grads"]
        if cell[3][stage]:  # a recomputed stage keeps its layers' inputs: to within 1%
            # (exact but for the last position's loss: 28672 B = 28672 B on 1F1B's stage 0)
            assert abs(measured["memory_saved_bytes"] - predicted["saved"]) <= \
                0.01 * measured["memory_saved_bytes"], (cell, stage, measured, predicted)
    # and recomputation is what changed: the recomputed stage saves less than without
    plain = {(c[0], s): m for c, s, m, _ in table.compare(
        [(name, 2, 4, 0) for name, _, _, _ in cells], 2)}
    for (name, _, _, intervals), stage, measured, _ in rows:
        if intervals[stage]:
            assert measured["memory_saved_bytes"] < plain[(name, stage)]["memory_saved_bytes"]


# -- auto under a budget: recomputation chosen, the measured peak within it ----------------

class SteadyClock:
    """The profiler's bytes as measured, its seconds replaced by a function of each layer's
    bytes: every run partitions by time the same way, so a budget computed in one engine
    binds the next (the bytes are exact either way)."""

    @pk.hookimpl(wrapper=True)
    def pipekernel_partition(self, method, layers, num_stages, context):
        from pipekernel.model.partitioning import Profile

        result = yield
        if isinstance(method, Profile) and context.layer_static_bytes:
            context.layer_costs = [1e-3 * (1 + b / 1e4) for b in context.layer_static_bytes]
            context.layer_forward_seconds = [c / 3 for c in context.layer_costs]
            context.layer_split_backward_seconds = None
        return result


def _auto_budget_worker():
    from pipekernel.extend.manager import make_plugin_manager, registered_schedules
    from pipekernel.plugins.memory import MemoryMeter

    torch.set_num_threads(1)
    sample = torch.randn(table.BATCH, table.IN)
    labels = torch.randn(table.BATCH, table.OUT)
    names = ["1f1b", "zbv", "v-half"]

    def engine(budget, plugins=()):
        return pk.PipelineEngine(
            table._module(2, 2, 0), optimizer=lambda p: torch.optim.Adam(p, lr=1e-3),
            micro_batches=4, transport="gloo", plugins=[SteadyClock(), *plugins], timeout=120,
            schedule=pk.auto(memory_budget=budget, sample=sample, labels=labels,
                             schedules=names, repeats=1, warmup=0, measure_link=False))

    free = engine(None)
    costs, plan = free.plan.costs, free.plan
    free.close()
    every = {k: v for k, v in registered_schedules(make_plugin_manager()).items()
             if k in names}

    def least(recompute):  # the smallest peak of any candidate, as the search prices it
        found = search(costs, 2, every, balance=balance, recompute=recompute, runs=4)
        return min(c.peak_bytes for c in found.candidates
                   if c.peak_bytes and not c.what_if)

    plain, redone = least((0, 0)), least((1, 1))
    # below every candidate without recomputation, above the least with it on both stages
    budget = int(redone * (1 + MEMORY_MARGIN)) + 1
    meter = MemoryMeter()
    bounded = engine(budget, [meter])
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        bounded.train_batch(iter([(torch.randn(table.BATCH, table.IN, generator=g),
                                   torch.randn(table.BATCH, table.OUT, generator=g))
                                  for _ in range(4)]))
    chosen = next(c for c in bounded.plan.candidates if c.key() == bounded.plan.key())
    out = (plain, redone, budget, bounded.plan.recompute, bounded.recompute,
           meter.last["memory_peak_bytes"], chosen.stage_bytes[bounded.stage],
           bounded.plan.format(top=3), plan.recompute)
    bounded.close()
    try:
        engine(1)
        refusal = ""
    except ConfigError as err:
        refusal = str(err)
    return out + (refusal,)


@pytest.mark.multirank
def test_auto_under_a_budget_recomputes_and_its_measured_peak_fits():
    results = run_ranks(_auto_budget_worker, 2, timeout=900)
    plain, redone, budget, chosen, used, _, _, text, free, refusal = results[0]
    assert redone * (1 + MEMORY_MARGIN) < budget < plain  # only recomputation fits
    assert free == (0, 0)  # no budget: nothing recomputed
    assert any(chosen) and used == chosen  # the engine runs what the plan chose
    for rank, result in enumerate(results):
        peak, predicted = result[5], result[6]
        assert peak <= budget, (rank, peak, budget)  # measured, every stage
        assert abs(predicted / peak - 1) <= MEMORY_MARGIN, (rank, peak, predicted)
    assert "recompute: stage" in text and "; recompute every 1 layer(s)" in text
    assert "predicted memory per stage" in text
    assert "smallest budget that would fit is" in refusal


def test_a_model_with_skips_is_planned_without_recompute_and_says_what_is_not_counted():
    from models import skips

    from pipekernel.engine.planner import plan_module
    from pipekernel.extend.manager import make_plugin_manager

    request = pk.auto(sample=torch.randn(4, 8), schedules=["1f1b"], chunks=[1], repeats=1,
                      warmup=0, micro_batches=[2])
    free = plan_module(skips(num_stages=2), request, num_stages=2, micro_batches=2,
                       pm=make_plugin_manager())
    # a budget that only recomputation could meet is refused, not met by a plan that
    # cannot run (recomputation with skip connections is refused by the engine)
    tight = min(c.peak_bytes for c in free.candidates if c.peak_bytes) * 0.8
    with pytest.raises(ConfigError, match="no candidate"):
        plan_module(skips(num_stages=2), pk.auto(**{**request.__dict__, "memory_budget": tight}),
                    num_stages=2, micro_batches=2, pm=make_plugin_manager())
    assert free.recompute == (0, 0)
    assert "note: skip connections' stashes (enc, mask, near) are not in the memory model" \
        in free.format()


def test_auto_counts_the_labels_it_is_given_on_the_last_stage():
    from models import mlp

    from pipekernel.engine.planner import plan_module
    from pipekernel.extend.manager import make_plugin_manager

    def plan(labels):
        request = pk.auto(sample=torch.randn(4, 8), labels=labels, schedules=["1f1b"],
                          chunks=[1], repeats=1, warmup=0, micro_batches=[2, 4])
        return plan_module(mlp(num_stages=2), request, num_stages=2, micro_batches=2,
                           pm=make_plugin_manager())

    without, given = plan(None), plan(torch.randn(4, 4))
    # 4 rows of 4 fp32 labels at 2 micro-batches; the batch re-split as 4: 2 rows each
    assert without.costs[2].label_bytes == 0.0 and given.costs[2].label_bytes == 64.0
    assert given.costs[4].label_bytes == 32.0
    last = {c.key(): c.stage_memory[1]["saved"] for c in given.candidates if c.stage_memory}
    same = [c for c in without.candidates if c.stage_memory and c.key() in last]
    assert same  # the memory-balanced partitions at least (bytes do not depend on the clock)
    for c in same:  # the loss saves them: more on the last stage
        assert last[c.key()] > c.stage_memory[1]["saved"]
