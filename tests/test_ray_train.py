"""examples/ray_train_gpt.py: the GPT trained through Ray Train's ``TorchTrainer`` on a local
Ray cluster (2 CPU workers, loopback only) gives one process's losses and weights.

Skips when ray (the ``ray`` extra) is not installed or a local Ray cannot start here.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("ray.train.torch", reason="needs the ray extra: pip install 'pipekernel[ray]'")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import ray_train_gpt  # noqa: E402

from pipekernel.testing import assert_parity, reference_train  # noqa: E402

STEPS = 3
#: seconds for the whole example: a local Ray start, its 2 workers, 3 steps
LIMIT = 240


def _run_example(tmp_path: Path) -> dict:
    (tmp_path / "weights").mkdir()
    # a fresh Ray of its own (no state from another run or user) in a short folder: Ray's
    # unix sockets live there, and their paths may not exceed 107 bytes
    ray_dir = tempfile.mkdtemp(prefix="pkray", dir="/tmp" if os.path.isdir("/tmp") else None)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           "RAY_TMPDIR": ray_dir, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
           # Ray's memory monitor counts the whole machine's memory as its node's: on a
           # shared machine it kills the workers for what other processes use
           "RAY_memory_monitor_refresh_ms": "0"}
    env.pop("RAY_ADDRESS", None)
    command = [sys.executable, str(ROOT / "examples" / "ray_train_gpt.py"), "--workers", "2",
               "--steps", str(STEPS), "--save", str(tmp_path / "weights")]
    # its own session: on a timeout every process of the local Ray cluster is ended too
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=LIMIT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        if "Started training worker group" not in err:
            pytest.skip(f"Ray could not start its 2 training workers within {LIMIT} s here "
                        f"(load average {os.getloadavg()[0]:.0f}): {err.strip()[-300:]}")
        pytest.fail(f"the Ray example's workers started but did not finish in {LIMIT} s:\n"
                    f"{out[-3000:]}\n{err[-6000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(ray_dir, ignore_errors=True)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 and "Started a local Ray instance" not in err:
        pytest.skip(f"a local Ray cluster cannot start here:\n{err[-2000:]}")
    assert proc.returncode == 0 and lines, out[-3000:] + err[-5000:]
    return json.loads(lines[0][len("RESULT "):])


def test_ray_train_trains_the_gpt_as_one_process_does(tmp_path):
    result = _run_example(tmp_path)
    assert result["master_addr"] == "127.0.0.1"  # loopback only
    assert result["world_size"] == 2 and result["transport"] == "GlooTransport"
    losses, state = reference_train(ray_train_gpt.model(1), ray_train_gpt.optimizer,
                                    [[step] for step in ray_train_gpt.batches(STEPS)],
                                    ray_train_gpt.MICRO_BATCHES)
    assert result["losses"] == pytest.approx(losses, rel=1e-5, abs=1e-6)
    import torch

    params = {k: v for stage in (0, 1)
              for k, v in torch.load(tmp_path / "weights" / f"stage{stage}.pt").items()}
    assert_parity(result["losses"], losses, params, state)
    assert set(params) == set(state)
