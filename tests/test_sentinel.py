"""The run-time sentinel (``PipelineEngine(check_every=K)``, pipekernel/engine/sentinel.py):
exact hashes, the option's errors, bugs injected by the test (monkeypatches on one rank,
no switch in the product) named on every rank at the step they happen, and clean runs of
1f1b, zbv and dualpipev with data parallelism that raise nothing."""
from __future__ import annotations

import pytest
import torch

import pipekernel as pk
from pipekernel.engine.sentinel import DEFAULT_CHECK_EVERY, check_every_option, tensor_hash
from pipekernel.testing import run_ranks
from tests.models import adam, tied_lm, token_data


# -- unit: the hash and the option -------------------------------------------------------
@pytest.mark.fast
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16,
                                   torch.float16, torch.int64, torch.uint8, torch.bool])
def test_hash_sees_one_flipped_bit_and_a_swap(dtype):
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(5, 7, generator=g) * 50).to(dtype)
    h = tensor_hash(t)
    assert h.dtype == torch.int64 and h.dim() == 0 and 0 <= int(h) < 2 ** 62
    assert int(tensor_hash(t.clone())) == int(h)
    bits = t.clone().reshape(-1).view(torch.uint8)
    bits[13] ^= 1  # one bit of one element
    assert int(tensor_hash(bits.view(dtype).reshape(5, 7))) != int(h)
    if dtype != torch.bool:
        swapped = t.clone().reshape(-1)
        swapped[[0, 1]] = swapped[[1, 0]]
        if not torch.equal(swapped, t.reshape(-1)):
            assert int(tensor_hash(swapped)) != int(h)


@pytest.mark.fast
def test_hash_sees_the_sign_bit_of_a_float64():
    assert int(tensor_hash(torch.tensor(2.0, dtype=torch.float64))) != \
        int(tensor_hash(torch.tensor(-2.0, dtype=torch.float64)))


@pytest.mark.fast
def test_the_hash_of_a_tensor_in_chunks_is_its_hash_whole(monkeypatch):
    from pipekernel.engine import sentinel

    t = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    whole = int(tensor_hash(t))
    monkeypatch.setattr(sentinel, "_CHUNK", 7)  # 143 chunks, the last one short
    assert int(tensor_hash(t)) == whole


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_hash_is_the_same_on_the_gpu():
    """Integer sums modulo 2**64 do not depend on the reduction order: a replica on a GPU
    hashes as one on the CPU (large tensors too: several chunks)."""
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        for n in (7, (1 << 24) + 5):
            t = (torch.randn(n, generator=g) * 9).to(dtype)
            assert int(tensor_hash(t)) == int(tensor_hash(t.cuda()))


@pytest.mark.fast
def test_object_hash_sees_a_lost_key_a_flipped_byte_and_a_changed_container():
    from pipekernel.engine.sentinel import object_hash

    x = {"hidden": torch.randn(2, 3), "position_ids": torch.arange(6).view(2, 3)}
    h = int(object_hash(x))
    assert int(object_hash({k: v.clone() for k, v in x.items()})) == h
    assert int(object_hash({"hidden": x["hidden"]})) != h
    assert int(object_hash((x["hidden"], x["position_ids"]))) != h
    flipped = x["hidden"].clone()
    flipped.reshape(-1).view(torch.uint8)[5] ^= 1
    assert int(object_hash({**x, "hidden": flipped})) != h


@pytest.mark.fast
def test_both_ends_of_a_transfer_add_into_the_same_slot():
    """A send at position p and its receive at p + 1 (activations), or a gradient sent at
    p + 1 and received at p, land in one slot; the micro-batch weighs in."""
    from pipekernel.engine.sentinel import TransferSums
    from pipekernel.schedules import instructions as isa

    t = torch.randn(4)
    for send, recv, at in ((isa.SendActivation, isa.RecvActivation, (2, 3)),
                           (isa.SendGrad, isa.RecvGrad, (3, 2))):
        a, b = TransferSums(1, 6, "cpu"), TransferSums(1, 6, "cpu")
        a.add(send(micro_batch=1, buffer=0, chunk=0), at[0], t)
        b.add(recv(micro_batch=1, buffer=0, chunk=0), at[1], t.clone())
        assert a.sums.keys() == b.sums.keys() and len(a.sums) == 1
        assert [int(v) for v in a.sums.values()] == [int(v) for v in b.sums.values()]
        c = TransferSums(1, 6, "cpu")
        c.add(recv(micro_batch=2, buffer=0, chunk=0), at[1], t)
        assert [int(v) for v in c.sums.values()] != [int(v) for v in b.sums.values()]
    skip = TransferSums(0, 6, "cpu")
    skip.add(isa.SendSkip(micro_batch=0, buffer=0, chunk=0), 1, t)
    assert skip.sums == {}


@pytest.mark.fast
@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "10"])
def test_check_every_refuses_what_is_not_a_positive_int(bad):
    with pytest.raises(pk.ConfigError, match=r"check_every must be a positive int or None"):
        check_every_option(bad)
    assert check_every_option(None) is None and check_every_option(7) == 7
    assert isinstance(DEFAULT_CHECK_EVERY, int) and DEFAULT_CHECK_EVERY > 0


# -- multi-rank: 2 stages x 2 replicas ---------------------------------------------------
def _token_sum(logits, labels):
    return (torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                              labels.reshape(-1), reduction="sum"),
            torch.tensor(labels.numel()))


def _engine(schedule, check_every, micro_batches=4, tokens=False):
    module = tied_lm(num_stages=2)
    if tokens:
        module.loss_fn = _token_sum
    return pk.PipelineEngine(module, optimizer=adam, micro_batches=micro_batches,
                             schedule=schedule, transport="gloo", data_parallel_size=2,
                             timeout=60, check_every=check_every,
                             loss_reduction="tokens" if tokens else "mean")


def _train(engine, steps, inject=None):
    """Train ``steps`` batches; ``inject(engine, step)`` runs before each (a test's bug)."""
    for step in range(steps):
        if inject is not None:
            inject(engine, step + 1)
        engine.train_batch(iter(token_data(step, engine.data_parallel_rank,
                                           engine.micro_batches)))


def _caught(engine, steps, inject):
    try:
        _train(engine, steps, inject)
    except pk.ConsistencyError as err:
        return {"check": err.check, "parameter": err.parameter, "step": err.train_step,
                "ranks": err.ranks, "stage": err.stage, "text": str(err),
                "perturbed": getattr(engine, "perturbed", None)}
    finally:
        engine.close()
    return None


def _perturb_replica(engine, step):
    """On rank 1 (stage 0, replica 1) at step 3: one element of its last block parameter
    moves by one ulp inside the optimizer step (a replica that diverged)."""
    if step != 3 or engine.rank != 1:
        return
    name, param = [(n, p) for n, p in engine.module.named_parameters() if "lin" in n][-1]
    engine.perturbed = name  # what the test expects named
    opt, step_fn = engine.optimizer, engine.optimizer.step

    def step_then_perturb(*args, **kwargs):
        out = step_fn(*args, **kwargs)
        with torch.no_grad():
            param.view(-1)[0] = torch.nextafter(param.view(-1)[0], torch.tensor(1e9))
        opt.step = step_fn
        return out
    opt.step = step_then_perturb


def _skip_tied_reduction(engine, step):
    """From step 2 on, every rank skips the sum of the tied gradients over stages."""
    if step == 2:
        engine.batch_step.reduce_tied_grads = lambda: None


def _skip_replica_step(engine, step):
    """Rank 3 (stage 1, replica 1) skips its optimizer step at step 2."""
    if step == 2 and engine.rank == 3:
        opt, step_fn = engine.optimizer, engine.optimizer.step

        def skip(*args, **kwargs):
            opt.step = step_fn
        opt.step = skip


def _perturb_moment(engine, step):
    """On rank 2 (stage 1, replica 0) at step 2, after the step: one element of AdamW's
    first moment of its first parameter moves (the parameters stay equal this step)."""
    if step != 2 or engine.rank != 2:
        return
    name, param = next(iter(engine.module.named_parameters()))
    engine.perturbed = name
    opt, step_fn = engine.optimizer, engine.optimizer.step

    def step_then_perturb(*args, **kwargs):
        out = step_fn(*args, **kwargs)
        with torch.no_grad():
            opt.state[param]["exp_avg"].view(-1)[0] += 1.0
        opt.step = step_fn
        return out
    opt.step = step_then_perturb


def _scale_twice(engine, step):
    """Stage 1 (ranks 2, 3) scales its gradients by the token count twice from step 2."""
    if step == 2 and engine.stage == 1:
        once = engine.batch_step._token_scale
        engine.batch_step._token_scale = lambda total: once(total) * once(total)


_INJECT = {"replica": _perturb_replica, "tied": _skip_tied_reduction,
           "skipped_step": _skip_replica_step, "scaled_twice": _scale_twice,
           "moment": _perturb_moment}


def _injected(schedule, bug, every=1):
    torch.set_num_threads(1)
    return _caught(_engine(schedule, every, tokens=bug == "scaled_twice"), 5, _INJECT[bug])


@pytest.mark.parametrize("schedule", ["1f1b", "zbv", "dualpipev"])
def test_a_diverged_replica_is_named_on_every_rank_at_its_step(schedule):
    results = run_ranks(_injected, 4, schedule, "replica", timeout=240)
    assert all(r is not None for r in results), results
    name = results[1]["perturbed"]
    assert name is not None and name.endswith("lin.bias")
    assert all({k: r[k] for k in ("check", "step", "parameter", "stage")} ==
               {"check": "replicas", "step": 3, "parameter": name, "stage": 0}
               for r in results)
    # two replicas: neither is the majority, both are named with their values
    assert all(r["ranks"] in ([0], [1]) for r in results)
    assert "rank(s) [1] hold" in results[2]["text"] and "rank(s) [0] hold" in results[2]["text"]
    assert "train step 3" in results[3]["text"] and name in results[3]["text"]


def test_with_check_every_2_a_fault_at_step_3_is_seen_at_step_4_after_a_clean_2():
    results = run_ranks(_injected, 4, "1f1b", "replica", 2, timeout=240)
    assert all(r is not None and r["step"] == 4 and r["check"] == "replicas"
               for r in results), results
    assert "the last clean check was after train step 2; checks run every 2 step(s)" \
        in results[0]["text"]


def test_a_replica_whose_optimizer_state_diverged_is_named():
    results = run_ranks(_injected, 4, "zbv", "moment", timeout=240)
    name = results[2]["perturbed"]
    assert all(r is not None and r["step"] == 2 and r["stage"] == 1
               and r["check"] == "replicas (optimizer state)" and r["parameter"] == name
               for r in results), results


def test_a_tied_copy_not_reduced_is_named():
    results = run_ranks(_injected, 4, "1f1b", "tied", timeout=240)
    assert all(r is not None and r["check"] == "tied" and r["step"] == 2 for r in results), results
    assert all("embed" in r["parameter"] and "weight" in r["parameter"] for r in results)


def test_a_replica_that_skipped_its_step_is_named():
    results = run_ranks(_injected, 4, "dualpipev", "skipped_step", timeout=240)
    assert all(r is not None and r["step"] == 2 and r["stage"] == 1 for r in results), results
    assert all(r["check"].startswith("replicas") for r in results)


def test_a_stage_that_scaled_its_gradients_twice_is_named():
    results = run_ranks(_injected, 4, "1f1b", "scaled_twice", timeout=240)
    assert all(r is not None and r["step"] == 2 and r["check"] == "normalisation"
               and r["parameter"] == "gradient scale" for r in results), results
    # under 1f1b its tied copies (stages 0 and 1) diverge too: the cause is named first
    assert all(sorted(r["ranks"]) in ([0, 1], [2, 3]) for r in results)


def _clean(schedules, steps):
    torch.set_num_threads(1)
    done = {}
    for schedule in schedules:
        engine = _engine(schedule, 1)
        try:
            _train(engine, steps)
            done[schedule] = (engine.sentinel.last_clean, engine.global_steps)
        finally:
            engine.close()
    return done


def test_clean_runs_raise_nothing():
    steps = 60
    results = run_ranks(_clean, 4, ["1f1b", "zbv", "dualpipev"], steps, timeout=400)
    assert all(r == {s: (steps, steps) for s in ("1f1b", "zbv", "dualpipev")}
               for r in results), results


LAYOUTS = [{"data_parallel_shard": 2}, {"data_parallel_size": 2, "zero_stage": 1},
           {"data_parallel_size": 2, "precision": "bf16"}, {"tensor_parallel_size": 2}]


def _tp_plan():
    """Two of :func:`tests.models.mlp`'s Linear layers split (one per stage)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    return {"1": ColwiseParallel(output_layouts=Replicate()),
            "11": RowwiseParallel(input_layouts=Replicate())}


def _layouts(layouts, steps):
    from tests.models import mlp, mlp_data
    torch.set_num_threads(1)
    done = []
    try:  # the constructor refuses a bad value on every rank, before anything is built
        pk.PipelineEngine(mlp(num_stages=2), optimizer=adam, timeout=60, check_every=0)
    except pk.ConfigError as err:
        done.append(str(err).splitlines()[0])
    for kw in layouts:
        if kw.get("tensor_parallel_size", 1) > 1:
            kw = {**kw, "tensor_parallel_plan": _tp_plan()}
        engine = pk.PipelineEngine(mlp(num_stages=2), optimizer=adam, micro_batches=2,
                                   timeout=60, check_every=1, **kw)
        try:
            for step in range(steps):
                engine.train_batch(iter(mlp_data(step, engine.data_parallel_rank, 2)))
            done.append(engine.sentinel.last_clean)
        finally:
            engine.close()
    return done


def test_fsdp_zero_low_precision_and_tensor_parallel_layouts_pass_clean():
    """DTensor shards, ZeRO-1's sharded optimizer state, bf16's fp32 master copies and
    tensor-parallel ranks: the checks run (every step) and find nothing."""
    results = run_ranks(_layouts, 4, LAYOUTS, 3, timeout=300)
    refused = "check_every must be a positive int or None, got 0"
    assert all(refused in r[0] for r in results), results
    assert [r[1:] for r in results] == [[3] * len(LAYOUTS)] * 4, results


def _expert_slices(steps):
    """1 stage x 4 replicas, experts spread over 2 (each slice held by 2 replicas): clean
    steps pass; then rank 2's copy of one expert moves by one ulp after step ``steps``."""
    from pipekernel.apps.gpt import VOCAB, gpt_module
    from pipekernel.grid.expert_parallel import is_expert

    torch.set_num_threads(1)
    module = gpt_module(16, 2, 2, 8, num_stages=1, seed=5, experts=4, top_k=2)
    engine = pk.PipelineEngine(module, optimizer=adam, micro_batches=2, check_every=1,
                               expert_parallel_size=2, timeout=60)
    g = torch.Generator().manual_seed(engine.data_parallel_rank)

    def batch():
        ids = torch.randint(0, VOCAB, (2, 2, 9), generator=g)
        return iter([(ids[m, :, :-1], ids[m, :, 1:]) for m in range(2)])
    name = None
    try:
        for step in range(steps):
            engine.train_batch(batch())
        clean = engine.sentinel.last_clean
        if engine.rank == 2:
            name, p = next((n, p) for n, p in engine.module.named_parameters() if is_expert(p))
            with torch.no_grad():
                p.view(-1)[0] = torch.nextafter(p.view(-1)[0], torch.tensor(1e9))
        engine.train_batch(batch())
    except pk.ConsistencyError as err:
        return clean, err.check, err.parameter, err.ranks, name
    finally:
        engine.close()
    return clean, None, None, None, name


def test_an_expert_slice_that_diverged_from_its_replica_is_named():
    results = run_ranks(_expert_slices, 4, 2, timeout=300)
    name = results[2][4]
    assert name is not None
    # rank 2 holds the same slice as rank 0 (expert-data-parallel group {0, 2})
    assert all(r[:4] == (2, "replicas (experts)", name, [0]) or
               r[:4] == (2, "replicas (experts)", name, [2]) for r in results), results


def _hsdp_shards(steps):
    """1 stage x 2 replicas x 2 FSDP2 shards (HSDP): clean steps pass; then rank 3's
    shard of one parameter moves by one ulp after step ``steps``."""
    from tests.models import mlp, mlp_data

    torch.set_num_threads(1)
    engine = pk.PipelineEngine(mlp(num_stages=1), optimizer=adam, micro_batches=2,
                               data_parallel_size=2, data_parallel_shard=2, check_every=1,
                               timeout=60)
    name = None
    try:
        for step in range(steps + 1):
            if step == steps and engine.rank == 3:
                name, p = next(iter(engine.module.named_parameters()))
                local = p.to_local() if hasattr(p, "to_local") else p
                with torch.no_grad():
                    local.view(-1)[0] = torch.nextafter(local.view(-1)[0],
                                                        torch.tensor(1e9))
            engine.train_batch(iter(mlp_data(step, engine.data_parallel_rank, 2)))
            clean = engine.sentinel.last_clean
    except pk.ConsistencyError as err:
        return clean, err.check, err.parameter, sorted(err.ranks), name
    finally:
        engine.close()
    return clean, None, None, None, name


def test_an_fsdp2_shard_that_diverged_from_its_replica_is_named():
    results = run_ranks(_hsdp_shards, 4, 2, timeout=300)
    name = results[3][4]
    assert name is not None
    # rank 3 (replica 1, shard 1) is compared with rank 1 (replica 0, shard 1) only
    assert all(r[0] == 2 and r[1].startswith("replicas") and r[2] == name
               and r[3] in ([1], [3]) for r in results), results
