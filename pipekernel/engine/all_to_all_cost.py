"""The planner's measurement of expert-parallel layers' all-to-all cost.

The layer profile (``pk.profile``, measured on global rank 0 alone) builds every layer
outside an expert-parallel group: a MoE layer then holds all of its experts and moves no
token. What expert parallelism adds to a stage is the dispatch and the combine (and the
token counts' exchange) of every MoE layer, forward and backward. :func:`measure_all_to_all`
times them where they happen: every rank builds the layers in the expert-parallel group
the engine would give it (``expert_parallel_size=E``; a group of the planner's own, lane
0) and runs the sample through them, one layer at a time, while an
:class:`~pipekernel.grid.expert_parallel.AllToAllClock` counts the wall seconds spent
inside the all-to-alls (forward, and their backward between two autograd marks). Rank
0's medians are broadcast, so every rank plans with the same numbers.

Collective: every rank of the transport calls it at the same point with the same sample
(each expert-parallel group exchanges within itself, all at once); under an engine, a
rank that fails during it stops the others at once (:func:`_watched`). A layer without
expert parameters (``pk.expert_parallel.mark``) is not timed: its all-to-all cost is 0.
On a GPU the clock synchronises the device around each call (see ``AllToAllClock``).
"""
from __future__ import annotations

import contextvars
import math
import statistics
import threading
from collections.abc import Callable
from typing import Any

import torch

from pipekernel.comm.transport import wait_sliced
from pipekernel.errors import PeerAbort, PipelineError
from pipekernel.grid import expert_parallel
from pipekernel.nested import map_tensors, tensors_of

__all__ = ["measure_all_to_all", "planner_group"]


def planner_group(topology: Any, transport: Any, size: int) -> expert_parallel.ExpertParallelGroup:
    """This rank's expert-parallel group for the measurement (collective; the trivial group
    when ``size`` is 1)."""
    return expert_parallel.make_group(topology, transport, size, lanes=1)


def measure_all_to_all(module: Any, sample: Any, ep_group: expert_parallel.ExpertParallelGroup,
                       *, transport: Any = None, device: Any = "cpu", repeats: int = 3,
                       warmup: int = 1, clock: Callable[[], float] | None = None
                       ) -> list[tuple[float, float]]:
    """Per layer, the median ``(forward, backward)`` seconds of its expert all-to-alls on
    one micro-batch ``sample`` (``(0, 0)`` for a layer without experts), rank 0's numbers
    on every rank of ``transport`` (see the module docstring). ``repeats`` timed runs
    follow ``warmup`` untimed ones, at least one: the members enter a layer's first
    all-to-all at different times (each builds the layer first)."""
    device = torch.device(device)
    scope = None
    if module.skip_declarations:  # as the layer profile runs them (plugins/partition.py)
        from pipekernel.model.skips import SkipScope
        scope = SkipScope(module.skip_declarations, where="the all-to-all measurement",
                          replay=True, keep=_leaf)

    def measure() -> list[tuple[float, float]]:
        return _measured(module, sample, ep_group, device, scope, (repeats, warmup, clock))

    return _agree(_watched(measure, transport), transport)


def _measured(module: Any, sample: Any, ep_group: expert_parallel.ExpertParallelGroup,
              device: torch.device, scope: Any, timing: tuple) -> list[tuple[float, float]]:
    """:func:`measure_all_to_all`'s layer-by-layer runs, before the agreement."""
    repeats, warmup, clock = timing
    x = map_tensors(lambda t: t.to(device), sample)
    out: list[tuple[float, float]] = []
    cuda = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda), expert_parallel.context(ep_group):
        for index in range(len(module.layers)):
            run, experts = _built(module, index, device, scope)
            if experts and ep_group.size > 1:  # at least one untimed run: it lines the
                # members up (a new group's first all-to-all also sets up its connections)
                out.append(_time(run, x, repeats, max(warmup, 1), clock))
            else:
                out.append((0.0, 0.0))
            with torch.no_grad():
                x = run(_leaf(x))
    return out


def _watched(measure: Callable[[], list], transport: Any) -> list:
    """``measure()``, run on a helper thread while this one waits for it and reads the
    engine's abort board (``transport.abort_check``, :mod:`pipekernel.engine.faults`)
    between slices of ``transport.abort_interval`` seconds.

    The all-to-alls wait inside torch's functional collectives, where no board is read:
    a rank that failed during the measurement (its engine publishes the error) would
    leave the others waiting there until the process groups' timeout. Watched, they raise
    the failing rank's :class:`~pipekernel.errors.PeerAbort` at once (the helper, still
    blocked, ends with the groups). Without a board (no engine) it runs here."""
    check = getattr(transport, "abort_check", None) if transport is not None else None
    if check is None:
        return measure()
    box: dict[str, Any] = {}
    done = threading.Event()
    # the current CUDA device is per thread: the helper measures on the caller's
    cuda = torch.cuda.current_device() if torch.cuda.is_initialized() else None

    def work() -> None:
        try:
            if cuda is not None:
                torch.cuda.set_device(cuda)
            box["out"] = measure()
        except BaseException as err:  # re-raised by the caller
            box["err"] = err
        finally:
            done.set()

    threading.Thread(target=contextvars.copy_context().run, args=(work,), daemon=True,
                     name="pipekernel-all-to-all-measurement").start()
    try:
        wait_sliced(done.wait, math.inf, check, getattr(transport, "abort_interval", 0.5))
        if "err" in box and not isinstance(box["err"], PipelineError):
            check()  # a backend's words (a closed connection): another rank's failure first
    except PeerAbort as abort:
        abort.add_detail(f"rank {transport.rank} was measuring the expert all-to-alls "
                         "(schedule='auto')")
        raise
    if "err" in box:
        raise box["err"]
    return box["out"]


def _built(module: Any, index: int, device: torch.device,
           scope: Any) -> tuple[Callable[[Any], Any], bool]:
    """Layer ``index`` built here (``PipelineModule.measured_layer``) and whether it holds
    expert parameters."""
    layer, run = module.measured_layer(index, device, scope)
    experts = isinstance(layer, torch.nn.Module) and any(
        expert_parallel.is_expert(p) for p in layer.parameters())
    return run, experts


def _leaf(obj: Any) -> Any:
    return map_tensors(lambda t: t.detach().requires_grad_(True)
                       if t.is_floating_point() or t.is_complex() else t.detach(), obj)


def _time(run: Callable[[Any], Any], x: Any, repeats: int, warmup: int,
          now: Callable[[], float] | None) -> tuple[float, float]:
    forward, backward = [], []
    for _ in range(warmup + repeats):
        with expert_parallel.timing(expert_parallel.AllToAllClock(now)) as clock:
            outputs = [t for t in tensors_of(run(_leaf(x))) if t.requires_grad]
            if outputs:
                torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
        forward.append(clock.forward_s)
        backward.append(clock.backward_s)
    return statistics.median(forward[warmup:]), statistics.median(backward[warmup:])


def _agree(values: list[tuple[float, float]], transport: Any) -> list[tuple[float, float]]:
    """Rank 0's ``values`` on every rank of ``transport``."""
    if transport is None or transport.world_size == 1:
        return values
    buf = torch.tensor([v for pair in values for v in pair], dtype=torch.float64)
    buf = buf.to(transport.device)
    transport.broadcast(buf, 0)
    flat = buf.cpu().tolist()
    return [(flat[2 * i], flat[2 * i + 1]) for i in range(len(values))]


# -- pricing: what the simulator sees -----------------------------------------------------

def pair_cost(forward: tuple[float, float], backward: tuple[float, float]) -> float:
    """The seconds of a ``ForwardBackward`` whose executor overlaps the halves'
    all-to-alls (:func:`pipekernel.overlap_all_to_all`): ``forward`` and ``backward`` are
    each half's ``(compute, all-to-all)`` seconds.

    The model: one compute stream and one communication stream; each half's all-to-all
    hides under the *other* half's compute, and what does not fit shows::

        F + B - min(a2a(F), compute(B)) - min(a2a(B), compute(F))

    so the pair never costs less than its compute (``compute(F) + compute(B)``) nor than
    its all-to-alls, and without all-to-all it is ``F + B``. It ignores that a half's own
    dispatch, experts and combine depend on each other (an upper bound on the overlap).
    """
    (fc, fa), (bc, ba) = forward, backward
    return fc + fa + bc + ba - min(fa, bc) - min(ba, fc)


def pair_table(parts: dict[tuple[int, int], tuple[float, float, float, float]],
               overlaps_same_chunk: bool) -> dict[tuple[int, int, int], dict[type, float]]:
    """``simulate``'s ``stage_costs`` entries pricing every pair a stage may run:
    ``parts[(stage, chunk)]`` is that part's ``(forward compute, forward all-to-all,
    backward compute, backward all-to-all)`` seconds; a pair of one chunk with itself
    runs its halves one after the other unless ``overlaps_same_chunk`` (a model's own
    executor: assumed to overlap like the built-in one)."""
    from pipekernel.schedules.instructions import ForwardBackward

    table: dict[tuple[int, int, int], dict[type, float]] = {}
    for (stage, cf), (fc, fa, _, _) in parts.items():
        for (other, cb), (_, _, bc, ba) in parts.items():
            if other != stage:
                continue
            cost = pair_cost((fc, fa), (bc, ba)) if cf != cb or overlaps_same_chunk \
                else fc + fa + bc + ba
            table[(stage, cf, cb)] = {ForwardBackward: cost}
    return table


def overlaps_same_chunk(executor: Any) -> bool:
    """Whether ``executor`` overlaps a pair of one chunk (the built-in one does not)."""
    from pipekernel.stage.paired import overlap_all_to_all

    return executor is not overlap_all_to_all
