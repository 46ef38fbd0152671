"""The router's load-balancing loss of a Hugging Face MoE model, carried across stages.

With ``output_router_logits=True`` a Hugging Face MoE causal LM (Mixtral, Qwen2-MoE,
Qwen3-MoE, GPT-OSS, OLMoE, ...) adds to its loss ::

    router_aux_loss_coef * load_balancing_loss_func(router_logits, E, top_k, attention_mask)

where ``router_logits`` are the logits of *every* MoE layer, concatenated: the loss is
``E * Σ_e f_e P_e`` with ``f_e`` the share of top-k assignments and ``P_e`` the mean
router probability of expert ``e`` over every (unpadded) token of every layer. A product
of two means over all layers is not a sum of per-layer terms, so no stage can compute its
share alone. What *is* a sum over layers are the three partial sums transformers itself
accumulates layer by layer: the assignment counts per expert (no gradient), the router
probabilities summed per expert (with gradient) and the number of rows. So:

* each decoder layer's pipeline layer hooks the modules Hugging Face records the router
  logits from (its own ``_can_record_outputs["router_logits"]``: the very tensors its
  forward concatenates, found in the module tree of the layer) and adds that layer's
  share to the partial sums, with transformers' own reductions, in layer order;
* the partial sums travel with the activations (``x["router"]``: two ``E``-vectors, a
  row count and the flattened attention mask) — a few numbers on the wire, and the
  gradient of the probability sums comes back in the ordinary backward;
* the pipeline layer of the last decoder layer turns them into transformers' value and
  adds ``coef * value`` with :func:`pipekernel.add_aux_loss` (reported apart, in the
  returned loss, its gradient in that stage's backward).

:func:`find_router_aux` decides, at build time, from the model's own code: the
``*ForCausalLM.forward`` must call transformers' ``load_balancing_loss_func`` (checked on
random logits against the reproduction here) as ``(outputs.router_logits, E, k,
attention_mask)`` and add ``coef * aux_loss`` to its loss; a forward that adds no router
loss (DeepSeek-V3) needs nothing; any other is refused by name.
"""
from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipekernel.errors import ConfigError

__all__ = ["RouterAux", "find_router_aux", "start", "accumulate", "aux_value", "Capture",
           "routed"]

_DOCS = "see docs/hf.md, 'MoE router auxiliary loss'"
_HINT = "set config.output_router_logits=False to train on the causal-LM loss alone; " + _DOCS
_FUNCTION = "load_balancing_loss_func"


@dataclass(frozen=True)
class RouterAux:
    """How a model's router auxiliary loss is computed, found by :func:`find_router_aux`.

    :param num_experts: ``E`` as the forward passes it.
    :param top_k: ``k`` as the forward passes it.
    :param coef: what the forward multiplies the value by (``router_aux_loss_coef``).
    :param masked: the forward passes its ``attention_mask`` (else ``None``).
    :param index: which output of a router module is its logits.
    :param routers: per decoder layer, the paths (relative to the layer) of the modules
        whose outputs are router logits, in registration order (empty: a dense layer).
    """

    num_experts: int
    top_k: int
    coef: float
    masked: bool
    index: int
    routers: tuple[tuple[str, ...], ...]


def start(inputs: dict[str, Any], device: torch.device, masked: bool = True
          ) -> dict[str, Any]:
    """The partial sums before the first layer: none yet, and the attention mask flattened
    as transformers flattens it (``None``: no mask given, or the forward passes none to its
    loss: every row counts)."""
    mask = inputs.get("attention_mask") if masked and isinstance(inputs, dict) else None
    flat = None if mask is None else mask.reshape(-1).to(device=device, dtype=torch.float32)
    return {"tokens": None, "probs": None, "rows": None, "mask": _bits(flat)}


def _bits(t: torch.Tensor | None) -> torch.Tensor | None:
    """A float32 tensor without gradient as its bits (an int32 view): what a low-precision
    policy casts on the wire are floats, so counts and the mask arrive exact."""
    return None if t is None else t.view(torch.int32)


def _float(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.view(torch.float32)


def accumulate(partial: dict[str, Any], logits: torch.Tensor, router: RouterAux
               ) -> dict[str, Any]:
    """``partial`` plus one router's logits, by transformers' own per-layer reductions
    (``load_balancing_loss_func``'s loop body), in float32. The probability sums carry
    the gradient (and travel in the wire's dtype, as activations do); the counts and the
    mask travel as float32 bits."""
    num_experts, top_k, flat_mask = router.num_experts, router.top_k, _float(partial["mask"])
    device = logits.device
    zeros = torch.zeros(num_experts, dtype=torch.float32, device=device)
    tokens = zeros if partial["tokens"] is None else _float(partial["tokens"])
    probs = zeros if partial["probs"] is None else partial["probs"]
    rows = torch.zeros((), dtype=torch.float32, device=device) if partial["rows"] is None \
        else _float(partial["rows"])
    routing_weights = torch.nn.functional.softmax(logits, dim=-1)
    _, selected_experts = torch.topk(routing_weights, top_k, dim=-1)
    if flat_mask is None:
        histc_dtype = torch.float32 if device.type in ("cpu", "mps") else torch.int32
        tokens = tokens + torch.histc(selected_experts.reshape(-1).to(histc_dtype),
                                      bins=num_experts, min=0, max=num_experts)
        probs = probs + routing_weights.float().sum(dim=0)
        rows = rows + routing_weights.shape[0]
    else:
        tokens = tokens + torch.zeros(num_experts, dtype=torch.float32, device=device
                                      ).scatter_add_(0, selected_experts.reshape(-1),
                                                     flat_mask.repeat_interleave(top_k))
        probs = probs + (routing_weights.float() * flat_mask.unsqueeze(-1)).sum(dim=0)
        rows = rows + flat_mask.sum()
    return {"tokens": _bits(tokens), "probs": probs, "rows": _bits(rows),
            "mask": partial["mask"]}


def aux_value(partial: dict[str, Any], router: RouterAux) -> torch.Tensor | None:
    """transformers' value from the partial sums of every layer (``None``: no router ran)."""
    if partial["probs"] is None:
        return None
    rows = _float(partial["rows"])
    tokens_per_expert = _float(partial["tokens"]) / rows
    router_prob_per_expert = partial["probs"].float() / rows
    overall_loss = torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0))
    return overall_loss * router.num_experts


class Capture:
    """While open, records what the router modules of one decoder layer return (their
    logits, as transformers' output recorder takes them) in the order they run."""

    def __init__(self, layer: nn.Module, paths: tuple[str, ...], index: int) -> None:
        self.layer, self.paths, self.index = layer, paths, index
        self.logits: list[torch.Tensor] = []
        self._hooks: list[Any] = []

    def __enter__(self) -> Capture:
        self._hooks = [self.layer.get_submodule(p).register_forward_hook(self._record)
                       for p in self.paths]
        return self

    def __exit__(self, *exc: Any) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _record(self, module: nn.Module, args: Any, output: Any) -> None:
        if not isinstance(output, tuple):
            self.logits.append(output)
        elif output[self.index] is not None:
            self.logits.append(output[self.index])

    def into(self, partial: dict[str, Any], router: RouterAux) -> dict[str, Any]:
        """``partial`` plus every logits tensor recorded."""
        for logits in self.logits:
            partial = accumulate(partial, logits, router)
        return partial


def find_router_aux(model: nn.Module, base: str, layers: str, num_layers: int
                    ) -> RouterAux | None:
    """The model's router auxiliary loss, or ``None`` when its forward adds none
    (``output_router_logits`` off, or a family whose forward computes no such loss).

    :param model: the ``*ForCausalLM`` (any device, meta included).
    :param base: the base model's path; :param layers: the decoder layers' path;
        :param num_layers: how many there are.
    :raises ConfigError: the forward adds a router loss this module does not reproduce,
        naming the family and what differs.
    """
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(text, "output_router_logits", False):
        return None
    name = type(model).__name__
    call, coef = _parse_forward(model)
    if call is None:
        return None  # e.g. DeepseekV3ForCausalLM: its loss is the causal-LM loss alone
    num_experts, top_k, masked = _call_arguments(model, call)
    index, routers = _find_routers(model, base, layers, num_layers)
    router = RouterAux(num_experts=num_experts, top_k=top_k, coef=coef, masked=masked,
                       index=index, routers=routers)
    _check_formula(_resolve(model), router, name)
    return router


def _refuse(model: nn.Module, what: str) -> ConfigError:
    return ConfigError(f"{type(model).__name__} has output_router_logits=True and its forward "
                       f"adds a router auxiliary loss that pipekernel.hf does not reproduce: "
                       f"{what}", hint=_HINT)


def _parse_forward(model: nn.Module) -> tuple[ast.Call | None, float]:
    """The forward's ``load_balancing_loss_func(...)`` call and the factor it adds the
    value with (``loss += coef * aux_loss``); ``(None, 0.0)`` when it adds none."""
    try:
        source = textwrap.dedent(inspect.getsource(type(model).forward))
    except (OSError, TypeError):
        raise _refuse(model, "the source of its forward is not available") from None
    tree = ast.parse(source)
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _name(n.func) == _FUNCTION]
    if not calls:
        if "aux_loss" in source:
            raise _refuse(model, f"its forward computes an aux_loss without {_FUNCTION}")
        return None, 0.0
    if len(calls) > 1:
        raise _refuse(model, f"its forward calls {_FUNCTION} {len(calls)} times")
    factors = [_factor(n.value) for n in ast.walk(tree)
               if isinstance(n, ast.AugAssign) and isinstance(n.op, ast.Add)
               and isinstance(n.target, ast.Name) and n.target.id == "loss"
               and _mentions(n.value, "aux_loss")]
    if len(factors) != 1 or factors[0] is None:
        raise _refuse(model, "its forward does not add it as loss += coef * aux_loss")
    coef = _evaluate(model, factors[0])
    if not isinstance(coef, (int, float)) or isinstance(coef, bool):
        raise _refuse(model, f"its coefficient is {coef!r}, not a number")
    return calls[0], float(coef)


def _call_arguments(model: nn.Module, call: ast.Call) -> tuple[int, int, bool]:
    """``(E, k, masked)`` from the forward's call, bound to the function's signature."""
    fn = _resolve(model)
    params = list(inspect.signature(fn).parameters.values())
    if [p.name for p in params] != ["gate_logits", "num_experts", "top_k", "attention_mask"] \
            or len(call.args) > 4:
        raise _refuse(model, f"its {_FUNCTION} takes ({', '.join(p.name for p in params)}), "
                             "not (gate_logits, num_experts, top_k, attention_mask)")
    bound = dict(zip([p.name for p in params], call.args))
    bound.update({k.arg: k.value for k in call.keywords if k.arg})
    logits = bound.get("gate_logits")
    if not (isinstance(logits, ast.Attribute) and logits.attr == "router_logits"):
        raise _refuse(model, f"its {_FUNCTION} is not given the base model's router_logits")
    values = {}
    for key in ("num_experts", "top_k"):
        node = bound.get(key)
        value = params[1 if key == "num_experts" else 2].default if node is None \
            else _evaluate(model, node)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise _refuse(model, f"its {key} argument is {value!r}, not a positive int")
        values[key] = value
    mask = bound.get("attention_mask")
    masked = isinstance(mask, ast.Name) and mask.id == "attention_mask"
    if not (masked or mask is None or (isinstance(mask, ast.Constant) and mask.value is None)):
        raise _refuse(model, f"its attention_mask argument is {ast.unparse(mask)!r}")
    return values["num_experts"], values["top_k"], masked


def _resolve(model: nn.Module) -> Callable:
    fn = getattr(inspect.unwrap(type(model).forward), "__globals__", {}).get(_FUNCTION)
    if not callable(fn):
        raise _refuse(model, f"{_FUNCTION} is not found in its module")
    return fn


def _name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    return node.attr if isinstance(node, ast.Attribute) else None


def _mentions(node: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(node))


def _factor(node: ast.AST) -> ast.AST | None:
    """``coef`` of ``coef * <aux_loss ...>`` (either side)."""
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)):
        return None
    left, right = node.left, node.right
    if _mentions(right, "aux_loss") and not _mentions(left, "aux_loss"):
        return left
    if _mentions(left, "aux_loss") and not _mentions(right, "aux_loss"):
        return right
    return None


def _evaluate(model: nn.Module, node: ast.AST) -> Any:
    """A constant, or an attribute chain on ``self`` (``self.config.router_aux_loss_coef``)
    read from ``model``; anything else is refused."""
    if isinstance(node, ast.Constant):
        return node.value
    chain, root = [], node
    while isinstance(root, ast.Attribute):
        chain.append(root.attr)
        root = root.value
    if not (isinstance(root, ast.Name) and root.id == "self" and chain):
        raise _refuse(model, f"a value of its router loss is {ast.unparse(node)!r}, not an "
                             "attribute of the model")
    value: Any = model
    for attr in reversed(chain):
        value = getattr(value, attr, None)
    return value


def _recorder_specs(module: nn.Module) -> list[Any]:
    """The ``router_logits`` entries of ``module``'s ``_can_record_outputs``, normalised as
    transformers normalises them (a class or a class-name suffix: output 1)."""
    declared = (getattr(module, "_can_record_outputs", None) or {}).get("router_logits")
    if declared is None:
        return []
    specs = []
    for spec in declared if isinstance(declared, list) else [declared]:
        if hasattr(spec, "target_class") and hasattr(spec, "index"):
            specs.append(spec)
        else:
            specs.append(_Spec(target_class=None if isinstance(spec, str) else spec,
                               class_name=spec if isinstance(spec, str) else None))
    return specs


@dataclass(frozen=True)
class _Spec:
    target_class: Any = None
    index: int = 1
    layer_name: str | None = None
    class_name: str | None = None


def _matches(spec: Any, module: nn.Module, name: str) -> bool:
    """transformers' rule (``recursively_install_hooks``): the class, or the name's suffix,
    then the layer name if given; ``name`` as it builds them (``".layers.0.mlp.gate"``)."""
    by_class = spec.target_class is not None and isinstance(module, spec.target_class)
    by_name = spec.class_name is not None and name.endswith(spec.class_name)
    if not (by_class or by_name):
        return False
    layer = getattr(spec, "layer_name", None)
    return layer is None or f".{layer.strip('.')}." in name + "."


def _find_routers(model: nn.Module, base: str, layers: str, num_layers: int
                  ) -> tuple[int, tuple[tuple[str, ...], ...]]:
    """``(output index, per decoder layer the paths of its router modules)``: the modules
    transformers records ``router_logits`` from, every one inside a decoder layer."""
    root = model.get_submodule(base) if base else model
    specs = _recorder_specs(root) or _recorder_specs(model)
    if not specs:
        raise _refuse(model, "transformers declares no module it records router_logits from "
                             "(_can_record_outputs) for it")
    key = layers[len(base) + 1:] if base else layers
    found: list[list[str]] = [[] for _ in range(num_layers)]
    indices, outside = set(), []
    for name, module in root.named_modules():
        hit = next((s for s in specs if _matches(s, module, "." + name if name else "")), None)
        if hit is None:
            continue
        indices.add(hit.index)
        head, _, rest = name[len(key) + 1:].partition(".") if name.startswith(key + ".") \
            else ("", "", "")
        if head.isdigit() and rest and int(head) < num_layers:
            found[int(head)].append(rest)
        else:
            outside.append(name)
    if outside or len(indices) != 1 or not any(found):
        what = (f"router modules outside the decoder layers ({', '.join(map(repr, outside))})"
                if outside else "no router module in its decoder layers" if not any(found)
                else "router modules whose logits are different outputs")
        raise _refuse(model, what)
    return indices.pop(), tuple(tuple(paths) for paths in found)


def _check_formula(fn: Callable, router: RouterAux, name: str) -> None:
    """The family's ``load_balancing_loss_func`` equals the reproduction here on random
    logits of three layers, with a padding mask and without."""
    g = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(6, router.num_experts, generator=g) for _ in range(3))
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    for given in (mask, None):
        try:
            theirs = float(fn(logits, router.num_experts, router.top_k, given))
        except Exception as e:  # noqa: BLE001 - any failure: not the formula reproduced
            raise ConfigError(f"{name}'s {_FUNCTION} fails on random router logits "
                              f"({type(e).__name__}: {e})"[:300], hint=_HINT) from e
        partial = start({"attention_mask": given}, torch.device("cpu"))
        for layer in logits:
            partial = accumulate(partial, layer, router)
        ours = float(aux_value(partial, router))
        if abs(ours - theirs) > 1e-5 * max(1.0, abs(theirs)):
            raise ConfigError(f"{name}'s {_FUNCTION} gives {theirs:.6g} on random router "
                              f"logits where transformers' formula pipekernel.hf reproduces "
                              f"gives {ours:.6g}", hint=_HINT)


def routed(router: RouterAux | None, j: int, layer: nn.Module, partial: dict[str, Any] | None,
           run: Callable[[], Any]) -> tuple[Any, dict[str, Any] | None]:
    """``run()`` (decoder layer ``j``'s forward) with its router modules recorded:
    ``(what run returned, partial plus this layer's share)``; no router aux: ``partial``."""
    if router is None or partial is None:
        return run(), partial
    with Capture(layer, router.routers[j], router.index) as capture:
        out = run()
    return out, capture.into(partial, router)
