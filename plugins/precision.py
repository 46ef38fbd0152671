"""Built-in precision policy ``fp32``: parameters, activations and gradients in float32."""
from __future__ import annotations

from typing import Any

import torch

from pipekernel.hookspecs import hookimpl


class FP32:
    """The identity policy: no casts, no loss scaling, every step taken."""

    name = "fp32"

    def prepare(self, module: torch.nn.Module) -> None:
        """Cast the stage's parameters (fp32: nothing to do)."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def step(self, optimizer: torch.optim.Optimizer, runtime: Any) -> bool:
        """Step the optimizer; return ``False`` if the step was skipped."""
        optimizer.step()
        return True

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


@hookimpl(trylast=True)
def pipekernel_make_precision(name: str, options: dict[str, Any]) -> Any:
    return FP32(**options) if name == "fp32" else None


@hookimpl(trylast=True)
def pipekernel_list_names(kind: str) -> list[str]:
    return ["fp32"] if kind == "precision" else []
