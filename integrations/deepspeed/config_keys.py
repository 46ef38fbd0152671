"""DeepSpeed config keys that change nothing in pipekernel: accepted, and logged once per
process (logger ``pipekernel.deepspeed``), so a real config runs as it is.

A key is accepted when it is **disabled** (a monitor or profiler with ``enabled:
false``), **at its default** (``prescale_gradients: false``), or **about performance
only** (ZeRO bucket sizes and overlap, DeepSpeed's own activation-checkpointing memory
options: pipekernel recomputes with ``torch.utils.checkpoint`` and reduces in its own
buckets, and the numbers do not change). Any other value of these keys is refused by
name with the reason, like every key pipekernel does not implement.
"""
from __future__ import annotations

import difflib
import logging
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["check_top_level", "check_zero_key", "check_precision_key", "note", "unknown",
           "changes_batch", "BATCH_KEYS"]

_log = logging.getLogger("pipekernel.deepspeed")
_noted: set[str] = set()

#: DeepSpeed's ``activation_checkpointing`` section: memory/performance of DeepSpeed's
#: own checkpoint function, which pipekernel does not use.
_ACTIVATION_CHECKPOINTING = ("partition_activations", "contiguous_memory_optimization",
                             "cpu_checkpointing", "number_checkpoints",
                             "synchronize_checkpoint_boundary", "profile")

#: ZeRO keys about buckets, overlap and layout: no effect on the numbers at stage 0/1.
_ZERO_PERFORMANCE = ("reduce_bucket_size", "allgather_bucket_size", "overlap_comm",
                     "contiguous_gradients", "reduce_scatter", "allgather_partitions",
                     "round_robin_gradients", "use_multi_rank_bucket_allreduce",
                     "sub_group_size", "prefetch_bucket_size", "memory_efficient_linear",
                     "log_trace_cache_warnings", "enable_sanity_checks")
#: ZeRO keys accepted at their DeepSpeed default only (else they mean something).
_ZERO_DEFAULTS = {"load_from_fp32_weights": True, "elastic_checkpoint": False,
                  "ignore_unused_parameters": True, "cpu_offload": False,
                  "cpu_offload_param": False, "zero_hpz_partition_size": 1,
                  "zero_quantized_weights": False, "zero_quantized_gradients": False,
                  "zero_quantized_nontrainable_weights": False, "legacy_stage1": False,
                  "parameter_alignment": False, "mics_shard_size": -1}


#: the keys that say what one batch is (DeepSpeed's batch arithmetic)
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu",
              "gradient_accumulation_steps")
#: sections that, enabled, change the batch: its size over time or which samples it holds
_BATCH_SECTIONS = {"elasticity": "it changes the batch size as the world changes",
                   "data_efficiency": "it chooses which samples (and how long) a batch holds",
                   "curriculum_learning": "it changes the sequence length of the batches"}


def unknown(key: str, known: Iterable[str]) -> str:
    """The refusal reason of a key this reader does not know: with the closest key it
    knows when one is close (a typo such as ``train_micro_batch_size_per_gpus``)."""
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.8)
    if close:
        return f"not a key pipekernel.deepspeed knows: did you mean {close[0]!r}?"
    return "not implemented by pipekernel.deepspeed"


def changes_batch(key: str) -> str | None:
    """Why dropping the refused ``key`` (dotted when nested) would change what one batch is
    (a batch-size key, a typo of one, a section that reshapes batches), else ``None``:
    such a key is refused even with ``unsupported='warn'``."""
    top, leaf = key.split(".", 1)[0], key.rsplit(".", 1)[-1]
    if top in _BATCH_SECTIONS:
        return _BATCH_SECTIONS[top]
    if (leaf in BATCH_KEYS or difflib.get_close_matches(leaf, BATCH_KEYS, n=1, cutoff=0.8)
            or "batch" in leaf or "accumulation" in leaf):
        return "it sets the batch size"
    return None


def note(key: str, why: str) -> None:
    """Log once per process that ``key`` is accepted with no effect, and why."""
    if key not in _noted:
        _noted.add(key)
        _log.info("DeepSpeed config key %r accepted with no effect in pipekernel: %s", key, why)


def _disabled(value: Any) -> str | None:
    """A section with ``enabled: false`` (DeepSpeed's default when absent)."""
    if isinstance(value, dict) and not value.get("enabled", False):
        return None
    return "enabled: only a disabled section is accepted"


def _equals(default: Any) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        same = (value is default if isinstance(default, bool)
                else not isinstance(value, bool) and value == default)
        return None if same else f"only its default ({default!r}) is accepted"
    return check


def _activation_checkpointing(value: Any) -> str | None:
    if not isinstance(value, dict):
        return "must be an object"
    unknown = sorted(set(value) - set(_ACTIVATION_CHECKPOINTING))
    return f"unknown key(s) {unknown}" if unknown else None


def _communication_dtype(value: Any) -> str | None:
    if value is None or value in ("fp32", "float32", "float"):
        return None
    return "pipekernel reduces gradients in fp32: only null or \"fp32\" are accepted"


def _bool(value: Any) -> str | None:
    return None if isinstance(value, bool) else "must be true or false"


#: ``{key: (check(value) -> refusal reason or None, why it changes nothing)}``
_TOP_LEVEL: dict[str, tuple[Callable[[Any], str | None], str]] = {
    **{key: (_disabled, "disabled") for key in
       ("tensorboard", "wandb", "csv_monitor", "comet", "flops_profiler", "comms_logger",
        "amp", "elasticity", "compression_training", "autotuning", "nebula")},
    "memory_breakdown": (_equals(False), "disabled"),
    "prescale_gradients": (_equals(False), "at its default"),
    "gradient_predivide_factor": (_equals(1.0), "at its default"),
    "sparse_gradients": (_equals(False), "at its default"),
    "dump_state": (_equals(False), "at its default"),
    "communication_data_type": (_communication_dtype, "pipekernel reduces gradients in fp32 "
                                "(fp32 master gradients under fp16/bf16)"),
    "activation_checkpointing": (_activation_checkpointing, "memory/performance options of "
                                 "DeepSpeed's checkpoint function; pipekernel recomputes "
                                 "with torch.utils.checkpoint (pipeline."
                                 "activation_checkpoint_interval)"),
    "zero_allow_untested_optimizer": (_bool, "pipekernel's ZeRO-1 takes any torch.optim "
                                      "optimizer"),
}


def check_top_level(key: str, value: Any, implemented: Iterable[str] = ()) -> str | None:
    """``None`` when ``key`` is accepted with no effect (noted in the log), else the
    reason it is refused (a key this module does not know: :func:`unknown`, against
    ``implemented`` and the keys accepted here)."""
    if key not in _TOP_LEVEL:
        return unknown(key, [*implemented, *_TOP_LEVEL])
    check, why = _TOP_LEVEL[key]
    refusal = check(value)
    if refusal is None:
        note(key, why)
    return refusal


def check_zero_key(key: str, value: Any) -> str | None:
    """``zero_optimization.<key>``: as :func:`check_top_level`."""
    name = f"zero_optimization.{key}"
    if key in _ZERO_PERFORMANCE:
        note(name, "performance only")
        return None
    if key.startswith("stage3_"):
        note(name, "a ZeRO-3 option, and ZeRO-3 is not used (stage <= 1)")
        return None
    if key in ("offload_optimizer", "offload_param"):
        device = value.get("device") if isinstance(value, dict) else value
        if value is None or device in (None, "none"):
            note(name, "disabled")
            return None
        return "offloading is not implemented by pipekernel.deepspeed"
    if key in _ZERO_DEFAULTS:
        refusal = _equals(_ZERO_DEFAULTS[key])(value)
        if refusal is None:
            note(name, "at its default")
        return refusal
    return unknown(key, ["stage", "offload_optimizer", "offload_param", *_ZERO_PERFORMANCE,
                         *_ZERO_DEFAULTS])


#: fp16/bf16 keys accepted at their DeepSpeed default.
_PRECISION_DEFAULTS = {"fp16": {"auto_cast": False, "consecutive_hysteresis": False},
                       "bf16": {"immediate_grad_update": False, "check_grad_overflow": True}}


def check_precision_key(section: str, key: str, value: Any,
                        implemented: Iterable[str] = ()) -> str | None:
    """``fp16.<key>`` / ``bf16.<key>`` beyond those implemented: as :func:`check_top_level`."""
    defaults = _PRECISION_DEFAULTS[section]
    if key not in defaults:
        return unknown(key, [*implemented, *defaults])
    refusal = _equals(defaults[key])(value)
    if refusal is None:
        note(f"{section}.{key}", "at its default")
    return refusal
