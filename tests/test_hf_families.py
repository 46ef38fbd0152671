"""Every causal-LM family transformers ships trains like its own forward, or is refused.

transformers' own list (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, see ``tests/hf_families.py``)
at small sizes, each trained one step at 2 stages in one 2-process world that loops over the
families — two padded micro-batches and two packed ones as Hugging Face's own
``DataCollatorWithFlattening`` makes them (with its flash-attention keys where the family's
forward takes them) and as TRL pads packed rows — against the same model trained in one
process through its own ``forward`` (its own loss, ``use_cache`` off as HF's ``Trainer``
sets it): every family that builds either matches (loss and every parameter <= 1e-5) or is
refused by ``pipeline_module`` with a ``ConfigError`` at build time; a mismatch or any other
error fails. Each family's ``save_pretrained`` key set (every stage's) must be the one
HF's own ``save_pretrained`` writes for the same model. The verdicts must equal ``tests/fixtures/hf_families.json``, from which
docs/hf.md's table is generated (``PK_WRITE_FAMILIES=1`` rewrites the file, then
``python tests/hf_families.py`` the table). A 4-process run trains the families whose fixes
this file pins (tuple blocks at 4 layers, soft-capping, logit scales, norms found without
``tail=``) at 4 stages.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from safetensors.torch import load_file  # noqa: E402

import hf_families as F  # noqa: E402
import pipekernel as pk  # noqa: E402
import pipekernel.hf as hf  # noqa: E402
from pipekernel.errors import ConfigError  # noqa: E402
from pipekernel.hf.save import stage_state  # noqa: E402
from pipekernel.testing import run_ranks  # noqa: E402

MICRO_BATCHES, TOLERANCE = 2, 1e-5
#: config values that make a family's post-processing matter at small sizes (random tiny
#: models have logits far below Gemma 2's default cap of 30)
CHANGES = {"gemma2": {"final_logit_softcapping": 0.5}}


def sgd(params):
    return torch.optim.SGD(params, lr=0.5)


def items(replica=0):
    return [F.batch(10 * replica + i) for i in range(MICRO_BATCHES)]


def reference(model, steps):
    """SGD steps of ``model`` through its own forward and loss, ``use_cache`` off as HF's
    ``Trainer`` sets it (with a cache transformers does not split packed documents): the
    token-weighted loss of each step."""
    opt = sgd(model.parameters())
    model.train()
    model.config.use_cache = False
    losses = []
    for data in steps:
        total = sum(int((b["labels"][:, 1:] != -100).sum()) for b in data)
        loss_sum = 0.0
        for b in data:
            count = int((b["labels"][:, 1:] != -100).sum())
            part = model(**b).loss * count  # the model's own (mean) loss, as a sum
            (part / total).backward()
            loss_sum += part.item()
        opt.step()
        opt.zero_grad()
        losses.append(loss_sum / total)
    return losses


def packed_items(model):
    """The packed step: with the flash-attention keys where the model's own forward takes
    them (a family whose linear attention needs a kernel to keep documents apart raises)."""
    try:
        with torch.no_grad():
            model(**F.packed_batches(0)[0], use_cache=False)
    except Exception as e:  # noqa: BLE001 - its own forward refuses the keys: train without
        return F.packed_batches(0, flash=False), \
            f"exact (its own forward refuses the flash keys: {type(e).__name__})"
    return F.packed_batches(0), "exact (with the flash keys)"


def train_family(name, stages):
    """``{"verdict", "detail"}`` of one family on this rank (every rank builds the same)."""
    model, why = F.build(name, **CHANGES.get(name, {}))
    if model is None:
        return {"verdict": "not built", "detail": why}
    try:
        module = hf.pipeline_module(model, num_stages=stages)
    except ConfigError as e:
        return {"verdict": "refused", "detail": str(e).splitlines()[0]}
    packed, how = packed_items(model)
    if module.packing_refused is not None:  # the probe refuses packed rows: one step only
        packed, how = [], f"refused: {module.packing_refused}"[:120]
    # one step of the padded micro-batches and the packed ones together (shapes change
    # inside the step): one optimizer step checks both, at the cost of two more forwards
    data = items() + packed
    engine = pk.PipelineEngine(module, optimizer=sgd, micro_batches=len(data),
                               loss_reduction="tokens", timeout=90)
    try:
        loss = engine.train_batch(iter(data)).item()
        state = {k.partition(".")[2]: v.detach().clone()
                 for k, v in engine.module.state_dict().items()}
        keys = sorted(stage_state(engine))  # what save_pretrained writes for this stage
    finally:
        engine.close()
    ref_loss, = reference(model, [data])
    ref = model.state_dict()
    worst = max((v - ref[k]).abs().max().item() / max(1.0, ref[k].abs().max().item())
                for k, v in state.items())
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        written = sorted(k for f in Path(directory).glob("*.safetensors") for k in load_file(f))
    return {"verdict": "trains", "loss": abs(loss - ref_loss) / abs(ref_loss), "packed": how,
            "parameters": worst, "keys": keys, "hf_keys": written}


def _worker(names, stages):
    torch.set_num_threads(1)
    out = {}
    for name in names:
        try:
            out[name] = train_family(name, stages)
        except Exception as e:  # noqa: BLE001 - reported by name, fails the test
            out[name] = {"verdict": "error", "detail": f"{type(e).__name__}: {e}"[:300]}
    return out


def _merge(ranks):
    merged = {}
    for name, first in ranks[0].items():
        r = dict(first)
        if r["verdict"] == "trains":
            for other in ranks[1:]:
                o = other[name]
                if o["verdict"] != "trains":
                    r = o
                    break
                r["loss"] = max(r["loss"], o["loss"])
                r["parameters"] = max(r["parameters"], o["parameters"])
                r["keys"] = sorted(set(r["keys"]) | set(o["keys"]))
        merged[name] = r
    return merged


def _key_difference(r):
    if r["verdict"] != "trains":
        return {}
    return {"only ours": sorted(set(r["keys"]) - set(r["hf_keys"]))[:5],
            "only HF's": sorted(set(r["hf_keys"]) - set(r["keys"]))[:5]}


def _check(results):
    bad = {n: {k: v for k, v in r.items() if "keys" not in k} | _key_difference(r)
           for n, r in results.items() if r["verdict"] == "error"
           or (r["verdict"] == "trains" and (max(r["loss"], r["parameters"]) > TOLERANCE
                                             or r["keys"] != r["hf_keys"]))}
    assert not bad, json.dumps(bad, indent=1)[:6000]


def test_every_family_trains_like_its_forward_or_is_refused():
    names = [name for name, _ in F.families()]
    results = _merge(run_ranks(_worker, 2, names, 2, timeout=1500))
    classes = dict(F.families())
    table = {n: {"class": classes[n], "verdict": r["verdict"], "detail": r.get("detail", ""),
                 **({"packed": r["packed"]} if "packed" in r else {})}
             for n, r in results.items()}
    if os.environ.get("PK_WRITE_FAMILIES"):
        F.RESULTS.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    _check(results)
    recorded = json.loads(F.RESULTS.read_text())
    changed = {n: ((recorded.get(n, {}).get("verdict"), recorded.get(n, {}).get("packed")),
                   (table[n]["verdict"], table[n].get("packed"))) for n in table
               if (recorded.get(n, {}).get("verdict"), recorded.get(n, {}).get("packed"))
               != (table[n]["verdict"], table[n].get("packed"))}
    assert not changed and set(recorded) == set(table), (
        f"verdicts changed (recorded, now): {changed}; families gone: "
        f"{sorted(set(recorded) - set(table))}: rerun with PK_WRITE_FAMILIES=1 and "
        "python tests/hf_families.py")


def test_the_docs_table_is_the_last_run():
    assert F.doc_table() == F.render(json.loads(F.RESULTS.read_text())), \
        "docs/hf.md's table of families is stale: run python tests/hf_families.py"


#: the fixes this file pins, at 4 stages: tuple-returning blocks (Bloom, Falcon, MPT; list:
#: GPT), logits post-processed by the forward (Gemma 2 soft-capping, Cohere logit_scale),
#: final norms found without tail= (OPT: registered before the layers; OLMo: no parameters;
#: Nanochat: one stateless norm before and after the layers)
PINNED = ["bloom", "falcon", "mpt", "openai-gpt", "gemma2", "cohere", "opt", "olmo", "nanochat"]


def test_pinned_families_at_four_stages():
    results = _merge(run_ranks(_worker, 4, PINNED, 4, timeout=900))
    assert {n: r["verdict"] for n, r in results.items()} == dict.fromkeys(PINNED, "trains"), \
        results
    _check(results)
