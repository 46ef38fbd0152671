"""The mutation suite (issue 47 item 4): each bug class of a silently wrong pipeline is
injected by the test (tests/mutations.py: monkeypatches, no switch in the product) at step
3 and named on every rank at that step — by the sentinel (``check_every=1``) or, for what
only the gradients show, by ``engine.verify_batch`` run before each step — under 1f1b, zbv
and dualpipev, with two replicas (2 stages x 2) and without (4 stages); steps 1 and 2 of
each run, and clean runs with the replay every step, raise nothing. One process world of
4 ranks for the file; ``python benchmarks/sentinel_cost.py --clean 1000`` runs 1,000 clean
steps of each."""
from __future__ import annotations

import pytest
import torch

from pipekernel.testing import run_ranks
from tests.mutations import BUG_STEP, BUGS, LAYOUTS, SCHEDULES, run_case

CLEAN_STEPS = 4


def _all(cases):
    torch.set_num_threads(1)
    return {case: run_case(*case) for case in cases}


@pytest.fixture(scope="module")
def outcomes():
    cases = [(bug, s, lay, BUG_STEP) for bug in BUGS for s in SCHEDULES for lay in LAYOUTS]
    cases += [(None, s, lay, CLEAN_STEPS) for s in SCHEDULES for lay in LAYOUTS]
    results = run_ranks(_all, 4, cases, timeout=1200)
    for case in cases:  # every rank raised the same error (or none)
        seen = [{k: v for k, v in r[case].items() if k != "text"} for r in results]
        assert all(s == seen[0] for s in seen), (case, seen)
    return results[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("bug", list(BUGS))
def test_each_bug_is_named_at_the_step_it_happens(outcomes, bug, schedule, layout):
    got = outcomes[(bug, schedule, layout, BUG_STEP)]
    expected = BUGS[bug][1]
    if bug == "step_skipped":  # a replica's, or (no replicas) a tied copy's
        expected = "replicas" if layout == "replicas" else "tied"
    assert got.get("check", "").startswith(expected or "?"), got
    assert got["step"] == BUG_STEP, got
    if bug in ("byte_flipped", "position_ids_lost"):
        # the first transfer stage 1 receives in the step: micro-batch 0's activations
        assert got["stage"] == 1 and "sent to stage 1" in got["text"], got
        assert "(micro-batch(es) [0]) differs" in got["text"], got
    if bug == "counted":
        assert got["parameter"] == "4" and "module '4' (PosBlock)" in got["text"], got
    if bug == "dropped_micro_batch":
        assert got["stage"] == 0, got


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_clean_steps_raise_nothing(outcomes, schedule, layout):
    got = outcomes[(None, schedule, layout, CLEAN_STEPS)]
    assert got == {"steps": CLEAN_STEPS, "last_clean": CLEAN_STEPS}, got
