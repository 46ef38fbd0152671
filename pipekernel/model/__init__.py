"""The model vocabulary users write a pipeline in: ``PipelineModule`` and layer specs
(``module.py``), skip connections (``skips.py``) and their routes between stages
(``skip_routing.py``), mixture of experts (``moe.py``), auxiliary losses (``aux_loss.py``),
activation recompute (``recompute.py``) and partition requests (``partitioning.py``)."""
