"""A dualpipev pair with and without the overlap of expert all-to-alls (issue 30, item 3).

``P`` gloo processes form one expert-parallel group; each holds ``1/P`` of the experts of
two chunks of MoE layers (pipekernel's own :class:`pipekernel.MoE`, one lane — process
group — per chunk, as the engine makes them for ``dualpipev``). One *pair* is the forward
of chunk 0 on one micro-batch and the backward of chunk 1 on another, what a
``ForwardBackward`` of ``dualpipev``'s steady state computes:

* ``F + B``: the forward, then the backward (:func:`pipekernel.stage.paired.sequential`,
  what a stage runs by default);
* ``paired``: :func:`pipekernel.overlap_all_to_all` — the forward in a worker thread while
  the backward runs, each half's dispatch/combine all-to-alls on its chunk's lane.

It also prints, per MoE layer, the measured all-to-all time of one dispatch and the local
experts' compute on the same rows, and their ratio in a pair (per layer four all-to-alls —
dispatch, combine and their backwards — against the experts' forward and backward), so a
reader sees whether the all-to-all is comparable to the expert compute (the regime the
overlap is for); and the load average before and after (figures taken while other work
runs are not comparable). The two executors run in interleaved rounds (one pair each per
round, their order alternating), and the ratio printed is the median of the rounds'
ratios, so load that comes and goes falls on both alike. The issue's target:
``paired <= 0.8 x (F + B)``.

The default (8192 tokens x 512, expert hidden 8) is one where the all-to-all is comparable
to the expert compute on gloo's loopback (about 1 in a pair): a thin expert keeps the
compute per row small while every row still crosses twice per layer each way. With a wide
expert (``--hidden 512``) the all-to-all is a small share and there is little to hide.

Usage::

    python benchmarks/paired_overlap.py [--procs 2] [--tokens 8192] [--dim 512]
        [--hidden 8] [--experts 8] [--layers 2] [--repeats 6] [--threads 1]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import pipekernel as pk
from pipekernel.grid import expert_parallel
from pipekernel.stage.paired import sequential


class Chunk:
    """``module0`` / ``module1`` of the paired contract: one chunk's layers on its lane."""

    def __init__(self, layers: nn.Module, chunk: int) -> None:
        self.layers, self.chunk = layers, chunk

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        with expert_parallel.lane(self.chunk):
            return self.layers(x)


def _group(procs: int) -> expert_parallel.ExpertParallelGroup:
    ranks = list(range(procs))
    lane0, lane1 = dist.new_group(ranks), dist.new_group(ranks)
    return expert_parallel.ExpertParallelGroup(dist.get_rank(), procs, procs, lane0, ranks,
                                               lanes=[lane1])


def _chunks(args: argparse.Namespace, ep) -> tuple[Chunk, Chunk]:
    torch.manual_seed(0)
    with expert_parallel.context(ep):
        parts = [nn.Sequential(*[pk.MoE(args.dim, args.hidden, args.experts, top_k=2,
                                        aux_loss_coef=0.0) for _ in range(args.layers)])
                 for _ in range(2)]
    return Chunk(parts[0], 0), Chunk(parts[1], 1)


def _one_pair(executor, chunk0: Chunk, chunk1: Chunk, args: argparse.Namespace,
              k: int) -> float:
    """Seconds of one pair under ``executor`` (the backward half's graph built before, as
    the schedule did, outside the timing)."""
    g = torch.Generator().manual_seed(k)
    x0 = torch.randn(args.tokens, args.dim, generator=g)
    x1 = torch.randn(args.tokens, args.dim, generator=g, requires_grad=True)
    out1 = chunk1(x1)  # the backward half's forward, earlier in the schedule
    dist.barrier()
    start = time.perf_counter()
    executor(chunk0, x0, None, None, chunk1, None, [out1], [torch.ones_like(out1)])
    return time.perf_counter() - start


def _pair_times(chunk0: Chunk, chunk1: Chunk, args: argparse.Namespace) -> dict:
    """Interleaved rounds: in each, one pair run apart (F + B) and one overlapped on the
    same inputs, their order alternating, so load that comes and goes (other work on the
    machine) falls on both alike; the medians and the median of the rounds' ratios."""
    apart, paired = [], []
    for k in range(args.repeats + 1):
        runs = [(sequential, apart), (pk.overlap_all_to_all, paired)]
        for executor, times in (runs if k % 2 == 0 else runs[::-1]):
            times.append(_one_pair(executor, chunk0, chunk1, args, k))
    apart, paired = apart[1:], paired[1:]  # the first round warms the groups up
    return {"apart": statistics.median(apart), "paired": statistics.median(paired),
            "ratios": [p / a for p, a in zip(paired, apart)]}


def _a2a_and_experts(chunk: Chunk, args: argparse.Namespace) -> tuple[float, float]:
    """Median seconds of one dispatch all-to-all of ``tokens * 2`` rows and of the local
    experts' compute on as many rows (forward and backward)."""
    layer, ep = chunk.layers[0], chunk.layers[0].ep
    rows = args.tokens * 2
    split = [rows // ep.size] * ep.size
    sizes = [rows // layer.local_experts] * layer.local_experts
    comm, compute = [], []
    for _ in range(args.repeats + 1):
        x = torch.randn(rows, args.dim, requires_grad=True)
        dist.barrier()
        start = time.perf_counter()
        ep.all_to_all(x, split, split).sum().backward()
        comm.append((time.perf_counter() - start) / 2)  # the forward's and the backward's
        start = time.perf_counter()
        layer._experts(x, sizes).sum().backward()
        compute.append(time.perf_counter() - start)
    return statistics.median(comm[1:]), statistics.median(compute[1:])  # first: warm-up


def _rank(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    try:
        chunk0, chunk1 = _chunks(args, _group(args.procs))
        a2a, experts = _a2a_and_experts(chunk0, args)
        return {"a2a": a2a, "experts": experts, "threads": torch.get_num_threads(),
                **_pair_times(chunk0, chunk1, args)}
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=8)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    before = os.getloadavg()
    results = pk.launch(_rank, args.procs, (args,), timeout=600)
    _report(args, results, before, os.getloadavg())


def _report(args: argparse.Namespace, results: list[dict], before: tuple,
            after: tuple) -> None:
    """The slowest rank's figures; the ratio is the median over the rounds of the slowest
    rank's paired / F + B (each round's two runs taken back to back)."""
    worst = {key: max(r[key] for r in results) for key in ("a2a", "experts", "apart",
                                                           "paired")}
    rounds = [max(r["ratios"][i] for r in results) for i in range(len(results[0]["ratios"]))]
    print(f"{args.procs} gloo processes, {args.layers} MoE layer(s) per chunk, "
          f"{args.experts} experts (top 2), {args.tokens} tokens x {args.dim}, hidden "
          f"{args.hidden}, {results[0]['threads']} torch thread(s) each")
    # a pair: per MoE layer, the forward half a dispatch and a combine, the backward half
    # their two backwards (4 all-to-alls), and the local experts' forward and backward
    share = 4 * worst["a2a"] / worst["experts"]
    print(f"  one dispatch all-to-all : {worst['a2a'] * 1e3:8.2f} ms   local experts "
          f"(fwd+bwd, same rows): {worst['experts'] * 1e3:8.2f} ms")
    print(f"  a2a / expert compute in a pair (4 all-to-alls per layer / experts fwd+bwd): "
          f"{share:.2f}")
    print(f"  F + B (one after other) : {worst['apart'] * 1e3:8.2f} ms")
    print(f"  paired (overlapped)     : {worst['paired'] * 1e3:8.2f} ms")
    print(f"  paired / (F + B), {len(rounds)} interleaved rounds: median "
          f"{statistics.median(rounds):.2f}, min {min(rounds):.2f}, max {max(rounds):.2f} "
          f"(target <= 0.80)")
    print(f"  load average before {before[0]:.2f}, after {after[0]:.2f} "
          f"({os.cpu_count()} CPUs): figures under load are not comparable")


if __name__ == "__main__":
    main()
