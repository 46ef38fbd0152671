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
    # Doge's load_balancing_loss_func is another formula (product keys): not reproduced
    with pytest.raises(ConfigError, match="(?s)DogeForCausalLM has output_router_logits=True.*"
                                          "num_keys.*output_router_logits=False"):
        hf.pipeline_module(model("doge", output_router_logits=True))
    with pytest.raises(ConfigError, match="layerdrop=0.5.*skips decoder layers"):
        hf.pipeline_module(model("opt", layerdrop=0.5))


def test_layers_that_need_more_than_the_forward_passes_are_refused_at_build():
    with pytest.raises(ConfigError, match="layers, run as a pipeline, fail where its forward"):
        hf.pipeline_module(model("deepseek_v4"))
    with pytest.raises(ConfigError, match="passes what decoder layer 0 returned"):
        hf.pipeline_module(model("hy_v4"))


def test_router_aux_loss_is_found_from_the_models_own_code():
    """The router modules transformers records router_logits from, the forward's own
    arguments and coefficient; a forward that adds no router loss (DeepSeek-V3) needs none."""
    qwen = hf.pipeline_module(model("qwen2_moe", output_router_logits=True,
                                    router_aux_loss_coef=0.25, mlp_only_layers=[1]))
    aux = qwen.router_aux
    assert (aux.num_experts, aux.top_k, aux.coef, aux.masked) == (4, 2, 0.25, True)
    assert aux.routers == (("mlp.gate",), (), ("mlp.gate",), ("mlp.gate",))  # layer 1 dense
    jet = hf.pipeline_module(model("jetmoe", output_router_logits=True)).router_aux
    assert sorted(jet.routers[0]) == ["mlp.router", "self_attention.experts.router"]
    assert hf.pipeline_module(model("deepseek_v3", output_router_logits=True)).router_aux is None
    assert hf.pipeline_module(model("qwen2_moe")).router_aux is None  # off: nothing carried


def test_a_stage_carries_the_router_partial_sums_and_the_last_decoder_adds_the_loss():
    import pipekernel as pk

    m = model("mixtral", output_router_logits=True)
    module = hf.pipeline_module(m, num_stages=2)
    first = module.build_stage(0, [0, 3, 6])   # embeddings, decoders 0 and 1
    last = module.build_stage(1, [0, 3, 6])
    item = F.batch(4)
    inputs = {k: v for k, v in item.items() if k != "labels"}
    with pk.aux_losses() as aux:
        x = first(inputs)
        assert not aux  # nothing is added before the last decoder layer
        partial = x["router"]
        assert partial["probs"].shape == (4,) and partial["probs"].requires_grad
        assert partial["tokens"].dtype == torch.int32  # float32 bits: exact on any wire
        last(x)
    out = m(**item)
    assert len(aux) == 1
    torch.testing.assert_close(aux[0], m.router_aux_loss_coef * out.aux_loss, rtol=1e-5,
                               atol=1e-7)
