"""Expert parallelism: the expert-parallel group a layer sees while it is built, the
all-to-all that moves tokens to their experts and back, and how expert gradients are
reduced, counted and synchronised.

**The groups.** ``PipelineEngine(expert_parallel_size=E)`` splits each stage's ``D``
data-parallel replicas into ``D / E`` *expert-parallel* groups of ``E`` consecutive
replicas (data ranks ``k*E .. k*E+E-1``); each member holds ``1/E`` of every MoE layer's
experts and exchanges tokens with the others. The replicas that hold the *same* experts
(data ranks ``j, j+E, j+2E, ...``) form the *expert-data-parallel* group, over which expert
gradients are reduced; dense parameters are reduced over the whole data-parallel group as
before. The rank lists come from the topology alone (:func:`expert_groups`); on a
``DeviceMesh`` they are the mesh's data-parallel dim reshaped to ``(D / E, E)``, so the
groups can move onto a mesh dim ``"ep"`` without changing any layer.

**The context.** The engine builds a stage's layers inside :func:`context`, so a layer's
``__init__`` reaches its group with :func:`group` (the trivial group of size 1 outside
one: a single process builds every expert). A layer marks each parameter holding a slice
of the stacked experts with ``param.expert_parallel_dim = d`` (the dimension experts are
stacked along, see :func:`mark`); the engine reduces, counts and synchronises those over
the expert-data-parallel group.

**Gradient scale.** An expert's gradient on one rank already sums the contributions of
every token the ``E`` members routed to it (the all-to-all's backward brings them back);
summing over the expert-data-parallel group adds the other ``D / E - 1`` groups' tokens.
Dividing by ``D`` — not by the group's size — gives the mean over replicas that the dense
parameters get, hence parity with one process (:mod:`pipekernel.step.expert_reduce`).

**All-to-all** is torch's autograd ``all_to_all_single`` over the group's process group
(uneven splits; gloo and NCCL support it). The split sizes are host numbers: one host
synchronisation per MoE layer and forward (:meth:`ExpertParallelGroup.exchange_counts`).

**Profiling.** Inside :func:`timing` every all-to-all adds its wall seconds to an
:class:`AllToAllClock` (forward and backward apart): how the planner measures an
expert-parallel layer's all-to-all cost (:mod:`pipekernel.engine.all_to_all_cost`).

**Lanes.** Each expert-parallel group has two process groups, *lanes*, when the stage
holds two chunks (the V of ``dualpipev`` and ``zbv``): a chunk's forward runs in
:func:`lane` ``(chunk)`` (the stage runtime sets it), so its all-to-alls — and their backward, which
autograd posts on the group the forward used — travel on the lane of the chunk. A
``ForwardBackward`` pairs two different chunks, so its halves' all-to-alls never share a
group and may run at the same time (:func:`pipekernel.stage.paired.overlap_all_to_all`):
each lane sees the same operations in the same order on every member.

**Checkpoints** hold whole expert stacks, as they hold whole tensor-parallel tensors: on
save the first expert-parallel group gathers every slice (:func:`gather_layer_state`) and
data-parallel rank 0 writes it; on load each rank cuts its slice
(:func:`shard_layer_state`), so a checkpoint loads at any expert-parallel size and as one
plain model. A DCP checkpoint (``save_checkpoint(format="dcp")``) gathers nothing: each
rank's slice is a DTensor ``Shard(dim)`` over its group for DCP to write and reshard
(:mod:`pipekernel.engine.checkpoint_dcp`).
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from pipekernel.errors import ConfigError, positive_int

__all__ = ["ExpertParallelGroup", "AllToAllClock", "timing", "group", "context", "lane", "LANE", "make_group", "expert_groups", "mark",
           "is_expert", "check_config", "broadcast_experts", "gather_slices",
           "gather_layer_state", "shard_layer_state", "full_shapes", "whole_state_dict"]


class ExpertParallelGroup:
    """This rank's expert-parallel group and expert-data-parallel group.

    :param rank: index in the expert-parallel group (which slice of experts it holds).
    :param size: ``E``.
    :param data_size: the stage's data-parallel size ``D`` (the gradient divisor).
    :param handle: the process group of the expert-parallel ranks (``None``: trivial).
    :param ranks: the expert-parallel members' transport ranks.
    :param data_handle: the process group of the expert-data-parallel ranks (``None``
        when it has one member).
    :param data_ranks: the expert-data-parallel members' transport ranks.
    """

    def __init__(self, rank: int = 0, size: int = 1, data_size: int = 1, handle: Any = None,
                 ranks: Sequence[int] = (0,), data_handle: Any = None,
                 data_ranks: Sequence[int] = (0,), lanes: Sequence[Any] = ()) -> None:
        self.rank, self.size, self.data_size = rank, size, data_size
        self.handle, self.ranks = handle, list(ranks)
        self.data_handle, self.data_ranks = data_handle, list(data_ranks)
        #: the process groups of the expert-parallel ranks, one per lane (:func:`lane`);
        #: lane 0 is ``handle``
        self.lanes: tuple[Any, ...] = (handle, *lanes)

    def lane_handle(self) -> Any:
        """The process group of the current :func:`lane` (lane ``n`` modulo the lanes)."""
        lanes = self.lanes
        return lanes[LANE.get() % len(lanes)] if len(lanes) > 1 else lanes[0]

    @property
    def expert_data_rank(self) -> int:
        """Index in the expert-data-parallel group (0: counts the experts in norms)."""
        return self.data_ranks.index(self.ranks[self.rank]) if self.size > 1 else 0

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """``counts`` (one per global expert, this rank's tokens) sent to the experts'
        owners: returns, per member ``r`` and local expert ``e``, how many tokens ``r``
        sends to ``e`` (shape ``(size, local experts)``). Not differentiable."""
        from torch.distributed import _functional_collectives as funcol

        local = counts.numel() // self.size
        clock = _TIMING.get()
        start = clock.start(counts) if clock is not None else 0.0
        got = funcol.all_to_all_single(counts.contiguous(), [local] * self.size,
                                       [local] * self.size, self.lane_handle())
        got = funcol.wait_tensor(got).view(self.size, local)
        if clock is not None:
            clock.stop(got, start, "forward")
        return got

    def all_to_all(self, tensor: torch.Tensor, output_splits: list[int],
                   input_splits: list[int]) -> torch.Tensor:
        """Rows ``input_splits[r]`` of ``tensor`` to member ``r``; returns the rows each
        member sent here, in member order (differentiable: the backward sends the
        gradients back the same way)."""
        from torch.distributed import _functional_collectives as funcol

        clock = _TIMING.get()
        if clock is not None:  # profiling: the backward's all-to-all lies between the marks
            tensor = _Mark.apply(tensor, clock, False)
            start = clock.start(tensor)
        out = funcol.all_to_all_single_autograd(tensor.contiguous(), output_splits,
                                                input_splits, self.lane_handle())
        out = funcol.wait_tensor(out)
        if clock is not None:
            clock.stop(out, start, "forward")
            out = _Mark.apply(out, clock, True)
        return out

    def __repr__(self) -> str:
        return (f"ExpertParallelGroup(rank={self.rank}, size={self.size}, ranks={self.ranks}, "
                f"expert_data_ranks={self.data_ranks})")


_TRIVIAL = ExpertParallelGroup()
_CURRENT: contextvars.ContextVar[ExpertParallelGroup] = contextvars.ContextVar(
    "pipekernel_expert_parallel_group", default=_TRIVIAL)
#: The lane expert all-to-alls travel on (:func:`lane`); the stage runtime sets it directly
#: around each compute instruction of a stage with several chunks (a context manager is
#: about nine Python calls, on the hot path).
LANE: contextvars.ContextVar[int] = contextvars.ContextVar("pipekernel_expert_lane", default=0)


class AllToAllClock:
    """Wall seconds spent inside expert all-to-alls while :func:`timing` is open: the
    dispatch and combine (and the token counts' exchange) in ``forward_s``, their
    backward (autograd's all-to-all of the gradients) in ``backward_s``.

    It is the wall time a rank spends in the call, waiting for its peers included: on a
    host transport (gloo) what the all-to-all costs the stage. On a GPU the device is
    synchronised around each call, which serialises what NCCL would overlap (CUDA events
    would time it better); it is a profiling tool, never on the training path.

    :param now: seconds now (default :func:`time.perf_counter`; tests inject one).
    """

    def __init__(self, now: Any = None) -> None:
        import time

        self.now = now or time.perf_counter
        self.forward_s = 0.0
        self.backward_s = 0.0
        self._backward_start: list[float] = []

    def start(self, tensor: torch.Tensor) -> float:
        _sync(tensor)
        return self.now()

    def stop(self, tensor: torch.Tensor, start: float, kind: str) -> None:
        _sync(tensor)
        setattr(self, f"{kind}_s", getattr(self, f"{kind}_s") + self.now() - start)


def _sync(tensor: torch.Tensor) -> None:
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


class _Mark(torch.autograd.Function):
    """Identity; its backward starts (after the all-to-all: ``after``) or stops (before
    it) the clock of the backward's all-to-all, which autograd runs between the two."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, clock: AllToAllClock, after: bool) -> torch.Tensor:
        ctx.clock, ctx.after = clock, after
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        clock = ctx.clock
        if ctx.after:
            clock._backward_start.append(clock.start(grad))
        elif clock._backward_start:
            clock.stop(grad, clock._backward_start.pop(), "backward")
        return grad, None, None


_TIMING: contextvars.ContextVar[AllToAllClock | None] = contextvars.ContextVar(
    "pipekernel_expert_all_to_all_timing", default=None)


@contextlib.contextmanager
def timing(clock: AllToAllClock | None = None) -> Iterator[AllToAllClock]:
    """Inside the block, every expert all-to-all adds its wall seconds to the returned
    :class:`AllToAllClock` (the planner's profile of expert-parallel layers)."""
    clock = clock or AllToAllClock()
    token = _TIMING.set(clock)
    try:
        yield clock
    finally:
        _TIMING.reset(token)


@contextlib.contextmanager
def lane(number: int) -> Iterator[int]:
    """Inside the block, expert all-to-alls travel on lane ``number`` (modulo the group's
    lanes; the stage runtime passes the chunk being computed)."""
    token = LANE.set(number)
    try:
        yield number
    finally:
        LANE.reset(token)


def group() -> ExpertParallelGroup:
    """The expert-parallel group of the layers being built (size 1 outside a context)."""
    return _CURRENT.get()


@contextlib.contextmanager
def context(ep_group: ExpertParallelGroup) -> Iterator[ExpertParallelGroup]:
    """Make ``ep_group`` the one :func:`group` returns inside the ``with`` block."""
    token = _CURRENT.set(ep_group)
    try:
        yield ep_group
    finally:
        _CURRENT.reset(token)


def check_config(size: Any, data_size: int, *, tensor_parallel_size: int = 1,
                 zero_stage: int = 0, rank: int | None = None) -> int:
    """``size`` if ``expert_parallel_size`` fits the data-parallel size, else
    ``ConfigError`` naming what to change (on ``rank``)."""
    positive_int("expert_parallel_size", size,
                 hint="e.g. expert_parallel_size=2 (it must divide the data-parallel size)")
    if size == 1:
        return size
    if data_size % size:
        raise ConfigError(f"expert_parallel_size={size} does not divide the data-parallel "
                          f"size {data_size}: experts are spread over expert-parallel groups "
                          f"of {size} replicas of each stage",
                          hint=f"choose expert_parallel_size among the divisors of "
                               f"{data_size}, or data_parallel_size a multiple of {size}",
                          rank=rank)
    if tensor_parallel_size > 1:
        raise ConfigError(f"expert_parallel_size={size} with tensor_parallel_size="
                          f"{tensor_parallel_size}: experts are not split over "
                          "tensor-parallel ranks yet", hint="use one of the two", rank=rank)
    if zero_stage:
        raise ConfigError(f"expert_parallel_size={size} with zero_stage={zero_stage}: ZeRO-1 "
                          "shards the optimizer state of parameters replicated over the "
                          "data-parallel group, and experts are not",
                          hint="use zero_stage=0 with expert parallelism", rank=rank)
    return size


def expert_groups(topology: Any, size: int) -> tuple[list[list[int]], list[list[int]]]:
    """The expert-parallel and expert-data-parallel rank lists of every (stage, model
    position), in the order every rank creates them."""
    parallel, data = [], []
    for ranks in topology.data_groups():  # ordered by data rank
        parallel += [ranks[k:k + size] for k in range(0, len(ranks), size)]
        data += [ranks[j::size] for j in range(size)]
    return parallel, data


def make_group(topology: Any, transport: Any, size: int, lanes: int = 1) -> ExpertParallelGroup:
    """Create every expert-parallel and expert-data-parallel group of ``topology``
    (collective: every rank calls it, in the same order) and return this rank's, with
    ``lanes`` process groups over its expert-parallel ranks (see the module docstring)."""
    if size == 1:
        return _TRIVIAL
    parallel, data = expert_groups(topology, size)
    mine: dict[str, Any] = {}
    extra = [(f"lane{n}", parallel) for n in range(1, lanes)]
    for kind, lists in (("ep", parallel), ("edp", data), *extra):
        for ranks in lists:
            member = topology.rank in ranks
            handle = _process_group(transport, ranks, member) if len(ranks) > 1 else None
            if member:
                mine[kind] = (handle, ranks)
    (handle, ranks), (data_handle, data_ranks) = mine["ep"], mine["edp"]
    return ExpertParallelGroup(ranks.index(topology.rank), size, topology.data_size, handle,
                               ranks, data_handle, data_ranks,
                               lanes=[mine[f"lane{n}"][0] for n in range(1, lanes)])


def _process_group(transport: Any, ranks: list[int], member: bool) -> Any:
    """A torch process group over ``ranks`` (what the autograd all-to-all needs);
    every rank calls it, only a ``member`` gets a group it can use."""
    import torch.distributed as dist

    handle = transport.new_group(ranks)
    if not member:
        return None
    if handle is None:  # the transport's whole world
        handle = getattr(transport, "group", None) or dist.group.WORLD
    if not isinstance(handle, dist.ProcessGroup):
        raise ConfigError(f"expert parallelism needs a torch.distributed transport (gloo, "
                          f"nccl); {type(transport).__name__} gives groups of type "
                          f"{type(handle).__name__}", hint="use transport='gloo' or 'nccl'")
    return handle


def mark(param: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Mark ``param`` as holding this rank's experts, stacked along ``dim``."""
    setattr(param, "expert_parallel_dim", dim)  # a tag torch.Tensor does not declare
    return param


def is_expert(param: torch.Tensor) -> bool:
    """Whether ``param`` holds a slice of experts (see :func:`mark`)."""
    return getattr(param, "expert_parallel_dim", None) is not None


def broadcast_experts(transport: Any, params: Iterable[torch.Tensor],
                      ep: ExpertParallelGroup) -> None:
    """Make the expert slices equal over their expert-data-parallel group (from its first
    member), as the engine does for dense parameters over the data-parallel group."""
    if len(ep.data_ranks) < 2:
        return
    with torch.no_grad():
        for p in params:
            transport.broadcast(p.data, ep.data_ranks[0], ep.data_handle)


# -- checkpoints: whole expert stacks in the files, slices in memory ------------------------

def _gather(part: torch.Tensor, dim: int, ep: ExpertParallelGroup) -> torch.Tensor:
    from torch.distributed import _functional_collectives as funcol

    whole = funcol.all_gather_tensor(part.contiguous(), dim, ep.handle)
    return funcol.wait_tensor(whole)


def gather_slices(part: torch.Tensor, dim: int, ep: ExpertParallelGroup) -> torch.Tensor:
    """The whole stack of which ``part`` is this rank's slice along ``dim`` (collective over
    the expert-parallel group; ``part`` itself when it has one member)."""
    return part if ep.size == 1 else _gather(part, dim, ep)


def _expert_params(layer: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor, int]]:
    for sub, param in layer.named_parameters():
        dim = getattr(param, "expert_parallel_dim", None)
        if dim is not None:
            yield sub, param, dim


def gather_layer_state(layer: torch.nn.Module, state: dict[str, Any], optim: dict[str, dict],
                       ep: ExpertParallelGroup) -> tuple[dict[str, Any], dict[str, dict]]:
    """``layer``'s ``state`` and per-parameter optimizer state with every expert slice
    gathered whole (collective over the expert-parallel group: every member calls it for
    the same layers in the same order)."""
    if ep.size == 1:
        return state, optim
    state, optim = dict(state), {k: dict(v) for k, v in optim.items()}
    for sub, param, dim in _expert_params(layer):
        if sub in state:
            state[sub] = _gather(state[sub], dim, ep)
        for key, value in optim.get(sub, {}).items():
            if isinstance(value, torch.Tensor) and value.shape == param.shape \
                    and value.dim() > 0:
                optim[sub][key] = _gather(value, dim, ep)
    return state, optim


def shard_layer_state(layer: torch.nn.Module, state: dict[str, Any], optim: dict[str, dict],
                      ep: ExpertParallelGroup) -> tuple[dict[str, Any], dict[str, dict]]:
    """The inverse of :func:`gather_layer_state`: whole stacks (as saved, at any
    expert-parallel size) cut to this rank's experts."""
    if ep.size == 1:
        return state, optim
    state, optim = dict(state), {k: dict(v) for k, v in optim.items()}
    for sub, param, dim in _expert_params(layer):
        n = param.shape[dim]
        whole = _whole_shape(param, dim, ep)

        def cut(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and tuple(value.shape) == whole:
                return value.narrow(dim, ep.rank * n, n).clone()
            return value

        if sub in state:
            state[sub] = cut(state[sub])
        for key, value in optim.get(sub, {}).items():
            optim[sub][key] = cut(value)
    return state, optim


def _whole_shape(param: torch.Tensor, dim: int, ep: ExpertParallelGroup) -> tuple[int, ...]:
    shape = list(param.shape)
    shape[dim] *= ep.size
    return tuple(shape)


def full_shapes(layer: torch.nn.Module, ep: ExpertParallelGroup,
                shapes: dict[str, list[int]]) -> dict[str, list[int]]:
    """``shapes`` (a layer's state shapes) with every expert slice counted whole."""
    if ep.size == 1:
        return shapes
    shapes = dict(shapes)
    for sub, param, dim in _expert_params(layer):
        if sub in shapes:
            shapes[sub] = list(_whole_shape(param, dim, ep))
    return shapes


def whole_state_dict(module: torch.nn.Module, ep: ExpertParallelGroup) -> dict[str, Any]:
    """``module.state_dict()`` with every expert slice gathered whole (collective over the
    expert-parallel group)."""
    state = module.state_dict()
    if ep.size == 1:
        return state
    for name, param in module.named_parameters():
        dim = getattr(param, "expert_parallel_dim", None)
        if dim is not None and name in state:
            state[name] = _gather(state[name], dim, ep)
    return state
