"""Skip connections across stages: routed straight from the stashing stage to the popping
one (never through the stages in between), gradients back, parity with one process;
declarations checked; the simulator proves the schedules with the extra edges."""
from __future__ import annotations

import pytest
import torch
from models import MODELS, mlp_data, sgd
from torch import nn

import pipekernel as pk
from pipekernel.schedules import instructions as isa
from pipekernel.schedules import BUILTIN_SCHEDULES, simulate
from pipekernel.schedules.lanes import lane_map
from pipekernel.schedules.skips import add_skip_transfers
from pipekernel.testing import assert_parity, reference_eval, reference_train, run_ranks

STEPS = 3


class Recording:
    """Wraps the runtime's transport: ``(direction, peer, tag, bytes)`` of every op."""

    def __init__(self, inner):
        self.inner, self.ops = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def batch_isend_irecv(self, ops):
        self.ops += [(op.op, op.peer, op.tag, op.tensor.numel() * op.tensor.element_size())
                     for op in ops]
        return self.inner.batch_isend_irecv(ops)


def worker(stages, micro_batches, schedule, chunks, dp=1):
    torch.set_num_threads(1)
    build, data = MODELS["skips"]
    engine = pk.PipelineEngine(build(num_stages=stages), optimizer=sgd,
                               micro_batches=micro_batches, schedule=schedule, chunks=chunks,
                               timeout=60, check_data_steps=0, data_parallel_size=dp)
    transfers = engine.runtime.transfers  # what the runtime posts goes through it
    recording = transfers.transport = Recording(transfers.transport)
    losses = [engine.train_batch(iter(data(step, engine.data_parallel_rank, micro_batches)))
              .item() for step in range(STEPS)]
    state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    eval_loss = engine.eval_batch(iter(data(99, 0, micro_batches))).item()
    edges = engine.skip_edges
    engine.close()
    return losses, state, eval_loss, engine.stage, recording.ops, edges


def check(stages, micro_batches, schedule="1f1b", chunks=None, dp=1):
    results = run_ranks(worker, stages * dp, stages, micro_batches, schedule, chunks, dp,
                        timeout=240)
    build, data = MODELS["skips"]
    batches = [[data(step, r, micro_batches) for r in range(dp)] for step in range(STEPS)]
    ref_losses, ref_state = reference_train(build(), sgd, batches, micro_batches)
    ref_eval, _ = reference_eval(build(), ref_state, data(99, 0, micro_batches))
    covered = set()
    for losses, state, eval_loss, _, _, _ in results:
        assert_parity(losses, ref_losses, state, ref_state)
        assert eval_loss == pytest.approx(ref_eval, rel=1e-5, abs=1e-6)
        covered |= set(state)
    assert covered == set(ref_state)
    return results


def test_four_stages_stage_0_feeds_stage_3_directly():
    results = check(4, 4)
    ops = {stage: recorded for _, _, _, stage, recorded, _ in results}
    assert results[0][5] == [(0, 2), (0, 3)]  # enc: part 0 -> 3, mask: part 0 -> 2
    # which channel each (stage, lane) carries: a lane is one channel at each rank
    lanes = lane_map(4, 1, "loop", ((0, 2), (0, 3))).lanes
    kind = {(stage, lane): channel[0] for channel, lane in lanes.items()
            for stage in (channel[1], channel[2])}  # 1 chunk, loop: position == stage
    assert any(kind[0, tag].startswith("skip") for _, _, tag, _ in ops[0]), \
        "the skips travel on lanes of their own"
    # stages 1 and 2 never carry the skip tensors: no skip lane, and each activation
    # they send is one [4, 16] float32 tensor (256 bytes + the 16-byte header) — the
    # 256-byte "enc" riding along would double it
    for stage in (1, 2):
        assert not [op for op in ops[stage] if kind[stage, op[2]].startswith("skip")
                    and not (stage == 2 and op[1] == 0)]
        sent = [size for direction, peer, tag, size in ops[stage]
                if direction == "send" and kind[stage, tag] == "activation"]
        # training sends 256 + 16; the eval batch's metadata change (no requires_grad)
        # leaves room for the metadata in front (7 int64: 64 bytes aligned; comm/wire.py)
        assert sent and 256 + 16 in sent and max(sent) == 256 + 16 + 64
    # stage 0 sends enc (256 B + header) straight to rank 3 and the bool mask (64 B) to 2
    direct = {(peer, size) for direction, peer, tag, size in ops[0]
              if direction == "send" and kind[0, tag] == "skip"}
    assert (3, 256 + 16) in direct and (2, 64 + 16) in direct
    # and gets their gradients back: the float enc's from stage 3 only (the mask has none)
    back = {(peer, size) for direction, peer, tag, size in ops[0]
            if direction == "recv" and kind[0, tag] == "skip grad"}
    assert (3, 256 + 16) in back
    assert max(size for peer, size in back if peer == 2) == 16  # an empty gradient message


def test_interleaved_with_a_local_skip_hand_off():
    # 2 stages x 2 chunks: part 0 (stage 0) -> part 2 (stage 0, a local hand-off), -> part 3
    check(2, 4, "interleaved", 2)


def test_zero_bubble_split_backward_routes_skip_gradients():
    check(4, 4, "zb-h1")


def test_zbv_skips():
    # V: part 3 is back on stage 0 (local), part 2 on stage 1
    check(2, 4, "zbv")


def test_gpipe_skips():
    check(2, 3, "gpipe")


def test_skips_with_data_parallel_replicas():
    check(2, 2, dp=2)


# -- one process: stash/pop within a stage -------------------------------------------------

def test_same_stage_stash_and_pop_is_local_and_differentiable():
    module = MODELS["skips"][0]()
    model = module.build_stage(0, [0, len(module.layers)])  # every layer, one part
    x, y = mlp_data(0, 0, 1)[0]
    loss = module.loss_fn(model(x), y)
    loss.backward()
    enc = model.get_submodule("0").proj.weight.grad
    decoder = model.get_submodule("6").gate.weight.grad
    assert enc is not None and decoder is not None and enc.abs().sum() > 0


# -- declarations -------------------------------------------------------------------------

@pk.skippable(stash=["a"])
class Stasher(nn.Module):
    def forward(self, x):
        pk.stash("a", x * 2)
        return x


@pk.skippable(pop=["a"])
class Popper(nn.Module):
    def forward(self, x):
        return x + pk.pop("a")


class Sneaky(nn.Module):
    def forward(self, x):
        pk.stash("b", x)
        return x


def test_inconsistent_declarations_are_config_errors():
    with pytest.raises(pk.ConfigError, match="'a' is stashed by layer 0 and never popped"):
        pk.PipelineModule([Stasher(), nn.Identity()])
    with pytest.raises(pk.ConfigError, match="'a' is popped by layer 0 and never stashed"):
        pk.PipelineModule([Popper(), nn.Identity()])
    with pytest.raises(pk.ConfigError, match="popped by layer 0, which does not come after"):
        pk.PipelineModule([Popper(), Stasher()])
    with pytest.raises(pk.ConfigError, match="stashed by layers \\[0, 1\\]"):
        pk.PipelineModule([Stasher(), Stasher(), Popper()])
    with pytest.raises(pk.ConfigError, match="activation checkpointing"):
        pk.PipelineModule([Stasher(), Popper()], activation_checkpoint_interval=1)


def test_undeclared_stash_and_missing_stash_name_the_layer():
    module = pk.PipelineModule([Stasher(), pk.Skip(Sneaky(), stash=["c"]), Popper(),
                                pk.Skip(nn.Identity(), pop=["c"])])
    stage = module.build_stage(0, [0, 4])
    with pytest.raises(pk.ConfigError, match=r"layer 1 on stage 0 called pk.stash\('b'\) but "
                                             r"declares stash=\['c'\]"):
        stage(torch.ones(2))
    # the class pops "a" but this entry declares no pop: the pop is refused at run time
    module = pk.PipelineModule([pk.Skip(Stasher(), stash=["a"]), pk.Skip(Popper(), pop=["a"]),
                                pk.Skip(nn.Identity(), stash=["z"]), pk.Skip(Popper(), pop=["z"])])
    with pytest.raises(pk.ConfigError, match=r"layer 2 on stage 0 declares but did not "
                                             r"stash 'z'"):
        module.build_stage(0, [0, 4])(torch.ones(2))


def test_stash_outside_a_pipeline_forward_is_a_clear_error():
    with pytest.raises(pk.PipelineError, match="outside the forward of a pipeline stage"):
        Stasher()(torch.ones(1))


# -- schedules and the simulator ---------------------------------------------------------

def test_simulator_rejects_a_skip_edge_whose_consumer_comes_before_its_producer():
    with pytest.raises(pk.ScheduleError, match=r"skip edge 3 -> 1: its consumer \(position 1\) "
                                               "does not come after its producer"):
        simulate(BUILTIN_SCHEDULES["1f1b"], 4, 4, skips=[(3, 1)])
    with pytest.raises(pk.ScheduleError, match="positions 0..3"):
        simulate(BUILTIN_SCHEDULES["1f1b"], 4, 4, skips=[(0, 4)])


@pytest.mark.parametrize("name", sorted(BUILTIN_SCHEDULES))
def test_every_builtin_schedule_is_deadlock_free_with_skip_edges(name):
    cls = BUILTIN_SCHEDULES[name]
    for stages in (2, 3, 4):
        for chunks in ((1,) if cls.max_chunks == 1 else (2,)):
            parts = stages * chunks
            everything = [(p, q) for p in range(parts) for q in range(p + 1, parts)]
            fewest = 2 * stages if name == "dualpipev" else stages  # dualpipev: M >= 2 S
            if hasattr(cls, "min_micro_batches"):  # v-min, v-half: their own minimum
                fewest = max(fewest, cls.min_micro_batches(stages))
            for micro_batches in (fewest, 2 * stages + 1 if name != "interleaved" else 2 * stages):
                for edges in [[e] for e in everything] + [everything]:
                    simulate(cls, stages, micro_batches, chunks, skips=edges)


def test_skip_transfers_sit_around_the_forward_and_backward():
    steps = [[isa.Forward(0)], [isa.Backward(0)]]
    # stage 0 of 2: part 0 produces for part 1
    assert add_skip_transfers(steps, stage=0, num_stages=2, edges=[(0, 1)]) == [
        [isa.Forward(0), isa.SendSkip(0, peer=1)],
        [isa.RecvSkipGrad(0, peer=1), isa.Backward(0)]]
    assert add_skip_transfers(steps, stage=1, num_stages=2, edges=[(0, 1)]) == [
        [isa.RecvSkip(0, peer=0), isa.Forward(0)],
        [isa.Backward(0), isa.SendSkipGrad(0, peer=0)]]


def test_simulator_catches_skips_on_a_shared_lane():
    # a posting policy that puts the skips on the activation lane breaks the in-order
    # matching there: the simulator must report it (what makes its proof worth having)
    import dataclasses

    from pipekernel.schedules.program import plan_communication
    from pipekernel.schedules.lanes import lane_map

    lanes_of = lane_map(2, 1, "loop", ((0, 1),)).lanes
    activations, skips = lanes_of[("activation", 0, 1)], lanes_of[("skip", 0, 1)]

    def shared(steps, **kw):
        plan = plan_communication(steps, **kw)
        lanes = tuple(activations if lane == skips else lane for lane in plan.lanes)
        return dataclasses.replace(plan, lanes=lanes)

    with pytest.raises(pk.ScheduleError, match="mismatched|deadlock"):
        simulate(BUILTIN_SCHEDULES["1f1b"], 2, 3, skips=[(0, 1)], posting=shared)


def test_memory_model_counts_a_stash_at_both_ends_and_not_in_between():
    from pipekernel.plugins.partition import measure_layers

    module = pk.PipelineModule([Stasher(), nn.Identity(), nn.Identity(), Popper()])
    _, _, act = measure_layers(module, torch.ones(4, 16), time_it=False)
    # x * 2 (4 x 16 float32 = 256 bytes) is held by the stashing layer and the popping
    # one until backward; scalar multiply and add save nothing for backward themselves
    assert act == [256.0, 0.0, 0.0, 256.0]


@pytest.mark.parametrize("schedule,stages,chunks", [("1f1b", 4, None), ("zbv", 2, None)])
def test_skips_train_under_rendezvous_semantics(schedule, stages, chunks):
    # NCCL's rules on CPU (sends rendezvous, lanes in order): the runtime posts the
    # plan's groups, skip transfers included, and trains to parity
    from test_comm_model import _train

    results = run_ranks(_train, stages, "skips", stages, 4, schedule, chunks, timeout=240)
    build, data = MODELS["skips"]
    ref_losses, ref_state = reference_train(build(), sgd, [[data(s, 0, 4)] for s in range(2)], 4)
    for losses, state, posted, expected in results:
        assert_parity(losses, ref_losses, state, ref_state)
        want = [[kind for kind, _ in g] for g in expected]
        assert [[kind for kind, _ in g] for g in posted][-len(want):] == want


class ForwardsOutOfOrder(BUILTIN_SCHEDULES["gpipe"]):
    """Valid without skips: the last stage receives micro-batches 0 and 1 in order but
    forwards 1 before 0, so it would pop 0's skips into micro-batch 1."""

    name = "forwards-out-of-order"

    def steps(self):
        steps = super().steps()
        if self.is_last and self.micro_batches == 2:
            (l0, r0, f0), (l1, r1, f1) = steps[0], steps[1]
            steps[0], steps[1] = [l0, r0, l1, r1], [f1, f0]
        return steps


def test_a_schedule_that_cannot_route_skips_is_refused_before_the_first_batch():
    from pipekernel.model.skip_routing import check_schedules

    simulate(ForwardsOutOfOrder, 2, 2)  # fine without skips
    with pytest.raises(pk.ScheduleError, match="mismatched skip"):
        simulate(ForwardsOutOfOrder, 2, 2, skips=[(0, 1)])

    with pytest.raises(pk.ConfigError, match=r"'forwards-out-of-order' cannot route the skip "
                                             r"connections \[\(0, 1\)\]"):
        check_schedules([ForwardsOutOfOrder], 2, 2, 1, [(0, 1)])
