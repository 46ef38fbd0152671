"""One host synchronisation per train step (issue 20, item 5).

fp16 overflow, clipping, ``nonfinite="skip"``, the token count and the batch's loss
all travel in one device vector, all-reduced once and read with one ``tolist()``
(:mod:`pipekernel.step.stats`). Counted with :class:`pipekernel.testing.HostSyncs`,
which sees the calls that would block a GPU's host even though the tensors here are on
the CPU. Before this change the same step made 8 (first stage) and 9 (last stage)
such calls, the default fp32 step 2 and 3.
"""
from __future__ import annotations

import torch
from models import sgd
from test_token_loss import MICRO_BATCHES, VOCAB, padded_data, padded_lm
from torch import nn

import pipekernel as pk
from pipekernel.step.stats import StepStats
from pipekernel.testing import HostSyncs, run_ranks

#: The wire reads its headers from host memory by design (gloo: fused in the host
#: message; a device transport: its gloo control lane), so they are not device syncs.
HOST_MEMORY = ("comm/wire.py",)


def mean_loss(logits, labels):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1),
                                       ignore_index=-100)


def _syncs_worker(configs):
    torch.set_num_threads(1)
    out = []
    for options in configs:
        module = padded_lm(2)
        if options.get("loss_reduction") != "tokens":
            module.loss_fn = mean_loss
        engine = pk.PipelineEngine(module, optimizer=sgd, micro_batches=MICRO_BATCHES,
                                   timeout=60, check_data_steps=0, **options)
        counts = []
        for step in range(3):
            with HostSyncs() as syncs:
                loss = engine.train_batch(iter(padded_data(step, 0, MICRO_BATCHES)))
            counts.append([r for r in syncs.records if not r[1].startswith(HOST_MEMORY)])
        with HostSyncs() as syncs:
            engine.eval_batch(iter(padded_data(9, 0, MICRO_BATCHES)))
        counts.append([r for r in syncs.records if not r[1].startswith(HOST_MEMORY)])
        out.append((counts, float(loss), engine.last_grad_norm, engine.skipped_steps))
        engine.close()
    return out


def test_a_train_step_synchronises_the_host_once_whatever_it_decides():
    everything = {"precision": "fp16", "max_grad_norm": 1.0, "nonfinite": "skip",
                  "loss_reduction": "tokens"}
    results = run_ranks(_syncs_worker, 2, [{}, everything])
    for rank, per_config in enumerate(results):
        for counts, loss, norm, _ in per_config:
            for step, records in enumerate(counts):
                assert [what for what, _ in records] == ["tolist"], (rank, step, records)
                assert records[0][1].startswith("step/stats.py")
            assert loss == loss and loss > 0  # a real loss came out of the one read
    # both ranks read the same decisions
    assert results[0][1][1:] == results[1][1][1:] and results[0][1][2] is not None


def test_step_stats_fill_on_the_device_and_read_once():
    stats = StepStats("cpu", micro_batches=3, world=2, flags=True)
    stats.put(stats.OVERFLOW, torch.tensor(True))
    stats.put(stats.NORM_SQ, None)
    stats.put(stats.TOKENS, 7.0)
    losses = [torch.tensor(1.5), torch.tensor(float("nan"))]
    with HostSyncs() as syncs:
        stats.put_losses(losses, [2, 0], rank=1)
        values = stats.read()
    assert [what for what, _ in syncs.records] == ["tolist"]
    assert values[:4] == [1.0, 0.0, 0.0, 7.0] and values[stats.LOSS] != values[stats.LOSS]
    assert stats.bad_micro_batches(values) == [0] and stats.bad_ranks(values) == [1]
