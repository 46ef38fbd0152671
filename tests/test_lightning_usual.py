"""A LightningModule written the usual way (layers in ``__init__``, automatic
optimization) under PipelineStrategy on 2 stages equals the same module trained by
Lightning in one process: losses, weights, the whole model's gradient norm seen by
``on_before_optimizer_step``, ``ReduceLROnPlateau`` on its monitored metric,
``accumulate_grad_batches`` (with a short last window), ``gradient_clip_val`` and
``precision="bf16-mixed"``; ``ModelCheckpoint``'s file loads with ``load_from_checkpoint``
in one process; ``trainer.predict`` returns the model's outputs on every rank.

One launch of 2 processes (Lightning takes ~10 s to import per process).
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("lightning")

import lightning_models as lm  # noqa: E402

import pipekernel as pk  # noqa: E402
from pipekernel.testing import run_ranks  # noqa: E402

EPOCHS = 3


def _trainer(devices: int, root: str | None, *, pipeline: bool, epochs: int = EPOCHS,
             precision: str = "32-true", clip: float | None = 0.05) -> object:
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from pipekernel.lightning import PipelineStrategy
    strategy = PipelineStrategy(num_stages=2, micro_batches=lm.MICRO,
                                log_grad_norm="grad_norm") if pipeline else "auto"
    callbacks = [ModelCheckpoint(dirpath=os.path.join(root, "ckpts"), filename="{epoch}",
                                 save_top_k=-1)] if root else []
    return Trainer(accelerator="cpu", devices=devices, max_epochs=epochs, strategy=strategy,
                   accumulate_grad_batches=2, gradient_clip_val=clip, precision=precision,
                   logger=False, callbacks=callbacks, enable_checkpointing=bool(root),
                   num_sanity_val_steps=0, enable_model_summary=False,
                   enable_progress_bar=False)


def _error(mistake: str) -> str:
    try:
        _trainer(2, None, pipeline=True, epochs=1).fit(lm.UsualModel(mistake=mistake))
    except pk.ConfigError as err:
        return str(err)
    return "no error"


def _worker(root: str) -> dict:
    model = lm.UsualModel()
    trainer = _trainer(2, root, pipeline=True)
    trainer.fit(model)
    out = {"fit": model.record(), "stage": trainer.strategy.engine.stage,
           "logged_norm": float(trainer.callback_metrics["grad_norm"])}
    out["predict"] = trainer.predict(model)
    bf16 = lm.UsualModel()
    trainer = _trainer(2, None, pipeline=True, epochs=1, precision="bf16-mixed", clip=None)
    trainer.fit(bf16)
    out["bf16"] = bf16.record()
    out["bf16_policy"] = trainer.strategy.engine.precision.name
    # resume: a straight run and one from its first epoch's checkpoint, in these processes
    straight, resumed = lm.UsualModel(plateau=False), lm.UsualModel(plateau=False)
    _trainer(2, os.path.join(root, "straight"), pipeline=True).fit(straight)
    _trainer(2, os.path.join(root, "resumed"), pipeline=True).fit(
        resumed, ckpt_path=os.path.join(root, "straight", "ckpts", "epoch=0.ckpt"))
    out["resume"] = (straight.record(), resumed.record())
    out["error"] = _error("forward")  # last: training_step calls self.net(x)
    return out


def _reference(precision: str = "32-true", epochs: int = EPOCHS,
               clip: float | None = 0.05) -> tuple[lm.UsualModel, object]:
    torch.set_num_threads(1)
    model = lm.UsualModel()
    trainer = _trainer(1, None, pipeline=False, epochs=epochs, precision=precision, clip=clip)
    trainer.fit(model)
    return model, trainer


def _as_pipeline(state: dict) -> dict:
    """One process's ``net.<i>.<name>`` keys as a stage's ``pipeline.<i>.<name>``."""
    return {k.replace("net.", "pipeline.", 1): v for k, v in state.items()}


@pytest.fixture(scope="module")
def usual(tmp_path_factory):
    root = tmp_path_factory.mktemp("usual")
    return root, run_ranks(_worker, 2, str(root), timeout=600)


def test_automatic_optimization_matches_lightning_in_one_process(usual):
    _, results = usual
    ref, _ = _reference()
    ref_state = _as_pipeline(ref.record()["state"])
    steps = EPOCHS * 2  # 3 batches an epoch, windows of 2 and 1
    for rank, result in enumerate(results):
        fit = result["fit"]
        assert fit["global_step"] == steps == len(ref.norms), rank
        assert fit["train_losses"] == pytest.approx(ref.train_losses, rel=1e-5, abs=1e-7)
        assert fit["state"] and set(fit["state"]) < set(ref_state), rank
        for key, value in fit["state"].items():
            torch.testing.assert_close(value, ref_state[key], rtol=1e-5, atol=1e-6)
        # the whole model's norm (before clipping), not this stage's
        for (ours, helper), (theirs, _) in zip(fit["norms"], ref.norms, strict=True):
            assert ours == helper == pytest.approx(theirs, rel=1e-5), rank
        # ReduceLROnPlateau stepped on val_loss (mode="max": every later epoch halves)
        assert fit["lrs"] == pytest.approx(ref.lrs) and len(set(ref.lrs)) > 1
        assert result["logged_norm"] == pytest.approx(fit["norms"][-1][0])  # log_grad_norm
    assert ref.norms[0][0] > 0.05  # the clipping was active


def test_bf16_mixed_is_autocast_with_fp32_weights_as_in_lightning(usual):
    _, results = usual
    ref, _ = _reference("bf16-mixed", epochs=1, clip=None)
    ref_state = _as_pipeline(ref.record()["state"])
    for result in results:
        assert result["bf16_policy"] == "amp-bf16"
        bf16 = result["bf16"]
        assert bf16["train_losses"] == pytest.approx(ref.train_losses, rel=1e-2)
        for key, value in bf16["state"].items():
            assert value.dtype == torch.float32
            torch.testing.assert_close(value, ref_state[key], rtol=2e-2, atol=2e-3)


def test_load_from_checkpoint_gives_the_trained_model_in_one_process(usual):
    root, results = usual
    whole = {}
    for result in results:
        whole.update(result["fit"]["state"])
    loaded = lm.UsualModel.load_from_checkpoint(root / "ckpts" / f"epoch={EPOCHS - 1}.ckpt")
    state = _as_pipeline(loaded.state_dict())
    assert state.keys() == whole.keys()
    assert all(torch.equal(state[k], whole[k]) for k in whole)
    # predict: the whole model's outputs for every batch, on both ranks (not activations)
    inputs = lm.usual_data(2).tensors[0]
    with torch.no_grad():
        expected = list(loaded.net(inputs).split(lm.BATCH))
    for result in results:
        assert len(result["predict"]) == len(expected)
        for ours, ref in zip(result["predict"], expected, strict=True):
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


def test_a_training_step_that_runs_the_layers_itself_is_told_what_to_write(usual):
    _, results = usual
    for result in results:
        assert "is a layer of the pipeline" in result["error"]
        assert "self.trainer.strategy.train_batch(batch)" in result["error"]


def test_resume_from_model_checkpoints_file_continues_bit_exactly(usual):
    """Accumulation windows, clipping and an epoch scheduler: fit(ckpt_path=the file
    ModelCheckpoint wrote after epoch 0) ends with the straight run's weights, bit for bit."""
    _, results = usual
    for rank, result in enumerate(results):
        straight, resumed = result["resume"]
        assert resumed["train_losses"] == straight["train_losses"][lm.USUAL_BATCHES:], rank
        assert resumed["global_step"] == straight["global_step"] == EPOCHS * 2
        assert resumed["lrs"] == straight["lrs"][2:]
        assert resumed["state"].keys() == straight["state"].keys()
        for key, value in straight["state"].items():
            assert torch.equal(resumed["state"][key], value), (rank, key)
