"""Pipeline (x data) training equals one process with gradient accumulation."""
from __future__ import annotations

import pytest
from models import MODELS, adam, sgd
from sweep import Sweep

import pipekernel as pk
from pipekernel.grid.topology import Topology
from pipekernel.testing import assert_parity, reference_train

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


SWEEP = Sweep()  # one world per world size for the whole module


def case(model, stages, dp, micro_batches, schedule="1f1b", optimizer=sgd):
    name = f"{model}-{stages}x{dp}-m{micro_batches}-{schedule}-{optimizer.__name__}"
    return SWEEP.case(name, stages * dp, train_worker, model, stages, dp, micro_batches,
                      schedule, optimizer)


def check_parity(case):
    results = SWEEP.results(case)
    model, stages, dp, micro_batches, schedule, optimizer = case.args
    build, data = MODELS[model]
    batches = [[data(step, r, micro_batches) for r in range(dp)] for step in range(STEPS)]
    ref_losses, ref_state = reference_train(build(), optimizer, batches, micro_batches)
    covered = set()
    for losses, state, stage, replica in results:
        assert_parity(losses, ref_losses, state, ref_state)
        covered |= set(state)
    assert covered == set(ref_state), "stages together must hold every parameter"
    assert [s for _, _, s, _ in results] == [Topology(stages, dp, 1, r).stage
                                             for r in range(stages * dp)]


STAGES = [case("mlp", 2, 1, 4), case("mlp", 4, 1, 6), case("mlp", 4, 1, 2)]
GPIPE_ADAM = case("mlp", 2, 1, 3, schedule="gpipe", optimizer=adam)
PIPE_AND_DATA = case("mlp", 2, 2, 4)
MIXED_DTYPES = case("masked", 2, 1, 3)
TIED = case("tied", 2, 1, 4, optimizer=adam)
TIED_DATA = case("tied", 2, 2, 3)  # 2 stages x 2 replicas: tied and data-parallel reductions
TIED_MIDDLE = case("tied", 3, 1, 3)
VARLEN = case("varlen", 2, 1, 3)
DICTS = [case("dicts", 2, 1, 4), case("dicts", 4, 1, 4)]


@pytest.mark.parametrize("case", STAGES, ids=str)
def test_mlp_parity_stages(case):
    check_parity(case)


def test_mlp_parity_gpipe_adam():
    check_parity(GPIPE_ADAM)


def test_pipe_and_data_parallel_parity():
    check_parity(PIPE_AND_DATA)


def test_mixed_dtype_tuple_activations():
    check_parity(MIXED_DTYPES)


def test_tied_layers_first_and_last_stage():
    check_parity(TIED)


def test_tied_layers_with_data_parallel():
    check_parity(TIED_DATA)


def test_tied_layers_with_a_middle_stage():
    check_parity(TIED_MIDDLE)


def test_sequence_length_changes_between_steps():
    check_parity(VARLEN)


@pytest.mark.parametrize("case", DICTS, ids=str)
def test_dict_activations_float_bool_int64(case):
    # {"hidden": float, "mask": bool, "pos": int64} crosses every boundary; only hidden
    # gets a gradient
    check_parity(case)
