"""Tensor parallelism is torch's DTensor (issue 45: pipekernel's own column/row-parallel
layers and partitioned activations are retired): Megatron-style blocks of plain
``nn.Linear`` layers under a Colwise/Rowwise plan train like one process at 2 stages x 2
tensor-parallel ranks, and at 2 stages x 2 FSDP2 shards x 2 tensor-parallel ranks; the
retired ways are refused before anything is built, naming what to use instead."""
from __future__ import annotations

import pytest
import torch
from models import adam, mlp_data, sgd
from torch import nn

import pipekernel as pk
from pipekernel.grid.parallel import ParallelConfig
from pipekernel.testing import assert_parity, reference_train, run_ranks

MB, STEPS = 3, 3


class Block(nn.Module):
    """``down(tanh(up(x)))``: ``up`` split by output features, ``down`` by input features
    under :func:`tp_plan`."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


def tp_mlp(num_stages=None, width=16, hidden=32, partition=None):
    """Two Megatron-style blocks between plain input and output layers."""
    layers = [pk.LayerSpec(nn.Linear, 8, width), pk.LayerSpec(Block, width, hidden),
              torch.tanh, pk.LayerSpec(Block, width, hidden), pk.LayerSpec(nn.Linear, width, 4)]
    return pk.PipelineModule(layers, loss_fn=nn.MSELoss(), num_stages=num_stages,
                             partition=partition or [0, 2, len(layers)], seed=7)


def tp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    return {"*.up": ColwiseParallel(), "*.down": RowwiseParallel()}


def whole_state(engine):
    """Every parameter of the stage whole (DTensors gathered: collective over the mesh)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in engine.module.named_parameters():
        value = engine.precision.master(p).detach()
        out[name] = (value.full_tensor() if isinstance(value, DTensor) else value).clone()
    return out


def tp_worker(optimizer, shard=1):
    torch.set_num_threads(1)
    engine = pk.PipelineEngine(tp_mlp(num_stages=2), optimizer=optimizer, micro_batches=MB,
                               tensor_parallel_size=2, tensor_parallel_plan=tp_plan(),
                               data_parallel_shard=shard, timeout=120, max_grad_norm=0.5)
    losses = [engine.train_batch(iter(mlp_data(s, engine.data_parallel_rank, MB))).item()
              for s in range(STEPS)]
    local = {n: tuple(p.to_local().shape) for n, p in engine.module.named_parameters()
             if hasattr(p, "to_local")}
    return {"losses": losses, "state": whole_state(engine), "local": local,
            "stage": engine.stage, "tp_rank": engine.topology.model_rank,
            "norm": engine.last_grad_norm}


def _reference(replicas, optimizer):
    batches = [[mlp_data(s, r, MB) for r in range(replicas)] for s in range(STEPS)]
    return reference_train(tp_mlp(), optimizer, batches, MB,
                           hook=lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5))


def _check(results, replicas, optimizer):
    ref_losses, ref_state = _reference(replicas, optimizer)
    covered = set()
    for r in results:
        assert_parity(r["losses"], ref_losses, r["state"], ref_state)
        covered |= set(r["state"])
    assert covered == set(ref_state)
    assert len({round(r["norm"], 6) for r in results}) == 1 and results[0]["norm"] > 0.5


@pytest.mark.parametrize("optimizer", [adam, sgd])
def test_two_stages_two_tensor_parallel_ranks_match_one_process(optimizer):
    results = run_ranks(tp_worker, 4, optimizer, timeout=300)
    assert [(r["stage"], r["tp_rank"]) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in results:  # each tensor-parallel rank holds half of every up / down weight
        ups = [shape for name, shape in r["local"].items() if name.endswith("up.weight")]
        downs = [shape for name, shape in r["local"].items() if name.endswith("down.weight")]
        assert ups and all(s == (16, 16) for s in ups) and all(s == (16, 16) for s in downs)
    _check(results, 1, optimizer)


def test_two_stages_two_shards_two_tensor_ranks_on_eight_processes():
    """2 stages x 2 FSDP2 shards x 2 tensor-parallel ranks (what tensor parallelism with
    data-parallel replicas and ZeRO-1 did on pipekernel's own layers), against one process."""
    results = run_ranks(tp_worker, 8, adam, 2, timeout=600)
    assert sorted((r["stage"], r["tp_rank"]) for r in results) == \
        sorted([(s, t) for s in range(2) for t in range(2)] * 2)
    _check(results, 2, adam)


def test_the_retired_ways_are_refused_naming_the_replacement():
    with pytest.raises(pk.ConfigError, match="tensor_parallel_size=2 needs a "
                                             "tensor_parallel_plan(.|\n)*ColwiseParallel"):
        ParallelConfig.make(tensor_parallel_size=2)
    for value in (True, False):
        with pytest.raises(pk.ConfigError, match="partitioned activations went with "
                                                 "(.|\n)*remove partition_activations"):
            ParallelConfig.make(partition_activations=value)
    assert not hasattr(pk, "tensor_parallel")
    with pytest.raises(ImportError):
        import pipekernel.grid.tensor_parallel  # noqa: F401
