"""FSDP2 timed by the pipeline schedule (layer 2): what a stage's ``fully_shard`` modules
do per micro-batch and per batch.

FSDP2 alone reduce-scatters a module's gradients in the post-backward hook of every
backward, and that hook runs when the gradient reaches the module's *inputs* — which a
split backward (``zb-h1``, ``zb-h2``, ``zbv``, ``dualpipev``: input pass B, weight pass W
later) reaches before the weight gradients exist. Under a pipeline the engine therefore
drives it, as ``torch.distributed.pipelining``'s stage does
(``backward_maybe_with_nosync`` / ``perform_reduce_grad``):

* :meth:`StageParallel.begin_batch` (a training batch): on every FSDP2 module of the
  stage ``set_is_last_backward(False)``, ``set_reshard_after_backward(False)``,
  ``set_requires_gradient_sync(False)``: each micro-batch's backward (B and W alike)
  accumulates into the *unsharded* gradients, nothing is communicated, and the parameters
  stay gathered (with ``reshard_after_forward=False``, the default under a pipeline, they
  are all-gathered once per batch, by the first forward);
* :meth:`StageParallel.after_last_backward` — right after the stage's last instruction of
  the batch that produces weight gradients (the runtime's ``after_last_backward``): the
  flags back on, FSDP2's post-backward run by hand on every parameter group (one
  reduce-scatter each; HSDP adds its all-reduce over ``dp_replicate``) and its final
  callback (waits, resharding);
* :meth:`StageParallel.end_batch` of an evaluation: reshard (a forward under ``no_grad``
  with ``reshard_after_forward=False`` leaves the parameters gathered).

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
        self._training = False

    def managed(self, param: torch.Tensor) -> bool:
        """Whether FSDP2 manages ``param`` (then it is not the engine's to reduce)."""
        return id(param) in self._unsharded

    @property
    def parameters(self) -> list[torch.Tensor]:
        """The sharded parameters FSDP2 manages (DTensors)."""
        return [fp.sharded_param for group in self.groups for fp in group.fsdp_params]

    def begin_batch(self, trains: bool) -> None:
        """Before a batch's first instruction: no gradient sync until the last backward."""
        self._training = trains
        if not trains:
            return
        for root in self.roots:
            root.set_is_last_backward(False)
            root.set_reshard_after_backward(False)
            root.set_requires_gradient_sync(False)

    def autograd_params(self, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """``params`` with each FSDP2 parameter replaced by the unsharded one autograd
        sees (the module holds it between unshard and reshard; a split backward
        accumulates into it, and :meth:`after_last_backward` reduce-scatters it)."""
        out = []
        for p in params:
            fp = self._unsharded.get(id(p))
            unsharded = getattr(fp, "_unsharded_param", None) if fp is not None else None
            out.append(unsharded if unsharded is not None else p)
        return out

    def after_last_backward(self) -> None:
        """After the stage's last weight-gradient instruction of the batch: reduce-scatter
        every parameter group once, wait, reshard."""
        if not self._training:
            return
        for root in self.roots:
            root.set_is_last_backward(True)
            root.set_reshard_after_backward(True)
            root.set_requires_gradient_sync(True)
        for state in self.states:
            for inner in state._state_ctx.all_states:
                for group in inner._fsdp_param_groups:
                    group.post_backward()
            state._root_post_backward_final_callback()
        self._training = False

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

    def end_batch(self, trains: bool) -> None:
        """After a batch: an evaluation leaves the parameters gathered; reshard them."""
        if not trains:
            for root in self.roots:
                root.reshard()



def _drop_groups(info: Any) -> None:
    """Set every process group an FSDP2 mesh info holds (``shard_process_group``,
    ``replicate_process_group``, ...) to ``None``."""
    import torch.distributed as dist

    for name, value in list(getattr(info, "__dict__", {}).items()):
        if isinstance(value, dist.ProcessGroup):
            setattr(info, name, None)
