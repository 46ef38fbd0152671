"""Auxiliary losses (``pk.add_aux_loss``): their gradient flows in the stage's own backward
with the main loss's scaling, under every kind of backward (full, split, checkpointed),
and the returned loss includes them, reported apart in the metrics."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import pipekernel as pk
from pipekernel.errors import DataError
from pipekernel.model.aux_loss import attach
from pipekernel.stage.split_backward import backward_input, backward_weight
from pipekernel.step.stats import StepStats
from pipekernel.testing import assert_parity, run_ranks


class AuxLinear(nn.Module):
    """A linear layer that adds two aux losses: one of its activation, one of its weight
    alone (the latter reaches only parameters: a split node of the weight pass)."""

    def __init__(self, width: int = 8, coef: float = 0.1) -> None:
        super().__init__()
        self.lin, self.coef = nn.Linear(width, width), coef

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x))
        pk.add_aux_loss(self.coef * h.pow(2).mean())
        pk.add_aux_loss(0.01 * self.lin.weight.pow(2).sum())
        return h


def aux_mlp(num_stages=None, checkpoint=0):
    layers = [pk.LayerSpec(nn.Linear, 4, 8)]
    layers += [pk.LayerSpec(AuxLinear) for _ in range(6)]
    layers += [pk.LayerSpec(pk.MoE, 8, 8, 4, top_k=2, aux_loss_coef=0.05),
               pk.LayerSpec(nn.Linear, 8, 3)]
    return pk.PipelineModule(layers, loss_fn=nn.MSELoss(), num_stages=num_stages,
                             partition="uniform", seed=3,
                             activation_checkpoint_interval=checkpoint)


def data(step, replica, micro_batches):
    g = torch.Generator().manual_seed(1000 * step + 10 * replica)
    return [(torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g))
            for _ in range(micro_batches)]


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def reference(build, steps, micro_batches, replicas=1):
    """One process with accumulation of ``loss + aux``; per step (total, aux part)."""
    model = build().build_stage(0, [0, len(build().layers)])
    opt = sgd(list(model.parameters()))
    losses, auxes = [], []
    scale = 1.0 / (micro_batches * replicas)
    for step in range(steps):
        total = aux_total = 0.0
        for r in range(replicas):
            for inputs, labels in data(step, r, micro_batches):
                with pk.aux_losses() as aux:
                    loss = nn.functional.mse_loss(model(inputs), labels)
                aux_sum = torch.stack(aux).sum()
                ((loss + aux_sum) * scale).backward()
                total += (loss + aux_sum).item() * scale
                aux_total += aux_sum.item() * scale
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
        auxes.append(aux_total)
    with torch.no_grad(), pk.aux_losses() as aux:
        evals = [nn.functional.mse_loss(model(x), y).item() for x, y in data(99, 0, 4)]
    ev = sum(evals) / len(evals) + torch.stack(aux).sum().item() / len(evals)
    return losses, auxes, {k: v.detach().clone() for k, v in model.state_dict().items()}, ev


class Metrics:
    def __init__(self):
        self.seen = []

    @pk.hookimpl
    def pipekernel_after_train_batch(self, engine, loss, metrics):
        self.seen.append((float(loss), metrics.get("aux_loss")))


CASES = [("1f1b", None, 0, 4), ("zb-h1", None, 0, 4), ("dualpipev", 2, 0, 4),
         ("zbv", 2, 1, 4), ("1f1b", None, 2, 3), ("interleaved", 2, 0, 4)]


def _worker(cases, steps):
    from pipekernel.plugins.monitor import Monitor

    out = []
    for schedule, chunks, checkpoint, micro_batches in cases:
        metrics, monitor = Metrics(), Monitor(sinks=(), dump_signal=None)
        engine = pk.PipelineEngine(aux_mlp(2, checkpoint), optimizer=sgd,
                                   micro_batches=micro_batches, schedule=schedule,
                                   chunks=chunks, plugins=[metrics, monitor], timeout=60)
        losses = [engine.train_batch(iter(data(s, 0, micro_batches))).item()
                  for s in range(steps)]
        eval_loss = engine.eval_batch(iter(data(99, 0, 4)), micro_batches=4).item()
        state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
        engine.close()
        seen = [(lo, aux, record["extra"].get("aux_loss"))  # and in the monitor's records
                for (lo, aux), record in zip(metrics.seen, monitor.history)]
        out.append((losses, seen, state, eval_loss))
    return out, _tokens_refused()


def _tokens_refused():
    """``loss_reduction="tokens"`` rescales every gradient after the backward: refused."""
    module = aux_mlp(2)
    module.loss_fn = lambda out, y: (((out - y) ** 2).sum(), torch.tensor(y.numel()))
    engine = pk.PipelineEngine(module, optimizer=sgd, micro_batches=2,
                               loss_reduction="tokens", timeout=60)
    try:
        engine.train_batch(iter(data(0, 0, 2)))
    except pk.PipelineError as err:
        return f"{type(err).__name__}: {err}"
    finally:
        engine.close()
    return None


def test_aux_losses_train_like_one_process_under_every_kind_of_backward():
    steps = 2
    results = run_ranks(_worker, 2, CASES, steps, timeout=300)
    for _, refused in results:  # the first to fail names it; its peer hears of it
        assert "pk.add_aux_loss) with loss_reduction='tokens'" in (refused or ""), refused
    results = [runs for runs, _ in results]
    for index, (schedule, chunks, checkpoint, micro_batches) in enumerate(CASES):
        build = lambda: aux_mlp(None, checkpoint)  # noqa: E731
        ref_losses, ref_aux, ref_state, ref_eval = reference(build, steps, micro_batches)
        covered = set()
        for rank_results in results:
            losses, seen, state, eval_loss = rank_results[index]
            assert_parity(losses, ref_losses, state, ref_state)
            covered |= set(state)
            # reported apart: the same on every rank, part of the returned loss
            assert [a for _, a, _ in seen] == pytest.approx(ref_aux, rel=1e-5)
            assert [m for _, _, m in seen] == [a for _, a, _ in seen]
            assert [lo for lo, _, _ in seen] == pytest.approx(losses, rel=1e-6)
            assert eval_loss == pytest.approx(ref_eval, rel=1e-5), (schedule, chunks)
        assert covered == set(ref_state), schedule


def test_add_aux_loss_collects_inside_aux_losses_only():
    layer = AuxLinear()
    x = torch.randn(3, 8)
    layer(x)  # outside any collector: nothing happens
    with pk.aux_losses() as aux:
        layer(x)
    assert len(aux) == 2 and all(a.dim() == 0 for a in aux)
    with pytest.raises(DataError, match="one-element tensor, got a tensor of shape"):
        with pk.aux_losses():
            pk.add_aux_loss(torch.ones(2))
    with pytest.raises(DataError, match="floating-point"):
        with pk.aux_losses():
            pk.add_aux_loss(torch.tensor(1))


def test_a_checkpointed_recompute_adds_nothing():
    layer = AuxLinear()
    x = torch.randn(3, 8, requires_grad=True)
    with pk.aux_losses() as aux:
        y = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
        (y.sum() + torch.stack(aux).sum()).backward()  # recomputes layer's forward
        assert len(aux) == 2


def _graph(layer, x):
    with pk.aux_losses() as aux:
        y = layer(x)
    return y, torch.stack(aux).sum()


@pytest.mark.parametrize("split", [False, True])
def test_the_attached_aux_loss_gets_the_main_loss_scale(split):
    """A middle stage: ``attach`` gives the aux loss the seed (1/m) as gradient, in a full
    backward and in the split one (the weight pass holds the router's gradient)."""
    torch.manual_seed(0)
    layer = AuxLinear()
    x = torch.randn(3, 8)
    grad_out = torch.randn(3, 8)
    seed = torch.tensor(0.25)
    # reference: backward of <y, grad_out> + seed * aux
    y, aux = _graph(layer, x.clone().requires_grad_())
    torch.autograd.backward([y, aux], [grad_out, seed])
    expected = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    inputs = x.clone().requires_grad_()
    y, aux = _graph(layer, inputs)
    y = attach(y, aux, seed)
    if split:
        grads, state = backward_input([y], [grad_out], [inputs], list(layer.parameters()))
        assert all(p.grad is None for p in layer.parameters())
        backward_weight(state)
    else:
        torch.autograd.backward([y], [grad_out])
    for n, p in layer.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=1e-6, atol=1e-7)


def test_attach_refuses_outputs_without_gradients():
    assert attach(torch.ones(2), torch.tensor(1.0, requires_grad=True), torch.tensor(1.0)) is None


def test_step_stats_carry_the_aux_sum_count_and_flags():
    stats = StepStats("cpu", micro_batches=2, world=3, flags=True)
    stats.put_losses([torch.tensor(1.0)], [0], rank=2)
    stats.put_aux([torch.tensor(0.5), torch.tensor(float("inf"))], [0, 1], rank=2)
    values = stats.read()
    assert values[stats.LOSS] == 1.0 and values[stats.AUX_COUNT] == 2
    assert stats.bad_micro_batches(values) == [1] and stats.bad_ranks(values) == [2]
