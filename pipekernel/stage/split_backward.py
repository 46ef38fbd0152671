"""Zero-bubble backward split: the input pass (B) and the weight pass (W) of one stage.

Zero Bubble Pipeline Parallelism (Qi et al., ICLR 2024) splits a stage's backward into

* **B** — the gradients w.r.t. the stage *inputs*, which the previous stage waits for, and
* **W** — the gradients w.r.t. the stage *parameters*, which nobody waits for and which a
  schedule may run later, in what would otherwise be a bubble.

This module does the split on the autograd graph, so it works for any layer (not only
``nn.Linear``)::

    input_grads, state = backward_input(outputs, grad_outputs, inputs, params)
    ...                       # send input_grads upstream, run other micro-batches
    backward_weight(state)    # accumulate p.grad for every p in params

What a caller may rely on
-------------------------
* ``backward_input`` returns one gradient per entry of ``inputs``, in order: what
  ``torch.autograd.grad`` gives, or ``zeros_like(input)`` where the input does not require
  grad or does not reach the outputs. It writes no ``.grad`` (neither inputs' nor params').
* After ``backward_weight(state)``, every ``p.grad`` holds what one
  ``torch.autograd.backward(outputs, grad_outputs)`` (or ``loss.backward()``) would have
  accumulated into it: added to an existing ``.grad``, created when it is ``None``, left
  untouched when ``p`` gets no gradient. A parameter used several times (tied) gets the sum.
  Only the listed ``params`` are written. Several states may be open at once (B of several
  micro-batches, then their W's in any order): the gradients add up.
* **The input path is back-propagated once.** B runs exactly the nodes that lie on a path
  from the outputs to an input — what ``torch.autograd.grad(outputs, inputs)`` runs — and
  records the gradient arriving at each of them that also has an edge into the
  parameter-only part of the graph ("split nodes": for ``nn.Linear`` the matmul node, for
  ``LayerNorm``/``Conv1d`` their fused backward). Such a node computes in B only its
  input-side outputs (``dy @ W``). W re-runs each split node from the recorded gradient
  computing only its parameter-side outputs (``x^T @ dy``, ``sum(dy)``, the norm's weight
  gradient), then runs the parameter-only part of the graph. No other node of the input path
  runs again, and no node of the parameter-only part runs in B.
* The first stage (``inputs=[]``, or no input requiring grad) works the same way: B runs
  nothing (the outputs' gradients are what W starts from), and W produces the same
  parameter gradients as a full backward.
* The last stage passes ``loss=<tensor with one element>`` (already scaled by a precision
  policy, if any) with empty ``outputs``/``grad_outputs``; it is back-propagated with
  gradient 1, as ``loss.backward()`` would.
* Outputs that do not require grad (bool masks, integer indices, detached tensors) are
  skipped together with their entry in ``grad_outputs``; so is an output whose gradient is
  ``None``.
* ``backward_weight`` runs once per state and then drops everything the state held (the
  recorded gradients, the references into the graph); a second call raises
  :class:`~pipekernel.errors.PipelineError`. Gradients recorded by B that share memory with
  a caller's ``grad_outputs`` tensor are copied, so the caller may reuse its gradient
  buffers as soon as ``backward_input`` returns.

How W re-runs a split node: from a pre-hook on the first weight-part node it feeds, i.e.
*inside* W's one autograd call, where autograd makes a node compute only the outputs whose
edges that call needs. The input side is not part of that call's graph, so it is never
recomputed — however the split nodes are connected (chains, tied parameters alike). W then
back-propagates the weight part in that same call, into the listed ``params`` only.

Memory: B keeps the graph (``retain_graph=True``) because W re-runs the split nodes, which
need their saved activations. The graph — input-path activations included — is freed once
W has run and the caller has dropped ``outputs``; as with
``torch.distributed.pipelining``, B does not shrink the memory of the micro-batch.

Limitations: a custom ``autograd.Function`` that takes both an activation and a parameter
(a ``torch.compile``'d layer is one) is a split node whose ``backward`` computes every
gradient ``ctx.needs_input_grad`` asks for whoever calls it, so it runs whole in B and again
in W, in an autograd call of its own (correct, but its input-side work is done twice;
should another path from it reach the same weight-part node, that call also passes
undefined gradients down the input path below it, which custom Functions there see as
zeros). Non-reentrant activation checkpointing (``use_reentrant=False``, what pipekernel's
own checkpointing uses) is an ordinary graph and splits normally; reentrant checkpointing
cannot be back-propagated in parts (``torch.autograd.grad`` refuses it), and B raises a
:class:`~pipekernel.errors.PipelineError` saying so. ``create_graph`` (double backward) is
not supported.

Planned once per graph shape: B walks the graph once (one pass over ``next_functions``)
and looks its shape — node types and edges, roots, inputs and parameters by position — up
in a small cache of plans (which nodes to split, where their weight-side edges go, which
roots and parameters the weight part holds); only a shape not seen before is analysed.
The activation gradients are read once, in B's one autograd call, which records what
arrives at each split node.
W calls ``torch.autograd.graph._engine_run_backward`` (what ``torch.autograd.backward``
calls, minus its per-root Python checks), falling back to ``torch.autograd.backward``.

Layer 2 (pure torch): imports nothing from the runtime or the engine.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from pipekernel.errors import PipelineError

try:  # the engine entry point torch.autograd.backward itself calls
    from torch.autograd.graph import _engine_run_backward
except ImportError:  # pragma: no cover - other torch versions
    _engine_run_backward = None  # type: ignore[assignment]  # the fallback at its use

__all__ = ["WeightGradState", "backward_input", "backward_weight"]


class _Split:
    """A split node: recorded incoming gradients, and its edges into the weight part."""

    __slots__ = ("node", "slots", "grads", "targets", "wedges", "direct", "guard")

    def __init__(self, node: Node, slots: tuple[int, ...], targets: list[GradientEdge],
                 wedges: list[tuple[int, Node, int]], guard: bool, direct: bool) -> None:
        self.node = node
        self.slots = slots               # input slots whose gradient B records
        self.grads: list = []            # recorded in B, one per slot (None: none arrived)
        self.targets = targets           # distinct (child, slot) it feeds in the weight part
        self.wedges = wedges             # (edge index, child, slot) of those edges
        # a C++ node is called directly inside W's autograd call, which computes only the
        # outputs whose edges that call needs; a custom Function's backward computes what
        # ctx.needs_input_grad says whatever the call, so it gets its own autograd call
        self.direct = direct
        # True when another path from this node may reach one of its targets; used for
        # custom Functions: W then silences the node's other children while re-running it
        self.guard = guard


class WeightGradState:
    """What :func:`backward_input` hands to :func:`backward_weight`; opaque to callers.

    ``done`` turns true once ``backward_weight`` has run on it.
    """

    __slots__ = ("_splits", "_roots", "_params", "done")

    def __init__(self, splits: list[_Split], roots: list[tuple[GradientEdge, torch.Tensor]],
                 params: list[torch.Tensor]) -> None:
        self._splits = splits     # split nodes to re-run for their parameter-side outputs
        self._roots = roots       # outputs whose node is already in the weight part
        self._params = params
        self.done = False

    def __repr__(self) -> str:
        return (f"WeightGradState(split_nodes={len(self._splits)}, "
                f"weight_roots={len(self._roots)}, params={len(self._params)}, "
                f"done={self.done})")


class _Walk:
    """The autograd graph reachable from the roots, in one pass: ``nodes`` in visit order,
    ``rows[i]`` the edges of ``nodes[i]`` as ``(child index or -1, slot)`` by output index,
    and ``key``, which says everything the split depends on (the node types and the
    edges), so two graphs with equal keys split the same way (:func:`_plan`)."""

    __slots__ = ("nodes", "index", "rows", "key")

    def __init__(self, roots: list[Node]) -> None:
        nodes: list[Node] = []
        index: dict[Node, int] = {}
        for node in roots:
            if node not in index:
                index[node] = len(nodes)
                nodes.append(node)
        rows = []
        at = 0
        while at < len(nodes):  # breadth first: nodes grows while it is read
            row = []
            for child, slot in nodes[at].next_functions:
                if child is None:
                    row.append((-1, slot))
                    continue
                i = index.get(child)
                if i is None:
                    i = index[child] = len(nodes)
                    nodes.append(child)
                row.append((i, slot))
            rows.append(tuple(row))
            at += 1
        self.nodes, self.index, self.rows = nodes, index, tuple(rows)
        self.key = (tuple(map(type, nodes)), self.rows)


class _Plan:
    """How one graph shape splits, by node index (see :func:`_plan`).

    * ``splits``: ``(node, slots, wedges, targets, guard, direct)`` per split node,
      ``wedges`` as ``(edge index, child, slot)``, ``targets`` the distinct ``(child,
      slot)``, ``direct`` false for a custom Function (see :class:`_Split`);
    * ``weight_roots``: positions of the roots whose node lies in the weight part;
    * ``reached``: positions (in the caller's parameter list) of the parameters the weight
      part reaches.
    """

    __slots__ = ("splits", "weight_roots", "reached", "has_weight_part")

    def __init__(self, splits, weight_roots, reached, has_weight_part) -> None:
        self.splits, self.weight_roots = splits, weight_roots
        self.reached, self.has_weight_part = reached, has_weight_part


def _ancestors(parents: list[list[int]], start, *, strict: bool) -> set[int]:
    """Indices with a path to one of ``start`` (``strict``: of length >= 1)."""
    found: set[int] = set() if strict else set(start)
    stack = list(start)
    while stack:
        for parent in parents[stack.pop()]:
            if parent not in found:
                found.add(parent)
                stack.append(parent)
    return found


_PLANS: dict[tuple, _Plan] = {}
_MAX_PLANS = 64


def _plan(walk: _Walk, roots: tuple[tuple[int, int], ...], inputs: tuple[int, ...],
          params: tuple[int, ...]) -> _Plan:
    """The split of a graph shape, computed once per ``(walk.key, roots, inputs, params)``
    and reused for every micro-batch whose graph has that shape. ``roots``: ``(node
    index, output_nr)`` of each root; ``inputs``/``params``: the node indices of the inputs
    and of the parameters (``-1``: not in the graph)."""
    key = (walk.key, roots, inputs, params)
    plan = _PLANS.get(key)
    if plan is not None:
        return plan
    rows = walk.rows
    parents: list[list[int]] = [[] for _ in rows]
    used: list[set[int]] = [set() for _ in rows]
    for node, row in enumerate(rows):
        for child, slot in row:
            if child >= 0:
                parents[child].append(node)
                used[child].add(slot)
    weight_part = _ancestors(parents, [p for p in params if p >= 0], strict=False)
    input_path = _ancestors(parents, [i for i in inputs if i >= 0], strict=True)  # B runs it
    weight_part -= input_path
    for node, slot in roots:
        used[node].add(slot)
    splits = []
    for node in range(len(rows)):  # visit order: deterministic
        if node not in input_path:
            continue
        wedges = tuple((e, c, s) for e, (c, s) in enumerate(rows[node]) if c in weight_part)
        if not wedges:
            continue
        targets = tuple(dict.fromkeys((c, s) for _, c, s in wedges))
        # a target reached by more than this one edge may be reached from another child
        guard = len(targets) < len(wedges) or any(len(parents[c]) > 1 for c, _ in targets)
        direct = not issubclass(walk.key[0][node], torch.autograd.function.BackwardCFunction)
        splits.append((node, tuple(sorted(used[node])), wedges, targets, guard, direct))
    weight_roots = tuple(k for k, (node, _) in enumerate(roots) if node in weight_part)
    reached = tuple(k for k, p in enumerate(params) if p in weight_part)
    plan = _Plan(tuple(splits), weight_roots, reached, bool(weight_part))
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.pop(next(iter(_PLANS)))
    _PLANS[key] = plan
    return plan


def _leaf_indices(walk: _Walk, tensors: list[torch.Tensor]) -> tuple[int, ...]:
    """The node index of each leaf tensor's gradient accumulator (``-1`` if not in the
    graph), found among the walk's ``AccumulateGrad`` nodes, without a lookup per tensor."""
    where: dict[int, int] = {}
    for i, (node, row) in enumerate(zip(walk.nodes, walk.rows)):
        if not row and hasattr(node, "variable"):
            where[id(node.variable)] = i
    return tuple(where.get(id(t), -1) for t in tensors)


def _check_list(name: str, values, allow_none: bool = False) -> list:
    if isinstance(values, torch.Tensor) or not isinstance(values, Sequence):
        raise PipelineError(f"split_backward: {name} must be a list of tensors, "
                            f"got {type(values).__name__}",
                            hint="wrap a single tensor in a list")
    for i, v in enumerate(values):
        if not (isinstance(v, torch.Tensor) or (allow_none and v is None)):
            raise PipelineError(f"split_backward: {name}[{i}] is {type(v).__name__}, "
                                "not a tensor", hint=f"pass only tensors in {name}")
    return list(values)


def _roots(outputs, grad_outputs, loss):
    """The (output, gradient) pairs to back-propagate, after the argument checks."""
    outputs = _check_list("outputs", outputs)
    grad_outputs = _check_list("grad_outputs", grad_outputs, allow_none=True)
    if loss is not None:
        if outputs or grad_outputs:
            raise PipelineError(
                "split_backward: backward_input got both loss and outputs/grad_outputs",
                hint="on the last stage pass loss=... with outputs=[] and grad_outputs=[]; "
                     "elsewhere pass outputs and grad_outputs without loss")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            got = (f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
                   else type(loss).__name__)
            raise PipelineError(f"split_backward: loss must be a one-element tensor, got {got}",
                                hint="reduce the loss to a scalar (e.g. .mean()) first")
        if not loss.requires_grad:
            raise PipelineError("split_backward: loss does not require grad",
                                hint="compute the loss from the stage outputs with grad "
                                     "enabled (not under torch.no_grad())")
        return [loss], [torch.ones_like(loss, memory_format=torch.preserve_format)]
    if len(outputs) != len(grad_outputs):
        raise PipelineError(
            f"split_backward: {len(outputs)} outputs but {len(grad_outputs)} grad_outputs",
            hint="pass one gradient (or None) per output, in the same order")
    pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad and g is not None]
    return [o for o, _ in pairs], [g for _, g in pairs]


def backward_input(outputs: Sequence[torch.Tensor],
                   grad_outputs: Sequence[torch.Tensor | None],
                   inputs: Sequence[torch.Tensor],
                   params: Sequence[torch.Tensor],
                   loss: torch.Tensor | None = None,
                   ) -> tuple[list[torch.Tensor], WeightGradState]:
    """Backward pass B: the gradients w.r.t. ``inputs``, and the state for the weight pass.

    ``outputs``/``grad_outputs``: the stage's output tensors and their gradients (an output
    that does not require grad, or whose gradient is ``None``, is skipped). On the last stage
    pass ``loss`` instead and leave both empty. ``inputs``: the stage's input tensors
    (detached leaves with ``requires_grad=True``, or ones that do not require grad; may be
    empty on the first stage). ``params``: the stage's parameters; those that do not
    require grad are ignored, repeats count once.

    Returns ``(input_grads, state)``: one tensor per input (``zeros_like`` where autograd
    gives none) and the :class:`WeightGradState` to pass to :func:`backward_weight` exactly
    once. See the module docstring for the full contract.
    """
    outs, out_grads = _roots(outputs, grad_outputs, loss)
    inputs = _check_list("inputs", inputs)
    grad_inputs, stage_params = _leaves_of(inputs, _check_list("params", params))
    root_edges = [get_gradient_edge(t) for t in outs]
    walk = _Walk([e.node for e in root_edges])
    roots = tuple((walk.index[e.node], e.output_nr) for e in root_edges)
    leaves = _leaf_indices(walk, grad_inputs + stage_params)
    plan = _plan(walk, roots, leaves[:len(grad_inputs)], leaves[len(grad_inputs):])
    nodes = walk.nodes
    splits = [_Split(nodes[n], slots, [GradientEdge(nodes[c], k) for c, k in targets],
                     [(e, nodes[c], k) for e, c, k in wedges], guard, direct)
              for n, slots, wedges, targets, guard, direct in plan.splits]

    captures = [GradientEdge(s.node, slot) for s in splits for slot in s.slots]
    wanted = [*grad_inputs, *captures]
    grads = (_input_pass(outs, wanted, out_grads, plan.has_weight_part) if outs and wanted
             else (None,) * len(wanted))
    found = iter(grads[:len(grad_inputs)])
    input_grads = []
    for t in inputs:
        g = next(found) if t.requires_grad else None
        input_grads.append(torch.zeros_like(t) if g is None else g)
    kept_splits = _keep_recorded(splits, grads[len(grad_inputs):], out_grads)
    # the caller may reuse its gradient buffers once B returns: W gets copies
    direct = [(root_edges[k], out_grads[k].clone()) for k in plan.weight_roots]
    reached = [stage_params[k] for k in plan.reached]
    return input_grads, WeightGradState(kept_splits, direct, reached)


def _leaves_of(inputs: list[torch.Tensor], params: list[torch.Tensor]
               ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(inputs that require grad, parameters that do, each once)``, checked."""
    input_ids = {id(t) for t in inputs}
    stage_params, seen = [], set()
    for p in params:
        if id(p) in input_ids:
            raise PipelineError("split_backward: a tensor is both an input and a parameter",
                                hint="list each tensor once, in inputs or in params")
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            stage_params.append(p)
    grad_inputs = [t for t in inputs if t.requires_grad]
    for t in grad_inputs:
        if t.grad_fn is not None:
            raise PipelineError(
                "split_backward: a stage input that requires grad is not a leaf tensor",
                hint="pass the received activation detached: x = x.detach().requires_grad_()")
    return grad_inputs, stage_params


def _input_pass(outs: list, wanted: list, out_grads: list, retain: bool) -> tuple:
    """B's one autograd call: the gradients of ``wanted`` (inputs, then split captures)."""
    try:
        return torch.autograd.grad(outs, wanted, out_grads, retain_graph=retain,
                                   allow_unused=True)
    except RuntimeError as err:
        if "use_reentrant" not in str(err):
            raise
        raise PipelineError(
            "split_backward: the stage uses activation checkpointing with "
            "use_reentrant=True, which torch cannot back-propagate in parts "
            "(torch.autograd.grad refuses it)",
            hint="checkpoint with use_reentrant=False (pipekernel's own activation "
                 "checkpointing does), or use a schedule without the split backward "
                 "(1f1b, gpipe, interleaved)") from err


def _keep_recorded(splits: list[_Split], recorded: Sequence, out_grads: list) -> list[_Split]:
    """Give each split node the gradients B captured for it (copies of any that are the
    caller's own buffers); the split nodes that got one."""
    caller = {g.untyped_storage().data_ptr() for g in out_grads}  # the caller's buffers
    found = iter(recorded)
    kept = []
    for s in splits:
        s.grads = [next(found) for _ in s.slots]
        s.grads = [g.clone() if g is not None and g.untyped_storage().data_ptr() in caller
                   else g for g in s.grads]
        if any(g is not None for g in s.grads):
            kept.append(s)
    return kept


def _silence(grads: tuple) -> tuple:
    """Pre-hook: the node goes on with undefined gradients (no work in generated nodes)."""
    return tuple(None for _ in grads)


def _as_input(grad: torch.Tensor, meta) -> torch.Tensor:
    """What autograd's output validation does to a node's output before passing it on."""
    if tuple(grad.shape) != tuple(meta.shape):
        grad = grad.sum_to_size(meta.shape)
    if grad.dtype != meta.dtype or grad.device != meta.device:
        grad = grad.to(dtype=meta.dtype, device=meta.device)
    return grad


def _add(into: dict, key, grad: torch.Tensor) -> None:
    into[key] = into[key] + grad if key in into else grad


def backward_weight(state: WeightGradState) -> None:
    """Backward pass W: accumulate into ``p.grad`` the parameter gradients of ``state``.

    Re-runs each split node from the gradient B recorded, computing only its outputs into
    the weight part, and back-propagates the weight part of the graph from there (and from
    outputs that lie in it) into the parameters in one autograd call, accumulating like
    ``.backward()``. Frees that part of the graph and drops everything the state held.
    Raises :class:`~pipekernel.errors.PipelineError` when called a second time on the
    same state.
    """
    _check_state(state)
    splits, roots, params = state._splits, state._roots, state._params
    state._splits, state._roots, state._params = [], [], []
    state.done = True
    if not params:
        return
    into: dict[GradientEdge, torch.Tensor] = {}  # root gradients of the weight part
    for edge, g in roots:
        _add(into, edge, g)
    for s in splits:  # custom Functions: one autograd call each
        if not s.direct:
            _run_function_split(s, into)
    direct = _DirectSplits([s for s in splits if s.direct])
    direct.stand_in(into)
    handles = [node.register_prehook(direct.hook_for(node)) for node in direct.feeders]
    try:
        if into:
            edges, grads = tuple(into), tuple(into.values())
            into.clear()
            if _engine_run_backward is not None:
                # what torch.autograd.backward(edges, grads, inputs=params) runs, without
                # its Python-side re-validation of every root gradient (~0.1 ms per root;
                # each one already has its node's exact shape, dtype and device)
                _engine_run_backward(edges, grads, False, False, tuple(params),
                                     allow_unreachable=True, accumulate_grad=True)
            else:
                torch.autograd.backward(edges, grads, inputs=params)
    finally:
        for h in handles:
            h.remove()


def _check_state(state: Any) -> None:
    """``state`` is a :class:`WeightGradState` that no W pass used yet."""
    if not isinstance(state, WeightGradState):
        raise PipelineError(
            "split_backward: backward_weight needs the state backward_input returned, "
            f"got {type(state).__name__}",
            hint="call input_grads, state = backward_input(...) first and pass state")
    if state.done:
        raise PipelineError(
            "split_backward: backward_weight called twice on the same state",
            hint="run exactly one backward_weight per backward_input; the first call already "
                 "accumulated the parameter gradients and freed what the state held")


def _run_function_split(s: _Split, into: dict) -> None:
    """A custom Function's split node: one autograd call from the gradient B recorded to
    its targets, whose gradients are added to ``into``."""
    pairs = [(GradientEdge(s.node, slot), g) for slot, g in zip(s.slots, s.grads)
             if g is not None]
    handles = []
    if s.guard:
        # another child may lead to a target: silence the children (they run, passing
        # on undefined gradients), so what is captured is this node's own contribution
        # — the rest is counted by the other split nodes. A target that runs is
        # captured before its pre-hook fires.
        handles = [c.register_prehook(_silence)
                   for c in {c for c, _ in s.node.next_functions if c is not None}]
    try:
        got = torch.autograd.grad([e for e, _ in pairs], s.targets, [g for _, g in pairs],
                                  retain_graph=s.guard, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    for edge, g in zip(s.targets, got):
        if g is not None:
            _add(into, edge, g)


class _DirectSplits:
    """The C++ split nodes of one W pass. Each is called directly from a pre-hook on the
    first weight-part node it feeds, i.e. inside W's autograd call: autograd then makes
    it compute only the outputs whose edges that call needs — those into the weight part,
    never the input side (which is not part of that call's graph at all)."""

    def __init__(self, splits: list[_Split]) -> None:
        self.splits = splits
        self.feeders: dict[Node, list[_Split]] = {}
        for s in splits:
            for edge in s.targets:
                self.feeders.setdefault(edge.node, [])
                if s not in self.feeders[edge.node]:
                    self.feeders[edge.node].append(s)
        self.pending: dict[tuple[Node, int], torch.Tensor] = {}
        self.placeholders: dict[tuple[Node, int], torch.Tensor] = {}

    def stand_in(self, into: dict) -> None:
        """Give every target without a root gradient one: a zero (no memory: a broadcast
        scalar) standing in for the one its pre-hook supplies."""
        zero: dict = {}
        for s in self.splits:
            for edge in s.targets:
                if edge not in into:
                    meta = edge.node._input_metadata[edge.output_nr]
                    key = (meta.dtype, meta.device)
                    if key not in zero:
                        zero[key] = torch.zeros((), dtype=meta.dtype, device=meta.device)
                    self.placeholders[(edge.node, edge.output_nr)] = into[edge] = \
                        zero[key].expand(meta.shape)

    def run(self, s: _Split) -> None:
        args: list = [None] * len(s.node._input_metadata)
        for slot, g in zip(s.slots, s.grads):
            args[slot] = g
        s.grads = []
        outs = s.node(*args)  # type: ignore[operator]  # autograd nodes are callable (not in torch's stub)
        del args
        for i, child, slot in s.wedges:
            if outs[i] is not None:
                _add(self.pending, (child, slot),
                     _as_input(outs[i], child._input_metadata[slot]))

    def hook_for(self, node: Node) -> Callable[[tuple], tuple]:
        def pre_hook(grads: tuple) -> tuple:
            for s in self.feeders.pop(node, ()):
                if s.grads:  # not run yet
                    self.run(s)
            new = list(grads)
            for slot, g in enumerate(new):
                if g is not None and g is self.placeholders.get((node, slot)):
                    g = None
                c = self.pending.pop((node, slot), None)
                new[slot] = c if g is None else g if c is None else g + c
            return tuple(new)
        return pre_hook
