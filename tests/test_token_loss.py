"""``loss_reduction="tokens"``: the gradient of the loss averaged over every token of the
batch (padded, variable-length data), equal to one process doing the same.

The multi-rank cases run as one world per size (tests/sweep.py): 2 and 4 ranks."""
from __future__ import annotations

import pytest
import torch
from models import Block, sgd
from sweep import Sweep
from torch import nn

import pipekernel as pk
from pipekernel.errors import ConfigError, DataError
from pipekernel.stage.loss import TokenLoss, check_loss_reduction
from pipekernel.testing import assert_parity, reference_train

VOCAB, DIM, LENGTH, STEPS, MICRO_BATCHES = 11, 8, 8, 3, 3
PAD = -100


def token_sum(logits, labels):
    flat = labels.reshape(-1)
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), flat, ignore_index=PAD,
                                       reduction="sum")
    return loss, (flat != PAD).sum()


def padded_lm(num_stages=None):
    layers = [pk.LayerSpec(nn.Embedding, VOCAB, DIM), *[pk.LayerSpec(Block, DIM) for _ in range(4)],
              pk.LayerSpec(nn.Linear, DIM, VOCAB)]
    return pk.PipelineModule(layers, loss_fn=token_sum, num_stages=num_stages,
                             partition="uniform", seed=5)


def padded_data(step, replica, micro_batches, batch=3):
    """Sequences of random lengths, padded to LENGTH; replica 1 gets shorter ones, so the
    replicas and micro-batches hold different numbers of tokens."""
    g = torch.Generator().manual_seed(1_000 * step + 17 * replica)
    items = []
    for _ in range(micro_batches):
        ids = torch.randint(0, VOCAB, (batch, LENGTH + 1), generator=g)
        lengths = torch.randint(1, LENGTH + 1 - 3 * replica, (batch,), generator=g)
        labels = ids[:, 1:].clone()
        labels[torch.arange(LENGTH)[None, :] >= lengths[:, None]] = PAD
        items.append((ids[:, :-1], labels))
    return items


def _worker(stages, dp, schedule, max_grad_norm):
    engine = pk.PipelineEngine(padded_lm(stages), optimizer=sgd, micro_batches=MICRO_BATCHES,
                               schedule=schedule, data_parallel_size=dp, timeout=60,
                               loss_reduction="tokens", max_grad_norm=max_grad_norm)
    losses, norms = [], []
    for step in range(STEPS):
        data = padded_data(step, engine.data_parallel_rank, MICRO_BATCHES)
        losses.append(engine.train_batch(iter(data)).item())
        norms.append(engine.last_grad_norm)
    state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    engine.close()  # the world runs other cases after this one (tests/sweep.py)
    return losses, state, norms


SWEEP = Sweep(timeout=600)
TOKEN_MEAN = {key: SWEEP.case("tokens-{}-{}-{}-{}".format(*key), key[0] * key[1], _worker, *key)
              for key in [(2, 1, "1f1b", None), (2, 2, "1f1b", 0.05), (2, 1, "zb-h1", None)]}


@pytest.mark.parametrize("stages,dp,schedule,max_grad_norm", list(TOKEN_MEAN))
def test_token_mean_matches_one_process(stages, dp, schedule, max_grad_norm):
    results = SWEEP.results(TOKEN_MEAN[stages, dp, schedule, max_grad_norm])
    batches = [[padded_data(step, r, MICRO_BATCHES) for r in range(dp)] for step in range(STEPS)]
    ref_norms = []

    def clip(model):
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                              max_grad_norm)))

    ref_losses, ref_state = reference_train(
        padded_lm(), sgd, batches, MICRO_BATCHES, loss_reduction="tokens",
        hook=clip if max_grad_norm is not None else None)
    for losses, state, norms in results:
        assert_parity(losses, ref_losses, state, ref_state)
        if max_grad_norm is not None:
            assert norms == pytest.approx(ref_norms, rel=1e-5)
            assert min(norms) > max_grad_norm  # the clipping did act
    # the test can tell the reductions apart: a mean of micro-batch means differs
    counts = [int(token_sum(torch.zeros(3, LENGTH, VOCAB), y)[1])
              for replicas in batches for items in replicas for _, y in items]
    assert len(set(counts)) > 1


def test_token_loss_wrapper_returns_the_sum_and_the_count_kept_with_the_loss():
    from pipekernel.step.optimizer_step import BatchLosses
    wrapped = TokenLoss(token_sum)
    logits = torch.randn(2, LENGTH, VOCAB)
    _, labels = padded_data(0, 0, 1, batch=2)[0]
    total, count = token_sum(logits, labels)
    got, tokens = wrapped(logits, labels)
    assert torch.equal(got, total) and tokens.dtype == torch.float64
    ledger = BatchLosses()  # one batch's losses and token counts
    assert float(ledger.local_tokens("cpu")) == 0 and ledger.values == []
    ledger.add(got, 0, tokens)
    ledger.add(*wrapped(logits, labels)[:1], 1, wrapped(logits, labels)[1])
    assert float(ledger.local_tokens("cpu")) == 2 * int(count)


@pytest.mark.parametrize("returned", [torch.tensor(1.0), (torch.ones(2), 3),
                                      (torch.tensor(1.0), torch.ones(2))])
def test_a_loss_fn_not_returning_sum_and_count_is_a_data_error(returned):
    with pytest.raises(DataError, match="loss_sum|token_count"):
        TokenLoss(lambda out, labels: returned)(None, None)


def test_unknown_loss_reduction_is_a_config_error():
    with pytest.raises(ConfigError, match="loss_reduction must be one of 'mean', 'tokens'"):
        check_loss_reduction("sum")


def _paired_tokens_worker():
    """The paired executor's criterion0 computes the last stage's loss itself: its token
    counts must still reach the batch step (the one owner of losses and counts)."""
    from pipekernel.apps.gpt import VOCAB as GPT_VOCAB, gpt_module
    from pipekernel.stage.paired import sequential

    torch.set_num_threads(1)

    def gpt_token_sum(logits, labels):
        flat = labels.reshape(-1)
        return (nn.functional.cross_entropy(logits.reshape(-1, GPT_VOCAB).float(), flat,
                                            ignore_index=PAD, reduction="sum"),
                (flat != PAD).sum())

    out = {}
    for name, fn in (("default", None), ("sequential", sequential)):
        module = gpt_module(16, 4, 2, 8, num_stages=2, partition="uniform", seed=3)
        module.loss_fn = gpt_token_sum
        if fn is not None:
            module.overlapped_forward_backward = fn
        engine = pk.PipelineEngine(module, optimizer=sgd, micro_batches=4, schedule="dualpipev",
                                   loss_reduction="tokens", timeout=120)
        losses = []
        for step in range(2):
            g = torch.Generator().manual_seed(7 + step)
            ids = torch.randint(0, GPT_VOCAB, (4, 2, 9), generator=g)
            labels = ids[:, :, 1:].clone()
            labels[:, :, -(step + 2):] = PAD  # padding: the counts differ per step
            losses.append(engine.train_batch(iter(
                [(ids[m, :, :-1], labels[m]) for m in range(4)])).item())
        out[name] = (losses, {k: v.detach().clone() for k, v in engine.module.state_dict().items()})
        engine.close()
    return out


PAIRED = SWEEP.case("paired-tokens", 2, _paired_tokens_worker)


@pytest.mark.multirank
def test_paired_executor_keeps_the_token_counts():
    for result in SWEEP.results(PAIRED):
        (default, state), (paired, paired_state) = result["default"], result["sequential"]
        assert default == paired
        assert all(torch.equal(state[k], paired_state[k]) for k in state)
