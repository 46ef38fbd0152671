"""Checkpoints of tensor-parallel (a DTensor plan) and ZeRO-1 runs load at another
tensor-parallel size and another D, and as one plain model."""
from __future__ import annotations

import pytest
import torch
from models import adam, mlp_data
from test_tensor_parallel import tp_mlp, tp_plan, whole_state

import pipekernel as pk
from pipekernel.engine import checkpoint as ckpt
from pipekernel.testing import assert_parity, reference_train, run_ranks

MB = 2


def worker(root, tp_size, dp, zero, steps, load, precision="fp32"):
    torch.set_num_threads(1)
    engine = pk.PipelineEngine(tp_mlp(num_stages=2), optimizer=adam, micro_batches=MB,
                               tensor_parallel_size=tp_size, data_parallel_size=dp,
                               tensor_parallel_plan=tp_plan() if tp_size > 1 else None,
                               zero_stage=zero, precision=precision, timeout=120)
    info = engine.load_checkpoint(root) if load else None
    losses = [engine.train_batch(iter(mlp_data(s, engine.data_parallel_rank, MB))).item()
              for s in steps]
    engine.save_checkpoint(root)
    return {"losses": losses, "state": whole_state(engine),
            "exact": None if info is None else info["exact"]}


def test_tp2_then_zero_d2_then_tp2_continue_like_one_process(tmp_path):
    root = str(tmp_path / "ck")
    a = run_ranks(worker, 4, root, 2, 1, 0, range(0, 2), False)          # 2 x 1 x 2
    b = run_ranks(worker, 4, root, 1, 2, 1, range(2, 4), True)           # 2 x 2 x 1, ZeRO
    c = run_ranks(worker, 4, root, 2, 1, 0, range(4, 5), True)           # 2 x 1 x 2 again
    assert {r["exact"] for r in b} == {False} and {r["exact"] for r in c} == {False}
    dps = [1, 1, 2, 2, 1]
    batches = [[mlp_data(s, r, MB) for r in range(dp)] for s, dp in enumerate(dps)]
    ref_losses, ref_state = reference_train(tp_mlp(), adam, batches, MB)
    losses = a[-1]["losses"] + b[-1]["losses"] + c[-1]["losses"]
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for r in c:
        assert_parity(r["losses"], ref_losses[4:], r["state"], ref_state)
    # the files hold whole tensors: one process reads the model as it is
    model = ckpt.load_sequential(root, tp_mlp())
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, ref_state[key], rtol=1e-5, atol=1e-6)


def test_same_shape_resume_of_zero_bf16_is_bit_exact(tmp_path):
    root = str(tmp_path / "zero")
    run_ranks(worker, 4, root, 1, 2, 1, range(0, 1), False, "bf16")
    resumed = run_ranks(worker, 4, root, 1, 2, 1, range(1, 3), True, "bf16")
    straight = run_ranks(worker, 4, str(tmp_path / "straight"), 1, 2, 1, range(0, 3), False,
                         "bf16")
    assert {r["exact"] for r in resumed} == {True}
    for r, s in zip(resumed, straight):
        assert r["losses"] == s["losses"][1:]  # bit-exact: ZeRO state restored shard by shard
        for key, value in r["state"].items():
            assert torch.equal(value, s["state"][key]), key
