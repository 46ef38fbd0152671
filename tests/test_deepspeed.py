"""``pipekernel.deepspeed``: a DeepSpeed pipeline script runs unchanged and gives
DeepSpeed's losses; DeepSpeed's checkpoints load at any stage count; the config is read
as DeepSpeed reads it, and what is not implemented is refused by name.

Tests marked "DeepSpeed itself" compare with the installed ``deepspeed`` (CPU accelerator,
no ops built) and skip cleanly without it; the rest need no DeepSpeed. The checkpoint
fixture ``tests/fixtures/deepspeed/ckpt`` and ``expected.json`` were written by DeepSpeed
0.19.8 (``tests/fixtures/deepspeed/make_checkpoint.py``).
"""
from __future__ import annotations

import json
import os
import sys
import warnings

import pytest
import torch

import pipekernel as pk
from pipekernel.deepspeed import config as dsconfig
from pipekernel.deepspeed import lr_schedules, optimizers, pipe
from pipekernel.errors import ConfigError
from pipekernel.testing import run_ranks

from deepspeed_support import FIXTURES, deepspeed_or_skip

sys.path.insert(0, str(FIXTURES))
import gpt_script  # noqa: E402

EXPECTED = json.loads((FIXTURES / "expected.json").read_text())


_deepspeed = deepspeed_or_skip


def _parse(extra: dict, world: int = 1, stages: int = 1, **kw) -> dsconfig.Settings:
    return dsconfig.parse({"train_micro_batch_size_per_gpu": 2, **extra}, world_size=world,
                          num_stages=stages, **kw)


# -- the config --------------------------------------------------------------------------

UNSUPPORTED = [
    ({"amp": {"enabled": True}}, "'amp'"),
    ({"activation_checkpointing": {"partition_activations": True, "overlap": True}},
     "'activation_checkpointing' (unknown key(s) ['overlap'])"),
    ({"flops_profiler": {"enabled": True}}, "'flops_profiler' (enabled"),
    ({"tensorboard": {"enabled": True}}, "'tensorboard' (enabled"),
    ({"wandb": {"enabled": True, "project": "p"}}, "'wandb' (enabled"),
    ({"comms_logger": {"enabled": True}}, "'comms_logger' (enabled"),
    ({"prescale_gradients": True}, "'prescale_gradients' (only its default (False)"),
    ({"gradient_predivide_factor": 2.0}, "'gradient_predivide_factor' (only its default"),
    ({"communication_data_type": "fp16"}, "'communication_data_type' (pipekernel reduces"),
    ({"data_types": {"grad_accum_dtype": "fp32"}}, "'data_types'"),
    ({"memory_breakdown": True}, "'memory_breakdown' (only its default (False)"),
    ({"checkpoint": {"tag_validation": "Warn"}}, "'checkpoint'"),
    ({"fp16": {"enabled": True, "auto_cast": True}}, "'fp16.auto_cast'"),
    ({"fp16": {"enabled": True, "consecutive_hysteresis": True}},
     "'fp16.consecutive_hysteresis'"),
    ({"bf16": {"enabled": True, "immediate_grad_update": True}},
     "'bf16.immediate_grad_update'"),
    ({"zero_optimization": {"stage": 1, "load_from_fp32_weights": False}},
     "'zero_optimization.load_from_fp32_weights' (only its default (True)"),
    ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}},
     "'zero_optimization.offload_optimizer'"),
    ({"pipeline": {"overlap": True}}, "'pipeline.overlap'"),
    ({"optimizer": {"type": "AdamW", "params": {}, "legacy_fusion": False}},
     "'optimizer.legacy_fusion'"),
]


@pytest.mark.parametrize("extra,name", UNSUPPORTED,
                         ids=[n.split(" ")[0].strip("'") for _, n in UNSUPPORTED])
def test_an_unimplemented_key_errors_by_name(extra, name):
    with pytest.raises(ConfigError) as err:
        _parse(extra)
    assert name in str(err.value)


def test_pipe_partitioned_true_is_refused_with_tensor_parallelism_only():
    """DeepSpeed partitions activations between stages under tensor parallelism; the
    DTensor path sends them whole, so an explicit ``true`` is refused there by name."""
    for flags in ({"pipe_partitioned": True}, {"grad_partitioned": True}):
        settings = _parse({"pipeline": flags})
        dsconfig.check_partitioned(settings, 1)  # no tensor parallelism: nothing to do
        with pytest.raises(ConfigError, match="pipe_partitioned/grad_partitioned is true "
                                              "with tensor_parallel_size=2"):
            dsconfig.check_partitioned(settings, 2)
    for extra in ({}, {"pipeline": {"pipe_partitioned": False, "grad_partitioned": False}}):
        dsconfig.check_partitioned(_parse(extra), 2)  # absent (DeepSpeed's default) or false


def test_unimplemented_keys_are_named_together_or_warned_with_the_option():
    with pytest.raises(ConfigError) as err:
        _parse({"amp": {"enabled": True}, "elasticity": {"enabled": True}})
    assert "'amp'" in str(err.value) and "'elasticity'" in str(err.value)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        settings = _parse({"amp": {"enabled": True}}, unsupported="warn")
    assert settings.micro_batches == 1 and any("'amp'" in str(w.message) for w in seen)


#: (config, the refused key's words): a typo gets the closest key, nested ones included
TYPOS = [
    ({"train_micro_batch_size_per_gpus": 2}, "'train_micro_batch_size_per_gpus' (not a key "
     "pipekernel.deepspeed knows: did you mean 'train_micro_batch_size_per_gpu'?)"),
    ({"gradient_clippin": 1.0}, "did you mean 'gradient_clipping'?"),
    ({"zero_optimization": {"stage": 1, "reduce_bucket_sise": 5}},
     "'zero_optimization.reduce_bucket_sise' (not a key pipekernel.deepspeed knows: did you "
     "mean 'reduce_bucket_size'?)"),
    ({"fp16": {"enabled": True, "loss_scale_windo": 100}}, "did you mean 'loss_scale_window'?"),
    ({"pipeline": {"activation_checkpoint_intervall": 1}},
     "did you mean 'activation_checkpoint_interval'?"),
    ({"optimizer": {"type": "AdamW", "param": {}}}, "'optimizer.param' (not a key "
     "pipekernel.deepspeed knows: did you mean 'params'?)"),
]


@pytest.mark.parametrize("extra,words", TYPOS, ids=[w.split("'")[1] for _, w in TYPOS])
def test_a_mistyped_key_gets_the_key_it_resembles(extra, words):
    with pytest.raises(ConfigError) as err:
        _parse(extra)
    assert words in str(err.value)


@pytest.mark.parametrize("extra,why", [
    ({"train_batch_size": 8, "train_micro_batch_size_per_gpus": 4}, "it sets the batch size"),
    ({"gradient_accumulation_step": 4}, "it sets the batch size"),
    ({"elasticity": {"enabled": True, "max_train_batch_size": 64}},
     "it changes the batch size as the world changes"),
    ({"data_efficiency": {"enabled": True}}, "it chooses which samples")])
def test_warn_never_drops_a_key_that_changes_the_batch(extra, why):
    """``unsupported='warn'`` would have trained on micro-batches of 2 (the default the
    test's config gives) where the config asked for 4: refused, saying why."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning either: an error
        with pytest.raises(ConfigError) as err:
            _parse(extra, world=2, unsupported="warn")
    text = str(err.value)
    assert "unsupported='warn' does not drop these: without them a batch would not be what " \
           "the config says" in text and why in text
    # other keys are still only warned about, and named with it
    with pytest.raises(ConfigError) as err:
        _parse({**extra, "checkpoint": {}}, world=2, unsupported="warn")
    assert "'checkpoint'" in str(err.value) and "drops only the others" in str(err.value)


def test_every_batch_key_deepspeed_defines_is_implemented_or_never_dropped():
    """DeepSpeed itself: its constants name the keys; each one that is about batches or
    gradient accumulation is implemented here or refused even with unsupported='warn'."""
    _deepspeed()
    from deepspeed.runtime import constants
    keys = {v for v in vars(constants).values() if isinstance(v, str) and v.isidentifier()
            and ("batch" in v or "accumulation" in v)}
    assert {"train_batch_size", "train_micro_batch_size_per_gpu",
            "gradient_accumulation_steps"} <= keys
    from pipekernel.deepspeed import config_keys
    for key in keys - set(dsconfig.SUPPORTED_KEYS):
        assert config_keys.changes_batch(key), key


#: (config, data-parallel size, DeepSpeed's result or its error message)
BATCHES = [
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}, 2, (16, 2, 4)),
    ({"train_batch_size": 16, "gradient_accumulation_steps": 2}, 2, (16, 4, 2)),
    ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5}, 2, (30, 3, 5)),
    ({"train_batch_size": 8}, 4, (8, 2, 1)),
    ({"train_micro_batch_size_per_gpu": 4}, 3, (12, 4, 1)),
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2,
      "gradient_accumulation_steps": 2}, 2,
     "Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu "
     "* gradient_acc_step * world_size 10 != 2 * 2 * 2"),
    ({"train_batch_size": 3, "train_micro_batch_size_per_gpu": 2}, 1,
     "Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu "
     "* gradient_acc_step * world_size 3 != 2 * 1 * 1"),
    ({"train_batch_size": 2, "train_micro_batch_size_per_gpu": 4}, 1,
     "Gradient accumulation steps: 0 has to be greater than 0"),
    ({"gradient_accumulation_steps": 2}, 1,
     "Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided"),
]


@pytest.mark.parametrize("config,dp,expected", BATCHES)
def test_batch_size_arithmetic_is_deepspeeds(config, dp, expected):
    if isinstance(expected, str):
        with pytest.raises(ConfigError) as err:
            dsconfig.batch_sizes(config, dp)
        assert err.value.message == expected
    else:
        assert dsconfig.batch_sizes(config, dp) == expected
        settings = dsconfig.parse(config, world_size=dp * 2, num_stages=2)
        assert settings.micro_batches == expected[2]  # the world is stages x replicas


def test_batch_size_errors_are_deepspeeds_own():
    """DeepSpeed itself: its DeepSpeedConfig (one process: world size 1) fails with our text."""
    _deepspeed()
    from deepspeed.runtime.config import DeepSpeedConfig
    for config, dp, expected in BATCHES:
        if dp != 1:
            continue
        if isinstance(expected, str):
            with pytest.raises(AssertionError) as err:
                DeepSpeedConfig(dict(config))
            assert str(err.value) == expected
        else:
            ds = DeepSpeedConfig(dict(config))
            assert (ds.train_batch_size, ds.train_micro_batch_size_per_gpu,
                    ds.gradient_accumulation_steps) == expected


def test_config_maps_to_pipekernel_settings(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({
        "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
        "fp16": {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 50,
                 "hysteresis": 3, "min_loss_scale": 4},
        "steps_per_print": 10, "wall_clock_breakdown": True,
        "zero_optimization": {"stage": 1},
        "pipeline": {"activation_checkpoint_interval": 2, "use_reentrant": False}}))
    s = dsconfig.parse(str(path), world_size=4, num_stages=2)
    assert (s.micro_batches, s.precision, s.zero_stage, s.steps_per_print) == (2, "fp16", 1, 10)
    assert s.precision_options == {"init_scale": 4096.0, "growth_factor": 2.0,
                                   "backoff_factor": 0.5, "growth_interval": 50,
                                   "hysteresis": 3, "min_scale": 4.0}
    assert s.max_grad_norm == 1.0  # DeepSpeed's GRADIENT_CLIPPING_DEFAULT when absent
    assert s.activation_checkpoint_interval == 2 and s.wall_clock_breakdown
    assert _parse({"gradient_clipping": 0}).max_grad_norm is None
    assert _parse({"bf16": {"enabled": True}}).precision == "bf16"
    static = _parse({"fp16": {"enabled": True, "loss_scale": 128}}).precision_options
    assert static["init_scale"] == static["min_scale"] == 128.0
    from pipekernel.plugins.precision import LossScaler
    for options in (s.precision_options, static):  # pipekernel's scaler takes them
        LossScaler(**options)
    fixed = LossScaler(**static)
    fixed.update(True)
    fixed.update(False)
    assert fixed.scale == 128.0  # an overflow skips the step, the scale stays
    with pytest.raises(ConfigError, match="zero_optimization.stage 2"):
        _parse({"zero_optimization": {"stage": 2}})
    with pytest.raises(ConfigError, match="must divide distributed world size"):
        _parse({}, world=3, stages=2)


def test_optimizer_sections_follow_deepspeeds_rules():
    cls, kw = optimizers.from_config({"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}})
    assert cls is torch.optim.AdamW and kw == {"lr": 1e-3}  # adam_w_mode defaults to true
    cls, _ = optimizers.from_config({"type": "adam", "params": {"adam_w_mode": False}})
    assert cls is torch.optim.Adam
    cls, kw = optimizers.from_config({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}})
    assert cls is torch.optim.SGD
    with pytest.raises(ConfigError, match="gradient_clipping"):
        optimizers.from_config({"type": "AdamW", "params": {"max_grad_norm": 1.0}})
    with pytest.raises(ConfigError, match="'Lamb'"):
        optimizers.from_config({"type": "Lamb", "params": {}})
    with pytest.raises(ConfigError, match="take"):
        optimizers.from_config({"type": "AdamW", "params": {"momentum": 0.9}})
    with pytest.raises(ConfigError, match="'WarmupInverseLR'"):
        lr_schedules.build_scheduler({"type": "WarmupInverseLR", "params": {}})
    with pytest.raises(ConfigError, match="warmup_steps"):
        lr_schedules.build_scheduler({"type": "WarmupLR", "params": {"warmup_steps": 3}})


SCHEDULES = [
    ("WarmupLR", {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 7}),
    ("WarmupLR", {"warmup_max_lr": 0.01, "warmup_num_steps": 5, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 20, "warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                       "warmup_num_steps": 6}),
    ("OneCycle", {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 5,
                  "cycle_second_step_size": 7, "decay_lr_rate": 0.1, "decay_step_size": 2,
                  "cycle_min_mom": 0.85, "cycle_max_mom": 0.95, "decay_mom_rate": 0.01}),
    ("OneCycle", {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 8,
                  "cycle_first_stair_count": 3}),
    ("WarmupCosineLR", {"total_num_steps": 20, "warmup_num_steps": 5}),
    ("WarmupCosineLR", {"total_num_steps": 25, "warmup_min_ratio": 0.1, "warmup_num_steps": 6,
                        "cos_min_ratio": 0.01, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 3, "warmup_num_steps": 4}),  # no decay window
]


def test_lr_schedules_are_deepspeeds():
    """DeepSpeed itself: lr (and OneCycle's betas) at every one of 30 steps, and the state."""
    _deepspeed()
    from deepspeed.runtime import lr_schedules as theirs

    def trace(cls, params):
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.005)
        sched, seen = cls(opt, **params), []
        for _ in range(30):
            seen.append((opt.param_groups[0]["lr"], opt.param_groups[0]["betas"]))
            sched.step()
        return seen, sched.state_dict()

    for name, params in SCHEDULES:
        ours = trace(lr_schedules.SCHEDULES[name], params)
        assert ours == trace(getattr(theirs, name), params), name


def test_partition_is_deepspeeds():
    """DeepSpeed itself: uniform and balanced boundaries for assorted weights and counts."""
    _deepspeed()
    from deepspeed.runtime import utils as ds_utils
    gen = torch.Generator().manual_seed(0)
    for n in (1, 3, 7, 12):
        for parts in (1, 2, 3, 4, 5):
            weights = torch.randint(0, 9, (n,), generator=gen).tolist()
            assert pipe.partition_uniform(n, parts) == ds_utils.partition_uniform(n, parts)
            assert pipe.partition_balanced(weights, parts) == \
                [int(b) for b in ds_utils.partition_balanced(weights, parts)], (weights, parts)


def test_seed_layers_builds_each_layer_after_deepspeeds_seed():
    layers = [pipe.LayerSpec(torch.nn.Linear, 3, 3), pipe.TiedLayerSpec("t", torch.nn.Linear, 3, 3),
              pipe.LayerSpec(torch.nn.Linear, 3, 3)]
    with torch.random.fork_rng(devices=[]):
        module = pipe.PipelineModule(layers, num_stages=1, seed_layers=True, base_seed=7,
                                     partition_method="uniform")
        for i in range(3):
            pipe.set_random_seed(7 + i)
            expected = torch.nn.Linear(3, 3).weight
            built = module.tied_modules["t"] if i == 1 else getattr(module, str(i))
            assert torch.equal(built.weight, expected), i
    # DeepSpeed's parameter order: tied modules first, then the layers by index
    assert [n for n, _ in module.named_parameters()][:2] == ["tied_modules.t.weight",
                                                             "tied_modules.t.bias"]
    with pytest.raises(ConfigError, match="LayerSpec only supports torch.nn.Module types"):
        pipe.LayerSpec(lambda: None)
    with pytest.raises(ConfigError, match="topology"):
        pipe.PipelineModule(layers, num_stages=1, topology=object())


def test_steps_per_print_prints_deepspeeds_line():
    from types import SimpleNamespace

    from pipekernel.deepspeed.report import InstructionTimes, StepReport
    from pipekernel.schedules.instructions import Forward
    lines, times = [], InstructionTimes()
    report = StepReport(2, 16, times, out=lines.append)
    times.pipekernel_after_instruction(Forward(micro_batch=0), 0.25)
    for step in (1, 2):
        report.pipekernel_after_train_batch(SimpleNamespace(global_steps=step, rank=0),
                                            torch.tensor(1.5))
    assert len(lines) == 2 and lines[0].startswith("steps: 2 loss: 1.5000 iter time (s): ")
    assert "samples/sec: " in lines[0] and lines[1] == "time (s) per instruction: Forward: 0.250"


# -- a script written for DeepSpeed, run by both -------------------------------------------

def _worker() -> dict:
    """One of 4 ranks: the script from scratch at 2 stages x 2 replicas (clipping on), then
    the fixture DeepSpeed saved at 2 stages, loaded at 4, 2 and 1 stages (x 1, 2, 4
    replicas), evaluated, and trained 2 more steps."""
    scratch = gpt_script.run("pipekernel", 2, 4)
    loaded = {stages: gpt_script.run("pipekernel", stages, 2, load=str(FIXTURES / "ckpt"),
                                     clip=0.0) for stages in (4, 2, 1)}
    return {"scratch": scratch, "loaded": loaded, "built": _built_optimizer(),
            "module_only": _module_only(), "groups": _param_groups(),
            "dropout": [_dropout_run(interval) for interval in (0, 1)]}


def _param_groups() -> list:
    """Param groups given as ``model_parameters`` reach the optimizer of each stage."""
    import pipekernel.deepspeed as deepspeed
    model = pipe.PipelineModule(gpt_script.layers(pipe), num_stages=4,
                                loss_fn=gpt_script.loss_fn, partition_method="uniform")
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, config=gpt_script.config(),
        model_parameters=[{"params": decay, "weight_decay": 0.1},
                          {"params": rest, "weight_decay": 0.0}])
    return [(len(g["params"]), g["weight_decay"]) for g in optimizer.param_groups]


def _dropout_run(interval: int) -> list[float]:
    """Dropout with ``seed_layers`` at 4 stages, with and without recomputation (1F1B runs
    later forwards before a micro-batch's backward recomputes: it must reseed as its
    own forward did, or the gradients and the second loss change)."""
    import pipekernel.deepspeed as deepspeed
    specs = [pipe.LayerSpec(torch.nn.Linear, 8, 8), pipe.LayerSpec(torch.nn.Dropout, 0.5),
             pipe.LayerSpec(torch.nn.Linear, 8, 8), pipe.LayerSpec(torch.nn.Dropout, 0.5),
             pipe.LayerSpec(torch.nn.Linear, 8, 8), pipe.LayerSpec(torch.nn.Linear, 8, 8)]
    model = pipe.PipelineModule(specs, num_stages=4, loss_fn=torch.nn.functional.mse_loss,
                                partition_method="uniform", seed_layers=True,
                                activation_checkpoint_interval=interval)
    gen = torch.Generator().manual_seed(3)
    data = [(torch.randn(8, generator=gen), torch.randn(8, generator=gen)) for _ in range(16)]
    engine, _, _, _ = deepspeed.initialize(
        model=model, training_data=data, config={
            "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.5}}})
    return [float(engine.train_batch()) for _ in range(2)]

def _module_only() -> dict:
    """``load_checkpoint(load_module_only=True)``: the weights, not the counters."""
    import pipekernel.deepspeed as deepspeed
    model = pipe.PipelineModule(gpt_script.layers(pipe), num_stages=4,
                                loss_fn=gpt_script.loss_fn, partition_method="uniform")
    engine, _, _, scheduler = deepspeed.initialize(model=model, config=gpt_script.config(0.0))
    path, client = engine.load_checkpoint(str(FIXTURES / "ckpt"), load_module_only=True)
    return {"steps": engine.global_steps, "scheduler": scheduler.last_batch_iteration,
            "eval": gpt_script.evaluate(engine), "client": client,
            "path": os.path.relpath(path, FIXTURES)}


def _built_optimizer() -> dict:
    """A script that builds its optimizer and scheduler itself (4 stages, fp32): they are
    used as they are; under bf16 a built scheduler is refused with the fix."""
    import pipekernel.deepspeed as deepspeed
    model = pipe.PipelineModule(gpt_script.layers(pipe), num_stages=4,
                                loss_fn=gpt_script.loss_fn, partition_method="uniform")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, optimizer=opt, lr_scheduler=sched, training_data=gpt_script.dataset(),
        config=config)
    engine.train_batch()
    try:
        deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                             config={**config, "bf16": {"enabled": True}})
        refused = ""
    except ConfigError as err:
        refused = str(err)
    return {"same": optimizer is opt and scheduler is sched, "lr": opt.param_groups[0]["lr"],
            "refused": refused}


@pytest.fixture(scope="module")
def pipekernel_run() -> dict:
    """The script through pipekernel.deepspeed on 4 processes (rank 0's results): one
    launch for every check, processes are what costs time here."""
    return run_ranks(_worker, 4)[0]


@pytest.mark.parametrize("stages", [1, 2, 4])
def test_deepspeed_checkpoint_loads_at_any_stage_count(pipekernel_run, stages):
    """Saved by DeepSpeed at 2 stages: the same eval loss, and the same two next steps as
    DeepSpeed resuming it (optimizer state, LR schedule and step counter carried over);
    a step sees the same 8 samples at any replica count."""
    loaded, saved, resumed = (pipekernel_run["loaded"][stages], EXPECTED["saved"],
                              EXPECTED["resumed"])
    assert loaded["loaded_eval"] == pytest.approx(saved["eval"], abs=1e-5)
    assert loaded["losses"] == pytest.approx(resumed["losses"], abs=1e-5)
    assert loaded["eval"] == pytest.approx(resumed["eval"], abs=1e-5)
    assert loaded["global_steps"] == resumed["global_steps"] == 4


def test_load_module_only_loads_the_weights_alone(pipekernel_run):
    got = pipekernel_run["module_only"]
    assert got["eval"] == pytest.approx(EXPECTED["saved"]["eval"], abs=1e-5)
    assert (got["steps"], got["scheduler"], got["path"]) == (0, -1, os.path.join("ckpt", "step2"))
    assert got["client"] == {"note": "fixture"}  # DeepSpeed's extra keys: the client state


def test_model_parameters_groups_reach_each_stages_optimizer(pipekernel_run):
    # rank 0 is stage 0 of [0, 2, 4, 5, 6]: two weights (the tied embedding, the
    # positions) and no other parameter, so the second group is empty there and dropped
    assert pipekernel_run["groups"] == [(2, 0.1)]


def test_recomputation_reseeds_dropout_as_the_forward_did(pipekernel_run):
    plain, recomputed = pipekernel_run["dropout"]
    assert recomputed == pytest.approx(plain, abs=1e-6) and plain[0] != plain[1]


def test_a_built_optimizer_and_scheduler_are_used_as_they_are(pipekernel_run):
    built = pipekernel_run["built"]
    assert built["same"] and built["lr"] == 0.05  # one step of StepLR(gamma=0.5)
    assert "lr_scheduler=lambda optimizer" in built["refused"]


def test_script_gives_deepspeeds_losses(pipekernel_run):
    """DeepSpeed itself, one process; pipekernel at 2 stages x 2 replicas: AdamW, WarmupLR,
    clipping 0.5 (active: the gradient norm is above it) and a tied embedding give the
    same 4 losses and eval loss."""
    _deepspeed()
    theirs = gpt_script.launch("deepspeed", 1, 1, 4)
    ours = pipekernel_run["scratch"]
    assert ours["losses"] == pytest.approx(theirs["losses"], abs=1e-5)
    assert ours["eval"] == pytest.approx(theirs["eval"], abs=1e-5)
    assert len(set(ours["losses"])) == 4


def test_convert_refuses_what_it_cannot_carry_over_by_name(tmp_path):
    import shutil

    from pipekernel.deepspeed import convert
    module = pipe.PipelineModule(gpt_script.layers(pipe), num_stages=1,
                                 loss_fn=gpt_script.loss_fn, partition_method="uniform")
    ckpt = tmp_path / "ds"
    shutil.copytree(FIXTURES / "ckpt", ckpt)
    stage0 = ckpt / "step2" / "mp_rank_00_model_states.pt"
    saved = torch.load(stage0, weights_only=False)
    state = saved["optimizer"]["state"]
    state[0], state[1] = state[1], state[0]  # positions that no longer fit the model
    torch.save(saved, stage0)
    with pytest.raises(ConfigError, match=r"stage 0 .* 0\.weight \[8, 16\] vs \[32, 16\]"):
        convert(ckpt, tmp_path / "a", module=module)
    saved["optimizer"] = {"optimizer_state_dict": {}, "dynamic_loss_scale": True}
    torch.save(saved, stage0)
    with pytest.raises(ConfigError, match="load_optimizer_states=False"):
        convert(ckpt, tmp_path / "b", module=module)
    convert(ckpt, tmp_path / "c", module=module, optimizer=False)  # the weights still load
    shutil.copy(ckpt / "step2" / "layer_02-model_states.pt",
                ckpt / "step2" / "layer_02-model_01-model_states.pt")
    with pytest.raises(ConfigError, match="tensor-parallel shard 1 of layer 2"):
        convert(ckpt, tmp_path / "d", module=module)


def test_convert_deepspeed_command_then_load_sequential(tmp_path, capsys):
    from pipekernel.apps.cli import main
    assert main(["convert-deepspeed", str(FIXTURES / "ckpt"), str(tmp_path),
                 "--num-layers", "6"]) == 0
    assert (tmp_path / "latest").read_text().strip() == "step2"
    module = pipe.PipelineModule(gpt_script.layers(pipe), num_stages=1,
                                 loss_fn=gpt_script.loss_fn, partition_method="uniform")
    model = pk.load_sequential(tmp_path, module.pipeline_module())
    data = gpt_script.dataset()[:8]
    with torch.no_grad():
        loss = gpt_script.loss_fn(model(torch.stack([x for x, _ in data])),
                                  torch.stack([y for _, y in data]))
    assert float(loss) == pytest.approx(EXPECTED["saved"]["eval"], abs=1e-5)
