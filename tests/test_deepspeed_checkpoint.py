"""``pipekernel.deepspeed``'s ``save_checkpoint`` at more than one stage: it resumes
bit-exactly in pipekernel, and writes DeepSpeed's own layout beside pipekernel's so that
DeepSpeed's engine loads it (``layer_XX-model_states.pt``, ``mp_rank_XX_model_states.pt``).

What DeepSpeed saved loads in pipekernel at any stage count:
``tests/test_deepspeed.py::test_deepspeed_checkpoint_loads_at_any_stage_count`` (the
fixture DeepSpeed 0.19.8 wrote with the same script at 2 stages).
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

from pipekernel.testing import run_ranks

from deepspeed_support import FIXTURES, deepspeed_or_skip

sys.path.insert(0, str(FIXTURES))
import gpt_script  # noqa: E402


_deepspeed = deepspeed_or_skip


def _layers(pipe) -> list:
    """A tied embedding, an in-place ReLU and dropout drawn from the global RNG (no
    ``seed_layers``: a bit-exact resume needs the RNG states restored)."""
    dim = gpt_script.DIM
    return [pipe.TiedLayerSpec("embed", nn.Embedding, gpt_script.VOCAB, dim),
            pipe.LayerSpec(nn.Linear, dim, dim), pipe.LayerSpec(nn.ReLU, inplace=True),
            pipe.LayerSpec(nn.Dropout, 0.2), pipe.LayerSpec(nn.Linear, dim, dim),
            pipe.TiedLayerSpec("embed", nn.Embedding, gpt_script.VOCAB, dim,
                               forward_fn=gpt_script.head)]


def _batches(count: int) -> list:
    data = gpt_script.dataset()
    micro = [(torch.stack([x for x, _ in data[i:i + 2]]), torch.stack([y for _, y in data[i:i + 2]]))
             for i in range(0, len(data), 2)]
    return [micro[4 * b:4 * b + 4] for b in range(count)]


def _engine(stages: int):
    import pipekernel.deepspeed as deepspeed
    from pipekernel.deepspeed import pipe
    torch.manual_seed(5)
    model = pipe.PipelineModule(_layers(pipe), num_stages=stages, loss_fn=gpt_script.loss_fn,
                                partition_method="uniform")
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=gpt_script.config(0.5))
    return engine


def _resume_worker(root: str) -> dict:
    """2 stages: 4 steps straight; 2 steps, save, a new engine loads, 2 more steps."""
    batches = _batches(4)
    torch.manual_seed(11)
    straight = _engine(2)
    losses = [float(straight.train_batch(iter(b))) for b in batches]
    torch.manual_seed(11)
    first = _engine(2)
    before = [float(first.train_batch(iter(b))) for b in batches[:2]]
    first.save_checkpoint(root, client_state={"note": "mine"})
    torch.manual_seed(99)  # the load restores the RNG states
    second = _engine(2)
    path, client = second.load_checkpoint(root)
    after = [float(second.train_batch(iter(b))) for b in batches[2:]]
    return {"straight": losses, "resumed": before + after, "client": client,
            "path": os.path.basename(path), "steps": second.global_steps}


def test_save_at_two_stages_resumes_bit_exactly(tmp_path):
    ranks = run_ranks(_resume_worker, 2, str(tmp_path))
    for got in ranks:
        assert got["resumed"] == got["straight"]  # bit-exact: RNG, optimizer, schedule
        assert (got["client"], got["path"], got["steps"]) == ({"note": "mine"},
                                                              "global_step2", 4)
    names = set(os.listdir(tmp_path / "global_step2"))
    # DeepSpeed's layout beside pipekernel's: [0, 3, 6] holds the embedding at layer 0,
    # Linear, ReLU (stage 0); Dropout, Linear (stage 1: the head is a forward_fn)
    assert {n for n in names if n.startswith(("layer_", "mp_rank_"))} == {
        "layer_00-model_states.pt", "layer_01-model_states.pt", "layer_02-model_states.pt",
        "layer_03-model_states.pt", "layer_04-model_states.pt",
        "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"}
    assert "meta.json" in names


def _save_worker(root: str) -> dict:
    return gpt_script.run("pipekernel", 2, 2, save=root, clip=0.0)


def _resume_gpt_worker(root: str) -> dict:
    return gpt_script.run("pipekernel", 2, 2, load=root, clip=0.0)


def test_deepspeed_loads_what_pipekernel_saved(tmp_path):
    """DeepSpeed itself at 2 stages loads pipekernel's 2-stage save: the same weights (eval),
    and the same next two steps as pipekernel resuming its own files (optimizer state,
    LR schedule, counters); the files are those DeepSpeed writes for the same script."""
    _deepspeed()
    saved = run_ranks(_save_worker, 2, str(tmp_path))[0]
    ours = run_ranks(_resume_gpt_worker, 2, str(tmp_path))[0]
    theirs = gpt_script.launch("deepspeed", 2, 2, 2, load=str(tmp_path), clip=0.0)
    assert theirs["loaded_eval"] == pytest.approx(saved["eval"], abs=1e-6)
    assert theirs["losses"] == pytest.approx(ours["losses"], abs=1e-6)
    assert theirs["eval"] == pytest.approx(ours["eval"], abs=1e-6)
    assert theirs["global_steps"] == ours["global_steps"] == 4
    mine, ds = tmp_path / "step2", FIXTURES / "ckpt" / "step2"
    ds_names = sorted(os.listdir(ds))
    assert sorted(n for n in os.listdir(mine) if n.startswith(("layer_", "mp_rank_"))) == ds_names
    for name in ds_names:
        a, b = (torch.load(d / name, map_location="cpu", weights_only=False) for d in (mine, ds))
        if name.startswith("layer_"):
            assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()}
            continue
        assert set(a) == set(b), name
        for key in ("global_steps", "global_samples", "dp_world_size", "mp_world_size",
                    "checkpoint_parallel_dimensions", "lr_scheduler", "note"):
            assert a[key] == b[key], (name, key)
        shapes = [{i: {k: v.shape for k, v in state.items()} for i, state in s.items()}
                  for s in (a["optimizer"]["state"], b["optimizer"]["state"])]
        assert shapes[0] == shapes[1] and \
            [g["params"] for g in a["optimizer"]["param_groups"]] == \
            [g["params"] for g in b["optimizer"]["param_groups"]]


def _bf16_worker(root: str) -> str:
    """2 stages x 2 replicas under bf16: one step, a refused client state, a save."""
    import pipekernel.deepspeed as deepspeed
    from pipekernel.deepspeed import pipe
    from pipekernel.errors import ConfigError
    torch.manual_seed(5)
    model = pipe.PipelineModule(_layers(pipe), num_stages=2, loss_fn=gpt_script.loss_fn,
                                partition_method="uniform")
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(),
        config={**gpt_script.config(0.5), "bf16": {"enabled": True}})
    engine.train_batch(iter(_batches(1)[0]))
    try:
        engine.save_checkpoint(root, client_state={"checkpoint_parallel_dimensions": 1})
        refused = ""
    except ConfigError as err:
        refused = str(err)
    engine.save_checkpoint(root, tag="t")
    return refused


def test_deepspeed_layout_under_bf16_with_replicas(tmp_path):
    """Replica 0 of each stage writes DeepSpeed's files; the weights are the fp32 masters
    pipekernel saved; the optimizer entry is None (DeepSpeed's bf16 optimizer has its own
    format: it loads with load_optimizer_states=False); DeepSpeed's reserved client key is
    refused before anything is written."""
    refused = run_ranks(_bf16_worker, 4, str(tmp_path))
    assert all("reserved checkpoint key: checkpoint_parallel_dimensions" in r for r in refused)
    assert sorted(os.listdir(tmp_path)) == ["latest", "t"]
    tag = tmp_path / "t"
    for stage in (0, 1):
        state = torch.load(tag / f"mp_rank_{stage:02d}_model_states.pt", weights_only=False)
        assert state["optimizer"] is None and state["global_steps"] == 1
        assert (state["dp_world_size"], state["mp_world_size"], state["global_samples"]) == \
            (2, 2, 8)
    for index in range(5):
        ds = torch.load(tag / f"layer_{index:02d}-model_states.pt")
        ours = torch.load(tag / f"layer-{index:05d}.pt")["state"] if index in (0, 1, 4) \
            else {}
        assert all(v.dtype == torch.float32 for v in ds.values())
        for key, value in ours.items():
            torch.testing.assert_close(ds[key], value, rtol=0, atol=0)


def test_deepspeed_optimizer_state_of_several_groups_is_refused(tmp_path):
    """DeepSpeed numbers a stage's parameters group by group in the script's order, which
    its checkpoint does not record: mapping them in module order could swap same-shaped
    tensors silently, so the optimizer state is refused by name (the weights load)."""
    import shutil

    from pipekernel.deepspeed import convert, pipe
    from pipekernel.errors import ConfigError
    module = pipe.PipelineModule(gpt_script.layers(pipe), num_stages=1,
                                 loss_fn=gpt_script.loss_fn, partition_method="uniform")
    ckpt = tmp_path / "ds"
    shutil.copytree(FIXTURES / "ckpt", ckpt)
    stage0 = ckpt / "step2" / "mp_rank_00_model_states.pt"
    saved = torch.load(stage0, weights_only=False)
    group = saved["optimizer"]["param_groups"][0]
    saved["optimizer"]["param_groups"] = [{**group, "params": group["params"][:3]},
                                          {**group, "params": group["params"][3:],
                                           "weight_decay": 0.0}]
    torch.save(saved, stage0)
    with pytest.raises(ConfigError, match="stage 0 has 2 param groups") as err:
        convert(ckpt, tmp_path / "a", module=module)
    assert "load_optimizer_states=False" in str(err.value)
    convert(ckpt, tmp_path / "b", module=module, optimizer=False)
