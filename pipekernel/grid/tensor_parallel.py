"""Tensor parallelism: the group a layer sees while it is built, the four region
functions, and a Megatron-style column/row-parallel linear pair (no Megatron needed).

**The context.** The engine builds a stage's layers (``LayerSpec.build``) inside
:func:`context`, so a layer's ``__init__`` reaches its tensor-parallel group with::

    import pipekernel.grid.tensor_parallel as tp
    g = tp.group()          # this rank's TensorParallelGroup: g.rank, g.size
    tp.rank(), tp.size()    # shortcuts

Outside a context (a single process, the parity reference, a meta-device build
for partitioning or checkpoint metadata) the group is the trivial one of size 1,
so the same layer list builds the whole model. A layer keeps the group it saw in
``__init__`` for its forward. The current group is a ``contextvars.ContextVar`` set only inside
:func:`context` (like ``torch.device`` as a context manager), never process-wide state.

**Initialisation makes parity possible.** :class:`ColumnParallelLinear` and
:class:`RowParallelLinear` build the *full* ``nn.Linear`` (same random draws as a
single process, under the seeding rule of :class:`~pipekernel.PipelineModule`) and
keep their slice, so the shards of ``T`` ranks are slices of the weight one process
builds. (This costs the full layer's memory once per rank at build time; for layers
too big for that, build on the meta device and load a checkpoint.) Every sharded
parameter carries ``param.tensor_parallel_dim`` (the dimension it is split along);
parameters without it are replicated over the group (and their gradients equal on
every tensor-parallel rank, as in Megatron without sequence parallelism).

**Why these layers stay beside the DTensor path** (issue 28, item 4;
``tensor_parallel_plan=`` is the path for models pipekernel does not build, Hugging Face's
included): on ``benchmarks/tp_compare.py`` (pp=2 x tp=2, d=256, gloo, the idle 2-core
machine) they train to the same numbers as a DTensor Colwise/Rowwise plan with the same
bytes per rank, and their step is 1.14-1.25x faster (``benchmarks/RESULTS.md``).

**Collectives** go through the engine's transport: ``all_reduce``, and
``all_gather`` (:func:`pipekernel.comm.collectives.all_gather`).
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipekernel.comm.collectives import all_gather
from pipekernel.errors import ConfigError

__all__ = ["TensorParallelGroup", "group", "rank", "size", "context", "make_group",
           "copy_to_region", "reduce_from_region", "gather_from_region", "scatter_to_region",
           "ColumnParallelLinear", "RowParallelLinear", "shard", "gather", "sharded_dim",
           "full_shape", "gather_layer_state", "shard_layer_state"]


class TensorParallelGroup:
    """The tensor-parallel ranks of one (stage, replica) and how to reach them.

    :param rank: this process's index in the group (``0 .. size-1``).
    :param size: ``T``.
    :param transport: the engine's transport (``None`` for the trivial group).
    :param handle: the transport's group object (``None``: the transport's world).
    :param ranks: the members' transport ranks.
    """

    def __init__(self, rank: int = 0, size: int = 1, transport: Any = None,
                 handle: Any = None, ranks: list[int] | None = None) -> None:
        self.rank, self.size, self.transport, self.handle = rank, size, transport, handle
        self.ranks = ranks if ranks is not None else [0]

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the group, in place; returns it."""
        if self.size > 1:
            self.transport.all_reduce(tensor, "sum", self.handle)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """The members' equally shaped ``tensor`` stacked along a new first dimension
        (shape ``(size, *tensor.shape)``), in rank order."""
        if self.size == 1:
            return tensor.unsqueeze(0)
        return all_gather(self.transport, tensor, self.handle, self.rank, self.size)

    def __repr__(self) -> str:
        return f"TensorParallelGroup(rank={self.rank}, size={self.size}, ranks={self.ranks})"


_TRIVIAL = TensorParallelGroup()
_CURRENT: contextvars.ContextVar[TensorParallelGroup] = contextvars.ContextVar(
    "pipekernel_tensor_parallel_group", default=_TRIVIAL)


def group() -> TensorParallelGroup:
    """The tensor-parallel group of the layers being built (size 1 outside a context)."""
    return _CURRENT.get()


def rank() -> int:
    """``group().rank``."""
    return _CURRENT.get().rank


def size() -> int:
    """``group().size``."""
    return _CURRENT.get().size


@contextlib.contextmanager
def context(tp_group: TensorParallelGroup) -> Iterator[TensorParallelGroup]:
    """Make ``tp_group`` the one :func:`group` returns inside the ``with`` block."""
    token = _CURRENT.set(tp_group)
    try:
        yield tp_group
    finally:
        _CURRENT.reset(token)


def make_group(topology: Any, transport: Any) -> TensorParallelGroup:
    """Create every tensor-parallel group of ``topology`` (collective: every rank calls
    it, in the same order as the engine's other groups) and return this rank's."""
    if topology.model_size == 1:
        return _TRIVIAL
    mine = None
    for ranks in topology.model_groups():
        handle = transport.new_group(ranks)
        if topology.rank in ranks:
            mine = TensorParallelGroup(ranks.index(topology.rank), len(ranks), transport,
                                       handle, ranks)
    return mine  # type: ignore[return-value]


# -- the four region functions (Megatron's mappings) -------------------------------------

class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g):  # noqa: ANN001
        ctx.g = g
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001
        return ctx.g.all_reduce(grad.clone()), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g):  # noqa: ANN001
        return g.all_reduce(x.clone())

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001
        return grad, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g):  # noqa: ANN001
        ctx.g = g
        return _gather_last(x, g)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001
        return _split_last(grad, ctx.g), None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g):  # noqa: ANN001
        ctx.g = g
        return _split_last(x, g)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001
        return _gather_last(grad, ctx.g), None


def _split_last(x: torch.Tensor, g: TensorParallelGroup) -> torch.Tensor:
    return x.chunk(g.size, dim=-1)[g.rank].contiguous() if g.size > 1 else x


def _gather_last(x: torch.Tensor, g: TensorParallelGroup) -> torch.Tensor:
    if g.size == 1:
        return x
    parts = g.all_gather(x)
    return torch.cat(list(parts.unbind(0)), dim=-1)


def copy_to_region(x: torch.Tensor, g: TensorParallelGroup | None = None) -> torch.Tensor:
    """Identity forward; gradients summed over the group in backward (the input of a
    column-parallel layer)."""
    g = g or group()
    return _CopyToRegion.apply(x, g) if g.size > 1 else x


def reduce_from_region(x: torch.Tensor, g: TensorParallelGroup | None = None) -> torch.Tensor:
    """Sum over the group forward; identity backward (the output of a row-parallel layer)."""
    g = g or group()
    return _ReduceFromRegion.apply(x, g) if g.size > 1 else x


def gather_from_region(x: torch.Tensor, g: TensorParallelGroup | None = None) -> torch.Tensor:
    """Concatenate the members' last dimension forward; keep this rank's slice backward."""
    g = g or group()
    return _GatherFromRegion.apply(x, g) if g.size > 1 else x


def scatter_to_region(x: torch.Tensor, g: TensorParallelGroup | None = None) -> torch.Tensor:
    """Keep this rank's slice of the last dimension forward; gather it backward."""
    g = g or group()
    return _ScatterToRegion.apply(x, g) if g.size > 1 else x


# -- shards of full tensors ------------------------------------------------------------

def shard(full: torch.Tensor, dim: int, g: TensorParallelGroup | None = None) -> torch.Tensor:
    """This rank's slice of ``full`` along ``dim`` (a copy)."""
    g = g or group()
    return full.chunk(g.size, dim=dim)[g.rank].clone() if g.size > 1 else full.clone()


def gather(part: torch.Tensor, dim: int, g: TensorParallelGroup | None = None) -> torch.Tensor:
    """The full tensor from every member's ``part`` along ``dim`` (collective)."""
    g = g or group()
    if g.size == 1:
        return part
    return torch.cat(list(g.all_gather(part).unbind(0)), dim=dim)


def _check_divisible(what: str, n: int, layer: str, g: TensorParallelGroup) -> None:
    if n % g.size:
        raise ConfigError(
            f"{layer}: {what} {n} is not divisible by the tensor-parallel size {g.size} "
            f"(tensor-parallel rank {g.rank} of ranks {g.ranks})",
            hint=f"choose {what} a multiple of {g.size}, or tensor_parallel_size dividing {n}")


def _full_linear(in_features: int, out_features: int, bias: bool, device: Any,
                 dtype: Any) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)


class ColumnParallelLinear(nn.Module):
    """``y = x A^T + b`` with ``A`` split along its output dimension over the group.

    The input is replicated over the group (its gradient is summed in backward); the
    output is this rank's ``out_features / T`` columns, or all of them with
    ``gather_output=True``. Initialised as ``nn.Linear(in_features, out_features)``
    would be, then sliced (see the module docstring).

    :raises ConfigError: ``out_features`` not divisible by ``T``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 gather_output: bool = False, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        self.tp = group()
        _check_divisible("out_features", out_features, "ColumnParallelLinear", self.tp)
        self.in_features, self.out_features = in_features, out_features
        self.gather_output = gather_output
        full = _full_linear(in_features, out_features, bias, device, dtype)
        self.weight = nn.Parameter(shard(full.weight.detach(), 0, self.tp))
        self.weight.tensor_parallel_dim = 0
        if bias:
            self.bias = nn.Parameter(shard(full.bias.detach(), 0, self.tp))
            self.bias.tensor_parallel_dim = 0
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_region(x, self.tp), self.weight, self.bias)
        return gather_from_region(y, self.tp) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(/{self.tp.size}), gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """``y = x A^T + b`` with ``A`` split along its input dimension over the group.

    The input is this rank's ``in_features / T`` slice (``input_is_parallel=True``,
    e.g. a :class:`ColumnParallelLinear`'s output) or the whole input, sliced here;
    the partial products are summed over the group and the (replicated) bias added,
    so the output is replicated. Initialised as ``nn.Linear`` would be, then sliced.

    :raises ConfigError: ``in_features`` not divisible by ``T``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 input_is_parallel: bool = True, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        self.tp = group()
        _check_divisible("in_features", in_features, "RowParallelLinear", self.tp)
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = input_is_parallel
        full = _full_linear(in_features, out_features, bias, device, dtype)
        self.weight = nn.Parameter(shard(full.weight.detach(), 1, self.tp))
        self.weight.tensor_parallel_dim = 1
        if bias:
            self.bias = nn.Parameter(full.bias.detach().clone())
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_region(x, self.tp)
        y = reduce_from_region(F.linear(x, self.weight), self.tp)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (/{self.tp.size}), "
                f"out_features={self.out_features}, input_is_parallel={self.input_is_parallel}")


def sharded_dim(param: torch.Tensor) -> int | None:
    """The dimension ``param`` is split along over the group, or ``None`` (replicated)."""
    return getattr(param, "tensor_parallel_dim", None)


def full_shape(param: torch.Tensor, g: TensorParallelGroup) -> tuple[int, ...]:
    """The shape of the whole tensor ``param`` is a shard of."""
    dim = sharded_dim(param)
    shape = list(param.shape)
    if dim is not None:
        shape[dim] *= g.size
    return tuple(shape)




# -- checkpoints: whole tensors in the files, shards in memory ----------------------------

def _shard_shaped(value: Any, shape: tuple[int, ...]) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) == shape


def gather_layer_state(layer: nn.Module, state: dict[str, Any], optim: dict[str, dict],
                       g: TensorParallelGroup) -> tuple[dict[str, Any], dict[str, dict]]:
    """``layer``'s ``state`` (``state_dict`` entries) and per-parameter optimizer state
    with every shard gathered whole (collective over ``g``: every member calls it for
    the same layers in the same order)."""
    if g.size == 1:
        return state, optim
    state, optim = dict(state), {k: dict(v) for k, v in optim.items()}
    for sub, param in layer.named_parameters():
        dim = sharded_dim(param)
        if dim is None:
            continue
        if sub in state:
            state[sub] = gather(state[sub].contiguous(), dim, g)
        for key, value in optim.get(sub, {}).items():
            if _shard_shaped(value, tuple(param.shape)):
                optim[sub][key] = gather(value.contiguous(), dim, g)
    return state, optim


def shard_layer_state(layer: nn.Module, state: dict[str, Any], optim: dict[str, dict],
                      g: TensorParallelGroup) -> tuple[dict[str, Any], dict[str, dict]]:
    """The inverse of :func:`gather_layer_state`: whole tensors (as saved, at any
    tensor-parallel size) cut to this rank's shards."""
    if g.size == 1:
        return state, optim
    state, optim = dict(state), {k: dict(v) for k, v in optim.items()}
    for sub, param in layer.named_parameters():
        dim = sharded_dim(param)
        if dim is None:
            continue
        whole = full_shape(param, g)
        if sub in state and _shard_shaped(state[sub], whole):
            state[sub] = shard(state[sub], dim, g)
        for key, value in optim.get(sub, {}).items():
            if _shard_shaped(value, whole):
                optim[sub][key] = shard(value, dim, g)
    return state, optim


def full_shapes(layer: nn.Module, g: TensorParallelGroup) -> dict[str, list[int]]:
    """``layer.state_dict()``'s shapes with every shard counted whole."""
    shapes = {k: list(v.shape) for k, v in layer.state_dict().items()}
    for sub, param in layer.named_parameters():
        if sub in shapes:
            shapes[sub] = list(full_shape(param, g))
    return shapes
