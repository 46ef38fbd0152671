"""Precision policies: bf16/fp16 with fp32 masters, fp16 loss scaling agreed by every
rank, global gradient clipping, amp-bf16, a third-party policy, bytes on the wire.

Tolerances (stated once in ``TOLERANCE``: loss relative, parameters absolute): after
20 steps of the 8-layer MLP with SGD, ``bf16`` stays within 5e-3 of the fp32
single-process reference and ``fp16`` within 5e-4 (about 10x what was measured:
6e-4 and 5e-5) — bf16 keeps 8 mantissa bits, fp16 11, and both accumulate
gradients and step in fp32. ``amp-bf16``: 5e-3 (measured 3e-4 after 10 steps);
the LayerNorm-in-fp32 example: 1e-2 (measured 2e-3).

The multi-rank cases run as one world per size (tests/sweep.py): 2, 3 and 4 ranks.
"""
from __future__ import annotations

import math

import pytest
import torch
from models import MODELS, sgd
from sweep import Sweep
from torch import nn

import pipekernel as pk
from pipekernel.errors import ConfigError
from pipekernel.schedules.instructions import OptimizerStep
from pipekernel.plugins.precision import FP16, LossScaler, LowPrecision
from pipekernel.step.precision import Precision
from pipekernel.plugins.counting import CountingPlugin
from pipekernel.testing import reference_train

TOLERANCE = {"bf16": (5e-3, 5e-3), "fp16": (5e-4, 5e-4), "amp-bf16": (5e-3, 5e-3),
             "bf16-ln32": (1e-2, 1e-2), "fp32": (1e-5, 1e-5)}


# -- test plugins ------------------------------------------------------------------
class Metrics:
    """Collects the metrics of every train_batch."""

    def __init__(self):
        self.seen = []

    @pk.hookimpl
    def pipekernel_after_train_batch(self, metrics):
        self.seen.append(dict(metrics))


class LayerNormFP32(LowPrecision):
    """A third-party policy: bf16 everywhere except LayerNorm, kept in fp32."""

    name = "bf16-ln32"

    def keeps_fp32(self, name, module):
        return isinstance(module, nn.LayerNorm)


class LayerNormFP32Plugin:
    @pk.hookimpl
    def pipekernel_make_precision(self, name, options):
        return LayerNormFP32(**options) if name == "bf16-ln32" else None


class InjectInf:
    """Puts an inf into one rank's gradient right before the optimizer step of step ``k``."""

    def __init__(self, k, rank):
        self.k, self.rank, self.engine = k, rank, None

    @pk.hookimpl
    def pipekernel_before_instruction(self, instruction):
        engine = self.engine
        if (isinstance(instruction, OptimizerStep) and engine.global_steps == self.k
                and engine.rank == self.rank):
            last = list(engine.module.parameters())[-1]
            engine.precision.master(last).grad.view(-1)[0] = math.inf


def ln_model(num_stages=None):
    layers = [pk.LayerSpec(nn.Linear, 8, 16), pk.LayerSpec(nn.LayerNorm, 16), torch.tanh,
              pk.LayerSpec(nn.Linear, 16, 16), pk.LayerSpec(nn.LayerNorm, 16),
              pk.LayerSpec(nn.Linear, 16, 4)]
    return pk.PipelineModule(layers, loss_fn=nn.MSELoss(), num_stages=num_stages,
                             partition=[0, 3, 6], seed=5)


MODELS = {**MODELS, "ln": (ln_model, MODELS["mlp"][1])}


# -- workers -----------------------------------------------------------------------
def _masters(engine):
    return {name: engine.precision.master(p).detach().clone()
            for name, p in engine.module.named_parameters()}


def _engine(model, stages, dp, micro_batches, precision, options=None, transport="counting",
            plugins=(), **kwargs):
    build, _ = MODELS[model]
    return pk.PipelineEngine(build(num_stages=stages), optimizer=sgd, micro_batches=micro_batches,
                             data_parallel_size=dp, precision=precision, transport=transport,
                             precision_options=options, timeout=60,
                             plugins=[CountingPlugin(), LayerNormFP32Plugin(), *plugins], **kwargs)


def _train(engine, model, micro_batches, steps):
    data = MODELS[model][1]
    return [engine.train_batch(iter(data(s, engine.data_parallel_rank, micro_batches))).item()
            for s in range(steps)]


def train_worker(model, stages, dp, micro_batches, precision, steps, max_grad_norm=None,
                 compare_bytes=False):
    sent_fp32 = None
    if compare_bytes:  # the same batches in fp32 first, for the byte count
        fp32 = _engine(model, stages, dp, micro_batches, "fp32")
        _train(fp32, model, micro_batches, steps)
        sent_fp32 = fp32.runtime.payload_bytes()
    metrics = Metrics()
    engine = _engine(model, stages, dp, micro_batches, precision, plugins=[metrics],
                     max_grad_norm=max_grad_norm)
    losses = _train(engine, model, micro_batches, steps)
    out = {"losses": losses, "masters": _masters(engine), "stage": engine.stage,
            "replica": engine.data_parallel_rank, "sent": engine.runtime.payload_bytes(),
            "sent_fp32": sent_fp32, "metrics": metrics.seen,
            "module_dtypes": {k: v.dtype for k, v in engine.module.state_dict().items()},
            "opt_dtypes": {v.dtype for state in engine.optimizer.state.values()
                           for v in state.values() if torch.is_tensor(v)},
            "precision_state": engine.precision.state_dict()}
    engine.close()  # the world runs other cases after this one (tests/sweep.py)
    if compare_bytes:
        fp32.close()
    return out


def _reference(model, dp, micro_batches, steps, max_grad_norm=None, skip=()):
    build, data = MODELS[model]
    batches = [[data(s, r, micro_batches) for r in range(dp)] for s in range(steps)
               if s not in skip]
    norms = []

    def clip(m):
        norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), max_grad_norm)))

    losses, state = reference_train(build(), sgd, batches, micro_batches,
                                    hook=clip if max_grad_norm else None)
    return losses, state, norms


def _close(results, ref_losses, ref_state, precision):
    rtol, atol = TOLERANCE[precision]
    covered = set()
    for r in results:
        for step, (a, b) in enumerate(zip(r["losses"], ref_losses)):
            assert abs(a - b) <= rtol * abs(b) + 1e-6, f"step {step}: loss {a} vs reference {b}"
        for key, value in r["masters"].items():
            assert value.dtype == torch.float32, f"master {key} is {value.dtype}"
            torch.testing.assert_close(value, ref_state[key], rtol=0, atol=atol,
                                       msg=lambda m, key=key: f"parameter {key}: {m}")
        covered |= set(r["masters"])
    assert covered == {k for k in ref_state}


# -- the cases, declared at import: one world per size (tests/sweep.py) -----------------
SWEEP = Sweep()
LOW_STEPS, LOW_MB = 20, 3
LOW = {p: SWEEP.case(f"low-{p}", 2, train_worker, "mlp", 2, 1, LOW_MB, p, LOW_STEPS, None, True)
       for p in ("bf16", "fp16")}
CLIP_STEPS, CLIP_MB, CLIP_NORM = 4, 3, 0.05  # small enough to clip at every step
CLIP = {(m, st, dp, p): SWEEP.case(f"clip-{m}-{st}-{dp}-{p}", st * dp, train_worker, m, st, dp,
                                   CLIP_MB, p, CLIP_STEPS, CLIP_NORM)
        for m, st, dp, p in [("mlp", 2, 1, "fp32"), ("mlp", 4, 1, "fp32"),
                             ("tied", 2, 2, "fp32"), ("tied", 3, 1, "fp16")]}
AMP_STEPS, AMP_MB = 10, 2
AMP = {(p, m): SWEEP.case(f"policy-{p}", 2, train_worker, m, 2, 1, AMP_MB, p, AMP_STEPS)
       for p, m in [("amp-bf16", "mlp"), ("bf16-ln32", "ln")]}
OVERFLOW_K, OVERFLOW_RANK, OVERFLOW_STEPS = 2, 3, 7   # rank 3: stage 1 of replica 1


# -- bf16 / fp16: parity, fp32 masters, half the bytes --------------------------------
@pytest.mark.parametrize("precision,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_low_precision_parity_masters_and_wire_bytes(precision, dtype):
    steps, mb = LOW_STEPS, LOW_MB
    results = SWEEP.results(LOW[precision])
    ref_losses, ref_state, _ = _reference("mlp", 1, mb, steps)
    _close(results, ref_losses, ref_state, precision)
    low = str(dtype).replace("torch.", "")
    for r in results:
        assert set(r["module_dtypes"].values()) == {dtype}   # the stage computes in low precision
        assert r["opt_dtypes"] == {torch.float32}            # optimizer state on fp32 masters
        # float traffic between stages is all in the low dtype, and exactly half of fp32's
        assert r["sent"].get("float32", 0) == 0
        assert r["sent"][low] * 2 == r["sent_fp32"]["float32"] > 0
        assert all(not m["skipped"] for m in r["metrics"])
    # precision state round-trips: masters keyed like the module's state_dict
    assert set(results[0]["precision_state"]["master_weights"]) == set(results[0]["masters"])


# -- fp16: one overflow anywhere skips the step everywhere --------------------------------
def overflow_worker(k, bad_rank, steps):
    layers = [nn.Linear(8, 4), nn.Linear(4, 4)]  # modules, so the stages use these objects
    module = pk.PipelineModule(layers, loss_fn=nn.MSELoss(), num_stages=2)
    with pytest.raises(ConfigError, match="fp32 master copies"):
        pk.PipelineEngine(module, optimizer=torch.optim.SGD(layers[0].parameters(), lr=0.1),
                          precision="bf16", timeout=60)
    metrics, inject = Metrics(), InjectInf(k, bad_rank)
    engine = _engine("mlp", 2, 2, 2, "fp16", transport="gloo", plugins=[metrics, inject],
                     options={"init_scale": 2.0 ** 10, "growth_interval": 3},
                     lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0))
    inject.engine = engine
    data = MODELS["mlp"][1]
    record = []
    for s in range(steps):
        before = ({k_: v.clone() for k_, v in engine.module.state_dict().items()},
                  _masters(engine))
        engine.train_batch(iter(data(s, engine.data_parallel_rank, 2)))
        after = ({k_: v for k_, v in engine.module.state_dict().items()}, _masters(engine))
        changed = any(not torch.equal(b[key], a[key]) for b, a in zip(before, after) for key in b)
        record.append({"changed": changed, "scale": engine.precision.scaler.scale,
                       "scheduler_steps": engine.lr_scheduler.last_epoch})
    out = {"record": record, "metrics": metrics.seen, "skipped_steps": engine.skipped_steps,
           "masters": _masters(engine), "state": engine.precision.state_dict()["scaler"]}
    engine.close()
    return out


# its first engine is refused: last of its world (tests/sweep.py)
OVERFLOW = SWEEP.case("overflow", 4, overflow_worker, OVERFLOW_K, OVERFLOW_RANK, OVERFLOW_STEPS)


def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank():
    k, bad_rank, steps = OVERFLOW_K, OVERFLOW_RANK, OVERFLOW_STEPS
    results = SWEEP.results(OVERFLOW)
    scales = [1024, 1024, 512, 512, 512, 1024, 1024]  # halved at k, doubled 3 clean steps later
    for rank, r in enumerate(results):
        changed = [x["changed"] for x in r["record"]]
        assert changed == [s != k for s in range(steps)], f"rank {rank}: {changed}"
        assert [x["scale"] for x in r["record"]] == scales, f"rank {rank}"
        assert [m["skipped"] for m in r["metrics"]] == [s == k for s in range(steps)]
        assert [m["loss_scale"] for m in r["metrics"]] == scales
        assert r["skipped_steps"] == 1
        # the LR schedule advanced once per step taken, not at the skipped step
        taken = [sum(1 for s in range(i + 1) if s != k) for i in range(steps)]
        assert [x["scheduler_steps"] for x in r["record"]] == taken
        assert r["state"] == {"scale": 1024.0, "growth_tracker": 1, "hysteresis_left": 1}
    # the skipped step's data left no trace: training equals the reference without step k
    ref_losses, ref_state, _ = _reference("mlp", 2, 2, steps, skip=(k,))
    for r in results:
        for key, value in r["masters"].items():
            torch.testing.assert_close(value, ref_state[key], rtol=0, atol=TOLERANCE["fp16"][1])


# -- global gradient clipping --------------------------------------------------------
@pytest.mark.parametrize("model,stages,dp,precision", [
    ("mlp", 2, 1, "fp32"), ("mlp", 4, 1, "fp32"), ("tied", 2, 2, "fp32"), ("tied", 3, 1, "fp16")])
def test_clipping_equals_clip_grad_norm(model, stages, dp, precision):
    steps, mb, max_norm = CLIP_STEPS, CLIP_MB, CLIP_NORM
    results = SWEEP.results(CLIP[model, stages, dp, precision])
    ref_losses, ref_state, ref_norms = _reference(model, dp, mb, steps, max_norm)
    assert min(ref_norms) > max_norm
    rtol = TOLERANCE[precision][0]
    for r in results:
        norms = [m["grad_norm"] for m in r["metrics"]]
        assert norms == pytest.approx(ref_norms, rel=max(rtol, 1e-5))
    _close(results, ref_losses, ref_state, precision)


# -- amp-bf16 and a third-party policy ------------------------------------------------------
@pytest.mark.parametrize("precision,model", [("amp-bf16", "mlp"), ("bf16-ln32", "ln")])
def test_amp_and_third_party_policy(precision, model):
    steps, mb = AMP_STEPS, AMP_MB
    results = SWEEP.results(AMP[precision, model])
    ref_losses, ref_state, _ = _reference(model, 1, mb, steps)
    _close(results, ref_losses, ref_state, precision)
    for r in results:
        assert r["sent"].get("float32", 0) == 0 and r["sent"]["bfloat16"] > 0
        dtypes = r["module_dtypes"]
        if precision == "amp-bf16":
            assert set(dtypes.values()) == {torch.float32}
        else:  # LayerNorm (layers 1 and 4) stays fp32, the Linear layers are bf16
            for key, dtype in dtypes.items():
                ln = key.split(".")[0] in ("1", "4")
                assert dtype == (torch.float32 if ln else torch.bfloat16), key


# -- single-process unit tests ---------------------------------------------------------
def test_loss_scaler_hysteresis_min_scale_and_growth():
    s = LossScaler(init_scale=8.0, growth_interval=2, hysteresis=2, min_scale=2.0)
    s.update(True)
    assert s.scale == 8.0                     # first overflow tolerated
    s.update(True)
    assert s.scale == 4.0                     # second backs off
    s.update(True), s.update(True)
    assert s.scale == 2.0
    s.update(True), s.update(True)
    assert s.scale == 2.0                     # floor
    s.update(False), s.update(False)
    assert s.scale == 4.0 and s.growth_tracker == 0
    t = LossScaler()
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()
    defaults = LossScaler()
    assert (defaults.scale, defaults.growth_factor, defaults.backoff_factor,
            defaults.growth_interval) == (2.0 ** 16, 2.0, 0.5, 2000)  # torch.amp.GradScaler's


@pytest.mark.parametrize("options", [{"growth_factor": 0.5}, {"hysteresis": 0},
                                     {"min_scale": 1e9}, {"bogus": 1}])
def test_bad_fp16_options_raise_config_error(options):
    from pipekernel.plugins.precision import pipekernel_make_precision
    with pytest.raises(ConfigError, match="fp16|loss-scaling"):
        pipekernel_make_precision("fp16", options)


def test_fp32_accumulation_and_state_dict_round_trip():
    torch.manual_seed(0)
    module = nn.Linear(4, 4)
    policy = FP16(init_scale=4.0)
    policy.prepare(module)
    assert module.weight.dtype == torch.float16 and policy.master(module.weight).dtype == \
        torch.float32
    # many tiny gradients: fp16 accumulation would stall, fp32 accumulation does not
    tiny = torch.full((4, 4), 1e-4, dtype=torch.float16)
    for _ in range(2048):
        module.weight.grad = tiny.clone()
        policy.after_backward(module)
    total = policy.master(module.weight).grad
    torch.testing.assert_close(total, torch.full((4, 4), 2048 * float(tiny[0, 0])))
    assert not policy.unscale_(policy.optimizer_parameters(module))  # a device flag, False
    state = policy.state_dict()
    other = FP16()
    torch.manual_seed(1)
    other_module = nn.Linear(4, 4)
    other.prepare(other_module)
    other.load_state_dict(state)
    assert other.scaler.scale == 4.0
    torch.testing.assert_close(other.master(other_module.weight), policy.master(module.weight))
    assert torch.equal(other_module.weight, module.weight)


def test_precision_protocol_is_checked():
    class Incomplete:
        @pk.hookimpl
        def pipekernel_make_precision(self, name):
            return object() if name == "broken" else None

    from pipekernel.extend.manager import make_plugin_manager, make_precision
    pm = make_plugin_manager([Incomplete()])
    with pytest.raises(ConfigError, match="lacks prepare"):
        make_precision(pm, "broken", {})
    assert isinstance(make_precision(pm, "bf16", {}), Precision)
    with pytest.raises(pk.UnknownNameError, match="amp-bf16"):
        make_precision(pm, "fp8", {})
