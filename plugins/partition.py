"""Built-in partition methods: ``uniform``, ``parameters``, ``type:<regex>``, explicit boundaries.

Weighted methods minimise the largest stage weight over contiguous splits
(binary search on the answer with a greedy check), so the result is optimal,
not a heuristic.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from pipekernel.errors import ConfigError
from pipekernel.hookspecs import hookimpl
from pipekernel.module import LayerSpec, PipelineModule


def _fits(weights: Sequence[float], num_stages: int, limit: float) -> list[int] | None:
    """Greedy split with every stage non-empty and at most ``limit``; None if impossible."""
    bounds, total, n = [0], 0.0, len(weights)
    for i, w in enumerate(weights):
        must_cut = n - i == num_stages - len(bounds)  # one layer left per unopened stage
        if i > bounds[-1] and (total + w > limit or must_cut):
            if len(bounds) == num_stages:
                return None
            bounds.append(i)
            total = 0.0
        total += w
        if w > limit:
            return None
    bounds.append(n)
    return bounds if len(bounds) == num_stages + 1 else None


def balance(weights: Sequence[float], num_stages: int) -> list[int]:
    """Boundaries minimising the maximum stage weight, every stage non-empty."""
    if num_stages > len(weights):
        raise ConfigError(f"cannot split {len(weights)} layers into {num_stages} stages",
                          hint="use fewer stages or more layers")
    # candidate answers are contiguous sums; search them exactly
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    candidates = sorted({prefix[j] - prefix[i] for i in range(len(weights))
                         for j in range(i + 1, len(weights) + 1)})
    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _fits(weights, num_stages, candidates[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    return _fits(weights, num_stages, candidates[lo])  # type: ignore[return-value]


def _layer_name(layer: Any) -> str:
    target = layer.typename if isinstance(layer, LayerSpec) else type(layer)
    return getattr(target, "__name__", str(target))


@hookimpl(trylast=True)
def pipekernel_partition(method: Any, layers: Sequence[Any], num_stages: int) -> list[int] | None:
    if isinstance(method, (list, tuple)):
        return list(method)
    if not isinstance(method, str):
        return None
    if method == "uniform":
        return balance([1.0] * len(layers), num_stages)
    if method == "parameters":
        counts = PipelineModule(layers).parameter_counts()
        return balance([float(c) for c in counts], num_stages)
    if method.startswith("type:"):
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
        return balance(weights, num_stages)
    return None


@hookimpl(trylast=True)
def pipekernel_list_names(kind: str) -> list[str]:
    # explicit boundaries ([0, ..., len(layers)]) are accepted too but have no name
    return ["uniform", "parameters", "type:<regex>"] if kind == "partition" else []
