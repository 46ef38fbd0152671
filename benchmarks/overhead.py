"""Per-instruction overhead of the kernel + runtime, measured (issue 9).

Trains a model whose layers are 1x1 linears (compute ~ nothing) with every schedule, on
1 stage (no communication) and on 2 gloo stages (the communication path: plan, packing,
batch_isend_irecv, header check, unpacking), and reports wall time per step divided by the
number of instructions the busiest stage runs per step. Compute is not zero (a 1x1
linear's forward and backward through autograd), so the numbers are upper bounds on what
the kernel and runtime add per instruction; the last column is torch autograd's share,
measured as the same layers' forward + backward on one process, per instruction.

    python benchmarks/overhead.py [--steps 200] [--rounds 3]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import pipekernel as pk


def _model(stages: int, parts: int) -> pk.PipelineModule:
    layers = [pk.LayerSpec(nn.Linear, 1, 1) for _ in range(2 * parts)]
    return pk.PipelineModule(layers, loss_fn=nn.MSELoss(), num_stages=stages,
                             partition="uniform", seed=0)


def _data(micro_batches: int):
    return [(torch.ones(1, 1), torch.zeros(1, 1)) for _ in range(micro_batches)]


def worker(stages: int, schedule: str, chunks: int, micro_batches: int, steps: int,
           rounds: int) -> tuple[float, int]:
    engine = pk.PipelineEngine(_model(stages, stages * chunks),
                               optimizer=lambda p: torch.optim.SGD(p, lr=1e-3),
                               micro_batches=micro_batches, schedule=schedule, chunks=chunks,
                               timeout=60)
    data = _data(micro_batches)
    for _ in range(5):
        engine.train_batch(iter(data))
    times = []
    for _ in range(rounds):
        engine.transport.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            engine.train_batch(iter(data))
        times.append((time.perf_counter() - start) / steps)
    instructions = len(engine._program(engine.schedule_cls).stream)
    engine.close()
    return statistics.median(times), instructions


def autograd_share(parts: int, micro_batches: int, steps: int) -> float:
    model = nn.Sequential(*[nn.Linear(1, 1) for _ in range(2 * parts)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.ones(1, 1), torch.zeros(1, 1)
    start = time.perf_counter()
    for _ in range(steps):
        for _ in range(micro_batches):
            (nn.functional.mse_loss(model(x), y) / micro_batches).backward()
        opt.step()
        opt.zero_grad()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--micro-batches", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    m = args.micro_batches
    print("| stages | schedule | chunks | instructions/step (busiest) | s/step | us/instruction | "
          "autograd us/instruction |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    cases = [(1, "1f1b", 1), (1, "gpipe", 1), (2, "1f1b", 1), (2, "gpipe", 1),
             (2, "interleaved", 2), (2, "zb-h1", 1), (2, "zbv", 2)]
    for stages, schedule, chunks in cases:
        results = pk.launch(worker, stages, (stages, schedule, chunks, m, args.steps,
                                             args.rounds), timeout=600)
        seconds = max(r[0] for r in results)
        instructions = max(r[1] for r in results)
        parts = stages * chunks
        base = autograd_share(parts, m, args.steps) * 1e6 / stages / instructions
        print(f"| {stages} | {schedule} | {chunks} | {instructions} | {seconds:.5f} | "
              f"{seconds * 1e6 / instructions:.1f} | {base:.1f} |", flush=True)


if __name__ == "__main__":
    main()
