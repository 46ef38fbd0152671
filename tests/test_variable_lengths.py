"""Variable lengths at speed (issue 44, item 4): a batch of 8 micro-batches of 8 different
lengths (or packed rows of 8 widths) costs the messages, waits and host reads of the same batch with one length, plus
exactly one read of each transfer's new metadata; nothing grows from step to step.

Counted through a real 2-rank gloo run (benchmarks/variable_lengths.py, whose table is in
benchmarks/RESULTS.md). Before the fix every length change was void + metadata + data
messages and two blocking receives: 32 posted operations, 16 extra ones and 48 waits per
rank and step instead of 16, 0 and 16.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import pytest  # noqa: E402
import variable_lengths as vl  # noqa: E402

from pipekernel.testing import assert_parity, reference_train, run_ranks  # noqa: E402

STEPS = 3


@pytest.mark.parametrize("model", list(vl.MODELS))
def test_eight_lengths_cost_what_one_length_does_plus_the_metadata_reads(model):
    """``plain``: one activation tensor; ``packed``: packed rows of 8 widths, a dict of
    hidden states and position ids crossing the boundary."""
    fixed = run_ranks(vl.count_worker, 2, vl.FIXED, STEPS, model, timeout=240)
    variable = run_ranks(vl.count_worker, 2, vl.VARIABLE, STEPS, model, timeout=240)
    for rank in range(2):
        peer = 1 - rank
        for step in range(1, STEPS):  # step 0 sizes the messages (the first transfers)
            f, v = fixed[rank][0][step], variable[rank][0][step]
            where = f"rank {rank} step {step}: fixed {f}, variable {v}"
            assert v["meta"] == vl.MICRO_BATCHES and f["meta"] == 0, where  # each detected
            for what in ("posted", "extra", "waits"):
                assert v[what] == f[what], f"{what} differ: {where}"
            assert f["extra"] == 0, where  # only the plan's groups on the fast path
            # one host read of each received transfer's new metadata, nothing else
            assert v["reads"] == f["reads"] + variable[peer][0][step]["meta"], where
        for case in (fixed, variable):  # no growth from step to step
            assert case[rank][0][1] == case[rank][0][STEPS - 1], case[rank][0]


@pytest.mark.parametrize("model", list(vl.MODELS))
def test_eight_lengths_train_as_one_process_does(model):
    results = run_ranks(vl.count_worker, 2, vl.VARIABLE, STEPS, model, timeout=240)
    batches = [[vl.batch(step, vl.VARIABLE)] for step in range(STEPS)]
    ref_losses, ref_state = reference_train(
        vl.MODELS[model](), lambda p: vl.torch.optim.SGD(p, lr=0.1), batches,
        vl.MICRO_BATCHES)
    for _, losses, state in results:
        assert_parity(losses, ref_losses, state, ref_state)
