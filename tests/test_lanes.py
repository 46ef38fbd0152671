"""Lanes under NCCL's real ordering (layer 0): a lane is one ordered stream per rank,
whatever the peer. The lanes of an earlier version deadlock under it (named cycle); the
lane map keeps one channel per lane at every rank with as few lanes as that allows; and a
transport with too few lanes is refused with the number it needs."""
from __future__ import annotations

import dataclasses
import itertools

import pytest

from pipekernel.comm.transport import require_lanes
from pipekernel.errors import ConfigError, ScheduleError
from pipekernel.schedules import BUILTIN_SCHEDULES, ZBH1, ZBV, Interleaved1F1B, OneFOneB, simulate
from pipekernel.schedules.comm import SENDS
from pipekernel.schedules.program import plan_communication
from pipekernel.schedules.instructions import RecvActivation, SendActivation
from pipekernel.schedules.lanes import channel_of, lane_map, lanes_needed


def old_lanes(steps, **kw):
    """The runtime's plan with the lanes of the earlier version: ``4 * sending chunk +
    2 * kind + direction`` — a stage's receive from ``s - 1`` and its send to ``s + 1``
    share a lane."""
    plan = plan_communication(steps, **kw)
    stage = kw["stage"]

    def lane(ins, peer):
        sending = isinstance(ins, SENDS)
        sender, chunk = (stage, ins.chunk) if sending else peer
        receiver = peer[0] if sending else stage
        kind = 0 if isinstance(ins, (SendActivation, RecvActivation)) else 1
        return 4 * chunk + 2 * kind + (0 if sender < receiver else 1)

    return dataclasses.replace(plan, lanes=tuple(
        None if old is None else lane(ins, peer)
        for ins, peer, old in zip(plan.stream, plan.peers, plan.lanes)))


def test_old_lanes_deadlock_1f1b_on_4_stages_and_the_cycle_is_named():
    simulate(OneFOneB, 4, 4, posting=old_lanes)  # fine while the pipeline never fills up
    simulate(OneFOneB, 4, 8)  # and fine with today's lanes
    with pytest.raises(ScheduleError, match="deadlock") as err:
        simulate(OneFOneB, 4, 5, posting=old_lanes)
    cycle = next(line for line in str(err.value).splitlines() if "cycle:" in line).strip()
    # stage 1 posted RECV_B1 (from stage 2) before its SEND_B0 (to stage 0) on the one
    # gradient lane, and stage 2 its RECV_F3 before SEND_F2 on the activation lane
    assert cycle == (
        "cycle: stage 0 waits RECV_B0 <- stage 1's SEND_B0, queued behind stage 1's RECV_B1 "
        "<- stage 2's SEND_B1, queued behind stage 2's RECV_B2 <- stage 3's SEND_B2, not yet "
        "posted: stage 3 waits RECV_F2 <- stage 2's SEND_F2, queued behind stage 2's RECV_F3 "
        "<- stage 1's SEND_F3, queued behind stage 1's RECV_F4 <- stage 0's SEND_F4, not yet "
        "posted: stage 0 waits RECV_B0 (the cycle closes)")


@pytest.mark.parametrize("cls,stages,micro_batches,chunks", [
    (OneFOneB, 4, 8, 1), (ZBH1, 4, 8, 1), (Interleaved1F1B, 4, 8, 2), (ZBV, 3, 4, 2)])
def test_old_lanes_deadlock_every_default_schedule(cls, stages, micro_batches, chunks):
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(cls, stages, micro_batches, chunks, posting=old_lanes)
    simulate(cls, stages, micro_batches, chunks)


def _layouts():
    for stages in range(1, 9):
        for chunks in range(1, 5):
            yield stages, chunks, "loop"
        yield stages, 2, "v"


def _two_edges(positions):
    """A long skip edge and a short one in the middle (fewer when the pipeline is short)."""
    if positions < 2:
        return ()
    return tuple(sorted({(0, positions - 1),
                         (max(0, positions // 2 - 1), min(positions - 1, positions // 2 + 1))}))


@pytest.mark.parametrize("with_skips", [False, True])
def test_one_channel_per_lane_at_every_rank_and_no_more_lanes_than_that_needs(with_skips):
    for stages, chunks, placement in _layouts():
        skips = _two_edges(stages * chunks) if with_skips else ()
        layout = lane_map(stages, chunks, placement, skips)
        used: dict[int, dict[int, tuple]] = {}
        for channel, lane in layout.lanes.items():
            for pos in channel[1:]:
                stage = (pos % stages if placement == "loop"
                         else min(pos, 2 * stages - 1 - pos))
                other = used.setdefault(stage, {}).setdefault(lane, channel)
                assert other == channel, (stages, chunks, placement, skips, lane, other,
                                          channel)
        assert layout.count == layout.bound, (stages, chunks, placement, skips)
        assert max(layout.degree, default=0) <= layout.count
        assert layout.count == lanes_needed(num_stages=stages, chunks=chunks,
                                            placement=placement, skips=skips)


def test_lane_map_is_optimal_on_every_small_skip_layout():
    # every one-edge skip set on 2-5 stages and two-edge set on 2-4, loop and V: as few
    # lanes as one channel per lane at each rank allows (the colouring meets the bound)
    for stages, chunks, placement in [(s, c, p) for s in range(2, 6)
                                      for c, p in ((1, "loop"), (2, "loop"), (2, "v"))]:
        positions = stages * chunks
        edges = list(itertools.combinations(range(positions), 2))
        pairs = itertools.combinations(edges, 2) if stages <= 4 else ()
        for skips in itertools.chain(itertools.combinations(edges, 1), pairs):
            layout = lane_map(stages, chunks, placement, skips)
            assert layout.count == layout.bound, (stages, chunks, placement, skips)


def test_lanes_per_rank_figures():
    # communicators (lanes) per rank on 4 stages, with 2 skip edges: (before) the earlier
    # version's 4 * chunks + 2 * edges; (after) one channel per lane at each rank
    def after(chunks, placement, skips=()):
        return lanes_needed(num_stages=4, chunks=chunks, placement=placement, skips=skips)

    assert after(1, "loop") == 4 and after(1, "loop", _two_edges(4)) == 6       # was 4, 8
    assert after(2, "loop") == 8 and after(2, "loop", _two_edges(8)) == 10      # was 8, 12
    assert after(2, "v") == 8 and after(2, "v", _two_edges(8)) == 10            # was 8, 12
    # an odd loop needs more than the largest degree: every two links meet at a stage
    assert lane_map(3, 2, "loop").degree == (6, 8, 6) and after(2, "loop") < 10 == \
        lanes_needed(num_stages=3, chunks=2)
    assert lanes_needed(num_stages=1, chunks=4) == 0  # everything is a local hand-off


def test_both_ends_of_a_transfer_compute_the_same_lane():
    plans = [plan_communication(Interleaved1F1B(4, s, 8, 2).steps(), stage=s, num_stages=4,
                                chunks=2) for s in range(4)]
    for plan in plans:
        for ins, peer, lane in zip(plan.stream, plan.peers, plan.lanes):
            if lane is None:
                continue
            assert lane == lane_map(4, 2).lane(channel_of(ins, plan.stage, 4))
            other = plans[peer[0]]
            lanes_there = {channel_of(i, other.stage, 4): x
                           for i, x in zip(other.stream, other.lanes) if x is not None}
            assert lanes_there[channel_of(ins, plan.stage, 4)] == lane


def test_a_transport_with_too_few_lanes_is_refused_with_the_number_it_needs():
    class Fixed:
        max_tags = 3

    needed = lanes_needed(num_stages=4, chunks=2, placement="v")
    with pytest.raises(ConfigError, match=r"offers 3 lane\(s\) \(tags\) and 4 stages needs 8") \
            as err:
        require_lanes(Fixed(), needed, name="nccl", layout="4 stages", rank=0)
    assert "transport_options={'lanes': 8}" in err.value.hint

    class Opens:
        max_tags = 0
        opened: list[int] = []

        def open_lanes(self, count):
            self.opened.append(count)
            self.max_tags = max(self.max_tags, count)

    opens = Opens()
    require_lanes(opens, needed, name="nccl", layout="4 stages")
    assert opens.opened == [8] and opens.max_tags == 8


# -- the contract's wait on a device transport (fakes: no GPU here) -------------------------
class _Watch:
    def __init__(self):
        self.watched = []

    def check(self):
        pass

    def watch(self, work, *args):
        self.watched.append(work)


def test_a_device_handle_is_completed_only_once_the_transfer_finished():
    import types

    from pipekernel.transports.cupy_nccl import _EventHandle
    from pipekernel.transports.nccl import _DeviceHandle

    class Work:  # an NCCL work / CUDA event that has not finished
        done = False

        def is_completed(self):
            return self.done

        query = is_completed

        def wait(self):
            pass  # stream ordering only

    work, watch = Work(), _Watch()
    transport = types.SimpleNamespace(_watch=watch, timeout=5.0, rank=0, describe=str)
    handle = _DeviceHandle(work, transport, 1, "send to")
    handle.wait()  # orders the stream, does not finish the transfer
    assert watch.watched == [work] and not handle.is_completed()
    work.done = True
    assert handle.is_completed()

    event, streams = Work(), []
    cuda = types.SimpleNamespace(current_stream=lambda: types.SimpleNamespace(
        wait_event=streams.append))
    ops = types.SimpleNamespace(watch=_Watch(), cuda=cuda, timeout=lambda: 5.0)
    handle = _EventHandle(event, ops, 1, "receive from")
    handle.wait()
    assert streams == [event] and not handle.is_completed()
    event.done = True
    assert handle.is_completed()
    assert _EventHandle(None, ops, 1, "send to").is_completed()  # nothing was posted
