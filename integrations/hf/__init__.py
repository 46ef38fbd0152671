"""``pipekernel.hf``: pipeline any Hugging Face decoder-only causal LM (optional extra ``[hf]``).

>>> import pipekernel as pk, pipekernel.hf as hf
>>> module = hf.pipeline_module("path/to/checkpoint", num_stages=4)   # or a model, or a config
>>> engine = pk.PipelineEngine(module, optimizer=..., micro_batches=8, loss_reduction="tokens")
>>> loss = engine.train_batch(iter(dicts))   # {"input_ids", "attention_mask", "labels"} each
>>> hf.save_pretrained(engine, "out")        # every rank; AutoModelForCausalLM loads "out"

Modules, one job each: :mod:`~pipekernel.hf.structure` (find the pieces),
:mod:`~pipekernel.hf.layers` (the pipeline layers), :mod:`~pipekernel.hf.head` (the output
projection by the model's own forward), :mod:`~pipekernel.hf.probe` (what is refused at build
time), :mod:`~pipekernel.hf.weights` (each stage's own weights, through transformers' key
conversion), :mod:`~pipekernel.hf.module` (``pipeline_module``),
:mod:`~pipekernel.hf.batches` (dict micro-batches), :mod:`~pipekernel.hf.packing` (packed
rows: the checks), :mod:`~pipekernel.hf.loss` (the shifted
causal-LM loss), :mod:`~pipekernel.hf.router` (the MoE router auxiliary loss across stages),
:mod:`~pipekernel.hf.save` (``save_pretrained``). See ``docs/hf.md``.

Imported only when used; the core never imports it."""
from pipekernel.hf.batches import split_batch
from pipekernel.hf.loss import IGNORE_INDEX, causal_lm_loss, causal_lm_mean_loss
from pipekernel.hf.module import HFPipelineModule, pipeline_module
from pipekernel.hf.save import save_pretrained
from pipekernel.hf.structure import Structure, find_structure

__all__ = ["pipeline_module", "save_pretrained", "causal_lm_loss", "causal_lm_mean_loss",
           "split_batch",
           "find_structure", "Structure", "HFPipelineModule", "IGNORE_INDEX"]
