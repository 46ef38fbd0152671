"""DeepSpeed's JSON config, read and checked: what each key means in pipekernel.

:func:`parse` turns the config (a dict or a JSON file path) into a :class:`Settings`.
Every key is either implemented (mapped to a pipekernel setting below), accepted because
it changes nothing in pipekernel (disabled, at its default or about performance only:
:mod:`.config_keys`, logged once), or refused by name: an unknown or unimplemented key raises :class:`~pipekernel.errors.ConfigError`
(``unsupported="warn"``: a warning instead, and the key has no effect, unless dropping
it would change what a batch is: then it stays an error). Nothing is silently ignored.

The batch-size arithmetic is DeepSpeed's own (``deepspeed/runtime/config.py``,
``_set_batch_related_parameters`` / ``_batch_assertion``), with its messages, where the
"world size" is the data-parallel size (``world // num_stages``, as DeepSpeed's pipeline
engine passes its grid as ``mpu``). Defaults are DeepSpeed 0.19's, e.g. a missing
``gradient_clipping`` means clipping at 1.0 (``GRADIENT_CLIPPING_DEFAULT``).
"""
from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

from pipekernel.errors import ConfigError

from . import config_keys

__all__ = ["Settings", "parse", "load_config", "batch_sizes", "check_partitioned", "SUPPORTED_KEYS"]

#: DeepSpeed's default when ``gradient_clipping`` is absent (runtime/constants.py).
GRADIENT_CLIPPING_DEFAULT = 1.0

#: Top-level keys pipekernel implements; nested sections are checked by their own parser.
SUPPORTED_KEYS = (
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "optimizer", "scheduler", "fp16", "bf16", "bfloat16", "gradient_clipping",
    "steps_per_print", "wall_clock_breakdown", "zero_optimization", "pipeline",
    "dataloader_drop_last", "pipekernel_trust_checkpoints",
)
_FP16_KEYS = ("enabled", "loss_scale", "initial_scale_power", "loss_scale_window",
              "hysteresis", "min_loss_scale")
_PIPELINE_DEFAULTS = {"stages": "auto", "partition": "best", "seed_layers": False,
                      "activation_checkpoint_interval": 0, "pipe_partitioned": True,
                      "grad_partitioned": True, "use_reentrant": True}


@dataclass
class Settings:
    """What a DeepSpeed config asks of pipekernel (the engine facade reads only this).

    :ivar micro_batches: ``gradient_accumulation_steps``: micro-batches per ``train_batch``.
    :ivar precision: ``"fp32"``, ``"fp16"`` or ``"bf16"``; ``precision_options`` the fp16
        loss scaling as :class:`pipekernel.plugins.precision.LossScaler` options.
    :ivar max_grad_norm: ``gradient_clipping`` (``None``: ``0``, DeepSpeed's "off").
    :ivar trust_checkpoints: ``pipekernel_trust_checkpoints`` (pipekernel's own key,
        default false): ``load_checkpoint`` unpickles checkpoint files fully instead of as
        data only (docs/checkpoints.md). Only for checkpoints from a source you trust.
    """

    train_batch_size: int
    micro_batch_size: int
    micro_batches: int
    optimizer: dict | None = None
    scheduler: dict | None = None
    precision: str = "fp32"
    precision_options: dict = field(default_factory=dict)
    max_grad_norm: float | None = GRADIENT_CLIPPING_DEFAULT
    steps_per_print: int | None = None
    wall_clock_breakdown: bool = False
    zero_stage: int = 0
    activation_checkpoint_interval: int | None = None
    #: ``pipeline.pipe_partitioned`` as written (``None``: absent; see :func:`check_partitioned`)
    pipe_partitioned: bool | None = None
    drop_last: bool = False
    trust_checkpoints: bool = False
    raw: dict = field(default_factory=dict)


def load_config(config: Any) -> dict:
    """The config as a dict: a dict is copied, a path is read as JSON."""
    if config is None:
        raise ConfigError("no DeepSpeed config given",
                          hint="pass initialize(..., config={...}) or config='ds_config.json'")
    if isinstance(config, dict):
        return json.loads(json.dumps(config))  # a deep copy; also rejects non-JSON values
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config) as f:
                return json.load(f)
        except OSError as err:
            raise ConfigError(f"cannot read the DeepSpeed config {os.fspath(config)!r}: {err}",
                              hint="pass the path of a JSON file or a dict") from err
        except json.JSONDecodeError as err:
            raise ConfigError(f"the DeepSpeed config {os.fspath(config)!r} is not valid JSON: "
                              f"{err}",
                              hint="fix the file at the place the JSON error names (a trailing "
                                   "comma, a missing quote)") from err
    raise ConfigError(f"config must be a dict or a JSON file path, got {type(config).__name__}",
                      hint="pass config={...} or config='ds_config.json'")


def batch_sizes(config: dict, world_size: int) -> tuple[int, int, int]:
    """``(train_batch_size, micro_batch_per_gpu, gradient_accumulation_steps)`` filled in
    as DeepSpeed does, with ``world_size`` the data-parallel size.

    :raises ConfigError: with DeepSpeed's message when they disagree or are missing.
    """
    train = config.get("train_batch_size")
    micro = config.get("train_micro_batch_size_per_gpu")
    acc = config.get("gradient_accumulation_steps")
    for key, value in (("train_batch_size", train), ("train_micro_batch_size_per_gpu", micro),
                       ("gradient_accumulation_steps", acc)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ConfigError(f"{key} must be an int, got {value!r}",
                              hint="give train_batch_size, train_micro_batch_size_per_gpu and "
                                   "gradient_accumulation_steps as ints")
    if train is not None and micro is not None and acc is not None:
        pass
    elif train is not None and micro is not None:
        acc = train // micro // world_size
    elif train is not None and acc is not None:
        micro = train // world_size // acc
    elif micro is not None and acc is not None:
        train = micro * acc * world_size
    elif train is not None:
        acc, micro = 1, train // world_size
    elif micro is not None:
        train, acc = micro * world_size, 1
    else:
        raise ConfigError("Either train_batch_size or train_micro_batch_size_per_gpu needs to "
                          "be provided", hint="e.g. \"train_micro_batch_size_per_gpu\": 4")
    checks = ((train > 0, f"Train batch size: {train} has to be greater than 0"),
              (micro > 0, f"Micro batch size per gpu: {micro} has to be greater than 0"),
              (acc > 0, f"Gradient accumulation steps: {acc} has to be greater than 0"),
              (train == micro * acc * world_size,
               "Check batch related parameters. train_batch_size is not equal to "
               "micro_batch_per_gpu * gradient_acc_step * world_size "
               f"{train} != {micro} * {acc} * {world_size}"))
    for ok, message in checks:
        if not ok:
            raise ConfigError(message, hint=f"world_size is the data-parallel size "
                                            f"({world_size}: processes // pipeline stages)")
    return train, micro, acc


class _Refusals:
    """Collects unimplemented keys; raises once naming all of them (or warns). A key whose
    loss would change what one batch is is refused even with ``unsupported='warn'``."""

    def __init__(self, mode: str) -> None:
        if mode not in ("error", "warn"):
            raise ConfigError(f"unsupported must be 'error' or 'warn', got {mode!r}",
                              hint="pass unsupported='error' (refuse unimplemented keys) or "
                                   "'warn'")
        self.mode, self.keys = mode, []
        self.batch: list[str] = []

    def add(self, key: str, why: str = "not implemented by pipekernel.deepspeed") -> None:
        self.keys.append(f"{key!r} ({why})")
        batch = config_keys.changes_batch(key)
        if batch is not None:
            self.batch.append(f"{key!r}: {batch}")

    def batch_first(self) -> None:
        """Before the batch arithmetic: a refused key about the batch (a typo of one
        included) would make its result, or its error, about another batch."""
        if self.batch:
            self.mode = "error"
            self.done()

    def done(self) -> None:
        if not self.keys:
            return
        text = "DeepSpeed config keys pipekernel does not implement: " + "; ".join(self.keys)
        if self.mode == "warn" and not self.batch:
            warnings.warn(text + " -- they have no effect", stacklevel=3)
            return
        hint = ("fix or remove them, or pass initialize(..., unsupported='warn') to run "
                "without them (see docs/deepspeed.md for the keys implemented)")
        if self.batch:
            text += (" -- unsupported='warn' does not drop these: without them a batch would "
                     "not be what the config says (" + "; ".join(self.batch) + ")")
            hint = ("fix or remove them; " + ("unsupported='warn' drops only the others"
                                               if len(self.batch) < len(self.keys) else
                                               "see docs/deepspeed.md for the keys implemented"))
        raise ConfigError(text, hint=hint)


def parse(config: Any, *, world_size: int, num_stages: int,
          unsupported: str = "error") -> Settings:
    """Read a DeepSpeed config for ``world_size`` processes in ``num_stages`` stages.

    :raises ConfigError: an unimplemented key (named; all of them at once), a bad value,
        or batch sizes that disagree (DeepSpeed's message).
    """
    raw = load_config(config)
    refusals = _Refusals(unsupported)
    for key in raw:
        if key not in SUPPORTED_KEYS:
            reason = config_keys.check_top_level(key, raw[key], SUPPORTED_KEYS)
            if reason is not None:
                refusals.add(key, reason)
    refusals.batch_first()
    if world_size % num_stages:
        raise ConfigError(f"num_stages ({num_stages}) must divide distributed world size "
                          f"({world_size})",
                          hint="start a multiple of num_stages processes, or pick num_stages "
                               "dividing the world size")
    train, micro, acc = batch_sizes(raw, world_size // num_stages)
    settings = Settings(train_batch_size=train, micro_batch_size=micro, micro_batches=acc,
                        raw=raw)
    settings.optimizer = _section(raw, "optimizer", ("type", "params"), refusals)
    settings.scheduler = _section(raw, "scheduler", ("type", "params"), refusals)
    _precision(raw, settings, refusals)
    clip = raw.get("gradient_clipping", GRADIENT_CLIPPING_DEFAULT)
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0:
        raise ConfigError(f"gradient_clipping must be a number >= 0, got {clip!r}",
                          hint='set "gradient_clipping" to a number, e.g. 1.0 (0: no clipping)')
    settings.max_grad_norm = float(clip) if clip > 0 else None
    steps = raw.get("steps_per_print")
    if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 1):
        raise ConfigError(f"steps_per_print must be a positive int or null, got {steps!r}",
                          hint='set "steps_per_print" to an int >= 1, or null')
    settings.steps_per_print = steps
    settings.wall_clock_breakdown = _flag(raw, "wall_clock_breakdown", False)
    settings.drop_last = _flag(raw, "dataloader_drop_last", False)
    settings.trust_checkpoints = _flag(raw, "pipekernel_trust_checkpoints", False)
    _zero(raw, settings, refusals)
    _pipeline(raw, settings, refusals, num_stages)
    refusals.done()
    return settings


def _flag(section: dict, key: str, default: bool, where: str = "") -> bool:
    value = section.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{where}{key} must be true or false, got {value!r}",
                          hint="write true or false (JSON booleans), not a string or a number")
    return value


def _section(raw: dict, name: str, keys: tuple[str, ...], refusals: _Refusals) -> dict | None:
    section = raw.get(name)
    if section is None:
        return None
    if not isinstance(section, dict) or "type" not in section:
        raise ConfigError(f"{name} must be an object with a \"type\", got {section!r}",
                          hint=f'e.g. "{name}": {{"type": ..., "params": {{...}}}}')
    for key in section:
        if key not in keys:
            refusals.add(f"{name}.{key}", config_keys.unknown(key, keys))
    params = section.get("params", {})
    if not isinstance(params, dict):
        raise ConfigError(f"{name}.params must be an object, got {params!r}",
                          hint='write "params": {...} with the settings as keys')
    return {"type": section["type"], "params": dict(params)}


def _precision(raw: dict, settings: Settings, refusals: _Refusals) -> None:
    fp16 = raw.get("fp16", {})
    bf16 = raw.get("bf16", raw.get("bfloat16", {}))
    for name, section in (("fp16", fp16), ("bf16", bf16)):
        if not isinstance(section, dict):
            raise ConfigError(f"{name} must be an object, got {section!r}",
                              hint='write the section as an object, e.g. "fp16": {"enabled": '
                                   "true}")
    for name, section, known in (("fp16", fp16, _FP16_KEYS), ("bf16", bf16, ("enabled",))):
        for key in section:
            if key not in known:
                reason = config_keys.check_precision_key(name, key, section[key], known)
                if reason is not None:
                    refusals.add(f"{name}.{key}", reason)
    fp16_on = _flag(fp16, "enabled", False, "fp16.")
    bf16_on = _flag(bf16, "enabled", False, "bf16.")
    if fp16_on and bf16_on:
        raise ConfigError("fp16 and bf16 are both enabled", hint="enable one of them")
    if bf16_on:
        settings.precision = "bf16"
    if fp16_on:
        settings.precision, settings.precision_options = "fp16", _loss_scaling(fp16)


def _loss_scaling(fp16: dict) -> dict:
    """DeepSpeed's fp16 keys as :class:`~pipekernel.plugins.precision.LossScaler` options:
    ``loss_scale`` 0 is dynamic from ``2 ** initial_scale_power`` (x2 after
    ``loss_scale_window`` clean steps, /2 after ``hysteresis`` overflows, floor
    ``min_loss_scale``); ``loss_scale`` > 0 is that fixed scale (overflows skip the step)."""
    scale = fp16.get("loss_scale", 0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale < 0:
        raise ConfigError(f"fp16.loss_scale must be a number >= 0, got {scale!r}",
                          hint='set "loss_scale" to 0 (dynamic) or a positive static scale')
    if scale > 0:  # static: no growth in practice, the floor pins it on overflow
        return {"init_scale": float(scale), "min_scale": float(scale),
                "growth_interval": 2 ** 62, "hysteresis": 1}
    return {"init_scale": 2.0 ** fp16.get("initial_scale_power", 16), "growth_factor": 2.0,
            "backoff_factor": 0.5, "growth_interval": fp16.get("loss_scale_window", 1000),
            "hysteresis": fp16.get("hysteresis", 2),
            "min_scale": float(fp16.get("min_loss_scale", 1))}


def _zero(raw: dict, settings: Settings, refusals: _Refusals) -> None:
    zero = raw.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigError(f"zero_optimization must be an object, got {zero!r}",
                          hint='write "zero_optimization": {"stage": 0 or 1}')
    for key in zero:
        if key != "stage":
            reason = config_keys.check_zero_key(key, zero[key])
            if reason is not None:
                refusals.add(f"zero_optimization.{key}", reason)
    stage = zero.get("stage", 0)
    if stage not in (0, 1) or isinstance(stage, bool):
        raise ConfigError(f"zero_optimization.stage {stage!r} is not supported with pipeline "
                          "parallelism", hint="use stage 0 or 1 (DeepSpeed's pipeline engine "
                                              "refuses ZeRO-2 and ZeRO-3 too)")
    settings.zero_stage = stage


def check_partitioned(settings: Settings, tensor_parallel_size: int) -> None:
    """``ConfigError`` for ``pipeline.pipe_partitioned``/``grad_partitioned`` written ``true``
    with tensor parallelism: DeepSpeed sends ``1/T`` of each activation between stages
    then; pipekernel's tensor parallelism (torch's DTensor) sends whole tensors, and its
    own partitioned activations are retired. (Without tensor parallelism DeepSpeed's
    switches change nothing, and neither do they here.)"""
    if settings.pipe_partitioned and tensor_parallel_size > 1:
        raise ConfigError(f"pipeline.pipe_partitioned/grad_partitioned is true with "
                          f"tensor_parallel_size={tensor_parallel_size}: pipekernel sends "
                          f"whole activations between stages under tensor parallelism "
                          f"(torch's DTensor; partitioned activations are retired)",
                          hint='write "pipe_partitioned": false and "grad_partitioned": '
                               'false (docs/parallelism.md, "Migrating from the retired '
                               'tensor-parallel layers")')


def _pipeline(raw: dict, settings: Settings, refusals: _Refusals, num_stages: int) -> None:
    """``pipeline``: ``activation_checkpoint_interval`` (overrides the module's),
    ``pipe_partitioned``/``grad_partitioned`` (booleans; nothing is partitioned between
    stages, see :func:`check_partitioned`), ``use_reentrant`` (either way:
    pipekernel recomputes non-reentrantly, the same values); ``stages``/``partition``/
    ``seed_layers`` (unused by DeepSpeed's engine) only at their defaults or consistent."""
    section = raw.get("pipeline", {})
    if not isinstance(section, dict):
        raise ConfigError(f"pipeline must be an object, got {section!r}",
                          hint='write "pipeline": {...} with its settings as keys')
    for key in section:
        if key not in _PIPELINE_DEFAULTS:
            refusals.add(f"pipeline.{key}", config_keys.unknown(key, _PIPELINE_DEFAULTS))
    interval = section.get("activation_checkpoint_interval")
    if interval is not None:
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 0:
            raise ConfigError("pipeline.activation_checkpoint_interval must be an int >= 0, "
                              f"got {interval!r}",
                              hint='set "activation_checkpoint_interval" to 0 (off) or N >= 1 '
                                   "layers per checkpoint")
        settings.activation_checkpoint_interval = interval or None
    pipe = _flag(section, "pipe_partitioned", True, "pipeline.")
    grad = _flag(section, "grad_partitioned", True, "pipeline.")
    if "pipe_partitioned" in section or "grad_partitioned" in section:
        settings.pipe_partitioned = pipe or grad
    _flag(section, "use_reentrant", True, "pipeline.")
    _flag(section, "seed_layers", False, "pipeline.")
    stages = section.get("stages", "auto")
    if stages not in ("auto", num_stages):
        raise ConfigError(f"pipeline.stages is {stages!r} and the PipelineModule has "
                          f"{num_stages} stages", hint='remove it or use "auto"')
    if section.get("seed_layers", False) or section.get("partition", "best") != "best":
        refusals.add("pipeline.seed_layers/partition", "DeepSpeed's engine does not read "
                     "them either: pass seed_layers= / partition_method= to PipelineModule")
