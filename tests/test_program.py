"""Layer 0/1: the compiled program of a stage (pipekernel.schedules.program) and how the
kernel reads it. No processes."""
from __future__ import annotations

import dataclasses

import pytest

import pipekernel as pk
from pipekernel.plugin import Kernel
from pipekernel.schedules import BUILTIN_SCHEDULES, simulate
from pipekernel.schedules import instructions as isa
from pipekernel.schedules.comm import P2P, SENDS
from pipekernel.schedules.program import compile_program, plan_communication

CASES = [("1f1b", 4, 8, 1, ()), ("gpipe", 3, 3, 1, ()), ("interleaved", 4, 8, 2, ()),
         ("zb-h1", 4, 8, 1, ()), ("zbv", 3, 4, 2, ()), ("dualpipev", 2, 4, 2, ()),
         ("1f1b", 2, 3, 1, ((0, 1),))]


@pytest.mark.parametrize("name,stages,micro_batches,chunks,skips", CASES)
def test_a_program_names_every_transfer_by_index(name, stages, micro_batches, chunks, skips):
    cls = BUILTIN_SCHEDULES[name]
    for stage in range(stages):
        program = compile_program(cls, stage=stage, num_stages=stages,
                                  micro_batches=micro_batches, chunks=chunks,
                                  placement=getattr(cls, "placement", "loop"), skips=skips)
        stream = program.stream
        assert program.schedule == name and program.trains == cls.trains
        assert program.micro_batches == micro_batches and program.skips == tuple(skips)
        assert [ins for step in program.steps for ins in step] == list(stream)
        posted = [i for group in program.posts for i in group]
        remote = [i for i, ins in enumerate(stream)
                  if isinstance(ins, P2P) and program.peers[i] is not None
                  and not program.local[i]]
        assert sorted(posted) == remote  # each remote transfer posted once, by its index
        for at, group in enumerate(program.posts):
            assert list(group) == sorted(group) and all(i >= at for i in group)
            assert all(i == at for i in group if isinstance(stream[i], SENDS))
        for i, number in enumerate(program.channel_of):
            assert (number is not None) == (i in remote)
            if number is not None:
                spec = program.channels[number]
                ins = stream[i]
                assert spec.key == (type(ins), ins.chunk, getattr(ins, "peer", None))
                assert (spec.peer_stage, spec.lane) == (program.peers[i][0], program.lanes[i])
        assert len({spec.key for spec in program.channels}) == len(program.channels)
        weights = [i for i, ins in enumerate(stream)
                   if isinstance(ins, (isa.Backward, isa.BackwardWeight))]
        assert program.last_weight == weights[-1]
        assert program.last_weight_chunk == stream[weights[-1]].chunk


def test_a_program_is_a_frozen_value_and_equal_programs_compare_equal():
    kw = dict(stage=1, num_stages=2, micro_batches=4)
    program = compile_program(BUILTIN_SCHEDULES["1f1b"], **kw)
    assert program == compile_program(BUILTIN_SCHEDULES["1f1b"], **kw)
    with pytest.raises(dataclasses.FrozenInstanceError):
        program.last_weight = 0  # type: ignore[misc]
    inference = compile_program(BUILTIN_SCHEDULES["inference"], **kw)
    assert inference.last_weight == -1 and inference.last_weight_chunk is None


def test_one_instruction_object_at_two_places_keeps_both_places():
    """Posting points are indices: a stream holding one instruction object twice (a
    hand-written schedule may reuse one) is planned place by place, never by identity."""
    send = isa.SendActivation(0)
    steps = [[isa.LoadMicroBatch(0), isa.Forward(0), send], [isa.Forward(0), send]]
    program = plan_communication(steps, stage=0, num_stages=2, schedule="custom",
                                 trains=False, num_buffers=1)
    assert program.posts[2] == (2,) and program.posts[4] == (4,)
    assert program.channel_of[2] == program.channel_of[4] == 0
    assert [group for group in program.posts if group] == [(2,), (4,)]


def test_the_kernel_runs_the_handlers_resolved_for_a_program():
    program = compile_program(BUILTIN_SCHEDULES["gpipe"], stage=0, num_stages=2,
                              micro_batches=2)
    table, done = {isa.Instruction: lambda ins: done.append(("table", str(ins)))}, []
    kernel = Kernel(table)
    handlers = kernel.resolve(program.stream)
    assert handlers is not None and len(handlers) == len(program.stream)
    mine = tuple((lambda ins, n=n: done.append((n, str(ins)))) for n in range(len(handlers)))
    kernel.run(program, mine)
    assert done == [(n, str(ins)) for n, ins in enumerate(program.stream)]
    assert Kernel({isa.Forward: lambda ins: None}).resolve(program.stream) is None
    with pytest.raises(pk.InstructionError, match="no handler for instruction"):
        Kernel({isa.Forward: lambda ins: None}).run(program)


@pytest.mark.parametrize("name,stages,chunks", [("1f1b", 2, 1), ("interleaved", 2, 2),
                                                ("zbv", 2, 2), ("dualpipev", 2, 2)])
def test_a_sharded_program_holds_fsdp_timing_as_instructions(name, stages, chunks):
    """FSDP2's gathers and reductions are instructions: one Unshard() first, after each
    compute an Unshard of the next compute that gathers (a weight pass only at position 0,
    both halves of a pair), ReduceShardedGrads after the last weight-gradient instruction
    and the sends right after it; an evaluation ends with Reshard. Nothing else moves."""
    cls = BUILTIN_SCHEDULES[name]
    kw = dict(num_stages=stages, micro_batches=4, chunks=chunks,
              placement=getattr(cls, "placement", "loop"))
    fsdp = (isa.Unshard, isa.Reshard, isa.ReduceShardedGrads)
    computes = (isa.Forward, isa.Backward, isa.BackwardInput, isa.BackwardWeight,
                isa.ForwardBackward)
    for stage in range(stages):
        plain = compile_program(cls, stage=stage, **kw)
        sharded = compile_program(cls, stage=stage, sharded=True, **kw)
        stream = sharded.stream
        assert [i for i in stream if not isinstance(i, fsdp)] == list(plain.stream)
        assert stream[0] == isa.Unshard() and isa.Reshard() not in stream
        reduce, last = stream.index(isa.ReduceShardedGrads()), sharded.last_weight
        assert stream.count(isa.ReduceShardedGrads()) == 1 and reduce > last
        assert sharded.step_of[reduce] == sharded.step_of[last]
        assert all(isinstance(ins, (isa.Unshard, *SENDS)) for ins in stream[last + 1:reduce])
        assert reduce + 1 == len(stream) or not isinstance(stream[reduce + 1], SENDS)
        assert stream.index(isa.OptimizerStep()) > reduce
        first = 0 if stage == 0 else None  # position 0: stage 0's chunk 0 (loop and v)
        gathers = [ins for ins in stream if isinstance(ins, computes)
                   and (not isinstance(ins, isa.BackwardWeight) or ins.chunk == first)]
        for i, ins in enumerate(stream):
            if not isinstance(ins, computes):
                continue
            after = [x for x in stream[i + 1:i + 3] if isinstance(x, isa.Unshard)]
            nxt = next((x for x in stream[i + 1:] if x in gathers), None)
            if nxt is None:
                assert not after, (i, ins)
                continue
            halves = nxt.halves if isinstance(nxt, isa.ForwardBackward) else (nxt,)
            assert after == [isa.Unshard(h.chunk, isinstance(h, isa.Forward))
                             for h in halves], (i, ins)
        assert sharded.step_of[-1] == plain.step_of[-1]  # each in the step it follows
    evaluation = compile_program(BUILTIN_SCHEDULES["inference"], stage=0, num_stages=2,
                                 micro_batches=2, sharded=True)
    assert evaluation.stream[0] == isa.Unshard() and evaluation.stream[-1] == isa.Reshard()
    assert isa.ReduceShardedGrads() not in evaluation.stream


def test_simulate_proves_and_times_the_sharded_program():
    """The simulator runs the same sharded programs the engine runs: the FSDP2
    instructions are in its steps, and their costs delay the stage."""
    cls = BUILTIN_SCHEDULES["1f1b"]
    plain = simulate(cls, 2, 4)
    sharded = simulate(cls, 2, 4, sharded=True)
    assert sharded.makespan == plain.makespan  # free by default (not compute)
    for stage, steps in enumerate(sharded.steps):
        assert [ins for step in steps for ins in step] == list(compile_program(
            cls, stage=stage, num_stages=2, micro_batches=4, sharded=True).stream)
    # the reduction after the last backward's step holds up the optimizer step (a world
    # collective), once: stage 1's own, after its last SEND_B, no longer delays stage 0
    slow = simulate(cls, 2, 4, sharded=True, costs={isa.ReduceShardedGrads: 5.0})
    assert slow.makespan == plain.makespan + 5.0


@pytest.mark.parametrize("name,stages,chunks", [("1f1b", 2, 1), ("interleaved", 2, 2),
                                                ("zb-h1", 2, 1), ("zbv", 2, 2),
                                                ("dualpipev", 2, 2)])
@pytest.mark.parametrize("paired", [False, True])
def test_a_replicated_program_holds_the_reducers_points_as_instructions(name, stages, chunks,
                                                                        paired):
    """The data-parallel reducer's overlap is instructions: ArmGradReduce(chunk of the last
    weight-gradient instruction) right before it, LaunchGradReduce after it and the sends
    that follow it, in its step; ReduceGrads stays where it was. Nothing else moves; with FSDP2's too, they stand
    next to the weight-gradient instruction (after the shards' instructions are added)."""
    cls = BUILTIN_SCHEDULES[name]
    kw = dict(num_stages=stages, micro_batches=4, chunks=chunks, paired=paired,
              placement=getattr(cls, "placement", "loop"))
    points = (isa.ArmGradReduce, isa.LaunchGradReduce)
    for stage in range(stages):
        for sharded in (False, True):
            plain = compile_program(cls, stage=stage, sharded=sharded, **kw)
            dp = compile_program(cls, stage=stage, sharded=sharded, data_parallel=True, **kw)
            stream = dp.stream
            assert [i for i in stream if not isinstance(i, points)] == list(plain.stream)
            last = dp.last_weight
            half = stream[last]
            half = half.backward if isinstance(half, isa.ForwardBackward) else half
            assert stream[last - 1] == isa.ArmGradReduce(half.chunk)
            launch = stream.index(isa.LaunchGradReduce())
            assert launch > last and all(isinstance(i, SENDS) for i in stream[last + 1:launch])
            assert launch + 1 == len(stream) or not isinstance(stream[launch + 1], SENDS) \
                or dp.step_of[launch + 1] != dp.step_of[launch]
            assert sum(isinstance(i, points) for i in stream) == 2
            assert dp.step_of[last - 1] == dp.step_of[last] == dp.step_of[launch]
            assert stream.index(isa.ReduceGrads()) > launch
            assert dp.step_of[-1] == plain.step_of[-1]
    evaluation = compile_program(BUILTIN_SCHEDULES["inference"], stage=0, num_stages=2,
                                 micro_batches=2, data_parallel=True)
    assert not any(isinstance(i, points) for i in evaluation.stream)
    assert str(isa.ArmGradReduce(1)) == "ARM_REDUCEc1" and str(isa.ArmGradReduce()) == \
        "ARM_REDUCE"
    assert isa.parse("ARM_REDUCEc1") == isa.ArmGradReduce(1)
    assert isa.parse("LAUNCH_REDUCE") == isa.LaunchGradReduce()


def test_simulate_proves_and_times_the_replicated_program():
    """The simulator runs the programs the engine runs under data parallelism: the
    reducer's points are in its steps, free by default, and their costs delay the stage."""
    cls = BUILTIN_SCHEDULES["1f1b"]
    plain = simulate(cls, 2, 4)
    dp = simulate(cls, 2, 4, data_parallel=True)
    assert dp.makespan == plain.makespan
    for stage, steps in enumerate(dp.steps):
        assert [ins for step in steps for ins in step] == list(compile_program(
            cls, stage=stage, num_stages=2, micro_batches=4, data_parallel=True).stream)
    # the launch stands after the last backward's sends: stage 1's no longer holds up its
    # last SEND_B (before it did, and the step grew 6), so only stage 0's own launch adds 3
    # to the batch's end
    slow = simulate(cls, 2, 4, data_parallel=True, costs={isa.LaunchGradReduce: 3.0})
    assert slow.makespan == plain.makespan + 3.0
    armed = simulate(cls, 2, 4, data_parallel=True, costs={isa.ArmGradReduce: 1.0})
    assert armed.makespan == plain.makespan + 2.0
    both = simulate(cls, 2, 4, data_parallel=True, sharded=True,
                    costs={isa.LaunchGradReduce: 3.0, isa.ReduceShardedGrads: 5.0})
    assert both.makespan > slow.makespan


def test_a_local_hand_off_names_the_receive_it_fills():
    """At the turn of a V (zbv: stage 0 holds positions 0 and 3 of 4) each local send fills
    the local receive of the same micro-batch, on the chunk it goes to."""
    cls = BUILTIN_SCHEDULES["zbv"]
    program = compile_program(cls, stage=1, num_stages=2, micro_batches=4, chunks=2,
                              placement="v")
    stream, handoffs = program.stream, program.handoffs
    sends = [i for i, ins in enumerate(stream) if program.local[i] and isinstance(ins, SENDS)]
    assert sends and [i for i, fills in enumerate(handoffs) if fills is not None] == sends
    assert len({handoffs[i] for i in sends}) == len(sends)
    for send, recv in ((i, handoffs[i]) for i in sends):
        s, r = stream[send], stream[recv]
        assert program.local[recv] and r.micro_batch == s.micro_batch and recv > send
        assert (r.chunk, program.peers[recv][1]) == (program.peers[send][1], s.chunk)
        assert type(r).__name__ == type(s).__name__.replace("Send", "Recv")
