"""Schedule-aware activation offload (pipekernel.stage.offload, schedules/offload_plan.py).

On CPU through the engine's own code path with the model mover (pk.ModelMover): the
storages move to a separate host pool the memory ledger does not count as device bytes.
Exact byte counts, no timing."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import pipekernel as pk
from pipekernel.extend.manager import make_plugin_manager, registered_schedules
from pipekernel.plugins.memory import MemoryMeter
from pipekernel.schedules import instructions as isa
from pipekernel.schedules.offload_plan import offload_delays, offload_points
from pipekernel.schedules.program import lower
from pipekernel.schedules.sim_memory import PartBytes, stage_memory
from pipekernel.schedules.simulator import simulate
from pipekernel.stage.offload import ActivationOffload, ModelMover, make_offload
from pipekernel.testing import run_ranks

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

SCHEDULES = registered_schedules(make_plugin_manager())


def _program(name, stages, stage, m, chunks=1):
    cls = SCHEDULES[name]
    return lower(cls(stages, stage, m, chunks), stage=stage, num_stages=stages,
                 micro_batches=m, chunks=chunks,
                 placement=getattr(cls, "placement", "loop"), paired=False)


@pytest.mark.fast
def test_points_follow_the_forward_to_backward_distance():
    stream = _program("1f1b", 2, 0, 4).stream
    points = offload_points(stream, min_distance=2, prefetch=1)
    # stage 0 of 1f1b, p=2: F0 F1 B0 F2 B1 F3 B2 B3 -> distances 1 2 2 1
    assert points.distance == {(0, 0): 1, (1, 0): 2, (2, 0): 2, (3, 0): 1}
    assert sorted(points.parts) == [(1, 0), (2, 0)]
    names = {i: f"{type(ins).__name__}{ins.micro_batch}" for i, ins in enumerate(stream)
             if isinstance(ins, (isa.Forward, isa.Backward))}
    f, p, b = points.parts[(1, 0)]
    assert (names[f], names[p], names[b]) == ("Forward1", "Forward2", "Backward1")
    # prefetch=0: back right before the backward; min_distance 3: nothing is that far
    assert names[offload_points(stream, 2, 0).parts[(1, 0)][1]] == "Backward1"
    assert offload_points(stream, 3, 1).parts == {}
    # the last stage runs each backward right after its forward: nothing moves
    assert offload_points(_program("1f1b", 2, 1, 4).stream, 1, 0).parts == {}


@pytest.mark.fast
@pytest.mark.parametrize("p", [2, 4, 8])
def test_1f1b_steady_state_distance_is_twice_the_stages_below(p):
    for s in range(p):
        distance = offload_points(_program("1f1b", p, s, 4 * p).stream, 1, 0).distance
        # the steady state: the micro-batches that are neither warm-up nor cool-down
        assert distance[(2 * p, 0)] == 2 * (p - 1 - s)


@pytest.mark.fast
def test_split_backward_offloads_until_the_input_pass():
    stream = _program("zb-h1", 4, 0, 8).stream
    points = offload_points(stream, 2, 1)
    assert points.parts
    for (f, p, b) in points.parts.values():
        assert isinstance(stream[f], isa.Forward)
        assert isinstance(stream[b], isa.BackwardInput)
        assert f < p < b


@pytest.mark.fast
@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_offload_numbers_are_config_errors(bad):
    with pytest.raises(pk.ConfigError, match="min_distance"):
        make_offload(pk.Offload(min_distance=bad), torch.device("cpu"))
    if bad != 0:
        with pytest.raises(pk.ConfigError, match="prefetch"):
            make_offload(pk.Offload(prefetch=bad), torch.device("cpu"))
    with pytest.raises(pk.ConfigError, match="offload must be"):
        make_offload("yes", torch.device("cpu"))


@pytest.mark.fast
def test_offload_on_cpu_without_a_mover_says_how_to_fix():
    with pytest.raises(pk.ConfigError, match="offload needs CUDA") as err:
        make_offload(True, torch.device("cpu"))
    assert "activation_checkpoint_interval" in str(err.value.hint)
    assert make_offload(None, torch.device("cpu")) is None
    assert make_offload(False, torch.device("cpu")) is None
    made = make_offload(pk.Offload(mover=ModelMover()), torch.device("cpu"))
    assert isinstance(made, ActivationOffload)


def _refused():
    module = pk.PipelineModule([pk.LayerSpec(nn.Linear, 4, 4)], loss_fn=nn.MSELoss(),
                               num_stages=1)
    try:
        pk.PipelineEngine(module, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                          transport="gloo", offload=True, timeout=30)
    except pk.ConfigError as err:
        return str(err)
    return ""


def test_engine_refuses_offload_on_cpu():
    message = run_ranks(_refused, 1)[0]
    assert "offload needs CUDA" in message and "how to fix" in message


@pytest.mark.fast
def test_time_model_overlaps_transfers_and_charges_what_it_cannot_hide():
    stream = _program("1f1b", 2, 0, 4).stream
    points = offload_points(stream, 2, 1)
    timeline = simulate(SCHEDULES["1f1b"], 2, 4,
                        costs={isa.Forward: 1.0, isa.Backward: 2.0}).timeline[0]
    # one direction 0.4 s per part: the copy out (after F1) and back (posted at F2's start)
    # fit in B0 (2 s) and F2 (1 s): no stall, 4 transfers on the side stream
    assert offload_delays(timeline, points, stream,
                          {k: 0.4 for k in points.parts}) == (0.0, pytest.approx(1.6))
    # 3 s per direction (timeline F0 0-1, F1 1-2, B0 4-6, F2 6-7, B1 7-9, F3 9-10,
    # B2 10-12, B3 13-15): out1 [2, 5]; back1 posted at F2 (6) -> [6, 9]; out2 after F2
    # waits for the side stream -> [9, 12]; B1 waits 7 -> 9 (+2); F3 starts at 11, posts
    # back2 -> [12, 15]; B2 waits 12 -> 15 (+3): the stage ends 5 s later, 4 x 3 s copied
    assert offload_delays(timeline, points, stream,
                          {k: 3.0 for k in points.parts}) == (5.0, 12.0)


class Block(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class Record:
    """After each instruction: the ledger's device bytes and the mover's host bytes."""

    def __init__(self, meter, mover):
        self.meter, self.mover, self.samples = meter, mover, []

    @pk.hookimpl
    def pipekernel_after_instruction(self, instruction, seconds):
        if self.meter._on:
            now = self.meter.ledger.now()
            host = self.mover.host_bytes() if self.mover is not None else 0
            self.samples.append((sum(now.values()), now["saved"], host))


def _worker(schedule, micro_batches, chunks, offload, interval=0, cuda=False):
    meter = MemoryMeter()
    mover = ModelMover() if offload and not cuda else None
    record = Record(meter, mover)
    layers = [pk.LayerSpec(nn.Linear, 8, 16), *[pk.LayerSpec(Block) for _ in range(6)],
              pk.LayerSpec(nn.Linear, 16, 4)]
    module = pk.PipelineModule(layers, loss_fn=nn.MSELoss(), partition="uniform", seed=3,
                               activation_checkpoint_interval=interval)
    engine = pk.PipelineEngine(
        module, optimizer=lambda p: torch.optim.Adam(p, lr=1e-3), micro_batches=micro_batches,
        schedule=schedule, chunks=chunks, transport="staged" if cuda else "gloo",
        plugins=[meter, record], timeout=120,
        offload=pk.Offload(min_distance=2, prefetch=1, mover=mover) if offload else None)
    if cuda and offload:
        mover = engine.runtime.offload.mover  # the CudaMover the engine made
        record.mover = mover
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(2):
        record.samples = []
        batch = [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g))
                 for _ in range(micro_batches)]
        losses.append(engine.train_batch(iter(batch)).item())
    params = [p.detach().cpu().clone() for p in engine.module.parameters()]
    moved = dict(engine.runtime.offload.moved) if offload else {}
    left = mover.host_bytes() if offload else 0
    engine.close()
    return (losses, params, record.samples, meter.last["memory_peak_bytes"], moved, left,
            engine.stage, engine.chunks)


@pytest.mark.multirank
@pytest.mark.parametrize("schedule,m,chunks,interval", [("1f1b", 6, 1, 0), ("zb-h1", 6, 1, 0),
                                                        ("zbv", 4, 2, 0), ("1f1b", 6, 1, 2)])
def test_offload_is_bit_exact_and_frees_exactly_what_it_moves(schedule, m, chunks, interval):
    # zbv: its input pass drops the outputs, freeing the nodes above the split ones (and
    # what they saved) before the weight pass; autograd keeps the pack hook beside each
    # saved tensor, so a hook holding its part's entries kept them all until then (found
    # by this test: 384 B per part more than without offload)
    # interval 2: checkpointed segments save under torch's own hooks; what autograd saves
    # outside them still moves (384 B per part here, 2304 without checkpointing)
    off = run_ranks(_worker, 2, schedule, m, chunks, False, interval)
    on = run_ranks(_worker, 2, schedule, m, chunks, True, interval)
    moved_any = False
    parts = {}
    for (l0, p0, s0, peak0, _, _, stage, chunks_), (l1, p1, s1, peak1, moved, left, _, _) \
            in zip(off, on):
        assert l0 == l1  # bit-exact losses
        assert all(torch.equal(a, b) for a, b in zip(p0, p1))  # and parameters
        assert left == 0  # every host copy freed by the batch's end
        assert len(s0) == len(s1)
        for (total0, saved0, _), (total1, saved1, host) in zip(s0, s1):
            # the device holds exactly what moved less, at every instruction
            assert total0 - total1 == saved0 - saved1 == host
        assert peak1 <= peak0
        moved_any = moved_any or any(moved.values())
        for c in range(chunks_):
            sizes = {b for (_, chunk), b in moved.items() if chunk == c}
            assert len(sizes) <= 1  # every micro-batch of a part moves the same bytes
            parts[(stage, c)] = PartBytes(offloaded=float(sizes.pop()) if sizes else 0.0)
    assert moved_any
    # the memory model's host bytes after each instruction: exactly the measured ones
    trace: list = []
    stage_memory(SCHEDULES[schedule], 2, m, chunks, parts, offload=(2, 1), trace=trace)
    for stage, (*_, samples, _, _, _, _, _) in enumerate(on):
        assert [h for _, h in trace[stage]] == [float(host) for _, _, host in samples]
    print("peaks off/on:", [r[3] for r in off], [r[3] for r in on])


def test_stage_memory_subtracts_the_offloaded_bytes_at_the_peak():
    parts = {(s, 0): PartBytes(saved=1000.0, inputs=10.0, outputs=10.0, offloaded=900.0)
             for s in range(4)}
    base = stage_memory(SCHEDULES["1f1b"], 4, 8, 1, parts)
    moved = stage_memory(SCHEDULES["1f1b"], 4, 8, 1, parts, offload=(2, 1))
    # stage 0 holds 4 graphs at its peak: with offload, the far ones sit on the host
    assert moved[0]["saved"] < base[0]["saved"]
    assert moved[3] == base[3]  # the last stage's backwards follow their forwards


@pytest.mark.fast
def test_train_takes_offload_and_refuses_it_on_cpu(monkeypatch):
    from pipekernel.apps import cli
    from pipekernel.apps.config import TrainConfig
    from pipekernel.apps.train import _positive

    seen = []
    monkeypatch.setattr("pipekernel.apps.train.run", seen.append)
    assert cli.main(["train", "--offload", "--steps", "2"]) == 0
    assert seen[0].offload is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(pk.ConfigError, match="--offload moves saved activations"):
        _positive(TrainConfig(offload=True))
    _positive(TrainConfig())  # off: nothing to refuse


@pytest.mark.fast
def test_offload_step_prices_the_whole_pipeline():
    costs = {isa.Forward: 1.0, isa.Backward: 2.0}
    from pipekernel.schedules.offload_plan import offload_step

    cheap = offload_step(SCHEDULES["1f1b"], 2, 4, seconds={(0, 0): 0.4}, costs=costs)
    assert cheap["stalls"] == [0.0, 0.0] and cheap["step"] == cheap["makespan"]
    dear = offload_step(SCHEDULES["1f1b"], 2, 4, seconds={(0, 0): 3.0}, costs=costs)
    assert dear["stalls"] == [5.0, 0.0]  # the hand-worked case above; stage 1 moves nothing
    assert dear["busy"] == [12.0, 0.0]
    assert dear["step"] == dear["makespan"] + 5.0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("schedule,m,chunks", [("1f1b", 6, 1), ("zbv", 4, 2)])
def test_cuda_offload_is_bit_exact_and_moves_bytes(schedule, m, chunks):
    # two stages on one GPU (staged transport), the CudaMover: pinned host buffers, a side
    # stream, events; the same fp32 kernels in the same order as without offload
    off = run_ranks(_worker, 2, schedule, m, chunks, False, 0, True, timeout=240)
    on = run_ranks(_worker, 2, schedule, m, chunks, True, 0, True, timeout=240)
    for (l0, p0, *_), (l1, p1, _, _, moved, left, _, _) in zip(off, on):
        assert l0 == l1
        assert all(torch.equal(a, b) for a, b in zip(p0, p1))
        assert left == 0  # every pinned copy released by the batch's end
    assert any(sum(r[4].values()) for r in on)
