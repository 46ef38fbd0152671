"""Tensor parallelism: 2 stages x 2 TP ranks train like one process; partitioned
activations cut the bytes each rank puts on the wire by T."""
from __future__ import annotations


import pytest
import torch
from models import adam, mlp_data, sgd
from torch import nn

import pipekernel as pk
import pipekernel.grid.tensor_parallel as tp
from pipekernel.plugins.counting import CountingPlugin
from pipekernel.testing import assert_parity, reference_train, run_ranks

MB, STEPS = 3, 3


def tp_mlp(num_stages=None, width=16, hidden=32, partition=None):
    """Megatron-style blocks: column-parallel up, tanh on the shards, row-parallel down."""
    def block():
        return [pk.LayerSpec(tp.ColumnParallelLinear, width, hidden), torch.tanh,
                pk.LayerSpec(tp.RowParallelLinear, hidden, width)]
    layers = [pk.LayerSpec(nn.Linear, 8, width), *block(), torch.tanh, *block(),
              pk.LayerSpec(nn.Linear, width, 4)]
    return pk.PipelineModule(layers, loss_fn=nn.MSELoss(), num_stages=num_stages,
                             partition=partition or [0, 5, len(layers)], seed=7)


def tp_worker(tp_size, dp, optimizer, partition, precision="fp32", zero=0, check_data=3):
    engine = pk.PipelineEngine(tp_mlp(num_stages=2), optimizer=optimizer, micro_batches=MB,
                               tensor_parallel_size=tp_size, data_parallel_size=dp,
                               partition_activations=partition, precision=precision,
                               zero_stage=zero, transport="counting", plugins=[CountingPlugin()],
                               timeout=60, max_grad_norm=0.5, check_data_steps=check_data)
    losses = [engine.train_batch(iter(mlp_data(s, engine.data_parallel_rank, MB))).item()
              for s in range(STEPS)]
    state = {k: engine.precision.master(p).detach().clone()
             for k, p in engine.module.named_parameters()}
    dims = {k: tp.sharded_dim(p) for k, p in engine.module.named_parameters()}
    return {"losses": losses, "state": state, "dims": dims, "stage": engine.stage,
            "tp_rank": engine.topology.model_rank, "tp_size": engine.tp_group.size,
            "sent": engine.transport.sent["bytes"], "payload": engine.runtime.payload_bytes(),
            "norm": engine.last_grad_norm}


def _reference(dp, optimizer):
    batches = [[mlp_data(s, r, MB) for r in range(dp)] for s in range(STEPS)]
    return reference_train(tp_mlp(), optimizer, batches, MB,
                           hook=lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5))


def _check(results, ref_losses, ref_state, rtol=1e-5, atol=1e-6):
    covered = set()
    for r in results:
        g = tp.TensorParallelGroup(r["tp_rank"], r["tp_size"])
        expected = {k: ref_state[k] if r["dims"][k] is None else tp.shard(ref_state[k],
                                                                          r["dims"][k], g)
                    for k in r["state"]}
        assert_parity(r["losses"], ref_losses, r["state"], expected, rtol=rtol, atol=atol)
        covered |= set(r["state"])
    assert covered == set(ref_state)


@pytest.mark.parametrize("optimizer", [adam, sgd])
def test_two_stages_two_tensor_parallel_ranks_match_one_process(optimizer):
    results = run_ranks(tp_worker, 4, 2, 1, optimizer, True)
    assert [(r["stage"], r["tp_rank"]) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert any(d is not None for d in results[0]["dims"].values())  # shards exist
    ref_losses, ref_state = _reference(1, optimizer)
    _check(results, ref_losses, ref_state)


def test_partitioned_activations_cut_the_bytes_per_rank_by_t():
    # the same run twice: whole tensors from every TP rank, then 1/T slices
    whole = run_ranks(tp_worker, 4, 2, 1, adam, False, "fp32", 0, 0)
    parts = run_ranks(tp_worker, 4, 2, 1, adam, True, "fp32", 0, 0)
    for w, p in zip(whole, parts):
        assert w["losses"] == p["losses"]  # the gather rebuilds the very same tensors
        # payload (tensor bytes handed to the wire): exactly half, float32 only
        assert p["payload"]["float32"] * 2 == w["payload"]["float32"]
        # bytes the transport sent (headers, metadata, 16-byte alignment included)
        assert p["sent"] < 0.6 * w["sent"], (p["sent"], w["sent"])
    ref_losses, ref_state = _reference(1, adam)
    _check(parts, ref_losses, ref_state)


def test_tensor_layers_build_whole_outside_a_context_and_check_divisibility():
    layer = tp.ColumnParallelLinear(4, 6)
    assert layer.weight.shape == (6, 4) and tp.size() == 1
    torch.manual_seed(0)
    a = tp.RowParallelLinear(6, 3)
    torch.manual_seed(0)
    b = nn.Linear(6, 3)
    torch.testing.assert_close(a.weight, b.weight)
    torch.testing.assert_close(a.bias, b.bias)
    with tp.context(tp.TensorParallelGroup(1, 4, ranks=[0, 1, 2, 3])):
        assert (tp.rank(), tp.size()) == (1, 4)
        with pytest.raises(pk.ConfigError, match="out_features 6 is not divisible by the "
                                                 "tensor-parallel size 4(.|\n)*how to fix"):
            tp.ColumnParallelLinear(4, 6)
        torch.manual_seed(0)
        row = tp.RowParallelLinear(8, 3)
        assert row.weight.shape == (3, 2) and tp.sharded_dim(row.weight) == 1
    torch.manual_seed(0)
    full = nn.Linear(8, 3)
    torch.testing.assert_close(row.weight, full.weight[:, 2:4])
    assert tp.size() == 1


# -- partitioned wire objects, without processes ------------------------------------------

class _FakeGroup:
    """Rank ``rank`` of a group whose members' slices are known in advance."""

    def __init__(self, rank, size, slices=None):
        self.rank, self.size, self.slices = rank, size, slices

    def all_gather(self, tensor):
        return torch.stack([tensor if r == self.rank else self.slices[r]
                            for r in range(self.size)])


def test_partitioned_slices_round_trip_through_the_wire_metadata_with_padding():
    from pipekernel.grid.partitioned import ActivationPartitioner
    from pipekernel.comm.wire import Partitioned, decode, encode, flatten, unflatten

    x = torch.randn(3, 5, requires_grad=True)   # 15 elements: 8 + 7, one of padding
    mask = torch.tensor([True, False])
    obj = (x, (mask, torch.arange(3)))
    splits = [ActivationPartitioner(_FakeGroup(r, 2)).split(obj) for r in range(2)]
    part0 = splits[0][0]
    assert isinstance(part0, Partitioned) and part0.part.shape == (8,) and part0.shape == (3, 5)
    assert splits[0][1][0] is mask  # integer / bool tensors travel whole
    # what the wire carries: the slice, with T and the full shape in the metadata
    tensors, structure = flatten(splits[1])
    specs, decoded = decode(encode(tensors, structure))
    assert specs[0][2] == (8,) and specs[0][1]  # the slice, flagged requires_grad
    received = unflatten(tensors, decoded)
    assert isinstance(received[0], Partitioned)
    assert (received[0].parts, received[0].shape) == (2, (3, 5))  # from the metadata alone
    joined = ActivationPartitioner(_FakeGroup(1, 2, {0: part0.part.detach()})).join(received)
    assert torch.equal(joined[0], x.detach()) and joined[0].requires_grad and joined[0].is_leaf
    assert torch.equal(joined[1][1], torch.arange(3))


def gather_fallback_worker():
    """pipekernel.comm.collectives.all_gather with and without the transport's all_gather."""
    from pipekernel.comm.collectives import all_gather
    from pipekernel.transports.gloo import GlooTransport

    class Without:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            if name == "all_gather":
                raise AttributeError(name)
            return getattr(self.inner, name)

    transport = GlooTransport(timeout=30)
    mine = torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * transport.rank
    native = all_gather(transport, mine, None, transport.rank, transport.world_size)
    fallback = all_gather(Without(transport), mine, None, transport.rank, transport.world_size)
    transport.close()
    return native, fallback


def test_all_gather_falls_back_to_an_all_reduce_exactly():
    for native, fallback in run_ranks(gather_fallback_worker, 2):
        expected = torch.stack([torch.arange(6.).view(2, 3), torch.arange(6.).view(2, 3) + 10])
        assert torch.equal(native, expected) and torch.equal(fallback, expected)


# -- tensor x data parallelism x ZeRO-1 --------------------------------------------------

def tp_dp_zero_worker(precision):
    out = {}
    for zero in (0, 1):
        engine = pk.PipelineEngine(tp_mlp(num_stages=1, partition="uniform"), optimizer=adam,
                                   micro_batches=MB, tensor_parallel_size=2,
                                   data_parallel_size=2, zero_stage=zero, precision=precision,
                                   max_grad_norm=0.5, timeout=60)
        losses = [engine.train_batch(iter(mlp_data(s, engine.data_parallel_rank, MB))).item()
                  for s in range(STEPS)]
        out[zero] = {"losses": losses, "norm": engine.last_grad_norm,
                     "state": {k: engine.precision.master(p).detach().clone()
                               for k, p in engine.module.named_parameters()},
                     "dims": {k: tp.sharded_dim(p) for k, p in engine.module.named_parameters()},
                     "where": (engine.data_parallel_rank, engine.topology.model_rank)}
    return out


def test_one_stage_two_replicas_two_tensor_ranks_zero1_matches_one_process():
    results = run_ranks(tp_dp_zero_worker, 4, "fp32")
    assert [r[1]["where"] for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    ref_losses, ref_state = _reference(2, adam)
    for r in results:
        assert r[1]["losses"] == pytest.approx(r[0]["losses"], rel=1e-6)
        assert r[1]["norm"] == pytest.approx(r[0]["norm"], rel=1e-6)
        g = tp.TensorParallelGroup(r[1]["where"][1], 2)
        expected = {k: ref_state[k] if r[1]["dims"][k] is None else tp.shard(ref_state[k],
                                                                             r[1]["dims"][k], g)
                    for k in r[1]["state"]}
        assert_parity(r[1]["losses"], ref_losses, r[1]["state"], expected)


def test_two_stages_two_replicas_two_tensor_ranks_on_eight_processes():
    """2 x 2 x 2, ZeRO-1 and partitioned activations together, against one process."""
    results = run_ranks(tp_worker, 8, 2, 2, adam, True, "fp32", 1, 3, timeout=300)
    assert sorted((r["stage"], r["tp_rank"]) for r in results) == \
        sorted([(s, t) for s in range(2) for t in range(2)] * 2)
    ref_losses, ref_state = _reference(2, adam)
    _check(results, ref_losses, ref_state)


class _Pair:
    """Two in-process tensor-parallel ranks: ``all_gather`` stacks the parts both hold."""

    def __init__(self, rank, parts):
        self.rank, self.size, self.parts = rank, 2, parts

    def all_gather(self, tensor):
        return torch.stack([self.parts[r][tensor.data_ptr()] if r != self.rank else tensor
                            for r in range(2)])


def test_partitioner_slices_float_leaves_of_nested_dicts_and_rebuilds_them():
    from pipekernel.grid.partitioned import ActivationPartitioner
    from pipekernel.comm.wire import Partitioned, flatten, unflatten

    value = {"hidden": torch.randn(3, 5), "mask": torch.rand(3) > 0.5,
             "extra": [torch.arange(4), (torch.randn(7),)]}
    split = [ActivationPartitioner(_Pair(r, None)).split(value) for r in range(2)]
    assert isinstance(split[0]["hidden"], Partitioned) and split[0]["hidden"].part.numel() == 8
    assert isinstance(split[0]["extra"][1][0], Partitioned)  # padded: 7 -> 2 x 4
    assert split[0]["mask"] is value["mask"] and split[0]["extra"][0] is value["extra"][0]
    # what rank 0 receives: its own parts, the peer's by position (as a gather does)
    tensors, structure = flatten(split[0])
    received = unflatten(tensors, structure)
    peer = {t.data_ptr(): p for t, p in zip(tensors, flatten(split[1])[0])}
    joined = ActivationPartitioner(_Pair(0, {1: peer})).join(received)
    assert list(joined) == ["hidden", "mask", "extra"] and isinstance(joined["extra"], list)
    assert torch.equal(joined["hidden"], value["hidden"])
    assert torch.equal(joined["extra"][1][0], value["extra"][1][0])
    assert torch.equal(joined["mask"], value["mask"])
