"""The kernel calls the per-instruction hooks as pluggy would, on its fast path too."""
from __future__ import annotations

import pytest

import pipekernel as pk
from pipekernel.plugin import make_plugin_manager
from pipekernel.schedules import instructions as isa
from pipekernel.errors import InstructionError, TransportTimeout
from pipekernel.kernel.loop import Kernel


class Recorder:
    def __init__(self, name, log):
        self.name, self.log = name, log

    @pk.hookimpl
    def pipekernel_before_instruction(self, instruction):
        self.log.append((self.name, "before", str(instruction)))

    @pk.hookimpl
    def pipekernel_after_instruction(self, stage, seconds, instruction):
        self.log.append((self.name, "after", str(instruction), stage))


class Wrapper:
    def __init__(self, log):
        self.log = log

    @pk.hookimpl(wrapper=True)
    def pipekernel_after_instruction(self, instruction):
        self.log.append(("wrapper", "enter", str(instruction)))
        result = yield
        self.log.append(("wrapper", "exit", str(instruction)))
        return result


def run(plugins, steps, handlers=None):
    pm = make_plugin_manager(plugins, autoload=False)
    handlers = handlers or {isa.Forward: lambda i: None}
    Kernel(handlers, hook=pm.hook, rank=0, stage=3).run(steps)


def test_plain_hooks_last_registered_first_with_argument_subsets():
    log = []
    run([Recorder("a", log), Recorder("b", log)], [[isa.Forward(0)]])
    assert log == [("b", "before", "F0"), ("a", "before", "F0"),
                   ("b", "after", "F0", 3), ("a", "after", "F0", 3)]


def test_wrappers_keep_pluggy_semantics():
    log = []
    run([Recorder("a", log), Wrapper(log)], [[isa.Forward(1)]])
    assert log == [("a", "before", "F1"), ("wrapper", "enter", "F1"),
                   ("a", "after", "F1", 3), ("wrapper", "exit", "F1")]


class Diagnose:
    @pk.hookimpl
    def pipekernel_instruction_error(self, instruction, error):
        error.add_detail(f"seen by a plugin at {instruction}")


def test_instruction_error_hook_adds_details_to_the_located_error():
    def fail(instruction):
        raise TransportTimeout("waited too long", peer=2)

    with pytest.raises(TransportTimeout) as info:
        run([Diagnose()], [[isa.Forward(0)], [isa.RecvGrad(4)]],
            {isa.Forward: lambda i: None, isa.RecvGrad: fail})
    text = str(info.value)
    assert "[rank 0, stage 3, schedule step 1, micro-batch 4, instruction RECV_B4]" in text
    assert text.endswith("seen by a plugin at RECV_B4") and info.value.peer == 2

    def crash(instruction):
        raise ValueError("boom")

    with pytest.raises(InstructionError, match="(?s)boom.*seen by a plugin at F0"):
        run([Diagnose()], [[isa.Forward(0)]], {isa.Forward: crash})


def test_errors_keep_details_and_peer_across_processes():
    import pickle

    err = TransportTimeout("late", peer=5, rank=1).add_detail("positions: ...")
    copy = pickle.loads(pickle.dumps(err))
    assert copy.peer == 5 and copy.details == ["positions: ..."] and str(copy) == str(err)
