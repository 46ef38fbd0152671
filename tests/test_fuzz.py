"""The differential fuzzer (tests/fuzzing.py): a seeded slice of drawn training setups
trains exactly like one process, or is refused by name; and the oracle itself tells a
wrong training, a refusal and a crash apart. The long run: benchmarks/fuzz.py."""
from __future__ import annotations

import json

import pytest
import torch
from fuzzing import SCHEDULES, draw_setups, judge, key, reference, run_setups, summary

SEED, COUNT = 2026, 16
#: minimal setups the long run found failing (kept as regression tests), as JSON
REGRESSIONS: list[str] = []


def _slice() -> list[dict]:
    return draw_setups(SEED, COUNT) + [json.loads(r) for r in REGRESSIONS]


@pytest.mark.multirank
def test_seeded_slice_trains_like_one_process_or_is_refused_by_name():
    setups = _slice()
    outcomes = run_setups(setups)
    verdicts = {key(s): judge(s, outcomes[key(s)]) for s in setups}
    bad = [f"{verdicts[key(s)][0]}: {key(s)}\n{verdicts[key(s)][1]}" for s in setups
           if verdicts[key(s)][0] not in ("ok", "refused")]
    assert not bad, "\n\n".join(bad) + "\n\n" + summary(setups, verdicts)
    # the slice means something: a good part of it trained (the rest refused by name:
    # chunks a schedule cannot hold, too few micro-batches for a V schedule, ...)
    assert sum(v[0] == "ok" for v in verdicts.values()) >= len(setups) // 3, \
        summary(setups, verdicts)


def test_the_schedules_come_from_the_plugin_manager():
    assert {"1f1b", "gpipe", "interleaved", "zb-h1", "zbv", "dualpipev"} <= set(SCHEDULES)


def test_drawing_is_seeded_and_covers_every_schedule():
    first = [key(s) for s in draw_setups(SEED, COUNT)]
    assert first == [key(s) for s in draw_setups(SEED, COUNT)]
    assert first != [key(s) for s in draw_setups(SEED + 1, COUNT)]
    assert {json.loads(s)["schedule"] for s in first} == set(SCHEDULES)


def _setup(**changes) -> dict:
    setup = {"checkpoint": 0, "chunks": None, "dp": 2, "ignore": 0.3, "input_dtype": "int64",
             "inputs": "tokens", "kinds": ["tuple", "tied", "tied", "dropout"],
             "labels": "classes", "loss_reduction": "tokens", "max_grad_norm": 0.05,
             "micro_batches": 3, "optimizer": "adamw", "partition": "uniform",
             "schedule": "1f1b", "seed": 3, "stages": 2, "tie_embed": True,
             "vary_length": True, "width": 8, "wire_dtype": "float64", "ramp": 2}
    return {**setup, **changes}


def test_the_oracle_passes_the_reference_itself_and_names_a_wrong_parameter():
    setup = _setup()
    losses, state = reference(setup)
    assert judge(setup, [("ok", losses, state)] * 2) == ("ok", "")
    wrong = dict(state)
    name = next(iter(wrong))
    wrong[name] = wrong[name] * (1 + 1e-4)
    verdict, detail = judge(setup, [("ok", losses, state), ("ok", losses, wrong)])
    assert verdict == "mismatch" and "rank 1" in detail and name in detail
    verdict, detail = judge(setup, [("ok", [losses[0], losses[1] * 1.001], state)] * 2)
    assert verdict == "mismatch" and "step 1" in detail


def test_the_oracle_needs_every_parameter_held_somewhere():
    setup = _setup()
    losses, state = reference(setup)
    part = {k: v for k, v in state.items() if not k.startswith("0.")}
    verdict, detail = judge(setup, [("ok", losses, part)] * 2)
    assert verdict == "mismatch" and "0." in detail


def test_the_oracle_tells_a_refusal_from_a_crash():
    setup = _setup()
    refused = ("refused", "ConfigError", "schedule 'inference' does not train\nhow to fix")
    aborted = ("aborted", "PeerAbort", "rank 0 failed")
    assert judge(setup, [refused, aborted]) == (
        "refused", "ConfigError: schedule 'inference' does not train")
    crash = ("error", "RuntimeError", "Traceback ...")
    assert judge(setup, [refused, crash])[0] == "error"
    assert judge(setup, [aborted, aborted])[0] == "error"  # nobody said why: not a refusal


def test_the_drawn_data_keeps_a_counted_label_and_varies_lengths():
    from fuzzing import data
    items = data(_setup(ignore=0.99), 0, 0)
    assert all((labels != -100).any() for _, labels in items)
    assert len({tuple(inputs.shape) for inputs, _ in data(_setup(micro_batches=6), 0, 0)}) > 1
    assert data(_setup(), 0, 0)[0][0].dtype == torch.int64


def test_a_failure_shrinks_to_a_minimal_setup(monkeypatch):
    """minimise() draws the run again and lets hypothesis shrink the first failure: here
    a fake oracle fails every setup with a custom autograd Function in it (no ranks)."""
    import fuzzing

    def fake_judge(setup, outcomes):
        return ("mismatch", "fake") if "function" in setup["kinds"] else ("ok", "")

    monkeypatch.setattr(fuzzing, "run_setups", lambda setups: {key(s): [] for s in setups})
    monkeypatch.setattr(fuzzing, "judge", fake_judge)
    setups = draw_setups(SEED, 40)
    verdicts = {key(s): fake_judge(s, None) for s in setups}
    assert any(v[0] == "mismatch" for v in verdicts.values())
    setup, verdict = fuzzing.minimise(SEED, 40, verdicts, budget=500)
    assert verdict == ("mismatch", "fake")
    assert sorted(setup["kinds"]) == ["function", "linear"]
    assert (setup["stages"], setup["dp"], setup["checkpoint"], setup["seed"]) == (2, 1, 0, 0)
