"""FSDP2 timed by the pipeline schedule (layer 2): what a stage's ``fully_shard`` modules
do per micro-batch and per batch.

FSDP2 alone reduce-scatters a module's gradients in the post-backward hook of every
backward, and that hook runs when the gradient reaches the module's *inputs* — which a
split backward (``zb-h1``, ``zb-h2``, ``zbv``, ``dualpipev``: input pass B, weight pass W
later) reaches before the weight gradients exist. Under a pipeline the engine therefore
drives it, as ``torch.distributed.pipelining``'s stage does
(``backward_maybe_with_nosync`` / ``perform_reduce_grad``):

The timing is the program's: a sharded stage's program holds FSDP2's instructions
(:mod:`pipekernel.schedules.sharded`), whose handlers are these methods:

* ``Unshard()``, a batch's first instruction (:meth:`StageParallel.begin_batch`): the
  roots gathered, and on every FSDP2 module of the stage ``set_is_last_backward(False)``,
  ``set_reshard_after_backward(False)``, ``set_requires_gradient_sync(False)``: each
  micro-batch's backward (B and W alike) accumulates into the *unsharded* gradients,
  nothing is communicated, and the parameters stay gathered (with
  ``reshard_after_forward=False``, the default under a pipeline, they are all-gathered once
  per batch, by the first forward);
* ``ReduceShardedGrads()``, right after the stage's last instruction of a training batch
  that produces weight gradients (:meth:`StageParallel.reduce_grads`): the flags back on,
  FSDP2's post-backward run by hand on every parameter group (one reduce-scatter each;
  HSDP adds its all-reduce over ``dp_replicate``) and its final callback (waits,
  resharding);
* ``Reshard()``, an evaluation's last instruction: reshard (a forward under ``no_grad``
  with ``reshard_after_forward=False`` leaves the parameters gathered);
* prefetching by the program (what ``reshard_after_forward=True`` needs, under multi-chunk
  schedules above all): inside each chunk every layer prefetches the next one in forward
  and the previous one in backward (:meth:`StageParallel.plan_chunks`: FSDP2's explicit
  lists, in place of its own backward order, which a pipeline interleaves across
  micro-batches and chunks), and after each compute instruction the program's
  ``Unshard(chunk, forward)`` for its next one (:meth:`StageParallel.prefetch`) starts
  that chunk's first all-gather (a forward's first layer, a backward's last), while this
  rank waits on its transfers. Only a batch's very first all-gather is then started by the
  compute that needs it (``tests/test_fsdp.py`` counts them under interleaved, zbv and
  dualpipev).

The split backward runs autograd over the parameters the graph holds, the *unsharded*
ones: :meth:`StageParallel.autograd_params` maps a stage's (sharded) parameters to them.

This reads FSDP2's private state (``_get_fsdp_state``, ``_fsdp_param_groups``,
``post_backward``, ``_root_post_backward_final_callback``), as torch's own pipelining does;
:func:`find` refuses by name a torch whose FSDP2 lacks them.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from pipekernel.errors import ConfigError

__all__ = ["StageParallel", "find", "fsdp_roots"]


def fsdp_roots(module: torch.nn.Module) -> list[Any]:
    """The FSDP2 modules of ``module`` (itself included) not inside another one."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return []
    roots: list[Any] = []
    inner: set[int] = set()
    for sub in module.modules():
        if id(sub) in inner or not isinstance(sub, FSDPModule):
            continue
        roots.append(sub)
        inner.update(id(m) for m in sub.modules())
    return roots


def find(module: torch.nn.Module) -> StageParallel | None:
    """The driver of ``module``'s FSDP2 modules, or ``None`` when it has none."""
    roots = fsdp_roots(module)
    return StageParallel(roots) if roots else None


class StageParallel:
    """Drives a stage's FSDP2 modules by the schedule (see the module docstring).

    :param roots: the outermost ``fully_shard`` modules of the stage (usually one: the
        stage itself). Each becomes FSDP2's root now (its lazy initialisation, which
        would otherwise wait for a forward of the root that a pipeline never runs:
        the runtime calls the stage's layers, not the stage).
    """

    def __init__(self, roots: list[Any]) -> None:
        self.roots = roots
        self.states = []
        try:
            for root in roots:
                state = root._get_fsdp_state()
                state._lazy_init()
                self.states.append(state)
            self.groups = [group for state in self.states
                           for inner in state._state_ctx.all_states
                           for group in inner._fsdp_param_groups]
            self._unsharded = {id(fp.sharded_param): fp for group in self.groups
                               for fp in group.fsdp_params}
        except AttributeError as err:
            raise ConfigError(f"this torch's FSDP2 ({torch.__version__}) lacks what the "
                              f"pipeline drives it by: {err}",
                              hint="use the torch pipekernel pins (.ci/constraints.txt)") from err
        self.chunk_layers: list[list[Any]] = []  # per chunk (plan_chunks)

    def managed(self, param: torch.Tensor) -> bool:
        """Whether FSDP2 manages ``param`` (then it is not the engine's to reduce)."""
        return id(param) in self._unsharded

    @property
    def parameters(self) -> list[torch.Tensor]:
        """The sharded parameters FSDP2 manages (DTensors)."""
        return [fp.sharded_param for group in self.groups for fp in group.fsdp_params]

    def unshard(self, instruction: Any) -> None:
        """``Unshard()``: :meth:`begin_batch`; ``Unshard(chunk, forward)``: :meth:`prefetch`."""
        if instruction.chunk is None:
            self.begin_batch()
        else:
            self.prefetch(instruction.chunk, instruction.forward)

    def begin_batch(self) -> None:
        """Before a batch's first instruction: the roots' own parameters gathered (their
        forward pre-hook, which would gather them, never runs: the runtime calls the
        layers; a no-op for a root whose parameters all live in layer groups), and no
        gradient sync until :meth:`reduce_grads` (an evaluation runs no backward)."""
        for root in self.roots:
            root.unshard()
        for root in self.roots:
            root.set_is_last_backward(False)
            root.set_reshard_after_backward(False)
            root.set_requires_gradient_sync(False)

    def autograd_params(self, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """``params`` with each FSDP2 parameter replaced by the unsharded one autograd
        sees (the module holds it between unshard and reshard; a split backward
        accumulates into it, and :meth:`reduce_grads` reduce-scatters it)."""
        out = []
        for p in params:
            fp = self._unsharded.get(id(p))
            unsharded = getattr(fp, "_unsharded_param", None) if fp is not None else None
            out.append(unsharded if unsharded is not None else p)
        return out

    def reduce_grads(self) -> None:
        """After the stage's last weight-gradient instruction of a training batch:
        reduce-scatter every parameter group once, wait, reshard."""
        for root in self.roots:
            root.set_is_last_backward(True)
            root.set_reshard_after_backward(True)
            root.set_requires_gradient_sync(True)
        for state in self.states:
            for inner in state._state_ctx.all_states:
                for group in inner._fsdp_param_groups:
                    group.post_backward()
            state._root_post_backward_final_callback()

    def plan_chunks(self, parts: list[Any]) -> None:
        """Prefetch by the program (``parts``: the stage's chunks, each with ``layers``
        in forward order; see :meth:`prefetch`). Inside a chunk each layer's forward
        prefetches the next layer's all-gather and its backward the previous one's
        (FSDP2's explicit lists): FSDP2's own backward prefetch follows the order
        forwards ran in, which under a pipeline interleaves micro-batches and chunks, so
        a chunk's first layer would prefetch whatever ran before it (another chunk's
        layer). Its list names itself instead: a no-op, as it is gathered by then. A layer
        whose lists a plugin set already keeps them."""
        self.chunk_layers = []
        try:
            for part in parts:
                self.chunk_layers.append(_plan_chunk(part, self.roots))
        except AttributeError as err:
            raise ConfigError(f"this torch's FSDP2 ({torch.__version__}) lacks what the "
                              f"pipeline prefetches by: {err}",
                              hint="use the torch pipekernel pins (.ci/constraints.txt)") from err

    def prefetch(self, chunk: int, forward: bool) -> None:
        """Issue the all-gather that the stage's next compute instruction, a forward
        (``forward``) or a backward of ``chunk``, starts with, now
        (``unshard(async_op=True)``; FSDP2's pre-forward or pre-backward waits on it): a
        forward's first layer, a backward's last. The program runs it after each compute
        instruction for the next one, so that with
        ``reshard_after_forward=True`` the next chunk's parameters arrive while this rank
        waits on its transfers. A no-op for parameters already gathered. Every shard of
        a stage runs the same program: the all-gathers start in the same order."""
        layers = self.chunk_layers[chunk] if chunk < len(self.chunk_layers) else []
        if layers:
            (layers[0] if forward else layers[-1]).unshard(async_op=True)

    def close(self) -> None:
        """Let go of the process groups FSDP2's mesh infos hold (at the engine's close,
        after :meth:`pipekernel.grid.mesh.Grid.close` destroyed them): gloo joins a
        group's threads only when its last reference goes, and the engine may outlive
        its close. The modules cannot communicate afterwards."""
        for group in self.groups:
            holders = [group, *group.fsdp_params]
            for holder in holders:
                for name in ("mesh_info", "post_forward_mesh_info"):
                    _drop_groups(getattr(holder, name, None))

    def reshard(self) -> None:
        """After an evaluation, which leaves the parameters gathered: reshard them."""
        for root in self.roots:
            root.reshard()



def _drop_groups(info: Any) -> None:
    """Set every process group an FSDP2 mesh info holds (``shard_process_group``,
    ``replicate_process_group``, ...) to ``None``."""
    import torch.distributed as dist

    for name, value in list(getattr(info, "__dict__", {}).items()):
        if isinstance(value, dist.ProcessGroup):
            setattr(info, name, None)


def _plan_chunk(part: Any, roots: list[Any]) -> list[Any]:
    """The FSDP2 layers of one chunk in forward order, their explicit prefetch lists set
    (see :meth:`StageParallel.plan_chunks`)."""
    from torch.distributed.fsdp import FSDPModule

    layers = [m for m in getattr(part, "layers", []) if isinstance(m, FSDPModule)
              and not any(m is root for root in roots)]
    for i, layer in enumerate(layers):
        state = layer._get_fsdp_state()
        if state._states_to_forward_prefetch or state._states_to_backward_prefetch:
            continue  # lists of the plugin's own: left as they are
        if i + 1 < len(layers):
            layer.set_modules_to_forward_prefetch([layers[i + 1]])
        layer.set_modules_to_backward_prefetch([layers[i - 1] if i else layer])
    return layers
