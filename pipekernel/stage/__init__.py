"""One stage's runtime: the instruction handlers, split backward, loss, device moves, memory accounting (the layers it builds: ``pipekernel.model``)."""
