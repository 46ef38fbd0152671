"""Pipeline (x data) training equals one process with gradient accumulation."""
from __future__ import annotations

import pytest
from models import MODELS, adam, sgd

import pipekernel as pk
from pipekernel.testing import assert_parity, reference_train, run_ranks

STEPS = 4


def train_worker(model, stages, dp, micro_batches, schedule, optimizer):
    build, data = MODELS[model]
    engine = pk.PipelineEngine(build(num_stages=stages), optimizer=optimizer,
                               micro_batches=micro_batches, schedule=schedule,
                               data_parallel_size=dp, timeout=60)
    losses = [engine.train_batch(iter(data(step, engine.data_parallel_rank, micro_batches)))
              .item() for step in range(STEPS)]
    state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return losses, state, engine.stage, engine.data_parallel_rank


def check_parity(model, stages, dp, micro_batches, schedule="1f1b", optimizer=sgd):
    results = run_ranks(train_worker, stages * dp, model, stages, dp, micro_batches, schedule,
                        optimizer)
    build, data = MODELS[model]
    batches = [[data(step, r, micro_batches) for r in range(dp)] for step in range(STEPS)]
    ref_losses, ref_state = reference_train(build(), optimizer, batches, micro_batches)
    covered = set()
    for losses, state, stage, replica in results:
        assert_parity(losses, ref_losses, state, ref_state)
        covered |= set(state)
    assert covered == set(ref_state), "stages together must hold every parameter"
    assert [s for _, _, s, _ in results] == [pk.Topology(stages, dp, 1, r).stage
                                             for r in range(stages * dp)]


@pytest.mark.parametrize("stages,micro_batches", [(2, 4), (4, 6), (4, 2)])
def test_mlp_parity_stages(stages, micro_batches):
    check_parity("mlp", stages, 1, micro_batches)


def test_mlp_parity_gpipe_adam():
    check_parity("mlp", 2, 1, 3, schedule="gpipe", optimizer=adam)


def test_pipe_and_data_parallel_parity():
    check_parity("mlp", 2, 2, 4)


def test_mixed_dtype_tuple_activations():
    check_parity("masked", 2, 1, 3)


def test_tied_layers_first_and_last_stage():
    check_parity("tied", 2, 1, 4, optimizer=adam)


def test_tied_layers_with_data_parallel():
    check_parity("tied", 2, 2, 3)  # 2 stages x 2 replicas: tied and data-parallel reductions


def test_tied_layers_with_a_middle_stage():
    check_parity("tied", 3, 1, 3)


def test_sequence_length_changes_between_steps():
    check_parity("varlen", 2, 1, 3)


@pytest.mark.parametrize("stages", [2, 4])
def test_dict_activations_float_bool_int64(stages):
    # {"hidden": float, "mask": bool, "pos": int64} crosses every boundary; only hidden
    # gets a gradient
    check_parity("dicts", stages, 1, 4)
