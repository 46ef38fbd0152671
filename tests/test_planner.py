"""``schedule="auto"``: the planner's search under injected costs, the memory budget,
and every rank of an engine choosing the same plan. No timing is asserted."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from models import mlp, mlp_data, sgd

import pipekernel as pk
from pipekernel.plugin import make_plugin_manager
from pipekernel.errors import ConfigError
from pipekernel.engine.planner import Auto, LayerCosts, search
from pipekernel.plugins.partition import balance
from pipekernel.schedules import BUILTIN_SCHEDULES, simulate
from pipekernel.schedules.instructions import Backward, BackwardInput, BackwardWeight, Forward
from pipekernel.testing import run_ranks

TRAINING = {k: v for k, v in BUILTIN_SCHEDULES.items() if v.trains}


def fixed_batch_costs(layers=8, counts=(1, 2, 4, 8), batch=8.0, overhead=0.05,
                      act=100.0, static=1000.0):
    """A fixed batch split into m micro-batches: each costs batch/m units plus an overhead."""
    out = {}
    for m in counts:
        f = batch / m / layers + overhead
        out[m] = LayerCosts([f] * layers, [2 * f] * layers, [static] * layers,
                            [act * batch / m] * layers)
    return out


def test_auto_picks_the_predicted_fastest_and_ranks_every_candidate():
    costs = fixed_batch_costs()
    plan = search(costs, 2, TRAINING, balance=balance)
    runnable = [c for c in plan.candidates if c.predicted_step_s is not None]
    assert plan.predicted_step_s == min(c.predicted_step_s for c in runnable)
    assert [c.predicted_step_s for c in runnable] == sorted(c.predicted_step_s for c in runnable)
    first = plan.candidates[0]
    assert (first.schedule, first.chunks, first.micro_batches, first.bounds) == \
        (plan.schedule, plan.chunks, plan.micro_batches, plan.bounds)
    # every (schedule, chunks, micro-batches) the schedules allow was considered
    seen = {(c.schedule, c.chunks, c.micro_batches) for c in plan.candidates}
    for name, cls in TRAINING.items():
        for chunks in {c for c in (1, 2) if cls.min_chunks <= c <= cls.max_chunks}:
            assert {(name, chunks, m) for m in costs} <= seen
    simulated = {c.schedule for c in plan.candidates if c.predicted_step_s is not None}
    assert {"zb-h1", "zb-h2", "zbv", "dualpipev"} <= simulated
    # the prediction is the simulator's makespan under the per-stage costs
    cls, m, c = TRAINING[plan.schedule], plan.micro_batches, plan.chunks
    layer = costs[m].forward_s[0]
    table = {}
    from pipekernel.schedules.placement import locate
    for p in range(2 * c):
        n = plan.bounds[p + 1] - plan.bounds[p]
        table[locate(p, 2, cls.placement)] = {Forward: n * layer, Backward: 2 * n * layer,
                                              BackwardInput: n * layer, BackwardWeight: n * layer}
    assert simulate(cls, 2, m, c, stage_costs=table).makespan == pytest.approx(
        plan.predicted_step_s)


def test_a_known_winner_one_schedule_many_counts():
    # 1f1b only: with no overhead more micro-batches shrink the bubble; with a large
    # per-micro-batch overhead one micro-batch wins
    only = {"1f1b": TRAINING["1f1b"]}
    assert search(fixed_batch_costs(overhead=0.0), 2, only, balance=balance).micro_batches == 8
    assert search(fixed_batch_costs(overhead=10.0), 2, only, balance=balance).micro_batches == 1
    # F=1, B=2 per stage, 2 stages, 4 micro-batches: (m + S - 1) * (F + B) = 15
    costs = {4: LayerCosts([1.0, 1.0], [2.0, 2.0], [0.0, 0.0], [0.0, 0.0])}
    assert search(costs, 2, only, balance=balance).predicted_step_s == pytest.approx(15.0)


def test_ties_break_by_name_then_fewer_chunks():
    costs = {4: LayerCosts([1.0, 1.0], [2.0, 2.0], [0.0, 0.0], [0.0, 0.0])}
    # 1f1b and gpipe take the same time with unit costs and 2 stages; "1f1b" < "gpipe"
    plan = search(costs, 2, {"gpipe": TRAINING["gpipe"], "1f1b": TRAINING["1f1b"]},
                  balance=balance)
    tied = [c for c in plan.candidates if c.predicted_step_s == plan.predicted_step_s]
    assert len(tied) == 2 and plan.schedule == "1f1b"


def test_a_memory_budget_excludes_the_fastest_candidate():
    costs = fixed_batch_costs(overhead=0.02, act=10_000.0, counts=(2, 4, 8))
    free = search(costs, 2, TRAINING, balance=balance)
    budget = free.candidates[0].peak_bytes - 1
    # recomputation fixed off: the budget must exclude (test_recompute_plan.py lets the
    # planner recompute instead)
    bounded = search(costs, 2, TRAINING, balance=balance, memory_budget=budget,
                     recompute=(0, 0))
    assert (bounded.schedule, bounded.chunks, bounded.micro_batches, bounded.bounds) != \
        (free.schedule, free.chunks, free.micro_batches, free.bounds)
    excluded = [c for c in bounded.candidates if c.bounds == free.bounds
                and (c.schedule, c.chunks, c.micro_batches) ==
                (free.schedule, free.chunks, free.micro_batches)]
    assert len(excluded) == 1 and not excluded[0].fits
    assert max(bounded.candidates[0].stage_bytes) <= budget
    assert bounded.predicted_step_s >= free.predicted_step_s
    assert "over budget" in bounded.format()
    with pytest.raises(ConfigError, match="no candidate fits memory_budget"):
        search(costs, 2, TRAINING, balance=balance, memory_budget=1.0, recompute=(0, 0))


def test_candidates_that_cannot_run_are_listed_with_the_reason():
    costs = {2: LayerCosts([1.0] * 3, [2.0] * 3, [0.0] * 3, [0.0] * 3)}
    plan = search(costs, 2, TRAINING, balance=balance)  # 2 stages x 2 chunks > 3 layers
    notes = {c.schedule: c.note for c in plan.candidates if c.predicted_step_s is None}
    assert "4 parts > 3 layers" in notes["zbv"]
    with pytest.raises(ConfigError, match="no runnable candidate"):
        search(costs, 2, {"zbv": TRAINING["zbv"]}, balance=balance)


class FakeProfile:
    """Answers pk.profile with injected per-layer costs, different on every rank (the
    rank-0-and-broadcast rule is what the real profiler follows; this one does not)."""

    def __init__(self, skew):
        self.skew = skew

    @pk.hookimpl(tryfirst=True)
    def pipekernel_partition(self, method, layers, num_stages, context):
        from pipekernel.model.partitioning import Profile
        if not isinstance(method, Profile):
            return None
        rows = method.sample.shape[0]
        rank = context.rank if self.skew else 0
        n = len(layers)
        seconds = [(rows + 0.5 + 50 * rank * (i == 0)) * 1e-3 for i in range(n)]
        context.layer_costs, context.layer_forward_seconds = seconds, [s / 3 for s in seconds]
        context.layer_static_bytes = [1000.0 * (1 + 50 * rank * (i == 0)) for i in range(n)]
        context.layer_activation_bytes = [float(rows)] * n
        return [0, n] if num_stages == 1 else None


def _auto_worker(skew):
    engine = pk.PipelineEngine(mlp(num_stages=2), optimizer=sgd, micro_batches=4,
                               schedule=pk.auto(sample=torch.randn(4, 8)),
                               plugins=[FakeProfile(skew)], timeout=60)
    loss = engine.train_batch(iter(mlp_data(0, 0, engine.micro_batches))).item()
    return (engine.plan.fields(), engine.schedule_cls.name, engine.chunks, engine.micro_batches,
            list(engine.bounds), loss)


def test_every_rank_picks_the_same_plan_and_trains_with_it():
    results = run_ranks(_auto_worker, 2, False)
    fields, name, chunks, m, bounds, loss = results[0]
    assert all(r[0] == fields for r in results)
    assert (name, chunks, m, bounds) == (fields["schedule"], fields["chunks"],
                                         fields["micro_batches"], fields["bounds"])
    assert results[0][5] == results[1][5]


def test_ranks_measuring_different_costs_are_caught():
    with pytest.raises(Exception, match="ranks disagree on their plan"):
        run_ranks(_auto_worker, 2, True)


def test_auto_without_a_sample_says_how_to_give_one():
    from pipekernel.engine.planner import plan_module
    with pytest.raises(ConfigError, match="needs a sample micro-batch"):
        plan_module(mlp(), Auto(), num_stages=2, micro_batches=4, pm=make_plugin_manager())


def test_a_host_link_occupies_the_stages_and_favours_fewer_micro_batches():
    from pipekernel.engine.planner import Link
    only = {"1f1b": TRAINING["1f1b"]}
    # one micro-batch on 2 stages is a chain F0 -> F1 -> B1 -> B0 with two transfers, each
    # costing its full link seconds (half packing on the sender, half unpacking)
    one = {1: LayerCosts([1.0, 1.0], [2.0, 2.0], [0.0, 0.0], [0.0, 0.0],
                         output_bytes=[100.0, 100.0])}
    link = Link(message_s=0.5, byte_s=0.01, on_host=True)  # 1.5 s per transfer
    assert search(one, 2, only, balance=balance).predicted_step_s == pytest.approx(6.0)
    assert search(one, 2, only, balance=balance, link=link).predicted_step_s == \
        pytest.approx(6.0 + 2 * 1.5)
    plan = search(one, 2, only, balance=balance, link=link)
    assert plan.link == link and "500000 us per message" in plan.format()
    # without a link more micro-batches win (smaller bubble); a costly host link turns it
    costs = fixed_batch_costs(overhead=0.0)
    costs = {m: dataclasses.replace(c, output_bytes=[10.0] * 8) for m, c in costs.items()}
    assert search(costs, 2, only, balance=balance).micro_batches == 8
    assert search(costs, 2, only, balance=balance,
                  link=Link(message_s=10.0, on_host=True)).micro_batches == 1
    # as latency (a device transport) the same seconds overlap compute: never slower
    as_latency = search(costs, 2, only, balance=balance, link=Link(message_s=2.0, on_host=False))
    assert as_latency.predicted_step_s < search(
        costs, 2, only, balance=balance, link=Link(message_s=2.0, on_host=True)).predicted_step_s


class _SteppingClock:
    """Advances 1 s per reading while timing the small message, 3 s for the large one."""

    def __init__(self, per_size):
        self.t, self.calls, self.per_size = 0.0, 0, per_size

    def __call__(self):
        self.t += 1.0 if self.calls < self.per_size else 3.0
        self.calls += 1
        return self.t


def _link_worker():
    from pipekernel.engine.planner import measure_link
    from pipekernel.extend.manager import make_plugin_manager, make_transport
    transport = make_transport(make_plugin_manager(), "gloo", {"timeout": 30})
    try:
        link = measure_link(transport, 1 << 16, repeats=3, warmup=1,
                            clock=_SteppingClock(2 * (1 + 3)))
        return link.message_s, link.byte_s, link.on_host
    finally:
        transport.close()


def test_measure_link_pings_between_ranks_0_and_1_and_every_rank_gets_rank_0s_numbers():
    results = run_ranks(_link_worker, 3)
    # one-way = half a round trip: 0.5 s for 64 bytes, 1.5 s for 65536 bytes (fake clock);
    # rank 2 takes no part in the ping-pong but gets the same numbers
    byte_s = 1.0 / (65536 - 64)
    assert results[0] == results[1] == results[2]
    message_s, got_byte_s, on_host = results[0]
    assert got_byte_s == pytest.approx(byte_s) and on_host is True
    assert message_s == pytest.approx(0.5 - 64 * byte_s)


def test_a_schedule_that_is_another_ones_pipeline_is_listed_once():
    # interleaved with one chunk runs exactly 1F1B's instruction streams
    plan = search(fixed_batch_costs(), 2, TRAINING, balance=balance)
    twins = [c for c in plan.candidates if (c.schedule, c.chunks) == ("interleaved", 1)]
    assert twins and all(c.predicted_step_s is None and
                         c.note == "the same instruction streams as 1f1b (chunks 1)"
                         for c in twins)
    assert {c.micro_batches for c in twins} == {1, 2, 4, 8}
    # interleaved with 2 chunks is a pipeline of its own
    assert any((c.schedule, c.chunks) == ("interleaved", 2) and c.predicted_step_s is not None
               for c in plan.candidates)


def test_a_dict_sample_is_resized_by_rows():
    from pipekernel.engine.planner import _resize, _rows
    sample = {"input_ids": torch.arange(6).reshape(2, 3), "mask": torch.ones(2, 3), "n": 1}
    assert _rows(sample) == 2
    resized = _resize(sample, 3)
    assert resized["input_ids"].shape == (3, 3) and resized["mask"].shape == (3, 3)
    assert resized["n"] == 1 and resized["input_ids"][2].tolist() == [0, 1, 2]


# -- an engine never changes what a batch is (issue 43) ----------------------------------------

def test_an_engine_chooses_at_its_own_count_and_lists_the_others_as_what_ifs():
    costs = fixed_batch_costs(overhead=0.0)  # alone, 8 micro-batches would win
    only = {"1f1b": TRAINING["1f1b"]}
    assert search(costs, 2, only, balance=balance).micro_batches == 8
    plan = search(costs, 2, only, balance=balance, runs=2)
    assert (plan.micro_batches, plan.runs) == (2, 2)
    assert plan.candidates[0].micro_batches == 2 and not plan.candidates[0].what_if
    others = [c for c in plan.candidates if c.micro_batches != 2]
    assert others and all(c.what_if and "what-if" in c.note for c in others)
    assert plan.predicted_step_s > min(c.predicted_step_s for c in others)
    line = plan.announce()
    assert "for your 2 micro-batches per step" in line and "8 micro-batches would be" in line
    rows = [r for r in plan.format().splitlines() if r.lstrip().startswith(("*", "1 ", "2 "))]
    assert rows[0].startswith("*") and " 2 time" in rows[0]  # the chosen one first, marked


def test_a_budget_only_another_count_fits_says_so_and_is_refused():
    costs = fixed_batch_costs(act=1e6)  # 1F1B holds <= 2 in flight: more, smaller is less
    only = {"1f1b": TRAINING["1f1b"]}
    free = search(costs, 2, only, balance=balance, runs=1)
    # above the 8-count's prediction plus the model's 5% margin
    budget = min(c.peak_bytes for c in free.candidates if c.micro_batches == 8) * 1.06
    with pytest.raises(ConfigError, match=r"no candidate at 1 micro-batches .*8 micro-batches "
                                          r"would fit"):
        search(costs, 2, only, balance=balance, runs=1, memory_budget=budget,
               recompute=(0, 0))


def _tutorial():
    """The tutorial's pipeline program (docs/tutorial.md, section 2), its definitions only."""
    import re
    from pathlib import Path
    text = (Path(__file__).resolve().parent.parent / "docs" / "tutorial.md").read_text()
    body = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "pk.launch(main" in b][0]
    space = {"__name__": "tutorial"}
    exec(compile(body, "docs/tutorial.md", "exec"), space)
    return space


def _tutorial_engine(t, schedule, partition="parameters", chunks=None, plugins=()):
    from torch import nn
    layers = [pk.LayerSpec(nn.Embedding, t["VOCAB"], t["DIM"]),
              *[pk.LayerSpec(t["Block"], t["DIM"]) for _ in range(t["LAYERS"])],
              pk.LayerSpec(nn.Linear, t["DIM"], t["VOCAB"])]
    module = pk.PipelineModule(layers, loss_fn=t["loss_fn"], num_stages=2, seed=1234,
                               partition=partition)
    return pk.PipelineEngine(module, micro_batches=t["MICRO_BATCHES"], schedule=schedule,
                             chunks=chunks, plugins=list(plugins), timeout=60,
                             optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2))


def _train(t, engine):
    losses = [engine.train_batch(iter(t["batch"](step))).item() for step in range(t["STEPS"])]
    plan, m = engine.plan, engine.micro_batches
    engine.close()
    return losses, plan, m


class FewerIsFaster:
    """Injected costs where each micro-batch carries a large fixed cost: alone, the planner
    would take the fewest micro-batches (2 of the candidates 2, 4, 8)."""

    @pk.hookimpl(tryfirst=True)
    def pipekernel_partition(self, method, layers, num_stages, context):
        from pipekernel.model.partitioning import Profile
        if not isinstance(method, Profile):
            return None
        rows, n = method.sample.shape[0], len(layers)
        seconds = [(rows + 100.0) * 1e-3] * n
        context.layer_costs, context.layer_forward_seconds = seconds, [s / 3 for s in seconds]
        context.layer_static_bytes, context.layer_activation_bytes = [1000.0] * n, [1.0 * rows] * n
        return [0, n] if num_stages == 1 else None


def _tutorial_worker():
    t = _tutorial()
    sample = t["batch"](0)[0][0]
    auto = _train(t, _tutorial_engine(t, pk.auto(sample=sample, repeats=1, warmup=0)))
    plan = auto[1]
    fixed = _train(t, _tutorial_engine(t, plan.schedule, list(plan.bounds), plan.chunks))
    import contextlib
    import io
    said = io.StringIO()
    with contextlib.redirect_stderr(said):  # what rank 0 says at start
        engine = _tutorial_engine(t, pk.auto(sample=sample, micro_batches=[2, 4, 8],
                                             measure_link=False), plugins=[FewerIsFaster()])
    return auto, fixed, (*_train(t, engine), said.getvalue())


@pytest.fixture(scope="module")
def tutorial_runs():
    return run_ranks(_tutorial_worker, 2)


def _plain_losses(t):
    from pipekernel.testing import reference_train
    from torch import nn
    layers = [pk.LayerSpec(nn.Embedding, t["VOCAB"], t["DIM"]),
              *[pk.LayerSpec(t["Block"], t["DIM"]) for _ in range(t["LAYERS"])],
              pk.LayerSpec(nn.Linear, t["DIM"], t["VOCAB"])]
    module = pk.PipelineModule(layers, loss_fn=t["loss_fn"], num_stages=1, seed=1234)
    batches = [[t["batch"](step)] for step in range(t["STEPS"])]
    return reference_train(module, lambda p: torch.optim.AdamW(p, lr=1e-2), batches,
                           t["MICRO_BATCHES"])[0]


def test_the_tutorial_with_auto_trains_the_batch_it_wrote(tutorial_runs):
    (auto, plan, m), (fixed, _, fixed_m), _ = tutorial_runs[0]
    assert m == fixed_m == plan.micro_batches == 4  # the tutorial's MICRO_BATCHES
    assert auto == pytest.approx(fixed, rel=1e-6, abs=1e-6)
    assert auto == pytest.approx(_plain_losses(_tutorial()), rel=1e-6, abs=1e-6)
    assert tutorial_runs[1][0][0] == auto  # every rank gets the same loss


def test_auto_preferring_another_count_still_trains_the_users(tutorial_runs):
    (auto, _, _), _, (prefers, plan, m, said) = tutorial_runs[0]
    assert m == plan.micro_batches == plan.runs == 4
    assert plan.announce() in said.splitlines()  # rank 0 says it at start, and only rank 0
    assert "schedule 'auto'" not in tutorial_runs[1][2][3]
    best = min((c for c in plan.candidates if c.predicted_step_s is not None),
               key=lambda c: c.predicted_step_s)
    assert best.micro_batches == 2 and best.what_if  # the planner alone would have taken 2
    assert "2 micro-batches would be predicted" in plan.announce()
    assert prefers == pytest.approx(auto, rel=1e-6, abs=1e-6)


def test_the_prediction_is_the_makespan_plus_the_slowest_stages_optimizer_step():
    # injected costs: 8 layers, 1f1b on 2 stages, the optimizer measured per layer
    steps = [0.0, 0.3, 0.3, 0.3, 0.5, 0.5, 0.5, 0.0]  # layers 0 and 7 hold no parameters
    base = fixed_batch_costs(counts=(4,))
    costs = {4: dataclasses.replace(base[4], optimizer_s=steps, optimizer_fixed_s=0.1)}
    plan = search(costs, 2, {"1f1b": TRAINING["1f1b"]}, balance=balance, chunks=(1,))
    bounds = plan.bounds
    layer = costs[4].forward_s[0]
    table = {(s, 0): {Forward: (bounds[s + 1] - bounds[s]) * layer,
                      Backward: 2 * (bounds[s + 1] - bounds[s]) * layer} for s in range(2)}
    makespan = simulate(TRAINING["1f1b"], 2, 4, 1, stage_costs=table).makespan
    # one step per stage over all its layers: their steps less the fixed part of all but one
    per_stage = []
    for s in range(2):
        mine = [t for t in steps[bounds[s]:bounds[s + 1]] if t > 0]
        per_stage.append(max(sum(mine) - (len(mine) - 1) * 0.1, max(mine)))
    assert plan.breakdown == pytest.approx({"pipeline": makespan, "optimizer": max(per_stage)})
    assert plan.predicted_step_s == pytest.approx(makespan + max(per_stage))
    # without a measured step the prediction is the makespan alone, as before
    bare = search(base, 2, {"1f1b": TRAINING["1f1b"]}, balance=balance, chunks=(1,))
    assert bare.breakdown["optimizer"] == 0.0
    assert bare.predicted_step_s == pytest.approx(makespan)


def test_measure_optimizer_times_each_layer_with_the_given_clock():
    from pipekernel.engine.planner import measure_optimizer

    module = mlp(4)
    ticks = iter(range(10 ** 6))
    steps, fixed = measure_optimizer(module, sgd, clock=lambda: float(next(ticks)),
                                     repeats=3, warmup=1)
    # every read of the clock advances it by 1: each timed step is 1 "second"
    assert steps == [1.0 if n else 0.0 for n in module.parameter_counts()]
    assert fixed == 1.0  # 1 + 1 - 1, at most the cheaper step
