"""Issue 30 item 3: dualpipev's (and zbv's) overlapped pairs as one ``ForwardBackward``
instruction.

A model-supplied ``overlapped_forward_backward`` (DualPipe's contract) is called for every
pair and its result used; the contract's reference (:func:`sequential`) and the built-in
overlap of expert all-to-alls (:func:`overlap_all_to_all`) train bit for bit like the
default (the forward, then the backward: today's program), on the own GPT (PP2) and on the
own MoE GPT with experts spread over 2 ranks (PP2 x EP2); bad input is a ConfigError."""
from __future__ import annotations

import inspect

import pytest
import torch

import pipekernel as pk
from pipekernel.apps.gpt import VOCAB, gpt_module
from pipekernel.schedules import simulate
from pipekernel.schedules.dualpipe import DualPipeV, dualpipev_order, dualpipev_pairs
from pipekernel.schedules.instructions import (Backward, BackwardInput, Forward,
                                               ForwardBackward, parse)
from pipekernel.schedules.ordered import unpair
from pipekernel.schedules.program import compile_program
from pipekernel.schedules.zero_bubble import ZBV
from pipekernel.stage.paired import PairedExecutor, sequential
from pipekernel.testing import run_ranks

CONTEXT, STEPS, MICRO = 8, 2, 4
CALLS: list[tuple[int, int]] = []  # (forward chunk, backward chunk) of each recorded pair


def build(experts: int = 0, fn=None, stages: int = 2) -> pk.PipelineModule:
    module = gpt_module(16, 4, 2, CONTEXT, num_stages=stages, partition="uniform", seed=3,
                        experts=experts, top_k=2)
    if fn is not None:
        module.overlapped_forward_backward = fn
    return module


def data(step: int, replica: int, micro: int = MICRO) -> list:
    g = torch.Generator().manual_seed(100 * step + 11 * replica)
    ids = torch.randint(0, VOCAB, (micro, 2, CONTEXT + 1), generator=g)
    return [(ids[m, :, :-1], ids[m, :, 1:]) for m in range(micro)]


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def recording(module0, inputs0, criterion0, labels0, module1, loss1, outputs1, output_grads1):
    """A model's own executor: DualPipe's example, each call recorded."""
    CALLS.append((module0.chunk, module1.chunk))
    return sequential(module0, inputs0, criterion0, labels0, module1, loss1, outputs1,
                      output_grads1)


def detaching(module0, inputs0, criterion0, labels0, module1, loss1, outputs1, output_grads1):
    """Returns the forward's outputs cut from the graph: if the stage uses what the
    executor returns, the backward of those parts never reaches their weights."""
    outputs0, loss0 = sequential(module0, inputs0, criterion0, labels0, module1, loss1,
                                 outputs1, output_grads1)
    return outputs0.detach(), loss0


def _train(fn, experts: int = 0, ep: int = 1, schedule: str = "dualpipev",
           micro: int = MICRO) -> tuple[list[float], dict, int]:
    CALLS.clear()
    engine = pk.PipelineEngine(build(experts, fn), optimizer=sgd, micro_batches=micro,
                               schedule=schedule, expert_parallel_size=ep, timeout=120)
    losses = [engine.train_batch(iter(data(s, engine.data_parallel_rank, micro))).item()
              for s in range(STEPS)]
    state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    lanes = engine.ep_group.lanes
    distinct = len({id(h) for h in lanes})
    engine.close()
    return losses, state, len(CALLS), distinct


def _config_errors() -> list[str]:
    found = []
    try:
        pk.PipelineEngine(build(0, "not a function"), optimizer=sgd, micro_batches=MICRO,
                          schedule="dualpipev", timeout=60)
    except pk.ConfigError as err:
        found.append(str(err))
    return found


def _dense_worker() -> dict:
    torch.set_num_threads(1)
    out = {"errors": _config_errors()}
    for name, fn in (("default", None), ("sequential", sequential),
                     ("overlap", pk.overlap_all_to_all), ("recording", recording),
                     ("detaching", detaching)):
        out[name] = _train(fn)
    return out


def _moe_worker() -> dict:
    torch.set_num_threads(1)
    return {name: _train(fn, experts=4, ep=2)
            for name, fn in (("default", None), ("overlap", pk.overlap_all_to_all))}


def _same(a, b) -> bool:
    return a[0] == b[0] and a[1].keys() == b[1].keys() and all(
        torch.equal(a[1][k], b[1][k]) for k in a[1])


def _pairs_on(rank: int) -> int:
    return len(dualpipev_pairs(2, rank, MICRO))


@pytest.mark.multirank
def test_paired_executors_train_bit_for_bit_like_the_default_on_the_gpt(tmp_path):
    results = run_ranks(_dense_worker, 2, timeout=600)
    for rank, result in enumerate(results):
        assert len(result["errors"]) == 1
        assert "overlapped_forward_backward is a str, not a callable" in result["errors"][0]
        for name in ("sequential", "overlap", "recording"):
            assert _same(result[name], result["default"]), (rank, name)
        assert result["recording"][2] == _pairs_on(rank) * STEPS  # called for every pair
        assert result["default"][2] == 0  # the default never calls one
        assert not _same(result["detaching"], result["default"])  # its result is used


@pytest.mark.multirank
def test_overlapped_expert_all_to_all_is_bit_exact_on_pp2_ep2(tmp_path):
    results = run_ranks(_moe_worker, 4, timeout=600)
    for rank, result in enumerate(results):
        assert _same(result["overlap"], result["default"]), rank
        assert result["overlap"][3] == 2  # one expert process group per chunk of the V


def _bad_return(*args):
    return "outputs"


def _bad_return_worker() -> str:
    torch.set_num_threads(1)
    engine = pk.PipelineEngine(build(0, _bad_return, stages=1), optimizer=sgd,
                               micro_batches=MICRO, schedule="dualpipev", timeout=60)
    try:
        engine.train_batch(iter(data(0, 0)))
    except pk.PipelineError as err:
        return f"{type(err).__name__}: {err}"
    finally:
        engine.close()
    return ""


@pytest.mark.multirank
def test_an_executor_returning_something_else_is_a_config_error(tmp_path):
    (text,) = run_ranks(_bad_return_worker, 1, timeout=300)
    assert "returned str, expected (outputs0, loss0)" in text, text


def _executor(fn, model_size=1, shard_size=1, skips=False):
    return PairedExecutor(object(), fn, where="stage 1", skips=skips,
                          sharded=model_size > 1 or shard_size > 1)


def test_the_executor_refuses_what_it_cannot_run_by_name():
    _executor(sequential, model_size=2)  # one after the other: any stage
    with pytest.raises(pk.ConfigError, match="stage 1: 'overlap_all_to_all' runs a pair's "
                                             "halves at the same time"):
        _executor(pk.overlap_all_to_all, model_size=2)
    with pytest.raises(pk.ConfigError, match="tensor-parallel or sharding collectives"):
        _executor(pk.overlap_all_to_all, shard_size=2)
    with pytest.raises(pk.ConfigError, match="overlapped_forward_backward with skip "
                                             "connections"):
        _executor(sequential, skips=True)
    with pytest.raises(pk.ConfigError, match="is a int, not a callable"):
        _executor(3)


def test_the_executor_uses_its_protocol_only_and_the_runtime_provides_it():
    from types import SimpleNamespace

    from pipekernel.stage.paired import PairedStage
    from pipekernel.stage.runtime import StageRuntime
    members = {n for n, v in vars(PairedStage).items()
               if inspect.isfunction(v) and not n.startswith("_")}
    assert members <= set(dir(StageRuntime)), members - set(dir(StageRuntime))
    returns = {"forward_inputs": SimpleNamespace(inputs=torch.ones(1)),
               "backward_roots": (None, [], []), "criterion": (None, None)}
    calls = []

    class Strict:  # any attribute outside PairedStage fails the run
        def __getattribute__(self, name):
            assert name in members, f"the executor read {name!r}, not in PairedStage"
            return lambda *args, **kw: calls.append(name) or returns.get(name)

    pair = ForwardBackward(Forward(0, 0, 0), Backward(1, 1, 1))
    PairedExecutor(Strict(), None, where="stage 0").run(pair)
    assert calls == ["forward", "backward"]
    calls.clear()
    PairedExecutor(Strict(), sequential, where="stage 0").run(pair)
    assert calls == ["forward_inputs", "backward_begin", "backward_roots", "criterion",
                     "run_part", "forward_done", "backward_done"]


# -- layer 0: the instruction, the schedule, the program ------------------------------------

def test_forward_backward_round_trips_and_refuses_bad_halves():
    pair = ForwardBackward(Forward(4, 1, 0), Backward(1, 2, 1))
    assert str(pair) == "F4+B1c1"
    assert parse("F4+B1c1") == ForwardBackward(Forward(4), Backward(1, 0, 1))
    with pytest.raises(pk.ConfigError, match="pairs a Forward with a Backward, got Forward"):
        ForwardBackward(Forward(0), BackwardInput(1))
    with pytest.raises(pk.ConfigError, match="pairs a part with itself"):
        ForwardBackward(Forward(2, 0, 1), Backward(2, 0, 1))


def test_dualpipev_pairs_as_deepseek_does_and_unpairs_to_the_two_steps():
    for stages, micro_batches in ((2, 4), (3, 7), (4, 12)):
        for rank in range(stages):
            order = dualpipev_order(stages, rank, micro_batches)
            pairs = dualpipev_pairs(stages, rank, micro_batches)
            # phase 4 and 5 pair every F with the B after it, but the last rank's first
            steady = micro_batches - 2 * stages + rank + 1
            expected = 2 * steady + (stages - rank - 1) - (rank == stages - 1)
            assert len(pairs) == expected, (stages, rank)
            assert all(order[i][0] == "F" and order[i + 1][0] == "B"
                       and order[i][1] != order[i + 1][1] for i in pairs)
            steps = DualPipeV(stages, rank, micro_batches).steps()
            assert sum(isinstance(i, ForwardBackward) for s in steps for i in s) == len(pairs)
            flat = [i for s in unpair(steps) for i in s]
            kinds = {"Forward": "F", "Backward": "B", "BackwardInput": "I",
                     "BackwardWeight": "W"}
            ops = [(kinds[type(i).__name__], i.chunk, i.micro_batch) for i in flat
                   if type(i).__name__ in kinds]
            assert ops == list(order)
        simulate(DualPipeV, stages, micro_batches, 2)  # the paired steps are proven


def test_compile_program_keeps_or_splits_the_pairs():
    paired = compile_program(DualPipeV, stage=0, num_stages=2, micro_batches=4, chunks=2,
                             placement="v")
    apart = compile_program(DualPipeV, stage=0, num_stages=2, micro_batches=4, chunks=2,
                            placement="v", paired=False)
    assert any(isinstance(i, ForwardBackward) for i in paired.stream)
    assert not any(isinstance(i, ForwardBackward) for i in apart.stream)
    assert len(apart.stream) == len(paired.stream) + _pairs_on(0)


def test_a_paired_cost_shortens_the_simulated_batch():
    base = simulate(DualPipeV, 4, 12, 2)
    faster = simulate(DualPipeV, 4, 12, 2, costs={ForwardBackward: 1.5})
    assert faster.makespan < base.makespan
    kinds = {type(i) for row in faster.timeline for _, _, i in row}
    assert ForwardBackward not in kinds  # the timeline shows the halves


def _recv_posting(program) -> dict:
    """Each receive's ``(class, chunk, micro-batch)``: the compute halves run before the
    point it is posted at, and before the point it is waited at."""
    halves, before = [], []
    for ins in program.stream:
        before.append(len(halves))
        halves += list(ins.halves) if isinstance(ins, ForwardBackward) else (
            [ins] if type(ins).__name__ in ("Forward", "Backward", "BackwardInput",
                                            "BackwardWeight") else [])
    out = {}
    for index, at in ((n, at) for n, group in enumerate(program.posts) for at in group):
        ins = program.stream[at]
        if type(ins).__name__.startswith("Recv"):
            out[(type(ins), ins.chunk, ins.micro_batch)] = (before[index], before[at])
    return out


def test_pairs_post_the_halves_receives_where_the_two_steps_did():
    """The plan of a paired program posts every receive where the two steps' plan did;
    a gradient's is waited on (and so may be posted) one compute earlier."""
    for stages, micro_batches in ((2, 4), (3, 6), (4, 9)):
        for stage in range(stages):
            kw = dict(stage=stage, num_stages=stages, micro_batches=micro_batches,
                      chunks=2, placement="v")
            paired = _recv_posting(compile_program(DualPipeV, **kw))
            apart = _recv_posting(compile_program(DualPipeV, paired=False, **kw))
            assert paired.keys() == apart.keys()
            for key, (posted, waited) in paired.items():
                # as the two steps did, or one compute earlier: a pair waits on both
                # halves' receives before its forward half (DualPipe's order)
                assert apart[key][0] - 1 <= posted <= apart[key][0], (stage, key)
                assert apart[key][1] - 1 <= waited <= apart[key][1], (stage, key)
                if key[0].__name__ == "RecvActivation":
                    assert (posted, waited) == apart[key]


def test_the_simulator_runs_pairs_as_the_engine_does():
    """By default ``simulate`` runs each ``ForwardBackward`` as its two steps, the engine's
    default program (the frozen grid of tests/test_simulator_frozen.py holds dualpipev's
    answers from before it paired); ``paired=True``, or a cost for the pair, runs it as one
    step, which moves the forward's sends after the backward."""
    from pipekernel.schedules import simulate
    from pipekernel.schedules.instructions import Backward, Forward, ForwardBackward

    class Unpaired(DualPipeV):
        def steps(self):
            return unpair(super().steps())

    for stages, micro_batches in ((2, 6), (4, 12)):
        default = simulate(DualPipeV, stages, micro_batches, 2)
        explicit = simulate(Unpaired, stages, micro_batches, 2, paired=True)
        assert default.timeline == explicit.timeline and default.waits == explicit.waits
        together = simulate(DualPipeV, stages, micro_batches, 2, paired=True)
        assert together.makespan > default.makespan
        priced = simulate(DualPipeV, stages, micro_batches, 2,
                          costs={Forward: 1.0, Backward: 1.0, ForwardBackward: 2.0})
        assert priced.makespan == together.makespan


# -- zbv: pairs where its plan puts a forward and the other chunk's backward side by side --

ZBV_MICRO = 8
_KINDS = {"Forward": "F", "Backward": "B", "BackwardInput": "I", "BackwardWeight": "W"}


def _ops(steps) -> list:
    return [(_KINDS[type(i).__name__], i.chunk, i.micro_batch) for s in steps for i in s
            if type(i).__name__ in _KINDS]


def _zbv_pairs_on(rank: int, stages: int = 2, micro_batches: int = ZBV_MICRO) -> int:
    return len(ZBV(stages, rank, micro_batches).pairs())


def test_zbv_pairs_a_forward_with_the_other_chunks_backward_and_keeps_its_plan_apart():
    for stages, micro_batches, expected in ((2, 8, (0, 3)), (4, 8, (0, 3, 3, 2)),
                                            (4, 16, (0, 11, 8, 7))):
        for rank in range(stages):
            zbv = ZBV(stages, rank, micro_batches)
            order, pairs, plan = list(zbv.order()), zbv.pairs(), list(zbv.plan_order())
            assert len(pairs) == expected[rank], (stages, rank, sorted(pairs))
            for i in pairs:  # a forward, then a full backward of the other chunk
                (f, fc, fm), (b, bc, bm) = order[i], order[i + 1]
                assert (f, b) == ("F", "B") and fc != bc and fm != bm, (stages, rank, i)
            steps = zbv.steps()
            fb = [i for s in steps for i in s if isinstance(i, ForwardBackward)]
            assert [(p.forward.chunk, p.forward.micro_batch, p.backward.chunk,
                     p.backward.micro_batch) for p in fb] == [
                (order[i][1], order[i][2], order[i + 1][1], order[i + 1][2])
                for i in sorted(pairs)]
            assert _ops(unpair(steps)) == order
            # every part's backward: the pair's B, or the plan's I and W; nothing else moved
            merged = {(c, m) for k, c, m in order if k == "B"}
            assert [op for op in order if op[0] != "W"] == [
                ("B", c, m) if k == "I" and (c, m) in merged else (k, c, m)
                for k, c, m in plan if k != "W"]
            assert sorted(op for op in plan if op[0] != "W" or (op[1], op[2]) not in merged) \
                == sorted(("I" if k == "B" else k, c, m) for k, c, m in order)
            # without an overlapping executor a stage runs the plan, I and W apart
            apart = zbv.unpaired_steps()
            assert _ops(apart) == plan
            assert not any(isinstance(i, (Backward, ForwardBackward)) for s in apart for i in s)


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_zbv_paired_plans_are_proven_and_need_no_more_buffers(stages):
    for micro_batches in range(1, 13):
        together = simulate(ZBV, stages, micro_batches, 2, paired=True)
        declared = tuple(ZBV(stages, s, micro_batches).num_buffers() for s in range(stages))
        assert all(a <= b for a, b in zip(together.buffers, declared)), (micro_batches,)
        apart = simulate(ZBV, stages, micro_batches, 2)
        assert apart.buffers == declared
        if any(ZBV(stages, s, micro_batches).pairs() for s in range(stages)):
            # the halves one after the other hold the forward's sends: slower, as dualpipev
            assert together.makespan > apart.makespan
            priced = simulate(ZBV, stages, micro_batches, 2,
                              costs={ForwardBackward: 1.0})  # an overlap cheaper than F alone
            assert priced.makespan < together.makespan


@pytest.mark.exhaustive
def test_zbv_paired_plans_are_proven_at_every_size():
    for stages in range(2, 9):
        for micro_batches in range(1, 33):
            simulate(ZBV, stages, micro_batches, 2, paired=True)


def test_compile_program_keeps_zbvs_pairs_or_runs_its_plan():
    kw = dict(stage=1, num_stages=2, micro_batches=ZBV_MICRO, chunks=2, placement="v")
    paired = compile_program(ZBV, **kw)
    apart = compile_program(ZBV, paired=False, **kw)
    assert sum(isinstance(i, ForwardBackward) for i in paired.stream) == _zbv_pairs_on(1)
    assert [str(i) for i in apart.stream] == [
        str(i) for s in ZBV(2, 1, ZBV_MICRO).unpaired_steps() for i in s]
    assert paired.num_buffers == apart.num_buffers


def _zbv_worker() -> dict:
    torch.set_num_threads(1)
    return {name: _train(fn, schedule="zbv", micro=ZBV_MICRO)[:3]
            for name, fn in (("default", None), ("sequential", sequential),
                             ("overlap", pk.overlap_all_to_all), ("recording", recording))}


@pytest.mark.multirank
def test_zbv_paired_executors_train_bit_for_bit_like_its_plan(tmp_path):
    """The default runs zbv's plan (I and W apart), as before it paired, which
    tests/test_parity_schedules.py holds to one process; a model's executor runs the pairs
    (the forward, then a full backward) and trains bit for bit the same."""
    results = run_ranks(_zbv_worker, 2, timeout=600)
    assert _zbv_pairs_on(1) > 0
    for rank, result in enumerate(results):
        for name in ("sequential", "overlap", "recording"):
            assert _same(result[name], result["default"]), (rank, name)
        assert result["recording"][2] == _zbv_pairs_on(rank) * STEPS  # once per pair
        assert result["default"][2] == 0


def _moe_zbv_worker() -> dict:
    torch.set_num_threads(1)
    return {name: _train(fn, experts=4, ep=2, schedule="zbv", micro=ZBV_MICRO)
            for name, fn in (("default", None), ("overlap", pk.overlap_all_to_all),
                             ("recording", recording))}


@pytest.mark.multirank
def test_zbv_overlapped_expert_all_to_all_is_bit_exact_on_pp2_ep2(tmp_path):
    results = run_ranks(_moe_zbv_worker, 4, timeout=600)
    for rank, result in enumerate(results):
        assert _same(result["overlap"], result["default"]), rank
        assert result["overlap"][3] == 2  # one expert process group per chunk of the V
    # stage 1 (ranks 2 and 3 under PP2 x EP2: the expert axis inside the stage) pairs
    assert sorted(r["recording"][2] for r in results) == [0, 0] + [_zbv_pairs_on(1) * STEPS] * 2


def test_unpaired_steps_are_unpair_of_the_paired_steps():
    """An ordered schedule's ``unpaired_steps()`` (built from its order without pairs where
    that is the same, so no pair is made to be split again) equals :func:`unpair` of its
    ``steps()``, raises what building its pairs raises, and keeps its buffers."""
    from pipekernel.schedules.ordered import OrderedSchedule

    for stages, micro_batches in ((2, 4), (3, 7), (4, 12), (5, 16)):
        for rank in range(stages):
            schedule = DualPipeV(stages, rank, micro_batches)
            assert schedule.unpaired_steps() == unpair(schedule.steps())
            paired = DualPipeV(stages, rank, micro_batches)
            paired.steps()  # its buffers counted from the paired steps
            assert schedule.num_buffers() == paired.num_buffers()

    class Custom(OrderedSchedule):
        name, placement, min_chunks, max_chunks, default_chunks = "custom", "v", 2, 2, 2
        ORDER, PAIRS = (), frozenset()

        def order(self):
            return self.ORDER

        def pairs(self):
            return self.PAIRS

    base = [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("B", 1, 0), ("F", 1, 1), ("B", 0, 0),
            ("B", 1, 1), ("B", 0, 1)]
    cases = [
        (base, {2, 4}),                      # two pairs
        (base, {2, 3}),                      # i + 1 of a pair named too: left as it is
        (base, {2, 40}),                     # past the end: never looked at
        (base, {-1, 0}),                     # no step has a negative index; 0 is an error
        (base, {-1, 2}),
        (base[:6], {4}),                     # the last op is a pair's backward
        (base, {0}),                         # not an F followed by a B: the error
        (base, {6}),
        ([("F", 0, 0), ("B", 0, 0)], {0}),   # a part paired with itself: the error
        ([], set()),
    ]
    for order, pairs in cases:
        Custom.ORDER, Custom.PAIRS = tuple(order), frozenset(pairs)
        expected = error = None
        try:
            expected = unpair(Custom(2, 1, 2).steps())
        except (pk.ScheduleError, pk.ConfigError) as e:
            error = e
        if error is None:
            assert Custom(2, 1, 2).unpaired_steps() == expected, (order, pairs)
        else:
            with pytest.raises(type(error)) as got:
                Custom(2, 1, 2).unpaired_steps()
            assert str(got.value) == str(error)
