"""Built-in partition methods.

``partition=`` accepts:

* ``"uniform"`` (layer count), ``"parameters"`` (parameter count),
  ``"type:<regex>"`` (count of layers whose class name matches, case-insensitive);
* explicit boundaries ``[0, b1, ..., len(layers)]``;
* ``pk.balance(costs)`` or a callable ``cost(layer) -> float``: user costs;
* ``pk.profile(sample)``: measured forward + backward seconds per layer;
* ``pk.memory(sample)`` / ``"memory"``: estimated bytes, with activations
  multiplied by the micro-batches the schedule keeps in flight on each stage.
  A skip connection's stashed value (:mod:`pipekernel.model.skips`) counts as an
  activation of the layer that stashes it (unless autograd saves it there anyway)
  *and* of the layer that pops it: each end holds it until the micro-batch's
  backward. The stages in between hold nothing (the value is routed past them).
  When both ends land on one stage the value is counted twice: an upper estimate.

Every weighted method calls :func:`balance`, which is exact: it minimises the
largest stage cost over all contiguous splits with no empty stage.
Measuring methods run on global rank 0 only and broadcast the result, so every
rank builds the same partition even though timings differ between processes.
"""
from __future__ import annotations

import math
import re
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from pipekernel import LayerSpec, PartitionContext, PipelineModule
from pipekernel.errors import ConfigError
from pipekernel.plugin import (Balance, Memory, Profile, SkipScope, backward_input,
                               backward_weight, compute_on_one, hookimpl, map_tensors,
                               tensors_of, tensors_to)

__all__ = ["balance", "stage_costs", "stage_layer_costs", "measure_layers", "measure_layer_times"]

#: optimizer-state bytes per trainable parameter byte when nothing better is known (Adam)
DEFAULT_OPTIMIZER_STATES = 2.0


# ---------------------------------------------------------------------------
# the exact balancer
# ---------------------------------------------------------------------------

def _check_costs(values: Sequence[float], what: str) -> list[float]:
    out = []
    for i, v in enumerate(values):
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise ConfigError(f"{what} of layer {i} is {v!r}, not a number",
                              hint="give one non-negative number per layer") from None
        if not math.isfinite(f) or f < 0:
            raise ConfigError(f"{what} of layer {i} is {f}; costs must be finite and >= 0",
                              hint="give one non-negative number per layer")
        out.append(f)
    return out


def stage_costs(bounds: Sequence[int], weights: Sequence[float],
                activations: Sequence[float] | None = None,
                in_flight: Sequence[float] | None = None) -> list[float]:
    """Cost of each stage: ``Σ weights + in_flight[s] × Σ activations`` over its layers."""
    out = []
    for s in range(len(bounds) - 1):
        lo, hi = bounds[s], bounds[s + 1]
        cost = sum(weights[lo:hi])
        if activations is not None:
            cost += (in_flight[s] if in_flight is not None else 1) * sum(activations[lo:hi])
        out.append(cost)
    return out


def balance(weights: Sequence[float], num_stages: int,
            activations: Sequence[float] | None = None,
            in_flight: Sequence[float] | None = None) -> list[int]:
    """Boundaries minimising the largest stage cost, every stage non-empty.

    The cost of stage ``s`` holding layers ``[i, j)`` is
    ``Σ weights[i:j] + in_flight[s] × Σ activations[i:j]`` (just ``Σ weights``
    without ``activations``). Exact dynamic program over stages: the best cost of
    the first ``s`` stages grows with the layers they cover while the next stage's
    cost shrinks, so each cut is found by binary search — O(stages × layers × log layers);
    with in-flight counts that differ by stage that order does not hold and every cut
    is tried (vectorised, O(stages × layers²)).

    :raises ConfigError: more stages than layers, or a negative / non-finite cost.
    """
    n = len(weights)
    if not isinstance(num_stages, int) or num_stages < 1 or num_stages > n:
        raise ConfigError(f"cannot split {n} layers into {num_stages} stages",
                          hint="every stage needs at least one layer: use fewer stages or "
                               "more layers")
    w = _check_costs(weights, "cost")
    a = _check_costs(activations, "activation cost") if activations is not None else [0.0] * n
    if len(a) != n:
        raise ConfigError(f"{len(a)} activation costs for {n} layers",
                          hint="give one activation cost per layer")
    k = list(in_flight) if in_flight is not None else [1.0] * num_stages
    if len(k) != num_stages:
        raise ConfigError(f"{len(k)} in-flight counts for {num_stages} stages",
                          hint="give one in-flight count per stage")
    pw, pa = [0.0], [0.0]
    for x, y in zip(w, a):
        pw.append(pw[-1] + x)
        pa.append(pa[-1] + y)

    def cost(s: int, i: int, j: int) -> float:
        return (pw[j] - pw[i]) + k[s] * (pa[j] - pa[i])

    inf = math.inf
    best = [inf] + [cost(0, 0, j) for j in range(1, n + 1)]
    # With one in-flight count for every stage, the best cost of the first s stages
    # grows with the layers they cover, so each cut is a binary search. With counts
    # that differ by stage it need not (moving a layer to an earlier stage can cost
    # more there), so every cut is tried — vectorised, O(stages x layers^2).
    uniform = all(x == k[0] for x in k)
    choices: list[list[int]] = []
    for s in range(1, num_stages):
        if uniform:
            new, arg = _cuts_by_search(best, cost, s, n, num_stages)
        else:
            new, arg = _cuts_exhaustive(best, pw, pa, k[s], s, n, num_stages)
        best = new
        choices.append(arg)
    bounds, j = [n], n
    for arg in reversed(choices):
        j = arg[j]
        bounds.append(j)
    bounds.append(0)
    return bounds[::-1]


def _cuts_by_search(best: list[float], cost: Callable[[int, int, int], float], s: int,
                    n: int, num_stages: int) -> tuple[list[float], list[int]]:
    """Best cut before stage ``s`` for every end ``j``, when ``best`` is non-decreasing."""
    new, arg = [math.inf] * (n + 1), [0] * (n + 1)
    for j in range(s + 1, n - (num_stages - 1 - s) + 1):
        lo, hi = s, j - 1  # stage s holds [i, j); the stages before it need i >= s layers
        left, right = lo, hi + 1
        while left < right:  # first i where the earlier stages dominate
            mid = (left + right) // 2
            if best[mid] >= cost(s, mid, j):
                right = mid
            else:
                left = mid + 1
        for i in (left - 1, left):
            if lo <= i <= hi:
                value = max(best[i], cost(s, i, j))
                if value < new[j]:
                    new[j], arg[j] = value, i
    return new, arg


def _cuts_exhaustive(best: list[float], pw: list[float], pa: list[float], k: float, s: int,
                     n: int, num_stages: int) -> tuple[list[float], list[int]]:
    """Best cut before stage ``s`` for every end ``j``, trying every cut ``i``."""
    w, a = torch.tensor(pw, dtype=torch.float64), torch.tensor(pa, dtype=torch.float64)
    b = torch.tensor(best, dtype=torch.float64)
    cost = (w[None, :] - w[:, None]) + k * (a[None, :] - a[:, None])  # [i, j]
    value = torch.maximum(b[:, None], cost)
    i = torch.arange(n + 1)
    valid = (i[:, None] >= s) & (i[:, None] < i[None, :])
    value = value.masked_fill(~valid, math.inf)
    low, where = value.min(dim=0)
    new, arg = [math.inf] * (n + 1), [0] * (n + 1)
    low_l, where_l = low.tolist(), where.tolist()
    for j in range(s + 1, n - (num_stages - 1 - s) + 1):
        new[j], arg[j] = low_l[j], where_l[j]
    return new, arg


# ---------------------------------------------------------------------------
# measuring layers
# ---------------------------------------------------------------------------

def _leaf(obj: Any) -> Any:
    """Detached copy of ``obj`` whose float tensors require grad (like a received activation)."""
    return map_tensors(lambda t: t.detach().requires_grad_(True)
                       if t.is_floating_point() or t.is_complex() else t.detach(), obj)


def _grad_outputs(obj: Any) -> list[torch.Tensor]:
    return [t for t in tensors_of(obj) if t.requires_grad]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _static_bytes(layer: Any, index: int, optimizer: Callable | None,
                  optimizer_states: float | None) -> float:
    """Parameters + gradients + optimizer state + buffers of one built layer."""
    if not isinstance(layer, nn.Module):
        return 0.0
    params = list(layer.parameters())
    trainable = [p for p in params if p.requires_grad]
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    grad_bytes = sum(p.numel() * p.element_size() for p in trainable)
    buffer_bytes = sum(b.numel() * b.element_size() for b in layer.buffers())
    if optimizer_states is not None or optimizer is None or not trainable:
        factor = DEFAULT_OPTIMIZER_STATES if optimizer_states is None else optimizer_states
        state_bytes = factor * grad_bytes
    else:  # one step of the real optimizer on this throwaway layer
        for p in trainable:
            p.grad = torch.zeros_like(p)
        try:
            opt = optimizer(trainable)
            opt.step()
        except Exception as err:
            raise ConfigError(f"the optimizer factory failed on layer {index} while measuring "
                              f"optimizer state: {type(err).__name__}: {err}",
                              hint="pass pk.memory(sample, optimizer_states=2.0) to assume "
                                   "a size instead") from err
        state_bytes = sum(t.numel() * t.element_size() for state in opt.state.values()
                          for t in state.values() if isinstance(t, torch.Tensor))
        for p in trainable:
            p.grad = None
    return float(param_bytes + grad_bytes + state_bytes + buffer_bytes)


def measure_layers(module: PipelineModule, sample: Any, device: Any = "cpu", *,
                   time_it: bool = True, repeats: int = 5, warmup: int = 1,
                   clock: Callable[[], float] | None = None,
                   optimizer: Callable | None = None,
                   optimizer_states: float | None = None
                   ) -> tuple[list[float] | None, list[float], list[float]]:
    """Run ``sample`` through the layers one at a time on ``device``.

    Only one layer's parameters exist at a time; the activations of one
    micro-batch are kept until the end so storage is never counted twice.
    ``clock`` (seconds, default :func:`time.perf_counter`) is read after the device
    is synchronised, before and after each repetition.

    :returns: ``(seconds, static_bytes, activation_bytes)`` per layer: the median
        forward + backward time (``None`` unless ``time_it``); parameter +
        gradient + optimizer-state + buffer bytes; bytes of the non-parameter
        tensors autograd saves for backward, each storage counted at the first
        layer that saves it, plus the bytes of the skip values a layer stashes (when
        autograd does not save them already) or pops.
    """
    seconds, _, static, act = measure_layer_times(
        module, sample, device, time_it=time_it, repeats=repeats, warmup=warmup,
        optimizer=optimizer, optimizer_states=optimizer_states, clock=clock)
    return seconds, static, act


def measure_layer_times(module: PipelineModule, sample: Any, device: Any = "cpu", *,
                        time_it: bool = True, repeats: int = 5, warmup: int = 1,
                        optimizer: Callable | None = None,
                        optimizer_states: float | None = None,
                        split: list | None = None,
                        clock: Callable[[], float] | None = None,
                        outputs: list | None = None, weight_states: list | None = None
                        ) -> tuple[list[float] | None, list[float] | None, list[float],
                                   list[float]]:
    """:func:`measure_layers`, with the forward timed on its own too.

    :param split: a list to append, per layer, the median seconds of the split backward
        (``(input pass, weight pass)``, :mod:`pipekernel.stage.split_backward`) to; ``None``:
        not timed.
    :param outputs: a list to append, per layer, the bytes of the tensors it returns to.
    :param weight_states: a list to append, per layer, the bytes its split backward's input
        pass records for the weight pass (:func:`_weight_state_bytes`).
    :returns: ``(seconds, forward_seconds, static_bytes, activation_bytes)``: the
        median forward + backward time and, of the same repetitions, the median
        forward time (both ``None`` unless ``time_it``), then as :func:`measure_layers`.
    """
    _check_measuring(sample, repeats, warmup)
    device = torch.device(device)
    now = clock or time.perf_counter
    x = tensors_to(sample, device)
    seconds: list[float] = []
    forwards: list[float] = []
    static: list[float] = []
    act: list[float] = []
    seen: set[int] = set()
    keep: list[torch.Tensor] = []  # keeps saved storages alive so addresses stay unique
    cuda = [device.index or 0] if device.type == "cuda" else []
    # layers that stash and pop run in one scope: a pop finds what an earlier layer
    # stashed (a detached leaf, as a receiving stage holds it), every repeat alike
    scope = SkipScope(module.skip_declarations, where="the partitioner's measurement",
                      replay=True, keep=_leaf) if module.skip_declarations else None
    skip_bytes: dict[str, int] = {}
    with torch.random.fork_rng(devices=cuda):  # layer seeding and dropout leave no trace
        for index, spec in enumerate(module.layers):
            layer, call = module.measured_layer(index, device, scope)
            params = _not_saved(layer, module.skip_declarations.get(index, ((), ())), scope)
            inp = _leaf(x)
            out, saved = _first_forward(call, inp, index, spec)
            nbytes = _new_saved_bytes(saved, params, seen, keep)
            if scope is not None:
                nbytes += _skip_bytes(module.skip_declarations.get(index, ((), ())), scope,
                                      skip_bytes, seen)
            act.append(float(nbytes))
            if outputs is not None:
                outputs.append(float(sum(t.numel() * t.element_size() for t in _tensors(out))))
            if weight_states is not None:  # the memory model's weight-pass state
                weight_states += [_weight_state_bytes(call, inp, layer)]
            if time_it:
                _time_into(seconds, forwards, split, call, inp, layer, device,
                           (warmup, repeats, now))
            static.append(_static_bytes(layer, index, optimizer, optimizer_states))
            x = _leaf(out)
            del out, layer
    return (seconds if time_it else None), (forwards if time_it else None), static, act


def _time_into(seconds: list, forwards: list, split: list | None, call: Callable, inp: Any,
               layer: Any, device: torch.device, timing: tuple) -> None:
    """Time one layer (forward + backward, forward alone, and the split backward when
    ``split`` is a list), appending the medians; its gradients are dropped after."""
    warmup, repeats, now = timing
    total, forward = _time_layer(call, inp, device, warmup, repeats, now)
    seconds.append(total)
    forwards.append(forward)
    if split is not None:
        split.append(_time_split(call, inp, layer, device, warmup, repeats, now))
    if isinstance(layer, nn.Module):
        layer.zero_grad(set_to_none=True)


def _weight_state_bytes(call: Callable, inp: Any, layer: Any) -> float:
    """Bytes of the gradients one layer's input pass records for its weight pass (each
    storage once); the layer's gradients are dropped after."""
    params = list(layer.parameters()) if isinstance(layer, nn.Module) else []
    inputs = _grad_outputs(inp)
    outputs = _grad_outputs(call(inp))
    if not outputs or not params:
        return 0.0
    _, state = backward_input(outputs, [torch.ones_like(o) for o in outputs], inputs, params)
    held = [g for s in state._splits for g in s.grads if g is not None]
    held += [g for _, g in state._roots]
    nbytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                  for t in held}.values())
    backward_weight(state)
    if isinstance(layer, nn.Module):
        layer.zero_grad(set_to_none=True)
    for t in inputs:
        t.grad = None
    return float(nbytes)


def _check_measuring(sample: Any, repeats: int, warmup: int) -> None:
    if sample is None:
        raise ConfigError("measuring layers needs a sample micro-batch",
                          hint="pass partition=pk.profile(sample_inputs) or "
                               "pk.memory(sample_inputs) with one micro-batch of inputs")
    if repeats < 1 or warmup < 0:
        raise ConfigError(f"profile needs repeats >= 1 and warmup >= 0, got {repeats}, {warmup}",
                          hint="use pk.profile(sample, repeats=5, warmup=1)")


def _first_forward(call: Callable, inp: Any, index: int, spec: Any
                   ) -> tuple[Any, list[torch.Tensor]]:
    """The layer's output on ``inp`` and the tensors autograd saved for its backward."""
    saved: list[torch.Tensor] = []
    try:
        def keep(t: torch.Tensor) -> torch.Tensor:
            saved.append(t)
            return t
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            return call(inp), saved
    except Exception as err:
        raise ConfigError(f"layer {index} ({_layer_name(spec)}) failed on the sample: "
                          f"{type(err).__name__}: {err}",
                          hint="the sample must be one micro-batch of the first "
                               "layer's inputs") from err


def _new_saved_bytes(saved: list[torch.Tensor], params: set[int], seen: set[int],
                     keep: list[torch.Tensor]) -> int:
    """Bytes of the storages in ``saved`` that are neither parameters nor counted before
    (``seen``, updated); ``keep`` holds them so that their addresses stay unique."""
    nbytes = 0
    for t in saved:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in params or key in seen:
            continue
        seen.add(key)
        keep.append(t)
        nbytes += storage.nbytes()
    return nbytes


def _time_layer(call: Callable, inp: Any, device: torch.device, warmup: int, repeats: int,
                now: Callable[[], float]) -> tuple[float, float]:
    """Median seconds of the layer's forward + backward and, of the same repetitions, of
    its forward alone (never more than the whole)."""
    samples, forward = [], []
    for _ in range(warmup + repeats):
        _sync(device)
        start = now()
        grads = _grad_outputs(call(inp))
        _sync(device)
        middle = now()
        if grads:
            torch.autograd.backward(grads, [torch.ones_like(g) for g in grads])
        _sync(device)
        samples.append(now() - start)
        forward.append(middle - start)
    total = statistics.median(samples[warmup:])
    return total, min(statistics.median(forward[warmup:]), total)


def _time_split(call: Callable, inp: Any, layer: Any, device: torch.device, warmup: int,
                repeats: int, now: Callable[[], float]) -> tuple[float, float]:
    """Median seconds of the input pass and of the weight pass of one layer's backward."""

    params = list(layer.parameters()) if isinstance(layer, nn.Module) else []
    inputs = _grad_outputs(inp)
    first, second = [], []
    for _ in range(warmup + repeats):
        outputs = _grad_outputs(call(inp))
        if not outputs:
            return 0.0, 0.0
        _sync(device)
        start = now()
        _, state = backward_input(outputs, [torch.ones_like(o) for o in outputs], inputs, params)
        _sync(device)
        middle = now()
        backward_weight(state)
        _sync(device)
        first.append(middle - start)
        second.append(now() - middle)
    if isinstance(layer, nn.Module):
        layer.zero_grad(set_to_none=True)
    for t in inputs:
        t.grad = None
    return statistics.median(first[warmup:]), statistics.median(second[warmup:])


def _not_saved(layer: Any, declaration: tuple, scope: SkipScope | None) -> set[int]:
    """Storages a layer's saved bytes leave out: its parameters, and what its pops will
    return (detached views of what was stashed: a popped value is counted once, as the
    pop, :func:`_skip_bytes`, even where autograd saves it too)."""
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()} \
        if isinstance(layer, nn.Module) else set()
    if scope is None:
        return params
    return params | {t.untyped_storage().data_ptr() for name in declaration[1]
                     for t in _tensors(scope.available.get(name))}


def _skip_bytes(declaration: tuple, scope: SkipScope, known: dict[str, int],
                seen: set[int]) -> int:
    """Bytes one layer holds for skip connections: what it stashes (unless autograd
    already saved that storage) and what it pops (the received copy, once: whether or
    not autograd saves it too)."""
    stash_names, pop_names = declaration
    total = 0
    for name in stash_names:
        tensors = [t for t in _tensors(scope.available.get(name)) if t.device.type != "meta"]
        known[name] = sum(t.untyped_storage().nbytes() for t in tensors)
        total += sum(t.untyped_storage().nbytes() for t in tensors
                     if t.untyped_storage().data_ptr() not in seen)
    return total + sum(known.get(name, 0) for name in pop_names)


_tensors = tensors_of


def _meta_static_bytes(module: PipelineModule,
                       optimizer_states: float = DEFAULT_OPTIMIZER_STATES) -> list[float]:
    """Parameter + gradient + optimizer-state + buffer bytes, built on the meta device."""
    out = []
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        for layer in module.layers:
            built = layer.build() if isinstance(layer, LayerSpec) else layer
            out.append(_static_bytes(built, 0, None, optimizer_states))
    return out


def _agree(context: PartitionContext, compute: Callable[[], tuple]) -> tuple:
    """Run ``compute`` on global rank 0 only and give its ``(bounds, *arrays)`` to every
    rank (:func:`pipekernel.plugin.compute_on_one`): the boundaries, then ``arrays``
    per-layer lists (as many as ``compute`` returns), each of which may be ``None`` (here: costs, static bytes, activation
    bytes, forward seconds, ...), as ints and floats on every rank.

    A failure on rank 0 is reported on every rank.
    """
    transport = context.transport
    if transport is None or transport.world_size == 1:
        return compute()
    bounds, *values = compute_on_one(transport, compute, 0, hint="look at rank 0's error: "
                                     "computing the partition failed there")
    return ([int(b) for b in bounds],
            *[None if v is None else [float(x) for x in v] for v in values])


# ---------------------------------------------------------------------------
# the hook
# ---------------------------------------------------------------------------

def _layer_name(layer: Any) -> str:
    target = layer.typename if isinstance(layer, LayerSpec) else type(layer)
    return getattr(target, "__name__", str(target))


def _explicit(bounds: Sequence[Any], n: int, num_stages: int) -> list[int]:
    out = list(bounds)
    if not all(isinstance(b, int) and not isinstance(b, bool) for b in out):
        raise ConfigError(f"partition boundaries {out} must be integers",
                          hint=f"write e.g. [0, {n // 2}, {n}]")
    if len(out) != num_stages + 1:
        raise ConfigError(f"partition boundaries {out} describe {len(out) - 1} stages, "
                          f"the pipeline has {num_stages}",
                          hint=f"give {num_stages + 1} boundaries from 0 to {n}")
    if out[0] != 0 or out[-1] != n:
        raise ConfigError(f"partition boundaries {out} do not cover all {n} layers",
                          hint=f"start at 0 and end at {n} (the number of layers)")
    for s, (a, b) in enumerate(zip(out, out[1:])):
        if b <= a:
            raise ConfigError(f"partition boundaries {out} are not increasing: stage {s} "
                              f"would hold layers [{a}, {b})",
                              hint="boundaries must strictly increase so no stage is empty")
    return out


def _user_costs(costs: Any, layers: Sequence[Any]) -> list[float]:
    if callable(costs):
        values = []
        for i, layer in enumerate(layers):
            try:
                values.append(costs(layer))
            except Exception as err:
                raise ConfigError(f"the cost function failed on layer {i} ({_layer_name(layer)}): "
                                  f"{type(err).__name__}: {err}",
                                  hint="a cost function takes one layer (as given to "
                                       "PipelineModule) and returns a number") from err
    else:
        values = list(costs)
    if len(values) != len(layers):
        raise ConfigError(f"{len(values)} costs for {len(layers)} layers",
                          hint="pk.balance(costs) needs one cost per layer")
    return _check_costs(values, "cost")


@hookimpl(trylast=True)
def pipekernel_partition(method: Any, layers: Sequence[Any], num_stages: int,
                         context: PartitionContext | None) -> list[int] | None:
    if context is None:  # called by hand, outside PipelineModule.partition
        context = PartitionContext(module=PipelineModule(layers), num_stages=num_stages)
    module, n = context.module, len(layers)
    if isinstance(method, (list, tuple)):
        return _explicit(method, n, num_stages)
    if method == "profile":
        raise ConfigError("partition='profile' needs a sample micro-batch to time",
                          hint="pass partition=pk.profile(sample_inputs)")
    if method == "memory":
        method = Memory()
    if isinstance(method, Profile):
        return _by_profile(method, context, num_stages)
    if isinstance(method, Memory):
        return _by_memory(method, context, num_stages)
    if isinstance(method, Balance) or (callable(method) and not isinstance(method, str)):
        costs_in, unit = (method.costs, method.unit) if isinstance(method, Balance) \
            else (method, "cost")
        weights = _user_costs(costs_in, layers)
        return _cheap(context, weights, unit, num_stages)
    if not isinstance(method, str):
        return None
    if method == "uniform":
        return _cheap(context, [1.0] * n, "layers", num_stages)
    if method == "parameters":
        counts = module.parameter_counts()
        return _cheap(context, [float(c) for c in counts], "parameters", num_stages)
    if method.startswith("type:"):
        return _by_type(method, layers, context, num_stages)
    return None


def _by_profile(method: Profile, context: PartitionContext, num_stages: int) -> list[int]:
    """Balance measured forward + backward seconds (rank 0 measures, all agree)."""
    module = context.module

    def compute() -> tuple:
        split: list | None = [] if method.split_backward else None
        outputs: list = []
        states: list | None = [] if method.split_backward else None
        seconds, forward, static, act = measure_layer_times(
            module, method.sample, context.device, repeats=method.repeats,
            warmup=method.warmup, optimizer=context.optimizer, split=split,
            clock=method.clock, outputs=outputs, weight_states=states)
        assert seconds is not None  # time_it (the default) measures them
        first, second = ([p[0] for p in split], [p[1] for p in split]) if split \
            else (None, None)
        return (balance(seconds, num_stages), seconds, static, act, forward, first, second,
                outputs, states)
    bounds, costs, static, act, forward, first, second, outputs, states = \
        _agree(context, compute)
    context.layer_output_bytes = outputs
    context.layer_weight_state_bytes = states
    context.layer_costs, context.cost_unit = costs, "seconds"
    context.layer_forward_seconds = forward
    context.layer_split_backward_seconds = (list(zip(first, second))
                                            if first is not None else None)
    context.layer_static_bytes, context.layer_activation_bytes = static, act
    context.notes.append(f"forward+backward seconds measured on rank 0 ({context.device}), "
                         f"median of {method.repeats}")
    return bounds


def _by_memory(method: Memory, context: PartitionContext, num_stages: int) -> list[int]:
    """Balance parameter, optimizer-state and activation bytes."""
    module = context.module
    in_flight = context.in_flight

    def compute() -> tuple:
        outputs: list | None = None
        states: list | None = None
        if method.sample is None:
            static, act = _meta_static_bytes(module, DEFAULT_OPTIMIZER_STATES if
                                             method.optimizer_states is None
                                             else method.optimizer_states), None
        else:  # what crosses each boundary and a split backward keeps: the memory model's
            outputs, states = [], []
            _, _, static, act = measure_layer_times(
                module, method.sample, context.device, time_it=False,
                optimizer=context.optimizer, optimizer_states=method.optimizer_states,
                outputs=outputs, weight_states=states)
        bounds = balance(static, num_stages, act, in_flight)
        return (bounds, stage_layer_costs(static, act, bounds, in_flight), static, act,
                outputs, states)
    bounds, costs, static, act, outputs, states = _agree(context, compute)
    context.layer_costs, context.cost_unit = costs, "bytes"
    context.layer_static_bytes, context.layer_activation_bytes = static, act
    context.layer_output_bytes, context.layer_weight_state_bytes = outputs, states
    context.notes.append("memory = params + grads + optimizer state + buffers"
                         + (f" + activations x in-flight micro-batches {in_flight}"
                            if act is not None else " (no sample: activations not counted)"))
    return bounds


def _by_type(method: str, layers: Sequence[Any], context: PartitionContext,
             num_stages: int) -> list[int]:
    """Balance the layers whose type matches the regex after ``type:``."""
    try:
        pattern = re.compile(method[5:], re.IGNORECASE)
    except re.error as err:
        raise ConfigError(f"invalid regex in partition={method!r}: {err}",
                          hint="write e.g. partition='type:Block|Linear'") from err
    weights = [1.0 if pattern.search(_layer_name(layer)) else 0.0 for layer in layers]
    if not any(weights):
        raise ConfigError(f"partition={method!r} matches no layer type",
                          hint="layer types are: " + ", ".join(
                              sorted({_layer_name(l) for l in layers})))
    return _cheap(context, weights, f"layers matching {method[5:]!r}", num_stages)


def stage_layer_costs(static: list[float], act: list[float] | None, bounds: Sequence[int],
                      in_flight: Sequence[int] | None) -> list[float]:
    """Per-layer bytes as placed: static + in-flight(stage of the layer) × activation
    (``in_flight`` ``None``: one micro-batch per stage, as :func:`balance`)."""
    out = []
    for s in range(len(bounds) - 1):
        k = in_flight[s] if in_flight is not None else 1
        for i in range(bounds[s], bounds[s + 1]):
            out.append(static[i] + (k * act[i] if act is not None else 0.0))
    return out


def _cheap(context: PartitionContext, weights: list[float], unit: str,
           num_stages: int) -> list[int]:
    """Balance costs every rank computes identically (no measuring, no broadcast)."""
    context.layer_costs, context.cost_unit = weights, unit
    context.layer_static_bytes = _meta_static_bytes(context.module)
    context.notes.append("memory estimate: params + grads + Adam-like state (2x) + buffers; "
                         "activations not measured (use pk.memory(sample) for them)")
    return balance(weights, num_stages)


@hookimpl(trylast=True)
def pipekernel_list_names(kind: str) -> list[str]:
    # explicit boundaries, pk.profile(sample), pk.memory(sample), pk.balance(costs) and
    # cost functions are accepted too but are objects, not names
    return ["uniform", "parameters", "type:<regex>", "memory"] if kind == "partition" else []
