"""Layer 0: the built-in schedules and the schedule simulator (no torch needed)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipekernel.errors import ConfigError, ScheduleError
from pipekernel.schedules.instructions import (
    Backward, BackwardInput, BackwardWeight, Forward, LoadMicroBatch, OptimizerStep,
    RecvActivation, RecvGrad, ReduceGrads, ReduceTiedGrads, SendActivation, SendGrad,
)
from pipekernel.schedules import (
    BUILTIN_SCHEDULES, GPipe, Inference, OneFOneB, Schedule, SimulationResult, format_grid,
    simulate,
)

ROOT = Path(__file__).resolve().parents[1]
SIZES = [(s, m) for s in range(1, 9) for m in range(1, 17)]


# -- every built-in schedule, every size ----------------------------------------------------

SINGLE_CHUNK = ["1f1b", "gpipe", "inference"]  # the multi-chunk ones: test_schedules_zb.py


@pytest.mark.parametrize("name", SINGLE_CHUNK)
def test_every_builtin_schedule_simulates_for_all_sizes(name):
    cls = BUILTIN_SCHEDULES[name]
    for stages, micro_batches in SIZES:
        result = simulate(cls, stages, micro_batches)
        assert isinstance(result, SimulationResult)
        assert (result.num_stages, result.micro_batches, result.chunks) == (
            stages, micro_batches, 1)


def test_registry_names_match_classes():
    from pipekernel.schedules import ZBH1, ZBH2, ZBV, DualPipeV, Interleaved1F1B, VHalf, VMin
    assert BUILTIN_SCHEDULES == {"1f1b": OneFOneB, "gpipe": GPipe, "inference": Inference,
                                 "interleaved": Interleaved1F1B, "zb-h1": ZBH1, "zb-h2": ZBH2,
                                 "zbv": ZBV, "dualpipev": DualPipeV, "v-min": VMin,
                                 "v-half": VHalf}
    assert all(cls.name == name for name, cls in BUILTIN_SCHEDULES.items())
    assert Inference.trains is False and OneFOneB.trains and GPipe.trains


def test_1f1b_in_flight_bound_and_buffers():
    for stages, micro_batches in SIZES:
        expected = tuple(min(stages - s, micro_batches) for s in range(stages))
        assert simulate(OneFOneB, stages, micro_batches).buffers == expected
        declared = tuple(OneFOneB(stages, s, micro_batches).num_buffers() for s in range(stages))
        assert declared == expected


def test_gpipe_buffers_equal_micro_batches():
    for stages, micro_batches in SIZES:
        assert simulate(GPipe, stages, micro_batches).buffers == (micro_batches,) * stages
        assert GPipe(stages, 0, micro_batches).num_buffers() == micro_batches


def test_inference_double_buffers():
    for stages, micro_batches in SIZES:
        want = min(2, micro_batches)
        assert all(Inference(stages, s, micro_batches).num_buffers() == want
                   for s in range(stages))
        assert max(simulate(Inference, stages, micro_batches).buffers) <= want


@pytest.mark.parametrize("cls", [OneFOneB, GPipe])
def test_bubble_fraction_unit_costs(cls):
    for stages, micro_batches in SIZES:
        result = simulate(cls, stages, micro_batches)
        assert result.makespan == 2 * (micro_batches + stages - 1)
        assert result.bubble_fraction == pytest.approx(
            (stages - 1) / (micro_batches + stages - 1))


def test_costs_override():
    result = simulate(GPipe, 1, 4, costs={Backward: 2.0})
    assert result.makespan == 12 and result.bubble_fraction == 0
    result = simulate(OneFOneB, 2, 2, costs={Backward: 2, SendActivation: 0.5})
    assert result.timeline[1][0][:2] == (1.5, 2.5)  # stage 1's F0 waits for the send


# -- instruction conventions ----------------------------------------------------------------

def _flat(schedule):
    return [i for step in schedule.steps() for i in step]


@pytest.mark.parametrize("cls", [OneFOneB, GPipe, Inference])
def test_instruction_conventions(cls):
    for stages, micro_batches in SIZES:
        for stage in range(stages):
            _check_conventions(cls(stages, stage, micro_batches), stages, stage)


def _check_conventions(schedule, stages, stage):
    first, last = stage == 0, stage == stages - 1
    flat = _flat(schedule)
    loads = [i for i in flat if isinstance(i, LoadMicroBatch)]
    assert len(loads) == (schedule.micro_batches if first or last else 0)
    for n, i in enumerate(flat):
        if isinstance(i, Forward):
            before = flat[:n]
            assert (RecvActivation(i.micro_batch, i.buffer) in before) == (not first)
            assert (LoadMicroBatch(i.micro_batch, i.buffer) in before) == (first or last)
            assert (flat[n + 1:n + 2] == [SendActivation(i.micro_batch, i.buffer)]) == (not last)
        if isinstance(i, Backward):
            assert (flat[n - 1:n] == [RecvGrad(i.micro_batch, i.buffer)]) == (not last)
            assert (flat[n + 1:n + 2] == [SendGrad(i.micro_batch, i.buffer)]) == (not first)
    tail = [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
    if schedule.trains:
        assert schedule.steps()[-1][-3:] == tail
    else:
        training_only = (Backward, RecvGrad, SendGrad, ReduceTiedGrads, ReduceGrads, OptimizerStep)
        assert not any(isinstance(i, training_only) for i in flat)
    assert all(i.buffer == i.micro_batch % schedule.num_buffers()
               for i in flat if hasattr(i, "buffer"))


def test_1f1b_exact_steps_two_stages_three_micro_batches():
    L, F, B = LoadMicroBatch, Forward, Backward
    SF, RF, SB, RB = SendActivation, RecvActivation, SendGrad, RecvGrad
    tail = [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
    stage0 = [
        [L(0, 0), F(0, 0), SF(0, 0)],
        [L(1, 1), F(1, 1), SF(1, 1)],
        [RB(0, 0), B(0, 0)],
        [L(2, 0), F(2, 0), SF(2, 0)],
        [RB(1, 1), B(1, 1)],
        [RB(2, 0), B(2, 0), *tail],
    ]
    stage1 = [
        [L(0, 0), RF(0, 0), F(0, 0)],
        [B(0, 0), SB(0, 0)],
        [L(1, 0), RF(1, 0), F(1, 0)],
        [B(1, 0), SB(1, 0)],
        [L(2, 0), RF(2, 0), F(2, 0)],
        [B(2, 0), SB(2, 0), *tail],
    ]
    assert OneFOneB(2, 0, 3).steps() == stage0
    assert OneFOneB(2, 1, 3).steps() == stage1


def test_single_stage_loads_once_per_micro_batch():
    assert [str(i) for i in _flat(OneFOneB(1, 0, 2))] == [
        "LOAD0", "F0", "B0", "LOAD1", "F1", "B1", "REDUCE_TIED", "REDUCE", "STEP"]


def test_gpipe_order_and_inference_steps():
    assert [str(i) for i in _flat(GPipe(2, 0, 2))] == [
        "LOAD0", "F0", "SEND_F0", "LOAD1", "F1", "SEND_F1", "RECV_B0", "B0", "RECV_B1", "B1",
        "REDUCE_TIED", "REDUCE", "STEP"]
    assert [[str(i) for i in step] for step in Inference(3, 2, 2).steps()] == [
        ["LOAD0", "RECV_F0", "F0"], ["LOAD1", "RECV_F1", "F1"]]
    assert [[str(i) for i in step] for step in Inference(3, 1, 1).steps()] == [
        ["RECV_F0", "F0", "SEND_F0"]]


def test_chunks_rejected_by_single_chunk_schedules():
    with pytest.raises(ConfigError, match="chunk"):
        OneFOneB(2, 0, 4, chunks=2)
    with pytest.raises(ConfigError, match="chunk"):
        simulate(GPipe, 2, 4, chunks=2)


# -- format_grid ----------------------------------------------------------------------------

def test_format_grid_tiny():
    assert format_grid(simulate(OneFOneB, 2, 3)) == (
        "stage 0 | F0 F1 .  B0 F2 B1 .  B2\n"
        "stage 1 | .  F0 B0 F1 B1 F2 B2 .")
    assert format_grid(simulate(Inference, 2, 2)) == (
        "stage 0 | F0 F1 .\n"
        "stage 1 | .  F0 F1")


# -- broken schedules are caught ------------------------------------------------------------

class SwappedRecvs(GPipe):
    """Stage 1 receives micro-batch 1 before micro-batch 0."""

    name = "swapped-recvs"

    def steps(self):
        steps = super().steps()
        if self.stage == 1:
            steps[0], steps[1] = steps[1], steps[0]
        return steps


class RecvGradFirst(OneFOneB):
    """Stage 0 waits for the first gradient before sending any activation."""

    name = "recv-grad-first"

    def steps(self):
        steps = super().steps()
        if self.stage == 0:
            steps.insert(0, steps.pop(self.num_stages))  # B0 follows the warm-up
        return steps


class OneBuffer(OneFOneB):
    """Claims one buffer although stage 0 keeps two micro-batches in flight."""

    name = "one-buffer"

    def num_buffers(self):
        return 1


def test_swapped_receives_are_a_mismatch():
    with pytest.raises(ScheduleError, match="swapped-recvs") as err:
        simulate(SwappedRecvs, 2, 2)
    text = str(err.value)
    assert "mismatched activation" in text
    assert "stage 1 step 0 (RECV_F1)" in text and "micro-batch 0" in text


def test_receive_cycle_is_a_deadlock_naming_stuck_stages():
    with pytest.raises(ScheduleError, match="deadlock") as err:
        simulate(RecvGradFirst, 2, 3)
    text = str(err.value)
    assert "stages [0, 1] cannot progress" in text
    assert "stage 0: blocked at step 0 on RECV_B0" in text
    assert "stage 1: blocked at step 0 on RECV_F0" in text
    assert "grid so far" in text


def test_partial_deadlock_shows_grid():
    class LostSend(OneFOneB):
        name = "lost-send"

        def steps(self):
            steps = super().steps()
            if self.stage == 0:  # never send the last activation
                steps = [[i for i in step if i != SendActivation(3, 0)] for step in steps]
            return steps

    with pytest.raises(ScheduleError, match="deadlock") as err:
        simulate(LostSend, 3, 4)
    text = str(err.value)
    assert "stage 0: blocked at step 6 on RECV_B2, waiting for stage 1" in text
    assert "stage 1: blocked at step 5 on RECV_F3, waiting for stage 0" in text
    assert "stage 0 | F0 F1 F2 .  .  B0 F3 B1" in text


def test_reused_live_buffer_is_reported():
    with pytest.raises(ScheduleError, match="overwrites buffer 0") as err:
        simulate(OneBuffer, 2, 3)
    assert "whose backward has not finished" in str(err.value)


def test_missing_backward_is_reported():
    class NoLastBackward(GPipe):
        name = "no-last-backward"

        def steps(self):
            steps = super().steps()
            del steps[-2]  # drop B0
            return steps

    with pytest.raises(ScheduleError) as err:
        simulate(NoLastBackward, 1, 2)
    assert "stage 0 chunk 0 micro-batch 0: backwarded 0 times" in str(err.value)


def test_all_problems_are_collected():
    class Broken(GPipe):
        name = "broken"

        def steps(self):
            steps = super().steps()
            if self.stage == 0:
                steps[0] = [LoadMicroBatch(0), Forward(0), Forward(0), SendActivation(0),
                            SendActivation(0), SendActivation(0, chunk=3)]
            return steps

    with pytest.raises(ScheduleError) as err:
        simulate(Broken, 2, 2)
    text = str(err.value)
    assert "forwarded 2 times" in text and "chunk 3 is outside" in text
    assert "never received" in text and "mismatched activation" in text
    assert re.search(r"\d+ problem\(s\)", text)


def test_split_backward_is_accepted_and_checked():
    class Split(Schedule):
        name = "split"

        def steps(self):
            steps = [[LoadMicroBatch(m, m), Forward(m, m)] for m in range(self.micro_batches)]
            steps += [[BackwardInput(m, m), BackwardWeight(m, m)]
                      for m in range(self.micro_batches)]
            return steps

    result = simulate(Split, 1, 3, costs={BackwardWeight: 0.5})
    assert result.makespan == 7.5 and result.buffers == (3,)

    class WeightFirst(Split):
        def steps(self):
            return [[LoadMicroBatch(0), Forward(0), BackwardWeight(0), BackwardInput(0)]]

    with pytest.raises(ScheduleError, match="BackwardWeight before its BackwardInput"):
        simulate(WeightFirst, 1, 1)


# -- virtual stages and callables -----------------------------------------------------------

class DepthFirstChunks(Schedule):
    """GPipe over virtual stages: chunk by chunk forward, reverse chunk order backward."""

    name = "depth-first-chunks"
    max_chunks = 4

    def _forward(self, c, m):
        position, last = c * self.num_stages + self.stage, self.num_stages * self.chunks - 1
        buf = c * self.micro_batches + m
        step = [RecvActivation(m, buf, c)] if position else [LoadMicroBatch(m, buf, c)]
        step.append(Forward(m, buf, c))
        return step + ([SendActivation(m, buf, c)] if position != last else [])

    def _backward(self, c, m):
        position, last = c * self.num_stages + self.stage, self.num_stages * self.chunks - 1
        buf = c * self.micro_batches + m
        step = [RecvGrad(m, buf, c)] if position != last else []
        step.append(Backward(m, buf, c))
        return step + ([SendGrad(m, buf, c)] if position else [])

    def steps(self):
        chunks, mbs = range(self.chunks), range(self.micro_batches)
        return ([self._forward(c, m) for c in chunks for m in mbs]
                + [self._backward(c, m) for c in reversed(chunks) for m in mbs])


def test_virtual_stages_route_between_positions():
    for stages in range(1, 5):
        for chunks in range(1, 4):
            result = simulate(DepthFirstChunks, stages, 3, chunks=chunks)
            assert result.buffers == (3 * chunks,) * stages
    result = simulate(DepthFirstChunks, 2, 1, chunks=2)
    assert format_grid(result) == (
        "stage 0 | F0   .    F0c1 .    .    B0c1 .    B0\n"
        "stage 1 | .    F0   .    F0c1 B0c1 .    B0   .")


def test_callable_factory_is_accepted():
    def factory(num_stages, stage, micro_batches, chunks):
        return GPipe(num_stages, stage, micro_batches, chunks)

    assert simulate(factory, 3, 2).makespan == 8


def test_bad_sizes_and_costs_raise_config_error():
    for args in [(0, 1), (2, 0), (2, 2, 0)]:
        with pytest.raises(ConfigError):
            simulate(GPipe, *args)
    with pytest.raises(ConfigError, match="instruction class"):
        simulate(GPipe, 1, 1, costs={"F": 1})
    with pytest.raises(ConfigError, match=">= 0"):
        simulate(GPipe, 1, 1, costs={Forward: -1})


# -- layer 0 stays free of torch ------------------------------------------------------------

LAYER0_FILES = [ROOT / "pipekernel" / "errors.py",
                *sorted((ROOT / "pipekernel" / "schedules").glob("*.py"))]


def test_layer0_sources_do_not_import_torch():
    pattern = re.compile(r"^\s*(import\s+torch|from\s+torch[\s.])", re.MULTILINE)
    offenders = [p.name for p in LAYER0_FILES if pattern.search(p.read_text())]
    assert offenders == []


def test_importing_schedules_does_not_load_torch():
    # Bypass pipekernel/__init__.py (which may import torch) and forbid torch outright.
    code = f"""
import importlib.abc, sys, types
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("layer 0 must not import torch")
sys.meta_path.insert(0, Block())
pkg = types.ModuleType("pipekernel"); pkg.__path__ = [{str(ROOT / 'pipekernel')!r}]
sys.modules["pipekernel"] = pkg
import pipekernel.schedules as s
s.simulate(s.OneFOneB, 3, 4)
assert not any(m == "torch" or m.startswith("torch.") for m in sys.modules)
"""
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
