"""The embedding examples under examples/ run and give the oracle's answers."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pipekernel.testing import assert_parity, run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import embed_engine  # noqa: E402
import embed_kernel  # noqa: E402
import embed_schedules  # noqa: E402


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_level1_host_runtime_drives_pipekernel_schedules(schedule):
    losses, grads = embed_schedules.run(schedule)
    ref_losses, ref_grads = embed_schedules.sequential()
    assert losses == pytest.approx(ref_losses) and grads == pytest.approx(ref_grads)


def test_level2_kernel_with_host_handlers_and_plugin():
    losses, timer = embed_kernel.train()
    assert losses == pytest.approx(embed_kernel.plain_loop(), rel=1e-6)
    assert set(timer.seconds) == {"LoadMicroBatch", "Forward", "Backward", "ReduceTiedGrads",
                                  "ReduceGrads", "OptimizerStep"}


def test_level3_engine_in_host_loop_on_a_subgroup():
    records = run_ranks(embed_engine.host_worker, 3)
    ref_losses, ref_norms, ref_state = embed_engine.reference()
    outside, *pipeline = records
    assert outside["losses"] == [] and outside["final"] == pytest.approx(ref_losses[-1])
    assert [r["stage"] for r in pipeline] == [0, 1]
    for record in pipeline:
        assert_parity(record["losses"], ref_losses, record["state"], ref_state)
        assert record["norms"] == pytest.approx(ref_norms, rel=1e-5)
        assert record["lrs"] == [0.2, 0.2, 0.1, 0.1, 0.05]
        assert len(record["log"]) == embed_engine.STEPS
    assert any(n > embed_engine.MAX_NORM for n in ref_norms)  # clipping really happened
    assert set(pipeline[0]["state"]) | set(pipeline[1]["state"]) == set(ref_state)


def test_quickstart_trains_and_the_loss_falls():
    import os
    import subprocess

    script = Path(__file__).resolve().parent.parent / "examples" / "quickstart.py"
    out = subprocess.run([sys.executable, str(script), "--steps", "20"],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    first, final = (float(x) for x in last.split()[1:4:2])
    assert "over 20 steps on 2 stages" in last
    assert final < 0.5 * first, last


def test_tensor_parallel_example_matches_its_one_process_oracle():
    import pipe_tensor_parallel as example
    results = run_ranks(example.train, 4)
    assert [(r["stage"], r["tp_rank"]) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {s for r in results for s in r["shards"]} == {2}  # the blocks saw their group
    expected = example.reference()
    for r in results:
        assert r["losses"] == pytest.approx(expected, rel=1e-5)


def test_skip_connections_example_matches_one_process():
    import skip_connections

    for losses in run_ranks(skip_connections.worker, 2):
        assert losses == pytest.approx(skip_connections.reference(), rel=1e-5, abs=1e-6)
