"""The configuration of ``pipekernel train``: one frozen dataclass, sent to every rank."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TrainConfig"]


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run needs; the same object goes to every rank."""

    stages: int = 2
    data_parallel: int = 1
    micro_batches: int = 4
    micro_batch_size: int = 16
    schedule: str = "1f1b"
    chunks: int | None = None  # parts per stage; None: the schedule's default
    precision: str = "fp32"
    transport: str = "auto"  # nccl when the stages are on CUDA, gloo otherwise (pk.PipelineEngine)
    partition: str = "parameters"
    steps: int = 450
    seed: int = 0
    lr: float = 3e-3
    dim: int = 96
    layers: int = 4
    heads: int = 4
    context: int = 64
    data: str | None = None
    corpus_bytes: int = 2_000_000
    out: str = "pipekernel-out"
    every: int = 10
    sample_bytes: int = 240
    prompt: str = "def "
    timeout: float = 300.0
    progress: bool = True
    threads: int = 1
    save_every: int = 0
    keep_last: int = 3  # checkpoints kept by --save-every (0: all)
    resume: bool | str = False  # True: the latest checkpoint, if any; a str: that tag
    checkpoint_dir: str | None = None
    rank_order: str = "tp-dp-pp"  # innermost axis first; see pipekernel.grid.topology
    zero_stage: int = 0
    hf: str | None = None  # a Hugging Face model instead of the built-in GPT (apps/hf_model.py)
    experts: int = 0  # > 0: every block's MLP is a mixture of this many experts (pk.MoE)
    top_k: int = 2  # experts per token
    expert_parallel: int = 1  # replicas each stage's experts are spread over
    pack: bool = False  # documents packed into rows, attention within each (docs/sequences.md)
    check_every: int = 100  # the sentinel's invariants every N steps (0: off; docs/faults.md)
    verify_every: int = 0  # replay-check every N-th step's batch before training it (0: off)
    seq_chunks: int = 1  # > 1: each micro-batch cut along the sequence (Seq1F1B)
    # activation recomputation: "" (the module's: none), an interval for every stage, or
    # one per stage "1,0" (0: none; 1: every layer); see pipekernel.engine.recompute_option
    recompute: str = ""
    offload: bool = False  # schedule-aware activation offload to pinned host memory (CUDA)

    @property
    def checkpoints(self) -> str:
        """Where checkpoints go: ``--checkpoint-dir``, default ``<out>/checkpoints``."""
        import os
        return self.checkpoint_dir or os.path.join(self.out, "checkpoints")

    @property
    def world_size(self) -> int:
        return self.stages * self.data_parallel

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batches * self.micro_batch_size * self.context * self.data_parallel


def partition_method(text: str) -> str | list[int]:
    """``"0,3,6"`` -> explicit boundaries ``[0, 3, 6]``; any other text is a method name
    (the ``--partition`` flag's two forms)."""
    parts = text.split(",")
    if len(parts) > 1 and all(p.strip().isdigit() for p in parts):
        return [int(p) for p in parts]
    return text
