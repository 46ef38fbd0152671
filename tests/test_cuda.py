"""The engine on a GPU: nccl, ``transport="auto"`` and bf16 on CUDA, each against the
single-process reference trained on the same GPU. Skipped without CUDA; run by
``gpu/check.sh`` (``pytest -m cuda``).

One GPU allows one NCCL rank only (NCCL refuses two ranks on the same device), so
these engines have one stage; several stages on one GPU run through the staged
transport in ``tests/test_cuda_pipeline.py``, and the nccl conformance test in
``tests/test_transports.py`` uses every GPU there is (up to 4).
"""
from __future__ import annotations

import pytest
import torch
from models import mlp, mlp_data, sgd

import pipekernel as pk
from pipekernel.extend.manager import auto_transport
from pipekernel.testing import assert_parity, reference_train, run_ranks

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

STEPS, MICRO_BATCHES = 5, 2
# bf16 against the fp32 reference: the bound tests/test_precision.py states for 20 steps
# of the same model on the CPU (loss relative, parameters absolute).
BF16_TOLERANCE = 5e-3


def engine_worker(transport, precision):
    engine = pk.PipelineEngine(mlp(num_stages=1), optimizer=sgd, micro_batches=MICRO_BATCHES,
                               transport=transport, precision=precision, timeout=60)
    losses = [engine.train_batch(iter(mlp_data(s, 0, MICRO_BATCHES))).item()
              for s in range(STEPS)]
    result = {"backend": engine.transport.backend, "device": str(engine.transport.device),
              "losses": losses,
              "module_dtypes": {p.dtype for p in engine.module.parameters()},
              # the optimizer's (fp32 master) weights, on the CPU to travel back
              "params": {name: engine.precision.master(p).detach().cpu()
                         for name, p in engine.module.named_parameters()}}
    engine.close()
    return result


def reference_on_gpu():
    batches = [[mlp_data(s, 0, MICRO_BATCHES)] for s in range(STEPS)]
    losses, state = reference_train(mlp(), sgd, batches, MICRO_BATCHES, device="cuda")
    return losses, {k: v.cpu() for k, v in state.items()}


def test_nccl_one_stage_engine_matches_the_reference_on_the_gpu():
    (result,) = run_ranks(engine_worker, 1, "nccl", "fp32", timeout=300)
    assert result["backend"] == "nccl" and result["device"] == "cuda:0"
    ref_losses, ref_state = reference_on_gpu()
    assert set(result["params"]) == set(ref_state)
    assert_parity(result["losses"], ref_losses, result["params"], ref_state)


def test_auto_picks_nccl_and_bf16_trains_within_tolerance_of_fp32():
    assert auto_transport() == "nccl"
    (result,) = run_ranks(engine_worker, 1, "auto", "bf16", timeout=300)
    assert result["backend"] == "nccl" and result["device"] == "cuda:0"
    assert result["module_dtypes"] == {torch.bfloat16}
    ref_losses, ref_state = reference_on_gpu()
    for step, (a, b) in enumerate(zip(result["losses"], ref_losses, strict=True)):
        assert abs(a - b) <= BF16_TOLERANCE * abs(b) + 1e-6, f"step {step}: {a} vs {b}"
    for key, value in result["params"].items():
        assert value.dtype == torch.float32, f"master {key} is {value.dtype}"
        torch.testing.assert_close(value, ref_state[key], rtol=0, atol=BF16_TOLERANCE,
                                   msg=lambda m, key=key: f"parameter {key}: {m}")
    # the comparison is meaningful: bf16 is not bit-identical to fp32
    assert result["losses"] != ref_losses
