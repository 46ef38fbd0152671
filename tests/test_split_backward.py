"""split_backward: B (input grads) + W (param grads) equal one full backward, without
re-running the input path."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from pipekernel.errors import PipelineError
from pipekernel.stage.split_backward import WeightGradState, backward_input, backward_weight


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

ATOL = 1e-6


# ---------------------------------------------------------------- stage modules

class LinearTanh(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                                 nn.Linear(16, 8))

    def forward(self, x):
        return self.net(x)


class CausalEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0,
                                                batch_first=True)

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.layer(x, src_mask=mask, is_causal=True)


class ConvNormGelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):  # (batch, length, 8)
        h = self.conv(x.transpose(1, 2)).transpose(1, 2)
        return nn.functional.gelu(self.norm(h)) + x


class Tied(nn.Module):
    """One Linear applied twice, and a scale parameter used directly twice."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, x):
        h = torch.tanh(self.lin(x) * self.scale)
        return self.lin(h) * self.scale + h


class Unused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 8)
        self.spare = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return torch.tanh(self.used(x))


class TupleOut(nn.Module):
    """Two outputs: a float activation and a bool mask (no gradient)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        return h, h > 0


MODULES = [LinearTanh, CausalEncoder, ConvNormGelu, Tied, Unused, TupleOut]
INPUT_SHAPE = {CausalEncoder: (2, 5, 16)}


def make(cls, seed=0):
    torch.manual_seed(seed)
    return cls()


def as_list(out):
    return list(out) if isinstance(out, tuple) else [out]


def sample(cls, seed):
    g = torch.Generator().manual_seed(100 + seed)
    return torch.randn(INPUT_SHAPE.get(cls, (2, 5, 8)), generator=g)


def out_grads(outs, seed):
    g = torch.Generator().manual_seed(200 + seed)
    return [torch.randn(o.shape, generator=g) if o.is_floating_point() else None for o in outs]


def loss_of(outs):
    return outs[0].pow(2).mean() * 1024.0  # as a loss scaler would pass it


def split_step(model, position, seed=0):
    """One micro-batch through B then W; returns the input grad (or None) and checks that
    B wrote no .grad anywhere."""
    x = sample(type(model), seed).requires_grad_(position != "first")
    before = {n: (None if p.grad is None else p.grad.clone())
              for n, p in model.named_parameters()}
    outs = as_list(model(x))
    inputs = [] if position == "first" else [x]
    if position == "last":
        grads, state = backward_input([], [], inputs, list(model.parameters()),
                                      loss=loss_of(outs))
    else:
        grads, state = backward_input(outs, out_grads(outs, seed), inputs,
                                      list(model.parameters()))
    assert x.grad is None
    for n, p in model.named_parameters():  # B touched no parameter gradient
        if before[n] is None:
            assert p.grad is None, n
        else:
            assert torch.equal(p.grad, before[n]), n
    assert len(grads) == len(inputs)
    backward_weight(state)
    assert state.done
    return grads[0] if grads else None


def full_step(model, position, seed=0):
    x = sample(type(model), seed).requires_grad_(position != "first")
    outs = as_list(model(x))
    if position == "last":
        loss_of(outs).backward()
    else:
        pairs = [(o, g) for o, g in zip(outs, out_grads(outs, seed)) if g is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return x.grad


def assert_same_grads(model, ref):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is None:
            assert p.grad is None, f"{name}: split gave a gradient, full backward none"
        else:
            assert p.grad is not None, f"{name}: no gradient after backward_weight"
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=ATOL, msg=name)


# ---------------------------------------------------------------- parity

@pytest.mark.parametrize("position", ["middle", "first", "last"])
@pytest.mark.parametrize("cls", MODULES, ids=lambda c: c.__name__)
def test_split_equals_full_backward(cls, position):
    model = make(cls)
    ref = copy.deepcopy(model)
    gx = split_step(model, position)
    gx_ref = full_step(ref, position)
    if position == "first":
        assert gx is None and gx_ref is None
    else:
        torch.testing.assert_close(gx, gx_ref, rtol=0, atol=ATOL)
    assert_same_grads(model, ref)
    assert any(p.grad is not None for p in model.parameters())


def test_linear_chain_is_bitwise_exact():
    model = make(LinearTanh)
    ref = copy.deepcopy(model)
    assert torch.equal(split_step(model, "middle"), full_step(ref, "middle"))
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_unused_parameters_are_left_untouched():
    model = make(Unused)
    model.spare.grad = torch.full((3,), 7.0)
    split_step(model, "middle")
    assert model.unused.weight.grad is None and model.unused.bias.grad is None
    assert torch.equal(model.spare.grad, torch.full((3,), 7.0))
    assert model.used.weight.grad is not None


def test_tied_parameter_gets_the_sum_of_its_uses():
    model = make(Tied)
    ref = copy.deepcopy(model)
    split_step(model, "middle")
    full_step(ref, "middle")
    assert_same_grads(model, ref)
    # the tied Linear and the directly-used scale both had two uses: not just one of them
    single = copy.deepcopy(ref)
    for p in single.parameters():
        p.grad = None
    x = sample(Tied, 0).requires_grad_()
    h = torch.tanh(single.lin(x) * single.scale)
    (single.lin(h.detach()) * single.scale.detach() + h).backward(out_grads([h], 0)[0])
    assert not torch.allclose(single.lin.weight.grad, model.lin.weight.grad, atol=1e-4)


@pytest.mark.parametrize("cls", [LinearTanh, CausalEncoder, Tied], ids=lambda c: c.__name__)
def test_two_micro_batches_accumulate(cls):
    model = make(cls)
    ref = copy.deepcopy(model)
    for p, q in zip(model.parameters(), ref.parameters()):  # existing grads are added to
        p.grad = torch.full_like(p, 0.25)
        q.grad = torch.full_like(q, 0.25)
    # zero-bubble order: B of both micro-batches first, then W in the opposite order
    states, input_grads = [], []
    for mb in range(2):
        x = sample(cls, mb).requires_grad_()
        outs = as_list(model(x))
        grads, state = backward_input(outs, out_grads(outs, mb), [x], list(model.parameters()))
        input_grads.append(grads[0])
        states.append(state)
    for p in model.parameters():
        assert torch.equal(p.grad, torch.full_like(p, 0.25))
    for state in reversed(states):
        backward_weight(state)
    for mb in range(2):
        torch.testing.assert_close(input_grads[mb], full_step(ref, "middle", mb),
                                   rtol=0, atol=ATOL)
    assert_same_grads(model, ref)


def test_tuple_outputs_skip_the_bool_mask_and_none_grads():
    model = make(TupleOut)
    ref = copy.deepcopy(model)
    x = sample(TupleOut, 0).requires_grad_()
    h, mask = model(x)
    assert mask.dtype == torch.bool
    g = out_grads([h], 0)[0]
    # a gradient for the mask may even be passed: a non-float output is skipped
    (gx,), state = backward_input([h, mask], [g, torch.zeros_like(h)], [x],
                                  list(model.parameters()))
    backward_weight(state)
    x2 = x.detach().clone().requires_grad_()
    ref(x2)[0].backward(g)
    torch.testing.assert_close(gx, x2.grad, rtol=0, atol=ATOL)
    assert_same_grads(model, ref)


def test_inputs_that_do_not_require_grad_or_are_unused_get_zeros():
    lin = make(LinearTanh)
    ref = copy.deepcopy(lin)
    x = sample(LinearTanh, 0).requires_grad_()
    side = torch.randn(2, 5, 8)                       # does not require grad
    unused = torch.randn(4, requires_grad=True)       # requires grad, not used
    ids = torch.arange(5)                             # integer input
    out = lin(x) + side
    g = out_grads([out], 0)[0]
    grads, state = backward_input([out], [g], [x, side, unused, ids], list(lin.parameters()))
    assert [t.shape for t in grads] == [x.shape, side.shape, unused.shape, ids.shape]
    assert torch.equal(grads[1], torch.zeros_like(side))
    assert torch.equal(grads[2], torch.zeros(4))
    assert torch.equal(grads[3], torch.zeros_like(ids)) and grads[3].dtype == ids.dtype
    backward_weight(state)
    x2 = x.detach().clone().requires_grad_()
    (ref(x2) + side).backward(g)
    torch.testing.assert_close(grads[0], x2.grad, rtol=0, atol=ATOL)
    assert_same_grads(lin, ref)


def test_first_stage_backward_input_runs_nothing():
    model = make(LinearTanh)
    x = sample(LinearTanh, 0)
    out = model(x)
    with FlopCounterMode(display=False) as flops:
        grads, state = backward_input([out], out_grads([out], 0), [], list(model.parameters()))
    assert grads == [] and flops.get_total_flops() == 0
    backward_weight(state)
    assert all(p.grad is not None for p in model.parameters())


# ---------------------------------------------------------------- no recomputation

class Count(torch.autograd.Function):
    """Identity whose backward counts its calls (per tag)."""

    calls: dict[str, int] = {}

    @staticmethod
    def forward(ctx, x, tag):
        ctx.tag = tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        Count.calls[ctx.tag] = Count.calls.get(ctx.tag, 0) + 1
        return g, None


class Counted(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        h = torch.tanh(self.a(Count.apply(x, "input")))             # stage input side
        h = Count.apply(h, "middle")                                  # between layers
        w = Count.apply(self.b.weight, "weight")                      # parameter side
        return nn.functional.linear(h, w, self.b.bias)


def test_weight_pass_does_not_rerun_the_input_path():
    Count.calls.clear()
    model = make(Counted)
    ref = copy.deepcopy(model)
    x = sample(Counted, 0).requires_grad_()
    out = model(x)
    g = out_grads([out], 0)[0]
    (gx,), state = backward_input([out], [g], [x], list(model.parameters()))
    assert Count.calls == {"input": 1, "middle": 1}  # B: the input path only
    backward_weight(state)
    assert Count.calls == {"input": 1, "middle": 1, "weight": 1}  # W: the weight side only
    Count.calls.clear()
    x2 = x.detach().clone().requires_grad_()
    ref(x2).backward(g)
    assert Count.calls == {"input": 1, "middle": 1, "weight": 1}
    torch.testing.assert_close(gx, x2.grad, rtol=0, atol=ATOL)
    assert_same_grads(model, ref)


@pytest.mark.parametrize("cls", [LinearTanh, CausalEncoder, ConvNormGelu, Tied],
                         ids=lambda c: c.__name__)
def test_input_and_weight_pass_together_cost_one_backward(cls):
    """FLOPs of B + W equal those of one full backward (nothing is computed twice), and
    both passes do real work."""
    model = make(cls)
    x = sample(cls, 0).requires_grad_()
    out = model(x)
    g = out_grads([out], 0)[0]
    with FlopCounterMode(display=False) as b:
        _, state = backward_input([out], [g], [x], list(model.parameters()))
    with FlopCounterMode(display=False) as w:
        backward_weight(state)
    out = model(x)
    with FlopCounterMode(display=False) as full:
        out.backward(g)
    assert b.get_total_flops() > 0 and w.get_total_flops() > 0
    assert b.get_total_flops() + w.get_total_flops() == full.get_total_flops()


# ---------------------------------------------------------------- errors

def test_backward_weight_twice_raises():
    model = make(LinearTanh)
    x = sample(LinearTanh, 0).requires_grad_()
    out = model(x)
    _, state = backward_input([out], out_grads([out], 0), [x], list(model.parameters()))
    backward_weight(state)
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(PipelineError, match="twice"):
        backward_weight(state)
    for p, g in zip(model.parameters(), grads):  # the failed call changed nothing
        assert torch.equal(p.grad, g)


def test_argument_errors_are_clear():
    model = make(LinearTanh)
    x = sample(LinearTanh, 0).requires_grad_()
    out = model(x)
    params = list(model.parameters())
    with pytest.raises(PipelineError, match="both loss and outputs"):
        backward_input([out], [torch.ones_like(out)], [x], params, loss=out.sum())
    with pytest.raises(PipelineError, match="1 outputs but 2 grad_outputs"):
        backward_input([out], [torch.ones_like(out)] * 2, [x], params)
    with pytest.raises(PipelineError, match="one-element"):
        backward_input([], [], [x], params, loss=out)
    with pytest.raises(PipelineError, match="not a leaf"):
        backward_input([out], [torch.ones_like(out)], [x * 2], params)
    with pytest.raises(PipelineError, match="list of tensors"):
        backward_input(out, [torch.ones_like(out)], [x], params)
    with pytest.raises(PipelineError, match="state backward_input returned"):
        backward_weight(None)
    # nothing ran: a correct call still works afterwards
    (gx,), state = backward_input([out], [torch.ones_like(out)], [x], params)
    assert isinstance(state, WeightGradState)
    backward_weight(state)
    assert gx.shape == x.shape


def test_caller_may_reuse_its_grad_buffer_after_backward_input():
    model = make(LinearTanh)
    ref = copy.deepcopy(model)
    x = sample(LinearTanh, 0).requires_grad_()
    out = model(x)
    buf = out_grads([out], 0)[0]
    g = buf.clone()
    _, state = backward_input([out], [buf], [x], list(model.parameters()))
    buf.fill_(123.0)  # the runtime receives the next micro-batch's gradient into it
    backward_weight(state)
    full_step(ref, "middle")
    assert_same_grads(model, ref)
    assert torch.equal(g, out_grads([out], 0)[0])


class MyLinear(torch.autograd.Function):
    """A custom Function taking an activation and a parameter: a split node W cannot call
    directly (its backward computes both gradients whatever asks)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, (g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1]))


class CustomSplit(nn.Module):
    """MyLinear used twice with the same weight (tied), around a tanh."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) / 3)
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.tanh(MyLinear.apply(x, self.w))
        return MyLinear.apply(self.lin(h), self.w)


@pytest.mark.parametrize("position", ["middle", "first", "last"])
def test_custom_function_split_nodes(position):
    model = make(CustomSplit)
    ref = copy.deepcopy(model)
    gx = split_step(model, position)
    gx_ref = full_step(ref, position)
    if position != "first":
        torch.testing.assert_close(gx, gx_ref, rtol=0, atol=ATOL)
    assert_same_grads(model, ref)


# ---------------------------------------------------------------- checkpointing, compile, plans

class Checkpointed(nn.Module):
    """Two Linear + tanh blocks, each under activation checkpointing."""

    def __init__(self, reentrant=False):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2))
        self.reentrant = reentrant

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return x


class Compiled(nn.Module):
    """A torch.compile'd Linear + LayerNorm between two eager Linears: the compiled part is
    one custom autograd Function holding an activation and parameters (aot_eager: no C++
    toolchain needed, the same autograd structure as inductor's)."""

    def __init__(self):
        super().__init__()
        self.pre, self.post = nn.Linear(8, 8), nn.Linear(8, 8)
        self.inner = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
        self.compiled = torch.compile(self.inner, backend="aot_eager", dynamic=False)

    def forward(self, x):
        return self.post(torch.tanh(self.compiled(torch.tanh(self.pre(x)))))


@pytest.mark.parametrize("build,position", [
    (Checkpointed, "middle"), (Checkpointed, "first"), (Checkpointed, "last"),
    (Compiled, "middle")], ids=["checkpoint-middle", "checkpoint-first", "checkpoint-last",
                                "compiled-middle"])  # one compile only: it is slow on CPU
def test_checkpointed_and_compiled_layers_split_like_a_full_backward(build, position):
    torch.manual_seed(0)
    model = build()
    ref = copy.deepcopy(model)
    if isinstance(model, Compiled):  # the reference runs the same layers eagerly
        ref.compiled = ref.inner
    for seed in range(2):  # two micro-batches: the second reuses the first one's plan
        gx = split_step(model, position, seed)
        gx_ref = full_step(ref, position, seed)
        if position != "first":
            torch.testing.assert_close(gx, gx_ref, rtol=0, atol=ATOL)
    assert_same_grads(model, ref)


def test_reentrant_checkpointing_is_a_clear_error():
    model = Checkpointed(reentrant=True)
    x = torch.randn(2, 8, requires_grad=True)
    out = model(x)
    with pytest.raises(PipelineError, match=r"use_reentrant=True.*\n.*use_reentrant=False"):
        backward_input([out], [torch.ones_like(out)], [x], list(model.parameters()))


def test_the_split_is_planned_once_per_graph_shape(monkeypatch):
    from pipekernel.stage import split_backward as sb
    monkeypatch.setattr(sb, "_PLANS", {})
    made = []
    real = sb._Plan
    monkeypatch.setattr(sb, "_Plan", lambda *a: made.append(a) or real(*a))

    class Branchy(nn.Module):
        """The graph's shape depends on the data: a second Linear for positive sums."""

        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            h = torch.tanh(self.a(x))
            return self.b(h) * h if bool(x.sum() > 0) else h

    torch.manual_seed(0)
    model = Branchy()
    ref = copy.deepcopy(model)
    for seed in range(6):
        split_step(model, "middle", seed)
        full_step(ref, "middle", seed)
    assert_same_grads(model, ref)
    shapes = {bool(sample(Branchy, seed).sum() > 0) for seed in range(6)}
    assert len(made) == len(shapes) == 2  # one plan per shape, reused for the other seeds
