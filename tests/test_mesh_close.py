"""``engine.close()`` destroys the process groups its DeviceMesh created (issue 28): they
leave torch.distributed's registry, no gloo thread of theirs is left while the closed
engine is still referenced, and a second engine trains in the same world like one
process."""
from __future__ import annotations

import os

import pytest
import torch
from models import adam, mlp, mlp_data

import pipekernel as pk
from pipekernel.testing import reference_train, run_ranks

MB, STEPS = 4, 2


def _gloo_threads():
    """How many of this process's threads are gloo's (Linux names them; else ``None``)."""
    if not os.path.isdir("/proc/self/task"):
        return None
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return sum("gloo" in name for name in names)


def _registered():
    """The process groups torch.distributed knows (``_world``: the group map and names)."""
    from torch.distributed import distributed_c10d as c10d

    return set(c10d._world.pg_map) | set(c10d._world.pg_names)


def _train(engine, seed):
    rank = engine.data_parallel_rank
    return [engine.train_batch(iter(mlp_data(seed + step, rank, MB))).item()
            for step in range(STEPS)]


def close_worker(host_owned, stages, replicas, shard):
    """Two engines one after the other in one world: the first's mesh groups are gone
    after its close; the second trains from the same weights on other batches."""
    import weakref

    import torch.distributed as dist

    torch.set_num_threads(1)
    if host_owned:  # the host's world: the default group outlives both engines
        dist.init_process_group("gloo", init_method=os.environ["PIPEKERNEL_INIT_METHOD"],
                                rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
        dist.barrier()  # gloo starts a group's threads on its first collective
    before = _registered()
    base = _gloo_threads()  # the host's default group's, or none
    kw = dict(micro_batches=MB, data_parallel_size=replicas, data_parallel_shard=shard,
              timeout=120)
    first = pk.PipelineEngine(mlp(num_stages=stages), optimizer=adam, **kw)
    mesh_groups = [g for g in _registered() - before]
    created = len(mesh_groups)
    refs = [weakref.ref(g) for g in mesh_groups]
    del mesh_groups
    losses = _train(first, 0)
    first.close()
    left = {g.group_name for g in _registered() - before}
    # the closed engine is still referenced: its mesh, FSDP2 and groups must let go anyway
    alive = sum(ref() is not None for ref in refs)
    threads = _gloo_threads()
    second = pk.PipelineEngine(mlp(num_stages=stages), optimizer=adam, **kw)
    losses += _train(second, 100)
    state = {name: (value.full_tensor() if hasattr(value, "full_tensor") else value)
             .detach().clone() for name, value in second.module.state_dict().items()}
    second.close()
    return {"created": created, "left": left, "alive": alive, "base": base,
            "threads": threads, "losses": losses, "state": state}


@pytest.mark.parametrize("host_owned,stages,replicas,shard", [
    (True, 2, 1, 2),    # PP2 x FSDP2 in a world the host made
    (False, 1, 2, 2),   # HSDP (2 replicas x 2 shards): the transport's world
])
def test_close_destroys_the_mesh_groups_and_a_second_engine_trains(host_owned, stages,
                                                                   replicas, shard):
    results = run_ranks(close_worker, 4, host_owned, stages, replicas, shard)
    data = replicas * shard
    ref = [reference_train(mlp(num_stages=1), adam,
                           [[mlp_data(seed + step, r, MB) for r in range(data)]
                            for step in range(STEPS)], MB) for seed in (0, 100)]
    for rank, result in enumerate(results):
        assert result["created"] > 0, "the mesh created no group of its own"
        assert result["left"] == set(), f"rank {rank}: still registered: {result['left']}"
        assert result["alive"] == 0, f"rank {rank}: {result['alive']} groups not freed"
        if result["threads"] is not None:  # gloo joins a group's threads when it is freed
            assert result["threads"] == result["base"], result
        assert result["losses"] == pytest.approx(ref[0][0] + ref[1][0], rel=1e-5, abs=1e-6)
        for name, value in result["state"].items():
            torch.testing.assert_close(value, ref[1][1][name], rtol=1e-5, atol=1e-6)


def tied_close_worker(shard):
    """In the host's world: a tied-layer engine's close leaves no group of its own (the
    tied groups come from ``transport.new_group``), keeps the host's, and ``engine.mesh``
    after it raises instead of handing back a mesh over destroyed groups."""
    import torch.distributed as dist
    from models import token_data, tied_lm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=os.environ["PIPEKERNEL_INIT_METHOD"],
                            rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))
    before = _registered()
    engine = pk.PipelineEngine(tied_lm(num_stages=2), optimizer=adam, micro_batches=MB,
                               data_parallel_size=2 // shard, data_parallel_shard=shard,
                               timeout=120)
    created = len(_registered() - before)
    engine.train_batch(iter(token_data(0, engine.data_parallel_rank, MB)))
    had_mesh = engine.mesh is not None
    engine.close()
    left = {g.group_name for g in _registered() - before}
    try:
        engine.mesh
        error = None
    except pk.ConfigError as exc:
        error = str(exc)
    kept = _registered() >= before and dist.is_initialized()
    dist.destroy_process_group()
    return {"created": created, "left": left, "had_mesh": had_mesh, "error": error,
            "kept": kept}


@pytest.mark.parametrize("shard", [1, 2])
def test_close_destroys_the_tied_groups_in_the_host_world(shard):
    for rank, result in enumerate(run_ranks(tied_close_worker, 4, shard)):
        assert result["created"] > 0, result
        assert result["left"] == set(), f"rank {rank}: still registered: {result['left']}"
        assert result["kept"], f"rank {rank}: a host group was destroyed"
        if result["had_mesh"]:
            assert "after engine.close()" in result["error"], result
        else:
            assert result["error"] is None, result
