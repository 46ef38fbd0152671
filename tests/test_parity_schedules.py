"""Interleaved, zero-bubble and V schedules train exactly like one process with gradient
accumulation, and evaluate like the full model (fp32, 1e-5)."""
from __future__ import annotations

import pytest
from models import MODELS, adam, sgd
from sweep import Sweep

import pipekernel as pk
from pipekernel.schedules import BUILTIN_SCHEDULES
from pipekernel.testing import assert_parity, reference_eval, reference_train, run_ranks

STEPS = 3


def worker(model, stages, dp, micro_batches, schedule, chunks, optimizer):
    build, data = MODELS[model]
    engine = pk.PipelineEngine(build(num_stages=stages), optimizer=optimizer,
                               micro_batches=micro_batches, schedule=schedule, chunks=chunks,
                               data_parallel_size=dp, timeout=60)
    losses = [engine.train_batch(iter(data(step, engine.data_parallel_rank, micro_batches)))
              .item() for step in range(STEPS)]
    state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    eval_loss = engine.eval_batch(iter(data(99, 0, micro_batches))).item()
    parts = (engine.module.num_parts, engine.chunks)
    engine.close()
    return losses, state, eval_loss, engine.stage, parts


SWEEP = Sweep(timeout=240)  # one world per world size for the cases below


def case(model, stages, dp, micro_batches, schedule, chunks=None, optimizer=sgd):
    name = f"{schedule}-{model}-{stages}x{dp}-m{micro_batches}-{optimizer.__name__}"
    return SWEEP.case(name, stages * dp, worker, model, stages, dp, micro_batches, schedule,
                      chunks, optimizer)


def check(case):
    results = SWEEP.results(case)
    model, stages, dp, micro_batches, schedule, chunks, optimizer = case.args
    build, data = MODELS[model]
    batches = [[data(step, r, micro_batches) for r in range(dp)] for step in range(STEPS)]
    ref_losses, ref_state = reference_train(build(), optimizer, batches, micro_batches)
    covered = set()
    for losses, state, eval_loss, _, parts in results:
        assert_parity(losses, ref_losses, state, ref_state)
        covered |= set(state)
        assert parts[0] == parts[1] == (chunks or BUILTIN_SCHEDULES[schedule].default_chunks)
    assert covered == set(ref_state), "stages together must hold every parameter"
    ref_eval, _ = reference_eval(build(), ref_state, data(99, 0, micro_batches))
    for _, _, eval_loss, _, _ in results:
        assert eval_loss == pytest.approx(ref_eval, rel=1e-5, abs=1e-6)


INTERLEAVED = case("mlp", 2, 1, 4, "interleaved", 2, optimizer=adam)
INTERLEAVED_DATA = case("mlp", 2, 2, 4, "interleaved", 2)
INTERLEAVED_TIED = case("tied", 2, 1, 2, "interleaved", 2, optimizer=adam)
ZB_H1 = case("mlp", 4, 1, 6, "zb-h1", optimizer=adam)
ZB_H1_DATA = case("mlp", 2, 2, 4, "zb-h1", optimizer=adam)
ZBV = case("tied", 2, 1, 4, "zbv", optimizer=adam)
ZBV_MIXED = case("masked", 2, 1, 3, "zbv")
ZB_H2 = case("mlp", 2, 1, 5, "zb-h2", optimizer=adam)
DUALPIPEV = case("tied", 2, 1, 4, "dualpipev", optimizer=adam)
# V-Min and V-Half (issue 46): p = 2 at each schedule's minimum, p = 4 above it
V_MIN = [case("mlp", 2, 1, 3, "v-min", optimizer=adam), case("mlp", 4, 1, 6, "v-min")]
V_HALF = [case("tied", 2, 1, 4, "v-half", optimizer=adam), case("mlp", 4, 1, 5, "v-half")]
DICTS = [case("dicts", 4, 1, 4, "zb-h1"), case("dicts", 2, 1, 4, "interleaved", 2)]


def test_interleaved_two_stages_two_chunks():
    check(INTERLEAVED)


def test_interleaved_with_two_data_parallel_replicas():
    check(INTERLEAVED_DATA)


def test_interleaved_tied_layers_across_parts():
    # 4 parts on 2 stages: the tied embedding sits on part 0 (stage 0) and part 3 (stage 1)
    check(INTERLEAVED_TIED)


def test_zb_h1_four_stages():
    check(ZB_H1)


def test_zb_h1_with_two_data_parallel_replicas():
    # the weight pass (BackwardWeight) is where the bucketed reduction starts
    check(ZB_H1_DATA)


def test_zbv_two_stages():
    # V placement: stage 0 holds the first and the last part (loads inputs and labels)
    check(ZBV)


def test_zbv_mixed_dtype_activations():
    check(ZBV_MIXED)


def test_zb_h2_two_stages():
    # up to 2 S - 1 = 3 parts in flight on stage 0, W deferred into the tail
    check(ZB_H2)


def test_dualpipev_two_stages():
    # full backwards paired with forwards in the steady state, I/W splits in the drain,
    # the tied embedding on the first and the last part (both on stage 0)
    check(DUALPIPEV)


@pytest.mark.parametrize("case", V_MIN + V_HALF, ids=str)
def test_controllable_memory_v_schedules(case):
    check(case)


def bad_chunks_worker():
    build, _ = MODELS["mlp"]
    pk.PipelineEngine(build(num_stages=2), optimizer=sgd, micro_batches=4, schedule="zbv",
                      chunks=3, timeout=30)


def test_chunks_the_schedule_cannot_hold_is_a_clear_error():
    with pytest.raises(pk.RankError, match=r"zbv.*exactly 2 chunk"):
        run_ranks(bad_chunks_worker, 2, timeout=300)


@pytest.mark.parametrize("case", DICTS, ids=str)
def test_dict_activations_zero_bubble_and_interleaved(case):
    check(case)
