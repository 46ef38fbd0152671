"""The runtime's per-instruction costs in the planner's prediction (issue 46, item 2, time).

Deterministic only: injected costs, or a fake clock that advances 1 s per reading."""
from __future__ import annotations

import dataclasses

import pytest
from models import mlp, mlp_data

from pipekernel.engine.planner import LayerCosts, Link, search
from pipekernel.engine.runtime_cost import RuntimeCosts, measure_dispatch, measure_runtime
from pipekernel.plugins.partition import balance
from pipekernel.schedules import BUILTIN_SCHEDULES, simulate
from pipekernel.schedules.instructions import (Backward, Forward, RecvActivation, RecvGrad,
                                               SendActivation, SendGrad)
from pipekernel.testing import run_ranks

ONE_F_ONE_B = {"1f1b": BUILTIN_SCHEDULES["1f1b"]}


def _ticks():
    state = {"t": 0.0}

    def clock() -> float:
        state["t"] += 1.0
        return state["t"]
    return clock


def test_the_prediction_is_the_makespan_under_the_runtimes_costs_plus_the_optimizer():
    layers, m = 8, 4
    costs = {m: LayerCosts([0.25] * layers, [0.5] * layers, [0.0] * layers, [0.0] * layers,
                           output_bytes=[100.0] * layers,
                           optimizer_s=[0.2] * layers, optimizer_fixed_s=0.05)}
    link = Link(message_s=0.5, byte_s=0.01, on_host=True)  # 1.5 s per transfer
    runtime = RuntimeCosts(dispatch_s=0.1, loss_forward_s=0.3, loss_backward_s=0.7,
                           wire_s=0.4)
    plan = search(costs, 2, ONE_F_ONE_B, balance=balance, chunks=(1,), link=link,
                  runtime=runtime)
    assert plan.runtime == runtime
    b = plan.bounds
    # every instruction pays the dispatch; the last stage's forward and backward the
    # loss; each transfer its link and wire seconds, half on each side, and a dispatch
    table = {(s, 0): {Forward: 0.25 * (b[s + 1] - b[s]) + 0.1 + (0.3 if s == 1 else 0.0),
                      Backward: 0.5 * (b[s + 1] - b[s]) + 0.1 + (0.7 if s == 1 else 0.0)}
             for s in range(2)}
    host = {k: 1.5 / 2 + 0.4 / 2 + 0.1 for k in (SendActivation, SendGrad, RecvActivation,
                                                RecvGrad)}
    makespan = simulate(ONE_F_ONE_B["1f1b"], 2, m, 1, stage_costs=table,
                        host_costs=host).makespan
    optimizer = max(0.2 * (b[s + 1] - b[s]) - 0.05 * (b[s + 1] - b[s] - 1) for s in range(2))
    assert plan.breakdown == pytest.approx({"pipeline": makespan, "optimizer": optimizer})
    assert plan.predicted_step_s == pytest.approx(makespan + optimizer)
    # the runtime's costs are seconds the plan now sees: more than without them
    bare = search(costs, 2, ONE_F_ONE_B, balance=balance, chunks=(1,), link=link)
    assert bare.runtime is None and bare.predicted_step_s < plan.predicted_step_s


def test_the_loss_lands_on_the_last_part_under_a_v_placement():
    # zbv's last part (stage 0, chunk 1) holds the loss: a loss cost moves stage 0's work
    layers, m = 8, 4
    costs = {m: LayerCosts([0.25] * layers, [0.5] * layers, [0.0] * layers, [0.0] * layers)}
    zbv = {"zbv": BUILTIN_SCHEDULES["zbv"]}
    plain = search(costs, 2, zbv, balance=balance, chunks=(2,))
    lossy = search(costs, 2, zbv, balance=balance, chunks=(2,),
                   runtime=RuntimeCosts(loss_forward_s=1.0))
    b, table = lossy.bounds, {}
    for p, (stage, chunk) in enumerate([(0, 0), (1, 0), (1, 1), (0, 1)]):
        n = b[p + 1] - b[p]
        from pipekernel.schedules.instructions import BackwardInput, BackwardWeight
        table[(stage, chunk)] = {Forward: 0.25 * n + (1.0 if p == 3 else 0.0),
                                 Backward: 0.5 * n, BackwardInput: 0.25 * n,
                                 BackwardWeight: 0.25 * n}
    makespan = simulate(zbv["zbv"], 2, m, 2, stage_costs=table, paired=False).makespan
    assert lossy.breakdown["pipeline"] == pytest.approx(makespan)
    assert lossy.predicted_step_s > plain.predicted_step_s


def test_measure_dispatch_runs_a_program_of_no_ops_through_the_kernel():
    # the fake clock advances 1 s per reading: each timed run of 64 instructions lasts 1 s
    assert measure_dispatch(instructions=64, repeats=3, clock=_ticks()) == 1.0 / 64


def test_measure_runtime_times_the_loss_with_labels_on_the_models_outputs():
    module = mlp(2)
    sample, labels = mlp_data(0, 0, 1)[0]
    costs = measure_runtime(module, sample, labels, repeats=3, warmup=1, clock=_ticks())
    # one process: no wire; the loss's forward and backward each read the clock once apart
    assert costs == RuntimeCosts(dispatch_s=1.0 / 64, loss_forward_s=1.0,
                                 loss_backward_s=1.0, wire_s=0.0)
    # without labels (or a loss) there is no loss term
    assert measure_runtime(module, sample, None, clock=_ticks()).loss_forward_s == 0.0
    unlossy = measure_runtime(mlp(2, loss=False), sample, labels, clock=_ticks())
    assert unlossy.loss_backward_s == 0.0


def _wire_worker():
    from pipekernel.extend.manager import make_plugin_manager, make_transport
    transport = make_transport(make_plugin_manager(), "gloo", {"timeout": 30})
    try:
        module = mlp(2)
        sample, labels = mlp_data(0, 0, 1)[0]
        costs = measure_runtime(module, sample, labels, transport, link=Link(message_s=0.1),
                                nbytes=4096, repeats=3, warmup=1, clock=_ticks())
        return dataclasses.astuple(costs)
    finally:
        transport.close()


def test_measure_runtime_sends_through_the_channel_and_every_rank_gets_rank_0s_numbers():
    results = run_ranks(_wire_worker, 3)
    # rank 0's ping-pong reads the clock twice per round trip on a clock that already
    # moved (dispatch, loss) but always by 1 per reading: one way is 0.5 s, less the
    # link's 0.1 s; rank 2 takes no part in it but gets the same numbers
    assert results[0] == results[1] == results[2]
    dispatch, loss_f, loss_b, wire = results[0]
    assert (dispatch, loss_f, loss_b) == (1.0 / 64, 1.0, 1.0)
    assert wire == pytest.approx(0.4)
