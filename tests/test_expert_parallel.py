"""Expert parallelism (``expert_parallel_size``): PP2 x EP2 on the own MoE GPT trains like
one process (aux loss included) under 1f1b and dualpipev; each rank holds 1/E of the
stage's experts; bad sizes are a ConfigError naming them."""
from __future__ import annotations

import pytest
import torch

import pipekernel as pk
from pipekernel.grid.topology import Topology
from pipekernel.apps.gpt import VOCAB, gpt_module
from pipekernel.grid import expert_parallel
from pipekernel.testing import assert_parity, reference_train, run_ranks

EXPERTS, STEPS, CONTEXT = 4, 2, 8


def build(num_stages=None, experts=EXPERTS):
    return gpt_module(16, 4, 2, CONTEXT, num_stages=num_stages, partition="uniform", seed=5,
                      experts=experts, top_k=2)


def data(step, replica, micro_batches):
    g = torch.Generator().manual_seed(500 * step + 7 * replica)
    ids = torch.randint(0, VOCAB, (micro_batches, 2, CONTEXT + 1), generator=g)
    return [(ids[m, :, :-1], ids[m, :, 1:]) for m in range(micro_batches)]


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


#: (schedule, micro-batches, max_grad_norm)
CASES = [("1f1b", 4, None), ("dualpipev", 4, 0.5)]


def _config_errors():
    """What every rank raises for sizes that do not fit (before any training)."""
    found = []
    for experts, ep in ((EXPERTS, 3), (3, 2)):
        try:
            pk.PipelineEngine(build(2, experts), optimizer=sgd, expert_parallel_size=ep,
                              timeout=60)
        except pk.ConfigError as err:
            found.append(str(err))
    return found


def _worker(path):
    out = {"errors": _config_errors(), "runs": []}
    for index, (schedule, micro_batches, clip) in enumerate(CASES):
        engine = pk.PipelineEngine(build(2), optimizer=sgd, micro_batches=micro_batches,
                                   schedule=schedule, expert_parallel_size=2,
                                   max_grad_norm=clip, timeout=60)
        losses = [engine.train_batch(iter(data(s, engine.data_parallel_rank, micro_batches)))
                  .item() for s in range(STEPS)]
        experts = {n for n, p in engine.module.named_parameters()
                   if expert_parallel.is_expert(p)}
        state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
        out["runs"].append((losses, state, experts, engine.ep_group.rank,
                            engine.last_grad_norm))
        if index == 0:  # whole stacks in the files, this rank's slice on load
            engine.save_checkpoint(path, tag="ep")
            again = pk.PipelineEngine(build(2), optimizer=sgd, micro_batches=micro_batches,
                                      schedule=schedule, expert_parallel_size=2, timeout=60)
            again.load_checkpoint(path, tag="ep")
            loaded = again.module.state_dict()
            mine, theirs = (o.optimizer.state_dict()["state"] for o in (engine, again))
            out["reloaded"] = (all(torch.equal(loaded[k], v) for k, v in state.items())
                               and mine.keys() == theirs.keys() and all(
                                   torch.equal(mine[i]["momentum_buffer"],
                                               theirs[i]["momentum_buffer"]) for i in mine))
            again.close()
        engine.close()
    out["nonfinite"] = _nonfinite_expert()
    return out


def _nonfinite_expert():
    """A NaN in one expert of one expert-parallel rank of stage 0: every rank raises."""
    engine = pk.PipelineEngine(build(2), optimizer=sgd, micro_batches=2,
                               expert_parallel_size=2, timeout=60)
    if engine.stage == 0 and engine.ep_group.rank == 1:
        with torch.no_grad():
            for name, p in engine.module.named_parameters():
                if name.endswith("mlp.w_in"):
                    p.fill_(float("nan"))
    try:
        engine.train_batch(iter(data(0, engine.data_parallel_rank, 2)))
    except pk.NonFiniteLossError as err:
        return str(err)
    finally:
        engine.close()
    return None


def _reference(clip):
    def hook(model):
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    return hook


def test_pp2_ep2_trains_like_one_process_under_1f1b_and_dualpipev(tmp_path):
    results = run_ranks(_worker, 4, str(tmp_path), timeout=400)
    assert all(r["reloaded"] for r in results)
    assert all("loss is NaN/inf at train step 1" in (r["nonfinite"] or "") for r in results)
    for errors in (r["errors"] for r in results):
        assert len(errors) == 2
        assert "expert_parallel_size=3 does not divide the data-parallel size 2" in errors[0]
        assert "3 experts are not divisible by the expert-parallel size 2" in errors[1]
    for index, (schedule, micro_batches, clip) in enumerate(CASES):
        batches = [[data(s, r, micro_batches) for r in range(2)] for s in range(STEPS)]
        ref_losses, ref_state = reference_train(build(), sgd, batches, micro_batches,
                                                hook=_reference(clip))
        covered = set()
        for result in results:
            losses, state, experts, ep_rank, _ = result["runs"][index]
            assert experts, "every stage holds MoE blocks"
            local = EXPERTS // 2
            for key in experts:  # 1/E of the stage's experts: this rank's slice
                assert state[key].shape[0] == local, (key, state[key].shape)
                state[key + "@full"] = ref_state[key][ep_rank * local:(ep_rank + 1) * local]
            expected = {k: (state.pop(k + "@full") if k in experts else ref_state[k])
                        for k in list(state) if not k.endswith("@full")}
            assert_parity(losses, ref_losses, state, expected)
            covered |= set(state)
        assert covered == set(ref_state), schedule
        norms = {r["runs"][index][4] for r in results}
        assert len(norms) == 1  # the same global norm on every rank
        if index == 0:  # the checkpoint is the whole single-process model
            whole = pk.load_sequential(str(tmp_path), build(), tag="ep").state_dict()
            assert_parity(ref_losses, ref_losses, whole, ref_state)


def test_the_moe_layer_refuses_bad_sizes_by_name():
    with pytest.raises(pk.ConfigError, match="top_k=5 with 4 experts"):
        pk.MoE(8, 8, 4, top_k=5)
    group = expert_parallel.ExpertParallelGroup(rank=1, size=2, ranks=[2, 3])
    with expert_parallel.context(group):
        layer = pk.MoE(8, 8, 4)
        assert layer.w_in.shape[0] == 2 and expert_parallel.is_expert(layer.w_in)
        with pytest.raises(pk.ConfigError, match="5 experts are not divisible by the "
                                                 "expert-parallel size 2"):
            pk.MoE(8, 8, 5)


def test_the_groups_follow_the_data_parallel_ranks():
    topo = Topology.from_world(8, 0, 2, 4)
    parallel, data_groups = expert_parallel.expert_groups(topo, 2)
    assert parallel == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert data_groups == [[0, 2], [1, 3], [4, 6], [5, 7]]
    with pytest.raises(pk.ConfigError, match="expert_parallel_size must be a positive int"):
        expert_parallel.check_config(0, 4)
    with pytest.raises(pk.ConfigError, match="zero_stage=1"):
        expert_parallel.check_config(2, 4, zero_stage=1)
