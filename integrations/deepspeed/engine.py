"""The engine a DeepSpeed pipeline script talks to: DeepSpeed's ``PipelineEngine`` names
over one :class:`pipekernel.PipelineEngine` (it holds no loop of its own).

``train_batch`` returns the mean loss over micro-batches and replicas on every rank (as
DeepSpeed); ``eval_batch`` the mean loss (``reduce_output="avg"``), with
``return_logits=True`` also the last micro-batch's outputs on the last stage (``None``
elsewhere), as DeepSpeed's ``self.outputs``. Checkpoints are saved in pipekernel's format
(any stage count loads them) and DeepSpeed's beside it (:mod:`.layout`);
``load_checkpoint`` reads both (:mod:`pipekernel.deepspeed.checkpoint`).
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch

import pipekernel as pk
from pipekernel.errors import ConfigError

from .config import Settings, check_partitioned
from .data import make_loader
from .layout import check_client_state, write_deepspeed_files
from .pipe import PipelineModule
from .report import InstructionTimes, StepReport
from .surface import BoundaryFlag, EngineSurface

__all__ = ["PipelineEngine"]


class PipelineEngine(EngineSurface):
    """DeepSpeed's pipeline engine API over ``self.engine`` (a :class:`pipekernel.PipelineEngine`;
    the queries besides the loop: :mod:`pipekernel.deepspeed.surface`).

    :param module: the :class:`~pipekernel.deepspeed.pipe.PipelineModule` (``self.module``).
    :param settings: the parsed config (:func:`pipekernel.deepspeed.config.parse`).
    :param engine_options: extra :class:`pipekernel.PipelineEngine` keyword arguments.
    """

    def __init__(self, module: PipelineModule, settings: Settings, optimizer: Any,
                 lr_scheduler: Any, training_data: Any = None, collate_fn: Any = None,
                 engine_options: dict | None = None) -> None:
        self.module, self._config = module, settings
        if settings.activation_checkpoint_interval is not None:
            module.activation_checkpoint_interval = settings.activation_checkpoint_interval
        module.mpu()  # the grid's groups, created on every rank now (collective)
        self._boundary, self._step_applied, self.batch_fn = BoundaryFlag(), False, None
        self._curr_ckpt_path: str | None = None
        times = InstructionTimes() if settings.wall_clock_breakdown else None
        plugins = [StepReport(settings.steps_per_print, settings.train_batch_size, times),
                   self._boundary,
                   *([module.seeding_plugin()] if module.seed_layers else []),
                   *([times] if times is not None else [])]
        options = dict(engine_options or {})
        check_partitioned(settings, options.get("tensor_parallel_size", 1))
        plugins += list(options.pop("plugins", ()))
        backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else "gloo"
        self.engine = pk.PipelineEngine(
            module.pipeline_module(), optimizer, micro_batches=settings.micro_batches,
            transport=options.pop("transport", "nccl" if backend == "nccl" else "gloo"),
            precision=settings.precision, precision_options=settings.precision_options,
            max_grad_norm=settings.max_grad_norm, lr_scheduler=lr_scheduler,
            zero_stage=settings.zero_stage, data_parallel_size=module.dp_size,
            plugins=plugins, **options)
        self.optimizer, self.lr_scheduler = self.engine.optimizer, self.engine.lr_scheduler
        self.training_dataloader = None
        self.data_iterator: Iterator | None = None
        if training_data is not None:
            self.set_dataloader(make_loader(
                training_data, settings.micro_batch_size, self.dp_world_size,
                self.engine.data_parallel_rank, collate_fn=collate_fn,
                drop_last=settings.drop_last))

    # -- where this process sits -----------------------------------------------------
    @property
    def global_steps(self) -> int:
        return self.engine.global_steps

    @property
    def skipped_steps(self) -> int:
        return self.engine.skipped_steps

    @property
    def global_samples(self) -> int:
        return self.engine.global_steps * self._config.train_batch_size

    @property
    def micro_batches(self) -> int:
        return self.engine.micro_batches

    @property
    def num_stages(self) -> int:
        return self.engine.num_stages

    @property
    def stage_id(self) -> int:
        return self.engine.stage

    @property
    def global_rank(self) -> int:
        return self.engine.rank

    @property
    def dp_world_size(self) -> int:
        return self.engine.data_parallel_size

    def is_first_stage(self) -> bool:
        return self.engine.is_first_stage()

    def is_last_stage(self) -> bool:
        return self.engine.is_last_stage()

    def train_batch_size(self) -> int:
        return self._config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._config.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.engine.micro_batches

    def gradient_clipping(self) -> float:
        return self._config.max_grad_norm or 0.0

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    # -- data --------------------------------------------------------------------------
    def set_dataloader(self, loader: Any) -> None:
        """Read training batches from ``loader`` (only the first and last stages read)."""
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = loader
            self.data_iterator = iter(loader)

    def set_dataiterator(self, iterator: Iterator) -> None:
        """Read training batches from ``iterator`` (only the first and last stages read)."""
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = None
            self.data_iterator = iterator

    def _reads_data(self) -> bool:
        return self.is_first_stage() or self.is_last_stage()

    # -- the loop ----------------------------------------------------------------------
    def train_batch(self, data_iter: Iterator | None = None) -> torch.Tensor:
        """Train on ``gradient_accumulation_steps`` micro-batches and step once.

        :returns: the mean loss, a 0-dim tensor with the same value on every rank.
        """
        if not torch.is_grad_enabled():
            raise ConfigError("train_batch() requires gradients enabled. Use eval_batch() "
                              "instead.",
                              hint="call train_batch outside torch.no_grad(), or eval_batch() to "
                                   "evaluate")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        if self.data_iterator is None and self._reads_data():
            raise ConfigError("train_batch() has no data", rank=self.global_rank,
                              stage=self.stage_id, hint="pass train_batch(data_iter) or "
                              "initialize(..., training_data=dataset)")
        skipped = self.engine.skipped_steps
        loss = self.engine.train_batch(self._mapped(self.data_iterator))
        self._step_applied = self.engine.skipped_steps == skipped
        return loss

    def eval_batch(self, data_iter: Iterator, return_logits: bool = False,
                   compute_loss: bool = True, reduce_output: str = "avg",
                   bcast_loss: bool = True, num_micro_batches: int | None = None) -> Any:
        """Forward only over ``num_micro_batches`` (default: gradient accumulation
        steps) micro-batches of ``data_iter``; the training iterator is kept.

        :returns: the mean loss on every rank (``None`` with ``compute_loss=False``), and
            with ``return_logits`` the pair ``(loss, last micro-batch's outputs)``.
        """
        if reduce_output != "avg" or not bcast_loss:
            raise ConfigError(f"eval_batch(reduce_output={reduce_output!r}, bcast_loss="
                              f"{bcast_loss!r}) is not implemented by pipekernel.deepspeed",
                              hint="use reduce_output='avg', bcast_loss=True")
        result = self.engine.eval_batch(self._mapped(iter(data_iter) if data_iter is not None
                                                     else None),
                                        compute_loss=compute_loss, return_outputs=return_logits,
                                        micro_batches=num_micro_batches)
        if not return_logits:
            return result
        loss, outputs = result
        return loss, (outputs[-1] if outputs else None)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError("Only train_batch() is accessible in pipeline mode.",
                          hint="call engine.train_batch() or engine.eval_batch(data_iter)")

    backward = step = forward

    # -- checkpoints --------------------------------------------------------------------
    def save_checkpoint(self, save_dir: str | os.PathLike, tag: str | None = None,
                        client_state: Any = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> bool:
        """Save under ``save_dir/tag`` (default ``global_step{N}``; ``save_dir/latest``
        names it) in pipekernel's format (bit-exact resume, any stage count) and, beside
        it, DeepSpeed's (its engine loads it: :mod:`pipekernel.deepspeed.layout`).
        Every rank calls it."""
        if not save_latest or exclude_frozen_parameters:
            raise ConfigError("save_checkpoint(save_latest=False / exclude_frozen_parameters"
                              "=True) is not implemented by pipekernel.deepspeed",
                              hint="call save_checkpoint(save_dir, tag, client_state) with the "
                                   "defaults")
        client_state = check_client_state(client_state if client_state is not None else {})
        directory = self.engine.save_checkpoint(save_dir, tag, client_state)
        write_deepspeed_files(self, directory, client_state)
        return True

    def load_checkpoint(self, load_dir: str | os.PathLike, tag: str | None = None,
                        load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        custom_load_fn: Any = None, *, trust_checkpoint: bool | None = None
                        ) -> tuple[str, Any]:
        """Load a checkpoint pipekernel or DeepSpeed wrote, at any stage count.

        The files load as data only (tensors, numbers, containers and the one inert
        DeepSpeed class its files hold); a file that would run code when unpickled is
        refused (``UntrustedCheckpointError``, a ``DataError``) unless
        ``trust_checkpoint=True`` or, when it is ``None``, the config's
        ``"pipekernel_trust_checkpoints": true`` (docs/checkpoints.md).

        :returns: ``(directory loaded, client_state)`` as DeepSpeed.
        """
        if not load_module_strict or custom_load_fn is not None:
            raise ConfigError("load_checkpoint(load_module_strict=False / custom_load_fn=...) "
                              "is not implemented by pipekernel.deepspeed",
                              hint="call load_checkpoint(load_dir, tag) with the defaults, or "
                                   "convert the checkpoint (pipekernel convert-deepspeed)")
        from .checkpoint import load
        return load(self, load_dir, tag, optimizer=load_optimizer_states and not load_module_only,
                    lr_scheduler=load_lr_scheduler_states and not load_module_only,
                    counters=not load_module_only,
                    trust_checkpoint=(self._config.trust_checkpoints if trust_checkpoint is None
                                      else bool(trust_checkpoint)))

    def close(self) -> None:
        self.engine.close()
