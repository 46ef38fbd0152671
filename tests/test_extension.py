"""Extension hooks: a plugin adds an instruction type with its handler and a schedule
that uses it, and trains; engines keep their plugins to themselves."""
from __future__ import annotations

import pytest
from models import mlp, mlp_data, sgd
from plugins_for_tests import Recorder, ScaledGradsPlugin, ScaledOneFOneB, ScaleGrads, flat

import pipekernel as pk
from pipekernel.plugin import Kernel
from pipekernel.errors import InstructionError, UnknownNameError
from pipekernel.extend.manager import make_plugin_manager, resolve_schedule
from pipekernel.schedules import simulate
from pipekernel.testing import assert_parity, reference_train, run_ranks

STEPS, MICRO = 3, 4


def scaled_worker():
    recorder = Recorder()
    engine = pk.PipelineEngine(mlp(num_stages=2), optimizer=sgd, micro_batches=MICRO,
                               schedule="1f1b-scaled", plugins=[ScaledGradsPlugin(), recorder],
                               autoload_plugins=False, timeout=60)
    losses = [engine.train_batch(iter(mlp_data(s, 0, MICRO))).item() for s in range(STEPS)]
    state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    expected = flat(ScaledOneFOneB(2, engine.stage, MICRO).steps())
    return losses, state, recorder.state(), expected


def _halve(model):
    for p in model.parameters():
        p.grad.mul_(0.5)


def test_plugin_instruction_and_schedule_train_with_parity():
    results = run_ranks(scaled_worker, 2)
    batches = [[mlp_data(s, 0, MICRO)] for s in range(STEPS)]
    ref_losses, ref_state = reference_train(mlp(), sgd, batches, MICRO, hook=_halve)
    plain_losses, _ = reference_train(mlp(), sgd, batches, MICRO)
    assert ref_losses[-1] != pytest.approx(plain_losses[-1])  # the new instruction matters
    for losses, state, seen, expected in results:
        assert_parity(losses, ref_losses, state, ref_state)
        # the monitor saw every instruction, the new one included, before and after
        assert [name for name, _ in seen["before"]] == expected * STEPS
        assert [name for name, _, _ in seen["after"]] == expected * STEPS
        assert expected.count("SCALE") == 1
        assert [m["step"] for _, m in seen["batches"]] == [1, 2, 3]


def test_plugin_schedule_passes_the_simulator():
    result = simulate(ScaledOneFOneB, 3, 5)
    assert sum(str(i) == "SCALE" for steps in result.steps for step in steps for i in step) == 3


def test_schedule_and_handler_come_only_with_the_plugin():
    with pytest.raises(UnknownNameError, match="1f1b-scaled") as err:
        resolve_schedule(make_plugin_manager(autoload=False), "1f1b-scaled")
    assert "1f1b" in err.value.hint and "pipekernel_register_schedules" in err.value.hint
    pm = make_plugin_manager([ScaledGradsPlugin()], autoload=False)
    assert resolve_schedule(pm, "1f1b-scaled") is ScaledOneFOneB
    with pytest.raises(InstructionError, match="no handler for instruction ScaleGrads"):
        Kernel({}, rank=0, stage=0).run([[ScaleGrads()]])


def two_engines_worker():
    a, b, c = Recorder("a"), Recorder("b"), Recorder("c")
    common = dict(optimizer=sgd, micro_batches=3, autoload_plugins=False, timeout=60)
    engine_a = pk.PipelineEngine(mlp(num_stages=2), schedule="1f1b", plugins=[a], **common)
    engine_b = pk.PipelineEngine(mlp(num_stages=2), schedule="gpipe", plugins=[b], **common)
    engine_c = pk.PipelineEngine(mlp(num_stages=2), plugins=[c], disable_plugins=["c"],
                                 **common)
    for step in range(2):
        for engine in (engine_a, engine_b, engine_c):
            engine.train_batch(iter(mlp_data(step, 0, 3)))
    registered = [sorted(n for n, p in e.pm.list_name_plugin() if p is not None) for e in (engine_a, engine_b,
                                                                          engine_c)]
    steps = {name: flat(cls(2, engine_a.stage, 3).steps())
             for name, cls in (("1f1b", pk.schedules.OneFOneB), ("gpipe", pk.schedules.GPipe))}
    return a.state(), b.state(), c.state(), registered, steps


def test_two_engines_in_one_process_keep_their_plugins_and_disabled_is_not_called():
    for a, b, c, registered, steps in run_ranks(two_engines_worker, 2):
        assert [n for n, _ in a["before"]] == steps["1f1b"] * 2
        assert [n for n, _ in b["before"]] == steps["gpipe"] * 2
        assert steps["1f1b"] != steps["gpipe"]
        assert len(a["batches"]) == len(b["batches"]) == 2
        assert c == {"before": [], "after": [], "batches": []}  # disabled: never called
        assert "a" in registered[0] and "a" not in registered[1] and "b" in registered[1]
        assert "c" not in registered[2]


class _OtherScaler:
    """A second plugin that claims ScaleGrads too."""

    @pk.hookimpl
    def pipekernel_register_instructions(self, runtime):
        return {ScaleGrads: lambda instruction: None}


def test_two_plugins_claiming_one_instruction_is_an_error_naming_both():
    from pipekernel.engine.assembly_step import plugin_handlers
    from pipekernel.errors import ConfigError
    from pipekernel.schedules.instructions import Forward

    one = make_plugin_manager([ScaledGradsPlugin()], autoload=False)
    assert list(plugin_handlers(one, runtime=None)) == [ScaleGrads]
    two = make_plugin_manager([ScaledGradsPlugin(), _OtherScaler()], autoload=False)
    with pytest.raises(ConfigError, match="ScaleGrads") as err:
        plugin_handlers(two, runtime=None)
    assert "scaled-grads" in str(err.value) and "_OtherScaler" in str(err.value)

    class _Override:  # replacing a core handler stays allowed: the hook's contract
        @pk.hookimpl
        def pipekernel_register_instructions(self):
            return {Forward: lambda instruction: None}

    assert list(plugin_handlers(make_plugin_manager([_Override()], autoload=False), None)) \
        == [Forward]
