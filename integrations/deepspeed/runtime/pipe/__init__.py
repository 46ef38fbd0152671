"""``deepspeed.runtime.pipe``: the pipeline module, its specs and the topology."""
from ...pipe import LayerSpec, PipelineModule, TiedLayerSpec
from . import topology
from .topology import ProcessTopology

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec", "ProcessTopology", "topology"]
