"""DeepSpeedExamples' ``training/pipeline_parallelism/train.py``, copied as
``tests/fixtures/deepspeed/pipe_train.py`` (written the same way: ``add_config_arguments``,
``runtime.utils.set_random_seed``, ``RepeatingLoader``, a joined layer list with in-place
ReLUs and dropout), run by DeepSpeed 0.19 itself and by pipekernel with only the import
changed. The config is the example's, with what real configs carry besides (disabled
monitors and profilers, ZeRO bucket sizes, DeepSpeed's activation-checkpointing options,
``WarmupCosineLR``) and ``torch_adam`` (no compiled ops on this machine).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pipekernel.testing import run_ranks

from deepspeed_support import FIXTURES, deepspeed_or_skip

sys.path.insert(0, str(FIXTURES))


_deepspeed = deepspeed_or_skip


def _config(path: Path, drop: tuple[str, ...] = (), **overrides) -> str:
    config = {
        "train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.9, 0.999],
                                                 "eps": 1e-8, "torch_adam": True}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 6,
                                                           "warmup_num_steps": 2,
                                                           "warmup_min_ratio": 0.1}},
        "gradient_clipping": 0.0,
        "steps_per_print": 10, "wall_clock_breakdown": False,
        "tensorboard": {"enabled": False, "output_path": "tb/"},
        "wandb": {"enabled": False, "project": "x"}, "csv_monitor": {"enabled": False},
        "flops_profiler": {"enabled": False, "profile_step": 1},
        "comms_logger": {"enabled": False}, "memory_breakdown": False,
        "prescale_gradients": False, "communication_data_type": None,
        "activation_checkpointing": {"partition_activations": False,
                                     "contiguous_memory_optimization": False,
                                     "cpu_checkpointing": False},
        "zero_optimization": {"stage": 0, "reduce_bucket_size": 5e8,
                              "allgather_bucket_size": 5e8, "overlap_comm": False,
                              "contiguous_gradients": True},
        **overrides}
    path.write_text(json.dumps({k: v for k, v in config.items() if k not in drop}))
    return str(path)


def _pipekernel(argv: list[str]) -> dict:
    import pipe_train
    return pipe_train.main(argv)


def test_train_py_runs_with_only_the_import_changed(tmp_path):
    """The same losses, dropout included, at 2 stages; and the same answers to DeepSpeed's
    grid, rank and step queries (where DeepSpeed 0.19's pipeline engine raises instead
    — ``get_data_parallel_rank()``, ``get_model_parallel_rank()``: its global groups are
    never set up — pipekernel answers from the grid)."""
    _deepspeed()
    import pipe_train
    argv = ["--deepspeed_config", _config(tmp_path / "ds.json"), "-p", "2", "--steps", "4",
            "--probe"]
    ours = run_ranks(_pipekernel, 2, argv)
    theirs = pipe_train.launch(argv, 2)
    for rank, (mine, ds) in enumerate(zip(ours, theirs)):
        assert mine["losses"] == pytest.approx(ds["losses"], rel=1e-6), rank
        assert len(set(mine["losses"])) == 4
        probe, expected = dict(mine["probe"]), dict(ds["probe"])
        assert expected["ranks"] == ["AssertionError", rank, "AssertionError"]
        assert probe.pop("ranks") == [0, rank, 0]
        expected.pop("ranks")
        assert probe == expected, rank


def test_clipping_counts_every_stage_as_deepspeed_at_one_stage(tmp_path):
    """The evidence for docs/deepspeed.md: with clipping active (SGD, clip 0.05),
    no dropout (one process draws other masks than two), pipekernel at 2 stages gives
    DeepSpeed's 1-stage losses; DeepSpeed 0.19 at 2 stages
    does not (its pipeline clips by the first stage's gradient norm only)."""
    _deepspeed()
    import pipe_train
    path = _config(tmp_path / "clip.json", gradient_clipping=0.05, drop=("scheduler",),
                   optimizer={"type": "SGD", "params": {"lr": 0.05}})
    argv = ["--deepspeed_config", path, "--steps", "4", "--dropout", "0"]
    ours = run_ranks(_pipekernel, 2, argv + ["-p", "2"])[0]["losses"]
    one_stage = pipe_train.launch(argv + ["-p", "1"], 1)[0]["losses"]
    two_stages = pipe_train.launch(argv + ["-p", "2"], 2)[0]["losses"]
    assert ours == pytest.approx(one_stage, rel=1e-6)
    assert max(abs(a - b) for a, b in zip(two_stages, one_stage)) > 1e-4
