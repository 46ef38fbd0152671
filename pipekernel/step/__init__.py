"""The step: gradient reductions (tied, data-parallel), the precision protocol, clipping and the optimizer step."""
