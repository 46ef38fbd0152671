"""Layer 3: the PipelineEngine that composes the rest, the planner (auto), faults, checkpoints (launching: ``pipekernel.launcher``)."""
