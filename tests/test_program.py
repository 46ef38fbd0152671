"""Layer 0/1: the compiled program of a stage (pipekernel.schedules.program) and how the
kernel reads it. No processes."""
from __future__ import annotations

import dataclasses

import pytest

import pipekernel as pk
from pipekernel.plugin import Kernel
from pipekernel.schedules import BUILTIN_SCHEDULES
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
    assert program.posted_at() == {2: 2, 4: 4}


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
