"""``deepspeed.runtime.pipe.topology``: see :mod:`pipekernel.deepspeed.topology`."""
from ...topology import (PipeDataParallelTopology, PipelineParallelGrid,
                         PipeModelDataParallelTopology, ProcessTopology)

__all__ = ["ProcessTopology", "PipeDataParallelTopology", "PipeModelDataParallelTopology",
           "PipelineParallelGrid"]
