"""ZeRO-1: the optimizer state sharded over replicas trains like the replicated one.

The multi-rank cases run as one world per size (tests/sweep.py): 1, 2 and 4 ranks."""
from __future__ import annotations

import pytest
import torch
from models import MODELS, adam, mlp, mlp_data
from sweep import Sweep

import pipekernel as pk
from pipekernel.grid.zero import ZeroOptimizer, optimizer_state_bytes

MB, STEPS = 2, 3


def _engine(stages, dp, zero, precision="bf16", **kw):
    return pk.PipelineEngine(mlp(num_stages=stages), optimizer=adam, micro_batches=MB,
                             data_parallel_size=dp, precision=precision, zero_stage=zero,
                             timeout=60, **kw)


def _masters(engine):
    return {name: engine.precision.master(p).detach().clone()
            for name, p in engine.module.named_parameters()}


def _run(engine, steps):
    return [engine.train_batch(iter(mlp_data(s, engine.data_parallel_rank, MB))).item()
            for s in steps]


def _owned_bytes(optimizer):
    """AdamW's state for the parameters this rank steps: two fp32 moments per element and
    one scalar step per tensor (what a replicated AdamW holds for them)."""
    params = [p for g in getattr(optimizer, "optim", optimizer).param_groups for p in g["params"]]
    return sum(8 * p.numel() + 4 for p in params)


def zero_vs_replicated_worker(stages, dp, precision, kw, model="mlp"):
    out = {}
    build, data = MODELS[model]
    for zero in (0, 1):
        engine = pk.PipelineEngine(
            build(num_stages=stages), optimizer=adam, micro_batches=MB, data_parallel_size=dp,
            precision=precision, zero_stage=zero, timeout=60,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5),
            **dict(kw))
        losses = [engine.train_batch(iter(data(s, engine.data_parallel_rank, MB))).item()
                  for s in range(STEPS)]
        out[zero] = {"losses": losses, "masters": _masters(engine),
                     "state_bytes": optimizer_state_bytes(engine.optimizer),
                     "zero": isinstance(engine.optimizer, ZeroOptimizer),
                     "owned_bytes": _owned_bytes(engine.optimizer),
                     "norm": engine.last_grad_norm, "metrics": engine.precision.metrics(),
                     "lr": engine.optimizer.param_groups[0]["lr"]}
        engine.close()  # the world runs other cases after this one (tests/sweep.py)
    return out


def one_process_worker(dp, precision):
    """The same data on one process: every replica's micro-batches accumulated."""
    engine = pk.PipelineEngine(mlp(num_stages=1), optimizer=adam, micro_batches=MB * dp,
                               precision=precision, timeout=60,
                               lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5))
    losses = [engine.train_batch(iter([item for r in range(dp) for item in mlp_data(s, r, MB)]))
              .item() for s in range(STEPS)]
    masters = _masters(engine)
    engine.close()
    return losses, masters


SWEEP = Sweep()
PRECISIONS = [("bf16", {}), ("fp16", {"max_grad_norm": 0.5})]
PP2_DP2 = {p: SWEEP.case(f"pp2-dp2-{p}", 4, zero_vs_replicated_worker, 2, 2, p,
                         tuple(kw.items()))  # hashable: a case is a key
           for p, kw in PRECISIONS}
ONE_PROCESS = {p: SWEEP.case(f"one-process-{p}", 1, one_process_worker, 2, p)
               for p, _ in PRECISIONS}
TIED = SWEEP.case("pp2-dp2-tied", 4, zero_vs_replicated_worker, 2, 2, "fp32", (), "tied")


@pytest.mark.parametrize("precision,kw", PRECISIONS)
def test_zero1_two_stages_two_replicas_matches_replicated_and_one_process(precision, kw):
    results = SWEEP.results(PP2_DP2[precision])
    ref_losses, ref_masters = SWEEP.results(ONE_PROCESS[precision])[0]
    for rank_result in results:
        plain, zero = rank_result[0], rank_result[1]
        assert zero["zero"] and not plain["zero"]
        assert zero["lr"] == plain["lr"] == pytest.approx(1e-2 * 0.5 ** STEPS)
        # same gradients, element-wise AdamW on shards: the same numbers as replicated
        assert zero["losses"] == pytest.approx(plain["losses"], rel=1e-6)
        for name, value in zero["masters"].items():
            torch.testing.assert_close(value, plain["masters"][name], rtol=1e-6, atol=1e-7)
        # and the one-process run with the same bf16/fp16 master policy (the only
        # difference: the order gradients are summed in, then low-precision casts)
        assert zero["losses"] == pytest.approx(ref_losses, rel=5e-3)
        for name, value in zero["masters"].items():
            torch.testing.assert_close(value, ref_masters[name], rtol=5e-3, atol=5e-3)
        # optimizer state per rank: exactly AdamW's moments (8 bytes) and step of the
        # parameters torch assigned to this rank, and less than the replicated state
        assert zero["state_bytes"] == zero["owned_bytes"] < plain["state_bytes"]
        if "max_grad_norm" in kw:
            assert zero["norm"] == pytest.approx(plain["norm"], rel=1e-6)
            assert zero["metrics"] == plain["metrics"]  # the same loss scale


def test_zero1_with_tied_weights_across_stages_matches_replicated():
    for rank_result in SWEEP.results(TIED):
        plain, zero = rank_result[0], rank_result[1]
        assert zero["zero"] and zero["losses"] == pytest.approx(plain["losses"], rel=1e-6)
        for name, value in zero["masters"].items():
            torch.testing.assert_close(value, plain["masters"][name], rtol=1e-6, atol=1e-7)
        assert zero["state_bytes"] < plain["state_bytes"]


def state_dict_worker():
    """ZeRO's full state_dict equals the replicated optimizer's."""
    out = {}
    for zero in (0, 1):
        engine = _engine(1, 2, zero, "fp32")
        _run(engine, range(2))
        out[zero] = engine.optimizer.state_dict()
        engine.close()
    return out


STATE_DICT = SWEEP.case("state-dict", 2, state_dict_worker)


def test_zero1_state_dict_is_the_full_replicated_layout():
    for result in SWEEP.results(STATE_DICT):
        plain, zero = result[0], result[1]
        assert sorted(zero["state"]) == sorted(plain["state"])
        for index, entry in plain["state"].items():
            assert sorted(zero["state"][index]) == sorted(entry)
            for key, value in entry.items():
                torch.testing.assert_close(zero["state"][index][key], value, rtol=1e-6, atol=1e-7)
        assert zero["param_groups"][0]["lr"] == plain["param_groups"][0]["lr"]


def test_bad_options_say_how_to_fix():
    from pipekernel.grid.parallel import ParallelConfig
    for kwargs, message in [({"zero_stage": 2}, "zero_stage must be 0 or 1"),
                            ({"tensor_parallel_size": 0}, "tensor_parallel_size must be"),
                            ({"rank_order": "pp-tp"}, "rank_order='pp-tp'"),
                            ({"partition_activations": "yes"}, "partition_activations")]:
        with pytest.raises(pk.ConfigError, match=message):
            ParallelConfig.make(**kwargs)
    assert ParallelConfig.make(rank_order="PP-dp-TP").rank_order == "pp-dp-tp"


def build_zero_directly_worker():
    """A factory with several parameter groups keeps them (torch's ZeRO assigns whole
    parameters, so groups by name or shape survive); a factory returning no optimizer is
    refused with a fix."""
    engine = pk.PipelineEngine(mlp(num_stages=1), optimizer=None, data_parallel_size=2,
                               timeout=30)
    params = list(engine.module.parameters())
    zero = ZeroOptimizer(params, lambda ps: torch.optim.SGD([{"params": ps[:1], "lr": 0.5},
                                                             {"params": ps[1:]}], lr=0.1),
                         engine.data_group)
    lrs = [g["lr"] for g in zero.param_groups]
    try:
        ZeroOptimizer(params, lambda ps: None, engine.data_group)
    except pk.ConfigError as err:
        return lrs, str(err)
    return lrs, None


# a refusal leaves its world as it left it: last of the world of 2 (tests/sweep.py)
SEVERAL_GROUPS = SWEEP.case("several-groups", 2, build_zero_directly_worker)


def test_a_factory_with_several_groups_keeps_them_and_a_bad_factory_is_refused():
    for lrs, message in SWEEP.results(SEVERAL_GROUPS):
        assert lrs == [0.5, 0.1]
        assert message is not None and "not a torch.optim.Optimizer" in message \
            and "how to fix" in message
