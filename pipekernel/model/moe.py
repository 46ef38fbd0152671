"""A small mixture-of-experts layer of pipekernel's own (:class:`MoE`): a top-k router,
experts as stacked weights, the Switch Transformer load-balancing loss through
:func:`pipekernel.add_aux_loss`, and expert parallelism over the group of
:mod:`pipekernel.grid.expert_parallel`.

It is what the examples and the parity tests train; models of other libraries bring their
own MoE blocks. The forward, per micro-batch of ``N`` tokens::

    probs = softmax(router(x))                 # (N, experts), float32
    weights, chosen = topk(probs, k)           # renormalised over the k chosen
    add_aux_loss(coef * experts * Σ_e f_e P_e) # f_e: share of the N*k assignments, P_e: mean prob
    tokens sorted by expert -> [all-to-all to the experts' owners] -> each expert's MLP
           -> [all-to-all back] -> unsorted, weighted sum over the k choices

Expert ``e``'s MLP is ``gelu(x @ w_in[e] + b_in[e]) @ w_out[e] + b_out[e]``. With an
expert-parallel group of size ``E`` the layer holds experts
``rank*n/E .. (rank+1)*n/E - 1`` of ``n``: the slices of the stacked tensors one process
builds under the same seed (so the ranks together hold exactly the single-process layer).
Host synchronisations: one per forward (the per-expert token counts become split sizes).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pipekernel.errors import ConfigError
from pipekernel.grid import expert_parallel
from pipekernel.model.aux_loss import add_aux_loss

__all__ = ["MoE", "load_balancing_loss"]


def load_balancing_loss(probs: torch.Tensor, counts: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch Transformer's loss: ``experts * Σ_e f_e P_e`` with ``f_e`` the share of the
    ``N*top_k`` assignments expert ``e`` got (no gradient) and ``P_e`` its mean router
    probability. 1 when perfectly balanced."""
    experts = probs.shape[-1]
    share = counts.detach().to(probs.dtype) / max(probs.shape[0] * top_k, 1)
    return experts * (share * probs.mean(0)).sum()


class MoE(nn.Module):
    """Top-``top_k`` routed experts over the last dimension: ``(..., dim) -> (..., dim)``.

    :param dim: the model width.
    :param hidden: each expert's hidden width.
    :param num_experts: experts in the layer (over every expert-parallel rank).
    :param top_k: experts per token.
    :param aux_loss_coef: weight of the load-balancing loss (``0``: none added).
    :raises ConfigError: ``num_experts`` not divisible by the expert-parallel size, or
        ``top_k`` not in ``1 .. num_experts``.
    """

    # this rank's experts, stacked (registered in __init__)
    w_in: nn.Parameter
    b_in: nn.Parameter
    w_out: nn.Parameter
    b_out: nn.Parameter

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int = 2,
                 aux_loss_coef: float = 0.01) -> None:
        super().__init__()
        self.ep = expert_parallel.group()
        if num_experts % self.ep.size:
            raise ConfigError(
                f"MoE: {num_experts} experts are not divisible by the expert-parallel size "
                f"{self.ep.size} (expert-parallel rank {self.ep.rank} of ranks {self.ep.ranks})",
                hint=f"choose num_experts a multiple of {self.ep.size}, or "
                     f"expert_parallel_size dividing {num_experts}")
        if not 1 <= top_k <= num_experts:
            raise ConfigError(f"MoE: top_k={top_k} with {num_experts} experts",
                              hint="top_k must be between 1 and num_experts")
        self.dim, self.hidden, self.num_experts, self.top_k = dim, hidden, num_experts, top_k
        self.aux_loss_coef = aux_loss_coef
        self.local_experts = num_experts // self.ep.size
        self.router = nn.Linear(dim, num_experts, bias=False)
        # the whole stack is drawn (the single-process weights), then this rank's slice kept
        bound_in, bound_out = 1 / math.sqrt(dim), 1 / math.sqrt(hidden)
        stacks = {"w_in": ((num_experts, dim, hidden), bound_in),
                  "b_in": ((num_experts, hidden), bound_in),
                  "w_out": ((num_experts, hidden, dim), bound_out),
                  "b_out": ((num_experts, dim), bound_out)}
        mine = slice(self.ep.rank * self.local_experts, (self.ep.rank + 1) * self.local_experts)
        for name, (shape, bound) in stacks.items():
            full = torch.empty(shape).uniform_(-bound, bound)
            self.register_parameter(name, nn.Parameter(full[mine].clone()))
            expert_parallel.mark(getattr(self, name), 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs = self.router(tokens).float().softmax(-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        flat = chosen.reshape(-1)
        counts = torch.bincount(flat, minlength=self.num_experts)
        if self.aux_loss_coef:
            add_aux_loss(self.aux_loss_coef * load_balancing_loss(probs, counts, self.top_k))
        order = flat.argsort(stable=True)  # assignments grouped by expert
        routed = tokens.index_select(0, order // self.top_k)
        if self.ep.size == 1:
            out = self._experts(routed, counts.tolist())
        else:
            out = self._exchange(routed, counts)
        unsorted = out.index_select(0, order.argsort())
        combined = (unsorted.view(-1, self.top_k, shape[-1]) * weights.unsqueeze(-1)).sum(1)
        return combined.reshape(shape)

    def _experts(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """This rank's experts on ``x``, whose rows come grouped by local expert."""
        outs = []
        for e, part in enumerate(x.split(sizes)):
            h = F.gelu(part @ self.w_in[e] + self.b_in[e])
            outs.append(h @ self.w_out[e] + self.b_out[e])
        return torch.cat(outs) if outs else x.new_zeros((0, self.dim))

    def _exchange(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Send the rows to the experts' owners, run the local experts, send them back."""
        ep, local = self.ep, self.local_experts
        incoming = ep.exchange_counts(counts)  # (members, local experts)
        host = torch.cat([counts, incoming.reshape(-1)]).tolist()  # the one host sync
        mine, theirs = host[:self.num_experts], host[self.num_experts:]
        send = [sum(mine[r * local:(r + 1) * local]) for r in range(ep.size)]
        matrix = [theirs[r * local:(r + 1) * local] for r in range(ep.size)]
        recv = [sum(row) for row in matrix]
        arrived = ep.all_to_all(routed, recv, send)  # grouped by (member, local expert)
        # regroup by local expert: rows of member r for expert e start at starts[r][e]
        starts: list[list[int]] = []
        at = 0
        for row in matrix:
            starts.append([])
            for n in row:
                starts[-1].append(at)
                at += n
        perm = [i for e in range(local) for r in range(ep.size)
                for i in range(starts[r][e], starts[r][e] + matrix[r][e])]
        index = torch.tensor(perm, dtype=torch.int64).to(routed.device, non_blocking=True)
        sizes = [sum(matrix[r][e] for r in range(ep.size)) for e in range(local)]
        out = self._experts(arrived.index_select(0, index), sizes)
        back = torch.zeros_like(out).index_copy(0, index, out)  # (member, expert) order again
        return ep.all_to_all(back, send, recv)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, hidden={self.hidden}, experts={self.num_experts} "
                f"({self.local_experts} here), top_k={self.top_k}, "
                f"aux_loss_coef={self.aux_loss_coef}")
