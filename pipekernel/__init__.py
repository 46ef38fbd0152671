"""pipekernel: a pipeline-parallel training kernel for PyTorch.

A tiny core runs a pipeline instruction stream; transports, precision,
partitioning, monitoring and extra schedules are pluggy plugins.
"""
from importlib.metadata import PackageNotFoundError, version

from pipekernel.grid import expert_parallel
from pipekernel.model.moe import MoE
from pipekernel.stage.paired import overlap_all_to_all
from pipekernel.engine.checkpoint import load_sequential
from pipekernel.engine.engine import PipelineEngine
from pipekernel.errors import (ConfigError, ConsistencyError, DataError, InstructionError,
                               NonFiniteLossError,
                               PeerAbort, PipelineError, ScheduleError, TransportError,
                               TransportTimeout, UnknownNameError)
from pipekernel.extend.hookspecs import hookimpl
from pipekernel.launcher.launch import LaunchInterrupted, RankError, launch
from pipekernel.model.module import LayerSpec, PipelineModule, TiedLayerSpec
from pipekernel.model.partitioning import PartitionContext, PartitionReport, balance, memory, profile
from pipekernel.engine.planner import Plan, auto
from pipekernel.model.skips import Skip, pop, skippable, stash
from pipekernel.model.aux_loss import add_aux_loss, aux_losses
from pipekernel.stage.offload import ModelMover, Offload
from pipekernel.stage.packing import document_ids, document_mask, pack
from pipekernel.stage.sequence import prefix_causal_mask, sequence_chunk

try:
    __version__ = version("pipekernel")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0"

# For users. Plugin, schedule and transport authors import from pipekernel.plugin (docs/api.md).
__all__ = [
    # model
    "PipelineModule", "LayerSpec", "TiedLayerSpec", "skippable", "Skip", "stash", "pop",
    "balance", "profile", "memory", "PartitionContext", "PartitionReport",
    "add_aux_loss", "aux_losses", "MoE", "expert_parallel", "overlap_all_to_all",
    "pack", "document_ids", "document_mask", "sequence_chunk", "prefix_causal_mask",
    # training
    "PipelineEngine", "auto", "Plan", "launch", "load_sequential", "hookimpl",
    "Offload", "ModelMover",
    # errors
    "PipelineError", "ConfigError", "UnknownNameError", "DataError", "ScheduleError",
    "InstructionError", "TransportError", "TransportTimeout", "PeerAbort", "NonFiniteLossError",
    "ConsistencyError",
    "RankError", "LaunchInterrupted",
    "__version__",
]
