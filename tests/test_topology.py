"""The rank order: which rank is which (stage, replica, tensor-parallel rank)."""
from __future__ import annotations

import itertools

import pytest

import pipekernel as pk
from pipekernel.errors import ConfigError
from pipekernel.grid.topology import Topology, format_rank_map, parse_rank_order, rank_map, \
    world_size_rules


def test_default_order_is_tensor_innermost_pipeline_outermost():
    # Megatron's order: rank = (stage * D + data) * T + model
    assert rank_map("tp-dp-pp", 2, 2, 2) == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    topo = Topology.from_world(8, rank=5, num_stages=2, model_size=2)
    assert topo.order == "tp-dp-pp"
    assert (topo.stage, topo.data_rank, topo.model_rank) == (1, 0, 1)
    assert topo.model_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.data_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.pipe_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.stage_rank(0) == 1


@pytest.mark.parametrize("order,expected", [
    ("tp-pp-dp", [(0, 0, 0), (1, 0, 0), (2, 0, 0), (0, 1, 0), (1, 1, 0), (2, 1, 0)]),
    ("pp-dp-tp", [(0, 0, 0), (1, 0, 0), (2, 0, 0), (0, 1, 0), (1, 1, 0), (2, 1, 0)]),
    ("dp-pp-tp", [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0), (2, 0, 0), (2, 1, 0)]),
    ("tp-dp-pp", [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0), (2, 0, 0), (2, 1, 0)]),
])
def test_orders_with_three_stages_two_replicas(order, expected):
    assert rank_map(order, 3, 2, 1) == expected


@pytest.mark.parametrize("sizes", [(2, 2, 2), (4, 2, 1), (3, 1, 2), (2, 3, 4), (1, 4, 2)])
@pytest.mark.parametrize("order", ["-".join(p) for p in itertools.permutations(("tp", "dp", "pp"))])
def test_every_order_is_a_bijection_and_groups_partition_the_world(order, sizes):
    pipe, data, model = sizes
    world = pipe * data * model
    mapping = rank_map(order, pipe, data, model)
    assert sorted(mapping) == sorted(itertools.product(range(pipe), range(data), range(model)))
    for rank in range(world):
        topo = Topology(pipe, data, model, rank, order)
        assert topo.rank_of(topo.data_rank, topo.stage, topo.model_rank) == rank
        for groups, axis in ((topo.pipe_groups(), 0), (topo.data_groups(), 1),
                             (topo.model_groups(), 2)):
            assert sorted(r for g in groups for r in g) == list(range(world))
            mine = [g for g in groups if rank in g]
            assert len(mine) == 1
            # members differ from this rank only along the group's axis
            coords = [rank_map(order, pipe, data, model)[r] for r in mine[0]]
            other = [i for i in range(3) if i != axis]
            assert {tuple(c[i] for i in other) for c in coords} == \
                {tuple(mapping[rank][i] for i in other)}
    # the innermost axis varies fastest
    inner = parse_rank_order(order)[0]
    index = {"pp": 0, "dp": 1, "tp": 2}[inner]
    size = sizes[index]
    assert [mapping[r][index] for r in range(size)] == list(range(size))


def test_without_data_or_tensor_parallelism_rank_is_stage_in_every_order():
    for order in ("tp-dp-pp", "tp-pp-dp", "pp-tp-dp", "dp-tp-pp"):
        assert [s for s, _, _ in rank_map(order, 4)] == [0, 1, 2, 3]


def test_bad_orders_say_how_to_fix():
    for bad in ("tp-dp", "tp-dp-dp", "tp-dp-pp-xx", "model-data-pipe", 3):
        with pytest.raises(pk.ConfigError, match="how to fix"):
            parse_rank_order(bad)  # type: ignore[arg-type]
    with pytest.raises(pk.ConfigError, match="tensor-parallel"):
        Topology.from_world(6, 0, 2, model_size=2)


def test_two_node_example_keeps_tensor_and_data_groups_inside_a_node():
    # 2 nodes x 4 GPUs: 2 stages x 2 replicas x 2 TP
    topo = Topology(2, 2, 2, 0)
    node = [r // 4 for r in range(8)]
    for groups in (topo.model_groups(), topo.data_groups()):
        assert all(len({node[r] for r in g}) == 1 for g in groups)
    assert all(len({node[r] for r in g}) == 2 for g in topo.pipe_groups())
    lines = format_rank_map(topo, ranks_per_node=4)
    assert lines[5] == "rank 5: stage 1, replica 0, tp 1 (node 1)"


def test_a_world_size_error_names_every_rule_it_breaks():
    """Fixing the one rule an error named used to uncover the next (issue 43)."""
    with pytest.raises(ConfigError) as info:
        Topology.from_world(6, 0, 4, data_parallel_size=2)
    text = str(info.value)
    assert "world size 6 is not divisible by 4 pipeline stages; and data_parallel_size=2 " \
           "does not match world size 6: it needs 8 processes (4 stages x 2 replica(s))" in text
    assert "how to fix: launch 8 processes" in text
    with pytest.raises(ConfigError) as info:
        Topology.from_world(6, 0, 4, data_parallel_size=2, shard_size=2)
    assert str(info.value).count("; and ") == 2  # stages, shards and replicas: all three
    assert "data_parallel_shard=2 needs a multiple of 8 processes" in str(info.value)
    assert world_size_rules(8, 2, 4) == []
    assert world_size_rules(8, 2, None, model_size=2, shard_size=2) == []
    assert world_size_rules(8, 0, None) == ["num_stages=0 must be >= 1"]
