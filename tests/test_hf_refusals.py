"""What ``pipeline_module`` finds without being told, and what it refuses by name (one process)."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_families as F  # noqa: E402
import pipekernel.hf as hf  # noqa: E402
from pipekernel.errors import ConfigError  # noqa: E402


def model(name, **changes):
    built, why = F.build(name, **changes)
    assert built is not None, why
    return built


def test_final_norms_found_without_tail():
    # OPT registers its final norm (and project_out) before the layers: its forward says
    opt = hf.find_structure(model("opt"))
    assert opt.tail == ("model.decoder.final_layer_norm",)
    # OLMo's final norm has no parameters: the PP plan says it runs after the layers
    assert hf.find_structure(model("olmo")).tail == ("model.norm",)
    # Nanochat calls one stateless norm before and after its layers: both sides run it
    nano = hf.find_structure(model("nanochat"))
    assert "model.norm" in nano.prologue and nano.tail == ("model.norm",)


@pytest.mark.parametrize("name, changes", [("bloom", {}), ("falcon", {}), ("openai-gpt", {}),
                                           ("gemma2", {"final_logit_softcapping": 0.5}),
                                           ("cohere", {}), ("opt", {})])
def test_one_stage_equals_the_forward(name, changes):
    """Tuple/list blocks at 4 layers, the forward's own post-processing of the logits."""
    m = model(name, **changes)
    module = hf.pipeline_module(m, num_stages=1)
    stage = module.build_stage(0, [0, len(module.layers)])
    item = F.batch(3)
    inputs = {k: v for k, v in item.items() if k != "labels"}
    torch.testing.assert_close(stage(inputs), m(**inputs).logits, rtol=1e-6, atol=1e-6)


def test_router_aux_loss_and_layerdrop_are_refused_by_name():
    with pytest.raises(ConfigError, match="(?s)router auxiliary loss.*issue 30.*"
                                          "output_router_logits=False"):
        hf.pipeline_module(model("qwen2_moe", output_router_logits=True))
    with pytest.raises(ConfigError, match="layerdrop=0.5.*skips decoder layers"):
        hf.pipeline_module(model("opt", layerdrop=0.5))


def test_layers_that_need_more_than_the_forward_passes_are_refused_at_build():
    with pytest.raises(ConfigError, match="layers, run as a pipeline, fail where its forward"):
        hf.pipeline_module(model("deepseek_v4"))
    with pytest.raises(ConfigError, match="passes what decoder layer 0 returned"):
        hf.pipeline_module(model("hy_v4"))
