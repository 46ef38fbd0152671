"""``pipekernel.deepspeed.pipe``: DeepSpeed's ``PipelineModule``, ``LayerSpec`` and
``TiedLayerSpec`` with DeepSpeed's construction rules, over pipekernel's layer list.

Like DeepSpeed's, :class:`PipelineModule` is an ``nn.Module`` that builds **this rank's
stage** when it is constructed, so a script may call ``model.parameters()`` before
``initialize``. It builds exactly as ``deepspeed/runtime/pipe/module.py`` (0.19) does,
so the same script makes the same weights:

* the partition is DeepSpeed's (``uniform``, ``parameters``, ``type:<regex>``, with its
  balancing algorithm); ``parameters`` builds every layer once to count, as DeepSpeed does
  (which advances the RNG the same way);
* with ``seed_layers=True`` layer ``i`` is built right after ``seed_fn(base_seed + i)``
  (default: DeepSpeed's ``set_random_seed``: Python ``random``, NumPy and torch), and every
  forward reseeds layer ``i`` with ``base_seed * (n + 1) + i`` where ``n`` counts this
  stage's forward passes (micro-batches, evaluation included), so dropout draws match;
* a tied module is built at its first occurrence on the stage and registered under
  ``tied_modules[key]``, before the other layers (DeepSpeed's parameter order, which its
  optimizer state follows).

pipekernel then ties the *whole* tied module across stages (DeepSpeed only the
``tied_weight_attr`` tensors): the same result whenever the other stage's copies of the
remaining parameters are unused, as in the usual embedding / output-head tie.
"""
from __future__ import annotations

import os
import random
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

import pipekernel as pk
from pipekernel.errors import ConfigError
from pipekernel.schedules.instructions import Backward, BackwardInput, BackwardWeight, Forward
from pipekernel.model import recompute
from pipekernel.model.module import StageModule

from .topology import PipeDataParallelTopology, PipelineParallelGrid, check_topology

__all__ = ["LayerSpec", "TiedLayerSpec", "PipelineModule", "partition_uniform",
           "partition_balanced", "set_random_seed"]


def set_random_seed(seed: int) -> None:
    """DeepSpeed's ``set_random_seed``: Python ``random``, NumPy (if installed), torch."""
    random.seed(seed)
    try:
        import numpy
        numpy.random.seed(seed % (2 ** 32))
    except ImportError:
        pass
    torch.manual_seed(seed % (2 ** 63))


def _module_type(typename: Any) -> None:
    if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
        raise ConfigError("LayerSpec only supports torch.nn.Module types.",
                          hint=f"got {typename!r}: put functions directly in the layer list")


class LayerSpec(pk.LayerSpec):
    """DeepSpeed's ``LayerSpec(typename, *module_args, **module_kwargs)``."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        _module_type(typename)
        super().__init__(typename, *module_args, **module_kwargs)
        self.module_args, self.module_kwargs = module_args, module_kwargs

    def build(self, log: bool = False) -> nn.Module:
        return super().build()


class TiedLayerSpec(pk.TiedLayerSpec):
    """DeepSpeed's ``TiedLayerSpec(key, typename, *module_args, forward_fn=None,
    tied_weight_attr=['weight'], **module_kwargs)``."""

    def __init__(self, key: str, typename: type, *module_args: Any,
                 forward_fn: Callable | None = None, tied_weight_attr: Any = ("weight",),
                 **module_kwargs: Any) -> None:
        _module_type(typename)
        super().__init__(key, typename, *module_args, forward_fn=forward_fn, **module_kwargs)
        self.module_args, self.module_kwargs = module_args, module_kwargs
        self.tied_weight_attr = ([tied_weight_attr] if isinstance(tied_weight_attr, str)
                                 else list(tied_weight_attr))

    def build(self, log: bool = False) -> nn.Module:
        return super().build()


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """DeepSpeed's ``partition_uniform`` (the first ``residual`` parts get one more)."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    size, residual = divmod(num_items, num_parts)
    return [p * size + min(p, residual) for p in range(num_parts + 1)]


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """DeepSpeed's ``partition_balanced``: the linear-partition dynamic programme that
    minimises max - min part weight, ties broken towards the last split point as there."""
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    inf = float("inf")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    hi = [[inf] * (m + 1) for _ in range(n + 1)]
    lo = [[inf] * (m + 1) for _ in range(n + 1)]
    cost = [[inf] * (m + 1) for _ in range(n + 1)]
    where = [[0] * (m + 1) for _ in range(n + 1)]
    hi[0][0] = cost[0][0] = 0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                part = prefix[i] - prefix[k]
                top, bottom = max(hi[k][j - 1], part), min(lo[k][j - 1], part)
                if cost[i][j] >= top - bottom:
                    cost[i][j], hi[i][j], lo[i][j], where[i][j] = top - bottom, top, bottom, k
    parts = [n]
    for j in reversed(range(1, m + 1)):
        parts.append(where[parts[-1]][j])
    return parts[::-1]


def _rank_and_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _refuse(name: str, value: Any, default: Any) -> None:
    if value is not default and value != default:
        raise ConfigError(f"PipelineModule({name}=...) is not implemented by "
                          "pipekernel.deepspeed", hint=f"leave {name} at its default "
                                                       f"({default!r}); see docs/deepspeed.md")


class PipelineModule(nn.Module):
    """DeepSpeed's ``PipelineModule`` (see the module docstring for the rules).

    ``activation_checkpoint_func`` is refused by name; runs of
    ``activation_checkpoint_interval`` layers are recomputed (non-reentrantly) as
    DeepSpeed chooses them (:func:`_checkpointed`: those with parameters, or of the
    ``checkpointable_layers`` classes). The data-parallel size is
    ``world_size // num_stages``, rank ``r`` is stage ``r // data_parallel_size``
    (DeepSpeed's ``PipeDataParallelTopology``); a ``topology`` must map ranks that way
    (:func:`~.topology.check_topology`).
    """

    def __init__(self, layers: Sequence[Any], num_stages: int | None = None,
                 topology: Any = None, loss_fn: Callable | None = None,
                 seed_layers: bool = False, seed_fn: Callable[[int], None] | None = None,
                 base_seed: int = 1234, partition_method: str = "parameters",
                 activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Any = None, checkpointable_layers: Any = None,
                 dynamic_shape: bool = False) -> None:
        super().__init__()
        _refuse("activation_checkpoint_func", activation_checkpoint_func, None)
        self.checkpointable_layers = (None if checkpointable_layers is None
                                      else list(checkpointable_layers))
        if num_stages is None and topology is None:
            raise ConfigError("must provide num_stages or topology",
                              hint="PipelineModule(layers, num_stages=...)")
        self.loss_fn = loss_fn
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self.global_rank, self.world_size = _rank_and_world()
        if topology is not None:  # as DeepSpeed: the topology's pipe axis wins
            num_stages, _ = check_topology(topology, self.world_size)
        elif self.world_size % num_stages:
            raise ConfigError(f"num_stages ({num_stages}) must divide distributed world size "
                              f"({self.world_size})",
                              hint="start a multiple of num_stages processes, or pick num_stages "
                                   "dividing the world size")
        self.num_stages, self.dynamic_shape = num_stages, dynamic_shape
        self.dp_size = self.world_size // num_stages
        self.stage_id = self.global_rank // self.dp_size
        self._topo = topology or PipeDataParallelTopology(num_pp=num_stages, num_dp=self.dp_size)
        self._grid: PipelineParallelGrid | None = None
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            self._grid = PipelineParallelGrid(self._topo)  # DeepSpeed builds it here too
        self._layer_specs = list(layers)
        self.partition_method = partition_method
        self.parts = self.partition(num_stages)
        self._local_start = self.parts[self.stage_id]
        self._local_stop = self.parts[self.stage_id + 1]
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.micro_offset = 0
        self._active_offset = 0  # the forward count the running micro-batch was given
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self.forward_funcs: list[Any] = []
        self._calls: list[tuple[int, Any, Callable | None]] = []
        self._build()

    # -- DeepSpeed's partition -------------------------------------------------------
    def partition(self, num_stages: int) -> list[int]:
        """DeepSpeed's stage boundaries for ``num_stages`` stages (``parameters`` builds
        every layer once, as DeepSpeed's ``_count_layer_params``)."""
        method = self.partition_method.lower()
        if method == "uniform":
            return partition_uniform(len(self._layer_specs), num_stages)
        if method == "parameters":
            return partition_balanced(self._count_layer_params(), num_stages)
        if method.startswith("type:"):
            pattern = re.compile(method.split(":")[1], re.IGNORECASE)
            weights = [1 if pattern.search(_layer_name(layer)) else 0
                       for layer in self._layer_specs]
            if not any(weights):
                raise ConfigError(f"Partitioning '{method.split(':')[1]}' found no valid "
                                  "layers to partition.",
                                  hint="use a pattern matching some layers' class names, e.g. "
                                       "partition_method='type:Block'")
            return partition_balanced(weights, num_stages)
        raise ConfigError(f"Partitioning method {self.partition_method} not implemented.",
                          hint="use 'parameters', 'uniform' or 'type:<regex>'")

    def _count_layer_params(self) -> list[int]:
        counts = []
        for layer in self._layer_specs:
            module = layer.build() if isinstance(layer, pk.LayerSpec) else layer
            counts.append(sum(p.numel() for p in module.parameters() if p.requires_grad)
                          if isinstance(module, nn.Module) else 0)
        return counts

    # -- DeepSpeed's build -------------------------------------------------------------
    def _seed(self, seed: int) -> None:
        (self.seed_fn or set_random_seed)(seed)

    def _build(self) -> None:
        for index in range(self._local_start, self._local_stop):
            layer = self._layer_specs[index]
            if self.seed_layers:
                self._seed(self.base_seed + index)
            if isinstance(layer, pk.TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    self.tied_modules[layer.key] = layer.build()
                    self.tied_weight_attrs[layer.key] = getattr(layer, "tied_weight_attr",
                                                                ["weight"])
                module, forward_fn = self.tied_modules[layer.key], layer.forward_fn
            elif isinstance(layer, (pk.LayerSpec, nn.Module)):
                module = layer.build() if isinstance(layer, pk.LayerSpec) else layer
                self.add_module(str(index), module)
                forward_fn = None
            elif callable(layer):
                module, forward_fn = layer, None
            else:
                raise ConfigError(f"layer {index} is {layer!r}: not a LayerSpec, nn.Module "
                                  "or callable",
                                  hint="list LayerSpec(...), TiedLayerSpec(...), modules or "
                                       "functions as layers")
            self._calls.append((index, module, forward_fn))
            self.forward_funcs.append(module if forward_fn is None else
                                      (lambda x, m=module, f=forward_fn: f(m, x)))

    def forward(self, x: Any) -> Any:
        """This stage's layers on ``x`` in one process (DeepSpeed's seeding included)."""
        self.micro_offset += 1
        self._active_offset = self.micro_offset
        for index, module, forward_fn in self._calls:
            if self.seed_layers:
                self._seed(self.base_seed * (self.micro_offset + 1) + index)
            x = module(x) if forward_fn is None else forward_fn(module, x)
        return x

    # -- what pipekernel's engine needs ---------------------------------------------------
    def topology_fields(self) -> dict[str, int]:
        return {"num_stages": self.num_stages, "data_parallel_size": self.dp_size}

    def stage_module(self) -> StageModule:
        """pipekernel's view of this stage (the same module objects and parameters):
        layers under their global indices, seeded per forward when ``seed_layers``."""
        calls = [(index, module, self._seeded(index, forward_fn))
                 for index, module, forward_fn in self._calls]
        if self.activation_checkpoint_interval:
            # what DeepSpeed's forward_funcs hold: the module, or the function calling it
            funcs = [module if forward_fn is None else forward_fn
                     for _, module, forward_fn in self._calls]
            calls = _checkpointed(calls, funcs, self.activation_checkpoint_interval,
                                  self._checkpointable, self.stage_id)
        return StageModule(calls, dict(self.tied_modules), self.stage_id, 0)

    def _checkpointable(self, funcs: Sequence[Any]) -> bool:
        """DeepSpeed's ``_is_checkpointable`` over a run's forward functions: every one's
        class is in ``checkpointable_layers`` when given, else any module has parameters."""
        if self.checkpointable_layers is not None:
            return all(type(f).__name__ in self.checkpointable_layers for f in funcs)
        return any(len(list(f.parameters())) > 0 for f in funcs if isinstance(f, nn.Module))

    def _seeded(self, index: int, forward_fn: Callable | None) -> Callable | None:
        if not self.seed_layers:
            return forward_fn

        def run(module: Any, x: Any) -> Any:
            self._seed(self.base_seed * (self._active_offset + 1) + index)
            return module(x) if forward_fn is None else forward_fn(module, x)
        return run

    def seeding_plugin(self) -> Any:
        """The pipekernel plugin that counts this stage's forward passes as DeepSpeed's
        ``micro_offset`` does, and gives a backward's recomputation (activation
        checkpointing) the count of its own micro-batch's forward."""
        return _ForwardCounter(self)

    def pipeline_module(self) -> pk.PipelineModule:
        """The :class:`pipekernel.PipelineModule` the engine runs: DeepSpeed's partition as
        explicit boundaries, and this rank's stage already built (above)."""
        return _Prebuilt(self)

    def topology(self) -> Any:
        """The process topology (DeepSpeed's ``PipeDataParallelTopology`` unless one was
        given)."""
        return self._topo

    def mpu(self) -> PipelineParallelGrid:
        """DeepSpeed's grid (built with the module, or by ``initialize`` when the module
        was built before ``torch.distributed`` started)."""
        if self._grid is None:
            if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
                raise ConfigError("the pipeline grid needs torch.distributed",
                                  hint="call deepspeed.init_distributed() first")
            self._grid = PipelineParallelGrid(self._topo)
        return self._grid

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def partitions(self) -> list[int]:
        return list(self.parts)

    def stage_owner(self, layer_idx: int) -> int:
        return next(s for s in range(self.num_stages) if layer_idx < self.parts[s + 1])


def _checkpointed(calls: list, funcs: list, interval: int, checkpointable: Callable,
                  stage: int) -> list:
    """DeepSpeed's activation checkpointing of a stage: runs of ``interval`` layers
    (counted from the stage's first), each recomputed in backward when
    ``checkpointable(funcs of the run)`` (DeepSpeed's forward functions: a tied module
    called through ``forward_fn`` is a function there) and run plainly otherwise — so a
    parameterless in-place ``ReLU`` is not recomputed over its own output. The run's
    first call runs the run; its other calls pass their input through (they stay
    registered under their indices: the state_dict keys do not change)."""
    out = []
    for start in range(0, len(calls), interval):
        run = calls[start:start + interval]
        if not checkpointable(funcs[start:start + interval]):
            out += run
            continue
        out.append((run[0][0], run[0][1], _Recomputed(run, stage)))
        out += [(index, module, _passthrough) for index, module, _ in run[1:]]
    return out


def _passthrough(module: Any, x: Any) -> Any:
    return x


class _Recomputed:
    """A run of calls under non-reentrant checkpointing (its RNG state kept, so dropout
    draws the same masks when recomputed; its buffers left as the forward left them,
    :mod:`pipekernel.model.recompute`)."""

    def __init__(self, run: list, stage: int) -> None:
        self.run = run
        self.watch = recompute.SegmentWatch([(index, module) for index, module, _ in run], stage)

    def _forward(self, x: Any) -> Any:
        for _, module, forward_fn in self.run:
            x = module(x) if forward_fn is None else forward_fn(module, x)
        return x

    def __call__(self, module: Any, x: Any) -> Any:
        if not torch.is_grad_enabled():
            return self._forward(x)
        return recompute.checkpoint(self._forward, x, self.watch)


class _ForwardCounter:
    """``Forward`` of micro-batch ``m``: the next count, remembered for ``m``; a backward
    of ``m`` (which may recompute the forward) runs with ``m``'s count."""

    def __init__(self, module: PipelineModule) -> None:
        self.module, self.offsets = module, {}

    @pk.hookimpl
    def pipekernel_before_instruction(self, instruction: Any) -> None:
        module, key = self.module, getattr(instruction, "micro_batch", None)
        if isinstance(instruction, Forward):
            module.micro_offset += 1
            self.offsets[key] = module._active_offset = module.micro_offset
        elif isinstance(instruction, (Backward, BackwardInput, BackwardWeight)):
            module._active_offset = self.offsets.get(key, module._active_offset)


def _layer_name(layer: Any) -> str:
    if isinstance(layer, pk.LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", "")


class _Prebuilt(pk.PipelineModule):
    """A pipekernel layer list whose stage ``stage_id`` is the DeepSpeed module's."""

    def __init__(self, ds: PipelineModule) -> None:
        super().__init__(ds._layer_specs, loss_fn=ds.loss_fn, num_stages=ds.num_stages,
                         partition=list(ds.parts),
                         activation_checkpoint_interval=0)  # the stage module checkpoints
        self.ds = ds

    def build_stage(self, stage: int, bounds: Sequence[int],
                    positions: Sequence[int] | None = None,
                    activation_checkpoint_interval: int | None = None) -> StageModule:
        """This rank's stage (the modules ``PipelineModule`` built); the whole model,
        freshly built, when asked for it (checkpoint metadata on the meta device,
        ``load_sequential``) without touching the RNG the training draws from."""
        if activation_checkpoint_interval:
            raise ConfigError(f"recompute={activation_checkpoint_interval} on stage {stage}: "
                              "a DeepSpeed PipelineModule checkpoints its own stage",
                              hint="set activation_checkpoint_interval on the DeepSpeed "
                                   "PipelineModule (or in the config's pipeline section) and "
                                   "leave the engine's recompute unset")
        whole = [0, len(self.layers)]
        if list(bounds) == whole and stage == 0 and list(positions or [0]) == [0] \
                and list(self.ds.parts) != whole:
            with torch.random.fork_rng(devices=[]):
                return super().build_stage(stage, bounds, positions)
        if stage != self.ds.stage_id or list(bounds) != list(self.ds.parts) \
                or list(positions or [stage]) != [stage]:
            raise ConfigError(f"the engine asks for stage {stage} with bounds {list(bounds)}, "
                              f"and this rank's PipelineModule built stage {self.ds.stage_id} "
                              f"of {list(self.ds.parts)}",
                              hint="use one chunk per stage and the default rank order")
        return self.ds.stage_module()
