"""Layer 0: the simulator's rendezvous semantics (NCCL rules) over the runtime's Program."""
from __future__ import annotations

import dataclasses

import pytest

from pipekernel.errors import ConfigError, ScheduleError
from pipekernel.schedules.instructions import (
    Backward, Forward, LoadMicroBatch, RecvActivation, RecvGrad, ReduceGrads,
    ReduceTiedGrads, SendActivation, SendGrad,
)
from pipekernel.schedules import BUILTIN_SCHEDULES, GPipe, Inference, OneFOneB, Schedule, simulate
from pipekernel.schedules.comm import P2P
from pipekernel.schedules.program import plan_communication

# -- 1. every built-in schedule, every size, under the plan the runtime runs -----------------


def _grid(cls):
    for chunks in range(cls.min_chunks, min(cls.max_chunks, 4) + 1):
        for stages in range(1, 9):
            for micro_batches in range(1, 17):
                yield stages, micro_batches, chunks


def _two_skip_edges(positions):
    """A long skip edge and a short one in the middle (fewer on short pipelines)."""
    if positions < 2:
        return []
    return sorted({(0, positions - 1),
                   (max(0, positions // 2 - 1), min(positions - 1, positions // 2 + 1))})


@pytest.mark.exhaustive
@pytest.mark.parametrize("name", sorted(BUILTIN_SCHEDULES))
def test_builtin_schedules_are_deadlock_free_under_rendezvous(name):
    """The grid proof under NCCL's ordering (a lane is one ordered stream per rank,
    whatever the peer): 1-8 stages x 1-16 micro-batches x every chunk count up to 4 the
    schedule takes, without and with two skip edges (3108 configurations over the 8
    built-in schedules, about 22 s of CPU on a loaded machine)."""
    cls = BUILTIN_SCHEDULES[name]
    ran = 0
    for stages, micro_batches, chunks in _grid(cls):
        for skips in ([], _two_skip_edges(stages * chunks)):
            try:
                result = simulate(cls, stages, micro_batches, chunks=chunks, skips=skips)
            except ConfigError:
                continue  # a combination the schedule cannot schedule
            assert result.semantics == "rendezvous"
            assert len(result.waits) == stages and min(result.waits) >= 0
            ran += 1
    assert ran > 0


def test_single_chunk_timing_is_the_dependency_bound():
    # Zero-cost transfers: rendezvous may not slow down a well-posted 1F1B or GPipe: unit
    # forwards and backwards end at 2 (m + s - 1), an inference at m + s - 1 (what sends that
    # never block gave, the lenient model this replaces).
    for cls, per in ((OneFOneB, 2), (GPipe, 2), (Inference, 1)):
        for stages, micro_batches in [(2, 3), (4, 8), (8, 16)]:
            a = simulate(cls, stages, micro_batches)
            assert a.makespan == per * (micro_batches + stages - 1)
            assert a.timeline[-1][0][0] == stages - 1  # the last stage starts when F0 lands


def test_transfer_costs_and_waits():
    result = simulate(OneFOneB, 2, 1, costs={SendActivation: 0.5, RecvActivation: 0.25,
                                              SendGrad: 1.0})
    # F0 on stage 0 [0, 1]; the activation lands at 1.75; B0 on stage 1 [2.75, 3.75];
    # the gradient lands at 4.75; stage 0's B0 [4.75, 5.75].
    assert result.timeline[1][0][:2] == (1.75, 2.75)
    assert result.timeline[0][1][:2] == (4.75, 5.75)
    assert result.makespan == 5.75
    assert result.waits[0] == pytest.approx(4.75 - 1) and result.waits[1] > 0


def test_bad_semantics_and_posting():
    with pytest.raises(ConfigError, match="semantics"):
        simulate(GPipe, 2, 2, semantics="eager")
    with pytest.raises(ConfigError, match="'buffered' model is gone"):
        simulate(GPipe, 2, 2, semantics="buffered")


def test_placement_is_read_from_the_schedule():
    class VGpipe(GPipe):
        name = "v-gpipe"
        placement = "v"
        max_chunks = 2

    with pytest.raises(ConfigError, match="placement 'v' holds exactly 2"):
        simulate(VGpipe, 2, 2, chunks=1)


# -- 2. a plan that would pass with sends that never block but deadlocks on rendezvous ------------------------


def one_lane(steps, **kw):
    """The runtime's plan on a transport without tags: one ordered lane per pair."""
    return dataclasses.replace(plan_communication(steps, **kw), lanes=())


def naive_plan(steps, **kw):
    """Post every send and receive at its own instruction, one group each, on one lane."""
    plan = one_lane(steps, **kw)
    posts = tuple((i,) if isinstance(ins, P2P) and plan.peers[i] is not None
                  and not plan.local[i] else () for i, ins in enumerate(plan.stream))
    return dataclasses.replace(plan, posts=posts)


def test_naive_posting_deadlocks_1f1b_and_names_the_cycle():
    simulate(OneFOneB, 2, 2)  # fine with the runtime's plan
    with pytest.raises(ScheduleError, match="deadlock"):  # which needs its lanes: stage 1
        simulate(OneFOneB, 2, 2, posting=one_lane)  # prefetches RECV_F1 ahead of SEND_B0
    with pytest.raises(ScheduleError, match="deadlock") as err:
        simulate(OneFOneB, 2, 2, posting=naive_plan)
    text = str(err.value)
    assert "stages [0, 1] cannot progress" in text
    assert "stage 0: blocked at step 2 on RECV_B0, waiting for" in text
    assert "stage 1: blocked at step 2 on RECV_F1, waiting for" in text
    cycle = next(line for line in text.splitlines() if "cycle:" in line)
    # stage 0's RECV_B0 sits behind its SEND_F1, which needs stage 1's RECV_F1, which sits
    # behind stage 1's SEND_B0, which needs stage 0's RECV_B0.
    assert cycle.strip() == (
        "cycle: stage 0 waits RECV_B0, queued behind stage 0's SEND_F1 -> stage 1's RECV_F1, "
        "queued behind stage 1's SEND_B0 -> stage 0's RECV_B0, queued behind stage 0's "
        "SEND_F1 (the cycle closes)")
    assert "grid so far" in text


def test_old_plan_policy_deadlocks_1f1b_with_three_stages():
    """Posting RECV_B0 in SEND_F0's group queues SEND_F1 behind it when a pair shares one
    ordered lane; with a lane per channel, it does not."""
    def eager_grad_plan(steps, **kw):
        plan = one_lane(steps, **kw)
        posts = [list(group) for group in plan.posts]
        for n, group in enumerate(plan.posts):
            for at in group:
                ins = plan.stream[at]
                if isinstance(ins, RecvGrad) and ins.micro_batch == 0:
                    sent = next(k for k, x in enumerate(plan.stream)
                                if isinstance(x, SendActivation) and x.micro_batch == 0)
                    posts[n].remove(at)
                    posts[sent].append(at)
                    posts[sent].sort()
        return dataclasses.replace(plan, posts=tuple(map(tuple, posts)))

    simulate(OneFOneB, 3, 4)
    simulate(OneFOneB, 3, 4, posting=lambda steps, **kw: dataclasses.replace(
        eager_grad_plan(steps, **kw), lanes=plan_communication(steps, **kw).lanes))  # lanes
    with pytest.raises(ScheduleError) as err:
        simulate(OneFOneB, 3, 4, posting=eager_grad_plan)
    text = str(err.value)
    assert ("stage 0 waits RECV_B0 <- stage 1's SEND_B0, not yet posted: stage 1 waits "
            "RECV_F1 <- stage 0's SEND_F1, queued behind stage 0's RECV_B0") in text


# -- 3. tagless matching -------------------------------------------------------------------


class CrossedKinds(Schedule):
    """2 stages x 2 chunks (loop): stage 0 -> stage 1 carries activations (position 0 -> 1)
    and gradients (position 2 -> 1). Stage 0 sends the activation of micro-batch 1 before
    the gradient of micro-batch 0; stage 1 receives the gradient first."""

    name = "crossed-kinds"
    max_chunks = 2

    def steps(self):
        if self.stage == 0:
            return [[LoadMicroBatch(0, 0, 0), Forward(0, 0, 0), SendActivation(0, 0, 0)],
                    [RecvActivation(0, 2, 1), Forward(0, 2, 1), SendActivation(0, 2, 1)],
                    [RecvGrad(0, 2, 1), Backward(0, 2, 1)],
                    [LoadMicroBatch(1, 1, 0), Forward(1, 1, 0), SendActivation(1, 1, 0)],
                    [SendGrad(0, 2, 1)],
                    [RecvGrad(0, 0, 0), Backward(0, 0, 0)],
                    [RecvActivation(1, 3, 1), Forward(1, 3, 1), SendActivation(1, 3, 1)],
                    [RecvGrad(1, 3, 1), Backward(1, 3, 1), SendGrad(1, 3, 1)],
                    [RecvGrad(1, 1, 0), Backward(1, 1, 0)]]
        return [[RecvActivation(0, 0, 0), Forward(0, 0, 0), SendActivation(0, 0, 0)],
                [LoadMicroBatch(0, 2, 1), RecvActivation(0, 2, 1), Forward(0, 2, 1)],
                [Backward(0, 2, 1), SendGrad(0, 2, 1)],
                [RecvGrad(0, 0, 0), Backward(0, 0, 0), SendGrad(0, 0, 0)],
                [RecvActivation(1, 1, 0), Forward(1, 1, 0), SendActivation(1, 1, 0)],
                [LoadMicroBatch(1, 3, 1), RecvActivation(1, 3, 1), Forward(1, 3, 1)],
                [Backward(1, 3, 1), SendGrad(1, 3, 1)],
                [RecvGrad(1, 1, 0), Backward(1, 1, 0), SendGrad(1, 1, 0)]]


def test_two_kinds_on_one_pair_in_different_orders_are_mismatched():
    simulate(CrossedKinds, 2, 2, chunks=2)  # one lane per channel
    with pytest.raises(ScheduleError, match="mismatched") as err:
        simulate(CrossedKinds, 2, 2, chunks=2, posting=naive_plan)  # tagless on the pair
    text = str(err.value)
    assert "stage 1 step 3 (RECV_B0): mismatched grad" in text
    assert "meets stage 0 step 3 (SEND_F1), which sends the activation of micro-batch 1" in text
    assert "stage 1 step 4 (RECV_F1): mismatched activation" in text
    assert "meets stage 0 step 4 (SEND_B0c1), which sends the grad of micro-batch 0" in text


# -- 4. world collectives ------------------------------------------------------------------


class LateLastGrad(GPipe):
    """The last stage sends its last gradient only after the optimizer step."""

    name = "late-last-grad"

    def steps(self):
        steps = super().steps()
        if self.is_last:
            last = steps[-1]
            send = next(i for i in last if isinstance(i, SendGrad))
            last.remove(send)
            steps.append([send])
        return steps


def test_send_after_the_world_collective_deadlocks():
    with pytest.raises(ScheduleError, match="deadlock") as err:
        simulate(LateLastGrad, 2, 2)
    text = str(err.value)
    assert "stage 1: blocked at step 3 on REDUCE_TIED, waiting for stage 0" in text
    assert ("cycle: stage 0 waits RECV_B1 <- stage 1's SEND_B1, not yet posted: stage 1 waits "
            "in the world collective REDUCE_TIED for stage 0, which waits RECV_B1 "
            "(the cycle closes)") in text


def test_mismatched_world_collectives_are_reported():
    class NoTied(GPipe):
        name = "no-tied"

        def steps(self):
            steps = super().steps()
            if self.stage == 1:
                steps[-1] = [i for i in steps[-1] if not isinstance(i, ReduceTiedGrads)]
            return steps

    with pytest.raises(ScheduleError, match="mismatched world collective #1") as err:
        simulate(NoTied, 2, 2)
    assert "stage 0 is in stage 0 step 3 (REDUCE_TIED)" in str(err.value)
    assert "stage 1 is in stage 1 step 3 (STEP)" in str(err.value)


def test_reduce_grads_is_not_a_cross_stage_collective():
    class EarlyReduce(GPipe):
        name = "early-reduce"

        def steps(self):
            steps = super().steps()
            if self.stage == 0:  # data-parallel reduction before the pipeline drained
                steps[0] = [*steps[0], ReduceGrads()]
            return steps

    simulate(EarlyReduce, 2, 2)


def test_unreceived_send_is_reported_and_blocks_the_end_of_batch():
    class ExtraSend(GPipe):
        name = "extra-send"

        def steps(self):
            steps = super().steps()
            if self.stage == 0:
                steps[-1].insert(0, SendActivation(1, 1))
            return steps

    with pytest.raises(ScheduleError) as err:
        simulate(ExtraSend, 2, 2)
    text = str(err.value)
    assert "(SEND_F1): the activation of micro-batch 1 sent to stage 1 chunk 0 is never " \
           "received" in text
    # the stage finished its stream: only its unreceived send keeps it
    assert "stage 0: blocked at the end of the batch on its SEND_F1" in text


def test_host_costs_occupy_the_stage_and_a_send_leaves_once_packed():
    from pipekernel.schedules.instructions import (Backward, Forward, RecvActivation, RecvGrad,
                                         SendActivation, SendGrad)
    from pipekernel.schedules import OneFOneB
    compute = {Forward: 1.0, Backward: 2.0}
    host = {SendActivation: 0.5, SendGrad: 0.5, RecvActivation: 0.25, RecvGrad: 0.25}
    # one micro-batch on 2 stages is a chain: F0, pack 0.5, unpack 0.25, F1, B1, pack 0.5,
    # unpack 0.25, B0 -- every host second lies on the critical path (6 + 1.5)
    assert simulate(OneFOneB, 2, 1, costs=compute).makespan == 6.0
    assert simulate(OneFOneB, 2, 1, costs=compute, host_costs=host).makespan == 7.5
    # as latency (costs=) the same seconds do not occupy the stages: the chain is the same
    # length here, but a stage is free to compute meanwhile
    latency = simulate(OneFOneB, 2, 4, costs={**compute, **host})
    occupied = simulate(OneFOneB, 2, 4, costs=compute, host_costs=host)
    assert occupied.makespan > latency.makespan


def test_host_costs_skip_local_hand_offs():
    from pipekernel.schedules.instructions import Backward, Forward, SendActivation, SendGrad
    from pipekernel.schedules import ZBV
    compute = {Forward: 1.0, Backward: 2.0}
    base = simulate(ZBV, 1, 1, 2, costs=compute).makespan  # one stage: every hand-off local
    assert simulate(ZBV, 1, 1, 2, costs=compute,
                    host_costs={SendActivation: 5.0, SendGrad: 5.0}).makespan == base
