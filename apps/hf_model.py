"""``pipekernel train --hf PATH_OR_CONFIG``: a Hugging Face causal LM instead of the built-in GPT.

``PATH_OR_CONFIG`` is a ``save_pretrained`` directory (its weights, each stage reading its
own tensors), a directory or ``.json`` file holding only a config (random weights), or
the name of a model type (``llama``, ``gpt2``, ``qwen2``, ...): a small random model of
that type sized by ``--dim``, ``--layers``, ``--heads`` and ``--context``. The text is the
same byte stream as the built-in model's, so the vocabulary must hold the 256 byte values.
"""
from __future__ import annotations

import os
from typing import Any

import torch

import pipekernel as pk
from pipekernel.apps.config import TrainConfig, partition_method

__all__ = ["hf_config", "hf_module", "as_dicts", "describe", "save", "TakesIds"]


def hf_config(spec: str, cfg: TrainConfig) -> Any:
    """The ``transformers`` config ``spec`` names (see the module docstring)."""
    from transformers import AutoConfig
    if os.path.isdir(spec) or spec.endswith(".json"):
        if not os.path.exists(spec):
            raise pk.ConfigError(f"--hf {spec}: no such file", hint="pass a directory holding "
                                 "config.json, a config .json file or a model type like llama")
        return AutoConfig.from_pretrained(spec)
    try:
        config = AutoConfig.for_model(spec, vocab_size=256)
    except ValueError as err:
        raise pk.ConfigError(f"--hf {spec}: not a directory, .json file or model type ({err})",
                             hint="e.g. --hf llama, --hf path/to/save_pretrained_dir") from None
    text = config.get_text_config()
    for name, value in (("hidden_size", cfg.dim), ("num_hidden_layers", cfg.layers),
                        ("num_attention_heads", cfg.heads), ("num_key_value_heads", cfg.heads),
                        ("intermediate_size", 4 * cfg.dim),
                        ("max_position_embeddings", cfg.context), ("n_positions", cfg.context)):
        if hasattr(text, name) or name in getattr(text, "attribute_map", {}):
            setattr(text, name, value)
    return config


def hf_module(cfg: TrainConfig) -> pk.PipelineModule:
    """The pipeline of ``--hf``: weights from a checkpoint directory, else random (seeded)."""
    import pipekernel.hf as hf
    spec = cfg.hf
    weights = os.path.isdir(spec) and any(f.startswith("model") and f.endswith(
        (".safetensors", ".safetensors.index.json")) for f in os.listdir(spec))
    config = hf_config(spec, cfg)
    vocab = config.get_text_config().vocab_size
    if vocab < 256:
        raise pk.ConfigError(f"--hf {spec}: a vocabulary of {vocab} cannot hold the 256 byte "
                             "values the training text is made of",
                             hint="use a config with vocab_size >= 256")
    return hf.pipeline_module(spec if weights else config, num_stages=cfg.stages,
                              partition=partition_method(cfg.partition), seed=cfg.seed)


def as_dicts(batch: list[tuple[torch.Tensor, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Byte windows ``(inputs, next bytes)`` as Hugging Face micro-batches: labels are the
    inputs, unshifted (the loss shifts them)."""
    return [{"input_ids": x, "labels": x} for x, _ in batch]


def describe(module: Any, cfg: TrainConfig) -> str:
    """One line naming the model."""
    s = module.structure
    params = sum(module.parameter_counts())
    return (f"model: Hugging Face {module.config.model_type} ({cfg.hf}), {params / 1e6:.2f}M "
            f"parameters: {s.num_layers} decoder layers, "
            f"{'tied' if s.tied else 'untied'} embeddings")


def save(engine: Any, cfg: TrainConfig) -> str:
    """Write the trained model to ``<out>/hf`` (every rank)."""
    import pipekernel.hf as hf
    return hf.save_pretrained(engine, os.path.join(cfg.out, "hf"))


class TakesIds(torch.nn.Module):
    """A whole-model stage called with token ids (as the sampler calls the built-in GPT)."""

    def __init__(self, stage: torch.nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.stage({"input_ids": ids})
