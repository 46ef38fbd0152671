"""``pipekernel.lightning``: pipeline parallelism for ``lightning.pytorch.Trainer``
(optional extra ``[lightning]``).

>>> import pipekernel.lightning  # registers Trainer(strategy="pipekernel")
>>> trainer = Trainer(accelerator="cpu", devices=2,
...                   strategy=pipekernel.lightning.PipelineStrategy(num_stages=2, micro_batches=4))

Imported only when used; the core never imports it. See ``docs/lightning.md``.
"""
try:
    import lightning.pytorch  # noqa: F401
except ImportError as err:  # say which extra brings it
    raise ImportError("pipekernel.lightning needs Lightning 2.x: pip install "
                      "'pipekernel[lightning]' (or lightning>=2.2)") from err

from pipekernel.lightning.batches import split_batch
from pipekernel.lightning.checkpoints import CHECKPOINT_TAG, pipeline_dir
from pipekernel.lightning.modules import attach_whole_model
from pipekernel.lightning.stepping import grad_norm
from pipekernel.lightning.strategy import PipelineStrategy

__all__ = ["PipelineStrategy", "split_batch", "CHECKPOINT_TAG", "pipeline_dir",
           "attach_whole_model", "grad_norm"]
