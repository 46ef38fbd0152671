"""schedule="auto": the planner's predicted step time next to the measured one, per candidate.

One launch (``--stages`` gloo processes, one thread each) builds an engine with
``schedule=pk.auto(...)`` on the ``pipekernel train`` model (random bytes as data), then
one engine per candidate of its plan (schedule, chunks, micro-batches and partition set
explicitly), and runs them in rounds that go through every candidate in turn, so the
machine's noise hits all of them alike. Prints, ranked by prediction: the predicted and
the measured (median) step time, the error, and the measured rank; then the median and
mean absolute error and where the chosen plan lands among the measured times.

    python benchmarks/auto_plan.py [--stages 2] [--rounds 3] [--steps 3] [--top N]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import pipekernel as pk
from pipekernel.apps.gpt import gpt_module


def batches(args: argparse.Namespace, micro_batches: int, step: int) -> list:
    rows = args.micro_batches * args.micro_batch_size // micro_batches
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 256, (micro_batches, rows, args.context + 1), generator=g)
    return [(x[:, :-1], x[:, 1:]) for x in ids]


def engine_for(args: argparse.Namespace, candidate: object) -> pk.PipelineEngine:
    c = candidate
    module = gpt_module(args.dim, args.layers, args.heads, args.context,
                        num_stages=args.stages, partition=list(c.bounds), seed=0)
    return pk.PipelineEngine(module, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
                             micro_batches=c.micro_batches, schedule=c.schedule,
                             chunks=c.chunks, check_data_steps=0)


def worker(args: argparse.Namespace) -> dict | None:
    g = torch.Generator().manual_seed(0)
    sample = torch.randint(0, 256, (args.micro_batch_size, args.context), generator=g)
    module = gpt_module(args.dim, args.layers, args.heads, args.context,
                        num_stages=args.stages, seed=0)
    planned = pk.PipelineEngine(
        module, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
        micro_batches=args.micro_batches, check_data_steps=0,
        schedule=pk.auto(sample=sample, repeats=args.repeats, transfer_s=args.transfer_ms / 1e3,
                         split_overhead=args.split_overhead, measure_link=not args.no_link,
                         micro_batches=[int(v) for v in args.counts.split(",")]
                         if args.counts else None))
    plan = planned.plan
    candidates = [c for c in plan.candidates if c.predicted_step_s is not None]
    candidates = candidates[:args.top] if args.top else candidates
    engines = [engine_for(args, c) for c in candidates]
    times: list[list[float]] = [[] for _ in candidates]
    for r in range(args.rounds + 1):  # round 0 warms up
        for i, engine in enumerate(engines):
            for s in range(args.steps):
                data = batches(args, engine.micro_batches, 1000 * r + s)
                start = time.perf_counter()
                engine.train_batch(iter(data))
                if r:
                    times[i].append(time.perf_counter() - start)
    for engine in engines + [planned]:
        engine.close()
    if planned.rank != 0:
        return None
    per_round = [[statistics.median(t[r * args.steps:(r + 1) * args.steps])
                  for r in range(args.rounds)] for t in times]
    return {"plan": plan, "candidates": candidates, "per_round": per_round,
            "measured": [statistics.median(t) for t in times],
            "spread": [(max(t) - min(t)) / statistics.median(t) for t in times]}


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation (ties get their mean rank)."""
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else float("nan")


def calibrated(plan: object, args: argparse.Namespace) -> dict:
    """Predicted seconds per candidate under the calibrated model (same profile)."""
    from pipekernel.engine.planner import search
    from pipekernel.extend.manager import make_plugin_manager, registered_schedules
    from pipekernel.plugins.partition import balance

    table = registered_schedules(make_plugin_manager())
    names = {c.schedule for c in plan.candidates}
    other = search(plan.costs, args.stages, {n: table[n] for n in names}, balance=balance,
                   transfer_s=args.calibrated_transfer_ms / 1e3,
                   split_overhead=args.calibrated_split, link=plan.link)
    return {_key(c): c.predicted_step_s for c in other.candidates}


def _key(c: object) -> tuple:
    return c.schedule, c.chunks, c.micro_batches, tuple(c.bounds)


def report(result: dict, args: argparse.Namespace) -> None:
    plan, candidates, measured = result["plan"], result["candidates"], result["measured"]
    alt = calibrated(plan, args)
    order = sorted(range(len(measured)), key=measured.__getitem__)
    measured_rank = {i: r + 1 for r, i in enumerate(order)}
    print(f"model: byte-level GPT width {args.dim}, {args.layers} blocks, context "
          f"{args.context}; batch {args.micro_batches * args.micro_batch_size} sequences; "
          f"{args.stages} stages; median of {args.rounds} rounds x {args.steps} steps")
    print(f"chosen: {plan.schedule}, chunks {plan.chunks}, {plan.micro_batches} micro-batches, "
          f"partition {plan.partition} {list(plan.bounds)}")
    if plan.link is not None:
        print(f"measured link: {1e6 * plan.link.message_s:.0f} us per message + "
              f"{1e6 * plan.link.byte_s * 2 ** 20:.0f} us per MiB, on the stages: "
              f"{plan.link.on_host}")
    print("| # | schedule | chunks | micro-batches | partition | predicted ms | measured ms "
          "| error | measured rank | calibrated ms | error |")
    print("|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    errors, alt_errors = [], []
    for i, (c, t) in enumerate(zip(candidates, measured)):
        err = (c.predicted_step_s - t) / t
        other = alt.get(_key(c))
        alt_err = (other - t) / t if other is not None else float("nan")
        errors.append(abs(err))
        alt_errors.append(abs(alt_err))
        print(f"| {i + 1} | {c.schedule} | {c.chunks} | {c.micro_batches} | {c.partition} | "
              f"{1e3 * c.predicted_step_s:.1f} | {1e3 * t:.1f} | {100 * err:+.0f}% | "
              f"{measured_rank[i]} | {1e3 * (other or float('nan')):.1f} | "
              f"{100 * alt_err:+.0f}% |")
    best = order[0]
    chosen_gap = (measured[0] - measured[best]) / measured[best]
    print(f"\nabsolute error: median {100 * statistics.median(errors):.0f}%, mean "
          f"{100 * statistics.mean(errors):.0f}%; calibrated: median "
          f"{100 * statistics.median(alt_errors):.0f}%, mean {100 * statistics.mean(alt_errors):.0f}%")
    alt_best = min(range(len(candidates)), key=lambda i: alt.get(_key(candidates[i]), 1e9))
    print(f"calibrated model's pick: #{alt_best + 1} ({candidates[alt_best].schedule}, chunks "
          f"{candidates[alt_best].chunks}, {candidates[alt_best].micro_batches} micro-batches), "
          f"measured rank {measured_rank[alt_best]}, {1e3 * measured[alt_best]:.1f} ms")
    print(f"chosen plan (predicted #1): measured rank {measured_rank[0]} of {len(measured)}, "
          f"{1e3 * measured[0]:.1f} ms; measured fastest: #{best + 1} "
          f"({candidates[best].schedule}, chunks {candidates[best].chunks}, "
          f"{candidates[best].micro_batches} micro-batches) {1e3 * measured[best]:.1f} ms; "
          f"the chosen one is {100 * chosen_gap:.0f}% slower")
    predicted = [c.predicted_step_s for c in candidates]
    scale = statistics.median(t / p for p, t in zip(predicted, measured))
    scaled = [abs(p * scale - t) / t for p, t in zip(predicted, measured)]
    print(f"rank correlation predicted vs measured (Spearman): "
          f"{spearman(predicted, measured):.2f}; measured / predicted: median {scale:.2f}; "
          f"error after that common factor: median {100 * statistics.median(scaled):.0f}%, "
          f"max {100 * max(scaled):.0f}%")
    print(f"noise: a candidate's step times vary by a median {100 * statistics.median(result['spread']):.0f}% "
          f"(max - min over median, {args.rounds} rounds x {args.steps} steps)")
    ordered = sorted(measured)
    verdict(result, best, (statistics.median(errors), statistics.median(scaled)), args)
    print(f"measured spread: fastest {1e3 * ordered[0]:.1f} ms, median "
          f"{1e3 * statistics.median(ordered):.1f} ms, slowest {1e3 * ordered[-1]:.1f} ms")


def verdict(result: dict, best: int, errors: tuple[float, float],
            args: argparse.Namespace) -> None:
    """Is auto's pick (candidate 0) confirmed? Paired per-round ratios against the fastest.

    Every round visits every candidate in turn, so the ratio of two candidates' step times
    within one round cancels most of the machine's drift; its spread over the rounds is the
    measurement's own error. The pick is confirmed within a reported error ``e`` when its
    median paired ratio to the measured fastest is at most ``1 + e``; the two errors are the
    prediction's median absolute error and its median error after the common factor (the
    one that matters for ranking). Also said: whether the rounds can tell the pick from the
    fastest at all (it was at least as fast in a quarter of the rounds or more).
    """
    rounds = result["per_round"]
    ratios = sorted(a / b for a, b in zip(rounds[0], rounds[best]))
    mid = statistics.median(ratios)
    lo, hi = ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]
    wins = sum(r <= 1.0 for r in ratios)
    absolute, relative = errors
    print(f"chosen / fastest, paired per round ({args.rounds} rounds): median {mid:.3f}, "
          f"quartiles {lo:.3f}-{hi:.3f}, range {ratios[0]:.3f}-{ratios[-1]:.3f}; the chosen "
          f"one was at least as fast in {wins} of {len(ratios)} rounds"
          + (" (it is the fastest)" if best == 0 else ""))
    for name, e in (("absolute error", absolute), ("error after the common factor", relative)):
        print(f"auto's pick within the {name} ({100 * e:.0f}%): "
              f"{'yes' if mid - 1 <= e else 'no'} (gap {100 * (mid - 1):.0f}%)")
    print(f"the rounds tell the pick from the fastest: "
          f"{'no' if best == 0 or 4 * wins >= len(ratios) else 'yes'}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument("--counts", default=None, help="micro-batch counts, e.g. 2,4,8,16")
    p.add_argument("--dim", type=int, default=96)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5, help="profile repetitions per layer")
    p.add_argument("--top", type=int, default=None, help="run only the best N predictions")
    p.add_argument("--transfer-ms", type=float, default=0.0, help="the plan's transfer cost")
    p.add_argument("--split-overhead", type=float, default=1.0, help="the plan's split factor")
    p.add_argument("--calibrated-transfer-ms", type=float, default=0.8)
    p.add_argument("--no-link", action="store_true", help="plan without the measured link")
    p.add_argument("--calibrated-split", type=float, default=1.5)
    args = p.parse_args()
    results = pk.launch(worker, args.stages, (args,), timeout=3600, threads=1)
    report(results[0], args)


if __name__ == "__main__":
    main()
