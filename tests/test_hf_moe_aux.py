"""Hugging Face MoE models with ``output_router_logits=True`` train through the pipeline to
their own loss: ``model(**batch).loss`` (the token mean plus ``router_aux_loss_coef`` times
the load-balancing loss of every layer's router logits) accumulated over micro-batches.

One 2-process world (pp=2) trains each family one step, its MoE layers on both stages, so
the router's partial sums cross the stage boundary, against the unmodified model trained in
one process with gradient accumulation: losses and every parameter within 1e-5, and the aux
part reported apart (``metrics["aux_loss"]``) equal to the model's own ``aux_loss`` times the
coefficient. DeepSeek-V3's forward adds no router loss: its loss is the causal-LM loss alone,
as in transformers. DualPipeV, ZBV with activation checkpointing (the aux loss added on a
chunk before the last), and the refusal of ``loss_reduction="tokens"`` run in the same
world.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_families as F  # noqa: E402
import pipekernel as pk  # noqa: E402
import pipekernel.hf as hf  # noqa: E402
from pipekernel.testing import assert_parity, run_ranks  # noqa: E402

pytestmark = pytest.mark.multirank

MICRO_BATCHES = 4  # dualpipev needs 2 x stages
#: large enough that a missing or wrong aux loss shows far above the tolerance
COEF = 0.5
#: (family, schedule, chunks, activation_checkpoint_interval)
CASES = [("mixtral", "1f1b", None, 0), ("qwen2_moe", "1f1b", None, 0),
         ("qwen3_moe", "1f1b", None, 0), ("deepseek_v3", "1f1b", None, 0),
         ("gpt_oss", "1f1b", None, 0), ("qwen3_moe", "zbv", 2, 1),
         ("mixtral", "dualpipev", 2, 0)]
#: families whose forward adds no router loss (the loss is the token mean alone)
NO_AUX = {"deepseek_v3"}
#: layers [embeddings, decoder 0 (+ prologue), 1, 2, 3 (+ final norm), head]: two
#: decoder layers on each stage
PARTITION = [0, 3, 6]
#: zbv's four parts (rank 0: parts 0 and 3, rank 1: parts 1 and 2): the aux loss is added
#: in part 2, before the head's part, so it rides on that part's output (AttachAux)
PARTS = [0, 2, 3, 5, 6]


def sgd(params):
    return torch.optim.SGD(params, lr=0.5)


def items():
    return [F.batch(i) for i in range(MICRO_BATCHES)]


def build(name):
    model, why = F.build(name, output_router_logits=True, router_aux_loss_coef=COEF)
    assert model is not None, why
    return model


def reference(model):
    """One SGD step of the unmodified model, gradient accumulation of its own loss:
    ``(mean loss, mean aux part)``."""
    opt = sgd(model.parameters())
    model.train()
    losses, auxes = [], []
    for b in items():
        out = model(**b)
        (out.loss / MICRO_BATCHES).backward()
        losses.append(out.loss.item())
        aux = getattr(out, "aux_loss", None)
        auxes.append(0.0 if aux is None else model.router_aux_loss_coef * aux.item())
    opt.step()
    return sum(losses) / MICRO_BATCHES, sum(auxes) / MICRO_BATCHES


class Metrics:
    def __init__(self):
        self.seen = []

    @pk.hookimpl
    def pipekernel_after_train_batch(self, engine, loss, metrics):
        self.seen.append(metrics.get("aux_loss"))


def train(name, schedule, chunks, checkpoint):
    model = build(name)
    partition = PARTITION if chunks is None else PARTS
    # the model's own loss per micro-batch: pipeline_module's default with a router loss
    options = {"loss_fn": hf.causal_lm_mean_loss} if name in NO_AUX else {}
    module = hf.pipeline_module(model, num_stages=2, partition=partition,
                                activation_checkpoint_interval=checkpoint, **options)
    assert (module.router_aux is None) == (name in NO_AUX), name
    metrics = Metrics()
    engine = pk.PipelineEngine(module, optimizer=sgd, micro_batches=MICRO_BATCHES,
                               schedule=schedule, chunks=chunks, plugins=[metrics], timeout=60)
    try:
        loss = engine.train_batch(iter(items())).item()
        state = {k.partition(".")[2]: v.detach().clone()
                 for k, v in engine.module.state_dict().items()}
    finally:
        engine.close()
    ref_loss, ref_aux = reference(model)
    assert_parity([loss], [ref_loss], state, model.state_dict())
    aux = metrics.seen[0]
    if module.router_aux is None:  # DeepSeek-V3: no router loss in its forward either
        assert aux is None and ref_aux == 0.0, (name, aux, ref_aux)
    else:
        assert ref_aux > 1e-3 and abs(float(aux) - ref_aux) <= 1e-5 * ref_aux, (name, aux,
                                                                                 ref_aux)
    layers = {int(k.partition(".")[0]) for k in engine.module.state_dict()}
    return {"loss": loss, "aux": None if aux is None else float(aux), "layers": sorted(layers)}


def tokens_refused():
    """``loss_reduction="tokens"`` rescales every gradient after the backward: refused."""
    module = hf.pipeline_module(build("mixtral"), num_stages=2, partition=PARTITION,
                                loss_fn=hf.causal_lm_loss)
    engine = pk.PipelineEngine(module, optimizer=sgd, micro_batches=MICRO_BATCHES,
                               loss_reduction="tokens", timeout=60)
    try:
        engine.train_batch(iter(items()))
    except pk.PipelineError as err:
        return f"{type(err).__name__}: {err}"
    finally:
        engine.close()
    return None


def _worker(cases):
    torch.set_num_threads(1)
    return [train(*case) for case in cases], tokens_refused()


def test_hf_moe_models_train_to_their_own_loss_with_the_router_aux_loss():
    results = run_ranks(_worker, 2, CASES, timeout=240)
    for _, refused in results:  # the stage that adds it names it; its peer hears of it
        assert "loss_reduction='tokens'" in (refused or ""), refused
    for index, case in enumerate(CASES):
        first, second = (runs[index] for runs, _ in results)
        assert first["loss"] == second["loss"] and first["aux"] == second["aux"], case
        if case[2] is None:  # decoder layers 0-1 on stage 0, 2-3 on stage 1
            assert first["layers"] == [0, 1, 2] and second["layers"] == [3, 4, 5], case
