"""pipekernel: a pipeline-parallel training kernel for PyTorch.

A tiny core runs a pipeline instruction stream; transports, precision,
partitioning, monitoring and extra schedules are pluggy plugins.
"""
from importlib.metadata import PackageNotFoundError, version

from pipekernel.grid import tensor_parallel
from pipekernel.engine.checkpoint import load_sequential
from pipekernel.engine.engine import PipelineEngine
from pipekernel.errors import (ConfigError, DataError, InstructionError, NonFiniteLossError,
                               PeerAbort, PipelineError, ScheduleError, TransportError,
                               TransportTimeout, UnknownNameError)
from pipekernel.extend.hookspecs import hookimpl, hookspec
from pipekernel.kernel.loop import Kernel
from pipekernel.engine.launch import LaunchInterrupted, RankError, launch
from pipekernel.stage.module import LayerSpec, PipelineModule, StageModule, TiedLayerSpec
from pipekernel.stage.partitioning import PartitionContext, PartitionReport, balance, memory, profile
from pipekernel.engine.planner import Plan, auto
from pipekernel.extend.manager import make_plugin_manager
from pipekernel.stage.skips import Skip, pop, skippable, stash
from pipekernel.grid.topology import Topology
from pipekernel.comm.transport import P2POp

try:
    __version__ = version("pipekernel")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "PipelineEngine", "PipelineModule", "LayerSpec", "TiedLayerSpec", "StageModule", "Kernel",
    "Topology", "launch", "make_plugin_manager", "hookimpl", "hookspec", "PipelineError",
    "ConfigError", "DataError", "InstructionError", "ScheduleError", "TransportError",
    "TransportTimeout", "UnknownNameError", "RankError", "LaunchInterrupted", "PeerAbort", "NonFiniteLossError",
    "__version__", "load_sequential", "balance", "profile", "memory", "PartitionContext",
    "PartitionReport", "P2POp", "auto", "Plan", "skippable", "Skip", "stash", "pop",
    "tensor_parallel",
]
