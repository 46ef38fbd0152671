"""What ``pipekernel.hf.pipeline_module`` costs: the wrapped Llama against the same Hugging
Face layers written by hand as ``LayerSpec``s, trained side by side.

    python benchmarks/hf_overhead.py [--hidden 256] [--layers 4] [--rounds 6] [--steps 3]

Two stages (local gloo processes, CPU). The hand-written pipeline is the glue a user
writes today: an embedding layer that also computes the rotary ``(cos, sin)``, a wrapper
per decoder layer that passes them on in a dict, a norm + head layer; the causal mask is
left to SDPA (no padding). Both engines are built in the same processes from the same
model and run in interleaved rounds (``steps`` batches each per round); the report is the
median over rounds of the wrapped / hand-written step time (wall, and CPU seconds per rank,
which other jobs on a loaded machine disturb less), the same for forward + backward of all
layers in one process (no communication), and the losses of both (equal when the two
compute the same thing).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

import pipekernel as pk

MICRO_BATCHES, ROWS, SEQ = 4, 4, 64


def model(hidden: int, layers: int):
    from transformers import AutoModelForCausalLM, LlamaConfig
    config = LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=SEQ, tie_word_embeddings=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


class HandEmbed(nn.Module):
    def __init__(self, hf_model) -> None:
        super().__init__()
        self.embed = copy.deepcopy(hf_model.model.embed_tokens)
        self.rotary = copy.deepcopy(hf_model.model.rotary_emb)

    def forward(self, inputs: dict) -> dict:
        ids = inputs["input_ids"]
        h = self.embed(ids)
        pos = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
        cos, sin = self.rotary(h, pos)
        return {"h": h, "cos": cos, "sin": sin, "pos": pos}


class HandLayer(nn.Module):
    def __init__(self, hf_model, j: int) -> None:
        super().__init__()
        self.layer = copy.deepcopy(hf_model.model.layers[j])

    def forward(self, x: dict) -> dict:
        h = self.layer(x["h"], attention_mask=None, position_embeddings=(x["cos"], x["sin"]),
                       position_ids=x["pos"])
        return {**x, "h": h}


class HandHead(nn.Module):
    def __init__(self, hf_model) -> None:
        super().__init__()
        self.norm = copy.deepcopy(hf_model.model.norm)
        self.head = copy.deepcopy(hf_model.lm_head)

    def forward(self, x: dict) -> torch.Tensor:
        return self.head(self.norm(x["h"]))


def hand_module(hf_model, layers: int, bounds: list[int]) -> pk.PipelineModule:
    import pipekernel.hf as hf  # the same loss and dict batches as the wrapped model
    specs = [pk.LayerSpec(HandEmbed, hf_model),
             *(pk.LayerSpec(HandLayer, hf_model, j) for j in range(layers)),
             pk.LayerSpec(HandHead, hf_model)]
    return pk.PipelineModule(specs, loss_fn=hf.causal_lm_loss, partition=bounds,
                             batch_fn=hf.split_batch)


def data(step: int) -> list:
    g = torch.Generator().manual_seed(step)
    out = []
    for _ in range(MICRO_BATCHES):
        ids = torch.randint(0, 512, (ROWS, SEQ), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def worker(hidden: int, layers: int, rounds: int, steps: int) -> dict:
    import pipekernel.hf as hf
    hf_model = model(hidden, layers)
    bounds = [0, layers // 2 + 1, layers + 2]  # the same split for both
    sgd = (lambda p: torch.optim.SGD(p, lr=1e-2))
    wrapped = pk.PipelineEngine(hf.pipeline_module(hf_model, partition=bounds), optimizer=sgd,
                                micro_batches=MICRO_BATCHES, loss_reduction="tokens")
    hand = pk.PipelineEngine(hand_module(hf_model, layers, bounds), optimizer=sgd, micro_batches=MICRO_BATCHES,
                             loss_reduction="tokens")
    times = {"wrapped": [], "hand": []}
    cpu = {"wrapped": [], "hand": []}
    losses = {"wrapped": [], "hand": []}
    for engine in (wrapped, hand):  # warm-up: metadata handshakes, allocator
        engine.train_batch(iter(data(10_000)))
    for r in range(rounds):
        order = (("wrapped", wrapped), ("hand", hand)) if r % 2 == 0 else \
            (("hand", hand), ("wrapped", wrapped))
        for name, engine in order:
            start, start_cpu = time.perf_counter(), time.process_time()
            for s in range(steps):
                losses[name].append(engine.train_batch(iter(data(r * steps + s))).item())
            times[name].append((time.perf_counter() - start) / steps)
            cpu[name].append((time.process_time() - start_cpu) / steps)
    wrapped.close()
    hand.close()
    return {"times": times, "cpu": cpu, "losses": losses}


def one_process(hidden: int, layers: int, rounds: int) -> tuple[float, float, float]:
    """Median CPU seconds of forward + backward over every layer, built as one stage, and
    the median of the per-round ratios: the wrapper's cost without communication."""
    import pipekernel.hf as hf
    torch.set_num_threads(1)
    hf_model = model(hidden, layers)
    n = layers + 2
    stacks = {"wrapped": hf.pipeline_module(hf_model).build_stage(0, [0, n]),
              "hand": hand_module(hf_model, layers, [0, n]).build_stage(0, [0, n])}
    inputs = {"input_ids": data(0)[0]["input_ids"]}
    seconds = {"wrapped": [], "hand": []}
    for r in range(rounds + 1):
        for name in (("wrapped", "hand") if r % 2 else ("hand", "wrapped")):
            start = time.process_time()
            loss, count = hf.causal_lm_loss(stacks[name](inputs), inputs["input_ids"])
            loss.backward()
            if r:  # round 0 warms up
                seconds[name].append(time.process_time() - start)
    ratios = [w / h for w, h in zip(seconds["wrapped"], seconds["hand"])]
    return (statistics.median(seconds["wrapped"]), statistics.median(seconds["hand"]),
            statistics.median(ratios))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    results = pk.launch(worker, 2, (args.hidden, args.layers, args.rounds, args.steps),
                        timeout=3600)
    result = results[0]
    print(f"Llama hidden {args.hidden}, {args.layers} layers, 2 stages, {MICRO_BATCHES} "
          f"micro-batches of {ROWS}x{SEQ} tokens, {args.rounds} interleaved rounds of "
          f"{args.steps} steps")
    t = result["times"]
    for what, series in (("wall", t), *((f"CPU rank {r}", x["cpu"]) for r, x in
                                        enumerate(results))):
        ratios = [w / h for w, h in zip(series["wrapped"], series["hand"])]
        print(f"{what} seconds per step, median: wrapped {statistics.median(series['wrapped']):.4f}"
              f", hand-written {statistics.median(series['hand']):.4f}; wrapped / hand-written "
              f"per round: {', '.join(f'{x:.3f}' for x in ratios)}; median "
              f"{statistics.median(ratios):.3f}")
    one = one_process(args.hidden, args.layers, 5 * args.rounds)
    print(f"one process, forward + backward of all layers (CPU seconds, {5 * args.rounds} "
          f"interleaved rounds): wrapped {one[0]:.4f}, hand-written {one[1]:.4f}, median of "
          f"the per-round ratios {one[2]:.3f}")
    diff = max(abs(a - b) for a, b in zip(result["losses"]["wrapped"], result["losses"]["hand"]))
    print(f"largest loss difference between the two: {diff:.2e}")


if __name__ == "__main__":
    main()
