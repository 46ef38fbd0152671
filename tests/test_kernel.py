"""The instruction loop, the wire protocol and the topology, without processes."""
from __future__ import annotations

import pytest
import torch

import pipekernel as pk
from pipekernel.plugin import Kernel, make_plugin_manager
from pipekernel.schedules import instructions as isa
from pipekernel.grid.topology import Topology
from pipekernel.comm.wire import decode, encode, flatten, unflatten


class Recorder:
    def __init__(self):
        self.seen = []

    @pk.hookimpl
    def pipekernel_before_instruction(self, instruction, stage):
        self.seen.append(("before", str(instruction), stage))

    @pk.hookimpl
    def pipekernel_after_instruction(self, instruction, seconds):
        self.seen.append(("after", str(instruction), seconds))


def test_kernel_dispatches_in_order_and_calls_hooks():
    done = []
    recorder = Recorder()
    pm = make_plugin_manager([recorder], autoload=False)
    clock = [0.0]  # seconds pass only inside handlers: 2 per forward, 0.5 per send

    def forward(i):
        clock[0] += 2.0
        done.append(f"f{i.micro_batch}")

    def other(i):
        clock[0] += 0.5
        done.append(f"any:{i}")

    kernel = Kernel({isa.Forward: forward, isa.MicroBatchInstruction: other},
                       hook=pm.hook, rank=3, stage=1, clock=lambda: clock[0])
    kernel.run([[isa.Forward(0), isa.SendActivation(0)], [isa.Forward(1)]])
    assert done == ["f0", "any:SEND_F0", "f1"]  # MRO lookup serves subclasses
    assert recorder.seen == [("before", "F0", 1), ("after", "F0", 2.0),
                             ("before", "SEND_F0", 1), ("after", "SEND_F0", 0.5),
                             ("before", "F1", 1), ("after", "F1", 2.0)]
    assert kernel.position is None


def test_kernel_walks_a_plan_by_index_and_resolves_its_handlers_once():
    from pipekernel.schedules.program import plan_communication

    steps = [[isa.LoadMicroBatch(0), isa.Forward(0)], [isa.SendActivation(0)],
             [isa.LoadMicroBatch(1), isa.Forward(1)], [isa.SendActivation(1)]]
    plan = plan_communication(steps, stage=0, num_stages=2)
    entered, done = [], []

    class Table(dict):  # counts the lookups the kernel makes in the dispatch table
        lookups = 0

        def get(self, key, default=None):
            Table.lookups += 1
            return super().get(key, default)

    kernel = Kernel({isa.MicroBatchInstruction: lambda i: done.append(str(i))},
                       enter=entered.append)
    kernel.handlers = Table(kernel.handlers)
    for _ in range(3):
        kernel.run(plan)
    assert entered == [0, 1, 2, 3, 4, 5] * 3  # the stream index, before each handler
    assert done == [str(i) for i in plan.stream] * 3
    # one MRO walk per instruction type (3 types, 2-3 classes each), none per instruction
    assert Table.lookups <= 9
    with pytest.raises(pk.InstructionError, match=r"step 1, micro-batch 0"):
        Kernel({isa.LoadMicroBatch: lambda i: None, isa.Forward: lambda i: None,
                   isa.SendActivation: lambda i: 1 / 0}).run(plan)


def test_one_container_walker_keeps_every_container():
    from collections import namedtuple

    from pipekernel.nested import map_tensors, tensors_of
    from pipekernel.nested import tensors_to as _to  # the one mover the oracle uses

    Pair = namedtuple("Pair", "a b")
    obj = {"x": [torch.ones(1), (torch.zeros(2), None)], "p": Pair(torch.ones(3), "s")}
    doubled = map_tensors(lambda t: t * 2, obj)
    assert list(doubled) == ["x", "p"] and isinstance(doubled["x"], list)
    assert isinstance(doubled["x"][1], tuple) and doubled["x"][1][1] is None
    assert isinstance(doubled["p"], Pair) and doubled["p"].b == "s"
    assert [t.numel() for t in tensors_of(doubled)] == [1, 2, 3]
    assert float(doubled["p"].a.sum()) == 6.0
    moved = _to(obj, "cpu")  # the test oracle's mover keeps dicts (it dropped them before)
    assert isinstance(moved, dict) and torch.equal(moved["x"][0], obj["x"][0])


def test_kernel_missing_handler_names_rank_stage_step_and_instruction():
    kernel = Kernel({isa.Forward: lambda i: None}, rank=5, stage=2)
    with pytest.raises(pk.InstructionError) as info:
        kernel.run([[isa.Forward(0)], [isa.OptimizerStep()]])
    text = str(info.value)
    assert text.startswith("[rank 5, stage 2, schedule step 1, instruction STEP] no handler for "
                           "instruction OptimizerStep")
    assert "pipekernel_register_instructions" in text and "Forward" in text


def test_kernel_failing_handler_is_wrapped_with_its_place_and_cause():
    def broken(instruction):
        raise ZeroDivisionError("bad math")

    kernel = Kernel({isa.Backward: broken}, rank=0, stage=0)
    with pytest.raises(pk.InstructionError, match=r"micro-batch 4, instruction B4\] "
                       r"ZeroDivisionError in the handler of B4: bad math") as info:
        kernel.run([[isa.Backward(4, buffer=1)]])
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    assert kernel.position == (0, isa.Backward(4, buffer=1))


def test_kernel_without_hook_implementations_skips_hook_calls():
    pm = make_plugin_manager(autoload=False)
    kernel = Kernel({isa.Forward: lambda i: None}, hook=pm.hook)
    assert kernel._hooks() == (None, None)


def test_instruction_strings_round_trip():
    for instr in [isa.Forward(3), isa.Backward(0, chunk=1), isa.SendGrad(12), isa.RecvActivation(2),
                  isa.LoadMicroBatch(1), isa.ReduceGrads(), isa.OptimizerStep()]:
        assert isa.parse(str(instr)) == instr
    with pytest.raises(ValueError, match="known prefixes"):
        isa.parse("X3")


def test_wire_metadata_round_trips_every_dtype_and_nesting():
    value = (torch.randn(2, 3, requires_grad=True),
             (torch.ones(4, dtype=torch.bool), torch.arange(3)),
             torch.zeros((), dtype=torch.bfloat16), torch.empty(0, 5, dtype=torch.float16))
    tensors, structure = flatten(value)
    specs, decoded = decode(encode(tensors, structure))
    assert decoded == structure
    assert [(d, g, s) for d, g, s in specs] == [(t.dtype, t.requires_grad, tuple(t.shape))
                                                for t in tensors]
    rebuilt = unflatten(tensors, decoded)
    assert rebuilt[1][0] is tensors[1] and rebuilt[3] is tensors[4]


def test_wire_rejects_non_tensor_values_with_a_fix():
    with pytest.raises(pk.DataError, match=r"inputs\[1\] is a str(.|\n)*how to fix"):
        flatten((torch.ones(1), "text"), "inputs")


def test_topology_rank_order_keeps_pipelines_adjacent():
    topo = Topology.from_world(8, rank=5, num_stages=4, order="tp-pp-dp")
    assert (topo.pipe_size, topo.data_size) == (4, 2)
    assert (topo.data_rank, topo.stage) == (1, 1)
    assert topo.pipe_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert topo.data_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.stage_groups([0, 3]) == [[0, 3], [4, 7]]
    assert topo.stage_rank(3) == 7


def test_topology_errors():
    with pytest.raises(pk.ConfigError, match="world size 6 is not divisible by 4"):
        Topology.from_world(6, 0, 4)
    with pytest.raises(pk.ConfigError, match="data_parallel_size=3 does not match"):
        Topology.from_world(4, 0, 2, data_parallel_size=3)


def test_errors_pickle_with_their_location():
    import pickle
    err = pk.TransportTimeout("late", peer=3, rank=1, hint="wait longer").locate(stage=2)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is pk.TransportTimeout and back.peer == 3 and str(back) == str(err)


def test_errors_say_which_batch_in_words():
    # the engine tells the kernel which batch runs: a train step or an eval after one
    kernel = Kernel({isa.Forward: lambda i: None}, rank=1, stage=0)
    with pytest.raises(pk.InstructionError) as info:
        kernel.run([[isa.Forward(0)], [isa.OptimizerStep()]], train_step=126)
    assert str(info.value).startswith("[rank 1, stage 0, train step 126 (1-based), schedule step 1, "
                                      "instruction STEP] no handler for ")
    with pytest.raises(pk.InstructionError) as info:
        kernel.run([[isa.OptimizerStep()]], eval_after=125)
    assert str(info.value).startswith("[rank 1, stage 0, eval after train step 125, "
                                      "schedule step 0, instruction STEP] ")
