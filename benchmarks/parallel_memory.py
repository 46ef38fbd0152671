"""Per-rank memory and step time of plain data parallelism, ZeRO-1 and FSDP2 inside a stage
(issue 28, item 8).

    python benchmarks/parallel_memory.py [--model gpt|mlp] [--width 256] [--layers 8]
                                         [--seq 128] [--micro-batches N] [--steps 3]
                                         [--degrees 2 4] [--modes dp zero1 fsdp]

For each data-parallel degree ``D`` (one stage, ``D`` local gloo processes) and each mode:

* ``dp``    — ``data_parallel_size=D``: everything replicated, gradients all-reduced;
* ``zero1`` — ``zero_stage=1``: the optimizer state sharded over the replicas;
* ``fsdp``  — ``data_parallel_shard=D``: parameters, gradients and optimizer state sharded
  with FSDP2 (``fully_shard`` per layer), timed by the schedule;

it prints, per rank (the largest rank), the bytes of parameters, gradients (after the
reduction, before ``zero_grad``: measured from a hook on the optimizer's step) and
optimizer state counted from the tensors themselves (a DTensor counts its local shard),
the peak RSS of the process, and the median step time over ``--steps`` steps after one
warm-up, beside plain DP in the same run, as wall time and as the process's CPU time
(``cpu s``: all its threads, gloo's included; waits cost none, so it moves less with
other load on the machine than the wall time does, and shows what each mode computes). fp32, AdamW. Models (``--model``):

* ``gpt`` (default): the d=256 GPT of ``benchmarks/vs_torch.py`` (imported, not copied):
  Embedding(512, d) -> ``layers`` x causal TransformerEncoderLayer(d, nhead=4, 4d) ->
  LayerNorm -> Linear(d, 512), cross-entropy on the next token, micro-batches of 4
  sequences of ``--seq`` tokens, 8 micro-batches per step by default (vs_torch's);
* ``mlp``: ``layers`` x (Linear(width, width), tanh), MSE, micro-batches of 8 rows,
  4 per step by default: almost no compute per parameter, so it shows FSDP2's fixed costs.

``p+g+s/tot`` is the rank's parameters + gradients + optimizer state over 4 x the
model's parameter bytes (parameters, gradients and AdamW's two moments, unsharded).
Targets (issue 28): FSDP2 state per rank <= 1.1 x total / D; step time <= 1.1 x
plain DP at D = 2 on the d=256 GPT. Run it with nothing else on the machine; no numbers
are recorded here.
"""
from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

import pipekernel as pk

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_torch  # noqa: E402  (the d=256 GPT: its blocks, vocabulary and loss)

MODES = {"dp": {}, "zero1": {"zero_stage": 1}, "fsdp": "shard"}


def _model(model: str, width: int, layers: int) -> pk.PipelineModule:
    if model == "gpt":
        specs: list = [pk.LayerSpec(nn.Embedding, vs_torch.VOCAB, width),
                       *[pk.LayerSpec(vs_torch.CausalBlock, width) for _ in range(layers)],
                       pk.LayerSpec(nn.LayerNorm, width),
                       pk.LayerSpec(nn.Linear, width, vs_torch.VOCAB)]
        return pk.PipelineModule(specs, loss_fn=vs_torch.loss_fn, num_stages=1,
                                 partition="uniform", seed=vs_torch.SEED)
    specs = []
    for _ in range(layers):
        specs += [pk.LayerSpec(nn.Linear, width, width), torch.tanh]
    return pk.PipelineModule(specs, loss_fn=nn.MSELoss(), num_stages=1, partition="uniform",
                             seed=0)


def _parameter_bytes(module: pk.PipelineModule) -> int:
    """The whole model's fp32 parameter bytes, from its layers built as one process would."""
    with torch.random.fork_rng(devices=[]):
        layers = [module.build_layer(i) for i in range(len(module.layers))]
    return sum(p.numel() * p.element_size() for layer in layers
               if isinstance(layer, nn.Module) for p in layer.parameters())


def _data(model: str, width: int, seq: int, micro_batches: int, step: int, replica: int):
    g = torch.Generator().manual_seed(1000 * step + replica)
    if model == "gpt":
        ids = torch.randint(0, vs_torch.VOCAB, (micro_batches, vs_torch.MICRO, seq + 1),
                            generator=g)
        return [(x[:, :-1].contiguous(), x[:, 1:].contiguous()) for x in ids]
    return [(torch.randn(8, width, generator=g), torch.randn(8, width, generator=g))
            for _ in range(micro_batches)]


def _local_bytes(tensors) -> int:
    total = 0
    for t in {id(t): t for t in tensors if t is not None}.values():
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def _state_bytes(optimizer) -> int:
    inner = getattr(optimizer, "inner", optimizer)  # ZeRO-1 wraps the shard's optimizer
    return _local_bytes(v for state in inner.state.values() for v in state.values()
                        if isinstance(v, torch.Tensor))


def worker(mode: str, degree: int, model: str, width: int, layers: int, seq: int,
           micro_batches: int, steps: int):
    torch.set_num_threads(1)
    options = {"data_parallel_shard": degree} if MODES[mode] == "shard" else \
        {"data_parallel_size": degree, **MODES[mode]}
    engine = pk.PipelineEngine(_model(model, width, layers), micro_batches=micro_batches,
                               optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4), timeout=600,
                               **options)
    grads = [0]
    optimizer = engine.optimizer
    step = optimizer.step

    def measured_step(*args, **kwargs):  # the gradients exist here, reduced
        grads[0] = _local_bytes(p.grad for p in engine.module.parameters())
        return step(*args, **kwargs)

    optimizer.step = measured_step
    seconds, cpu = [], []
    for s in range(steps + 1):
        start, start_cpu = time.perf_counter(), time.process_time()
        engine.train_batch(iter(_data(model, width, seq, micro_batches, s,
                                      engine.data_parallel_rank)))
        if s:
            seconds.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    out = {"params": _local_bytes(engine.module.parameters()), "grads": grads[0],
           "state": _state_bytes(engine.optimizer),
           "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "step": statistics.median(seconds), "cpu": statistics.median(cpu)}
    engine.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("gpt", "mlp"), default="gpt")
    parser.add_argument("--width", type=int, default=256, help="d (gpt) or features (mlp)")
    parser.add_argument("--layers", type=int, default=8, help="blocks (gpt) or Linears (mlp)")
    parser.add_argument("--seq", type=int, default=128, help="sequence length (gpt)")
    parser.add_argument("--micro-batches", type=int, default=None,
                        help="per step: 8 (gpt, vs_torch's) or 4 (mlp) by default")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--degrees", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--modes", nargs="+", choices=tuple(MODES), default=list(MODES),
                        help="dp is always run first: the others are timed beside it")
    a = parser.parse_args()
    micro = a.micro_batches or (8 if a.model == "gpt" else 4)
    total = _parameter_bytes(_model(a.model, a.width, a.layers))
    shape = (f"GPT d={a.width}, {a.layers} blocks, sequence {a.seq}, {micro} micro-batches "
             f"of {vs_torch.MICRO} sequences" if a.model == "gpt" else
             f"{a.layers} x Linear({a.width}, {a.width}), {micro} micro-batches of 8 rows")
    print(f"model: {shape}; fp32 parameters {total} bytes")
    print(f"{'D':>2} {'mode':>6} {'params':>10} {'grads':>10} {'state':>10} {'p+g+s/tot':>9} "
          f"{'rss MiB':>8} {'step s':>8} {'vs dp':>6} {'cpu s':>7} {'vs dp':>6}")
    for degree in a.degrees:
        base = base_cpu = None
        for mode in ["dp", *(m for m in a.modes if m != "dp")]:
            rows = pk.launch(worker, degree, (mode, degree, a.model, a.width, a.layers,
                                              a.seq, micro, a.steps))
            worst = max(rows, key=lambda r: r["params"] + r["grads"] + r["state"])
            step, cpu = max(r["step"] for r in rows), max(r["cpu"] for r in rows)
            base, base_cpu = (step, cpu) if mode == "dp" else (base, base_cpu)
            ratio = (worst["params"] + worst["grads"] + worst["state"]) / (4 * total)
            print(f"{degree:>2} {mode:>6} {worst['params']:>10} {worst['grads']:>10} "
                  f"{worst['state']:>10} {ratio:>9.3f} {worst['rss'] / 2**20:>8.0f} "
                  f"{step:>8.3f} {step / base:>6.2f} {cpu:>7.3f} {cpu / base_cpu:>6.2f}")


if __name__ == "__main__":
    main()
