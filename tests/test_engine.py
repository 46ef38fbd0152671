"""Engine behaviour beyond parity: evaluation, bad input, the public surface."""
from __future__ import annotations

import itertools

import pytest
import torch
from models import mlp, mlp_data, sgd, tied_lm, token_data
from torch import nn

import pipekernel as pk
from pipekernel.plugin import make_plugin_manager
from pipekernel.schedules import instructions as isa
from pipekernel.testing import reference_eval, reference_train, run_ranks


# -- evaluation -----------------------------------------------------------------------
def eval_worker(stages):
    engine = pk.PipelineEngine(mlp(num_stages=stages), optimizer=sgd, micro_batches=3, timeout=60)
    results = []
    # any order of train and eval calls: eval, train, eval, eval, train, eval
    for step, kind in enumerate(["eval", "train", "eval", "eval", "train", "eval"]):
        items = mlp_data(step, 0, 3)
        if kind == "train":
            results.append(("train", engine.train_batch(iter(items)).item(), None))
        else:
            loss, outputs = engine.eval_batch(iter(items), return_outputs=True)
            results.append(("eval", loss.item(), outputs))
    return results, engine.is_last_stage()


def test_eval_batch_matches_reference_in_any_order_with_training():
    ranks = run_ranks(eval_worker, 2, 2)
    module = mlp()
    state = module.build_stage(0, [0, len(module.layers)]).state_dict()
    trained = 0
    for step, kind in enumerate(["eval", "train", "eval", "eval", "train", "eval"]):
        items = mlp_data(step, 0, 3)
        if kind == "train":
            trained += 1
            batches = [[mlp_data(s, 0, 3)] for s in (1, 4)[:trained]]
            _, state = reference_train(mlp(), sgd, batches, 3)
            continue
        ref_loss, ref_outputs = reference_eval(module, state, items)
        for results, is_last in ranks:
            got_kind, loss, outputs = results[step]
            assert got_kind == "eval"
            assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
            if is_last:
                assert len(outputs) == 3
                for out, ref in zip(outputs, ref_outputs):
                    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
            else:
                assert outputs is None


def eval_no_loss_worker():
    engine = pk.PipelineEngine(tied_lm(num_stages=2, depth=2), micro_batches=2, timeout=60)
    out = engine.eval_batch(iter(token_data(0, 0, 2)), compute_loss=False, return_outputs=True)
    return out[0], None if out[1] is None else [o.shape for o in out[1]]


def test_eval_without_loss_or_optimizer():
    (loss0, shapes0), (loss1, shapes1) = run_ranks(eval_no_loss_worker, 2)
    assert loss0 is None and loss1 is None
    assert shapes0 is None and shapes1 == [torch.Size([3, 6, 13])] * 2


# -- the public surface -------------------------------------------------------------------
def surface_worker():
    engine = pk.PipelineEngine(mlp(), optimizer=sgd, micro_batches=2, timeout=60)
    errors = []
    for call in (engine.forward, engine.backward, engine.step):
        try:
            call()
        except pk.PipelineError as err:
            errors.append(str(err))
    # one way down: the step's instructions are the BatchStep's handlers, the runtime
    # serves none of them, and it returns the batch's losses
    table = engine.kernel.handlers
    owners = {cls.__name__: getattr(table[cls], "__self__", None) is engine.batch_step
              for cls in (isa.ReduceTiedGrads, isa.ReduceGrads, isa.OptimizerStep)}
    step_in_runtime = sorted(c.__name__ for c in engine.runtime.handlers()
                             if c in (isa.ReduceTiedGrads, isa.ReduceGrads, isa.OptimizerStep))
    data = [(torch.ones(2, 8), torch.zeros(2, 4)) for _ in range(2)]
    loss = engine.train_batch(iter(data))
    losses = engine.runtime.end()
    got = (len(losses.values), losses.micro_batches, float(loss))
    # end() hands the batch's losses over: the next batch records into a new one
    engine.train_batch(iter(data))
    after = engine.runtime.end()
    got += (after is not losses, (len(losses.values), losses.micro_batches) == got[:2],
            after.micro_batches == losses.micro_batches)
    return engine.stage, engine.num_stages, engine.data_parallel_rank, errors, owners, \
        step_in_runtime, got


def test_engine_surface_and_forward_points_to_train_batch():
    results = run_ranks(surface_worker, 2)
    assert [r[:3] for r in results] == [(0, 2, 0), (1, 2, 0)]
    for _, _, _, errors, owners, step_in_runtime, _ in results:
        assert len(errors) == 3 and all("train_batch" in e for e in errors)
        assert all(owners.values()) and step_in_runtime == [], (owners, step_in_runtime)
    first, last = results[0][-1], results[1][-1]
    assert first[:2] == (0, []) and last[:2] == (2, [0, 1])  # only the last stage has losses
    assert first[3:] == last[3:] == (True, True, True), (first, last)
    assert first[2] == last[2]  # the batch loss, the same on every rank


def launch_worker(x):
    import os
    return int(os.environ["RANK"]) * x, os.environ["WORLD_SIZE"]


def test_launch_returns_results_by_rank():
    assert pk.launch(launch_worker, 3, (10,)) == [(0, "3"), (10, "3"), (20, "3")]


def failing_worker():
    import os
    if os.environ["RANK"] == "1":
        raise ValueError("boom on purpose")
    return "ok"


def test_launch_reraises_with_rank_and_traceback():
    with pytest.raises(pk.RankError, match=r"rank 1 failed(.|\n)*boom on purpose") as info:
        pk.launch(failing_worker, 2)
    assert info.value.rank == 1 and isinstance(info.value.original, ValueError)


def sleeping_worker():
    import time
    time.sleep(60)


def test_launch_kills_everything_after_timeout():
    with pytest.raises(pk.RankError, match="timed out after 2s waiting for ranks \\[0, 1\\]"):
        pk.launch(sleeping_worker, 2, timeout=2)


# -- laziness ---------------------------------------------------------------------------------
class Counted(nn.Linear):
    built: list[str] = []

    def __init__(self, tag):
        super().__init__(2, 2)
        Counted.built.append(f"{tag}:{self.weight.device.type}")


def test_layer_spec_builds_only_the_stage_layers():
    module = pk.PipelineModule([pk.LayerSpec(Counted, i) for i in range(6)], num_stages=3,
                               partition="parameters")
    Counted.built = []
    bounds = module.partition(3)
    assert bounds == [0, 2, 4, 6]
    assert all(b.endswith(":meta") for b in Counted.built)  # counting allocates nothing
    Counted.built = []
    stage = module.build_stage(1, bounds)
    assert Counted.built == ["2:cpu", "3:cpu"]
    assert sorted(stage.state_dict()) == ["2.bias", "2.weight", "3.bias", "3.weight"]


def test_seeding_rule_makes_weights_independent_of_partitioning():
    whole = mlp().build_stage(0, [0, 14]).state_dict()
    module = mlp(num_stages=3)
    bounds = module.partition(3)
    parts = {}
    for s in range(3):
        parts.update(module.build_stage(s, bounds).state_dict())
    assert parts.keys() == whole.keys()
    for key in whole:
        torch.testing.assert_close(parts[key], whole[key], rtol=0, atol=0)


def test_plain_modules_and_callables_in_the_layer_list():
    lin = nn.Linear(3, 3)
    module = pk.PipelineModule([lin, torch.relu, pk.LayerSpec(nn.Linear, 3, 1)], num_stages=1)
    stage = module.build_stage(0, module.partition(1))
    x = torch.randn(2, 3)
    torch.testing.assert_close(stage(x), stage._modules["2"](torch.relu(lin(x))))
    assert "0.weight" in stage.state_dict() and "2.weight" in stage.state_dict()


LAYERS5 = [pk.LayerSpec(nn.Linear, 2, 2), torch.relu, pk.LayerSpec(nn.Linear, 2, 2), torch.relu,
           pk.LayerSpec(nn.Linear, 2, 2)]


def test_uniform_and_explicit_partitions():
    uniform = pk.PipelineModule(LAYERS5, partition="uniform").partition(2)
    assert uniform[0] == 0 and uniform[2] == 5 and uniform[1] in (2, 3)
    assert pk.PipelineModule(LAYERS5, partition=[0, 1, 5]).partition(2) == [0, 1, 5]


def test_type_partition_balances_matching_layers():
    bounds = pk.PipelineModule(LAYERS5, partition="type:linear").partition(2)
    counts = [sum(isinstance(LAYERS5[i], pk.LayerSpec) for i in range(a, b))
              for a, b in zip(bounds, bounds[1:])]
    assert sorted(counts) == [1, 2]


def test_parameters_partition_balances_parameter_counts():
    layers = [pk.LayerSpec(nn.Linear, 64, 64), *[pk.LayerSpec(nn.Linear, 4, 4)] * 6]
    assert pk.PipelineModule(layers, partition="parameters").partition(2) == [0, 1, 7]


# -- bad input -------------------------------------------------------------------------------
def test_fewer_layers_than_stages():
    with pytest.raises(pk.ConfigError, match="cannot split 2 layers into 3 stages") as info:
        pk.PipelineModule([nn.Linear(2, 2), nn.Linear(2, 2)], num_stages=3)
    assert "fewer stages" in str(info.value)


def test_batch_fn_must_be_callable():
    with pytest.raises(pk.ConfigError, match="batch_fn must be callable"):
        pk.PipelineModule([nn.Linear(2, 2)], batch_fn="input_ids")
    assert pk.PipelineModule([nn.Linear(2, 2)]).batch_fn is None


@pytest.mark.parametrize("bounds,match", [([0, 3, 2, 5], "not increasing(.|\n)*strictly increase"),
                                          ([0, 2, 4], "do not cover all 5 layers")])
def test_bad_explicit_boundaries(bounds, match):
    layers = [pk.LayerSpec(nn.Linear, 2, 2)] * 5
    with pytest.raises(pk.ConfigError, match=match):
        pk.PipelineModule(layers, partition=bounds).partition(len(bounds) - 1)


def test_bad_partition_regex_and_unknown_method():
    layers = [pk.LayerSpec(nn.Linear, 2, 2)] * 3
    with pytest.raises(pk.ConfigError, match="invalid regex"):
        pk.PipelineModule(layers, partition="type:(").partition(2)
    with pytest.raises(pk.ConfigError, match="matches no layer type(.|\n)*Linear"):
        pk.PipelineModule(layers, partition="type:Conv").partition(2)
    with pytest.raises(pk.ConfigError, match="no partition plugin understands"):
        pk.PipelineModule(layers, partition="magic").partition(2)


def bad_input_worker(case):
    module = mlp(num_stages=2, loss=case != "no_loss")
    engine = pk.PipelineEngine(module, optimizer=sgd, micro_batches=4, timeout=20)
    items = mlp_data(0, 0, 4)
    if case == "short_iter":
        items = items[:2]
    elif case == "bad_labels":
        items = [(x, (y, y)) for x, y in items]
    elif case == "not_pairs":
        items = [x for x, _ in items]
    return engine.train_batch(iter(items))


@pytest.mark.parametrize("case,match", [
    # both stages read the iterator (inputs, labels); whichever runs dry first reports
    ("short_iter", r"stage [01], train step 1 \(1-based\), schedule step \d+, micro-batch 2, "
                   r"instruction LOAD2\] the data "
                   r"iterator ran out at micro-batch 2 of 4"),
    ("no_loss", "train_batch needs a loss function on the last stage(.|\n)*loss_fn="),
    ("bad_labels", r"micro-batch 0.*loss_fn\(outputs, labels\) failed(.|\n)*labels: \(tensor"),
    ("not_pairs", r"micro-batch 0 is a Tensor(.|\n)*expected \(inputs, labels\)"),
])
def test_bad_input_errors_name_the_place(case, match):
    with pytest.raises(pk.RankError, match=match):
        run_ranks(bad_input_worker, 2, case, timeout=300)


def divisible_worker():
    pk.PipelineEngine(mlp(num_stages=2), optimizer=sgd, micro_batches=2, timeout=20)


def test_world_size_not_divisible_by_stages():
    with pytest.raises(pk.RankError, match="world size 3 is not divisible by 2 pipeline stages"):
        run_ranks(divisible_worker, 3)


def stalled_worker():
    import os
    engine = pk.PipelineEngine(mlp(num_stages=2), optimizer=sgd, micro_batches=2, timeout=3)
    if os.environ["RANK"] == "0":
        import time
        time.sleep(30)  # never sends: rank 1 must give up naming rank 0
    return engine.train_batch(iter(mlp_data(0, 0, 2)))


def test_a_silent_peer_ends_in_an_error_naming_it():
    with pytest.raises(pk.RankError, match=r"rank 1 failed(.|\n)*stage 1, train step 1 \(1-based\), "
                       r"schedule step 0, micro-batch 0, instruction RECV_F0\] rank 1 waited 3s "
                       r"to receive from rank 0"):
        run_ranks(stalled_worker, 2, timeout=300)


def test_unknown_names_list_the_available_ones():
    pm = make_plugin_manager()
    from pipekernel.extend.manager import make_precision, resolve_schedule
    with pytest.raises(pk.UnknownNameError, match="unknown schedule 'zz'(.|\n)*1f1b, dualpipev, gpipe"):
        resolve_schedule(pm, "zz")
    with pytest.raises(pk.UnknownNameError, match="unknown precision 'fp7'"):
        make_precision(pm, "fp7", {})


def test_iterables_and_cycles_are_accepted():
    # itertools.cycle is the recommended way to feed a finite loader
    it = itertools.cycle(mlp_data(0, 0, 1))
    assert next(it)[0].shape == (4, 8)



def _set_optimizer_worker() -> tuple[list[float], dict]:
    engine = pk.PipelineEngine(mlp(num_stages=2), None, micro_batches=2)
    errors = []
    try:
        engine.set_optimizer(torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1))
    except pk.ConfigError as err:
        errors.append(str(err))
    engine.set_optimizer(sgd(engine.module.parameters()),
                         lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.5))
    losses = [float(engine.train_batch(iter(mlp_data(step, 0, 2)))) for step in range(3)]
    state = {k: v.clone() for k, v in engine.module.state_dict().items()}
    lr = engine.optimizer.param_groups[0]["lr"]
    engine.close()
    return losses, state, errors, lr


def test_set_optimizer_attaches_an_optimizer_and_scheduler_built_after_the_stage():
    """A host (Lightning's configure_optimizers) builds them over engine.module once it
    exists: the same training as a factory given to the constructor."""
    class Halving(torch.optim.SGD):  # the reference's optimizer with the scheduler inside
        def __init__(self, params):
            super().__init__(params, lr=0.05, momentum=0.9)  # models.sgd
            self.scheduler = torch.optim.lr_scheduler.StepLR(self, 1, 0.5)

        def step(self, closure=None):
            super().step(closure)
            self.scheduler.step()

    results = run_ranks(_set_optimizer_worker, 2)
    ref_losses, ref_state = reference_train(mlp(), Halving,
                                            [[mlp_data(s, 0, 2)] for s in range(3)], 2)
    for losses, state, errors, lr in results:
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        for key, value in state.items():
            torch.testing.assert_close(value, ref_state[key], rtol=1e-5, atol=1e-6)
        assert "does not train" in errors[0]
        assert lr == pytest.approx(0.05 / 8)
