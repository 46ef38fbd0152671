"""Built-in precision policies: ``fp32``, ``bf16``, ``fp16`` and ``amp-bf16``.

* ``fp32``: everything in float32 (the identity policy).
* ``bf16`` / ``fp16``: the stage's parameters, float buffers and activations
  in the low dtype (integer and bool buffers unchanged), so activations and gradients cross stage boundaries at half the bytes;
  fp32 **master weights** that the optimizer steps (its state is fp32 too);
  gradients moved into fp32 accumulators after every micro-batch, so summing
  many micro-batches loses nothing to low-precision addition; the loss is
  computed in fp32. ``fp16`` adds **dynamic loss scaling** (:class:`LossScaler`).
* ``amp-bf16``: fp32 parameters and gradients, the stage's forward under
  ``torch.autocast(dtype=torch.bfloat16)``; activations cross in bf16.

See ``docs/precision.md`` for when to choose which.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from pipekernel.errors import ConfigError
from pipekernel.plugin import Precision, cast_floats, find_stage_parallel, hookimpl

__all__ = ["FP32", "LowPrecision", "FP16", "AmpBF16", "LossScaler"]


class FP32(Precision):
    """The identity policy: no casts, no loss scaling, every step taken."""

    name = "fp32"


class LowPrecision(Precision):
    """Parameters and activations in ``dtype`` with fp32 master weights and fp32
    gradient accumulation (the ``bf16`` policy; ``fp16`` adds loss scaling).

    :param dtype: ``torch.bfloat16`` or ``torch.float16``.

    Subclasses may override :meth:`keeps_fp32` to leave some modules in fp32
    (their parameters are then their own masters).
    """

    name = "bf16"

    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        self.dtype = dtype
        self._masters: dict[int, torch.nn.Parameter] = {}   # id(module param) -> fp32 master
        self._pairs: list[tuple[str, torch.nn.Parameter, torch.nn.Parameter]] = []

    def keeps_fp32(self, name: str, module: torch.nn.Module) -> bool:
        """``True`` to keep submodule ``name`` (its own parameters) in fp32."""
        return False

    def prepare(self, module: torch.nn.Module) -> None:
        keep = {id(p) for name, sub in module.named_modules() if self.keeps_fp32(name, sub)
                for p in sub.parameters(recurse=False)}
        # FSDP2 keeps its fp32 shards as the masters and gathers them in self.dtype itself
        # (pipekernel.plugins.fsdp maps this policy to its MixedPrecisionPolicy)
        sharded = find_stage_parallel(module)
        for name, param in module.named_parameters():
            if not param.is_floating_point() or id(param) in keep or (
                    sharded is not None and sharded.managed(param)):
                continue
            # The master is the fp32 original (not a round trip through the low dtype),
            # so step 0 starts from exactly the reference's weights.
            master = torch.nn.Parameter(param.detach().clone().float(),
                                        requires_grad=param.requires_grad)
            param.data = param.data.to(self.dtype)
            self._masters[id(param)] = master
            self._pairs.append((name, param, master))
        self._cast_buffers(module)

    def _cast_buffers(self, module: torch.nn.Module) -> None:
        """Float buffers (e.g. running statistics, rotary tables) go to ``dtype`` like the
        parameters, so the forward sees one dtype; integer and bool buffers (counters,
        masks, token ids) stay as they are. Buffers of submodules kept in fp32 stay fp32."""
        for name, sub in module.named_modules():
            if self.keeps_fp32(name, sub):
                continue
            for key, buf in sub._buffers.items():
                if buf is not None and buf.is_floating_point() and buf.dtype != self.dtype:
                    sub._buffers[key] = buf.to(self.dtype)

    def optimizer_parameters(self, module: torch.nn.Module) -> list[torch.Tensor]:
        return [self.master(p) for p in module.parameters()]

    def master(self, param: torch.Tensor) -> torch.Tensor:
        return self._masters.get(id(param), param)

    def forward(self, module: torch.nn.Module, inputs: Any, *, first: bool, last: bool) -> Any:
        outputs = module(cast_floats(inputs, self.dtype))
        # Loss in fp32; activations leave in the low dtype (half the bytes on the wire).
        return cast_floats(outputs, torch.float32 if last else self.dtype)

    def after_backward(self, module: torch.nn.Module) -> None:
        sums, grads = [], []  # fp32 accumulation: the sum is done in master's dtype
        for _, param, master in self._pairs:
            grad = param.grad
            if grad is None:
                continue
            if master.grad is None:
                master.grad = grad.float()
            else:
                sums.append(master.grad)
                grads.append(grad)
            param.grad = None
        if sums:
            torch._foreach_add_(sums, grads)  # one call, not one add_ per parameter

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()
        if self._pairs:
            with torch.no_grad():
                torch._foreach_copy_([p for _, p, _ in self._pairs],
                                     [m for _, _, m in self._pairs])

    def state_dict(self) -> dict[str, Any]:
        return {"master_weights": {name: master.detach().clone()
                                   for name, _, master in self._pairs}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        weights = state.get("master_weights", {})
        with torch.no_grad():
            for name, param, master in self._pairs:
                if name in weights:
                    master.copy_(weights[name])
                    param.copy_(master)


class LossScaler:
    """Dynamic loss scale, the rules of ``torch.amp.GradScaler`` plus DeepSpeed's
    ``min_scale`` and ``hysteresis``.

    :param init_scale: the first scale.
    :param growth_factor: multiply the scale by this after ``growth_interval``
        steps in a row without overflow.
    :param backoff_factor: multiply the scale by this on overflow (once
        ``hysteresis`` overflows were seen), never going below ``min_scale``.
    :param growth_interval: clean steps between growths.
    :param min_scale: the floor of the scale.
    :param hysteresis: overflows tolerated before the scale backs off (1: back
        off on every overflow, as GradScaler does). Every overflow skips its step.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 min_scale: float = 1.0, hysteresis: int = 1) -> None:
        given = {"init_scale": init_scale, "growth_factor": growth_factor,
                 "backoff_factor": backoff_factor, "growth_interval": growth_interval,
                 "min_scale": min_scale, "hysteresis": hysteresis}
        checks = {"init_scale": init_scale > 0, "growth_factor": growth_factor > 1,
                  "backoff_factor": 0 < backoff_factor < 1,
                  "growth_interval": isinstance(growth_interval, int) and growth_interval >= 1,
                  "min_scale": 0 < min_scale <= init_scale,
                  "hysteresis": isinstance(hysteresis, int) and hysteresis >= 1}
        bad = [f"{name}={given[name]!r}" for name, ok in checks.items() if not ok]
        if bad:
            raise ConfigError(
                f"invalid fp16 loss-scaling options: {', '.join(bad)}",
                hint="need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, integer "
                     "growth_interval >= 1, 0 < min_scale <= init_scale, integer hysteresis >= 1")
        self.scale, self.growth_factor, self.backoff_factor = float(init_scale), growth_factor, \
            backoff_factor
        self.growth_interval, self.min_scale, self.hysteresis = growth_interval, min_scale, \
            hysteresis
        self.growth_tracker = 0
        self.hysteresis_left = hysteresis

    def update(self, overflow: bool) -> None:
        if overflow:
            self.growth_tracker = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
                self.hysteresis_left = self.hysteresis
            return
        self.growth_tracker += 1
        if self.growth_tracker >= self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0
            self.hysteresis_left = self.hysteresis

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_left": self.hysteresis_left}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_left = int(state.get("hysteresis_left", self.hysteresis))


class FP16(LowPrecision):
    """``bf16``'s scheme in float16 plus dynamic loss scaling.

    Options (``precision_options=``) are those of :class:`LossScaler`.
    """

    name = "fp16"

    def __init__(self, **options: Any) -> None:
        super().__init__(torch.float16)
        self.scaler = LossScaler(**options)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale

    def unscale_(self, params: Iterable[torch.Tensor]) -> bool | torch.Tensor:
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return False
        inv = 1.0 / self.scaler.scale
        bad = []
        for g in grads:
            g.mul_(inv)
            bad.append(~torch.isfinite(g).all())
        return torch.stack(bad).any()  # a device flag: the engine reads it with the step's

    def update(self, skipped: bool) -> None:
        self.scaler.update(skipped)

    def metrics(self) -> dict[str, Any]:
        return {"loss_scale": self.scaler.scale}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])


class AmpBF16(Precision):
    """fp32 parameters, gradients and optimizer; the forward under ``torch.autocast``.

    :param dtype: the autocast dtype (``torch.bfloat16``).
    :param wire_dtype: float dtype of activations sent to the next stage
        (default: ``dtype``; ``torch.float32`` to keep full activations on the wire).
    """

    name = "amp-bf16"

    def __init__(self, dtype: torch.dtype = torch.bfloat16,
                 wire_dtype: torch.dtype | None = None) -> None:
        self.dtype, self.wire_dtype = dtype, wire_dtype or dtype

    def forward(self, module: torch.nn.Module, inputs: Any, *, first: bool, last: bool) -> Any:
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        with torch.autocast(device.type, dtype=self.dtype):
            outputs = module(inputs)
        return cast_floats(outputs, torch.float32 if last else self.wire_dtype)


def _policies() -> dict[str, Callable[..., Precision]]:
    return {"fp32": FP32, "bf16": LowPrecision, "fp16": FP16, "amp-bf16": AmpBF16}


@hookimpl(trylast=True)
def pipekernel_make_precision(name: str, options: dict[str, Any]) -> Any:
    factory = _policies().get(name)
    if factory is None:
        return None
    try:
        return factory(**options)
    except TypeError as err:
        raise ConfigError(f"precision {name!r} does not accept options {sorted(options)}: {err}",
                          hint="see docs/precision.md for each policy's options") from err


@hookimpl(trylast=True)
def pipekernel_list_names(kind: str) -> list[str]:
    return sorted(_policies()) if kind == "precision" else []
