"""Peak memory per pipeline rank of a Hugging Face Llama loaded stage by stage, against
training the whole model in one process.

    python benchmarks/hf_memory.py [--hidden 1024] [--layers 16] [--stages 4]

The checkpoint is written piece by piece (one decoder layer in memory at a time), so no
process here ever holds the whole model except the one that measures one training
step of it (``AutoModelForCausalLM.from_pretrained``, SGD, the same tokens). Each pipeline rank then builds its stage with
``pipekernel.hf.pipeline_module(directory)``, runs one training step (SGD, no optimizer
state), and reports its peak RSS growth (``ru_maxrss`` after minus the RSS before: the imports
are not counted), the checkpoint bytes it read and its own parameter bytes. Local gloo
processes on the CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile

import torch

import pipekernel as pk

MB = 2 ** 20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _rss_mb() -> float:
    """Resident memory now (the baseline: the process's peak may lie above it)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MB


def config(hidden: int, layers: int):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                       num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4,
                       max_position_embeddings=256, tie_word_embeddings=False)


def write_checkpoint(directory: str, cfg) -> int:
    """A random checkpoint of ``cfg``, one piece at a time; its size in bytes."""
    from safetensors.torch import save_file

    from pipekernel.hf.structure import find_structure
    from pipekernel.hf.weights import ConfigSource
    source = ConfigSource(cfg)
    s = find_structure(source.model)
    pieces = [s.embed, *s.prologue, *(f"{s.layers}.{j}" for j in range(s.num_layers)), *s.tail,
              s.lm_head]
    weight_map, total = {}, 0
    for i, path in enumerate(pieces):
        torch.manual_seed(i)
        state = {f"{path}.{k}": v.contiguous() for k, v in source.build(path).state_dict().items()}
        if not state:
            continue
        name = f"model-{i:05d}.safetensors"
        save_file(state, os.path.join(directory, name), metadata={"format": "pt"})
        for key, value in state.items():
            weight_map[key] = name
            total += value.numel() * value.element_size()
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    cfg.save_pretrained(directory)
    return total


def whole(directory: str, seq: int) -> dict:
    """Peak RSS growth of one training step of the whole model in one process (loaded with
    ``from_pretrained``, whose memory-mapped tensors are read when first used)."""
    from transformers import AutoModelForCausalLM

    import pipekernel.hf as hf
    before = _rss_mb()
    model = AutoModelForCausalLM.from_pretrained(directory)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 32000, (1, seq), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        loss, count = hf.causal_lm_loss(model(input_ids=ids).logits, ids)
        (loss / count).backward()
    opt.step()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"peak_growth_mb": _peak_mb() - before, "param_mb": params / MB}


def stage(directory: str, seq: int) -> dict:
    import transformers  # noqa: F401  (imported before measuring, as in whole())

    import pipekernel.hf as hf
    before = _rss_mb()
    module = hf.pipeline_module(directory)
    engine = pk.PipelineEngine(module, optimizer=lambda p: torch.optim.SGD(p, lr=1e-3),
                               micro_batches=2, loss_reduction="tokens", timeout=1200)
    built = _peak_mb() - before
    ids = torch.randint(0, 32000, (1, seq), generator=torch.Generator().manual_seed(0))
    engine.train_batch(iter([{"input_ids": ids, "labels": ids}] * 2))
    own = sum(t.numel() * t.element_size() for t in engine.module.state_dict().values())
    out = {"stage": engine.stage, "built_growth_mb": built, "step_growth_mb": _peak_mb() - before,
           "read_mb": module.source.bytes_read / MB, "own_param_mb": own / MB}
    engine.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        size = write_checkpoint(directory, config(args.hidden, args.layers))
        print(f"checkpoint: {size / MB:.0f} MiB fp32 (Llama, hidden {args.hidden}, "
              f"{args.layers} layers, vocab 32000)")
        ranks = pk.launch(stage, args.stages, (directory, args.seq), timeout=3600)
        one = pk.launch(whole, 1, (directory, args.seq), timeout=3600)[0]
    print(f"whole model, one step in one process: peak RSS +{one['peak_growth_mb']:.0f} "
          f"MiB ({one['param_mb']:.0f} MiB of parameters)")
    print("pipeline rank | stage | read from checkpoint | own parameters | peak RSS growth: "
          "built | after 1 step")
    for r, s in enumerate(ranks):
        print(f"{r:>13} | {s['stage']:>5} | {s['read_mb']:>16.0f} MiB | {s['own_param_mb']:>10.0f} "
              f"MiB | {s['built_growth_mb']:>8.0f} MiB | {s['step_growth_mb']:>8.0f} MiB "
              f"({s['step_growth_mb'] / max(one['peak_growth_mb'], 1):.0%} of whole)")


if __name__ == "__main__":
    main()
