"""pipekernel vs torch.distributed.pipelining on a small causal transformer (issue 9).

One command runs every configuration side by side, in interleaved rounds (round ``r``
runs each configuration once, the order rotated by ``r``), and prints a markdown table:

    python benchmarks/vs_torch.py [--sizes 256,64] [--rounds 6] [--steps N]
                                  [--pk-schedules 1f1b,gpipe,interleaved,zb-h1,zb-h2,zbv,dualpipev]
                                  [--processes shared,separate]
    python benchmarks/vs_torch.py --quick      # d=64 only, 2 rounds, few steps (< 2 min)

``--processes`` says where the engines run, and each value gets its own table:

* ``shared``: both engines' configurations live in the same two worker processes (one
  ``pk.launch`` per size), each with its own process group; rounds interleave every
  configuration of both engines.
* ``separate``: each engine in processes of its own: every round launches fresh workers
  for the references (``single``, ``limit``), then for pipekernel's configurations, then
  for torch's (the order rotated by the round), so no engine shares an interpreter, an
  allocator or a gloo context with the other; each launch warms up before it times.

Model: Embedding(512, d) -> 8 x TransformerEncoderLayer(d, nhead=4, 4d, dropout=0,
batch_first) under a causal mask -> LayerNorm -> Linear(d, 512); cross-entropy on the
next token; 8 micro-batches of 4 sequences per step; AdamW(lr=1e-3); fp32, one thread
per process. Sizes: d=256 / sequence 128 and d=64 / sequence 32.

Configurations (one at a time: every block of timed steps sits between two barriers):

* ``single``: one process, gradient accumulation over the 8 micro-batches, one step
  (the other worker waits at the barrier).
* ``limit``: two independent single-process runs at once, one per core; throughput
  = 2 x sequences of one / wall time — what 2 cores can give.
* ``pk <schedule>``: pipekernel, 2 gloo processes, 2 stages, explicit boundaries
  ``[0, 5, 11]`` (embedding + 4 blocks | 4 blocks + norm + head); schedules that need
  ``chunks=2`` (interleaved, zbv, dualpipev) use the 4 parts ``[0, 3, 5, 7, 11]`` and run only
  when the engine has a ``chunks`` parameter. Unknown schedule names are skipped
  with a note.
* ``torch <Schedule>``: ``torch.distributed.pipelining`` with ``PipelineStage`` objects
  built by hand from the same layers and splits: one stage per rank for GPipe/1F1B;
  two per rank for Interleaved1F1B (loop: rank r holds parts r and r + 2) and for
  ZBVZeroBubble/DualPipeV (V: rank 0 holds parts 0 and 3, rank 1 parts 1 and 2);
  AdamW step after each ``schedule.step``.

Every configuration builds its layers with the seeding rule of
``PipelineModule(seed=...)`` (layer i after ``torch.manual_seed(seed + i)``), so all
start from identical weights and see identical data; the first-step loss of each is
compared with ``single``'s. Both workers live for the whole size (one ``pk.launch``
per size) and hold every configuration's model; each configuration has its own
process group.

Reported per configuration: sequences/s (32 sequences per step / median over rounds of
the round's mean step time; 2 untimed warm-up steps first), ratio to ``limit``, ratio
to torch's matching schedule (1f1b <-> Schedule1F1B, gpipe <-> ScheduleGPipe,
interleaved <-> ScheduleInterleaved1F1B, zbv <-> ScheduleZBVZeroBubble, dualpipev <->
ScheduleDualPipeV, zb-h1 and zb-h2 vs Schedule1F1B) as the median of the per-round ratios
(torch's step time over pipekernel's in the same round) with their min–max, and the peak
bytes autograd holds saved for backward per rank
(activations; parameters and their views excluded), counted with
``torch.autograd.graph.saved_tensors_hooks`` during the second warm-up step the same
way for every engine. (``ru_maxrss`` is printed once per worker as well, but it covers
all configurations of that process, so it cannot be split per configuration.)
"""
from __future__ import annotations

import argparse
import inspect
import resource
import statistics
import time
import weakref
from collections import OrderedDict
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import pipekernel as pk

VOCAB = 512
MICRO = 4            # sequences per micro-batch
MICRO_BATCHES = 8    # micro-batches per step
SEQ_PER_STEP = MICRO * MICRO_BATCHES
SEED = 1234
BLOCKS = 8
BOUNDS_2 = [0, 5, 11]          # embedding + 4 blocks | 4 blocks + norm + head
BOUNDS_4 = [0, 3, 5, 7, 11]    # embedding + 2 | 2 | 2 | 2 + norm + head
CHUNKED = {"interleaved", "zbv", "dualpipev"}   # pipekernel schedules that need chunks=2
#: size label -> (d, sequence length, timed steps per round by default)
SIZES = {"256": (256, 128, 3), "64": (64, 32, 20)}
#: torch schedule name -> (placement, stages per rank)
TORCH = {"1F1B": ("single", 1), "GPipe": ("single", 1), "Interleaved1F1B": ("loop", 2),
         "ZBVZeroBubble": ("v", 2), "DualPipeV": ("v", 2)}
#: pipekernel schedule -> torch schedule it is compared with
PAIR = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved": "Interleaved1F1B",
        "zbv": "ZBVZeroBubble", "zb-h1": "1F1B", "zb-h2": "1F1B", "dualpipev": "DualPipeV"}
#: every pipekernel training schedule the benchmark knows
PK_SCHEDULES = "1f1b,gpipe,interleaved,zb-h1,zb-h2,zbv,dualpipev"


class CausalBlock(nn.Module):
    """A TransformerEncoderLayer applied under a causal mask built for the input's length."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=4 * d, dropout=0.0,
                                                batch_first=True)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(h.size(1), device=h.device,
                                                              dtype=h.dtype)
        return self.layer(h, src_mask=mask, is_causal=True)


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def specs(d: int) -> list:
    return [pk.LayerSpec(nn.Embedding, VOCAB, d), *[pk.LayerSpec(CausalBlock, d)
                                                    for _ in range(BLOCKS)],
            pk.LayerSpec(nn.LayerNorm, d), pk.LayerSpec(nn.Linear, d, VOCAB)]


def pipeline_module(d: int, bounds: list[int]) -> pk.PipelineModule:
    return pk.PipelineModule(specs(d), loss_fn=loss_fn, num_stages=2, partition=bounds,
                             seed=SEED)


def build_part(d: int, lo: int, hi: int) -> nn.Sequential:
    """Layers ``lo .. hi - 1`` with exactly the weights ``PipelineModule(seed=SEED)`` gives."""
    module = pipeline_module(d, BOUNDS_2)
    with torch.random.fork_rng(devices=[]):
        return nn.Sequential(OrderedDict((str(i), module.build_layer(i)) for i in range(lo, hi)))


def batch(step: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's 32 sequences (the same for every configuration): inputs and next tokens."""
    g = torch.Generator().manual_seed(10_000 + step)
    ids = torch.randint(0, VOCAB, (SEQ_PER_STEP, seq + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def micro_batches(step: int, seq: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = batch(step, seq)
    return list(zip(x.split(MICRO), y.split(MICRO)))


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


class SavedBytes:
    """Peak bytes of distinct storages autograd holds saved for backward while active
    (``saved_tensors_hooks``); storages of ``exclude`` (the parameters) are not counted."""

    class _Held:
        __slots__ = ("t", "__weakref__")

        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

    def __init__(self, exclude) -> None:
        self.skip = {self._storage(p).data_ptr() for p in exclude}
        self.live = self.peak = 0
        self.refs: dict[int, list[int]] = {}

    @staticmethod
    def _storage(t: torch.Tensor):
        """The storage counted for ``t`` (a DTensor counts its local shard)."""
        return t.untyped_storage()

    def _release(self, key: int) -> None:
        entry = self.refs[key]
        entry[1] -= 1
        if entry[1] == 0:
            del self.refs[key]
            self.live -= entry[0]

    def _pack(self, t: torch.Tensor):
        held = self._Held(t.detach())  # detached: no reference cycle through grad_fn
        storage = self._storage(t)
        key = storage.data_ptr()
        if key and key not in self.skip:
            entry = self.refs.setdefault(key, [storage.nbytes(), 0])
            if entry[1] == 0:
                self.live += entry[0]
                self.peak = max(self.peak, self.live)
            entry[1] += 1
            weakref.finalize(held, self._release, key)
        return held

    def __enter__(self) -> SavedBytes:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda held: held.t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


# -- configurations: every rank builds all of them, in the same order ------------------------
class Single:
    """One process, gradient accumulation. ``ranks``: the ranks that run it."""

    def __init__(self, name: str, d: int, seq: int, rank: int, ranks: tuple[int, ...]) -> None:
        self.name, self.seq, self.active = name, seq, rank in ranks
        self.sequences = SEQ_PER_STEP * len(ranks)
        if self.active:
            self.model = build_part(d, 0, len(specs(d)))
            self.opt = adamw(self.model.parameters())

    def parameters(self):
        return list(self.model.parameters()) if self.active else []

    def step(self, step: int) -> float | None:
        if not self.active:
            return None
        total = 0.0
        for x, y in micro_batches(step, self.seq):
            loss = loss_fn(self.model(x), y)
            (loss / MICRO_BATCHES).backward()
            total += loss.detach()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(total) / MICRO_BATCHES


class PK:
    def __init__(self, schedule: str, d: int, seq: int, rank: int) -> None:
        self.name, self.seq, self.sequences = f"pk {schedule}", seq, SEQ_PER_STEP
        chunked = schedule in CHUNKED
        extra = {"chunks": 2} if chunked else {}
        self.engine = pk.PipelineEngine(
            pipeline_module(d, BOUNDS_4 if chunked else BOUNDS_2), optimizer=adamw,
            micro_batches=MICRO_BATCHES, schedule=schedule, transport="gloo",
            transport_options={"group": dist.new_group([0, 1])}, timeout=1800, **extra)

    def parameters(self):
        return list(self.engine.module.parameters())

    def step(self, step: int) -> float:
        return float(self.engine.train_batch(iter(micro_batches(step, self.seq))))

    def close(self) -> None:
        self.engine.close()


class Torch:
    def __init__(self, schedule: str, d: int, seq: int, rank: int) -> None:
        from torch.distributed import pipelining

        self.name, self.seq, self.sequences = f"torch {schedule}", seq, SEQ_PER_STEP
        placement, per_rank = TORCH[schedule]
        bounds = BOUNDS_2 if per_rank == 1 else BOUNDS_4
        num_parts = len(bounds) - 1
        parts = {"single": [rank], "loop": [rank, rank + 2],
                 "v": [rank, num_parts - 1 - rank]}[placement]
        group = dist.new_group([0, 1])
        self.modules = [build_part(d, bounds[p], bounds[p + 1]) for p in parts]
        stages = [pipelining.PipelineStage(m, p, num_parts, torch.device("cpu"), group=group)
                  for m, p in zip(self.modules, parts)]
        self.has_first = 0 in parts
        self.has_last = num_parts - 1 in parts
        cls = getattr(pipelining, "Schedule" + schedule)
        self.schedule = cls(stages[0] if per_rank == 1 else stages, MICRO_BATCHES,
                            loss_fn=loss_fn)
        self.opt = adamw(self.parameters())

    def parameters(self):
        return [p for m in self.modules for p in m.parameters()]

    def step(self, step: int) -> float | None:
        x, y = batch(step, self.seq)
        losses: list[torch.Tensor] = []
        args = (x,) if self.has_first else ()
        self.schedule.step(*args, target=y if self.has_last else None,
                           losses=losses if self.has_last else None)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(torch.stack(losses).detach().mean()) if self.has_last else None


def worker(d: int, seq: int, pk_schedules: list[str], torch_schedules: list[str],
           rounds: int, steps: int, warmup: int, references: bool = True) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(minutes=30))
    rank = dist.get_rank()
    configs = ([Single("single", d, seq, rank, (0,)), Single("limit", d, seq, rank, (0, 1))]
               if references else [])
    configs += [PK(s, d, seq, rank) for s in pk_schedules]
    configs += [Torch(s, d, seq, rank) for s in torch_schedules]
    losses: dict[str, list] = {c.name: [] for c in configs}
    saved: dict[str, int] = {}
    for c in configs:  # warm-up: step 0 is the parity step; the last one is counted
        for s in range(warmup):
            dist.barrier()
            if s == warmup - 1:
                with SavedBytes(c.parameters()) as counter:
                    losses[c.name].append(c.step(s))
                saved[c.name] = counter.peak if c.parameters() else None
            else:
                losses[c.name].append(c.step(s))
    times: dict[str, list[float]] = {c.name: [] for c in configs}
    counter = {c.name: warmup for c in configs}
    for r in range(rounds):
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        for c in order:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                c.step(counter[c.name])
                counter[c.name] += 1
            dist.barrier()
            times[c.name].append((time.perf_counter() - start) / steps)
    for c in configs:
        if hasattr(c, "close"):
            c.close()
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"times": times, "losses": losses, "saved": saved, "maxrss": maxrss,
            "sequences": {c.name: c.sequences for c in configs}}


def available_pk(names: list[str]) -> tuple[list[str], list[str]]:
    from pipekernel.errors import UnknownNameError
    from pipekernel.extend.manager import make_plugin_manager, resolve_schedule

    pm = make_plugin_manager()
    has_chunks = "chunks" in inspect.signature(pk.PipelineEngine).parameters
    ok, notes = [], []
    for name in names:
        try:
            resolve_schedule(pm, name)
        except UnknownNameError:
            notes.append(f"pk {name}: skipped, the installed pipekernel has no schedule {name!r}")
            continue
        if name in CHUNKED and not has_chunks:
            notes.append(f"pk {name}: skipped, needs chunks=2 and PipelineEngine has no "
                         "'chunks' parameter")
            continue
        ok.append(name)
    return ok, notes


def available_torch(names: list[str]) -> tuple[list[str], list[str]]:
    from torch.distributed import pipelining

    ok, notes = [], []
    for name in names:
        if name not in TORCH or not hasattr(pipelining, "Schedule" + name):
            notes.append(f"torch {name}: skipped, torch {torch.__version__} has no Schedule{name}"
                         if name in TORCH else f"torch {name}: unknown to this benchmark")
        else:
            ok.append(name)
    return ok, notes


def merge(parts: list[list[dict]]) -> list[dict]:
    """Per rank, the results of several launches (one per engine and round) as one."""
    merged = []
    for rank in range(2):
        out: dict = {"times": {}, "losses": {}, "saved": {}, "sequences": {}, "maxrss": 0}
        for results in parts:
            r = results[rank]
            for name, t in r["times"].items():
                out["times"].setdefault(name, []).extend(t)
            for key in ("losses", "saved", "sequences"):
                for name, value in r[key].items():
                    out[key].setdefault(name, value)
            out["maxrss"] = max(out["maxrss"], r["maxrss"])
        merged.append(out)
    return merged


def table(label: str, d: int, seq: int, results: list[dict], steps: int, rounds: int,
          processes: str) -> str:
    times = {name: [max(r["times"][name][i] for r in results) for i in range(rounds)]
             for name in results[0]["times"]}
    seq_s = {name: results[0]["sequences"][name] / statistics.median(t)
             for name, t in times.items()}
    loss = {name: next((r["losses"][name] for r in results if r["losses"][name][0] is not None))
            for name in times}
    ref = loss["single"]
    where = ("both engines side by side in the same two worker processes"
             if processes == "shared" else
             "each engine in processes of its own (fresh workers per engine and round)")
    lines = [f"### d={d}, sequence {seq}: {where} (median of {rounds} rounds x {steps} steps)",
             "",
             "| config | s/step | rounds min–max | seq/s | x limit | x torch same (per-round "
             "median, min–max) | saved-for-backward peak MiB r0 / r1 | step-0 loss | "
             "Δ step 0 | Δ step 1 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, t in times.items():
        kind, _, sched = name.partition(" ")
        other = f"torch {PAIR.get(sched, '')}"
        vs = "—"
        if kind == "pk" and other in times:
            ratios = [o / p for o, p in zip(times[other], t)]
            vs = (f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f}, "
                  f"{other.split(' ')[1]})")
        mem = " / ".join("—" if r["saved"][name] is None else f"{r['saved'][name] / 2**20:.1f}"
                         for r in results)
        deltas = [f"{abs(a - b):.1e}" for a, b in zip(loss[name], ref)]
        lines.append(f"| {name} | {statistics.median(t):.3f} | {min(t):.3f}–{max(t):.3f} | "
                     f"{seq_s[name]:.1f} | "
                     f"{seq_s[name] / seq_s['limit']:.2f} | {vs} | {mem} | {loss[name][0]:.6f} | "
                     f"{deltas[0]} | {deltas[1] if len(deltas) > 1 else '—'} |")
    rss = " / ".join(f"{r['maxrss'] / 2**20:.0f}" for r in results)
    lines += ["", f"ru_maxrss per worker (largest over its launches): {rss} MiB"]
    return "\n".join(lines)


def run_size(d: int, seq: int, pk_names: list[str], torch_names: list[str], rounds: int,
             steps: int, warmup: int, processes: str) -> list[dict]:
    """Every configuration's per-round times for one size, the engines placed as
    ``processes`` says (see the module docstring)."""
    if processes == "shared":
        return pk.launch(worker, 2, (d, seq, pk_names, torch_names, rounds, steps, warmup),
                         timeout=3600)
    groups = [([], [], True), (pk_names, [], False), ([], torch_names, False)]
    parts = []
    for r in range(rounds):
        for pk_group, torch_group, refs in groups[r % 3:] + groups[:r % 3]:
            if pk_group or torch_group or refs:
                parts.append(pk.launch(worker, 2, (d, seq, pk_group, torch_group, 1, steps,
                                                   warmup, refs), timeout=3600))
    return merge(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="256,64", help="comma-separated d values: 256, 64")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per configuration per round (default: 3 at d=256, "
                             "20 at d=64)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--pk-schedules", default=PK_SCHEDULES)
    parser.add_argument("--processes", default="shared,separate",
                        help="comma-separated: shared (both engines in the same workers), "
                             "separate (each engine in workers of its own); one table each")
    parser.add_argument("--torch-schedules",
                        default="1F1B,GPipe,Interleaved1F1B,ZBVZeroBubble,DualPipeV")
    parser.add_argument("--quick", action="store_true",
                        help="smoke check: d=64 only, 2 rounds, 3 steps")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.rounds, args.steps = "64", 2, args.steps or 3
    if args.warmup < 2:
        parser.error("--warmup must be >= 2 (step 0 is the parity step, the last is counted)")
    torch.set_num_threads(1)
    pk_names, notes = available_pk([s for s in args.pk_schedules.split(",") if s])
    torch_names, more = available_torch([s for s in args.torch_schedules.split(",") if s])
    for note in notes + more:
        print(note)
    print(f"torch {torch.__version__}, pipekernel {pk.__version__}; {MICRO_BATCHES} micro-batches "
          f"of {MICRO} sequences per step, AdamW, fp32, 1 thread per process, gloo\n")
    for label in args.sizes.split(","):
        if label not in SIZES:
            parser.error(f"unknown size {label!r}; sizes: {', '.join(SIZES)}")
        d, seq, default_steps = SIZES[label]
        steps = args.steps or default_steps
        for processes in args.processes.split(","):
            if processes not in ("shared", "separate"):
                parser.error(f"unknown --processes value {processes!r}: shared or separate")
            start = time.perf_counter()
            results = run_size(d, seq, pk_names, torch_names, args.rounds, steps, args.warmup,
                               processes)
            print(table(label, d, seq, results, steps, args.rounds, processes))
            print(f"({time.perf_counter() - start:.0f} s)\n", flush=True)


if __name__ == "__main__":
    main()
