"""The stable import path for plugin, schedule and transport authors.

``pipekernel`` is for users (engine, module, specs, launch, auto, errors); this module is for
code that *extends* pipekernel. Everything here keeps its name and meaning across minor
versions; internal module paths (``pipekernel.stage.runtime`` and the like) may move.

* hooks: :data:`hookimpl` / :data:`hookspec` (pluggy markers of project ``"pipekernel"``);
* transports: :class:`Transport`, :class:`Handle`, :class:`P2POp`, :func:`wait_sliced`, and
  the conformance suite (:func:`check_transport` starts processes,
  :func:`run_transport_conformance` runs it on ranks you started);
* embedding: :class:`Kernel` (the instruction loop with your handlers),
  :func:`make_plugin_manager`;
* schedules: :class:`Schedule`, :data:`BUILTIN_SCHEDULES`, :func:`simulate`,
  :func:`plan_communication` / :class:`CommPlan`, :func:`compile_program` / :class:`Program`,
  and every instruction class;
* torch parallelism inside a stage: the hook ``pipekernel_parallelize_stage(module, mesh,
  engine)`` (FSDP2, DTensor, float8, a wrapping policy of your own; the built-in FSDP2 of
  ``data_parallel_shard`` is a plugin on it, :mod:`pipekernel.plugins.fsdp`), the mesh's
  dims :data:`MESH_DIMS` and :class:`StageParallel` (how the engine times any
  ``fully_shard`` module by the schedule).
"""
from __future__ import annotations

from pipekernel.comm.conformance import run_transport_conformance
from pipekernel.comm.transport import Handle, P2POp, Transport, wait_sliced
from pipekernel.extend.hookspecs import hookimpl, hookspec
from pipekernel.extend.manager import make_plugin_manager
from pipekernel.grid.mesh import MESH_DIMS
from pipekernel.grid.stage_parallel import StageParallel
from pipekernel.kernel.loop import Kernel
from pipekernel.schedules import BUILTIN_SCHEDULES, Schedule, SimulationResult, simulate
from pipekernel.schedules.comm import CommPlan, lanes_needed, plan_communication
from pipekernel.schedules.program import Program, compile_program
from pipekernel.schedules.instructions import (Backward, BackwardInput, BackwardWeight, Forward,
                                               Instruction, LoadMicroBatch,
                                               MicroBatchInstruction, OptimizerStep,
                                               RecvActivation, RecvGrad, RecvSkip, RecvSkipGrad,
                                               ReduceGrads, ReduceTiedGrads, SendActivation,
                                               SendGrad, SendSkip, SendSkipGrad,
                                               SkipInstruction)
from pipekernel.testing import check_transport

__all__ = [
    "hookimpl", "hookspec", "make_plugin_manager", "Kernel",
    "Transport", "Handle", "P2POp", "wait_sliced", "check_transport", "run_transport_conformance",
    "Schedule", "BUILTIN_SCHEDULES", "simulate", "SimulationResult", "plan_communication",
    "CommPlan", "lanes_needed", "Program", "compile_program",
    "Instruction", "MicroBatchInstruction", "SkipInstruction", "LoadMicroBatch", "Forward",
    "Backward", "BackwardInput", "BackwardWeight", "SendActivation", "RecvActivation", "SendGrad",
    "RecvGrad", "SendSkip", "RecvSkip", "SendSkipGrad", "RecvSkipGrad", "ReduceTiedGrads",
    "ReduceGrads", "OptimizerStep", "MESH_DIMS", "StageParallel",
]
