"""Describing a model as a list of layers, and building one stage of it.

``LayerSpec`` delays construction so that a stage builds only its own layers;
``PipelineModule`` holds the list, the loss and the partitioning policy, and
``build_stage`` makes the :class:`StageModule` one rank trains.
"""
from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from pipekernel.nested import map_tensors
from pipekernel.model import skips
from pipekernel.model import recompute
from pipekernel.errors import ConfigError, did_you_mean

__all__ = ["LayerSpec", "TiedLayerSpec", "PipelineModule", "StageModule"]


def seeded_cuda_devices() -> list[int]:
    """The CUDA devices whose generators :func:`seed_generators` reseeds: every device
    once CUDA is initialised in this process, none before (see there)."""
    return list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []


def seed_generators(seed: int) -> None:
    """``torch.manual_seed(seed)`` without touching CUDA before CUDA is initialised.

    ``torch.manual_seed`` on a process whose CUDA is not initialised yet queues the
    seed and applies it when CUDA starts, long after the layers were built: the CUDA
    generator (dropout on the GPU) would then start from the last layer's seed. So
    the CPU generator is seeded always, CUDA's only once initialised; the caller
    forks and restores both (:func:`seeded_cuda_devices`).
    """
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)


class LayerSpec:
    """A layer to construct later: ``typename(*args, **kwargs)``.

    :param typename: an ``nn.Module`` subclass (or any callable returning a module).
    """

    def __init__(self, typename: Callable[..., nn.Module], *args: Any, **kwargs: Any) -> None:
        if not callable(typename):
            raise ConfigError(f"LayerSpec needs a class or factory, got {typename!r}",
                              hint="pass the class itself: LayerSpec(nn.Linear, 4, 4)")
        self.typename, self.args, self.kwargs = typename, args, kwargs

    def build(self) -> nn.Module:
        return self.typename(*self.args, **self.kwargs)

    def __repr__(self) -> str:
        args = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"{type(self).__name__}({getattr(self.typename, '__name__', self.typename)}, " \
               f"{', '.join(args)})"


class TiedLayerSpec(LayerSpec):
    """A layer whose parameters are shared by every ``TiedLayerSpec`` with the same ``key``.

    On one stage all occurrences use one module; on different stages each holds
    a copy, built identically, and their gradients are summed before the step
    so the copies stay equal (e.g. an embedding reused as the output head).

    :param key: the name that ties occurrences together.
    :param forward_fn: ``forward_fn(module, x)`` used instead of ``module(x)``
        at this occurrence (e.g. ``lambda emb, h: h @ emb.weight.T``).
    """

    def __init__(self, key: str, typename: Callable[..., nn.Module], *args: Any,
                 forward_fn: Callable[[nn.Module, Any], Any] | None = None, **kwargs: Any) -> None:
        super().__init__(typename, *args, **kwargs)
        self.key, self.forward_fn = key, forward_fn


class StageModule(nn.Module):
    """The layers of one stage, chained like ``nn.Sequential``.

    Modules are registered under their *global* layer index, so
    ``state_dict()`` keys are ``f"{global_index}.{name}"`` whatever the
    partitioning. A tied module appears under every index where it occurs.

    A stage of a schedule with several chunks holds several *parts* (runs of
    consecutive layers, one per chunk); ``part(c)`` runs chunk ``c``'s layers and
    ``forward`` runs the only part of a one-chunk stage.
    """

    #: how a ``ForwardBackward`` runs (set from the PipelineModule's, see there)
    overlapped_forward_backward: Callable[..., Any] | None

    def __init__(self, layers: Sequence[tuple[int, Any, Callable | None]],
                 tied: dict[str, nn.Module], stage: int = 0,
                 activation_checkpoint_interval: int = 0,
                 parts: Sequence[int] | None = None,
                 skip_declarations: dict[int, Any] | None = None) -> None:
        super().__init__()
        self.stage = stage
        self.activation_checkpoint_interval = activation_checkpoint_interval
        #: ``{global layer index: (stash names, pop names)}`` of this stage's layers.
        self.skip_declarations = dict(skip_declarations or {})
        self._calls: list[tuple[int, Any, Callable | None]] = []
        for index, layer, forward_fn in layers:
            if isinstance(layer, nn.Module) and str(index) not in self._modules:
                self.add_module(str(index), layer)
            self._calls.append((index, layer, forward_fn))
        self.tied_modules = dict(tied)  # key -> module (not registered twice)
        #: first global index of a checkpointed segment -> what its forward writes
        self._watches: dict[int, recompute.SegmentWatch] = {}
        self.first_index = layers[0][0] if layers else 0
        sizes = list(parts) if parts is not None else [len(layers)]
        self._parts, start = [], 0
        for size in sizes:
            self._parts.append(_Part(self, self._calls[start:start + size],
                                     [entry[1] for entry in layers[start:start + size]]))
            start += size

    @property
    def num_parts(self) -> int:
        return len(self._parts)

    def part(self, chunk: int) -> _Part:
        """The callable running chunk ``chunk``'s layers (``parameters()`` lists its own)."""
        return self._parts[chunk]

    def forward(self, x: Any) -> Any:
        if len(self._parts) != 1:
            raise RuntimeError(f"stage {self.stage} holds {len(self._parts)} parts: call "
                               "stage.part(chunk)(x)")
        return self._run(self._calls, x)

    def _run(self, calls: Sequence[tuple[int, Any, Callable | None]], x: Any) -> Any:
        if self.skip_declarations:
            scope = skips.active()  # the runtime's, with what other parts sent
            if scope is None:       # one process: stash and pop stay local
                with skips.SkipScope(self.skip_declarations,
                                     where=f"stage {self.stage}") as scope:
                    return _run_scoped(calls, x, scope)
            return _run_scoped(calls, x, scope)
        k = self.activation_checkpoint_interval
        if not k or not torch.is_grad_enabled():
            return _run_calls(calls, x)
        # Non-reentrant checkpointing keeps only each chunk's input and recomputes
        # the chunk in backward; the saved RNG state makes dropout draw the same mask,
        # and the recompute leaves the buffers as the forward left them (recompute.py).
        for start in range(0, len(calls), k):
            segment = calls[start:start + k]
            watch = self._watches.get(segment[0][0])
            if watch is None:
                watch = self._watches[segment[0][0]] = recompute.SegmentWatch(
                    [(index, layer) for index, layer, _ in segment], self.stage)
            x = recompute.checkpoint(functools.partial(_run_segment, segment), x, watch)
        return x


class _Part:
    """One chunk's layers of a :class:`StageModule`: callable, with ``parameters()``.

    Not an ``nn.Module``, so the stage's ``state_dict`` keys stay global."""

    def __init__(self, stage: StageModule, calls: list, layers: list) -> None:
        self._stage, self._calls, self._layers = stage, calls, layers

    def __call__(self, x: Any) -> Any:
        return self._stage._run(self._calls, x)

    @property
    def layers(self) -> list:
        """The chunk's layers, in the order its forward calls them."""
        return list(self._layers)

    def parameters(self) -> list[torch.Tensor]:
        seen: set[int] = set()
        out: list[torch.Tensor] = []
        for layer in self._layers:
            if isinstance(layer, nn.Module):
                for p in layer.parameters():
                    if id(p) not in seen:
                        seen.add(id(p))
                        out.append(p)
        return out


def _run_calls(calls: Sequence[tuple[int, Any, Callable | None]], x: Any) -> Any:
    for index, layer, forward_fn in calls:
        try:
            x = layer(x) if forward_fn is None else forward_fn(layer, x)
        except Exception as err:
            raise _name_layer(err, index, layer)
    return x


def _run_segment(calls: Sequence[tuple[int, Any, Callable | None]], x: Any) -> Any:
    """One checkpointed segment, run on a copy of its input.

    The checkpoint keeps the segment's input by reference and runs the segment on it
    again in backward. A first layer that works in place on its input
    (``nn.ReLU(inplace=True)``, ``x += bias``) would change that saved input: the
    recomputation would start from the modified values, and modify a tensor of the
    graph outside the segment a second time (``RuntimeError: ... modified by an
    inplace operation``). The copy costs one tensor of the input's size while the
    segment runs, in forward and in the recomputation (the layers' saved tensors are
    the checkpoint's, dropped until backward), and one copy's time; its gradient is
    the identity, so the result is the one without checkpointing, bit for bit."""
    return _run_calls(calls, map_tensors(torch.Tensor.clone, x))


def _name_layer(err: Exception, index: int, layer: Any) -> Exception:
    """Tag ``err`` with the failing layer (global index and class) for the kernel's
    ``InstructionError``; the innermost tag wins (a nested pipeline names its own layer)."""
    if getattr(err, "pipekernel_where", None) is None:
        try:
            setattr(err, "pipekernel_where", f"layer {index} ({type(layer).__name__})")
        except AttributeError:  # an exception type with __slots__: keep it untagged
            pass
    return err


def _run_scoped(calls: Sequence[tuple[int, Any, Callable | None]], x: Any,
                scope: skips.SkipScope) -> Any:
    for index, layer, forward_fn in calls:
        try:
            x = scope.run(index, layer if forward_fn is None else
                          functools.partial(forward_fn, layer), x)
        except Exception as err:
            raise _name_layer(err, index, layer)
    return x


class PipelineModule:
    """A model as a list of layers, split into pipeline stages.

    :param layers: ``LayerSpec``/``TiedLayerSpec``, ``nn.Module`` objects or plain callables.
    :param loss_fn: ``loss_fn(outputs, labels)`` on the last stage; needed to train.
    :param num_stages: number of stages; ``None`` lets the engine use the world size
        divided by the data-parallel size.
    :param partition: a partition method name (``"parameters"``, ``"uniform"``,
        ``"type:<regex>"``), explicit boundaries ``[0, b1, ..., len(layers)]``, or
        anything a partition plugin accepts.
    :param seed: if set, layer ``i`` is built right after ``torch.manual_seed(seed + i)``
        (a tied layer with the seed of its first occurrence), so weights do not
        depend on the partitioning.
    Layers may be wrapped in :class:`~pipekernel.model.skips.Skip` (or have a class decorated
    with :func:`~pipekernel.model.skips.skippable`) to pass tensors to a later layer by name
    (skip connections, :mod:`pipekernel.model.skips`); the wrapper is removed from ``layers``
    and its names kept in ``skip_declarations``.

    :param batch_fn: ``batch_fn(item) -> (inputs, labels)``, applied to every item the
        data iterator yields before the stages read it (e.g. a dict per micro-batch, as
        :func:`pipekernel.hf.split_batch` splits it); ``None`` (default): the items are
        ``(inputs, labels)`` pairs already.
    :param activation_checkpoint_interval: ``k > 0`` keeps only the input of every
        run of ``k`` consecutive layers of a stage during a forward with grad
        enabled and recomputes the run in backward (non-reentrant
        ``torch.utils.checkpoint``, RNG state preserved so dropout matches; the
        recompute leaves every buffer as the forward left it, and a Python attribute it
        changes is a ``ConfigError``: :mod:`pipekernel.model.recompute`);
        ``0`` (default) stores every activation.
    :param overlapped_forward_backward: how a stage runs a ``ForwardBackward`` (the pairs
        of ``dualpipev`` and ``zbv``): DualPipe's contract, see :mod:`pipekernel.stage.paired` (e.g.
        :func:`pipekernel.overlap_all_to_all`, which hides expert all-to-alls); a subclass
        may define it as a method instead. ``None`` (default): the forward, then the
        backward.
    """

    #: DualPipe's hook (see ``overlapped_forward_backward`` above); ``None``: none.
    overlapped_forward_backward: Callable[..., Any] | None = None
    #: Why the engine's ``seq_chunks > 1`` is refused for this model (its attention cannot
    #: read the key/value prefix of earlier sequence chunks); ``None``: not known to be.
    sequence_chunks_refused: str | None = None
    #: Applied to each ``(inputs, labels)`` before it is cut into sequence chunks
    #: (``seq_chunks > 1``), e.g. to shift unshifted labels so that no prediction crosses a
    #: cut; ``None``: cut as they are.
    sequence_chunk_fn: Callable[[Any], Any] | None = None

    def __init__(self, layers: Sequence[Any], loss_fn: Callable[[Any, Any], Any] | None = None,
                 num_stages: int | None = None, partition: Any = "parameters",
                 seed: int | None = None, activation_checkpoint_interval: int = 0,
                 batch_fn: Callable[[Any], Any] | None = None,
                 overlapped_forward_backward: Callable[..., Any] | None = None) -> None:
        if overlapped_forward_backward is not None:
            self.overlapped_forward_backward = overlapped_forward_backward
        self.layers = [layer.layer if isinstance(layer, skips.Skip) else layer
                       for layer in layers]
        #: ``{layer index: (stash names, pop names)}`` for the layers that declare skips.
        self.skip_declarations = {i: skips.declared(layer) for i, layer in enumerate(layers)
                                  if skips.declared(layer) != ((), ())}
        if not self.layers:
            raise ConfigError("PipelineModule got an empty layer list",
                              hint="pass at least one layer per stage")
        for i, layer in enumerate(self.layers):
            if not (isinstance(layer, (LayerSpec, nn.Module)) or callable(layer)):
                raise ConfigError(f"layer {i} is {layer!r}, which is not a LayerSpec, "
                                  "nn.Module or callable",
                                  hint="wrap the layer in LayerSpec(cls, *args)")
        if num_stages is not None:
            self._check_stages(num_stages)
        if not (isinstance(activation_checkpoint_interval, int)
                and not isinstance(activation_checkpoint_interval, bool)
                and activation_checkpoint_interval >= 0):
            raise ConfigError(f"activation_checkpoint_interval must be an int >= 0, got "
                              f"{activation_checkpoint_interval!r}",
                              hint="use 0 to store all activations or k > 0 to recompute "
                                   "every k layers")
        self.activation_checkpoint_interval = activation_checkpoint_interval
        #: ``{name: (stashing layer, popping layer)}`` of every skip connection.
        self.skip_names = skips.check_declarations(self.skip_declarations, len(self.layers),
                                                   activation_checkpoint_interval > 0)
        self.loss_fn, self.num_stages = loss_fn, num_stages
        if batch_fn is not None and not callable(batch_fn):
            raise ConfigError(f"batch_fn must be callable, got {batch_fn!r}",
                              hint="pass a function item -> (inputs, labels), or None")
        self.batch_fn = batch_fn
        self.partition_method, self.seed = partition, seed
        self._first_tied: dict[str, int] = {}
        for i, layer in enumerate(self.layers):
            if isinstance(layer, TiedLayerSpec):
                self._first_tied.setdefault(layer.key, i)

    def _check_stages(self, num_stages: int) -> None:
        if num_stages < 1 or num_stages > len(self.layers):
            raise ConfigError(
                f"cannot split {len(self.layers)} layers into {num_stages} stages",
                hint="every stage needs at least one layer: use fewer stages or more layers")

    def _seed_for(self, index: int) -> int | None:
        if self.seed is None:
            return None
        layer = self.layers[index]
        if isinstance(layer, TiedLayerSpec):
            index = self._first_tied[layer.key]
        return self.seed + index

    def build_layer(self, index: int) -> Any:
        """Construct layer ``index`` (applying the seeding rule)."""
        layer = self.layers[index]
        if not isinstance(layer, LayerSpec):
            return layer
        seed = self._seed_for(index)
        if seed is not None:
            seed_generators(seed)
        return layer.build()

    def measured_layer(self, index: int, device: Any, scope: Any = None) -> tuple[Any, Any]:
        """Layer ``index`` built on ``device`` for measuring it (a user's own module is
        copied: the model itself is never moved or stepped) and the call running it on
        an input, its ``forward_fn`` for a tied layer, inside the skip ``scope``
        (a :class:`~pipekernel.model.skips.SkipScope`) if any. What the partitioner and the
        planner's measurements run."""
        spec = self.layers[index]
        layer = self.build_layer(index)
        if isinstance(layer, nn.Module):
            if not isinstance(spec, LayerSpec):
                layer = copy.deepcopy(layer)
            layer = layer.to(device)
        forward_fn = spec.forward_fn if isinstance(spec, TiedLayerSpec) else None

        def run(inp: Any) -> Any:
            return layer(inp) if forward_fn is None else forward_fn(layer, inp)

        def call(inp: Any) -> Any:
            if scope is None:
                return run(inp)
            with scope:
                return scope.run(index, run, inp)
        return layer, call

    def parameter_counts(self) -> list[int]:
        """Parameters per layer, counted on the meta device (nothing is allocated)."""
        counts = []
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            for i, layer in enumerate(self.layers):
                module = layer.build() if isinstance(layer, LayerSpec) else layer
                counts.append(sum(p.numel() for p in module.parameters())
                              if isinstance(module, nn.Module) else 0)
        return counts

    def partition(self, num_stages: int, pm: Any = None, context: Any = None) -> list[int]:
        """Stage boundaries ``[0, ..., len(layers)]`` for ``num_stages`` stages.

        :param pm: the plugin manager (default: a fresh one).
        :param context: a :class:`~pipekernel.model.partitioning.PartitionContext`
            (default: one for a single CPU process); plugins leave their per-layer
            estimates on it for the partition report.
        """
        self._check_stages(num_stages)
        if pm is None:
            from pipekernel.extend.manager import make_plugin_manager
            pm = make_plugin_manager()
        if context is None:
            from pipekernel.model.partitioning import PartitionContext
            context = PartitionContext(module=self, num_stages=num_stages)
        bounds = pm.hook.pipekernel_partition(method=self.partition_method, layers=self.layers,
                                              num_stages=num_stages, context=context)
        if bounds is None:
            from pipekernel.extend.manager import provided_names
            known = provided_names(pm, "partition")
            raise ConfigError(f"no partition plugin understands partition={self.partition_method!r}"
                              f"{did_you_mean(self.partition_method, known)}",
                              hint="use 'parameters', 'uniform', 'type:<regex>', 'memory', "
                                   "pk.profile(sample), pk.memory(sample), pk.balance(costs), "
                                   "a cost function or explicit boundaries [0, ..., len(layers)]")
        bounds = list(bounds)
        ok = (len(bounds) == num_stages + 1 and bounds[0] == 0 and bounds[-1] == len(self.layers)
              and all(a < b for a, b in zip(bounds, bounds[1:])))
        if not ok:
            raise ConfigError(
                f"partition {self.partition_method!r} gave boundaries {bounds} for "
                f"{len(self.layers)} layers and {num_stages} stages",
                hint=f"boundaries must strictly increase from 0 to {len(self.layers)} "
                     f"with {num_stages + 1} entries")
        return bounds

    def build_stage(self, stage: int, bounds: Sequence[int],
                    positions: Sequence[int] | None = None,
                    activation_checkpoint_interval: int | None = None) -> StageModule:
        """Construct only the layers of ``stage``.

        :param bounds: part boundaries ``[0, ..., len(layers)]``.
        :param positions: the parts (pipeline positions) this stage holds, by chunk
            (:func:`pipekernel.schedules.placement.parts_of`); default ``[stage]``.
        :param activation_checkpoint_interval: this stage's interval (the engine's
            per-stage ``recompute``), in place of the module's; ``None``: the module's.
        """
        tied: dict[str, nn.Module] = {}
        built, sizes = [], []
        with torch.random.fork_rng(devices=seeded_cuda_devices(), enabled=self.seed is not None):
            for pos in (positions if positions is not None else [stage]):
                sizes.append(bounds[pos + 1] - bounds[pos])
                for index in range(bounds[pos], bounds[pos + 1]):
                    spec = self.layers[index]
                    if isinstance(spec, TiedLayerSpec):
                        if spec.key not in tied:
                            tied[spec.key] = self.build_layer(index)
                        built.append((index, tied[spec.key], spec.forward_fn))
                    else:
                        built.append((index, self.build_layer(index), None))
        mine = {index for index, _, _ in built}
        interval = self.activation_checkpoint_interval if activation_checkpoint_interval \
            is None else activation_checkpoint_interval
        module = StageModule(built, tied, stage, interval,
                             parts=sizes, skip_declarations={
                                 i: d for i, d in self.skip_declarations.items() if i in mine})
        module.overlapped_forward_backward = self.overlapped_forward_backward
        return module

    def skip_layout(self, bounds: Sequence[int]) -> skips.SkipLayout:
        """Where the skip connections go for part boundaries ``bounds``: the edges
        ``(producer position, consumer position)`` and the names each carries."""
        return skips.SkipLayout(self.skip_names, bounds)

    def tied_stages(self, bounds: Sequence[int],
                    stage_of: Callable[[int], int] | None = None) -> dict[str, list[int]]:
        """``{key: stages holding it}`` for every tied key.

        :param stage_of: maps a part (pipeline position) to the stage holding it
            (default: part ``p`` is stage ``p``, one part per stage)."""
        stages: dict[str, list[int]] = {}
        for index, layer in enumerate(self.layers):
            if isinstance(layer, TiedLayerSpec):
                part = next(s for s in range(len(bounds) - 1) if index < bounds[s + 1])
                stage = stage_of(part) if stage_of is not None else part
                if stage not in stages.setdefault(layer.key, []):
                    stages[layer.key].append(stage)
        return {key: sorted(found) for key, found in stages.items()}
