"""The hot path, guarded (issue 45, item 6): Python-level calls per instruction of
``train_batch`` on a fixed model (2 stages, 1f1b, 8 micro-batches; per rank), counted with
``sys.setprofile`` by benchmarks/hot_path_calls.py — counted, not timed, so the figures are
the same on every run and under any load. A change that adds work per instruction fails
here, naming the instruction kind and by how much; a change that removes some lowers the
ceilings below (the table in benchmarks/RESULTS.md says what each figure was).

The counts depend on the Python and torch versions (what their own functions call): the
ceilings are recorded for the versions the project pins; on others the test is skipped
with the measured figures, to record them.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import hot_path_calls as hp  # noqa: E402

from pipekernel.testing import run_ranks  # noqa: E402

#: calls per instruction of each kind (``setup``, ``finish``: per batch), per rank, for
#: (Python, torch) versions
CEILINGS = {
    ((3, 11), "2.13"): (
        {"LoadMicroBatch": 16, "Forward": 28, "SendActivation": 30, "RecvGrad": 19,
         "Backward": 64.5, "ReduceTiedGrads": 4, "ReduceGrads": 3, "OptimizerStep": 130,
         "setup": 129, "finish": 40},
        {"LoadMicroBatch": 17.5, "RecvActivation": 15, "Forward": 67.25,
         "SendGrad": 33.875, "Backward": 46, "ReduceTiedGrads": 4, "ReduceGrads": 3,
         "OptimizerStep": 130, "setup": 129, "finish": 63},
    ),
}
#: what a figure may exceed its ceiling by: 2% of it, at least one call
TOLERANCE = 0.02


def _grown(rank: int, counts: dict[str, float], ceilings: dict[str, float]) -> list[str]:
    out = []
    for kind in sorted(set(counts) | set(ceilings)):
        count, ceiling = counts.get(kind), ceilings.get(kind)
        if ceiling is None:
            out.append(f"rank {rank} runs a new kind of instruction, {kind}: {count:g} calls "
                       f"each (record its ceiling)")
        elif count is None:
            out.append(f"rank {rank} no longer runs {kind} (remove its ceiling)")
        elif count > ceiling + max(1.0, TOLERANCE * ceiling):
            out.append(f"rank {rank} {kind}: {count:g} calls per instruction, ceiling "
                       f"{ceiling:g} (+{count - ceiling:g}, +{100 * (count / ceiling - 1):.1f}%)")
    return out


def test_calls_per_instruction_stay_under_their_ceilings():
    versions = (sys.version_info[:2], ".".join(torch.__version__.split(".")[:2]))
    results = run_ranks(hp.calls_worker, 2, 2, timeout=240)
    for rank, (first, second) in enumerate(results):
        assert first == second, f"rank {rank}: two counted steps differ: {first} vs {second}"
    if versions not in CEILINGS:
        pytest.skip(f"no ceilings recorded for Python {versions[0]}, torch {versions[1]}; "
                    f"measured: {[r[0] for r in results]}")
    grown = [line for rank, (counts, _) in enumerate(results)
             for line in _grown(rank, counts, CEILINGS[versions][rank])]
    assert not grown, ("the hot path does more work per instruction than recorded "
                       "(python benchmarks/hot_path_calls.py --detail KIND lists its calls):\n"
                       + "\n".join(grown))


def test_the_guard_names_the_kind_that_grew_and_by_how_much():
    ceilings = {"Forward": 20, "Backward": 50, "setup": 100}
    assert _grown(0, {"Forward": 20.5, "Backward": 51, "setup": 102}, ceilings) == []
    assert _grown(1, {"Forward": 25, "Backward": 50, "setup": 100, "Extra": 3}, ceilings) == [
        "rank 1 runs a new kind of instruction, Extra: 3 calls each (record its ceiling)",
        "rank 1 Forward: 25 calls per instruction, ceiling 20 (+5, +25.0%)"]
