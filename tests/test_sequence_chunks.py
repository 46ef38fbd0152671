"""Sequence-level pipelining (Seq1F1B, issue 44 item 3): ``seq_chunks=k`` cuts each
micro-batch along the sequence into ``k`` units of 1F1B, each chunk's attention reading the
keys and values of the chunks before it.

The oracle is the unsplit micro-batch: one process training the whole sequences with
gradient accumulation (``reference_train``) must give the pipeline's losses and weights
(fp32, 1e-6). The schedule is proven by the simulator under NCCL's rules and its bubble
checked against 1F1B's own formula over ``m * k`` units of ``1/k`` the work; the memory by
the exact byte ledger of :mod:`pipekernel.stage.memory`.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import pipekernel as pk
from pipekernel.apps.gpt import gpt_module
from pipekernel.engine.assembly import sequence_schedule
from pipekernel.extend.manager import make_plugin_manager, resolve_schedule
from pipekernel.plugin import hookimpl
from pipekernel.plugins.memory import MemoryMeter
from pipekernel.schedules import OneFOneB, simulate
from pipekernel.schedules.instructions import Backward, Forward
from pipekernel.schedules.sequence import Seq1F1B
from pipekernel.stage.sequence import KVPrefix, SequenceChunk, split_sequences
from pipekernel.testing import reference_train, run_ranks


# -- the schedule ------------------------------------------------------------------------------

@pytest.mark.parametrize("p,m,k", [(1, 2, 2), (2, 1, 2), (2, 3, 3), (4, 1, 4), (4, 5, 2),
                                   (3, 2, 4)])
def test_forwards_in_chunk_order_backwards_reversed(p, m, k):
    cls = Seq1F1B.with_chunks(k)
    for s in range(p):
        order = cls(p, s, m).order()
        forwards = [u for kind, _, u in order if kind == "F"]
        backwards = [u for kind, _, u in order if kind == "B"]
        assert forwards == list(range(m * k))
        assert backwards == [i * k + j for i in range(m) for j in reversed(range(k))]
        first_backward = next(n for n, op in enumerate(order) if op[0] == "B")
        assert first_backward == min(p - s + k - 1, m * k)  # all forwards before it


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 5])
@pytest.mark.parametrize("k", [2, 3, 4])
def test_simulator_proves_it_and_the_bubble_is_1f1b_over_units(p, m, k):
    """Deadlock-free under NCCL's per-communicator order, each stage holding at most
    ``p - s + k - 1`` units; with ``F = 1/k``, ``B = 2/k`` (a micro-batch's work) the
    makespan is 1F1B's ``(units + p - 1) * (F + B)`` with ``m * k`` units."""
    seq = simulate(Seq1F1B.with_chunks(k), p, m, costs={Forward: 1 / k, Backward: 2 / k})
    plain = simulate(OneFOneB, p, m, costs={Forward: 1, Backward: 2})
    assert seq.buffers == tuple(min(p - s + k - 1, m * k) for s in range(p))
    assert seq.makespan == pytest.approx((m * k + p - 1) * 3 / k)
    assert seq.bubble_fraction == pytest.approx((p - 1) / (m * k + p - 1))
    assert plain.makespan == pytest.approx((m + p - 1) * 3)
    if p > 1:
        assert seq.makespan < plain.makespan


def test_bubble_at_one_micro_batch_on_four_stages():
    """The long-context case (m < p): 1F1B idles 75% of a 4-stage pipeline on one
    micro-batch; in 4 chunks 43%, in 8 chunks 27%."""
    plain = simulate(OneFOneB, 4, 1, costs={Forward: 1, Backward: 2})
    assert (plain.makespan, plain.bubble_fraction) == (12, 0.75)
    for k, makespan, bubble in [(4, 5.25, 3 / 7), (8, 4.125, 3 / 11)]:
        seq = simulate(Seq1F1B.with_chunks(k), 4, 1, costs={Forward: 1 / k, Backward: 2 / k})
        assert seq.makespan == pytest.approx(makespan)
        assert seq.bubble_fraction == pytest.approx(bubble)


# -- the KV prefix and the data, alone ----------------------------------------------------------

def test_split_sequences_cuts_dim_one_and_refuses_a_remainder():
    ids, labels = torch.arange(12).view(2, 6), torch.arange(12).view(2, 6) + 1
    pieces = list(split_sequences(iter([({"input_ids": ids, "scale": torch.ones(2)}, labels)]),
                                  3))
    assert len(pieces) == 3
    assert pieces[1][0]["input_ids"].tolist() == [[2, 3], [8, 9]]
    assert pieces[2][1].tolist() == [[5, 6], [11, 12]]
    assert pieces[0][0]["scale"].shape == (2,)  # 1-D: goes with every chunk
    with pytest.raises(pk.DataError, match="sequence length 6 is not a multiple of "
                                           "seq_chunks=4") as info:
        list(split_sequences(iter([(ids, labels)]), 4))
    assert "e.g. 4 or 8" in info.value.hint
    with pytest.raises(pk.DataError, match=r"sequence lengths \(dim 1\) \[5, 6\]"):
        list(split_sequences(iter([(ids, labels[:, :5])]), 2))


def test_a_mean_loss_refuses_chunks_that_count_different_labels():
    """Under loss_reduction='mean' the micro-batch's loss would be the mean of its chunks'
    means: chunks counting different numbers of -100 labels are refused, equal ones pass."""
    ids = torch.arange(12).view(2, 6)
    uneven = torch.arange(12).view(2, 6)
    uneven[0, :2] = -100  # the first chunk counts 2 labels, the others 4
    with pytest.raises(pk.DataError, match=r"count \[2, 4, 4\] labels that are not -100") \
            as info:
        list(split_sequences(iter([(ids, uneven)]), 3, mean_loss=True))
    assert "loss_reduction='tokens'" in info.value.hint
    assert len(list(split_sequences(iter([(ids, uneven)]), 3))) == 3  # tokens: exact
    even = torch.arange(12).view(2, 6)
    even[0, ::2] = -100  # one ignored label in every chunk
    assert len(list(split_sequences(iter([(ids, even)]), 3, mean_loss=True))) == 3


def _train_masked_mean():
    torch.set_num_threads(1)
    engine = pk.PipelineEngine(_module(2), optimizer=_sgd, micro_batches=2, seq_chunks=2,
                               timeout=60)
    try:
        engine.train_batch(iter(_batches(1, 2, mask=True)[0][0]))
    except pk.PipelineError as err:
        return type(err).__name__, str(err)
    finally:
        engine.close()
    return None


def test_masked_labels_under_a_mean_loss_stop_every_rank_by_name():
    """The silent case (a mean of chunk means) ends the step on both ranks, named."""
    results = run_ranks(_train_masked_mean, 2, timeout=300)
    assert all(result is not None for result in results), results
    assert any(name == "DataError" and "mean of its chunks' means" in text
               for name, text in results), results


def test_kv_prefix_gradients_reach_the_earlier_chunks_exactly():
    """Attention over two chunks, chunk 1 backwarded first, then chunk 0 from its output
    and its keys/values: the gradients of the unsplit attention."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4, requires_grad=True) for _ in range(3))
    whole = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad = torch.randn_like(whole)
    want = torch.autograd.grad(whole, (q, k, v), grad)
    prefix, outs = KVPrefix(), []
    for j in range(2):
        chunk = SequenceChunk(j, 2, prefix)
        part = slice(3 * j, 3 * j + 3)
        kj, vj = chunk.extend("attn", k[:, :, part] * 1, v[:, :, part] * 1)
        mask = pk.prefix_causal_mask(3, kj.shape[-2])
        outs.append(nn.functional.scaled_dot_product_attention(q[:, :, part], kj, vj,
                                                               attn_mask=mask))
    for j in (1, 0):
        roots, grads = prefix.roots(j)
        assert len(roots) == (2 if j == 0 else 0)  # chunk 1's keys have no later reader
        torch.autograd.backward([outs[j], *roots], [grad[:, :, 3 * j:3 * j + 3], *grads])
        prefix.release(j)
    for got, expected in zip((q.grad, k.grad, v.grad), want):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(pk.PipelineError, match="extended its key/value prefix 0 time"):
        SequenceChunk(1, 2, KVPrefix()).extend("attn", k, v)


# -- through real ranks ------------------------------------------------------------------------

def _module(stages, dim=16, layers=4, context=32, tokens=False, partition="uniform"):
    """The built-in GPT; ``tokens``: its loss a (sum, count) for ``loss_reduction="tokens"``."""
    return gpt_module(dim, layers, 2, context, num_stages=stages, seed=3, partition=partition,
                      pack=tokens)


def _batches(steps, m, length=24, mask=False, replicas=1):
    """``[step][replica]``: ``m`` micro-batches of 2 rows; ``mask``: labels -100 in places,
    a different number of counted tokens in every chunk."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, 256, (replicas, m, 2, length + 1), generator=g)
        labels = ids[..., 1:].clone()
        if mask:
            labels[:, :, 0, : length // 2 + 1] = -100
            labels[:, :, 1, -3:] = -100
        out.append([[(ids[r, i, :, :-1], labels[r, i]) for i in range(m)]
                    for r in range(replicas)])
    return out


def _sgd(params):
    return torch.optim.SGD(params, lr=0.5)


def _train(stages, m, k, steps=2, reduction="mean", replicas=1, partition="uniform"):
    torch.set_num_threads(1)
    tokens = reduction == "tokens"
    engine = pk.PipelineEngine(_module(stages, tokens=tokens, partition=partition),
                               optimizer=_sgd, micro_batches=m,
                               seq_chunks=k, timeout=60, loss_reduction=reduction,
                               data_parallel_size=replicas,
                               check_every=1)  # the sentinel (transfers too): no false alarm
    try:
        data = _batches(steps, m, mask=tokens, replicas=replicas)
        losses = [engine.train_batch(iter(b[engine.data_parallel_rank])).item() for b in data]
        left = len(engine.runtime._prefixes)  # every prefix released after chunk 0's backward
        # evaluation runs whole sequences (the layers see no chunk): the trained model's loss
        evaluated = engine.eval_batch(iter(data[0][engine.data_parallel_rank])).item()
        state = {key: v.clone() for key, v in engine.module.state_dict().items()}
        return losses, state, left, evaluated
    finally:
        engine.close()


def _check_parity(ranks, m, reduction="mean", steps=2, replicas=1):
    tokens = reduction == "tokens"
    data = _batches(steps, m, mask=tokens, replicas=replicas)
    ref_losses, ref = reference_train(_module(1, tokens=tokens), _sgd, data, m,
                                      loss_reduction=reduction)
    model = _module(1, tokens=tokens)
    whole = model.build_stage(0, [0, len(model.layers)])
    whole.load_state_dict(ref)
    with torch.no_grad():
        per_replica = [[model.loss_fn(whole(x), y) for x, y in data[0][r]]
                       for r in range(replicas)]
    for losses, state, left, evaluated in ranks:
        assert left == 0
        assert losses == pytest.approx(ref_losses, rel=1e-6, abs=1e-6)
        for key, value in state.items():
            torch.testing.assert_close(value, ref[key], rtol=1e-6, atol=1e-6)
        if not tokens:
            want = torch.stack([loss for losses_ in per_replica for loss in losses_]).mean()
            assert evaluated == pytest.approx(want.item(), rel=1e-6)


@pytest.mark.parametrize("k", [2, 4])
def test_two_stages_match_the_unsplit_micro_batches(k):
    _check_parity(run_ranks(_train, 2, 2, 3, k, timeout=300), 3)


def test_four_stages_one_micro_batch_match():
    """The head alone on the last stage: position-wise, it says so (``pk.sequence_chunk()``)."""
    bounds = [0, 2, 3, 5, 6]
    _check_parity(run_ranks(_train, 4, 4, 1, 3, 2, "mean", 1, bounds, timeout=300), 1)


def test_two_stages_two_replicas_match():
    _check_parity(run_ranks(_train, 4, 2, 2, 2, 2, "mean", 2, timeout=300), 2, replicas=2)


def test_token_mean_with_masked_labels_matches():
    """Chunks counting different numbers of tokens: exact under ``loss_reduction="tokens"``."""
    _check_parity(run_ranks(_train, 2, 2, 2, 3, 2, "tokens", timeout=300), 2, "tokens")


class _SavedPeak(MemoryMeter):
    """The step's peak of the activations autograd saved for backward (the KV prefixes'
    concatenations among them), exact bytes after every instruction."""

    def __init__(self) -> None:
        super().__init__()
        self.activations = 0

    @hookimpl
    def pipekernel_after_instruction(self, instruction, seconds):
        if self._on:
            self.activations = max(self.activations, self.ledger.now()["saved"])


def _peaks(runs):
    torch.set_num_threads(1)
    out = []
    for m, k in runs:
        meter = _SavedPeak()
        engine = pk.PipelineEngine(_module(2, dim=32, context=64), optimizer=_sgd,
                                   micro_batches=m, seq_chunks=k, timeout=60, plugins=[meter])
        try:
            engine.train_batch(iter(_batches(1, m, length=32)[0][0]))
            out.append(meter.activations)
        finally:
            engine.close()
    return out


def test_peak_activation_memory_falls_with_the_chunks():
    """Stage 0 of 2 holds 2 micro-batches under 1F1B, ``(k + 1) / k`` of one under
    Seq1F1B (plus the prefixes' concatenated keys and values): the exact bytes saved for
    backward fall as ``k`` grows (measured: 1, 0.82, 0.77 of 1F1B's for k = 1, 2, 4), and
    grow with the micro-batch count exactly as 1F1B's do (a prefix kept past its
    micro-batch's backward would add its keys and values)."""
    runs = [(4, 1), (8, 1), (4, 2), (8, 2), (4, 4), (8, 4)]
    first, last = run_ranks(_peaks, 2, runs, timeout=300)
    unsplit, unsplit_long, two, two_long, four, four_long = first
    assert four < two < unsplit
    assert four <= 0.8 * unsplit
    assert two_long - two == four_long - four == unsplit_long - unsplit
    assert (last[3], last[5]) == (last[2], last[4])  # the last stage: no growth at all


# -- refused, with the fix ----------------------------------------------------------------------

def test_seq_chunks_only_with_1f1b_and_models_that_take_a_prefix():
    pm = make_plugin_manager(autoload=False)
    module = _module(2)
    assert sequence_schedule(resolve_schedule(pm, "1f1b"), 1, module, 0) is OneFOneB
    assert sequence_schedule(resolve_schedule(pm, "1f1b"), 3, module, 0).seq_chunks == 3
    with pytest.raises(pk.ConfigError, match="seq_chunks=2 with schedule 'gpipe': sequence "
                                             "chunks run under 1F1B only"):
        sequence_schedule(resolve_schedule(pm, "gpipe"), 2, module, 0)
    with pytest.raises(pk.ConfigError, match="seq_chunks must be a positive int, got 0"):
        sequence_schedule(resolve_schedule(pm, "1f1b"), 0, module, 0)
    module.sequence_chunks_refused = "LlamaForCausalLM: cannot take a prefix"
    with pytest.raises(pk.ConfigError, match="seq_chunks=2: LlamaForCausalLM: cannot take"):
        sequence_schedule(resolve_schedule(pm, "1f1b"), 2, module, 0)


class _Mixer(nn.Module):
    """Mixes positions (a causal cumulative mean) without reading pk.sequence_chunk()."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x).cumsum(1) / torch.arange(1, x.shape[1] + 1)[None, :, None]


def _refused(length, micro_batches=1, model=None):
    torch.set_num_threads(1)
    module = model or pk.PipelineModule([_Mixer(), _Mixer()], num_stages=2,
                                        loss_fn=nn.functional.mse_loss)
    engine = pk.PipelineEngine(module, optimizer=_sgd, micro_batches=micro_batches,
                               seq_chunks=2, timeout=60)
    try:
        x = torch.ones(2, length, 4) if model is None else torch.ones(2, length, dtype=torch.long)
        engine.train_batch(iter([(x, x)]))  # one micro-batch
    except pk.PipelineError as err:
        return type(err).__name__, str(err)
    finally:
        engine.close()
    return None


def test_a_stage_whose_layers_never_read_the_chunk_is_refused():
    (kind, message), _ = run_ranks(_refused, 2, 4, timeout=300)
    assert kind == "ConfigError"
    assert "stage 0: no layer read pk.sequence_chunk() in the forward of sequence chunk 0" \
        in message
    assert "seq_chunks=1" in message
    (kind, message), _ = run_ranks(_refused, 2, 5, timeout=300)
    assert kind == "DataError" and "sequence length 5 is not a multiple" in message
    # the micro-batches named as the user counts them, not as chunks
    (kind, message), _ = run_ranks(_refused, 2, 4, 2, _module(2), timeout=300)
    assert kind == "DataError" and "the data iterator ran out at micro-batch 1 of 2" in message


def test_hugging_face_families_are_admitted_or_refused_by_name():
    """A config (random weights, built layer by layer for the probe): Llama's attention
    takes the prefix through the cache adapter, Mamba's recurrent state cannot
    (tests/test_hf_sequence_chunks.py trains every family)."""
    transformers = pytest.importorskip("transformers")
    import pipekernel.hf as hf

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      max_position_embeddings=16)
    module = hf.pipeline_module(config, num_stages=2)
    pm = make_plugin_manager(autoload=False)
    assert sequence_schedule(resolve_schedule(pm, "1f1b"), 4, module, 0).seq_chunks == 4
    assert sequence_schedule(resolve_schedule(pm, "1f1b"), 1, module, 0) is OneFOneB
    mamba = transformers.MambaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2,
                                     state_size=4, expand=2, conv_kernel=2)
    module = hf.pipeline_module(mamba, num_stages=2)
    with pytest.raises(pk.ConfigError, match=r"seq_chunks=4: MambaForCausalLM: backbone.layers.0 "
                                             r".* does not reproduce the whole sequence"):
        sequence_schedule(resolve_schedule(pm, "1f1b"), 4, module, 0)


def test_activation_checkpointing_is_refused_with_chunks():
    module = pk.PipelineModule([nn.Linear(4, 4), nn.Linear(4, 4)], num_stages=2,
                               activation_checkpoint_interval=1)
    with pytest.raises(pk.ConfigError, match="activation_checkpoint_interval=1: the recompute"):
        sequence_schedule(resolve_schedule(make_plugin_manager(autoload=False), "1f1b"), 2,
                          module, 0)


def test_train_takes_seq_chunks_and_refuses_what_cannot_chunk(monkeypatch):
    import dataclasses

    from pipekernel.apps import cli
    from pipekernel.apps.config import TrainConfig
    from pipekernel.apps.train import _positive

    seen = []
    monkeypatch.setattr("pipekernel.apps.train.run", seen.append)
    assert cli.main(["train", "--seq-chunks", "4", "--steps", "2"]) == 0
    assert seen[0].seq_chunks == 4
    cfg = TrainConfig(context=24, seq_chunks=4)
    _positive(cfg)
    for change, match in [({"seq_chunks": 5}, "--seq-chunks 5 must be >= 1 and divide "
                                               "--context 24"),
                          ({"pack": True}, "--seq-chunks 4 with --pack"),
                          ({"hf": "llama"}, "--seq-chunks 4 with --hf"),
                          ({"schedule": "gpipe"}, "--seq-chunks 4 with --schedule gpipe")]:
        with pytest.raises(pk.ConfigError, match=match):
            _positive(dataclasses.replace(cfg, **change))
