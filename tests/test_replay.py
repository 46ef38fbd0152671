"""The replay check (``engine.verify_batch``, pipekernel/engine/replay.py): a layer that is
not safe to recompute, split or reorder is named under 1f1b with activation checkpointing,
zbv and dualpipev; a clean model with dropout passes and verify_batch leaves the weights,
the optimizer and the counters alone; a stage that cannot replay is refused by name.
One process world for the file (2 ranks)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import pipekernel as pk
from pipekernel.engine.replay import check_replayable
from pipekernel.engine.sentinel import tensor_hash
from pipekernel.testing import run_ranks
from tests.models import adam, token_data
from tests.replay_layers import CallCounter, InPlaceInput, OwnRandom, lm

LAYERS = {"counter": CallCounter, "own_rng": OwnRandom, "in_place": InPlaceInput, None: None}
SETUPS = [("1f1b", 1), ("zbv", 0), ("dualpipev", 0)]  # (schedule, checkpoint interval)


def _weights(engine):
    return [int(tensor_hash(p)) for p in engine.module.parameters()]


def _one(bad, schedule, checkpoint):
    """Verify, train, verify the next batch: what happened (an error's fields, or the
    losses and whether verify_batch left everything as it was)."""
    # in place: not the first layer of a part (there it is a leaf: autograd refuses loudly)
    at = 5 if bad == "in_place" else 4
    engine = pk.PipelineEngine(lm(LAYERS[bad], checkpoint=checkpoint, at=at), optimizer=adam,
                               micro_batches=4, schedule=schedule, transport="gloo",
                               timeout=60)
    try:
        before, rng = _weights(engine), torch.get_rng_state()
        verified = float(engine.verify_batch(iter(token_data(0, 0, 4))))
        torch.set_rng_state(rng)  # the train step draws the same dropout masks
        untouched = _weights(engine) == before and engine.global_steps == 0 \
            and not engine.optimizer.state \
            and all(p.grad is None for p in engine.module.parameters())
        trained = float(engine.train_batch(iter(token_data(0, 0, 4))))
        engine.verify_batch(iter(token_data(1, 0, 4)))
        return {"verified": verified, "trained": trained, "untouched": untouched}
    except pk.ConsistencyError as err:
        return {"check": err.check, "module": err.parameter, "stage": err.stage,
                "step": err.train_step, "text": str(err)}
    finally:
        engine.close()


def _refused():
    """A model-supplied overlapped_forward_backward: refused before anything runs."""
    module = lm()
    from pipekernel.stage.paired import sequential
    module.overlapped_forward_backward = sequential
    engine = pk.PipelineEngine(module, optimizer=adam, micro_batches=4, schedule="dualpipev",
                               transport="gloo", timeout=60)
    try:
        engine.verify_batch(iter(token_data(0, 0, 4)))
    except pk.ConfigError as err:
        return str(err)
    finally:
        engine.close()
    return None


def _option():
    """``verify_every=2`` on a call-counting model: step 1 trains, step 2's train_batch
    replays first and raises; gradients pending before a verify_batch (a host that
    accumulates) are there after it, untouched."""
    engine = pk.PipelineEngine(lm(CallCounter), optimizer=adam, micro_batches=4,
                               transport="gloo", timeout=60, verify_every=2, check_every=None)
    out = {}
    try:
        p = next(iter(engine.module.parameters()))
        p.grad = torch.full_like(p, 0.5)
        try:
            engine.verify_batch(iter(token_data(0, 0, 4)))
        except pk.ConsistencyError:
            pass
        out["pending kept"] = bool(torch.equal(p.grad, torch.full_like(p, 0.5)))
        p.grad = None
        engine.train_batch(iter(token_data(0, 0, 4)))
        engine.train_batch(iter(token_data(1, 0, 4)))
    except pk.ConsistencyError as err:
        out.update(check=err.check, step=err.train_step, steps=engine.global_steps)
    finally:
        engine.close()
    return out


def _all(cases):
    torch.set_num_threads(1)
    return {case: _one(*case) for case in cases}, _refused(), _option()


@pytest.fixture(scope="module")
def outcomes():
    cases = [(bad, s, c) for bad in (None, "counter", "own_rng", "in_place") for s, c in SETUPS]
    results = run_ranks(_all, 2, cases, timeout=600)
    assert results[0] == results[1] or all(
        {k: v for k, v in results[0][0][c].items() if k != "text"} ==
        {k: v for k, v in results[1][0][c].items() if k != "text"} for c in cases), results
    return results[0]


@pytest.mark.parametrize("schedule,checkpoint", SETUPS)
def test_a_clean_model_with_dropout_passes_and_nothing_moves(outcomes, schedule, checkpoint):
    got = outcomes[0][(None, schedule, checkpoint)]
    assert got.get("untouched") is True, got
    # verify_batch returned the batch's loss: the first train step on it computes the same
    assert got["verified"] == pytest.approx(got["trained"], rel=1e-6)


@pytest.mark.parametrize("bad", ["counter", "own_rng"])
@pytest.mark.parametrize("schedule,checkpoint", SETUPS)
def test_a_layer_not_safe_to_replay_is_named(outcomes, bad, schedule, checkpoint):
    got = outcomes[0][(bad, schedule, checkpoint)]
    assert got.get("check") == "replay", got
    assert got["module"] == "4" and got["stage"] == 1 and got["step"] == 1, got
    assert "module '4' (" in got["text"] and "stage 1" in got["text"], got


@pytest.mark.parametrize("schedule,checkpoint", SETUPS)
def test_a_layer_in_place_on_its_input_is_what_one_process_computes(outcomes, schedule,
                                                                    checkpoint):
    """The engine copies a checkpointed segment's input and gives each chunk its own
    received tensors: in place on its input is safe, and the replay agrees."""
    got = outcomes[0][("in_place", schedule, checkpoint)]
    assert got.get("untouched") is True, got


def test_a_stage_that_cannot_replay_is_refused_by_name(outcomes):
    text = outcomes[1]
    assert text is not None and "verify_batch cannot replay" in text, text
    assert "how to fix: verify without overlapped_forward_backward" in text, text


def test_verify_every_replays_inside_train_batch_and_pending_gradients_stay(outcomes):
    assert outcomes[2] == {"pending kept": True, "check": "replay", "step": 2, "steps": 1}


@pytest.mark.fast
def test_verify_every_refuses_what_is_not_a_positive_int():
    from pipekernel.engine.sentinel import check_every_option

    with pytest.raises(pk.ConfigError, match=r"verify_every must be a positive int or None"):
        check_every_option(0, "verify_every")


@pytest.mark.fast
@pytest.mark.parametrize("change,why", [
    ({"data_parallel_shard": 2}, "FSDP2 reduce-scatters"),
    ({"tensor_parallel_size": 2}, "collectives inside the forward"),
    ({"expert_parallel_size": 2}, "all-to-alls"),
    ({"skip_edges": [(1, 2)]}, "skip connections"),
    ({"schedule_cls": type("S", (), {"seq_chunks": 2})}, "seq_chunks > 1"),
    ({"optimizer": None}, "no optimizer")])
def test_check_replayable_says_why_and_what_to_change(change, why):
    parallel = SimpleNamespace(data_parallel_shard=1, tensor_parallel_size=1,
                               expert_parallel_size=1)
    fields = {"skip_edges": [], "optimizer": object(), "schedule_cls": object}
    for key, value in change.items():
        if hasattr(parallel, key):
            setattr(parallel, key, value)
        else:
            fields[key] = value
    engine = SimpleNamespace(parallel=parallel, runtime=SimpleNamespace(pairs=False), rank=0,
                             stage=0, **fields)
    with pytest.raises(pk.ConfigError, match=why) as info:
        check_replayable(engine)
    assert info.value.hint
