"""DTensor tensor parallelism inside each stage (issue 28): a ``parallelize_module`` plan
over ``mesh["tp"]`` trains like one process, alone (PP2 x TP2) and under FSDP2 (FSDP2 x TP2
on one stage); bad plans fail before the first step. The multi-rank cases run in one
world per world size (tests/sweep.py)."""
from __future__ import annotations

import importlib.util

import pytest
import torch
from models import ff_model, ff_plan, mlp_data, sgd
from sweep import Sweep, refused

import pipekernel as pk
from pipekernel.testing import reference_train

MB, STEPS = 2, 3
SWEEP = Sweep()  # the cases below: one world of 4 ranks, one of 2


def _engine(stages, shard, hidden=32, extra=None):
    return pk.PipelineEngine(ff_model(stages, hidden), optimizer=sgd, micro_batches=MB,
                             tensor_parallel_size=2, tensor_parallel_plan=ff_plan(extra),
                             data_parallel_shard=shard, max_grad_norm=0.5, timeout=120)


def tp_worker(stages, shard):
    torch.set_num_threads(1)
    from torch.distributed.tensor import DTensor

    engine = _engine(stages, shard)
    losses = [engine.train_batch(iter(mlp_data(s, engine.data_parallel_rank, MB))).item()
              for s in range(STEPS)]
    state = {}
    for name, value in engine.module.state_dict().items():
        state[name] = (value.full_tensor() if isinstance(value, DTensor) else value).clone()
    fc1 = [p for n, p in engine.module.named_parameters() if n.endswith("fc1.weight")]
    return {"losses": losses, "state": state, "norm": engine.last_grad_norm,
            "fc1_local": [tuple(p.to_local().shape) for p in fc1],
            "placements": [str(p.placements) for p in fc1]}


def _check(results, replicas):
    batches = [[mlp_data(s, r, MB) for r in range(replicas)] for s in range(STEPS)]
    ref_losses, ref_state = reference_train(
        ff_model(1), sgd, batches, MB,
        hook=lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5))
    for result in results:
        assert result["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
        for name, value in result["state"].items():
            torch.testing.assert_close(value, ref_state[name], rtol=1e-5, atol=1e-6)
        assert result["norm"] > 0.5  # it clipped, with the same norm as one process
    assert len({round(r["norm"], 6) for r in results}) == 1


PP2_X_TP2 = SWEEP.case("pp2-tp2", 4, tp_worker, 2, 1)
FSDP2_X_TP2 = SWEEP.case("fsdp2-tp2", 4, tp_worker, 1, 2)


def test_pp2_x_tp2_with_a_dtensor_plan_matches_one_process():
    results = SWEEP.results(PP2_X_TP2)
    _check(results, replicas=1)
    for result in results:  # each tp rank holds half of every fc1 (32 -> 16 rows)
        assert result["fc1_local"] and all(shape == (16, 16) for shape in result["fc1_local"])


def test_fsdp2_x_tp2_on_one_stage_matches_one_process():
    results = SWEEP.results(FSDP2_X_TP2)
    _check(results, replicas=2)
    for result in results:  # 2-D: rows over tp, then over dp_shard
        assert result["fc1_local"] and all(shape == (8, 16) for shape in result["fc1_local"])


def refused_worker(stages, shard, hidden=32, typo=False):
    """The refusal's text, ``None`` when the engine built. ``typo``: a plan entry that
    matches no module. In the world of 4 ranks it runs last: a refusal leaves its world
    as it is (tests/sweep.py)."""
    torch.set_num_threads(1)
    from torch.distributed.tensor.parallel import ColwiseParallel

    extra = {"*.fc3": ColwiseParallel()} if typo else None
    return refused(lambda: _engine(stages, shard, hidden, extra))


BAD_PLANS = [(SWEEP.case("typo", 2, refused_worker, 1, 1, 32, True),
              "match no module on any stage"),
             (SWEEP.case("hidden-33", 2, refused_worker, 1, 1, 33),
              "out_features=33, which tensor_parallel_size=2 does not divide")]


@pytest.mark.parametrize("case,words", BAD_PLANS, ids=["typo", "33"])
def test_bad_plans_fail_before_the_first_step(case, words):
    for message in SWEEP.results(case):
        assert message is not None, "no error on a rank"
        assert words in message


def hf_tp_worker():
    torch.set_num_threads(1)
    import test_hf as t
    from torch.distributed.tensor import DTensor

    import pipekernel.hf as hf

    module = hf.pipeline_module(t.llama(), num_stages=2)
    engine = pk.PipelineEngine(module, optimizer=t.sgd, micro_batches=t.MICRO_BATCHES,
                               tensor_parallel_size=2, tensor_parallel_plan="hf",
                               loss_reduction="tokens", timeout=120)
    losses = [engine.train_batch(iter(t.batches(step, engine.data_parallel_rank))).item()
              for step in range(t.STEPS)]
    state = {k.partition(".")[2]: (v.full_tensor() if isinstance(v, DTensor) else v).clone()
             for k, v in engine.module.state_dict().items()}
    sharded = [n for n, p in engine.module.named_parameters() if isinstance(p, DTensor)]
    return losses, state, sharded


HF_LLAMA = SWEEP.case("hf-llama", 4, hf_tp_worker) \
    if importlib.util.find_spec("transformers") else None


def test_pp2_x_tp2_on_an_unmodified_hf_llama_with_its_own_plan():
    pytest.importorskip("transformers")
    import test_hf as t

    results = SWEEP.results(HF_LLAMA)
    ref_losses, ref_model = t.reference("llama", 1)
    for losses, state, sharded in results:
        assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
        t.check_state(state, ref_model, "hf tp")
        # the plan's seven projections of each decoder layer the stage holds
        assert sharded and all(any(k in n for k in ("q_proj", "k_proj", "v_proj", "o_proj",
                                                     "gate_proj", "up_proj", "down_proj"))
                               for n in sharded)


# 2 replicas x TP2 on one stage: DTensor gradients that nothing would average
NO_FSDP = SWEEP.case("replicas-without-fsdp", 4, refused_worker, 1, 1)


def test_a_dtensor_plan_with_replicas_but_no_fsdp_is_refused():
    for message in SWEEP.results(NO_FSDP):
        assert message is not None and "only FSDP2 reduces DTensor gradients" in message
