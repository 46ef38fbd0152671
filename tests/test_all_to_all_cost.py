"""Issue 30 item 4: the simulator and ``auto`` know an expert-parallel layer's all-to-all
cost (measured apart from the compute, on every rank in an expert-parallel group) and the
price of dualpipev's overlapped pair. Unit tests inject costs (a fake profile, a fake
clock); one multi-process test measures a PP2 x EP2 model. No timing is asserted beyond
"more than zero" against "zero"."""
from __future__ import annotations

import pytest
import torch

import pipekernel as pk
from pipekernel.apps.gpt import VOCAB, gpt_module
from pipekernel.engine.all_to_all_cost import pair_cost, pair_table
from pipekernel.engine.planner import LayerCosts, search
from pipekernel.grid import expert_parallel
from pipekernel.plugins.partition import balance
from pipekernel.schedules import BUILTIN_SCHEDULES, simulate
from pipekernel.schedules.dualpipe import DualPipeV
from pipekernel.schedules.instructions import (Backward, BackwardInput, BackwardWeight, Forward,
                                               ForwardBackward)
from pipekernel.stage.paired import overlap_all_to_all, sequential
from pipekernel.testing import run_ranks

TRAINING = {k: v for k, v in BUILTIN_SCHEDULES.items() if v.trains}


def profile(a2a: float, layers: int = 16, counts=(4, 8, 16)) -> dict[int, LayerCosts]:
    """A fixed batch in m micro-batches; each layer's all-to-all ``a2a`` times its compute."""
    out = {}
    for m in counts:
        f = 8.0 / m / layers + 0.05
        out[m] = LayerCosts([f] * layers, [2 * f] * layers, [1000.0] * layers,
                            [100.0 * 8 / m] * layers,
                            all_to_all_s=[(a2a * f, a2a * 2 * f)] * layers)
    return out


def test_the_pair_hides_each_halfs_all_to_all_under_the_others_compute():
    # (compute, all-to-all) of the forward half and of the backward half
    assert pair_cost((2.0, 0.0), (4.0, 0.0)) == 6.0              # nothing to hide: F + B
    assert pair_cost((2.0, 1.0), (4.0, 2.0)) == 6.0              # all hidden: the compute
    assert pair_cost((2.0, 5.0), (4.0, 1.0)) == 2 + 5 + 4 + 1 - 4 - 1  # F's a2a shows
    assert pair_cost((1.0, 3.0), (1.0, 3.0)) == 8.0 - 2.0        # never below the a2a
    assert pair_cost((1.0, 3.0), (1.0, 3.0)) >= 3.0 + 3.0


def test_pairs_of_one_chunk_overlap_only_under_a_models_own_executor():
    parts = {(0, 0): (2.0, 1.0, 4.0, 2.0), (0, 1): (2.0, 1.0, 4.0, 2.0)}
    built_in = pair_table(parts, overlaps_same_chunk=False)
    assert built_in[(0, 0, 1)] == {ForwardBackward: 6.0}
    assert built_in[(0, 1, 1)] == {ForwardBackward: 9.0}         # run one after the other
    assert pair_table(parts, overlaps_same_chunk=True)[(0, 1, 1)] == {ForwardBackward: 6.0}


def test_the_simulator_prices_a_stages_pairs_by_their_chunks():
    base = simulate(DualPipeV, 2, 8, 2, paired=True)
    priced = {(s, cf, cb): {ForwardBackward: 1.0} for s in range(2)
              for cf in range(2) for cb in range(2)}               # a pair: 1, not F + B = 2
    cheaper = simulate(DualPipeV, 2, 8, 2, stage_costs=priced)    # paired (a pair is priced)
    assert cheaper.makespan < base.makespan
    assert simulate(DualPipeV, 2, 8, 2, costs={ForwardBackward: 1.0}).makespan == \
        cheaper.makespan
    # a stage's own price wins over the global one
    assert simulate(DualPipeV, 2, 8, 2, costs={ForwardBackward: 2.0},
                    stage_costs=priced).makespan == cheaper.makespan


def test_a_big_all_to_all_makes_auto_choose_dualpipev_with_the_overlap_executor_only():
    costs = profile(1.0)
    without = search(costs, 4, TRAINING, balance=balance)
    overlapped = search(costs, 4, TRAINING, balance=balance, executor=overlap_all_to_all)
    assert without.schedule != "dualpipev"
    assert overlapped.schedule == "dualpipev"
    assert overlapped.predicted_step_s < without.predicted_step_s
    assert overlapped.executor == "overlap_all_to_all" and without.executor == ""
    # what is predicted for dualpipev is the simulator's answer with the pairs priced
    best = overlapped.candidates[0]
    assert best.schedule == "dualpipev"
    unpaired = [c for c in without.candidates if (c.schedule, c.micro_batches, c.bounds) ==
                (best.schedule, best.micro_batches, best.bounds)]
    assert unpaired and unpaired[0].predicted_step_s > best.predicted_step_s


def test_the_all_to_all_counts_in_the_stage_costs_and_without_it_nothing_changes():
    none = {m: LayerCosts(c.forward_s, c.backward_s, c.static_bytes, c.activation_bytes)
            for m, c in profile(0.0).items()}
    zero = search(profile(0.0), 4, TRAINING, balance=balance)
    assert zero.predicted_step_s == search(none, 4, TRAINING, balance=balance).predicted_step_s
    slower = search(profile(1.0), 4, TRAINING, balance=balance)
    assert slower.predicted_step_s > zero.predicted_step_s
    # a model executor without any all-to-all prices the pair F + B, run as one step
    plain = search(profile(0.0), 2, {"dualpipev": DualPipeV}, balance=balance,
                   executor=sequential)
    m = plain.micro_batches
    assert plain.predicted_step_s == pytest.approx(
        _dualpipev_makespan(profile(0.0)[m], plain.bounds, m, paired=True))


def _dualpipev_makespan(costs: LayerCosts, bounds, m: int, paired: bool) -> float:
    from pipekernel.schedules.placement import locate
    table = {}
    for p in range(4):
        lo, hi = bounds[p], bounds[p + 1]
        f, b = sum(costs.forward_s[lo:hi]), sum(costs.backward_s[lo:hi])
        table[locate(p, 2, DualPipeV.placement)] = {Forward: f, Backward: b,
                                                    BackwardInput: b / 2, BackwardWeight: b / 2}
    return simulate(DualPipeV, 2, m, 2, stage_costs=table, paired=paired).makespan


def test_the_plan_names_the_all_to_all_share():
    plan = search(profile(1.0), 4, TRAINING, balance=balance, executor=overlap_all_to_all)
    text = plan.format(top=3)
    assert "expert all-to-all:" in text and "(50%)" in text
    assert "overlapped by overlap_all_to_all" in text
    assert "expert all-to-all" not in search(
        {m: LayerCosts(c.forward_s, c.backward_s, c.static_bytes, c.activation_bytes)
         for m, c in profile(0.0).items()}, 4, TRAINING, balance=balance).format()
    assert "run as their two steps" in search(profile(1.0), 4, TRAINING,
                                              balance=balance).format()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_the_clock_counts_forward_and_backward_all_to_alls_apart(monkeypatch, device):
    """The group's all-to-all under a fake collective (identity) and a fake clock."""
    from torch.distributed import _functional_collectives as funcol
    monkeypatch.setattr(funcol, "all_to_all_single_autograd",
                        lambda t, out, inp, group: t * 1.0)
    monkeypatch.setattr(funcol, "wait_tensor", lambda t: t)
    ticks = iter(range(100))
    clock = expert_parallel.AllToAllClock(lambda: float(next(ticks)))
    group = expert_parallel.ExpertParallelGroup(0, 2, 2)
    x = torch.ones(4, 3, device=device, requires_grad=True)
    with expert_parallel.timing(clock):
        y = group.all_to_all(x, [2, 2], [2, 2])
        assert clock.forward_s == 1.0 and clock.backward_s == 0.0
        (y * 2).sum().backward()
    assert clock.backward_s == 1.0
    assert torch.equal(x.grad.cpu(), torch.full((4, 3), 2.0))
    y = group.all_to_all(x, [2, 2], [2, 2])  # outside timing(): not counted
    assert clock.forward_s == 1.0


def test_outside_an_expert_parallel_group_nothing_is_timed():
    from pipekernel.engine.all_to_all_cost import measure_all_to_all
    module = gpt_module(16, 2, 2, 8, num_stages=2, seed=3, experts=4, top_k=2)
    sample = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    measured = measure_all_to_all(module, sample, expert_parallel.ExpertParallelGroup())
    assert measured == [(0.0, 0.0)] * len(module.layers)


def _measured_worker() -> dict:
    torch.set_num_threads(1)
    sample = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    out = {}
    for experts in (4, 0):
        module = gpt_module(16, 2, 2, 8, num_stages=2, seed=3, experts=experts, top_k=2)
        module.overlapped_forward_backward = overlap_all_to_all
        engine = pk.PipelineEngine(
            module, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), micro_batches=2,
            data_parallel_size=2, expert_parallel_size=2, timeout=120,
            schedule=pk.auto(sample=sample, schedules=["1f1b", "dualpipev"],
                             micro_batches=[2], repeats=1, warmup=0, measure_link=False))
        try:
            costs = engine.plan.costs[engine.plan.micro_batches]
            experts_at = [any(expert_parallel.is_expert(p) for p in layer.parameters())
                          for layer in (module.build_layer(i)
                                        for i in range(len(module.layers)))]
            out[experts] = (list(costs.all_to_all_s), experts_at, engine.plan.format())
        finally:
            engine.close()
    return out


@pytest.mark.multirank
def test_the_profile_of_a_pp2_ep2_model_holds_its_all_to_all_and_a_dense_one_none():
    results = run_ranks(_measured_worker, 4, timeout=600)
    assert all(r[4][0] == results[0][4][0] and r[0][0] == results[0][0][0]
               for r in results)  # every rank plans with rank 0's numbers
    a2a, experts_at, text = results[0][4]
    assert any(experts_at)
    # the MoE blocks exchange tokens forward and backward; the other layers move none
    assert [f > 0 and b > 0 for f, b in a2a] == experts_at, a2a
    assert all(pair == (0.0, 0.0) for pair, moe in zip(a2a, experts_at) if not moe)
    assert "expert all-to-all:" in text and "overlapped by overlap_all_to_all" in text
    dense, _, _ = results[0][0]
    assert dense == [(0.0, 0.0)] * len(dense)


def _failing_measurement_worker() -> str:
    """Rank 1 fails inside the measurement, at the first layer with experts (after
    building it, before its all-to-alls); rank 0 then waits in that layer's all-to-all."""
    import pipekernel.engine.all_to_all_cost as cost

    torch.set_num_threads(1)
    rank = int(__import__("os").environ["RANK"])
    real = cost._built

    def built(module, index, device, scope):
        run, experts = real(module, index, device, scope)
        if experts and rank == 1:
            raise RuntimeError(f"injected failure measuring layer {index}")
        return run, experts

    cost._built = built
    sample = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    module = gpt_module(16, 2, 2, 8, num_stages=1, seed=3, experts=4, top_k=2)
    try:
        pk.PipelineEngine(module, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                          micro_batches=2, data_parallel_size=2, expert_parallel_size=2,
                          timeout=900,  # the transport's: far beyond run_ranks' below
                          schedule=pk.auto(sample=sample, schedules=["1f1b"],
                                           micro_batches=[2], repeats=1, warmup=0,
                                           measure_link=False))
    except Exception as err:  # noqa: BLE001 - what each rank saw, for the test
        seen = f"{type(err).__name__}: {err}"
    else:
        seen = "no error"
    # the failing rank stays alive until the other has its error (a process that exits
    # closes its connections, which would release the other's wait without any abort)
    from datetime import timedelta

    from torch.distributed import distributed_c10d
    store = distributed_c10d._get_default_store()
    if rank == 0:
        store.set("measurement-test/seen", "1")
    else:
        store.wait(["measurement-test/seen"], timedelta(seconds=600))
    return seen


@pytest.mark.multirank
def test_a_rank_failing_in_the_measurement_stops_the_others_at_once():
    """The failing rank's error reaches the other through the engine's abort board: it
    stops waiting in the all-to-all with a PeerAbort naming rank 1, long before the
    transport's 900 s timeout (run_ranks gives up after 240 s: a hang fails the test)."""
    waiting, failing = run_ranks(_failing_measurement_worker, 2, timeout=240)
    assert failing.startswith("RuntimeError: injected failure measuring layer"), failing
    assert waiting.startswith("PeerAbort: "), waiting
    assert "rank 1 failed first with RuntimeError: injected failure measuring layer" \
        in waiting, waiting
    assert "rank 0 was measuring the expert all-to-alls" in waiting, waiting
