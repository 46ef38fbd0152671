"""``pipekernel.deepspeed``: run a DeepSpeed pipeline script on pipekernel by changing
one import::

    import pipekernel.deepspeed as deepspeed
    from pipekernel.deepspeed.pipe import PipelineModule, LayerSpec, TiedLayerSpec

``initialize`` reads DeepSpeed's JSON config (:mod:`.config`: every key implemented or
refused by name), builds the optimizer and LR schedule it names (:mod:`.optimizers`,
:mod:`.lr_schedules`) and returns DeepSpeed's four values around a
:class:`pipekernel.PipelineEngine` (:mod:`.engine`); ``load_checkpoint`` reads DeepSpeed's
pipeline checkpoints (:mod:`.checkpoint`; :func:`convert` and ``pipekernel
convert-deepspeed`` write them in pipekernel's format). DeepSpeed itself is not needed.
See ``docs/deepspeed.md``. Imported only when used; the core never imports it.
"""
from __future__ import annotations

import argparse
import datetime
import os
from typing import Any

import torch

from pipekernel.errors import ConfigError

from . import pipe, runtime, utils
from .checkpoint import convert
from .config import parse
from .data import RepeatingLoader
from .engine import PipelineEngine
from .lr_schedules import build_scheduler
from .optimizers import optimizer_factory
from .pipe import PipelineModule
from .utils import log_dist, logger

__all__ = ["initialize", "init_distributed", "add_config_arguments", "convert",
           "PipelineEngine", "PipelineModule", "RepeatingLoader", "log_dist", "logger", "pipe",
           "runtime", "utils"]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's command-line arguments on ``parser``: ``--deepspeed`` (a flag for the
    script), ``--deepspeed_config FILE`` (read by ``initialize(args=...)``) and the
    deprecated ``--deepscale`` / ``--deepscale_config``."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on "
                            "DeepSpeed backend)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="Deprecated enable DeepSpeed (helper flag for user code, no "
                            "impact on DeepSpeed backend)")
    group.add_argument("--deepscale_config", default=None, type=str,
                       help="Deprecated DeepSpeed json configuration file.")
    return parser


def _config_of(args: Any, config: Any, config_params: Any) -> Any:
    """The config from ``config`` / ``config_params`` / ``args.deepspeed_config`` (or the
    deprecated ``args.deepscale_config``), refusing two of them as DeepSpeed does."""
    config = config if config is not None else config_params
    from_args = getattr(args, "deepspeed_config", None)
    old = getattr(args, "deepscale_config", None)
    if old is not None:
        if from_args is not None:
            raise ConfigError("Not sure how to proceed, we were given both a deepscale_config "
                              "and deepspeed_config", hint="keep --deepspeed_config")
        from_args = old
    if from_args is not None:
        if config is not None:
            raise ConfigError("Not sure how to proceed, we were given deepspeed configs in the "
                              "deepspeed arguments and deepspeed.initialize() function call",
                              hint="pass one of --deepspeed_config and initialize(config=...)")
        config = from_args
    return config


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True,
                     timeout: datetime.timedelta = datetime.timedelta(minutes=30),
                     init_method: str | None = None, dist_init_required: bool | None = None,
                     config: Any = None, rank: int = -1, world_size: int = -1) -> None:
    """Start ``torch.distributed`` from the torchrun environment unless it is running
    (``dist_backend`` default: ``nccl`` with CUDA, else ``gloo``). Without ``RANK`` /
    ``WORLD_SIZE`` in the environment: one process (``127.0.0.1:distributed_port``)."""
    if torch.distributed.is_initialized() or dist_init_required is False:
        return
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if rank < 0 and "RANK" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
        rank, world_size = 0, 1
    kwargs: dict[str, Any] = {"backend": backend, "timeout": timeout,
                              "init_method": init_method or "env://"}
    if rank >= 0:
        kwargs.update(rank=rank, world_size=world_size)
    torch.distributed.init_process_group(**kwargs)


def initialize(args: Any = None, model: Any = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Any = None,
               lr_scheduler: Any = None, distributed_port: int = 29500, mpu: Any = None,
               dist_init_required: bool | None = None, collate_fn: Any = None,
               config: Any = None, config_params: Any = None, *,
               unsupported: str = "error", engine_options: dict | None = None
               ) -> tuple[PipelineEngine, Any, Any, Any]:
    """DeepSpeed's ``initialize`` for a :class:`~pipekernel.deepspeed.pipe.PipelineModule`.

    :param config: the DeepSpeed config, a dict or a JSON file path (also
        ``config_params`` or ``args.deepspeed_config``).
    :param optimizer: a ``torch.optim`` optimizer or ``f(params)``, unless the config
        names one.
    :param lr_scheduler: a scheduler ``f(optimizer)`` (or a built one, with a built
        optimizer), unless the config names one.
    :param unsupported: ``"error"`` (default): an unimplemented config key raises
        ``ConfigError`` naming it; ``"warn"``: a warning, and the key has no effect,
        except a key that would change what a batch is (a batch-size key or a typo of
        one, ``elasticity``, ...): that stays an error.
    :param engine_options: extra :class:`pipekernel.PipelineEngine` keyword arguments
        (``schedule``, ``timeout``, ``plugins``, ...).
    :returns: ``(engine, optimizer, training_dataloader, lr_scheduler)``.
    """
    if not isinstance(model, PipelineModule):
        raise ConfigError(f"model must be a pipekernel.deepspeed.pipe.PipelineModule, got "
                          f"{type(model).__name__}",
                          hint="pipekernel.deepspeed runs pipeline scripts: wrap the layers "
                               "in PipelineModule([...], num_stages=...)")
    if mpu is not None:
        raise ConfigError("initialize(mpu=...) is not implemented by pipekernel.deepspeed",
                          hint="the pipeline grid comes from PipelineModule(num_stages=...)")
    config = _config_of(args, config, config_params)
    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    settings = parse(config, world_size=model.world_size, num_stages=model.num_stages,
                     unsupported=unsupported)
    keep_built = settings.precision == "fp32" and settings.zero_stage == 0
    factory = optimizer_factory(settings.optimizer, optimizer, model_parameters,
                                lambda: list(model.stage_module().parameters()), keep_built)
    if settings.scheduler is not None and lr_scheduler is not None:
        raise ConfigError("an LR scheduler is given both in the config and as initialize("
                          "lr_scheduler=...)", hint="keep one of them")
    if hasattr(lr_scheduler, "step") and not (keep_built and factory is optimizer):
        raise ConfigError("a built LR scheduler steps the optimizer it was built over, and "
                          "pipekernel builds the optimizer here (from the config, or over "
                          "fp32 master weights / a ZeRO shard)",
                          hint="pass lr_scheduler=lambda optimizer: Scheduler(optimizer, ...)")
    scheduler = build_scheduler(settings.scheduler) if settings.scheduler else lr_scheduler
    engine = PipelineEngine(model, settings, factory, scheduler, training_data, collate_fn,
                            engine_options)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
