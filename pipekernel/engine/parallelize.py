"""What the engine checks and keeps of the torch parallelism applied to its stage by the
hook ``pipekernel_parallelize_stage`` (FSDP2, DTensor). The engine calls it; the logic lives in
:mod:`pipekernel.grid.mesh` and :mod:`pipekernel.grid.stage_parallel`."""
from __future__ import annotations

from typing import Any

from pipekernel.errors import ConfigError
from pipekernel.extend.views import StageView
from pipekernel.grid import stage_parallel

__all__ = ["check_stage_parallel"]


def check_stage_parallel(engine: StageView) -> stage_parallel.StageParallel | None:
    """The driver of the stage's FSDP2 modules (``None``: none), after refusing by name
    what it does not run with: ``data_parallel_shard`` that no plugin applied, precision
    policies other than ``fp32`` and ``bf16``, ZeRO-1."""
    driver = stage_parallel.find(engine.module)
    where = {"rank": engine.transport.rank, "stage": engine.stage}
    shard = engine.parallel.data_parallel_shard
    if shard > 1 and driver is None:
        raise ConfigError(f"data_parallel_shard={shard}, but no plugin applied FSDP2 to stage "
                          f"{engine.stage}: the built-in plugin 'fsdp' "
                          f"(pipekernel.plugins.fsdp) is disabled or not installed",
                          hint="do not disable 'fsdp'; reinstall pipekernel (pip install -e .) "
                               "if its entry points predate the plugin", **where)
    _check_dtensors(engine, driver, where)
    if driver is None:
        return None
    name = getattr(engine.precision, "name", "fp32")
    if name not in ("fp32", "bf16"):
        raise ConfigError(f"stage {engine.stage} is sharded with FSDP2, which runs under "
                          f"precision='fp32' or 'bf16' only so far, not {name!r}",
                          hint="use precision='fp32' or 'bf16' (mapped to FSDP2's "
                               "MixedPrecisionPolicy)", **where)
    if engine.parallel.zero_stage:
        raise ConfigError(f"stage {engine.stage} is sharded with FSDP2, which does not combine "
                          f"with zero_stage=1", hint="drop zero_stage", **where)
    return driver


def _check_dtensors(engine: StageView, driver: Any, where: dict) -> None:
    """DTensor parameters FSDP2 does not manage (a DTensor plan alone) are reduced by no
    one over data-parallel ranks: refuse them there rather than train replicas apart."""
    from pipekernel.grid.mesh import local_share

    if engine.topology.data_size == 1:
        return
    loose = [name for name, p in engine.module.named_parameters()
             if local_share(p) is not False and (driver is None or not driver.managed(p))]
    if loose:
        raise ConfigError(f"stage {engine.stage} has DTensor parameters ({loose[:3]}...) with "
                          f"{engine.topology.data_size} data-parallel ranks, and only FSDP2 "
                          f"reduces DTensor gradients over them",
                          hint="add data_parallel_shard (FSDP2 composes with the DTensor "
                               "plan) or run one data-parallel rank per stage", **where)

