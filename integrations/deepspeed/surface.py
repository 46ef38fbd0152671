"""The parts of DeepSpeed's engine API that scripts query besides the loop (0.19's
``runtime/engine.py`` and ``runtime/pipe/engine.py``), with DeepSpeed's meanings:

* where this process sits: ``grid`` and ``mpu`` (the module's
  :class:`~pipekernel.deepspeed.topology.PipelineParallelGrid`), ``local_rank``,
  ``world_size`` (every process), ``global_rank``, ``mp_world_size`` (the stages),
  ``get_data_parallel_rank()``, ``get_pipeline_parallel_rank()`` (the stage),
  ``get_model_parallel_rank()`` / ``get_tensor_parallel_rank()`` (tensor-slicing rank:
  0), ``device``;
* the last step: ``was_step_applied()`` (``False`` before the first step and after a
  step skipped for an fp16 overflow), ``get_global_grad_norm()`` (the whole model's
  gradient norm before clipping, with clipping on; ``None`` without, as DeepSpeed's
  fp32 pipeline with a ``torch.optim`` optimizer), ``is_gradient_accumulation_boundary()``
  (``True`` only while the gradient reduction or the optimizer step runs, as
  DeepSpeed's pipeline engine forces it);
* ``set_batch_fn(fn)``: ``fn`` maps every batch read from the data iterator (training
  and evaluation, on the stages that read data);
* ``reset_activation_shape()``: nothing to reset (pipekernel sends the shape whenever it
  changes), so it does nothing;
* ``fp16_enabled()``, ``bfloat16_enabled()``;
* ``module_state_dict()``: as DeepSpeed's pipeline engine, only inside
  ``save_checkpoint``, where it writes this stage's ``layer_XX`` files and returns
  ``None``.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

import pipekernel as pk
from pipekernel.errors import ConfigError
from pipekernel.schedules.instructions import OptimizerStep, ReduceGrads, ReduceTiedGrads

__all__ = ["EngineSurface", "BoundaryFlag", "BatchFn"]


class BoundaryFlag:
    """A pipekernel plugin: ``value`` is ``True`` while a gradient reduction or the
    optimizer step runs (DeepSpeed's ``_force_grad_boundary``)."""

    _KINDS = (ReduceGrads, ReduceTiedGrads, OptimizerStep)

    def __init__(self) -> None:
        self.value = False

    @pk.hookimpl
    def pipekernel_before_instruction(self, instruction: Any) -> None:
        if isinstance(instruction, self._KINDS):
            self.value = True

    @pk.hookimpl
    def pipekernel_after_instruction(self, instruction: Any) -> None:
        if isinstance(instruction, self._KINDS):
            self.value = False


class BatchFn:
    """Iterates ``fn(batch)`` over ``iterator`` (no read-ahead: the engine pulls)."""

    def __init__(self, iterator: Iterator, fn: Callable[[Any], Any]) -> None:
        self.iterator, self.fn = iterator, fn

    def __iter__(self) -> BatchFn:
        return self

    def __next__(self) -> Any:
        return self.fn(next(self.iterator))


class EngineSurface:
    """Mixed into :class:`pipekernel.deepspeed.engine.PipelineEngine` (needs ``engine``,
    ``module``, ``_config``, ``_boundary``, ``_step_applied``, ``batch_fn``)."""

    engine: Any
    module: Any
    _config: Any
    _boundary: BoundaryFlag
    _step_applied: bool
    batch_fn: Callable[[Any], Any] | None
    _curr_ckpt_path: str | None

    # -- where this process sits -----------------------------------------------------
    @property
    def grid(self) -> Any:
        return self.module.mpu()

    @property
    def mpu(self) -> Any:
        return self.module.mpu()

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def world_size(self) -> int:
        return self.engine.transport.world_size

    @property
    def mp_world_size(self) -> int:
        return self.engine.num_stages

    @property
    def device(self) -> torch.device:
        return torch.device(self.engine.transport.device)

    def get_data_parallel_rank(self) -> int:
        return self.engine.data_parallel_rank

    def get_pipeline_parallel_rank(self) -> int:
        return self.engine.stage

    def get_model_parallel_rank(self) -> int:
        return self.grid.get_slice_parallel_rank()

    get_tensor_parallel_rank = get_model_parallel_rank

    # -- the last step -----------------------------------------------------------------
    def was_step_applied(self) -> bool:
        return self._step_applied

    def get_global_grad_norm(self) -> float | None:
        return self.engine.last_grad_norm

    def is_gradient_accumulation_boundary(self) -> bool:
        return self._boundary.value

    # -- data and shapes ---------------------------------------------------------------
    def set_batch_fn(self, fn: Callable[[Any], Any]) -> None:
        """Run ``fn`` on every batch read from the data iterator."""
        self.batch_fn = fn

    def _mapped(self, iterator: Iterator | None) -> Iterator | None:
        if iterator is None or self.batch_fn is None:
            return iterator
        return BatchFn(iterator, self.batch_fn)

    def reset_activation_shape(self) -> None:
        """Nothing to reset: pipekernel sends an activation's shape whenever it changes."""

    # -- precision ---------------------------------------------------------------------
    def fp16_enabled(self) -> bool:
        return self._config.precision == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self._config.precision == "bf16"

    # -- the module's files ------------------------------------------------------------
    def module_state_dict(self, destination: Any = None, prefix: str = "",
                          keep_vars: bool = False,
                          exclude_frozen_parameters: bool = False) -> None:
        """Write this stage's ``layer_XX-model_states.pt`` files into the checkpoint
        being saved; only ``save_checkpoint`` calls it (as DeepSpeed's)."""
        if getattr(self, "_curr_ckpt_path", None) is None:
            raise ConfigError("PipelineEngine expects module_state_dict() to be called from "
                              "save_checkpoint()",
                              hint="call engine.save_checkpoint(dir), or read this stage's "
                                   "weights with engine.module.state_dict()")
        from .layout import write_layer_files
        write_layer_files(self, self._curr_ckpt_path)
        return None
