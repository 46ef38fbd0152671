"""The engine plugin behind ``accumulate_grad_batches`` and the callbacks' gradient norm
(pipekernel.lightning.stepping), and the predictions' broadcast
(pipekernel.lightning.predict), on the engine alone at 2 stages x 2 replicas with a weight
tied across the stages: two batches accumulated into one step equal one process stepping
once on both, the norm the hooks see is the whole model's, and every rank gets its
replica's outputs.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("lightning")

import models  # noqa: E402

from pipekernel.testing import reference_train, run_ranks  # noqa: E402

MICRO, STEPS, WINDOW = 2, 2, 2


class _Strategy:
    """What StepControl asks of PipelineStrategy: the engine, and the hooks at the step."""

    def __init__(self) -> None:
        self.engine = None
        self.norms: list[float | None] = []
        self.control = None

    def _before_optimizer_step(self) -> None:
        self.norms.append(self.control.grad_norm)


def _batch(step: int, window: int, replica: int) -> list:
    return models.token_data(WINDOW * step + window, replica, MICRO)


def _worker() -> dict:
    import pipekernel as pk
    from pipekernel.lightning.predict import OutputBroadcast, concat
    from pipekernel.lightning.stepping import StepControl
    strategy = _Strategy()
    control = strategy.control = StepControl(strategy)
    engine = pk.PipelineEngine(models.tied_lm(num_stages=2), models.sgd, micro_batches=MICRO,
                               plugins=[control], grad_bucket_mb=0)
    strategy.engine = engine
    losses = []
    for step in range(STEPS):
        for window in range(WINDOW):
            control.accumulating = window < WINDOW - 1
            control.grad_scale = 1.0 / WINDOW
            items = _batch(step, window, engine.data_parallel_rank)
            losses.append(float(engine.train_batch(iter(items))))
    control.accumulating = False
    items = _batch(STEPS, 0, engine.data_parallel_rank)
    _, outputs = engine.eval_batch(iter(items), compute_loss=False, return_outputs=True)
    predicted = OutputBroadcast(engine)(concat(outputs) if outputs is not None else None)
    return {"losses": losses, "norms": strategy.norms, "predicted": predicted,
            "dp_rank": engine.data_parallel_rank,
            "state": {k: v.detach().clone() for k, v in engine.module.state_dict().items()}}


def test_accumulated_windows_grad_norm_and_predictions_match_one_process():
    results = run_ranks(_worker, 4, timeout=600)
    steps = [[[item for window in range(WINDOW) for item in _batch(step, window, replica)]
              for replica in range(2)] for step in range(STEPS)]
    ref_norms = []

    def hook(model):
        ref_norms.append(float(torch.nn.utils.get_total_norm(
            [p.grad for p in model.parameters() if p.grad is not None])))

    ref_losses, ref_state = reference_train(models.tied_lm(), models.sgd, steps,
                                            MICRO * WINDOW, hook=hook)
    model = models.tied_lm().build_stage(0, [0, len(models.tied_lm().layers)])
    model.load_state_dict(ref_state)
    for rank, result in enumerate(results):
        # each batch's own loss; the mean of a window is the one-process step's
        windows = [sum(result["losses"][i:i + WINDOW]) / WINDOW
                   for i in range(0, len(result["losses"]), WINDOW)]
        assert windows == pytest.approx(ref_losses, rel=1e-6), rank
        assert result["norms"] == pytest.approx(ref_norms, rel=1e-6), rank
        for key, value in result["state"].items():
            torch.testing.assert_close(value, ref_state[key], rtol=1e-6, atol=1e-7)
        inputs = torch.cat([x for x, _ in _batch(STEPS, 0, result["dp_rank"])])
        with torch.no_grad():
            expected = model.eval()(inputs)
        torch.testing.assert_close(result["predicted"], expected, rtol=1e-5, atol=1e-6)
    assert {r["dp_rank"] for r in results} == {0, 1}
