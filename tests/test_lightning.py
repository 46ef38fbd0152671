"""pipekernel.lightning.PipelineStrategy: a LightningModule trained by Lightning's Trainer
through the pipeline gives the one-process oracle's losses and weights, validates, saves,
resumes bit-exactly in new processes, and refuses misconfigurations with what to change.

Lightning takes ~10 s to import per process, so there are three launches in all: two
stages (processes started by run_ranks, which Lightning's cluster environment adopts,
like torchrun's), two stages x two replicas (the same), and a resume where
``Trainer(devices=2)`` starts its own processes (``start_method="spawn"``).
"""
from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

import lightning_models as lm  # noqa: E402

import pipekernel as pk  # noqa: E402
from pipekernel.testing import assert_parity, reference_eval, reference_train, run_ranks  # noqa: E402


def _trainer(devices: int, epochs: int, root: str | None, **strategy: object) -> object:
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from pipekernel.lightning import PipelineStrategy
    callbacks = [ModelCheckpoint(dirpath=os.path.join(root, "ckpts"), filename="{epoch}",
                                 save_top_k=-1)] if root else []
    return Trainer(accelerator="cpu", devices=devices, max_epochs=epochs,
                   strategy=PipelineStrategy(num_stages=2, micro_batches=lm.MICRO, **strategy),
                   logger=CSVLogger(root, name="logs") if root else False,
                   callbacks=callbacks, enable_checkpointing=bool(root),
                   num_sanity_val_steps=0, log_every_n_steps=1, enable_model_summary=False,
                   enable_progress_bar=bool(root))


def _misconfigured(kind: str) -> str:
    """The error a fit of a misconfigured module raises (on this rank)."""
    model = lm.PipeModel(automatic=kind == "automatic", model=kind)
    try:
        _trainer(2, 1, None).fit(model)
    except pk.ConfigError as err:
        return str(err)
    return "no error"


def _fit_worker(root: str, replicas: int, epochs: int, misconfigurations: bool) -> dict:
    model = lm.PipeModel(replicas=replicas)
    trainer = _trainer(2 * replicas, epochs, root)
    trainer.fit(model)
    engine = trainer.strategy.engine
    out = {**model.record(), "stage": engine.stage, "dp_rank": engine.data_parallel_rank,
           "own_parameters": sorted(engine.module.state_dict())}
    if misconfigurations:
        # the same Trainer validates again: a new engine, the stage's trained weights
        (out["validate"],) = trainer.validate(model, verbose=False)
        out["errors"] = {kind: _misconfigured(kind) for kind in ("linear",)}
        out["errors"]["rank 1 fails"] = _failing_rank()  # last: it breaks the group
    return out


def _failing_rank() -> str:
    """A rank failing in the module's own code, outside the engine, while its peer waits
    inside a pipelined step: the peer stops with the cause, not a transfer timeout."""
    try:
        _trainer(2, 1, None).fit(lm.FailingModel())
    except Exception as err:  # noqa: BLE001 - the test looks at which one
        return f"{type(err).__name__}: {err}"
    return "no error"


def _check_against_oracle(results: list[dict], replicas: int, epochs: int) -> None:
    steps = lm.reference_steps(replicas, epochs)
    ref_losses, ref_state = reference_train(lm.pipeline_module(), lm.scheduled_optimizer,
                                            steps, lm.MICRO)
    per_epoch = len(steps) // epochs
    ref_val = []
    for epoch in range(1, epochs + 1):  # validation after each epoch, with its weights
        _, state = reference_train(lm.pipeline_module(), lm.scheduled_optimizer,
                                   steps[:epoch * per_epoch], lm.MICRO)
        ref_val += [reference_eval(lm.pipeline_module(), state, items)[0]
                    for items in lm.reference_val_items(replicas)]
    for rank, result in enumerate(results):
        # the same batch losses on every rank, the stage's own parameters only
        assert_parity(result["train_losses"], ref_losses, result["state"], ref_state)
        assert result["state"] and set(result["state"]) < set(ref_state), rank
        for ours, ref in zip(result["val_losses"], ref_val, strict=True):
            assert abs(ours - ref) <= 1e-6 + 1e-5 * abs(ref), (rank, ours, ref)
        assert result["global_step"] == len(steps)
        assert result["steps_seen"] == list(range(1, len(steps) + 1))  # after each step
        assert result["before_step_calls"] == len(steps)       # Lightning's hook, per step
        assert result["lr"] == pytest.approx(lm.LR * lm.GAMMA ** (len(steps) // 2)
                                             * lm.EPOCH_GAMMA ** epochs)
        assert result["callback_metrics"]["train_loss"] == pytest.approx(result["train_losses"][-1])
    stages = {(r["stage"], r["dp_rank"]) for r in results}
    assert stages == {(s, d) for s in range(2) for d in range(replicas)}
    covered = set().union(*(r["own_parameters"] for r in results))
    assert covered == set(ref_state)  # the stages together hold the whole model


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory) -> tuple[Path, list[dict]]:
    """One launch: fit 2 epochs on 2 stages (checkpoint each epoch), then misconfigurations."""
    root = tmp_path_factory.mktemp("lightning")
    return root, run_ranks(_fit_worker, 2, str(root), 1, 2, True)


def test_two_stages_match_one_process_losses_weights_and_validation(two_stages):
    root, results = two_stages
    _check_against_oracle(results, replicas=1, epochs=2)
    # the logger (rank 0's CSV) saw every step's loss at its global step
    (metrics,) = (root / "logs").rglob("metrics.csv")
    rows = [r for r in csv.DictReader(metrics.open()) if r.get("train_loss")]
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3]
    assert [float(r["train_loss"]) for r in rows] == pytest.approx(results[0]["train_losses"])


def test_two_stages_by_two_replicas_match_one_process(tmp_path):
    results = run_ranks(_fit_worker, 4, str(tmp_path), 2, 1, False)
    _check_against_oracle(results, replicas=2, epochs=1)


def _checked_worker() -> dict:
    model = lm.PipeModel(replicas=1)
    trainer = _trainer(2, 1, None, verify_every=1, check_every=1)
    trainer.fit(model)
    engine = trainer.strategy.engine
    return {**model.record(), "stage": engine.stage, "dp_rank": engine.data_parallel_rank,
            "own_parameters": sorted(engine.module.state_dict()),
            "checked": engine.sentinel.last_clean}


def test_verify_every_and_check_every_reach_the_engine_and_change_nothing():
    """PipelineStrategy(verify_every=1, check_every=1): every batch is replayed before it
    trains and checked after; the run still matches one process."""
    results = run_ranks(_checked_worker, 2)
    _check_against_oracle(results, 1, 1)
    assert all(r["checked"] == r["global_step"] for r in results)


def test_resume_in_processes_the_trainer_starts_equals_the_straight_run(two_stages, tmp_path):
    """fit(ckpt_path=epoch 0's checkpoint) in new processes (Trainer(devices=2) spawns
    them) ends with the straight run's weights, bit for bit, and its losses."""
    root, straight = two_stages
    env = dict(os.environ)
    # one thread per process, as run_ranks gave the straight run: bit-exact needs the same
    # reduction order (Lightning's spawn would otherwise pick cores // processes threads)
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        trainer = _trainer(2, 2, str(tmp_path), start_method="spawn")
        trainer.fit(lm.PipeModel(record_dir=str(tmp_path)),
                    ckpt_path=str(root / "ckpts" / "epoch=0.ckpt"))
    finally:
        os.environ.clear()
        os.environ.update(env)
    records = [torch.load(tmp_path / f"record-{r}.pt") for r in range(2)]
    for rank, record in enumerate(records):
        assert record["train_losses"] == straight[rank]["train_losses"][2:], rank
        assert record["steps_seen"] == [3, 4] and record["global_step"] == 4, rank
        assert record["lr"] == straight[rank]["lr"]
        for key, value in straight[rank]["state"].items():
            assert torch.equal(record["state"][key], value), key
    # and the resumed run's own last checkpoint is the straight run's, layer for layer
    from pipekernel.lightning import pipeline_dir
    a = pk.load_sequential(pipeline_dir(root / "ckpts" / "epoch=1.ckpt"),
                           lm.pipeline_module()).state_dict()
    b = pk.load_sequential(pipeline_dir(tmp_path / "ckpts" / "epoch=1.ckpt"),
                           lm.pipeline_module()).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_load_from_checkpoint_reads_the_file_model_checkpoint_wrote(two_stages):
    """In one process, no process group: the module (LayerSpec layers, whole model through
    attach_whole_model) gets every stage's trained weights."""
    root, results = two_stages
    whole = {}
    for result in results:
        whole.update({f"pipeline.{k}": v for k, v in result["state"].items()})
    loaded = lm.PipeModel.load_from_checkpoint(root / "ckpts" / "epoch=1.ckpt")
    state = loaded.state_dict()
    assert state.keys() == whole.keys()
    assert all(torch.equal(state[k], whole[k]) for k in whole)


def test_misconfigurations_say_what_to_change_and_a_failing_rank_stops_its_peer(two_stages):
    _, results = two_stages
    for result in results:
        errors = result["errors"]
        assert "configure_model() returned Linear" in errors["linear"]
        assert "pk.PipelineModule(" in errors["linear"]
        assert result["validate"]["val_loss"] == pytest.approx(result["val_losses"][-1], rel=1e-6)
    assert results[1]["errors"]["rank 1 fails"] == "ValueError: the module failed on rank 1"
    assert results[0]["errors"]["rank 1 fails"].startswith("PeerAbort")
    assert "the module failed on rank 1" in results[0]["errors"]["rank 1 fails"]


def test_devices_not_a_multiple_of_the_stages_and_other_precisions_fail_in_the_trainer():
    from lightning.pytorch import Trainer

    from pipekernel.lightning import PipelineStrategy
    with pytest.raises(pk.ConfigError, match=r"3 processes, not a multiple of num_stages=2"
                                             r"(.|\n)*devices=2"):
        Trainer(accelerator="cpu", devices=3, strategy=PipelineStrategy(num_stages=2))
    with pytest.raises(pk.ConfigError, match=r"precision='bf16-true'(.|\n)*PipelineStrategy\(precision='bf16'\)"):
        Trainer(accelerator="cpu", devices=2, precision="bf16-true",
                strategy=PipelineStrategy(num_stages=2))
    with pytest.raises(pk.ConfigError, match=r"both choose a precision"):
        Trainer(accelerator="cpu", devices=2, precision="bf16-mixed",
                strategy=PipelineStrategy(num_stages=2, precision="bf16"))
    trainer = Trainer(accelerator="cpu", devices=2, precision="bf16-mixed",
                      strategy=PipelineStrategy(num_stages=2))
    assert trainer.strategy._precision_options["precision"] == "amp-bf16"
    assert type(trainer.precision_plugin).__name__ == "Precision"


def test_registered_by_name():
    from lightning.pytorch import Trainer

    import pipekernel.lightning  # noqa: F401  (registers the name)
    trainer = Trainer(accelerator="cpu", devices=1, strategy="pipekernel", logger=False)
    assert type(trainer.strategy).__name__ == "PipelineStrategy"
    assert trainer.strategy.num_stages is None and trainer.strategy.micro_batches == 1


def test_split_batch_cuts_nested_batches_and_refuses_uneven_ones():
    from pipekernel.lightning import split_batch
    batch = ({"ids": torch.arange(6), "mask": torch.ones(6, 2)}, (torch.arange(6), "tag"))
    items = split_batch(batch, 3)
    assert len(items) == 3 and items[1][0]["ids"].tolist() == [2, 3]
    assert items[2][1][0].tolist() == [4, 5] and items[2][1][1] == "tag"
    with pytest.raises(pk.DataError, match="6 samples, which micro_batches=4"):
        split_batch(batch, 4)
    with pytest.raises(pk.DataError, match="must be a pair"):
        split_batch([torch.ones(2)], 1)


def test_gpt_example_trains_with_processes_the_trainer_starts(tmp_path):
    """examples/lightning_gpt.py: Trainer(devices=2) with the default start method (the
    script runs again for rank 1, as Lightning's DDP does), a checkpoint at the end."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parent.parent / "examples" / "lightning_gpt.py"
    out = subprocess.run([sys.executable, str(script), "--steps", "6", "--dim", "32",
                          "--layers", "2", "--context", "32", "--batch-size", "8",
                          "--micro-batches", "2", "--checkpoints", str(tmp_path)],
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    assert "over 6 steps on 2 stages x 1 replicas" in last, last
    first, final = float(last.split()[1]), float(last.split()[3])
    assert final < first, last
    from pipekernel.lightning import pipeline_dir
    (checkpoint,) = tmp_path.glob("*.ckpt")
    assert checkpoint.is_file()  # Lightning's own file; pipekernel's directory beside it
    assert (Path(pipeline_dir(checkpoint)) / "latest").read_text().strip() == "checkpoint"
