"""An optimizer step over DTensor parameters (FSDP2, DTensor plans) run on their local
shards, the optimizer state still kept as DTensors.

torch's optimizers step a DTensor parameter through DTensor's dispatch: every op of the
update (AdamW: about ten per parameter) goes through sharding propagation in Python,
which on a stage of small layers costs more than the arithmetic (``benchmarks/RESULTS.md``,
"One FSDP2 parameter group per stage": ~10 ms of the FSDP2 step on 8 x Linear(256, 256)
at D = 2, per a cProfile of rank 0). For an
optimizer whose update is elementwise in the parameter, its gradient and its state, the
DTensor path runs exactly the same aten ops on the local tensors, so
:func:`step_local_shards` runs the step on them directly: for the step only, each
DTensor parameter in ``param_groups`` is replaced by its local tensor (its ``.grad`` the
local tensor of the DTensor gradient) and its state by the states' local tensors; after
it, everything is put back. State the optimizer updated in place is the same storage its
DTensor wraps; state it created or rebound (the first step) is wrapped into a DTensor
with the parameter's mesh, placements, shape and stride — what the DTensor path would
have created — so ``state_dict()`` and ``torch.distributed.checkpoint`` see the same keys,
DTensors and placements either way, and the numbers are bit-identical.

Only the optimizers of :data:`ELEMENTWISE` (exact types: a subclass may do anything) take
this path, and only when every DTensor parameter's gradient is a DTensor of the same
placements and local shape; anything else steps as before. An optimizer with a norm or
a factorisation over a whole parameter (LAMB, Adafactor, Shampoo, Muon) must see the
DTensor, and does. (During the step, the optimizer's own step hooks, if a user registered
any, see the local tensors in ``param_groups``.)
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["ELEMENTWISE", "local_pairs", "step_local_shards"]

#: torch optimizers whose update is elementwise (a shard's update needs only the shard).
ELEMENTWISE: tuple[type, ...] = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW,
                                 torch.optim.Adagrad, torch.optim.RMSprop,
                                 torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam)


def _dtensor_type() -> Any:
    """``DTensor``, or ``None`` while nothing imported it (then no parameter is one: a
    step without DTensors does not pay for importing them)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def local_pairs(optimizer: Any) -> list[tuple[Any, torch.Tensor]] | None:
    """``(DTensor parameter, its local tensor)`` for every DTensor parameter of
    ``optimizer`` when its step may run on the local shards, else ``None`` (no DTensor
    parameter, an optimizer not in :data:`ELEMENTWISE`, or a gradient of other
    placements)."""
    dtensor = _dtensor_type()
    if dtensor is None or type(optimizer) not in ELEMENTWISE:
        return None
    pairs = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not isinstance(p, dtensor):
                continue
            local, grad = p._local_tensor, p.grad
            if grad is not None and not (isinstance(grad, dtensor)
                                         and grad.placements == p.placements
                                         and grad._local_tensor.shape == local.shape):
                return None
            pairs.append((p, local))
    return pairs or None


def step_local_shards(optimizer: Any, step: Callable[[], Any]) -> bool:
    """Run ``step()`` (which steps ``optimizer``) on the local shards of its DTensor
    parameters when :func:`local_pairs` allows it; otherwise just ``step()``.

    :returns: whether the step ran on the local shards.
    """
    pairs = local_pairs(optimizer)
    if pairs is None:
        step()
        return False
    dtensor = _dtensor_type()
    state, saved = optimizer.state, []
    for p, local in pairs:
        local.grad = None if p.grad is None else p.grad._local_tensor
        before = state.pop(p, None)
        saved.append(before)
        if before is not None:
            state[local] = {k: v._local_tensor if isinstance(v, dtensor) else v
                            for k, v in before.items()}
    groups = [group["params"] for group in optimizer.param_groups]
    local_of = {id(p): local for p, local in pairs}
    for group in optimizer.param_groups:
        group["params"] = [local_of.get(id(p), p) for p in group["params"]]
    try:
        step()
    finally:
        for group, params in zip(optimizer.param_groups, groups):
            group["params"] = params
        for (p, local), before in zip(pairs, saved):
            local.grad = None
            after = state.pop(local, None)
            if after is not None:
                state[p] = _as_dtensors(after, before or {}, p, local, dtensor)
            elif before is not None:
                state[p] = before
    return True


def _as_dtensors(after: dict, before: dict, p: Any, local: torch.Tensor,
                 dtensor: Any) -> dict:
    """The state of ``p`` after a local step: a state tensor updated in place keeps its
    DTensor; a new or rebound one of the local shard's shape is wrapped into one with
    ``p``'s layout (as ``zeros_like(p)`` would be); the rest (step counters) as it is."""
    out = {}
    for key, value in after.items():
        old = before.get(key)
        if isinstance(old, dtensor) and old._local_tensor is value:
            out[key] = old
        elif (isinstance(value, torch.Tensor) and not isinstance(value, dtensor)
              and value.dim() > 0 and value.shape == local.shape):
            out[key] = dtensor.from_local(value, p.device_mesh, p.placements,
                                          run_check=False, shape=p.shape, stride=p.stride())
        else:
            out[key] = value
    return out
