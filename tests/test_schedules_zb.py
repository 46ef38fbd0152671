"""Layer 0: interleaved 1F1B, ZB-H1, ZB-H2, ZB-V and DualPipeV, checked by the simulator
(no torch)."""
from __future__ import annotations

import pytest

from pipekernel.apps import cli
from pipekernel.errors import ConfigError
from pipekernel.schedules.instructions import (
    ForwardBackward,
    Backward, BackwardInput, BackwardWeight, Forward, LoadMicroBatch, OptimizerStep,
    RecvActivation, RecvGrad, ReduceGrads, ReduceTiedGrads, SendActivation, SendGrad,
)
from pipekernel.extend.manager import make_plugin_manager, resolve_schedule
from pipekernel.schedules import (
    ZBH1, ZBH2, ZBV, DualPipeV, Interleaved1F1B, OneFOneB, format_grid, simulate,
)
from pipekernel.schedules.program import plan_communication
from pipekernel.schedules.placement import peer

SIZES = [(s, m) for s in range(1, 9) for m in range(1, 17)]
COSTS = {Forward: 1.0, Backward: 2.0, BackwardInput: 1.0, BackwardWeight: 1.0}
COMPUTE = (Forward, Backward, BackwardInput, BackwardWeight)
P2P = (SendActivation, RecvActivation, SendGrad, RecvGrad)


def _interleaved_valid(stages, micro_batches, chunks):
    return chunks == 1 or micro_batches <= stages or micro_batches % stages == 0


def _cases():
    for stages, micro_batches in SIZES:
        for chunks in range(1, 5):
            if _interleaved_valid(stages, micro_batches, chunks):
                yield Interleaved1F1B, stages, micro_batches, chunks
        yield ZBH1, stages, micro_batches, 1
        yield ZBH2, stages, micro_batches, 1
        yield ZBV, stages, micro_batches, 2
        if micro_batches >= 2 * stages:
            yield DualPipeV, stages, micro_batches, 2


def _pair_orders(cls, stages, micro_batches, chunks):
    """Per pair of different ranks: the messages in the sender's order and in the
    receiver's order (NCCL matches point-to-point operations between two ranks in order)."""
    sent, received = {}, {}
    for s in range(stages):
        schedule = cls(stages, s, micro_batches, chunks)
        for step in schedule.steps():
            for i in step:
                if not isinstance(i, P2P):
                    continue
                delta = 1 if isinstance(i, (SendActivation, RecvGrad)) else -1
                other, other_chunk = peer(s, i.chunk, delta, stages, chunks, schedule.placement)
                kind = "act" if isinstance(i, (SendActivation, RecvActivation)) else "grad"
                if other == s:
                    continue
                if isinstance(i, (SendActivation, SendGrad)):
                    sent.setdefault((s, other), []).append((kind, other_chunk, i.micro_batch))
                else:
                    received.setdefault((other, s), []).append((kind, i.chunk, i.micro_batch))
    return sent, received


def _by_kind(orders):
    return {(pair, kind): [m for m in messages if m[0] == kind]
            for pair, messages in orders.items() for kind in ("act", "grad")}


# -- the grid: every size simulates, buffers are declared exactly ---------------------------

@pytest.mark.exhaustive
def test_every_size_simulates_with_exact_buffers_and_ordered_pairs():
    for cls, stages, micro_batches, chunks in _cases():
        result = simulate(cls, stages, micro_batches, chunks)
        assert result.chunks == chunks
        declared = tuple(cls(stages, s, micro_batches, chunks).num_buffers()
                         for s in range(stages))
        assert result.buffers == declared, (cls.name, stages, micro_batches, chunks)
        sent, received = _pair_orders(cls, stages, micro_batches, chunks)
        if cls in (DualPipeV, ZBV):
            # their pairs send a forward's activation and another micro-batch's gradient to
            # the same rank in either order: each kind has its own lane (the engine
            # requires the transport's lanes), so the order holds per kind
            sent, received = _by_kind(sent), _by_kind(received)
        assert sent == received, (cls.name, stages, micro_batches, chunks)


def test_registered_by_name_with_their_chunk_rules():
    pm = make_plugin_manager()
    assert resolve_schedule(pm, "interleaved") is Interleaved1F1B
    assert resolve_schedule(pm, "zb-h1") is ZBH1
    assert resolve_schedule(pm, "zbv") is ZBV
    assert resolve_schedule(pm, "zb-h2") is ZBH2
    assert resolve_schedule(pm, "dualpipev") is DualPipeV
    assert (ZBH2.placement, ZBH2.max_chunks) == ("loop", 1)
    assert (DualPipeV.placement, DualPipeV.min_chunks, DualPipeV.max_chunks,
            DualPipeV.default_chunks) == ("v", 2, 2, 2)
    assert (Interleaved1F1B.placement, Interleaved1F1B.min_chunks, Interleaved1F1B.max_chunks,
            Interleaved1F1B.default_chunks) == ("loop", 1, 8, 2)
    assert (ZBH1.placement, ZBH1.max_chunks) == ("loop", 1)
    assert (ZBV.placement, ZBV.min_chunks, ZBV.max_chunks, ZBV.default_chunks) == ("v", 2, 2, 2)
    with pytest.raises(ConfigError, match="exactly 2"):
        ZBV(2, 0, 4, chunks=1)
    with pytest.raises(ConfigError, match="chunk"):
        ZBH1(2, 0, 4, chunks=2)


def test_interleaved_rejects_micro_batch_counts_with_a_clear_message():
    with pytest.raises(ConfigError) as err:
        Interleaved1F1B(4, 0, 6, chunks=2)
    text = str(err.value)
    assert "interleaved with 4 stages needs micro_batches to be a multiple of 4 (got 6): " \
           "use 4, 8, 12, ..." in text
    with pytest.raises(ConfigError, match="multiple of 3"):
        simulate(Interleaved1F1B, 3, 7, 2)
    Interleaved1F1B(4, 0, 6, chunks=1)  # plain 1F1B: any count
    Interleaved1F1B(4, 0, 3, chunks=2)  # at most S: one group


# -- instruction conventions ----------------------------------------------------------------

def test_conventions_loads_steps_and_tail():
    tail = [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
    for cls, stages, micro_batches, chunks in _cases():
        if micro_batches not in (1, 5, 8):
            continue
        for s in range(stages):
            schedule = cls(stages, s, micro_batches, chunks)
            steps = schedule.steps()
            assert steps[-1][-3:] == tail
            for step in steps:  # one compute instruction per step (a pair is one)
                assert sum(isinstance(i, (*COMPUTE, ForwardBackward)) for i in step) == 1
            loads = [i for step in steps for i in step if isinstance(i, LoadMicroBatch)]
            if cls.placement == "v" or stages == 1:  # one stage holds both ends: one load
                expected = [0] * micro_batches if s == 0 else []
            else:
                expected = ([0] * micro_batches if s == 0 else []) + (
                    [chunks - 1] * micro_batches if s == stages - 1 else [])
            assert sorted(i.chunk for i in loads) == sorted(expected)
            for step in steps:  # communication belongs to the step's own part(s)
                compute = next(i for i in step if isinstance(i, (*COMPUTE, ForwardBackward)))
                halves = compute.halves if isinstance(compute, ForwardBackward) else (compute,)
                for i in step:
                    if isinstance(i, P2P):
                        owner = halves[-1] if isinstance(i, (RecvGrad, SendGrad)) else halves[0]
                        assert (i.micro_batch, i.chunk) == (owner.micro_batch, owner.chunk)
                    if isinstance(i, (RecvGrad, SendGrad)):
                        assert isinstance(halves[-1], (Backward, BackwardInput))
            if cls not in (Interleaved1F1B, DualPipeV):  # DualPipeV mixes B with I/W
                # zbv's pairs hold a full B; its plan, run without a paired executor, none
                plain = schedule.unpaired_steps() if cls is ZBV else steps
                flat = [i for step in plain for i in step]
                assert not any(isinstance(i, (Backward, ForwardBackward)) for i in flat)


def test_zbv_turn_of_the_v_is_a_local_hand_off():
    stages = 4
    schedule = ZBV(stages, stages - 1, 8)
    plan = plan_communication(schedule.steps(), stage=stages - 1, num_stages=stages, chunks=2,
                              placement="v")
    local = {(type(i), i.chunk) for i, is_local in zip(plan.stream, plan.local) if is_local}
    assert local == {(SendActivation, 0), (RecvActivation, 1), (SendGrad, 1), (RecvGrad, 0)}
    for s in range(stages - 1):  # every other rank talks only to its neighbours
        other = plan_communication(ZBV(stages, s, 8).steps(), stage=s, num_stages=stages,
                                   chunks=2, placement="v")
        assert not any(other.local)


# -- bubble and memory, as the simulator measures them --------------------------------------

@pytest.mark.parametrize("stages,micro_batches", [(4, 8), (2, 8), (4, 16), (8, 16)])
def test_bubble_below_1f1b(stages, micro_batches):
    base = simulate(OneFOneB, stages, micro_batches, costs=COSTS).bubble_fraction
    for cls, chunks in ((Interleaved1F1B, 2), (ZBH1, 1), (ZBH2, 1), (ZBV, 2), (DualPipeV, 2)):
        if cls is DualPipeV and micro_batches < 2 * stages:
            continue
        bubble = simulate(cls, stages, micro_batches, chunks, costs=COSTS).bubble_fraction
        assert bubble < base, (cls.name, bubble, base)
    zbv = simulate(ZBV, stages, micro_batches, 2, costs=COSTS).bubble_fraction
    assert zbv < simulate(ZBH1, stages, micro_batches, costs=COSTS).bubble_fraction


@pytest.mark.exhaustive
def test_zero_bubble_memory_is_the_papers():
    # ZB-H1: no stage above 1F1B's peak (stage 0's min(S, M)); ZB-H2: at most 2 S - 1
    for stages, micro_batches in SIZES:
        peak = max(simulate(OneFOneB, stages, micro_batches).buffers)
        assert peak == min(stages, micro_batches)
        assert max(simulate(ZBH1, stages, micro_batches, costs=COSTS).buffers) == peak
        h2 = simulate(ZBH2, stages, micro_batches, costs=COSTS).buffers
        assert max(h2) == min(2 * stages - 1, micro_batches), (stages, micro_batches, h2)


@pytest.mark.parametrize("stages", [4, 8])
@pytest.mark.parametrize("micro_batches", [8, 16, 32])
def test_zero_bubble_times_are_the_papers(stages, micro_batches):
    """Qi et al. (ICLR 2024) Table 1 at T_F = T_B = T_W = 1: 1F1B takes
    M (F+B+W) + (p-1)(F+B+W), ZB-H1 M (F+B+W) + (p-1)(F+B-W), ZB-H2's stages
    M (F+B+W) + (p-1)(F+B-2W) each (a parallelogram: the paper drops the end-of-batch
    synchronisation; with it the batch adds the fill (p-1) F). ZB-H2 needs M >= 2p - 1
    micro-batches to fill its warm-up: with fewer, stage 0 waits 2p - 1 - M units for
    its first backward whatever the schedule."""
    p, m = stages, micro_batches
    work = 3 * m
    assert simulate(OneFOneB, p, m, costs=COSTS).makespan == work + (p - 1) * 3
    h1 = simulate(ZBH1, p, m, costs=COSTS)
    assert h1.makespan == work + (p - 1) * 1
    assert h1.bubble_fraction == pytest.approx(1 - work / (work + p - 1))
    h2 = simulate(ZBH2, p, m, costs=COSTS)
    assert max(h2.spans) == work + (p - 1) * 0 + max(0, 2 * p - 1 - m)
    if m >= 2 * p - 1:
        assert h2.spans == (work,) * p  # no stage idles between its first F and last W
    assert h2.makespan == h1.makespan  # the fill, paid once with the synchronisation


def test_zb_h2_beats_zb_h1_when_the_weight_pass_is_cheap():
    # (p-1)(F+B-2W) < (p-1)(F+B-W): with W < F the parallelogram's spans are shorter
    costs = {Forward: 1.0, BackwardInput: 1.0, BackwardWeight: 0.5}
    h1 = simulate(ZBH1, 4, 16, costs=costs)
    h2 = simulate(ZBH2, 4, 16, costs=costs)
    assert max(h2.spans) < max(h1.spans)
    assert h2.makespan <= h1.makespan


def test_dualpipev_needs_two_micro_batches_per_stage():
    with pytest.raises(ConfigError, match=r"dualpipev with 4 stage\(s\) needs micro_batches "
                                          r">= 8 \(2 x num_stages\), got 6"):
        DualPipeV(4, 0, 6)
    with pytest.raises(ConfigError, match="exactly 2"):
        DualPipeV(2, 0, 4, chunks=1)


def test_dualpipev_pairs_forward_and_backward_of_different_micro_batches():
    stages, micro_batches = 4, 12
    result = simulate(DualPipeV, stages, micro_batches, 2, costs=COSTS)
    for s in range(stages):
        ops = [(type(i).__name__[0] if not isinstance(i, (BackwardInput, BackwardWeight))
                else type(i).__name__[-5], i.chunk, i.micro_batch)
               for _, _, i in result.timeline[s]]
        # the steady state alternates F chunk 0, B chunk 1, F chunk 1, B chunk 0
        steady = [(k, c) for k, c, _ in ops]
        pattern = [("F", 0), ("B", 1), ("F", 1), ("B", 0)]
        runs = sum(steady[i:i + 4] == pattern for i in range(len(steady) - 3))
        assert runs >= micro_batches - 2 * stages + s, (s, steady)
        pairs = [(a, b) for a, b in zip(ops, ops[1:]) if a[0] == "F" and b[0] == "B"]
        assert all(a[2] != b[2] or a[1] != b[1] for a, b in pairs)
    # the V's memory: at most 2 S + 1 parts (half a stage each) per rank
    assert max(result.buffers) <= 2 * stages + 1
    zbv = simulate(ZBV, stages, micro_batches, 2, costs=COSTS)
    assert result.makespan <= zbv.makespan  # the default program: each pair as its two steps
    # run as one step, a pair's halves one after the other delay the forward's sends by the
    # backward; with the overlap a paired executor buys (0.8 x (F + B)) it still beats zbv
    apart = simulate(DualPipeV, stages, micro_batches, 2, costs=COSTS, paired=True)
    assert apart.makespan > result.makespan
    overlapped = simulate(DualPipeV, stages, micro_batches, 2,
                          costs={**COSTS, ForwardBackward: 0.8 * (COSTS[Forward] + COSTS[Backward])})
    assert overlapped.makespan <= zbv.makespan


@pytest.mark.exhaustive
def test_zbv_memory_is_1f1b_first_stage_memory():
    # a ZB-V part is half a stage: 2 * S parts hold what 1F1B's first stage holds
    for stages, micro_batches in SIZES:
        first = simulate(OneFOneB, stages, micro_batches).buffers[0]
        assert max(simulate(ZBV, stages, micro_batches, 2).buffers) <= 2 * first


# -- grids, checked by hand -----------------------------------------------------------------

def test_interleaved_grid_two_stages_two_chunks():
    assert str(format_grid(simulate(Interleaved1F1B, 2, 4, 2))) == (
        "stage 0 | F0   F1   F0c1 F1c1 F2   B0c1 F3   B1c1 F2c1 B0   F3c1 B1   .    B2c1 .    "
        "B3c1 B2   B3\n"
        "stage 1 | .    F0   F1   F0c1 B0c1 F1c1 B1c1 F2   B0   F3   B1   F2c1 B2c1 F3c1 B3c1 "
        "B2   B3   .")


def test_zbv_grid_two_stages():
    assert str(format_grid(simulate(ZBV, 2, 4, 2))) == (
        "stage 0 | F0   F1   .    F0c1 I0c1 F1c1 I1c1 I0   W0c1 I1   F2   W1c1 F3   W0   F2c1 "
        "I2c1 W1   W2c1 I2   F3c1 I3c1 W2   W3c1 I3   W3\n"
        "stage 1 | .    F0   F0c1 F1   F1c1 I0c1 I0   I1c1 I1   W0c1 W0   F2   F2c1 W1c1 F3   "
        "W1   I2c1 I2   F3c1 W2c1 W2   I3c1 I3   W3c1 W3")


# -- the CLI uses the schedule's default chunks ----------------------------------------------

def test_cli_schedule_default_and_explicit_chunks(capsys):
    assert cli.main(["schedule", "zbv", "--stages", "2", "--micro-batches", "4"]) == 0
    out = capsys.readouterr().out
    assert "2 stage(s) x 4 micro-batch(es) x 2 chunk(s)" in out
    assert cli.main(["schedule", "interleaved", "--stages", "2", "--micro-batches", "4",
                     "--chunks", "3"]) == 0
    assert "x 3 chunk(s)" in capsys.readouterr().out
    assert cli.main(["schedule", "interleaved", "--stages", "4", "--micro-batches", "6"]) == 1
    assert "multiple of 4" in capsys.readouterr().err
