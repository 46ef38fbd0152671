"""Expert parallelism on Hugging Face MoE blocks (``expert_parallel_size=2``): a tiny
Qwen3-MoE (4 experts, top-2, router aux loss on) at PP2 x EP2 on 4 ranks trains one step
like the unmodified model in one process with gradient accumulation over both replicas'
micro-batches — loss and every parameter within 1e-5, each rank's expert stacks compared
with its slice of the reference — under 1f1b and dualpipev (clipped: the global norm
counts each expert once), and so does DeepSeek-V3 (a dense first layer, a shared expert,
no router loss in its forward) under 1f1b; each rank holds 1/E of each MoE layer's
experts (from the parameter shapes); ``save_pretrained`` writes whole experts (the
directory loads into ``from_pretrained`` as the reference), and so does
``save_checkpoint`` (``load_checkpoint`` cuts each rank's slice again; through DCP too). Bad input — 2 not dividing 3
experts, a dense model — is a ConfigError naming it.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_families as F  # noqa: E402
import pipekernel as pk  # noqa: E402
import pipekernel.hf as hf  # noqa: E402
from pipekernel.grid import expert_parallel  # noqa: E402
from pipekernel.testing import assert_parity, run_ranks  # noqa: E402

pytestmark = pytest.mark.multirank

MICRO_BATCHES, REPLICAS, EXPERTS, COEF = 4, 2, 4, 0.5
#: (family, schedule, chunks, partition, max_grad_norm): two decoder layers per stage / the
#: V's four parts; the clip (below the step's norm) checks the EP-aware global norm
CASES = [("qwen3_moe", "1f1b", None, [0, 3, 6], None),
         ("qwen3_moe", "dualpipev", 2, [0, 2, 3, 5, 6], 0.5),
         ("deepseek_v3", "1f1b", None, [0, 3, 6], None)]


def sgd(params):
    return torch.optim.SGD(params, lr=0.5)


def build(family="qwen3_moe", **changes):
    model, why = F.build(family, output_router_logits=True, router_aux_loss_coef=COEF,
                         **changes)
    assert model is not None, why
    return model


def items(replica):
    return [F.batch(100 * replica + m) for m in range(MICRO_BATCHES)]


def reference(family, clip):
    """The unmodified model, one SGD step accumulating ``loss / (M * D)`` over every
    replica's micro-batches (gradients clipped to ``clip``): ``(mean loss, state_dict)``."""
    model = build(family)
    opt = sgd(model.parameters())
    model.train()
    total = 0.0
    for replica in range(REPLICAS):
        for b in items(replica):
            loss = model(**b).loss / (MICRO_BATCHES * REPLICAS)
            loss.backward()
            total += loss.item()
    if clip is not None:
        assert torch.nn.utils.clip_grad_norm_(model.parameters(), clip) > clip
    opt.step()
    return total, model.state_dict()


def train(family, schedule, chunks, partition, clip, path):
    # the model's own per-micro-batch loss (pipeline_module's default with a router loss)
    module = hf.pipeline_module(build(family), num_stages=2, partition=partition,
                                loss_fn=hf.causal_lm_mean_loss)
    engine = pk.PipelineEngine(module, optimizer=sgd, micro_batches=MICRO_BATCHES,
                               schedule=schedule, chunks=chunks, expert_parallel_size=2,
                               max_grad_norm=clip, timeout=60)
    try:
        loss = engine.train_batch(iter(items(engine.data_parallel_rank))).item()
        experts = {n.partition(".")[2] for n, p in engine.module.named_parameters()
                   if expert_parallel.is_expert(p)}
        state = {k.partition(".")[2]: v.detach().clone()
                 for k, v in engine.module.state_dict().items()}
        reloaded = None
        if path is not None:
            hf.save_pretrained(engine, path)
            reloaded = _reload(engine, partition, state, path + "-checkpoint")
        return {"loss": loss, "state": state, "experts": experts,
                "ep_rank": engine.ep_group.rank, "reloaded": reloaded}
    finally:
        engine.close()


def _reload(engine, partition, state, path):
    """``save_checkpoint`` (whole expert stacks; a DCP directory as written before issue 45
    too, tests/dcp_legacy.py) and ``load_checkpoint``
    into a fresh engine (this rank's slice again): whether the state comes back equal."""
    engine.save_checkpoint(path, tag="ep")
    from dcp_legacy import save_dcp
    save_dcp(engine, path, "dcp")
    again = pk.PipelineEngine(hf.pipeline_module(build(), num_stages=2, partition=partition,
                                                 loss_fn=hf.causal_lm_mean_loss),
                              optimizer=sgd, micro_batches=MICRO_BATCHES,
                              expert_parallel_size=2, timeout=60)
    try:
        same = []
        for tag in ("dcp", "ep"):  # DCP first: the fresh engine's weights are not the saved
            again.load_checkpoint(path, tag=tag)
            loaded = {k.partition(".")[2]: v for k, v in again.module.state_dict().items()}
            same.append(loaded.keys() == state.keys() and all(torch.equal(loaded[k], v)
                                                              for k, v in state.items()))
        return all(same)
    finally:
        again.close()


def refused(**changes):
    """What ``expert_parallel_size=2`` raises for ``changes`` to the model."""
    model = changes["model"] if "model" in changes else build(**changes)
    module = hf.pipeline_module(model, num_stages=2, partition=[0, 3, 6])
    try:
        pk.PipelineEngine(module, optimizer=sgd, micro_batches=2, expert_parallel_size=2,
                          timeout=60).close()
    except pk.ConfigError as err:
        return str(err)
    return None


def _worker(path):
    torch.set_num_threads(1)
    runs = [train(*case, path if index == 0 else None) for index, case in enumerate(CASES)]
    dense, why = F.build("llama")
    assert dense is not None, why
    errors = [refused(num_experts=3, num_experts_per_tok=2), refused(model=dense)]
    return runs, errors


def _check(runs, ref_loss, ref_state):
    covered = set()
    for run in runs:
        assert run["experts"], "every stage holds MoE blocks"
        state, local, rank = run["state"], EXPERTS // 2, run["ep_rank"]
        expected = {}
        for key, value in state.items():
            if key in run["experts"]:  # 1/E of each MoE layer's experts: this rank's slice
                assert value.shape[0] == local, (key, value.shape)
                expected[key] = ref_state[key][rank * local:(rank + 1) * local]
            else:
                expected[key] = ref_state[key]
        assert_parity([run["loss"]], [ref_loss], state, expected)
        covered |= set(state)
    assert covered == set(ref_state)


def test_qwen3_moe_pp2_ep2_trains_like_one_process(tmp_path):
    results = run_ranks(_worker, 4, str(tmp_path), timeout=300)
    refs = {(case[0], case[4]): reference(case[0], case[4]) for case in CASES}
    for index, case in enumerate(CASES):
        _check([runs[index] for runs, _ in results], *refs[case[0], case[4]])
    assert all(runs[0]["reloaded"] for runs, _ in results)  # engine checkpoints too
    for _, errors in results:
        assert "does not divide Qwen3MoeForCausalLM's 3 experts in model.layers.0.mlp" \
               ".experts" in (errors[0] or ""), errors[0]
        assert "LlamaForCausalLM's decoder layers (model.layers.*) hold no MoE experts " \
               "module" in (errors[1] or ""), errors[1]
    saved = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    ref_loss, ref_state = refs["qwen3_moe", None]
    assert_parity([ref_loss], [ref_loss], saved.state_dict(), ref_state)
