"""Per-rank memory and step time of plain data parallelism, ZeRO-1 and FSDP2 inside a stage
(issue 28, item 8).

    python benchmarks/parallel_memory.py [--width 256] [--layers 8] [--micro-batches 4]
                                         [--steps 3] [--degrees 2 4]

For each data-parallel degree ``D`` (one stage, ``D`` local gloo processes) and each mode:

* ``dp``    — ``data_parallel_size=D``: everything replicated, gradients all-reduced;
* ``zero1`` — ``zero_stage=1``: the optimizer state sharded over the replicas;
* ``fsdp``  — ``data_parallel_shard=D``: parameters, gradients and optimizer state sharded
  with FSDP2 (``fully_shard`` per layer), timed by the schedule;

it prints, per rank (the largest rank), the bytes of parameters, gradients (after the
reduction, before ``zero_grad``: measured from a hook on the optimizer's step) and
optimizer state counted from the tensors themselves (a DTensor counts its local shard),
the peak RSS of the process, and the median step time over ``--steps`` steps after one
warm-up, beside plain DP in the same run. fp32, AdamW, ``layers`` x (Linear(width, width),
tanh). Targets (issue 28): FSDP2 state per rank <= 1.1 x total / D; step time <= 1.1 x
plain DP at D = 2. Run it with nothing else on the machine; no numbers are recorded here.
"""
from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch
from torch import nn

import pipekernel as pk

MODES = {"dp": {}, "zero1": {"zero_stage": 1}, "fsdp": "shard"}


def _model(width: int, layers: int) -> pk.PipelineModule:
    specs: list = []
    for _ in range(layers):
        specs += [pk.LayerSpec(nn.Linear, width, width), torch.tanh]
    return pk.PipelineModule(specs, loss_fn=nn.MSELoss(), num_stages=1, partition="uniform",
                             seed=0)


def _data(width: int, micro_batches: int, step: int, replica: int):
    g = torch.Generator().manual_seed(1000 * step + replica)
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


def worker(mode: str, degree: int, width: int, layers: int, micro_batches: int, steps: int):
    torch.set_num_threads(1)
    options = {"data_parallel_shard": degree} if MODES[mode] == "shard" else \
        {"data_parallel_size": degree, **MODES[mode]}
    engine = pk.PipelineEngine(_model(width, layers), micro_batches=micro_batches,
                               optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4), timeout=600,
                               **options)
    grads = [0]
    optimizer = engine.optimizer
    step = optimizer.step

    def measured_step(*args, **kwargs):  # the gradients exist here, reduced
        grads[0] = _local_bytes(p.grad for p in engine.module.parameters())
        return step(*args, **kwargs)

    optimizer.step = measured_step
    seconds = []
    for s in range(steps + 1):
        start = time.perf_counter()
        engine.train_batch(iter(_data(width, micro_batches, s, engine.data_parallel_rank)))
        if s:
            seconds.append(time.perf_counter() - start)
    out = {"params": _local_bytes(engine.module.parameters()), "grads": grads[0],
           "state": _state_bytes(engine.optimizer),
           "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "step": statistics.median(seconds)}
    engine.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--degrees", type=int, nargs="+", default=[2, 4])
    a = parser.parse_args()
    total = a.layers * (a.width * a.width + a.width) * 4
    print(f"model: {a.layers} x Linear({a.width}, {a.width}), fp32 parameters {total} bytes")
    print(f"{'D':>2} {'mode':>6} {'params':>10} {'grads':>10} {'state':>10} {'p+g+s/tot':>9} "
          f"{'rss MiB':>8} {'step s':>8} {'vs dp':>6}")
    for degree in a.degrees:
        base = None
        for mode in MODES:
            rows = pk.launch(worker, degree, (mode, degree, a.width, a.layers,
                                              a.micro_batches, a.steps))
            worst = max(rows, key=lambda r: r["params"] + r["grads"] + r["state"])
            step = max(r["step"] for r in rows)
            base = step if mode == "dp" else base
            ratio = (worst["params"] + worst["grads"] + worst["state"]) / (4 * total)
            print(f"{degree:>2} {mode:>6} {worst['params']:>10} {worst['grads']:>10} "
                  f"{worst['state']:>10} {ratio:>9.3f} {worst['rss'] / 2**20:>8.0f} "
                  f"{step:>8.3f} {step / base:>6.2f}")


if __name__ == "__main__":
    main()
