"""Train an unmodified Hugging Face Llama through a 2-stage pipeline, then load it back.

    python examples/hf_llama.py [--steps 20] [--stages 2] [--out DIR]

A small random ``LlamaConfig`` is saved with ``save_pretrained`` (so nothing is
downloaded); each pipeline stage reads only its own tensors from that directory, trains on
padded Hugging Face style dict micro-batches with the token-weighted causal-LM loss, and
``pipekernel.hf.save_pretrained`` writes the result, which ``AutoModelForCausalLM``
loads. Any decoder-only causal LM checkpoint directory works the same way.
"""
from __future__ import annotations

import argparse
import os
import tempfile

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import pipekernel as pk
import pipekernel.hf as hf

VOCAB, LENGTH, ROWS, MICRO_BATCHES = 64, 16, 4, 4


def make_checkpoint(directory: str) -> None:
    """A small random Llama (RoPE, grouped-query attention), saved as a user's would be."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=LENGTH)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)


def batches(step: int, replica: int):
    """Padded micro-batches of counting sequences (learnable): labels -100 on padding."""
    g = torch.Generator().manual_seed(1000 * step + replica)
    for _ in range(MICRO_BATCHES):
        start = torch.randint(0, VOCAB, (ROWS, 1), generator=g)
        ids = (start + torch.arange(LENGTH)) % VOCAB
        lengths = torch.randint(LENGTH // 2, LENGTH + 1, (ROWS, 1), generator=g)
        mask = (torch.arange(LENGTH) < lengths).long()
        yield {"input_ids": ids * mask, "attention_mask": mask,
               "labels": ids.masked_fill(mask == 0, -100)}


def main(steps: int, directory: str, out: str) -> list[float]:
    module = hf.pipeline_module(directory)  # each stage loads only its own layers
    engine = pk.PipelineEngine(module, optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3),
                               micro_batches=MICRO_BATCHES, loss_reduction="tokens")
    losses = [engine.train_batch(batches(step, engine.data_parallel_rank)).item()
              for step in range(steps)]
    hf.save_pretrained(engine, out)
    engine.close()
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--out", default=None, help="where to save (default: a temporary dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        start, out = os.path.join(tmp, "start"), args.out or os.path.join(tmp, "trained")
        make_checkpoint(start)
        losses = pk.launch(main, args.stages, (args.steps, start, out))[0]
        model = AutoModelForCausalLM.from_pretrained(out)  # back in plain transformers
        print(f"loaded {type(model).__name__} with "
              f"{sum(p.numel() for p in model.parameters())} parameters from {out}")
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {args.steps} steps on "
              f"{args.stages} stages")
