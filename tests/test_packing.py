"""Packed rows for pipekernel's own models (issue 44 item 2): ``pk.pack``, the boundaries
reaching every stage, the built-in GPT attending within documents, ``pipekernel train --pack``.

The oracle for "within documents" is not the packed model itself: each document run alone
(its own row, positions from 0) must give the logits it gets inside the packed row, and the
packed loss must be the token mean of the documents' own losses. The 2-stage run is then
checked against one process with gradient accumulation (``reference_train``).
"""
from __future__ import annotations

import pytest
import torch

import pipekernel as pk
from pipekernel.apps.config import TrainConfig
from pipekernel.apps.gpt import gpt_module, packed_token_loss
from pipekernel.apps.train import _positive, documents, make_packed_batch
from pipekernel.testing import reference_train, run_ranks

DOCS = [torch.tensor(d) for d in ([5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16, 17], [18])]


def test_pack_restarts_positions_and_labels_each_document():
    rows = pk.pack(DOCS, width=6, rows=3)
    assert rows["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16],
                                          [17, 18, 0, 0, 0, 0]]
    assert rows["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 4, 5],
                                             [0, 0, 0, 0, 0, 0]]
    # next-token labels inside each document; -100 at its end (the next token is another
    # document's), on the cut of a long document and on padding
    assert rows["labels"].tolist() == [[6, 7, 8, -100, 10, -100], [12, 13, 14, 15, 16, -100],
                                       [-100, -100, -100, -100, -100, -100]]
    assert pk.document_ids(rows["position_ids"]).tolist()[0] == [0, 0, 0, 0, 1, 1]
    assert pk.pack(DOCS, width=6, rows=1)["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10]]
    with pytest.raises(pk.DataError, match="not 1-D"):
        pk.pack([torch.ones(2, 2)], width=4, rows=1)


def test_document_mask_is_causal_within_documents():
    mask = pk.document_mask(pk.document_ids(torch.tensor([[0, 1, 2, 0, 1]])))[0, 0]
    want = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0],
                         [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(mask, want)


def test_each_document_sees_itself_alone_and_its_tokens_count_once():
    torch.manual_seed(0)
    module = gpt_module(16, 3, 2, 16, num_stages=1, seed=3, pack=True)
    model = module.build_stage(0, [0, len(module.layers)]).eval()
    rows = pk.pack(DOCS, width=16, rows=1)
    logits = model({"input_ids": rows["input_ids"], "position_ids": rows["position_ids"]})
    start, total, count = 0, 0.0, 0
    for doc in DOCS:
        alone = model(doc[None])  # its own row, positions from 0, the plain causal path
        torch.testing.assert_close(logits[0, start:start + len(doc)], alone[0],
                                   rtol=1e-5, atol=1e-6)
        loss, n = packed_token_loss(alone[:, :-1], doc[None, 1:])
        total, count, start = total + loss, count + int(n), start + len(doc)
    loss, n = packed_token_loss(logits, rows["labels"])
    assert int(n) == count == sum(len(d) - 1 for d in DOCS)
    torch.testing.assert_close(loss, total, rtol=1e-6, atol=1e-6)


def _cfg():
    return TrainConfig(stages=2, micro_batches=3, micro_batch_size=2, context=24, dim=16,
                       layers=3, heads=2, seed=5, pack=True)


def _batches(steps):
    text = b"".join(bytes([65 + i % 26]) * (3 + i % 9) + b"\n\n" for i in range(60))
    docs = documents(torch.tensor(list(text)))
    return [[make_packed_batch(docs, _cfg(), step, 0)] for step in range(steps)]


def _module(stages):
    c = _cfg()
    return gpt_module(c.dim, c.layers, c.heads, c.context, num_stages=stages, seed=c.seed,
                      pack=True)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.5)


def _train(steps):
    torch.set_num_threads(1)
    engine = pk.PipelineEngine(_module(2), optimizer=_sgd, micro_batches=3,
                               loss_reduction="tokens", timeout=60)
    try:
        losses = [engine.train_batch(iter(batch[0])).item() for batch in _batches(steps)]
        return losses, {k: v.clone() for k, v in engine.module.state_dict().items()}
    finally:
        engine.close()


def test_packed_gpt_through_two_stages_matches_one_process():
    ranks = run_ranks(_train, 2, 3, timeout=300)
    ref_losses, ref = reference_train(_module(1), _sgd, _batches(3), 3, loss_reduction="tokens")
    for losses, state in ranks:
        assert losses == pytest.approx(ref_losses, rel=1e-6)
        for key, value in state.items():
            torch.testing.assert_close(value, ref[key], rtol=1e-6, atol=1e-6)


def test_pack_is_for_the_built_in_gpt():
    import dataclasses
    with pytest.raises(pk.ConfigError, match="--pack packs documents for the built-in GPT"):
        _positive(dataclasses.replace(_cfg(), hf="llama"))


def test_train_takes_pack_and_runs_it(monkeypatch):
    from pipekernel.apps import cli
    seen = []
    monkeypatch.setattr("pipekernel.apps.train.run", seen.append)
    assert cli.main(["train", "--pack", "--steps", "2"]) == 0
    assert seen[0].pack and seen[0].steps == 2
