"""``pipekernel.deepspeed``'s surface besides the loop, against DeepSpeed 0.19's meaning:
topologies and the grid, ``add_config_arguments``, ``log_dist``, the config keys accepted
with no effect (logged once), the engine's step and rank queries, ``set_batch_fn``, and
activation checkpointing over in-place layers (DeepSpeed's choice of runs to recompute).
"""
from __future__ import annotations

import argparse
import logging

import pytest
import torch
from torch import nn

from pipekernel.deepspeed import config as dsconfig
from pipekernel.deepspeed import topology as topo
from pipekernel.errors import ConfigError
from pipekernel.testing import run_ranks

from deepspeed_support import deepspeed_or_skip


_deepspeed = deepspeed_or_skip


TOPOLOGIES = [("ProcessTopology", (["x", "y"], [2, 3])),
              ("ProcessTopology", (["pipe", "data", "model"], [2, 2, 2])),
              ("PipeDataParallelTopology", (3, 2)),
              ("PipeModelDataParallelTopology", (2, 2, 3))]


@pytest.mark.parametrize("name,args", TOPOLOGIES)
def test_topology_answers_as_deepspeeds(name, args):
    """DeepSpeed itself: every query of every rank."""
    _deepspeed()
    from deepspeed.runtime.pipe import topology as theirs
    ours_t, theirs_t = getattr(topo, name)(*args), getattr(theirs, name)(*args)
    axes = theirs_t.get_axis_names()
    assert ours_t.get_axis_names() == axes and ours_t.world_size() == theirs_t.world_size()
    for axis in axes + ["nope"]:
        assert ours_t.get_dim(axis) == theirs_t.get_dim(axis)
        assert ours_t.get_axis_comm_lists(axis) == theirs_t.get_axis_comm_lists(axis)
    for rank in range(theirs_t.world_size()):
        coord = theirs_t.get_coord(rank)
        assert tuple(ours_t.get_coord(rank)) == tuple(coord)
        assert ours_t.get_rank(**coord._asdict()) == rank
        assert ours_t.get_rank_repr(rank) == theirs_t.get_rank_repr(rank)
        assert ours_t.get_rank_repr(rank, omit_axes=[]) == theirs_t.get_rank_repr(rank, [])
    for axis in axes:
        for i in range(theirs_t.get_dim(axis)):
            assert ours_t.get_axis_list(axis, i) == theirs_t.get_axis_list(axis, i)
            assert ours_t.filter_match(**{axis: i}) == theirs_t.filter_match(**{axis: i})


def test_topologies_pipekernel_cannot_run_are_refused_by_name():
    assert topo.check_topology(topo.PipeModelDataParallelTopology(2, 1, 2), 4) == (2, 2)
    with pytest.raises(ConfigError, match="one model-parallel rank"):
        topo.check_topology(topo.PipeModelDataParallelTopology(2, 2, 1), 4)
    with pytest.raises(ConfigError, match="rank 1 at stage 1, replica 0; pipekernel runs"):
        topo.check_topology(topo.ProcessTopology(["data", "pipe"], [2, 2]), 4)
    with pytest.raises(ConfigError, match="2 x 2 ranks and the world has 8"):
        topo.check_topology(topo.PipeDataParallelTopology(2, 2), 8)
    with pytest.raises(ConfigError, match="must be a ProcessTopology"):
        topo.check_topology("pipe", 4)


def test_add_config_arguments_is_deepspeeds():
    deepspeed = _deepspeed()
    import pipekernel.deepspeed as ours
    argv = ["--deepspeed", "--deepspeed_config", "ds.json"]
    for module in (ours, deepspeed):
        args = module.add_config_arguments(argparse.ArgumentParser()).parse_args(argv)
        assert vars(args) == {"deepspeed": True, "deepspeed_config": "ds.json",
                              "deepscale": False, "deepscale_config": None}
    from pipekernel.deepspeed import _config_of
    args = argparse.Namespace(deepspeed_config="a.json", deepscale_config=None)
    assert _config_of(args, None, None) == "a.json"
    assert _config_of(argparse.Namespace(deepscale_config="old.json"), None, None) == "old.json"
    with pytest.raises(ConfigError, match="in the deepspeed arguments and deepspeed.initialize"):
        _config_of(args, {"train_batch_size": 2}, None)


def test_log_dist_logs_on_the_ranks_named(caplog):
    from pipekernel.deepspeed.utils import log_dist
    with caplog.at_level(logging.INFO, logger="DeepSpeed"):
        log_dist("hello", ranks=[0])  # no process group: every process logs
    assert caplog.messages == ["[Rank -1] hello"]


def test_no_effect_keys_are_logged_once(caplog):
    from pipekernel.deepspeed import config_keys
    config_keys._noted.discard("csv_monitor")
    config = {"train_micro_batch_size_per_gpu": 2, "csv_monitor": {"enabled": False}}
    with caplog.at_level(logging.INFO, logger="pipekernel.deepspeed"):
        for _ in range(2):
            dsconfig.parse(config, world_size=1, num_stages=1)
    assert [m for m in caplog.messages if "'csv_monitor'" in m] == [
        "DeepSpeed config key 'csv_monitor' accepted with no effect in pipekernel: disabled"]


CALLS = [0]


class CountingLinear(nn.Linear):
    """Counts its forward passes (a recomputation is one more)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CALLS[0] += 1
        return super().forward(x)


def _layers(pipe) -> list:
    """In-place ReLUs between linears (DeepSpeed runs them under checkpointing)."""
    return [pipe.LayerSpec(CountingLinear, 8, 8), pipe.LayerSpec(nn.ReLU, inplace=True),
            pipe.LayerSpec(CountingLinear, 8, 8), pipe.LayerSpec(nn.ReLU, inplace=True),
            pipe.LayerSpec(CountingLinear, 8, 8), pipe.LayerSpec(nn.ReLU, inplace=True),
            pipe.LayerSpec(CountingLinear, 8, 8)]


def _train(interval: int, config: dict | None = None, batch_fn=None, double: bool = False,
           **module_kw) -> dict:
    import pipekernel.deepspeed as deepspeed
    from pipekernel.deepspeed import pipe
    torch.manual_seed(0)
    model = pipe.PipelineModule(_layers(pipe), num_stages=2, partition_method="uniform",
                                loss_fn=nn.functional.mse_loss,
                                activation_checkpoint_interval=interval, **module_kw)
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, generator=gen) * (2 if double else 1), torch.randn(8, generator=gen))
            for _ in range(16)]
    engine, optimizer, _, _ = deepspeed.initialize(model=model, training_data=data, config={
        "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1e9,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, **(config or {})})
    seen = []
    optimizer.register_step_pre_hook(lambda *_: seen.append(engine.is_gradient_accumulation_boundary()))
    if batch_fn is not None:
        engine.set_batch_fn(batch_fn)
    before = engine.was_step_applied()
    CALLS[0] = 0
    losses = [float(engine.train_batch()) for _ in range(2)]
    calls = CALLS[0]
    try:
        engine.module_state_dict()
        refused = ""
    except ConfigError as err:
        refused = str(err)
    engine.reset_activation_shape()
    return {"losses": losses, "params": {k: v.clone() for k, v in model.state_dict().items()},
            "boundary": (seen, engine.is_gradient_accumulation_boundary()),
            "applied": (before, engine.was_step_applied()), "norm": engine.get_global_grad_norm(),
            "refused": refused, "fp16": engine.fp16_enabled(), "calls": calls}


def _surface_worker() -> dict:
    plain = _train(0)
    return {"plain": plain, "every_layer": _train(1),
            "from_config": _train(0, {"pipeline": {"activation_checkpoint_interval": 1}}),
            "linear_only": _train(1, checkpointable_layers=["CountingLinear"]),
            "seeded": _train(1, seed_layers=True), "seeded_plain": _train(0, seed_layers=True),
            "none_listed": _train(2, checkpointable_layers=["Conv2d"]),
            "batch_fn": _train(0, batch_fn=lambda b: (b[0] * 2, b[1])),
            "doubled": _train(0, double=True)}


@pytest.fixture(scope="module")
def surface_run() -> list[dict]:
    return run_ranks(_surface_worker, 2)


def test_checkpointing_every_layer_runs_in_place_relus_and_changes_nothing(surface_run):
    """``activation_checkpoint_interval=1`` (as module argument or config) over in-place
    ReLUs: DeepSpeed recomputes only runs with parameters, and so does pipekernel now;
    the losses and weights are those of no checkpointing."""
    for got in surface_run:
        plain = got["plain"]
        for name in ("every_layer", "from_config", "linear_only", "none_listed"):
            assert got[name]["losses"] == pytest.approx(plain["losses"], abs=1e-7), name
            for key, value in plain["params"].items():
                torch.testing.assert_close(got[name]["params"][key], value, rtol=0, atol=1e-7)
        assert got["seeded"]["losses"] == pytest.approx(got["seeded_plain"]["losses"], abs=1e-7)
        # 2 linears per stage x 4 micro-batches x 2 steps, once more when recomputed
        assert plain["calls"] == got["none_listed"]["calls"] == 16
        for name in ("every_layer", "from_config", "linear_only", "seeded"):
            assert got[name]["calls"] == 32, name


def test_step_queries_mean_what_deepspeeds_do(surface_run):
    for rank, got in enumerate(surface_run):
        plain = got["plain"]
        assert plain["boundary"] == ([True, True], False)  # only inside the step
        assert plain["applied"] == (False, True)
        assert plain["norm"] > 0 and plain["norm"] == surface_run[0]["plain"]["norm"]
        assert "called from save_checkpoint()" in plain["refused"] and not plain["fp16"]


def test_set_batch_fn_maps_every_batch(surface_run):
    for got in surface_run:
        assert got["batch_fn"]["losses"] == got["doubled"]["losses"]
        assert got["batch_fn"]["losses"] != got["plain"]["losses"]
