"""The communication model end to end: the runtime posts what the plan says, and real
pipelines train under NCCL's rules on CPU (rendezvous sends; a lane is one ordered stream
per rank, whatever the peer: tests/rendezvous_transport.py). 4 stages x 8 micro-batches
fill the pipeline: under per-pair order they passed with the old lanes, under this one
they deadlock with them (tests/test_lanes.py)."""
from __future__ import annotations

import dataclasses

import pytest
from models import MODELS, sgd
from rendezvous_transport import RendezvousPlugin
from sweep import Sweep

import pipekernel as pk
from pipekernel.engine.programs import load_program
from pipekernel.errors import TransportError
from pipekernel.schedules.comm import P2P
from pipekernel.schedules.program import compile_program
from pipekernel.testing import assert_parity, reference_train, run_ranks

STEPS = 2


def _train(model, stages, micro_batches, schedule, chunks=None, naive=False, timeout=60):
    build, data = MODELS[model]
    engine = pk.PipelineEngine(build(num_stages=stages), optimizer=sgd,
                               micro_batches=micro_batches, schedule=schedule,
                               transport="rendezvous", plugins=[RendezvousPlugin()],
                               timeout=timeout, chunks=chunks)
    if naive:  # the old model: every op posted alone where it stands, all on one lane
        # compiled, not loaded: loading makes the runtime's channels, on the plan's lanes
        program = compile_program(engine.schedule_cls, stage=engine.stage,
                                  num_stages=stages, micro_batches=micro_batches,
                                  chunks=engine.chunks, placement=engine.placement)
        posts = tuple((i,) if isinstance(ins, P2P) and not program.local[i]
                      and program.peers[i] else () for i, ins in enumerate(program.stream))
        engine._programs[engine.schedule_cls, engine.micro_batches] = load_program(
            engine, dataclasses.replace(program, posts=posts, lanes=tuple(
                0 if lane is not None else None for lane in program.lanes)))
    losses = [engine.train_batch(iter(data(step, 0, micro_batches))).item()
              for step in range(STEPS)]
    state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    plan = engine._program(engine.schedule_cls)
    expected = [[("send" if "Send" in type(plan.stream[i]).__name__ else "recv", None)
                 for i in group]
                for group in plan.posts if group]
    posted = [[(op, None) for op, _ in group] for group in engine.transport.groups_posted]
    engine.close()
    return losses, state, posted, expected


SWEEP = Sweep(timeout=240)  # one world per stage count for the cases below
CASES = [SWEEP.case(f"{schedule}-{stages}x{micro_batches}", stages, _train, "mlp", stages,
                    micro_batches, schedule, chunks)
         for schedule, stages, micro_batches, chunks in [
             ("1f1b", 4, 8, None), ("gpipe", 3, 3, None), ("interleaved", 4, 8, 2),
             ("zb-h1", 4, 8, None), ("zbv", 3, 4, 2)]]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_pipelines_train_under_rendezvous_semantics(case):
    results = SWEEP.results(case)
    micro_batches = case.args[2]
    build, data = MODELS["mlp"]
    ref_losses, ref_state = reference_train(build(), sgd,
                                            [[data(s, 0, micro_batches)] for s in range(STEPS)],
                                            micro_batches)
    for losses, state, posted, expected in results:
        assert_parity(losses, ref_losses, state, ref_state)
        # the runtime posted the plan's groups, in order: on the second batch (the fast
        # path: metadata known) exactly one data-lane message per transfer of the plan
        groups = [[kind for kind, _ in g] for g in posted]
        want = [[kind for kind, _ in g] for g in expected]
        assert groups[-len(want):] == want


def test_naive_posting_deadlocks_under_rendezvous():
    """Posting each send and receive alone where the instruction stands, on one ordered
    stream per pair (the old model), deadlocks 1F1B under rendezvous sends — each side's
    receive queues behind its own send; the engine must end with an error, not hang."""
    with pytest.raises(pk.RankError) as info:
        run_ranks(_train, 2, "mlp", 2, 4, "1f1b", None, True, 8, timeout=300)
    assert isinstance(info.value.original, TransportError)
    assert "RECV_" in str(info.value.original)  # names the instruction it was blocked on


def _lane_order(t, lane, back, send_lane):
    """Rank 1 posts a receive from rank 0 on ``lane`` and then a send to rank 2 on
    ``send_lane``; rank 0 sends only once rank 2, served by that send, has written to it
    (on ``back``). On another lane the send goes ahead; on the receive's lane it waits
    behind it, whatever the peer: a cycle."""
    import torch

    data = torch.zeros(4)
    try:
        if t.rank == 0:
            t.irecv(data, 2, tag=back).wait()
            t.isend(data + 1, 1, tag=lane).wait()
        elif t.rank == 1:
            got = t.irecv(data, 0, tag=lane)
            sent = t.isend(torch.full((4,), 5.0), 2, tag=send_lane)
            sent.wait()
            got.wait()
        else:
            t.irecv(data, 1, tag=send_lane).wait()
            t.isend(data, 0, tag=back).wait()
    except TransportError as err:
        return type(err).__name__
    return data.tolist()


def _lane_order_worker():
    import torch

    from rendezvous_transport import RendezvousTransport

    torch.set_num_threads(1)
    t = RendezvousTransport(timeout=120)  # the exchange that completes: slow ranks are fine
    apart = _lane_order(t, 0, 1, 2)
    t.timeout = 2  # the one that deadlocks: it times out whatever the timeout
    return apart, _lane_order(t, 3, 4, 3)


def test_the_emulator_runs_a_lane_in_posting_order_whatever_the_peer():
    results = run_ranks(_lane_order_worker, 3, timeout=240)
    assert [apart for apart, _ in results] == [[5.0] * 4, [6.0] * 4, [5.0] * 4]
    # the shared lane deadlocks: no rank completes; the first to give up times out, and a
    # peer may instead see that rank's connections close as it exits (a TransportError)
    shared = [shared for _, shared in results]
    assert set(shared) <= {"TransportTimeout", "TransportError"}, shared
    assert "TransportTimeout" in shared, shared


class _LanesPlugin:
    """``"few-lanes"``: a gloo transport with 1 lane; ``"opens-lanes"``: one that has none
    until the engine opens them (as nccl and cupy-nccl do)."""

    @pk.hookimpl
    def pipekernel_make_transport(self, name, options):
        from pipekernel.transports.gloo import GlooTransport

        if name == "few-lanes":
            transport = GlooTransport(**options)
            transport.max_tags = 1
            return transport
        if name == "opens-lanes":
            class Opens(GlooTransport):
                max_tags, opened = 0, []

                def open_lanes(self, count):
                    self.opened = [*self.opened, count]
                    self.max_tags = max(self.max_tags, count)

            return Opens(**options)
        return None


def _lanes_worker():
    import torch

    torch.set_num_threads(1)
    build, data = MODELS["mlp"]
    made = dict(optimizer=sgd, micro_batches=2, plugins=[_LanesPlugin()], timeout=60)
    try:
        pk.PipelineEngine(build(num_stages=2), transport="few-lanes", **made)
        refused = None
    except pk.ConfigError as err:
        refused = str(err)
    engine = pk.PipelineEngine(build(num_stages=2), transport="opens-lanes", **made)
    engine.train_batch(iter(data(0, 0, 2)))
    opened = engine.transport.opened
    engine.close()
    return refused, opened


def test_the_engine_opens_the_lanes_it_needs_and_refuses_too_few_at_start():
    for refused, opened in run_ranks(_lanes_worker, 2, timeout=240):
        assert "transport 'few-lanes' offers 1 lane(s) (tags) and 2 stage(s) x 1 chunk(s) " \
               "('loop' placement) needs 2" in refused
        assert opened == [2]  # 1F1B on 2 stages: activations one way, gradients back
