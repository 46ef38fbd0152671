"""Layer 0: the simulator's answers are frozen. Every case of a grid of (schedule, stages,
micro-batches, chunks, costs, skips, posting policy) gives exactly the result the
simulator gave before its event loop was rewritten for scale (issue 29, item 7): the makespan,
bubble fraction, buffer counts, waits, the whole timeline and its ASCII grid (one digest), and
for an invalid plan the full text of the error (deadlock cycles, mismatches) — so the proof under
the strict lane order (a rank's operations on one lane complete in posting order, whatever the
peer) is unchanged, not just its verdict.

The expected values live in ``tests/fixtures/simulator_frozen.json``, written by the simulator
before the rewrite. Regenerate them only for an intended change of the simulator's answers:
``python tests/test_simulator_frozen.py --freeze`` (then review the diff).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from pathlib import Path

import pytest

from pipekernel.errors import PipelineError
from pipekernel.schedules import BUILTIN_SCHEDULES, format_grid, simulate
from pipekernel.schedules.program import plan_communication
from pipekernel.schedules.instructions import (
    Backward, BackwardInput, BackwardWeight, Forward, RecvActivation, RecvGrad, SendActivation,
    SendGrad,
)

FROZEN = Path(__file__).parent / "fixtures" / "simulator_frozen.json"

_COSTS = {
    "unit": None,
    "mixed": {Forward: 1.0, Backward: 2.0, BackwardInput: 1.25, BackwardWeight: 0.75,
              SendActivation: 0.25, RecvActivation: 0.125, SendGrad: 0.5, RecvGrad: 0.0625},
}
_HOST = {SendActivation: 0.0625, RecvActivation: 0.03125, SendGrad: 0.125, RecvGrad: 0.0}


def one_lane(steps, **kw):
    """The runtime's plan without lanes: a stage's traffic on one ordered stream."""
    return dataclasses.replace(plan_communication(steps, **kw), lanes=())


def eager(steps, **kw):
    """Every receive posted at the start of the batch, on the runtime's lanes."""
    plan = plan_communication(steps, **kw)
    posts = [list(group) for group in plan.posts]
    moved = [i for group in plan.posts for i in group
             if plan.stream[i].__class__.__name__.startswith("Recv")]
    for group in posts:
        group[:] = [i for i in group if i not in moved]
    posts[0] = sorted(set(posts[0]) | set(moved)) if posts else []
    return dataclasses.replace(plan, posts=tuple(tuple(g) for g in posts))


_POSTING = {"one_lane": one_lane, "eager": eager}


def _stage_costs(stages: int, chunks: int) -> dict:
    """Stages that differ (deterministic): stage s chunk c computes (1 + (s + c) % 3) / 2."""
    return {(s, c): {Forward: (1 + (s + c) % 3) / 2, Backward: 1 + (s + c) % 3,
                     BackwardInput: (1 + (s + c) % 3) / 2, BackwardWeight: (1 + s % 2) / 4}
            for s in range(stages) for c in range(chunks)}


def cases():
    """``(key, kwargs)`` of every frozen case; the key names it in the fixture."""
    for name in sorted(BUILTIN_SCHEDULES):
        cls = BUILTIN_SCHEDULES[name]
        for chunks in sorted({cls.min_chunks, min(cls.max_chunks, 3)}):
            for stages in (1, 2, 3, 4):
                for micro_batches in (1, 2, 3, 5, 8):
                    base = dict(schedule=name, num_stages=stages, micro_batches=micro_batches,
                                chunks=chunks)
                    yield from _variants(base, stages, chunks)
            for stages, micro_batches in ((8, 16), (6, 24)):
                base = dict(schedule=name, num_stages=stages, micro_batches=micro_batches,
                            chunks=chunks)
                yield _key(base), base


def _variants(base: dict, stages: int, chunks: int):
    yield _key(base), base
    yield _key(base, costs="mixed"), dict(base, costs="mixed")
    if (stages + base["micro_batches"]) % 2:  # half the sizes: keeps the grid fast
        yield _key(base, costs="mixed", host="yes"), dict(base, costs="mixed", host="yes")
        yield _key(base, stage_costs="yes"), dict(base, stage_costs="yes")
    positions = stages * chunks
    if positions >= 3:
        skips = sorted({(0, positions - 1), (positions // 2 - 1, positions // 2 + 1)})
        yield _key(base, skips=skips), dict(base, skips=skips)
    for posting in _POSTING:
        if stages >= 2:
            yield _key(base, posting=posting), dict(base, posting=posting)


def _key(base: dict, **extra) -> str:
    return " ".join(f"{k}={v}" for k, v in {**base, **extra}.items()).replace(" ", "")


def run_case(kwargs: dict) -> dict:
    """What the simulator answers for one case: the figures and a digest of everything."""
    kw = dict(kwargs)
    cls = BUILTIN_SCHEDULES[kw.pop("schedule")]
    costs = _COSTS[kw.pop("costs", "unit")]
    if kw.pop("host", None):
        kw["host_costs"] = _HOST
    if kw.pop("stage_costs", None):
        kw["stage_costs"] = _stage_costs(kw["num_stages"], kw["chunks"])
    if "posting" in kw:
        kw["posting"] = _POSTING[kw["posting"]]
    try:
        r = simulate(cls, costs=costs, **kw)
    except PipelineError as e:
        text = f"{type(e).__name__}: {e}"
        return {"error": text[:160], "digest": hashlib.sha256(text.encode()).hexdigest()[:20]}
    timeline = [[(repr(a), repr(b), type(i).__name__, str(i)) for a, b, i in row]
                for row in r.timeline]
    whole = repr((r.makespan, r.bubble_fraction, r.buffers, r.waits, r.semantics, r.spans,
                  timeline, format_grid(r)))
    return {"makespan": repr(r.makespan), "bubble": repr(r.bubble_fraction),
            "buffers": list(r.buffers), "digest": hashlib.sha256(whole.encode()).hexdigest()[:20]}


def _frozen() -> dict:
    return json.loads(FROZEN.read_text())


def test_the_grid_is_frozen_and_covers_errors():
    frozen = _frozen()
    keys = [key for key, _ in cases()]
    assert len(keys) == len(set(keys)) and set(keys) == set(frozen)
    errors = [k for k, v in frozen.items() if "error" in v]
    assert any("deadlock" in frozen[k]["error"] for k in errors)
    assert len(errors) < len(frozen) // 2


@pytest.mark.parametrize("name", sorted(BUILTIN_SCHEDULES))
def test_every_answer_is_the_frozen_one(name):
    frozen = _frozen()
    ran = 0
    for key, kwargs in cases():
        if kwargs["schedule"] != name:
            continue
        assert run_case(kwargs) == frozen[key], key
        ran += 1
    assert ran > 50


def test_the_fast_path_answers_as_the_full_simulation_does(monkeypatch):
    """``simulate`` proves a plan with nothing to report on a fast path
    (:mod:`pipekernel.schedules.sim_fast`) that repeats the full simulation's checks: every
    case of the grid answers the same with the fast path turned off (so a check added to one
    and not the other shows here), and the fast path does answer most valid cases."""
    from pipekernel.schedules import sim_fast

    prove, answered = sim_fast._Fast.prove, []

    def counted(self):
        result = prove(self)
        answered.append(result is not None)
        return result

    grid = [kwargs for _, kwargs in cases()]
    monkeypatch.setattr(sim_fast._Fast, "prove", counted)
    fast = [run_case(kwargs) for kwargs in grid]
    monkeypatch.setattr(sim_fast._Fast, "prove", lambda self: None)
    for kwargs, answer in zip(grid, fast):
        assert run_case(kwargs) == answer, kwargs
    valid = sum("error" not in answer for answer in fast)
    assert sum(answered) >= valid // 2, (sum(answered), valid)


if __name__ == "__main__" and sys.argv[1:] == ["--freeze"]:
    FROZEN.parent.mkdir(exist_ok=True)
    FROZEN.write_text(json.dumps({key: run_case(kw) for key, kw in cases()}, indent=0,
                                 sort_keys=True) + "\n")
    print(f"wrote {FROZEN}")
