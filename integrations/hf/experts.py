"""Expert parallelism for Hugging Face MoE blocks: each rank of the stage's expert-parallel
group keeps ``1/E`` of every decoder layer's experts, and tokens travel to them and back
with all-to-all.

**Which module.** The *experts module* of a decoder layer is the one transformers 5 puts
beside the router in every MoE block (Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3, ...):
per-expert weights stacked along dimension 0 (``gate_up_proj [E, 2I, D]``,
``down_proj [E, D, I]``), ``num_experts``, and ``forward(hidden_states, top_k_index,
top_k_weights)``. Where the config carries transformers' own expert-parallel plan
(``base_model_ep_plan``, e.g. ``"layers.*.mlp.experts": "ep_dispatch_experts"``) its
entries name the module; otherwise it is found by that structure. A model with
``expert_parallel_size > 1`` and no such module in its decoder layers is refused by name.

**Why pipekernel's machinery and not transformers' ``apply_expert_parallelism``.** That
path turns the expert weights into DTensors sharded on a ``DeviceMesh`` built over the
whole world (EP x TP), which a pipeline stage's data-parallel subgroup is not, and it
posts its counts on one process group; the engine reduces, counts (norms, ``nonfinite``),
broadcasts and checkpoints expert slices through the ``expert_parallel_dim`` mark of
:mod:`pipekernel.grid.expert_parallel`, and keeps the all-to-alls of the two chunks of a
V schedule on separate lanes. So the experts are sliced and marked here, and the dispatch
follows transformers' ``AllToAllEP`` (sort the (token, expert) pairs by expert, all-to-all
them to the owners, run the experts' *own* forward on local ids with unit weights,
all-to-all back, weight and sum on the sender) over
:class:`~pipekernel.grid.expert_parallel.ExpertParallelGroup`.

**Parity.** The slices are those of the single-process stacks (cut after the weights are
built or loaded), the router stays whole on every rank (so ``output_router_logits`` and
the aux loss are unchanged), and an expert's output is multiplied by its routing weight
on the sender instead of inside the expert: the same products, summed in another order.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from pipekernel.errors import ConfigError
from pipekernel.grid import expert_parallel

__all__ = ["find_experts", "shard_experts", "check_model"]

#: the experts module's forward arguments (transformers 5's MoE experts contract)
_ARGS = ("hidden_states", "top_k_index", "top_k_weights")


def _plan_suffixes(config: Any) -> list[str]:
    """The sub-paths inside a decoder layer that the config's ``base_model_ep_plan`` marks
    ``ep_dispatch_experts`` (``"layers.*.mlp.experts"`` -> ``"mlp.experts"``)."""
    plan = getattr(config, "base_model_ep_plan", None) or {}
    return [key.split(".*.", 1)[1] for key, style in plan.items()
            if style == "ep_dispatch_experts" and ".*." in key]


def _is_experts(module: nn.Module) -> bool:
    n = getattr(module, "num_experts", None)
    params = list(module.named_parameters(recurse=False))
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or not params:
        return False
    if any(p.dim() == 0 or p.shape[0] != n for _, p in params):
        return False
    try:
        names = tuple(inspect.signature(type(module).forward).parameters)[1:4]
    except (TypeError, ValueError):
        return False
    return names == _ARGS


def find_experts(layer: nn.Module, config: Any = None) -> list[tuple[str, nn.Module]]:
    """``(sub-path, module)`` of each experts module inside decoder ``layer``: those the
    config's ``base_model_ep_plan`` names, else those found by structure (see the module
    docstring)."""
    found = []
    for suffix in _plan_suffixes(config):
        try:
            module = layer.get_submodule(suffix)
        except AttributeError:
            continue  # a dense layer of a model that mixes them (mlp_only_layers)
        if _is_experts(module):
            found.append((suffix, module))
    if found:
        return found
    return [(name, m) for name, m in layer.named_modules() if name and _is_experts(m)]


def check_model(model: nn.Module, layers: str, num_layers: int, size: int) -> None:
    """``ConfigError`` unless some decoder layer of ``model`` holds an experts module whose
    ``num_experts`` ``size`` divides (every rank checks the whole model, so every stage
    refuses alike)."""
    if size == 1:
        return
    name, config = type(model).__name__, getattr(model, "config", None)
    found = [(j, sub, m) for j in range(num_layers)
             for sub, m in find_experts(model.get_submodule(f"{layers}.{j}"), config)]
    if not found:
        raise ConfigError(
            f"expert_parallel_size={size}: {name}'s decoder layers ({layers}.*) hold no MoE "
            f"experts module pipekernel.hf recognises (a module with num_experts, parameters "
            f"stacked [num_experts, ...] and forward{_ARGS}, or one named "
            "'ep_dispatch_experts' in config.base_model_ep_plan)",
            hint="use expert_parallel_size=1 for this model")
    for j, sub, m in found:
        if m.num_experts % size:
            raise ConfigError(
                f"expert_parallel_size={size} does not divide {name}'s {m.num_experts} "
                f"experts in {layers}.{j}.{sub}",
                hint=f"choose expert_parallel_size dividing {m.num_experts}")


def shard_experts(layer: nn.Module, path: str, config: Any = None) -> None:
    """Keep this rank's ``1/E`` of every experts module in ``layer`` (built at ``path``,
    inside the engine's expert-parallel context) and dispatch its tokens by all-to-all;
    nothing happens outside one (``E == 1``)."""
    ep = expert_parallel.group()
    if ep.size == 1:
        return
    for sub, module in find_experts(layer, config):
        total = module.num_experts
        if total % ep.size:
            raise ConfigError(f"expert_parallel_size={ep.size} does not divide the {total} "
                              f"experts in {path}.{sub}",
                              hint=f"choose expert_parallel_size dividing {total}")
        local = total // ep.size
        mine = slice(ep.rank * local, (ep.rank + 1) * local)
        for name, p in list(module.named_parameters(recurse=False)):
            part = nn.Parameter(p.detach()[mine].clone(), requires_grad=p.requires_grad)
            setattr(module, name, expert_parallel.mark(part, 0))
        module.num_experts = local
        module.forward = _Dispatch(type(module).forward.__get__(module), local, ep)


class _Dispatch:
    """The experts' forward over the expert-parallel group (transformers' ``AllToAllEP``
    on :class:`~pipekernel.grid.expert_parallel.ExpertParallelGroup`)."""

    def __init__(self, own: Any, local: int, ep: Any) -> None:
        self.own, self.local, self.ep = own, local, ep

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        ep, local = self.ep, self.local
        tokens, top_k = hidden_states.shape[0], top_k_index.shape[-1]
        ids = top_k_index.reshape(-1)
        order = ids.argsort(stable=True)  # pairs grouped by expert, so by owner
        send = hidden_states.index_select(0, order // top_k)
        counts = torch.bincount(ids, minlength=local * ep.size)
        incoming = ep.exchange_counts(counts)  # (members, local experts)
        host = torch.cat([counts, incoming.reshape(-1)]).tolist()  # the one host sync
        mine, theirs = host[:local * ep.size], host[local * ep.size:]
        send_sizes = [sum(mine[r * local:(r + 1) * local]) for r in range(ep.size)]
        recv_sizes = [sum(theirs[r * local:(r + 1) * local]) for r in range(ep.size)]
        arrived = ep.all_to_all(send, recv_sizes, send_sizes)
        expert_ids = torch.arange(local, device=ids.device).repeat(ep.size)
        expert_ids = expert_ids.repeat_interleave(incoming.reshape(-1).to(ids.device))
        out = self._experts(arrived, expert_ids.unsqueeze(-1))
        back = ep.all_to_all(out, send_sizes, recv_sizes)
        pairs = torch.zeros_like(back).index_copy(0, order, back)
        weighted = pairs.view(tokens, top_k, -1) * top_k_weights.unsqueeze(-1).to(pairs.dtype)
        return weighted.sum(1).to(hidden_states.dtype)

    def _experts(self, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if rows.shape[0] == 0:  # keep the empty exchange in the backward (as AllToAllEP)
            one = rows.sum(0, keepdim=True)
            return self.own(one, ids.new_zeros((1, 1)), one.new_ones((1, 1)))[:0]
        return self.own(rows, ids, rows.new_ones(ids.shape))

