"""The stable import path for plugin, schedule and transport authors.

``pipekernel`` is for users (engine, module, specs, launch, auto, errors); this module is for
code that *extends* pipekernel. Everything here keeps its name and meaning across minor
versions; internal module paths (``pipekernel.stage.runtime`` and the like) may move.

* hooks: :data:`hookimpl` (the pluggy marker of project ``"pipekernel"``);
* transports as a plugin sees them: :class:`Transport` and :class:`Handle` (the contract;
  what a transport *author* builds on, :class:`P2POp` and the plumbing, is
  :mod:`pipekernel.comm`, its conformance suite :mod:`pipekernel.testing`);
* embedding: :class:`Kernel` (the instruction loop with your handlers),
  :func:`make_plugin_manager`;
* schedules: :class:`Schedule`, :data:`BUILTIN_SCHEDULES`, :func:`simulate`,
  :func:`compile_program` / :func:`plan_communication` (a :class:`Program` from a schedule or
  from steps),
  and every instruction class;
* torch parallelism inside a stage: the hook ``pipekernel_parallelize_stage(module, mesh,
  engine)`` (FSDP2, DTensor, float8, a wrapping policy of your own; the built-in FSDP2 of
  ``data_parallel_shard`` is a plugin on it, :mod:`pipekernel.plugins.fsdp`), the mesh's
  dims :data:`MESH_DIMS` and :class:`StageParallel` (how the engine times any
  ``fully_shard`` module by the schedule), :func:`find_stage_parallel` (a module's driver);
* precision policies: :class:`Precision` (the base; its methods and when the engine calls
  them are its contract) and :func:`cast_floats`;
* partitioning: the method values a ``pipekernel_partition`` implementation receives
  (:class:`Balance`, :class:`Profile`, :class:`Memory`; the context is
  ``pipekernel.PartitionContext``), :class:`SkipScope` (run layers that stash and pop
  outside the engine) and the split backward (:func:`backward_input`,
  :func:`backward_weight`);
* nested values: :func:`map_tensors`, :func:`tensors_of`, :func:`tensors_to`, :func:`describe`;
* what hooks and checkpoints read of an engine: :class:`EngineView` (the built engine: the
  object passed is the :class:`~pipekernel.PipelineEngine`, which implements it),
  :class:`StageView` (the engine as ``pipekernel_parallelize_stage`` sees it) and
  :class:`RuntimeView` (the stage runtime: handlers, inputs of a micro-batch) — typed,
  read-only, each docstring the contract;
* agreement across ranks: :func:`all_gather_objects`, :func:`broadcast_object`,
  :func:`compute_on_one` (one rank computes, every rank gets the value or its error),
  :func:`raise_on_every_rank` (one rank's failure raised on all);
* installed extensions: :func:`entry_points`.

Built-in plugins (``pipekernel.plugins.*``) and transports (``pipekernel.transports.*``)
import from here, ``pipekernel.comm``, ``pipekernel`` and ``pipekernel.errors`` only
(``tests/test_surface.py``), so this surface is the one the project itself uses.
"""
from __future__ import annotations

from pipekernel.comm.transport import Handle, Transport
from pipekernel.extend.hookspecs import hookimpl
from pipekernel.extend.manager import make_plugin_manager
from pipekernel.grid.mesh import MESH_DIMS
from pipekernel.grid.stage_parallel import StageParallel
from pipekernel.kernel.loop import Kernel
from pipekernel.schedules import BUILTIN_SCHEDULES, Schedule, SimulationResult, simulate
from pipekernel.schedules.comm import lanes_needed
from pipekernel.schedules.program import Program, compile_program, plan_communication
from pipekernel.schedules.instructions import (Backward, BackwardInput, BackwardWeight, Forward,
                                               ForwardBackward, Instruction, LoadMicroBatch,
                                               MicroBatchInstruction, OptimizerStep,
                                               RecvActivation, RecvGrad, RecvSkip, RecvSkipGrad,
                                               ReduceGrads, ReduceTiedGrads, SendActivation,
                                               SendGrad, SendSkip, SendSkipGrad,
                                               SkipInstruction)
# what the built-in plugins use (one line each in docs/api.md)
from pipekernel.comm.agreement import (all_gather_objects, broadcast_object,
                                         compute_on_one, raise_on_every_rank)
from pipekernel.extend.installed import entry_points
from pipekernel.extend.views import EngineView, RuntimeView, StageView
from pipekernel.grid.stage_parallel import find as find_stage_parallel
from pipekernel.nested import describe, map_tensors, tensors_of, tensors_to
from pipekernel.stage.memory import MemoryLedger
from pipekernel.model.partitioning import Balance, Memory, Profile
from pipekernel.model.skips import SkipScope
from pipekernel.stage.split_backward import backward_input, backward_weight
from pipekernel.step.precision import Precision, cast_floats

__all__ = [
    "hookimpl", "make_plugin_manager", "Kernel",
    "Transport", "Handle",
    "Schedule", "BUILTIN_SCHEDULES", "simulate", "SimulationResult", "plan_communication",
    "lanes_needed", "Program", "compile_program",
    "Instruction", "MicroBatchInstruction", "SkipInstruction", "LoadMicroBatch", "Forward",
    "Backward", "BackwardInput", "BackwardWeight", "SendActivation", "RecvActivation", "SendGrad",
    "RecvGrad", "SendSkip", "RecvSkip", "SendSkipGrad", "RecvSkipGrad", "ReduceTiedGrads",
    "ReduceGrads", "OptimizerStep", "ForwardBackward", "MESH_DIMS", "StageParallel", "find_stage_parallel",
    "Precision", "cast_floats", "Balance", "Profile", "Memory", "SkipScope", "backward_input",
    "backward_weight", "map_tensors", "tensors_of", "all_gather_objects", "entry_points",
    "EngineView", "StageView", "RuntimeView", "broadcast_object", "compute_on_one",
    "raise_on_every_rank", "tensors_to", "describe", "MemoryLedger",
]
