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
    assert "runtime per instruction: dispatch 100000.0 us, loss 300000 + 700000 us" in \
        plan.format()
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


class _PatternClock:
    """1 s per reading for the first ``plain`` readings, then per reading the next of
    ``cycle`` (a raw round trip then a Channel one read the clock 4 times)."""

    def __init__(self, plain, cycle):
        self.t, self.k, self.plain, self.cycle = 0.0, 0, plain, cycle

    def __call__(self):
        step = 1.0 if self.k < self.plain else self.cycle[(self.k - self.plain) % len(self.cycle)]
        self.k += 1
        self.t += step
        return self.t


def _wire_worker():
    from pipekernel.extend.manager import make_plugin_manager, make_transport
    transport = make_transport(make_plugin_manager(), "gloo", {"timeout": 30})
    try:
        module = mlp(2)
        sample, labels = mlp_data(0, 0, 1)[0]
        # rank 0 reads the clock 6 times for the dispatch (3 runs) and 12 for the loss
        # (4 runs x 3) before the wire; rank 1 times only the wire (its numbers unused)
        out = []
        for work in (0.0, 0.01):  # each side computes 10 ms (real time) before it sends
            clock = _PatternClock(18 if transport.rank == 0 else 0, (1.0, 1.0, 1.0, 3.0))
            costs = measure_runtime(module, sample, labels, transport,
                                    link=Link(message_s=0.1), nbytes=4096, work_s=work,
                                    repeats=3, warmup=1, clock=clock)
            out.append(dataclasses.astuple(costs))
        return out
    finally:
        transport.close()


def test_measure_runtime_sends_through_the_channel_and_every_rank_gets_rank_0s_numbers():
    results = run_ranks(_wire_worker, 3)
    # each round: the raw round trip lasts 1 s (0.5 one way), the Channel's 3 s (1.5):
    # the wire adds 1 s per transfer; rank 2 takes no part in it but gets the same numbers
    assert results[0] == results[1] == results[2]
    (dispatch, loss_f, loss_b, wire), worked = results[0]
    assert (dispatch, loss_f, loss_b) == (1.0 / 64, 1.0, 1.0)
    assert wire == pytest.approx(1.0)
    # the work before each send is the stage's, not the wire's: taken off (the fake clock
    # does not see it, so 10 ms less)
    assert worked[3] == pytest.approx(1.0 - 0.01)
