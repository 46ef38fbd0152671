"""Several stages on one GPU through the staged transport (NCCL refuses two ranks on one
GPU): 1F1B, ZB-H1 and ZBV train exactly like one process on the same GPU (fp32
parity), and bf16/fp16 stay within the bounds ``tests/test_precision.py`` states.

With CUDA every case runs on the GPU (``gpu/check.sh`` runs them with ``-m cuda``);
without it, the 1F1B case runs the same staging on CPU tensors, so the path the GPU
check takes is exercised on every machine.
"""
from __future__ import annotations

import pytest
import torch
from models import MODELS, adam, sgd

import pipekernel as pk
from pipekernel.testing import assert_parity, reference_train, run_ranks

STEPS = 3
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# loss relative, parameters absolute: tests/test_precision.py's bounds for 20 steps
TOLERANCE = {"bf16": 5e-3, "fp16": 5e-4}
OPTIMIZERS = {"sgd": sgd, "adam": adam}

on_cuda = [pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="needs CUDA")]


def worker(model, stages, micro_batches, schedule, precision, optimizer):
    build, data = MODELS[model]
    engine = pk.PipelineEngine(build(num_stages=stages), optimizer=OPTIMIZERS[optimizer],
                               micro_batches=micro_batches, schedule=schedule,
                               transport="staged", precision=precision, timeout=120)
    device = str(engine.transport.device)
    losses = [engine.train_batch(iter(data(step, 0, micro_batches))).item()
              for step in range(STEPS)]
    # the optimizer's (fp32 master) weights, keyed like the state dict, on the CPU
    names = {id(p): n for n, p in engine.module.named_parameters()}
    state = {k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()}
    for param in engine.module.parameters():
        state[names[id(param)]] = engine.precision.master(param).detach().cpu().clone()
    engine.close()
    return device, losses, state


def check(model, stages, micro_batches, schedule, precision="fp32", optimizer="sgd"):
    results = run_ranks(worker, stages, model, stages, micro_batches, schedule, precision,
                        optimizer, timeout=240)
    build, data = MODELS[model]
    batches = [[data(step, 0, micro_batches)] for step in range(STEPS)]
    ref_losses, ref_state = reference_train(build(), OPTIMIZERS[optimizer], batches,
                                            micro_batches, device=DEVICE)
    ref_state = {k: v.cpu() for k, v in ref_state.items()}
    covered = set()
    for device, losses, state in results:
        assert device.startswith(DEVICE), f"the staged transport put a stage on {device}"
        if precision == "fp32":
            assert_parity(losses, ref_losses, state, ref_state)
        else:
            bound = TOLERANCE[precision]
            for step, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
                assert abs(a - b) <= bound * abs(b) + 1e-6, f"step {step}: {a} vs {b}"
            for key, value in state.items():
                if value.is_floating_point():
                    torch.testing.assert_close(value.float(), ref_state[key].float(), rtol=0,
                                               atol=bound)
        covered |= set(state)
    assert covered == set(ref_state), "stages together must hold every parameter"
    return results


def test_two_stages_1f1b_through_the_staged_transport():
    check("mlp", 2, 4, "1f1b")


@pytest.mark.parametrize("model,stages,micro_batches,schedule,optimizer", [
    ("masked", 2, 3, "1f1b", "sgd"),   # bool and int activations cross the host staging
    ("mlp", 4, 6, "zb-h1", "adam"),
    ("tied", 2, 4, "zbv", "adam"),
])
@pytest.mark.parametrize("_", [pytest.param(None, marks=on_cuda, id="cuda")])
def test_schedules_on_one_gpu_match_the_reference(_, model, stages, micro_batches, schedule,
                                                  optimizer):
    check(model, stages, micro_batches, schedule, optimizer=optimizer)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("_", [pytest.param(None, marks=on_cuda, id="cuda")])
def test_low_precision_pipelines_on_one_gpu_stay_within_tolerance(_, precision):
    results = check("mlp", 2, 4, "1f1b", precision=precision)
    build, data = MODELS["mlp"]
    reference, _ = reference_train(build(), sgd, [[data(s, 0, 4)] for s in range(STEPS)], 4,
                                   device=DEVICE)
    assert results[-1][1] != reference  # low precision is not bit-identical to fp32
