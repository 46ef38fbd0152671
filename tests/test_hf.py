"""``pipekernel.hf``: Hugging Face causal LMs through the pipeline, unmodified.

One ``run_ranks`` call on 4 processes trains GPT-2 (tied embeddings, learned positions) and
Llama (RoPE, GQA, untied) on padded dict micro-batches under several schedules and
layouts, saves one to the Hugging Face format and loads it back stage by stage; the main
process checks every result against the same Hugging Face model trained in one process.
"""
from __future__ import annotations

import functools
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import pipekernel as pk  # noqa: E402
import pipekernel.hf as hf  # noqa: E402
from pipekernel.errors import ConfigError, DataError  # noqa: E402
from pipekernel.testing import run_ranks  # noqa: E402

VOCAB, LENGTH, ROWS, MICRO_BATCHES, STEPS = 128, 8, 2, 4, 2


def gpt2():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=6, n_head=4,
                                     n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(1)
    return transformers.AutoModelForCausalLM.from_config(config)


def llama():
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=6, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=32,
                                      tie_word_embeddings=False)
    torch.manual_seed(2)
    return transformers.AutoModelForCausalLM.from_config(config)


MODELS = {"gpt2": gpt2, "llama": llama}
#: (model, stages, replicas, schedule, chunks, activation checkpointing)
RUNS = [("gpt2", 2, 2, "1f1b", None, 0), ("gpt2", 4, 1, "interleaved", 2, 0),
        ("gpt2", 2, 2, "zbv", None, 1), ("llama", 4, 1, "1f1b", None, 1),
        ("llama", 2, 2, "interleaved", 2, 0), ("llama", 4, 1, "zbv", None, 0)]


def sgd(params):
    return torch.optim.SGD(params, lr=0.5)


def batches(step, replica):
    """Padded micro-batches: rows of random lengths, labels -100 on the padding."""
    g = torch.Generator().manual_seed(100 * step + 7 * replica)
    out = []
    for _ in range(MICRO_BATCHES):
        ids = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=g)
        lengths = torch.randint(2, LENGTH + 1, (ROWS,), generator=g)
        mask = (torch.arange(LENGTH)[None, :] < lengths[:, None]).long()
        out.append({"input_ids": ids * mask, "attention_mask": mask,
                    "labels": ids.masked_fill(mask == 0, -100)})
    return out


def hf_state(engine):
    """The stage's weights by Hugging Face key."""
    return {k.partition(".")[2]: v.detach().clone() for k, v in engine.module.state_dict().items()}


def _train(name, stages, replicas, schedule, chunks, checkpointing, precision="fp32"):
    module = hf.pipeline_module(MODELS[name](), num_stages=stages,
                                activation_checkpoint_interval=checkpointing)
    engine = pk.PipelineEngine(module, optimizer=sgd, micro_batches=MICRO_BATCHES,
                               schedule=schedule, chunks=chunks, data_parallel_size=replicas,
                               loss_reduction="tokens", precision=precision, timeout=120)
    losses = [engine.train_batch(iter(batches(step, engine.data_parallel_rank))).item()
              for step in range(STEPS)]
    return engine, losses


def _worker(directory):
    torch.set_num_threads(1)
    results = {}
    for run in RUNS:
        engine, losses = _train(*run)
        results[run] = (losses, hf_state(engine))
        if run == RUNS[-1]:  # 4 stages of Llama back to the Hugging Face format
            hf.save_pretrained(engine, directory)
        if run == RUNS[-2]:  # a pipekernel checkpoint of 2 stages x 2 replicas, 2 chunks
            engine.save_checkpoint(directory + "-checkpoint")
        engine.close()
    # each stage loads only its own tensors from the saved directory
    module = hf.pipeline_module(directory, num_stages=4)
    engine = pk.PipelineEngine(module, optimizer=sgd, micro_batches=1, timeout=120,
                               loss_reduction="tokens")
    own = sum(t.numel() * t.element_size() for t in engine.module.state_dict().values())
    item = batches(0, 0)[0]
    loss, outputs = engine.eval_batch(iter([item]), return_outputs=True)
    results["load"] = (module.source.bytes_read, own, loss.item(), outputs, hf_state(engine))
    engine.load_checkpoint(directory + "-checkpoint")  # reshaped onto 4 stages x 1 chunk
    results["reshaped"] = hf_state(engine)
    engine.close()
    # bf16 and schedule="auto" (the planner profiles dict inputs) train too
    _, results["bf16"] = _train("llama", 2, 2, "1f1b", None, 0, precision="bf16")
    module = hf.pipeline_module(llama(), num_stages=4)
    sample = {k: v for k, v in batches(0, 0)[0].items() if k != "labels"}
    engine = pk.PipelineEngine(module, optimizer=sgd, micro_batches=MICRO_BATCHES,
                               schedule=pk.auto(sample=sample, micro_batches=[MICRO_BATCHES],
                                                measure_link=False, repeats=1, warmup=0),
                               loss_reduction="tokens", timeout=120)
    results["auto"] = [engine.train_batch(iter(batches(s, 0))).item() for s in range(STEPS)]
    engine.close()
    return results


@functools.lru_cache(maxsize=None)
def reference(name, replicas):
    """The same Hugging Face model trained in one process: per step, the loss summed over
    every micro-batch of every replica, divided by the labelled tokens."""
    model = MODELS[name]()
    opt = sgd(model.parameters())
    losses = []
    for step in range(STEPS):
        items = [b for r in range(replicas) for b in batches(step, r)]
        total = sum(int((b["labels"][:, 1:] != -100).sum()) for b in items)
        opt.zero_grad()
        loss_sum = 0.0
        for b in items:
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
            part, _ = hf.causal_lm_loss(logits, b["labels"])
            (part / total).backward()
            loss_sum += part.item()
        opt.step()
        losses.append(loss_sum / total)
    return losses, model


def check_state(state, model, where):
    ref = model.state_dict()
    for key, value in state.items():
        torch.testing.assert_close(value, ref[key], rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{where} {key}: {m}")


def test_hf_models_train_to_parity_save_and_load(tmp_path):
    directory = str(tmp_path / "saved")
    results = run_ranks(_worker, 4, directory, timeout=600)
    for run in RUNS:
        name, stages, replicas = run[:3]
        ref_losses, ref_model = reference(name, replicas)
        seen = set()
        for rank in results:
            losses, state = rank[run]
            assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6), run
            check_state(state, ref_model, run)
            seen |= set(state)
        assert seen == set(ref_model.state_dict()) - ({"lm_head.weight"} if name == "gpt2"
                                                      else set()), run
        if run == RUNS[-1]:
            saved = transformers.AutoModelForCausalLM.from_pretrained(directory)
            for rank in results:  # the round trip: from_pretrained equals the pipeline
                check_state(rank[run][1], saved, "saved")
    _, interleaved = reference("llama", 2)  # RUNS[-2]
    for rank in results:
        check_state(rank["reshaped"], interleaved, "reshaped checkpoint")
    files = [os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".safetensors")]
    total = sum(os.path.getsize(f) for f in files)
    item = batches(0, 0)[0]
    logits = saved(input_ids=item["input_ids"], attention_mask=item["attention_mask"]).logits
    ref_loss = [x.item() for x in hf.causal_lm_loss(logits, item["labels"])]
    for stage, rank in enumerate(results):
        read, own, loss, outputs, state = rank["load"]
        assert read == own and 0 < read < total / 2, (stage, read, own, total)
        check_state(state, saved, "loaded")
        assert loss == pytest.approx(ref_loss[0] / ref_loss[1], rel=1e-5)
        if stage == 3:
            torch.testing.assert_close(outputs[0], logits, rtol=1e-5, atol=1e-5)
    bf16_ref, _ = reference("llama", 2)
    auto_ref, _ = reference("llama", 1)
    for rank in results:
        assert rank["bf16"] == pytest.approx(bf16_ref, rel=5e-2)
        assert rank["auto"] == pytest.approx(auto_ref, rel=1e-4)


class NoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.config = transformers.GPT2Config()
        self.proj = torch.nn.Linear(4, 4)

    def get_input_embeddings(self):
        return self.proj


def test_unsupported_structure_says_what_is_missing():
    with pytest.raises(ConfigError, match="(?s)no nn.ModuleList of decoder layers.*layers="):
        hf.pipeline_module(NoLayers())
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=16)
    bert = transformers.AutoModelForMaskedLM.from_config(config)
    with pytest.raises(ConfigError, match="does not take inputs_embeds"):
        hf.pipeline_module(bert)
    with pytest.raises(ConfigError, match="'model.nope' is not a child"):
        hf.pipeline_module(llama(), tail=["model.nope"])
    with pytest.raises(ConfigError, match="not a directory"):
        hf.pipeline_module("/nonexistent/checkpoint")


def test_structure_and_batches_in_one_process():
    model = llama()
    s = hf.find_structure(model)
    assert (s.layers, s.embed, s.prologue, s.tail, s.lm_head, s.tied) == (
        "model.layers", "model.embed_tokens", ("model.rotary_emb",), ("model.norm",),
        "lm_head", False)
    g = hf.find_structure(gpt2())
    assert (g.prologue, g.tail, g.tied) == (("transformer.wpe", "transformer.drop"),
                                            ("transformer.ln_f",), True)
    module = hf.pipeline_module(model, num_stages=1)
    stage = module.build_stage(0, [0, len(module.layers)])
    item = batches(0, 0)[0]
    inputs, labels = hf.split_batch(item)
    torch.testing.assert_close(stage(inputs), model(**inputs).logits, rtol=0, atol=0)
    assert labels is item["labels"]
    with pytest.raises(DataError, match="needs 'input_ids'"):
        hf.split_batch({"ids": 1})
    with pytest.raises(DataError, match="no 'labels'"):
        hf.causal_lm_loss(torch.zeros(1, 2, 3), None)


def _run(*args, timeout=600):
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout, env={**env, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_example_trains_saves_and_loads_back(tmp_path):
    script = os.path.join(os.path.dirname(__file__), "..", "examples", "hf_llama.py")
    out = _run(script, "--steps", "12", "--out", str(tmp_path / "out"))
    last = out.strip().splitlines()[-1]
    first, final = (float(x) for x in last.split()[1:4:2])
    assert "over 12 steps on 2 stages" in last and final < 0.8 * first, out
    assert "loaded LlamaForCausalLM" in out


def test_cli_trains_a_small_random_llama(tmp_path):
    import json
    out = _run("-m", "pipekernel.apps.cli", "train", "--hf", "llama", "--steps", "12",
               "--out", str(tmp_path), "--dim", "32", "--layers", "2", "--heads", "2",
               "--context", "32", "--micro-batch-size", "8", "--micro-batches", "2",
               "--corpus-bytes", "100000", "--sample-bytes", "8", "--lr", "1e-2",
               "--no-progress")
    summary = json.loads((tmp_path / "train.json").read_text())
    assert "model: Hugging Face llama" in out and "Decoder0" in out
    assert summary["loss_last5"] < summary["loss_first5"] - 0.5, summary["losses"]
    model = transformers.AutoModelForCausalLM.from_pretrained(summary["paths"]["hf"])
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 2
