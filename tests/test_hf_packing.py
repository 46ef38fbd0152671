"""Packed rows through ``pipekernel.hf``: Hugging Face's own collator output, exact, or refused.

The family test (``tests/test_hf_families.py``) trains every family one packed step beside
its padded one; here: the user's path of issue 44 (a ``save_pretrained`` directory, 3 SGD
steps of ``DataCollatorWithFlattening``'s rows, and rows packed and right-padded with an
``attention_mask`` as TRL's packing collator pads them) at 2 stages against one process
training as HF's ``Trainer`` does (``use_cache=False``: with a cache transformers builds no
per-document mask, and its one process attends across documents — the 1e-2 of the issue);
the data checks; the build-time probe refusing what it cannot reproduce, on every rank.
"""
from __future__ import annotations

import tempfile

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_families as F  # noqa: E402
import pipekernel as pk  # noqa: E402
import pipekernel.hf as hf  # noqa: E402
from pipekernel.errors import DataError  # noqa: E402
from pipekernel.testing import run_ranks  # noqa: E402

STEPS, TOLERANCE = 3, 1e-5


def sgd(params):
    return torch.optim.SGD(params, lr=0.5)


def collated(seed, flash=True):
    """Two micro-batches of ``DataCollatorWithFlattening``'s own output, one row each."""
    g = torch.Generator().manual_seed(seed)
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash)
    return [collator([{"input_ids": torch.randint(3, F.VOCAB, (int(n),), generator=g).tolist()}
                      for n in torch.randint(2, 7, (3,), generator=g)]) for _ in range(2)]


def trl_padded(seed):
    """Two micro-batches of two rows of packed documents, right-padded with an
    ``attention_mask`` (TRL's packing collator without padding-free)."""
    rows = [F.packed_batches(seed + 100 * k)[1] for k in range(2)]
    return [{**b, "attention_mask": (b["input_ids"] != 0).long()} for b in rows]


def one_process(directory, steps):
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    model.config.use_cache = False  # as HF's Trainer sets it (TrainingArguments.use_cache)
    model.train()
    opt, losses = sgd(model.parameters()), []
    for data in steps:
        total = sum(int((b["labels"][:, 1:] != -100).sum()) for b in data)
        loss_sum = 0.0
        for b in data:
            part = model(**b).loss * int((b["labels"][:, 1:] != -100).sum())
            (part / total).backward()
            loss_sum += part.item()
        opt.step()
        opt.zero_grad()
        losses.append(loss_sum / total)
    return losses, model.state_dict()


class PositionLogits(transformers.LlamaForCausalLM):
    """A forward that uses ``position_ids`` after its base model, where the pipeline's head
    does not see them: the plain probe passes (no position_ids), the packed one does not."""

    def forward(self, input_ids=None, position_ids=None, **kwargs):
        out = super().forward(input_ids=input_ids, position_ids=position_ids, **kwargs)
        if position_ids is not None:
            out.logits = out.logits + 0.1 * position_ids[..., None]
        return out


def _world(directory):
    torch.set_num_threads(1)
    out = {}
    for name, steps in (("collator", [collated(s) for s in range(STEPS)]),
                        ("trl padded", [trl_padded(s) for s in range(STEPS)])):
        engine = pk.PipelineEngine(hf.pipeline_module(directory, num_stages=2), optimizer=sgd,
                                   micro_batches=2, loss_reduction="tokens", timeout=90)
        try:
            losses = [engine.train_batch(iter(data)).item() for data in steps]
            state = {k.partition(".")[2]: v.clone() for k, v in engine.module.state_dict().items()}
        finally:
            engine.close()
        out[name] = (losses, state)
    odd = PositionLogits.from_pretrained(directory)
    engine = pk.PipelineEngine(hf.pipeline_module(odd, num_stages=2), optimizer=sgd,
                               micro_batches=2, loss_reduction="tokens", timeout=90)
    try:
        engine.train_batch(iter(collated(0)))
        out["refused"] = None
    except (DataError, pk.PipelineError) as e:  # its own DataError, or the first rank's
        out["refused"] = f"{type(e).__name__}: {e}"
    finally:
        engine.close()
    return out


def test_collator_rows_train_exactly_through_two_stages_and_refusals_reach_every_rank():
    model, _ = F.build("llama")
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        ranks = run_ranks(_world, 2, directory, timeout=600)
        for name, make in (("collator", collated), ("trl padded", trl_padded)):
            ref_losses, ref = one_process(directory, [make(s) for s in range(STEPS)])
            for losses, state in (r[name] for r in ranks):
                assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= TOLERANCE, \
                    (name, losses, ref_losses)
                worst = max((v - ref[k]).abs().max().item() for k, v in state.items())
                assert worst <= TOLERANCE, (name, worst)
    for r in ranks:  # every rank ends with the refusal (its own, or the peer's), no hang
        assert r["refused"] is not None and "PositionLogits: on a packed row" in r["refused"]
    assert any(r["refused"].startswith("DataError") for r in ranks)


def test_a_document_start_with_a_label_is_refused_with_the_fix():
    batch = collated(0)[0]
    batch["labels"] = batch["input_ids"].clone()  # packed by hand, labels not masked
    with pytest.raises(DataError, match=r"position_ids restart at token \d+ of row 0") as e:
        hf.split_batch(batch)
    assert "-100 at the first token of every document" in e.value.hint


def test_flash_keys_that_disagree_with_the_positions_are_refused():
    batch = collated(0)[0]
    batch["cu_seq_lens_q"] = batch["cu_seq_lens_q"].flip(0).cumsum(0).to(torch.int32)
    with pytest.raises(DataError, match="cu_seq_lens_q is .* but position_ids say"):
        hf.split_batch(batch)
    batch = collated(0)[0]
    batch["max_length_k"] += 1
    with pytest.raises(DataError, match="max_length_k is"):
        hf.split_batch(batch)


def test_hugging_faces_and_trls_packed_rows_pass_the_checks():
    for batch in [*collated(1), *F.packed_batches(1), *trl_padded(1)]:
        inputs, labels = hf.split_batch(batch)
        assert labels is batch["labels"] and "labels" not in inputs
        assert set(inputs) == set(batch) - {"labels"}  # the flash keys travel on


def test_the_probe_learns_packed_rows_and_refuses_by_name():
    model, _ = F.build("llama")
    assert hf.pipeline_module(model, num_stages=2).packing_refused is None
    odd = PositionLogits(model.config)
    odd.load_state_dict(model.state_dict())
    module = hf.pipeline_module(odd, num_stages=2)
    assert module.packing_refused.startswith("PositionLogits: on a packed row, the pipeline's "
                                             "logits differ")
    with pytest.raises(DataError, match="packed rows .* are not trained for this model"):
        module.batch_fn(collated(0)[0])
    inputs, _ = module.batch_fn(F.batch(0))  # unpacked rows still train
    assert set(inputs) == {"input_ids", "attention_mask"}
