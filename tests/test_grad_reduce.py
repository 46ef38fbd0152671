"""Bucketed, overlapped data-parallel gradient reduction (``pipekernel.step.grad_reduce``).

Unit tests drive a :class:`GradReducer` in one process over a fake transport that
plays ``world`` identical replicas (it multiplies by ``world``) and records when
each all-reduce started; multi-process tests check parity with the one-process
reference for 2 stages x 2 replicas with buckets small enough that several start
during the last backward (SGD, AdamW, bf16 masters, tied weights), parameters used
on one replica only or never, and that buckets are on the wire before
``ReduceGrads`` starts.
"""
from __future__ import annotations

import pytest
import torch
from models import MODELS, adam, sgd
from sweep import Sweep
from torch import nn

import pipekernel as pk
from pipekernel.schedules import instructions as isa
from pipekernel.errors import ConfigError
from pipekernel.step.grad_reduce import GradReducer
from pipekernel.testing import assert_parity, reference_train

STEPS = 4
SMALL = 1.0 / 1024  # 1 KiB buckets: the 16-wide MLP stage splits into several


# -- unit tests: one process, a fake transport ------------------------------------------
class _Done:
    def wait(self):
        pass

    def is_completed(self):
        return True


class FakeReplicas:
    """``iall_reduce`` as over ``world`` replicas holding the same tensor; records each call
    as ``(numel, started inside autograd's backward)``."""

    def __init__(self, world=2):
        self.world, self.calls = world, []

    def iall_reduce(self, tensor, op="sum", group=None):
        self.calls.append((tensor.numel(), torch._C._current_graph_task_id() != -1))
        tensor.mul_(self.world)
        return _Done()


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def _backward(net, reducer=None, micro_batches=3):
    g = torch.Generator().manual_seed(1)
    for m in range(micro_batches):
        if reducer is not None and m == micro_batches - 1:
            reducer.arm()
        net(torch.randn(5, 4, generator=g)).pow(2).sum().backward()
    if reducer is not None:
        reducer.backward_done()


def test_layout_reverse_order_capacity_and_late_parameters():
    net = _net()
    params = list(net.parameters())
    names = [n for n, _ in net.named_parameters()]
    # bytes: 4.bias 8, 4.weight 64, 2.bias 32, 2.weight 256, 0.bias 32, 0.weight 128 (late)
    reducer = GradReducer(params, FakeReplicas(), None, 2, 300, names=names,
                          late=[net[0].weight])
    assert reducer.layout() == [["4.bias", "4.weight", "2.bias"], ["2.weight", "0.bias"],
                                ["0.weight"]]
    assert GradReducer(params, FakeReplicas(), None, 2, 0, names=names).layout() == [
        names[::-1]]  # no overlap: one flat bucket
    frozen = _net()
    frozen[2].weight.requires_grad_(False)
    assert "2.weight" not in sum(GradReducer(frozen.parameters(), FakeReplicas(), None, 2, 300,
                                             names=names).layout(), [])


def test_buckets_start_inside_the_last_backward_and_results_are_the_average():
    net, ref = _net(), _net()
    transport = FakeReplicas(world=2)
    reducer = GradReducer(list(net.parameters()), transport, None, 2, 100)
    _backward(ref)
    _backward(net, reducer)
    n = len(reducer.buckets)
    assert n == 5 and len(transport.calls) == n and all(inside for _, inside in transport.calls)
    reducer.finish()
    assert reducer.last_launches == ["backward"] * n
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    # earlier micro-batches and a second batch: hooks only while armed
    _backward(net)
    assert len(transport.calls) == n


def test_arm_with_final_parameters_starts_their_buckets_at_once():
    net = _net()
    transport = FakeReplicas()
    reducer = GradReducer(list(net.parameters()), transport, None, 2, 100)
    _backward(net)
    reducer.arm(final=list(net[4].parameters()))  # the first bucket: 4.bias, 4.weight
    assert len(transport.calls) == 1 and not transport.calls[0][1]
    reducer.finish()


def test_no_overlap_and_finish_alone_reduce_at_finish():
    for bucket_bytes, arm in ((0, True), (300, False)):
        net, ref = _net(), _net()
        transport = FakeReplicas()
        reducer = GradReducer(list(net.parameters()), transport, None, 2, bucket_bytes)
        _backward(ref)
        _backward(net, reducer if arm else None)
        assert transport.calls == []
        reducer.finish()
        assert set(reducer.last_launches) == {"finish"}
        for p, q in zip(net.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_masters_start_after_backward_and_missing_gradients_stay_none():
    net = _net()
    masters = {id(p): nn.Parameter(p.detach().clone()) for p in net[0].parameters()}
    transport = FakeReplicas()
    reducer = GradReducer(list(net.parameters()), transport, None, 2, 300,
                          master=lambda p: masters.get(id(p), p))
    unused = nn.Parameter(torch.ones(3))
    lonely = GradReducer([unused], transport, None, 2, 300)
    _backward(net, reducer)
    for p in net[0].parameters():  # what a precision's after_backward does
        masters[id(p)].grad, p.grad = p.grad.clone(), None
    lonely.arm()
    lonely.backward_done()
    reducer.finish()
    lonely.finish()
    assert reducer.last_launches == ["backward"] * 2 + ["after_backward"]
    assert unused.grad is None  # no replica had one (the flags say so): the optimizer skips it
    assert all(masters[id(p)].grad is not None and p.grad is None for p in net[0].parameters())


# -- multi-process: parity with the one-process reference --------------------------------
class LaunchCounter:
    """Wraps the gloo transport, counts ``iall_reduce`` calls (and those started inside
    autograd's backward), and notes the count when each ``ReduceGrads`` starts."""

    def __init__(self):
        self.started = self.in_backward = 0
        self.at_reduce_grads = []
        self.points = []  # (the reducer's point, buckets started before it) per batch

    @pk.hookimpl
    def pipekernel_make_transport(self, name, options):
        if name != "counting":
            return None
        from pipekernel.transports.gloo import GlooTransport
        inner, counter = GlooTransport(**options), self

        class Counting:
            def __getattr__(self, attr):
                return getattr(inner, attr)

            def iall_reduce(self, tensor, op="sum", group=None):
                counter.started += 1
                counter.in_backward += torch._C._current_graph_task_id() != -1
                return inner.iall_reduce(tensor, op, group)
        return Counting()

    @pk.hookimpl
    def pipekernel_before_instruction(self, instruction):
        if isinstance(instruction, isa.ReduceGrads):
            self.at_reduce_grads.append(self.started)
        elif isinstance(instruction, (isa.ArmGradReduce, isa.LaunchGradReduce)):
            self.points.append((type(instruction).__name__, self.started))


def train_worker(model, stages, dp, micro_batches, optimizer, precision="fp32",
                 grad_bucket_mb=SMALL, steps=STEPS):
    build, data = MODELS[model]
    counter = LaunchCounter()
    engine = pk.PipelineEngine(build(num_stages=stages), optimizer=optimizer,
                               micro_batches=micro_batches, data_parallel_size=dp,
                               precision=precision, transport="counting", timeout=60,
                               grad_bucket_mb=grad_bucket_mb, plugins=[counter])
    losses = [engine.train_batch(iter(data(step, engine.data_parallel_rank, micro_batches)))
              .item() for step in range(steps)]
    state = {name: engine.precision.master(p).detach().clone()
             for name, p in engine.module.named_parameters()}
    state.update({k: v for k, v in engine.module.state_dict().items() if k not in state})
    reducer = engine.grad_reducer
    return {"losses": losses, "state": state, "stage": engine.stage,
            "replica": engine.data_parallel_rank,
            "launches": reducer.last_launches, "buckets": len(reducer.buckets),
            "at_reduce_grads": counter.at_reduce_grads, "points": counter.points,
            "started": counter.started,
            "in_backward": counter.in_backward}


SWEEP = Sweep()  # every case below in one world of 2 stages x 2 replicas


def case(name, model, micro_batches=4, optimizer=sgd, precision="fp32", steps=STEPS,
         grad_bucket_mb=SMALL):
    return SWEEP.case(name, 4, train_worker, model, 2, 2, micro_batches, optimizer, precision,
                      grad_bucket_mb, steps)


def check_parity(case, tol=(1e-5, 1e-6)):
    results = SWEEP.results(case)
    model, stages, dp, micro_batches, optimizer, precision, grad_bucket_mb, steps = case.args
    build, data = MODELS[model]
    batches = [[data(step, r, micro_batches) for r in range(dp)] for step in range(steps)]
    ref_losses, ref_state = reference_train(build(), optimizer, batches, micro_batches)
    covered = set()
    for r in results:
        assert_parity(r["losses"], ref_losses, r["state"], ref_state, rtol=tol[0], atol=tol[1])
        covered |= set(r["state"])
    assert covered == set(ref_state)
    return results


SMALL_BUCKETS = [case("small-sgd", "mlp", optimizer=sgd),
                 case("small-adamw", "mlp", optimizer=adam)]
ON_THE_WIRE = SWEEP.case("on-the-wire", 4, train_worker, "mlp", 2, 2, 4, sgd, "fp32", SMALL, 2)
NO_OVERLAP = case("no-overlap", "mlp", grad_bucket_mb=0)
BF16 = case("bf16", "mlp", precision="bf16", steps=6)
TIED = case("tied", "tied", optimizer=adam)
BRANCHES = case("branches", "branches", optimizer=adam)


@pytest.mark.parametrize("case", SMALL_BUCKETS, ids=["sgd", "adamw"])
def test_parity_small_buckets_start_during_the_last_backward(case):
    for r in check_parity(case):
        assert r["buckets"] >= 3
        assert r["launches"] == ["backward"] * r["buckets"], r["launches"]


def test_buckets_are_on_the_wire_before_reduce_grads():
    results = SWEEP.results(ON_THE_WIRE)
    for r in results:
        # per batch: every bucket started by ReduceGrads, from hooks inside the backward
        # (the loss's all-reduce over the world is a blocking all_reduce, not counted)
        assert r["at_reduce_grads"] == [r["buckets"], 2 * r["buckets"]], r
        assert r["in_backward"] == r["started"] == 2 * r["buckets"]


def test_the_reducers_points_are_instructions_every_hook_sees():
    """Arming and launching are instructions of the program (what the monitor times): the
    kernel's hooks see ArmGradReduce before the last backward starts any bucket and
    LaunchGradReduce once it started them all, once per batch."""
    for r in SWEEP.results(ON_THE_WIRE):
        b = r["buckets"]
        assert r["points"] == [("ArmGradReduce", 0), ("LaunchGradReduce", b),
                               ("ArmGradReduce", b), ("LaunchGradReduce", 2 * b)], r["points"]


def test_no_overlap_option_gives_the_same_training():
    for r in check_parity(NO_OVERLAP):
        assert r["launches"] == ["finish"] and r["at_reduce_grads"] == list(range(STEPS))
        assert r["points"] == []  # nothing overlaps: the programs hold no such points


def test_bf16_masters_start_after_backward_parity():
    # test_precision's bf16 tolerance: 5e-3 on losses (relative) and fp32 masters (absolute)
    for r in check_parity(BF16, tol=(5e-3, 5e-3)):
        assert r["launches"] == ["after_backward"] * r["buckets"] and r["buckets"] >= 3
        assert all(v.dtype == torch.float32 for v in r["state"].values())


def test_tied_weights_wait_for_the_tied_sum():
    for r in check_parity(TIED):
        assert r["launches"][-1] == "finish" and "backward" in r["launches"], r["launches"]


# -- parameters with no gradient on some replica --------------------------------------------
class Branches(nn.Module):
    """``b`` joins when ``x[0, 0] > 0`` and ``c`` when ``x[0, 1] > 0`` (data decides, per
    micro-batch); ``never`` is not used at all."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(8, 16)
        self.never = nn.Parameter(torch.ones(16))

    def forward(self, x):
        h = self.a(x)
        if x[0, 0] > 0:
            h = h + self.b(x)
        if x[0, 1] > 0:
            h = h + self.c(x)
        return h


def branches(num_stages=None):
    layers = [pk.LayerSpec(Branches), torch.tanh, pk.LayerSpec(nn.Linear, 16, 16), torch.tanh,
              pk.LayerSpec(nn.Linear, 16, 16), pk.LayerSpec(nn.Linear, 16, 4)]
    return pk.PipelineModule(layers, loss_fn=nn.MSELoss(), num_stages=num_stages,
                             partition=[0, 3, 6] if num_stages else "uniform", seed=5)


def branch_data(step, replica, micro_batches):
    """Replica 0 always uses ``b`` and never ``c``; replica 1 never uses ``b`` and uses
    ``c`` in its first micro-batch only (a gradient, but none in the last backward)."""
    items = MODELS["mlp"][1](step, replica, micro_batches)
    for m, (x, _) in enumerate(items):
        x[0, 0] = 1.0 if replica == 0 else -1.0
        x[0, 1] = 1.0 if replica == 1 and m == 0 else -1.0
    return items


MODELS = {**MODELS, "branches": (branches, branch_data)}


def test_parameters_unused_on_a_replica_or_everywhere_match_the_reference():
    # AdamW decays weights: a zero-filled `never` that reached the optimizer would move
    results = check_parity(BRANCHES)
    first = [r for r in results if r["stage"] == 0]
    assert all(torch.equal(r["state"]["0.never"], torch.ones(16)) for r in first)
    # the buckets holding `never` (and `b` or `c`) wait for the backward's end, not the step
    assert all("after_backward" in r["launches"] for r in first)
    assert all("finish" not in r["launches"] for r in results)


def test_grad_bucket_mb_is_checked():
    with pytest.raises(ConfigError, match="grad_bucket_mb"):
        pk.PipelineEngine(MODELS["mlp"][0](num_stages=1), optimizer=sgd, grad_bucket_mb=-1)
