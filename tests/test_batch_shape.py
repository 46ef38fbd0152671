"""``micro_batches`` changes between batches (a batch-size ramp-up).

The multi-rank cases run as one world per size (tests/sweep.py): 2 and 4 ranks."""
from __future__ import annotations

import pytest
from models import MODELS, sgd
from sweep import Sweep

import pipekernel as pk
from pipekernel.errors import ConfigError
from pipekernel.testing import assert_parity, reference_train

RAMP = [2, 4, 8, 4]  # 2 -> 4 -> 8, then back to a cached count


def _ramp_worker(stages, dp, schedule, per_call):
    build, data = MODELS["mlp"]
    engine = pk.PipelineEngine(build(num_stages=stages), optimizer=sgd, micro_batches=RAMP[0],
                               schedule=schedule, data_parallel_size=dp, timeout=60)
    losses = []
    for step, n in enumerate(RAMP):
        it = iter(data(step, engine.data_parallel_rank, n))
        if per_call:
            losses.append(engine.train_batch(it, micro_batches=n).item())
            assert engine.micro_batches == RAMP[0]  # a per-call count is for that call only
        else:
            engine.set_micro_batches(n)
            losses.append(engine.train_batch(it).item())
    cached = sorted({key[1] for key in engine._programs})
    state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    engine.close()  # the world runs other cases after this one (tests/sweep.py)
    return losses, state, cached


SWEEP = Sweep()
RAMPS = {key: SWEEP.case("ramp-{}-{}-{}-{}".format(*key), key[0] * key[1], _ramp_worker, *key)
         for key in [(2, 1, "1f1b", False), (2, 2, "1f1b", True), (2, 1, "zb-h1", True)]}


@pytest.mark.parametrize("stages,dp,schedule,per_call", list(RAMPS))
def test_micro_batch_ramp_matches_one_process(stages, dp, schedule, per_call):
    results = SWEEP.results(RAMPS[stages, dp, schedule, per_call])
    build, data = MODELS["mlp"]
    batches = [[data(step, r, n) for r in range(dp)] for step, n in enumerate(RAMP)]
    ref_losses, ref_state = reference_train(build(), sgd, batches, RAMP)
    for losses, state, cached in results:
        assert_parity(losses, ref_losses, state, ref_state)
        assert cached == sorted(set(RAMP))  # one plan per count, reused when it comes back


def _mismatch_worker():
    build, data = MODELS["mlp"]
    engine = pk.PipelineEngine(build(num_stages=2), optimizer=sgd, micro_batches=2, timeout=30)
    n = 4 if engine.stage == 0 else 3
    try:
        engine.train_batch(iter(data(0, 0, n)), micro_batches=n)
    except ConfigError as err:
        return str(err)
    return "no error"


def test_ranks_changing_to_different_counts_get_a_clear_error():
    for message in SWEEP.results(MISMATCH):
        assert "micro-batch count" in message and "micro_batches: 4 on rank 0; 3 on rank 1" \
            in message, message


def _eval_worker():
    build, data = MODELS["mlp"]
    engine = pk.PipelineEngine(build(num_stages=2), optimizer=sgd, micro_batches=2, timeout=60)
    loss, outputs = engine.eval_batch(iter(data(0, 0, 5)), return_outputs=True, micro_batches=5)
    engine.close()
    return loss.item(), None if outputs is None else len(outputs)


EVAL = SWEEP.case("eval-per-call", 2, _eval_worker)
# a refusal leaves its world as it left it: last of the world of 2 (tests/sweep.py)
MISMATCH = SWEEP.case("mismatch", 2, _mismatch_worker)


def test_eval_batch_takes_a_per_call_count():
    build, data = MODELS["mlp"]
    items = data(0, 0, 5)
    model = build()
    ref_model = model.build_stage(0, [0, len(model.layers)])
    expected = sum(model.loss_fn(ref_model(x), y).item() for x, y in items) / 5
    results = SWEEP.results(EVAL)
    for loss, _ in results:
        assert loss == pytest.approx(expected, rel=1e-5)
    assert results[1][1] == 5 and results[0][1] is None


def test_set_micro_batches_refuses_bad_counts_without_communicating():
    class Fake:  # only what the check reads
        num_stages, stage, rank, chunks = 2, 0, 0, 2
        skip_edges = ()  # no skip connections to re-prove
        schedule_cls = pk.PipelineEngine  # placeholder, replaced below

    from pipekernel.extend.manager import make_plugin_manager, resolve_schedule
    pm = make_plugin_manager()
    fake = Fake()
    fake.schedule_cls = fake.eval_schedule_cls = resolve_schedule(pm, "interleaved")
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ConfigError, match="micro_batches must be a positive int"):
            pk.PipelineEngine._check_micro_batches(fake, bad)
    pk.PipelineEngine._check_micro_batches(fake, 4)
