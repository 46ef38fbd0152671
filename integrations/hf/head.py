"""The output projection and whatever the model does after it, by the model's own code.

A ``*ForCausalLM.forward`` calls its base model, projects the last hidden state with its
``lm_head`` and may do more before the loss: Gemma 2 soft-caps the logits
(``final_logit_softcapping``), Cohere multiplies them by ``logit_scale``. Rather than
re-implementing that per family, the last pipeline layer calls that very ``forward`` on a
shallow copy of the model whose base model is a stub returning the hidden state the
pipeline computed, and whose ``lm_head`` is the stage's own projection (or the tied input
embeddings' weight): the logits are the model's, whatever its forward does to them.
"""
from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipekernel.errors import ConfigError
from pipekernel.stage.sequence import sequence_chunk

from pipekernel.hf.layers import Mirror

__all__ = ["Head", "TiedHead", "head_shell"]


class _Hidden(nn.Module):
    """Stands in for the base model (``base``, never called): returns the hidden state the
    pipeline handed over; the head's forward may read the base model's attributes (Falcon-H1's
    ``lm_head_multiplier``): they are the base model's."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.value: torch.Tensor | None = None
        self.__dict__["base"] = base

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["base"], name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.value is None:
            raise ConfigError("the model's forward called its base model twice",
                              hint="write the model as LayerSpecs")
        value, self.value = self.value, None
        return _Output(value)


class _Output:
    """The base model's output as the head's forward reads it: the last hidden state, first
    and as ``last_hidden_state``; every other field (caches, attentions, router logits) None."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.last_hidden_state = hidden

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return None

    def __getitem__(self, index: Any) -> Any:
        if index == "last_hidden_state":
            return self.last_hidden_state
        return (self.last_hidden_state,)[index]

    def __len__(self) -> int:
        return 1

    def __iter__(self) -> Any:
        return iter((self.last_hidden_state,))

    def to_tuple(self) -> tuple:
        return (self.last_hidden_state,)


class _TiedProjection(nn.Module):
    """``lm_head`` as the input embeddings' weight (tied embeddings), not registered twice."""

    def __init__(self, embeddings: nn.Module) -> None:
        super().__init__()
        self.__dict__["embeddings"] = embeddings

    @property
    def weight(self) -> torch.Tensor:
        return self.embeddings.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.embeddings.weight)


def _shallow(module: nn.Module) -> nn.Module:
    out = copy.copy(module)
    out._modules = dict(module._modules)
    return out


def head_shell(model: nn.Module, base: str, lm_head: str, projection: nn.Module
               ) -> tuple[nn.Module, _Hidden]:
    """A shallow copy of ``model`` whose module at ``base`` is a :class:`_Hidden` stub and
    whose ``lm_head`` is ``projection``; the original is untouched."""
    shell, stub = _shallow(model), _Hidden(model.get_submodule(base))
    for path, module in ((base, stub), (lm_head, projection)):
        *parents, name = path.split(".")
        node = shell
        for part in parents:
            node._modules[part] = node = _shallow(node._modules[part])
        node._modules[name] = module
    return shell, stub


def run_head(shell: nn.Module, stub: _Hidden, hidden: torch.Tensor, training: bool
             ) -> torch.Tensor:
    """The logits ``shell``'s own forward computes from the last hidden state."""
    sequence_chunk()  # position-wise: runs on sequence chunks as on whole sequences
    shell.training = training
    stub.value = hidden
    options = shell.__dict__.get("_head_options")
    if options is None:  # once per shell: no cache
        takes = "use_cache" in inspect.signature(shell.forward).parameters
        options = shell.__dict__["_head_options"] = {"use_cache": False} if takes else {}
    try:
        out = shell(inputs_embeds=hidden, **options)
    finally:
        stub.value = None
    return out.logits if hasattr(out, "logits") else out[0]


class Head(Mirror):
    """The output projection (untied) at its Hugging Face path, run by the model's forward.

    :param model: the ``*ForCausalLM`` model (any device: only its ``forward`` runs).
    :param base: the base model's path; :param path: the projection's path.
    :param module: the materialised projection.
    """

    def __init__(self, model: nn.Module, base: str, path: str, module: nn.Module) -> None:
        super().__init__({path: module})
        self.__dict__["shell"], self.__dict__["stub"] = head_shell(model, base, path, module)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return run_head(self.shell, self.stub, hidden, self.training)


class TiedHead:
    """The ``forward_fn`` of the tied embeddings at the pipeline's end: the model's own head
    forward with ``lm_head`` the embeddings' weight (one shell per layer object)."""

    def __init__(self, model: nn.Module, base: str, lm_head: str) -> None:
        self.model, self.base, self.lm_head = model, base, lm_head

    def __call__(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        shells = layer.__dict__.setdefault("_head_shell", {})
        if not shells:
            shells["shell"], shells["stub"] = head_shell(
                self.model, self.base, self.lm_head, _TiedProjection(layer.target))
        return run_head(shells["shell"], shells["stub"], hidden, layer.training)
