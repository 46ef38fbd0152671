"""Any directory Hugging Face loads, ``pipeline_module`` loads stage by stage, through
transformers' own key conversion; ``save_pretrained``'s key set is the one HF writes.

One process: each stage of a ``pipeline_module(directory)`` is built on its own (as its rank
would build it) and compared with ``AutoModelForCausalLM.from_pretrained(directory)``.
"""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")

import hf_families as F  # noqa: E402
import pipekernel.hf as hf  # noqa: E402
from pipekernel.hf.save import _as_hf_writes  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402


def stages_state(module, stages=2):
    """Every stage built alone: ``({HF key: tensor}, [bytes read after each stage])``."""
    state, reads = {}, []
    bounds = module.partition(stages)
    for stage in range(stages):
        built = module.build_stage(stage, bounds)
        state.update({k.partition(".")[2]: v for k, v in built.state_dict().items()})
        reads.append(module.source.bytes_read)
    return state, reads


def saved_keys(directory):
    keys = set()
    for name in directory.glob("*.safetensors"):
        keys |= set(load_file(str(name)))
    return keys


def check_loads(directory, stages=2):
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(directory))
    module = hf.pipeline_module(str(directory), num_stages=stages)
    state, reads = stages_state(module, stages)
    expected = ref.state_dict()
    assert set(state) <= set(expected)
    for key, value in state.items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=0, msg=key)
    return module, state, reads


def test_moe_hub_layout_loads_per_stage_and_saves_back(tmp_path):
    model, why = F.build("qwen2_moe")
    assert model is not None, why
    model.save_pretrained(tmp_path)
    written = saved_keys(tmp_path)
    assert any(".experts.0.gate_proj.weight" in k for k in written), sorted(written)[:20]
    module, state, reads = check_loads(tmp_path)
    assert 0 < reads[0] < reads[1]  # each stage read its own tensors
    # what pipekernel's save_pretrained writes for these weights: HF's per-expert key set
    assert set(_as_hf_writes(module.source.model, dict(state))) == written


def test_gpt2_checkpoint_without_the_transformer_prefix(tmp_path):
    model, _ = F.build("gpt2")
    state = {k.removeprefix("transformer."): v.contiguous() for k, v in model.state_dict().items()
             if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(tmp_path)
    module, loaded, _ = check_loads(tmp_path)
    assert "transformer.wte.weight" in loaded


def test_tied_weight_saved_under_the_head_name(tmp_path):
    model, _ = F.build("gpt2")
    assert model.config.tie_word_embeddings
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "transformer.wte.weight"}
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(tmp_path)
    check_loads(tmp_path)


@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen2_moe", "mixtral"])
def test_saved_key_set_is_hfs(name, tmp_path):
    model, why = F.build(name)
    assert model is not None, why
    model.save_pretrained(tmp_path)
    module = hf.pipeline_module(model, num_stages=2)
    state, _ = stages_state(module)
    tied = {"lm_head.weight"} if module.structure.tied else set()
    ours = _as_hf_writes(model, {k: v for k, v in state.items() if k not in tied})
    assert set(ours) == saved_keys(tmp_path)
    index = json.loads((tmp_path / "config.json").read_text())
    assert index["model_type"] == model.config.model_type
