"""``pipekernel train``'s checkpoints: ``--keep-last N`` deletes the older ones after a save
complete on every rank, ``--resume TAG`` picks one, and the error for a corrupt one names
the tag to resume from instead."""
from __future__ import annotations

import dataclasses
import os

import pytest

from pipekernel.apps import cli
from pipekernel.apps.config import TrainConfig
from pipekernel.engine.checkpoint_files import checkpoint_tags, layer_file, prune


def _fake_checkpoints(root, tags, latest):
    root.mkdir(exist_ok=True)
    for tag in tags:
        (root / tag).mkdir()
        (root / tag / "meta.json").write_text("{}")
    (root / "latest").write_text(latest + "\n")


def test_checkpoint_tags_are_complete_ones_in_step_order(tmp_path):
    _fake_checkpoints(tmp_path, ["global_step10", "global_step9", "best"], "global_step10")
    (tmp_path / "global_step11").mkdir()  # no meta.json: not a checkpoint
    (tmp_path / ".tmp-global_step12").mkdir()
    assert checkpoint_tags(str(tmp_path)) == ["global_step9", "global_step10", "best"]
    assert checkpoint_tags(str(tmp_path / "nowhere")) == []


def test_prune_keeps_the_newest_and_never_the_current_latest_or_other_tags(tmp_path):
    steps = ["global_step1", "global_step2", "global_step3", "global_step4", "global_step5"]
    _fake_checkpoints(tmp_path, [*steps, "best", "global_step9"], "global_step5")
    assert prune(str(tmp_path), 2, "global_step5") == steps[:3]
    # global_step9 is of a later step (a run resumed from an older tag): it stays
    assert sorted(os.listdir(tmp_path)) == ["best", "global_step4", "global_step5",
                                            "global_step9", "latest"]
    assert prune(str(tmp_path), 1, "global_step5") == ["global_step4"]
    assert prune(str(tmp_path), 1, "global_step5") == []


def test_prune_with_keep_last_zero_keeps_all_and_protects_latest(tmp_path):
    _fake_checkpoints(tmp_path, ["global_step1", "global_step2", "global_step3"], "global_step1")
    assert prune(str(tmp_path), 0, "global_step3") == []
    assert prune(str(tmp_path), 1, "global_step3") == ["global_step2"]  # latest stays
    assert checkpoint_tags(str(tmp_path)) == ["global_step1", "global_step3"]


def test_keep_last_then_resume_a_tag_then_a_corrupt_latest_names_the_older_tag(tmp_path, capfd):
    """Two ranks save every step with --keep-last 3; --resume global_step2 repeats the
    straight run from step 2 bit-exactly; a corrupt latest is refused with the tag to take."""
    from pipekernel.apps.train import run

    ck = tmp_path / "ck"
    cfg = TrainConfig(steps=5, save_every=1, keep_last=3, dim=16, layers=2, heads=2,
                      context=16, micro_batch_size=2, micro_batches=2, corpus_bytes=50_000,
                      sample_bytes=0, out=str(tmp_path / "a"), checkpoint_dir=str(ck),
                      progress=False, every=100)
    straight = run(cfg)
    assert checkpoint_tags(str(ck)) == ["global_step3", "global_step4", "global_step5"]
    assert sorted(p.name for p in ck.iterdir()) == [  # nothing hidden left behind
        "global_step3", "global_step4", "global_step5", "latest"]

    resumed = run(dataclasses.replace(cfg, resume="global_step3", out=str(tmp_path / "b")))
    assert resumed["first_step"] == 3 and resumed["losses"] == straight["losses"][3:]
    out = capfd.readouterr().out
    assert f"resumed from {ck / 'global_step3'} at step 3" in out
    assert "learning-rate schedule changed" not in out  # the same --steps: the same schedule
    assert (ck / "latest").read_text().strip() == "global_step5"

    (ck / "global_step5" / layer_file(0)).write_bytes(b"not a checkpoint")
    argv = ["train", "--steps", "6", "--dim", "16", "--layers", "2", "--heads", "2",
            "--context", "16", "--micro-batch-size", "2", "--micro-batches", "2",
            "--corpus-bytes", "50000", "--sample-bytes", "0", "--no-progress",
            "--out", str(tmp_path / "c"), "--checkpoint-dir", str(ck), "--resume"]
    assert cli.main(argv) == 1
    err = capfd.readouterr().err
    assert "truncated or corrupt" in err and "Traceback" not in err
    assert "how to fix: resume from another checkpoint: --resume global_step4" in err
    assert "global_step3, global_step4" in err
    # and that advice works
    assert cli.main([*argv, "global_step4"]) == 0
    # --steps 6 where the checkpoint's run had 5: the cosine decay moved, and it says so
    out = capfd.readouterr().out
    assert "the learning-rate schedule changed at the resume" in out
    assert "cosine decay to --steps 6" in out and "step 4" in out
    # a tag that is not there: the ones that are
    assert cli.main([*argv, "global_step7"]) == 1
    err = capfd.readouterr().err
    assert "checkpoint 'global_step7'" in err and "--resume global_step5 (under " in err


def test_a_corrupt_checkpoint_names_the_older_tags_to_load_instead(tmp_path):
    from pipekernel.engine.checkpoint_files import read_meta
    from pipekernel.errors import DataError

    _fake_checkpoints(tmp_path, ["global_step1", "global_step2"], "global_step2")
    (tmp_path / "global_step2" / "meta.json").write_text("{trunc")
    with pytest.raises(DataError) as info:
        read_meta(str(tmp_path))
    assert "global_step2" in info.value.message and "truncated or corrupt" in info.value.message
    assert info.value.hint == (f"load an older tag (global_step1 under {tmp_path}): "
                               "engine.load_checkpoint(root, tag=...), or pipekernel train "
                               "--resume TAG")


def test_lr_change_compares_the_saved_rate_with_this_runs_schedule():
    import torch

    from pipekernel.apps.train import lr_change, lr_factor

    def scheduler(steps, lr=3e-3, run=0, state=None):
        cfg = TrainConfig(steps=steps, lr=lr)
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(cfg))
        for _ in range(run):
            opt.step()
            sched.step()
        if state is not None:
            sched.load_state_dict(state)
        return sched, cfg

    saved = scheduler(450, run=100)[0].state_dict()
    assert lr_change(*scheduler(450, state=saved)) is None
    text = lr_change(*scheduler(900, state=saved))
    assert "at step 100" in text and "to --steps 900" in text
    assert lr_change(*scheduler(450, lr=1e-3, state=saved)) is not None
