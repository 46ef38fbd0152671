"""Skip connections: a layer stashes a tensor by name, a later layer pops it.

Models that are not a straight chain (U-Net, encoder-decoder, long residuals) pass
a tensor from one layer to a much later one. With pipeline parallelism the two may
sit on different stages; pipekernel routes the tensor **straight from the stage
that stashes it to the stage that pops it** (not through the stages in between),
and its gradient straight back (the torchgpipe ``skippable`` idea)::

    import pipekernel as pk

    @pk.skippable(stash=["enc1"])
    class Down(nn.Module):
        def forward(self, x):
            y = self.conv(x)
            pk.stash("enc1", y)          # kept for a later layer
            return self.pool(y)

    @pk.skippable(pop=["enc1"])
    class Up(nn.Module):
        def forward(self, x):
            return self.conv(torch.cat([self.up(x), pk.pop("enc1")], dim=1))

    layers = [pk.LayerSpec(Down, ...), *middle, pk.LayerSpec(Up, ...)]

Names are declared *statically* — on the class (:func:`skippable`) or on one entry
of the layer list (:class:`Skip`, when one class serves several names) — so the
engine knows, as soon as the layers are placed, which pipeline position sends to
which (the skip *edges*), builds the communication plan with a lane per edge, and
the simulator proves it deadlock-free before the first forward
(:mod:`pipekernel.schedules.skips`). At run time every layer is checked against its
declaration: stashing or popping an undeclared name, or not stashing/popping a
declared one, raises :class:`~pipekernel.errors.ConfigError` naming the layer, the
stage and the micro-batch.

Rules (checked when the :class:`~pipekernel.model.module.PipelineModule` is built):
each name is stashed by exactly one layer and popped by exactly one later layer.
What may be stashed: anything that can cross a stage boundary (a tensor, or
tuples/lists/dicts of tensors; :mod:`pipekernel.comm.wire`). Gradients flow back for its
float tensors that require grad. Within one part (the layers of one chunk of one
stage) stash and pop are plain Python: nothing is sent. Between two chunks of the
same stage it is a local hand-off. Activation checkpointing
(``activation_checkpoint_interval > 0``) is not supported together with skips.
"""
from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from pipekernel.errors import ConfigError, PipelineError

__all__ = ["skippable", "Skip", "stash", "pop", "declared", "SkipLayout", "SkipScope",
           "check_declarations"]

_ATTRIBUTE = "__pipekernel_skips__"
_ACTIVE: contextvars.ContextVar[SkipScope | None] = contextvars.ContextVar(
    "pipekernel_skip_scope", default=None)

Declaration = tuple[tuple[str, ...], tuple[str, ...]]  # (stash names, pop names)


def _names(value: Iterable[str] | str, what: str) -> tuple[str, ...]:
    names = (value,) if isinstance(value, str) else tuple(value)
    for name in names:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"skip {what} names must be non-empty strings, got {name!r}",
                              hint=f'e.g. {what}=["enc1"]')
    if len(set(names)) != len(names):
        raise ConfigError(f"skip {what} names {names} repeat a name",
                          hint="list each name once")
    return names


def skippable(stash: Iterable[str] | str = (), pop: Iterable[str] | str = ()) -> Callable:
    """Class (or function) decorator: the layer stashes the names ``stash`` and pops
    the names ``pop`` in every forward (with :func:`stash` / :func:`pop`).

    Returns the class (or function) itself with the declaration attached. A
    :class:`Skip` entry in the layer list overrides it for that entry.
    """
    declaration = (_names(stash, "stash"), _names(pop, "pop"))

    def mark(target: Any) -> Any:
        setattr(target, _ATTRIBUTE, declaration)
        return target
    return mark


class Skip:
    """One entry of a layer list with its skip names: ``pk.Skip(layer, stash=[...],
    pop=[...])`` where ``layer`` is a ``LayerSpec``, a module or a callable. Overrides
    what the layer's class declares with :func:`skippable`; the
    :class:`~pipekernel.model.module.PipelineModule` keeps ``layer`` in its list."""

    def __init__(self, layer: Any, stash: Iterable[str] | str = (),
                 pop: Iterable[str] | str = ()) -> None:
        if isinstance(layer, Skip):
            raise ConfigError("pk.Skip of a pk.Skip", hint="give all the names in one pk.Skip")
        self.layer = layer
        self.declaration: Declaration = (_names(stash, "stash"), _names(pop, "pop"))

    def __repr__(self) -> str:
        stash, pop = self.declaration
        return f"Skip({self.layer!r}, stash={list(stash)}, pop={list(pop)})"


def declared(layer: Any) -> Declaration:
    """``(stash names, pop names)`` a layer-list entry declares (empty when none)."""
    if isinstance(layer, Skip):
        return layer.declaration
    target = getattr(layer, "typename", layer)  # a LayerSpec declares through its class
    found = getattr(target, _ATTRIBUTE, None)
    return found if found is not None else ((), ())


def check_declarations(declarations: Mapping[int, Declaration], num_layers: int,
                       checkpointing: bool = False) -> dict[str, tuple[int, int]]:
    """``{name: (stashing layer, popping layer)}``; raises ``ConfigError`` listing every
    name stashed twice, never popped, popped but never stashed, or popped by a layer
    that does not come after the one stashing it."""
    stashed: dict[str, list[int]] = {}
    popped: dict[str, list[int]] = {}
    for index, (stash_names, pop_names) in sorted(declarations.items()):
        for name in stash_names:
            stashed.setdefault(name, []).append(index)
        for name in pop_names:
            popped.setdefault(name, []).append(index)
    problems, edges = [], {}
    for name in sorted(set(stashed) | set(popped)):
        at, by = stashed.get(name, []), popped.get(name, [])
        if len(at) > 1 or len(by) > 1:
            problems.append(f"{name!r} is stashed by layers {at} and popped by layers {by}; "
                            "each name is stashed once and popped once")
        elif not by:
            problems.append(f"{name!r} is stashed by layer {at[0]} and never popped")
        elif not at:
            problems.append(f"{name!r} is popped by layer {by[0]} and never stashed")
        elif by[0] <= at[0]:
            problems.append(f"{name!r} is popped by layer {by[0]}, which does not come after "
                            f"layer {at[0]} that stashes it")
        else:
            edges[name] = (at[0], by[0])
    if problems:
        raise ConfigError("the skip connections of the layer list are inconsistent:\n"
                          + "\n".join(f"  - {p}" for p in problems),
                          hint="declare every name with pk.skippable(stash=...) on exactly one "
                               "layer and pk.skippable(pop=...) on exactly one later layer")
    if edges and checkpointing:
        raise ConfigError("skip connections cannot be combined with activation checkpointing "
                          f"(activation_checkpoint_interval > 0; skips: {sorted(edges)})",
                          hint="use activation_checkpoint_interval=0 with pk.stash/pk.pop")
    return edges


class SkipLayout:
    """Where each skip connection goes once the layers are placed.

    :param names: ``{name: (stashing layer, popping layer)}``
        (:func:`check_declarations`).
    :param bounds: part boundaries ``[0, ..., num_layers]`` (part = pipeline position).

    ``edges``: sorted ``(producer position, consumer position)`` pairs that cross
    parts; ``names_of[edge]``: the names each carries, in a fixed order.
    """

    def __init__(self, names: Mapping[str, tuple[int, int]], bounds: Sequence[int]) -> None:
        def part(layer: int) -> int:
            return next(p for p in range(len(bounds) - 1) if layer < bounds[p + 1])

        self.bounds = list(bounds)
        self.positions = {name: (part(a), part(b)) for name, (a, b) in names.items()}
        by_edge: dict[tuple[int, int], list[str]] = {}
        for name, (p, q) in sorted(self.positions.items()):
            if p != q:
                by_edge.setdefault((p, q), []).append(name)
        self.edges: list[tuple[int, int]] = sorted(by_edge)
        self.names_of: dict[tuple[int, int], tuple[str, ...]] = {
            edge: tuple(found) for edge, found in by_edge.items()}

    def into(self, consumer: int) -> list[tuple[int, int]]:
        """The edges ending at position ``consumer``."""
        return [e for e in self.edges if e[1] == consumer]

    def out_of(self, producer: int) -> list[tuple[int, int]]:
        """The edges starting at position ``producer``."""
        return [e for e in self.edges if e[0] == producer]


class SkipScope:
    """Where :func:`stash` and :func:`pop` go during one forward of some layers.

    :param declarations: ``{global layer index: (stash names, pop names)}`` of the
        layers that may run in this scope.
    :param incoming: names already available to :func:`pop` (received from
        earlier parts).
    :param where: how errors name the place (``"stage 1 micro-batch 3"``).
    :param replay: measuring mode (the partitioner runs each layer several times):
        a stash replaces, a pop does not consume.
    :param keep: applied to each stashed value before it is kept (the partitioner
        keeps detached leaves, as a receiving stage would).
    """

    def __init__(self, declarations: Mapping[int, Declaration],
                 incoming: Mapping[str, Any] | None = None, where: str = "",
                 replay: bool = False, keep: Callable[[Any], Any] | None = None) -> None:
        self.declarations, self.where, self.replay = declarations, where, replay
        self._keep = keep
        self.available: dict[str, Any] = dict(incoming or {})
        self.stashed: dict[str, Any] = {}  # stashed here and not popped here
        self.layer: int | None = None
        self._did: set[tuple[str, str]] = set()
        self._token: Any = None

    def __enter__(self) -> SkipScope:
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.reset(self._token)

    def _where(self) -> str:
        layer = f"layer {self.layer}" if self.layer is not None else "a layer"
        return f"{layer}{' on ' + self.where if self.where else ''}"

    def _check(self, what: str, name: str) -> None:
        stash_names, pop_names = ((), ()) if self.layer is None else \
            self.declarations.get(self.layer, ((), ()))
        names = stash_names if what == "stash" else pop_names
        if name not in names:
            raise ConfigError(f"{self._where()} called pk.{what}({name!r}) but declares "
                              f"{what}={list(names)}",
                              hint=f"declare it: @pk.skippable({what}=[{name!r}]) on the class, "
                                   f"or pk.Skip(layer, {what}=[{name!r}]) in the layer list")

    def stash(self, name: str, value: Any) -> None:
        self._check("stash", name)
        if (name, "stash") in self._did and not self.replay:
            raise ConfigError(f"{self._where()} stashed {name!r} twice in one forward",
                              hint="stash each name once per forward")
        self._did.add((name, "stash"))
        if self._keep is not None:
            value = self._keep(value)
        self.available[name] = value
        self.stashed[name] = value

    def pop(self, name: str) -> Any:
        self._check("pop", name)
        if name not in self.available:
            raise ConfigError(f"{self._where()} popped {name!r}, which is not available "
                              "(popped twice, or its producer did not stash it)",
                              hint="pop each name once per forward, after the layer that "
                                   "stashes it ran")
        self._did.add((name, "pop"))
        if self.replay:
            return self.available[name]
        self.stashed.pop(name, None)
        return self.available.pop(name)

    def run(self, index: int, call: Callable[[Any], Any], x: Any) -> Any:
        """Run layer ``index`` (``call(x)``) and check it did what it declares."""
        self.layer, self._did = index, set()
        out = call(x)
        stash_names, pop_names = self.declarations.get(index, ((), ()))
        missing = [f"stash {n!r}" for n in stash_names if (n, "stash") not in self._did]
        missing += [f"pop {n!r}" for n in pop_names if (n, "pop") not in self._did]
        if missing:
            raise ConfigError(f"{self._where()} declares but did not {', '.join(missing)} "
                              "in its forward",
                              hint="call pk.stash/pk.pop for every declared name in every "
                                   "forward, or fix the declaration")
        self.layer = None
        return out


def active() -> SkipScope | None:
    """The scope of the forward running now, if any."""
    return _ACTIVE.get()


def _scope_or_fail(what: str, name: str) -> SkipScope:
    scope = _ACTIVE.get()
    if scope is None:
        raise PipelineError(f"pk.{what}({name!r}) was called outside the forward of a "
                            "pipeline stage",
                            hint="declare the names (pk.skippable / pk.Skip) and run the layer "
                                 "through a PipelineModule (engine, or module.build_stage(0, "
                                 "[0, len(layers)]) on one process)")
    return scope


def stash(name: str, value: Any) -> None:
    """Keep ``value`` for the later layer that pops ``name`` (call inside ``forward``)."""
    _scope_or_fail("stash", name).stash(name, value)


def pop(name: str) -> Any:
    """The value an earlier layer stashed as ``name`` (call inside ``forward``)."""
    return _scope_or_fail("pop", name).pop(name)
