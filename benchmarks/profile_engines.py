"""Where each engine's CPU goes: a side-by-side sampling profile of pipekernel and torch
(issue 29, item 6).

    python benchmarks/profile_engines.py [--seconds 15] [--size 64] [--out DIR]
                                         [--pk-schedule 1f1b] [--torch-schedule 1F1B]
                                         [--rate 200] [--blocking] [--engines pk,torch]
                                         [--py-spy PATH]
    python benchmarks/profile_engines.py --from DIR    # re-classify a run's files, no run

It needs py-spy, which the project does not depend on: ``pip install py-spy`` (0.4.3 used).

The model, data, and the way each engine is built and stepped are those of
``benchmarks/vs_torch.py`` (imported, not copied): 2 gloo processes, 2 stages, 8 micro-batches
of 4 sequences, AdamW, fp32, one thread per process. Each engine runs in processes of its
own, one engine after the other (pipekernel first): the two workers build the engine, take
``--warmup`` untimed steps (the last ones timed to choose how many steps fill ``--seconds``),
then wait; ``py-spy record`` attaches to each rank's pid, and the workers train steadily for
that many steps and wait again until py-spy has written its file.

py-spy samples every Python thread of a rank ``--rate`` times a second, without ``--idle``:
a thread that is blocked (a gloo wait in C++, an ``Event.wait``, a sleep) is not sampled, so
the shares below are shares of the rank's *busy* samples (a thread that is runnable but
waits for a core counts as busy: on a loaded machine the waits' wake-ups grow).
``--nonblocking`` (the default here; ``--blocking`` turns it off) reads the stacks without
pausing the process, which keeps py-spy's overhead off the pipeline's critical path; a
torn read shows up as an unclassified stack or as py-spy's "Errors" count, printed per rank.

Every collapsed stack is classified (:func:`classify`): first by frames anywhere in the
stack (``torch/optim`` -> optimizer, the benchmark's ``loss_fn`` -> loss), then by its
*owner*: the frame nearest the leaf that belongs to a known component (the autograd
backward entry points, the model's layers under ``torch/nn``, pipekernel's transports,
waits, kernel, stage runtime, wire, engine, torch.distributed's posting and waits,
torch.distributed.pipelining's schedule and stage code, the benchmark's driver); library
helpers (``threading``, ``torch/_tensor.py``, ``torch.distributed``'s bookkeeping, ...)
pass the sample to their caller. ``torch.distributed``'s own ``isend`` / ``irecv`` /
``batch_isend_irecv`` count as the posting of the engine that called them, so "pk posting"
includes the time inside ``dist.isend`` under pipekernel's gloo transport; pipekernel's waits
are split by thread (its waiter thread, which runs gloo's blocking waits, and the main
thread's ``_Handle.wait`` / ``wait_sliced`` / ``submit``). Whatever has no owner is "other",
and its most common leaf frames are printed so the rules can be checked.

Written under ``--out`` (default ``<tmp>/profile-engines-<time>``): per engine and rank the
raw collapsed stacks (``<engine>-<schedule>.rank<r>.txt``, ``py-spy --format raw`` with
``--threads --full-filenames``), py-spy's log, and ``meta.json`` (steps, windows, pids, load
averages) that ``--from`` reads back. The load average is printed before and
after each engine: run it on an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import pipekernel as pk

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_torch  # noqa: E402  (the benchmark's model, data and engines)

ROOT = Path(pk.__file__).resolve().parent.parent  # the checkout pipekernel runs from
_POLL = 0.05


# -- the workers ------------------------------------------------------------------------------
def _wait_file(ctl: Path, name: str, timeout: float) -> None:
    """Sleep until ``ctl/name`` exists (idle: py-spy does not sample a sleep)."""
    deadline = time.monotonic() + timeout
    while not (ctl / name).exists():
        if (ctl / "abort").exists():
            raise RuntimeError(f"the profiler gave up: {(ctl / 'abort').read_text()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {name!r} from the profiler after {timeout:.0f} s")
        time.sleep(_POLL)


def _build(engine: str, schedule: str, d: int, seq: int, rank: int):
    if engine == "pk":
        return vs_torch.PK(schedule, d, seq, rank)
    return vs_torch.Torch(schedule, d, seq, rank)


def worker(engine: str, schedule: str, d: int, seq: int, warmup: int, seconds: float,
           ctl: str) -> dict:
    """One rank: build ``engine`` as vs_torch does, warm up, then train steadily while
    the parent's py-spy samples this process."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(minutes=30))
    rank, ctl_dir = dist.get_rank(), Path(ctl)
    config = _build(engine, schedule, d, seq, rank)
    dist.barrier()
    config.step(0)
    dist.barrier()
    start = time.perf_counter()
    for s in range(1, warmup):
        config.step(s)
    dist.barrier()
    per_step = torch.tensor([(time.perf_counter() - start) / max(1, warmup - 1)])
    dist.all_reduce(per_step, op=dist.ReduceOp.MAX)  # both ranks choose the same count
    steps = max(1, math.ceil(seconds / float(per_step)))
    (ctl_dir / f"ready.{rank}").write_text(str(os.getpid()))
    _wait_file(ctl_dir, "go", 300.0)
    dist.barrier()
    start = time.perf_counter()
    for s in range(warmup, warmup + steps):
        config.step(s)
    dist.barrier()
    elapsed = time.perf_counter() - start
    (ctl_dir / f"done.{rank}").write_text("")
    _wait_file(ctl_dir, "stopped", 300.0)
    if hasattr(config, "close"):
        config.close()
    return {"rank": rank, "pid": os.getpid(), "steps": steps, "elapsed": elapsed,
            "warm_step": float(per_step)}


# -- the parent: py-spy around the steady part -----------------------------------------------
def find_py_spy(given: str | None) -> str:
    """``given``, else the py-spy next to this interpreter (the venv's), else the PATH's."""
    if given:
        return given
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else (shutil.which("py-spy") or "py-spy")


def _spy_command(spy: str, pid: int, out: Path, rate: int, blocking: bool) -> list[str]:
    cmd = [spy, "record", "--pid", str(pid), "--format", "raw", "--rate", str(rate),
           "--threads", "--full-filenames", "--output", str(out)]
    return cmd if blocking else cmd + ["--nonblocking"]


class _Spies:
    """Waits for both ranks, runs one py-spy per rank from "go" to "done"."""

    def __init__(self, spy: str, tag: str, out: Path, ctl: Path, rate: int,
                 blocking: bool) -> None:
        self.spy, self.tag, self.out, self.ctl = spy, tag, out, ctl
        self.rate, self.blocking = rate, blocking
        self.error: str | None = None
        self.window: float | None = None
        self.pids: list[int] = []
        self.stop = threading.Event()   # set by the parent when the launch ends
        self.thread = threading.Thread(target=self._run, daemon=True, name="spies")

    def _await(self, names: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not all((self.ctl / n).exists() for n in names):
            if self.stop.is_set():
                raise RuntimeError("the workers ended before the profile")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {names} from the workers after {timeout:.0f} s")
            time.sleep(_POLL)

    def _start(self) -> list[subprocess.Popen]:
        procs = []
        for rank, pid in enumerate(self.pids):
            log = open(self.out / f"{self.tag}.rank{rank}.pyspy.log", "w")
            cmd = _spy_command(self.spy, pid, self.out / f"{self.tag}.rank{rank}.txt", self.rate,
                               self.blocking)
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 30.0  # attached once it says "Sampling process"
        for rank, proc in enumerate(procs):
            log = self.out / f"{self.tag}.rank{rank}.pyspy.log"
            while "Sampling process" not in log.read_text():
                if proc.poll() is not None or time.monotonic() > deadline:
                    for p in procs:
                        p.kill()
                    raise RuntimeError(f"py-spy could not attach to rank {rank} (pid "
                                       f"{self.pids[rank]}), exit {proc.poll()}: "
                                       f"{log.read_text().strip()}")
                time.sleep(_POLL)
        return procs

    def _run(self) -> None:
        try:
            self._await(["ready.0", "ready.1"], 1800.0)
            self.pids = [int((self.ctl / f"ready.{r}").read_text()) for r in range(2)]
            procs = self._start()
            start = time.perf_counter()
            (self.ctl / "go").write_text("")
            self._await(["done.0", "done.1"], 3600.0)
            self.window = time.perf_counter() - start
            for proc in procs:
                proc.send_signal(signal.SIGINT)  # py-spy writes its file on Ctrl-C
            for proc in procs:
                proc.wait(timeout=60)
            (self.ctl / "stopped").write_text("")
        except Exception as err:  # noqa: BLE001 - reported by the parent
            self.error = str(err)
            (self.ctl / "abort").write_text(self.error)


def profile_engine(engine: str, schedule: str, args, out: Path) -> dict:
    """Launch the two workers of one engine and profile their steady training."""
    tag = f"{engine}-{schedule}"
    d, seq, _ = vs_torch.SIZES[args.size]
    ctl = Path(tempfile.mkdtemp(prefix="pk-profile-"))
    spies = _Spies(find_py_spy(args.py_spy), tag, out, ctl, args.rate, args.blocking)
    load_before = os.getloadavg()
    spies.thread.start()
    try:
        results = pk.launch(worker, 2, (engine, schedule, d, seq, args.warmup, args.seconds,
                                        str(ctl)), timeout=args.seconds * 20 + 900)
    except Exception as err:
        if spies.error is not None:
            raise SystemExit(f"{tag}: {spies.error}") from None
        raise RuntimeError(f"{tag}: the workers failed") from err
    finally:
        spies.stop.set()
        spies.thread.join(timeout=120)
        shutil.rmtree(ctl, ignore_errors=True)
    if spies.error is not None:
        raise SystemExit(f"{tag}: {spies.error}")
    return {"engine": engine, "schedule": schedule, "tag": tag, "d": d, "seq": seq,
            "rate": args.rate, "blocking": args.blocking, "window": spies.window,
            "load_before": load_before, "load_after": os.getloadavg(), "ranks": results,
            "root": str(ROOT)}


# -- classification ---------------------------------------------------------------------------
#: the rows of the table, in order; ``engine`` says whose machinery a row is (None: both)
COMPONENTS = [
    ("autograd backward", None), ("layer forwards", None), ("loss", None),
    ("optimizer", None),
    ("pk posting", "pk"), ("pk waits: waiter thread", "pk"),
    ("pk waits: handle, wait_sliced, submit", "pk"), ("pk collectives", "pk"),
    ("pk kernel loop", "pk"),
    ("pk stage runtime", "pk"), ("pk wire", "pk"), ("pk engine/step", "pk"),
    ("pk other", "pk"),
    ("torch posting", "torch"), ("torch waits", "torch"),
    ("torch schedule/stage code", "torch"),
    ("benchmark driver", None), ("other", None),
]
MACHINERY = {"pk": [c for c, e in COMPONENTS if e == "pk"],
             "torch": [c for c, e in COMPONENTS if e == "torch"]}

_GLOO_POST = {"_post", "isend", "irecv", "batch_isend_irecv", "_bytes", "global_rank",
              "_Handle.__init__"}
_GLOO_WAIT = {"_Handle.wait", "_Handle.is_completed", "_waiter", "_Box.__init__", "_Box.wait"}
_GLOO_COLLECTIVE = {"all_reduce", "iall_reduce", "all_gather", "broadcast", "barrier",
                    "_collective", "_finish_text"}
_C10D_POST = {"isend", "irecv", "batch_isend_irecv", "send", "recv", "_coalescing_manager",
              "P2POp", "__new__", "__init__", "_check_p2p_op_list", "_check_single_tensor",
              "_check_op"}
_C10D_WAIT = {"wait"}  # a barrier is the driver's (between the timed blocks)
_TORCH_POST = {"_batch_p2p", "_sorted_batch_p2p"}
_TORCH_WAIT = {"_wait_batch_p2p"}
_BACKWARD = {"backward", "grad", "_engine_run_backward", "_calculate_shape",
             "_make_grads", "_tensor_or_tensors_to_tuple"}
_MODULE_CALL = {"_call_impl", "_wrapped_call_impl", "__call__", "forward"}


def parse_frame(frame: str) -> tuple[str, str]:
    """``"Class.func (/path/file.py:12)"`` -> ``("Class.func", "/path/file.py")``."""
    name, _, where = frame.rpartition(" (")
    return name, where.rstrip(")").rsplit(":", 1)[0]


def _rel(path: str, root: str) -> str:
    """A frame's file relative to the checkout (``pk:...``) or to site-packages."""
    if "site-packages/" in path:  # first: the venv may live inside the checkout
        return path.split("site-packages/", 1)[1]
    if path.startswith(root + "/"):
        return "pk:" + path[len(root) + 1:]
    return path


def _pk_owner(func: str, rel: str) -> str | None:
    if rel.startswith("pk:benchmarks/vs_torch.py") and func.startswith("CausalBlock."):
        return "layer forwards"  # the model's own block
    if rel.startswith("pk:benchmarks/"):
        return "benchmark driver"
    if rel.startswith("pk:transports/gloo.py"):
        if func in _GLOO_POST or func.rsplit(".", 1)[-1] in _GLOO_POST:
            return "pk posting"
        if func.rsplit(".", 1)[-1] in _GLOO_COLLECTIVE:
            return "pk collectives"
        waits = func in _GLOO_WAIT or func.startswith("_Waiter.")
        return "pk waits" if waits or func.rsplit(".", 1)[-1] in _GLOO_WAIT else "pk other"
    if rel.startswith("pk:pipekernel/comm/transport.py") and func.endswith("wait_sliced"):
        return "pk waits"
    for prefix, owner in (("pk:pipekernel/comm/wire.py", "pk wire"),
                          ("pk:pipekernel/kernel/", "pk kernel loop"),
                          ("pk:pipekernel/stage/", "pk stage runtime"),
                          ("pk:pipekernel/model/", "pk stage runtime"),  # the layers' runner
                          ("pk:pipekernel/engine/", "pk engine/step"),
                          ("pk:pipekernel/step/", "pk engine/step")):
        if rel.startswith(prefix):
            return owner
    return "pk other"


def _torch_owner(func: str, rel: str) -> str | None:
    if rel.startswith(("torch/autograd/", "torch/_tensor.py")):
        return "autograd backward" if func in _BACKWARD else None
    if rel.startswith("torch/nn/modules/module.py"):
        return "layer forwards" if func in _MODULE_CALL else None
    if rel.startswith(("torch/nn/modules/", "torch/nn/functional.py")):
        return "layer forwards"
    if rel.startswith("torch/distributed/pipelining/"):
        if func in _TORCH_POST:
            return "torch posting"
        return "torch waits" if func in _TORCH_WAIT else "torch schedule/stage code"
    if rel.startswith("torch/distributed/distributed_c10d.py"):
        if func in _C10D_POST:
            return "torch.distributed posting"
        return "torch.distributed waits" if func in _C10D_WAIT else None
    return None


def owner(frame: str, root: str) -> str | None:
    """The component a frame owns, or None for a helper that passes to its caller."""
    qualname, path = parse_frame(frame)
    rel = _rel(path, root)
    if rel.startswith("pk:"):
        return _pk_owner(qualname, rel)
    return _torch_owner(qualname.rsplit(".", 1)[-1], rel)


def classify(stack: str, root: str, engine: str) -> tuple[str, str]:
    """(component, leaf frame) of one collapsed stack of ``engine`` (pk or torch)."""
    component, leaf = _classify(stack, root, engine)
    if component == "pk waits":  # split by thread: gloo's blocking waits run on their own
        waiter = thread_name(stack).startswith("pipekernel-wait")
        component = ("pk waits: waiter thread" if waiter
                     else "pk waits: handle, wait_sliced, submit")
    return component, leaf


def _classify(stack: str, root: str, engine: str) -> tuple[str, str]:
    frames = stack.split(";")
    if frames and frames[0].startswith("thread ("):
        frames = frames[1:]
    if frames and " (" not in frames[0]:
        frames = frames[1:]  # the thread's name
    leaf = frames[-1] if frames else "(no Python frame)"
    for frame in frames:
        func, path = parse_frame(frame)
        rel = _rel(path, root)
        if rel.startswith("torch/optim/"):
            return "optimizer", leaf
        if func.endswith("loss_fn") and rel.startswith("pk:benchmarks/"):
            return "loss", leaf
    for frame in reversed(frames):
        found = owner(frame, root)
        if found is None:
            continue
        if found.startswith("torch.distributed "):  # c10d under an engine: its machinery
            return f"{engine} {found.split(' ', 1)[1]}", leaf
        return found, leaf
    return "other", leaf


def load(path: Path) -> Counter:
    counts: Counter = Counter()
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if stack and n.isdigit():
            counts[stack] += int(n)
    return counts


def thread_name(stack: str) -> str:
    """The thread's name from py-spy's ``--threads`` frames (``thread (tid): name``)."""
    first = stack.split(";", 2)
    if not first[0].startswith("thread ("):
        return "?"
    head = first[0].split(": ", 1)
    name = head[1] if len(head) > 1 else (first[1] if len(first) > 1 else "?")
    return name if " (" not in name else "?"


def summarize(counts: Counter, root: str, engine: str) -> dict:
    parts: Counter = Counter()
    others: Counter = Counter()
    threads: Counter = Counter()
    for stack, n in counts.items():
        component, leaf = classify(stack, root, engine)
        parts[component] += n
        threads[thread_name(stack)] += n
        if component == "other":
            others[leaf] += n
    return {"parts": parts, "others": others, "threads": threads,
            "total": sum(counts.values())}


def _py_spy_counts(log: Path) -> str:
    """py-spy's own "Samples: N Errors: M" line (how many reads it got)."""
    if not log.exists():
        return "?"
    for line in log.read_text().splitlines():
        if "Samples:" in line:
            return line.split("Samples:", 1)[1].strip().replace("Errors:", "errors")
    return "?"


# -- the report -------------------------------------------------------------------------------
def _columns(out: Path, metas: list[dict]) -> list[dict]:
    columns = []
    for meta in metas:
        for r in meta["ranks"]:
            rank = r["rank"]
            counts = load(out / f"{meta['tag']}.rank{rank}.txt")
            columns.append({"meta": meta, "rank": rank, "run": r,
                            "sum": summarize(counts, meta["root"], meta["engine"]),
                            "spy": _py_spy_counts(out / f"{meta['tag']}.rank{rank}.pyspy.log")})
    return columns


def _share(col: dict, names: list[str]) -> str:
    total = col["sum"]["total"]
    if not total:
        return "—"
    return f"{100.0 * sum(col['sum']['parts'][n] for n in names) / total:.1f}"


def report(out: Path, metas: list[dict], show_other: int = 8) -> str:
    columns = _columns(out, metas)
    head = [f"{c['meta']['engine']} {c['meta']['schedule']} r{c['rank']}" for c in columns]
    lines = ["| component (% of busy samples) | " + " | ".join(head) + " |",
             "|---|" + "---:|" * len(columns)]
    for name, engine in COMPONENTS:
        cells = [_share(c, [name]) if engine in (None, c["meta"]["engine"]) else "—"
                 for c in columns]
        if all(cell in ("—", "0.0") for cell in cells) and name != "other":
            continue
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("| **engine machinery, total** | " + " | ".join(
        f"**{_share(c, MACHINERY[c['meta']['engine']])}**" for c in columns) + " |")
    rows = [("busy samples", lambda c: str(c["sum"]["total"])),
            ("py-spy samples / errors", lambda c: c["spy"]),
            ("busy threads (samples / rate / window)", lambda c: (
                f"{c['sum']['total'] / c['meta']['rate'] / c['meta']['window']:.2f}"
                if c["meta"]["window"] else "—")),
            ("steps profiled / s per step", lambda c: (
                f"{c['run']['steps']} / {c['run']['elapsed'] / c['run']['steps']:.3f}")),
            ("sampled window s", lambda c: f"{c['meta']['window']:.1f}")]
    for label, cell in rows:
        lines.append(f"| {label} | " + " | ".join(cell(c) for c in columns) + " |")
    lines += ["", "Busy samples per thread:"]
    for c, h in zip(columns, head):
        threads = ", ".join(f"{n} {100.0 * k / max(1, c['sum']['total']):.1f}%"
                            for n, k in c["sum"]["threads"].most_common())
        lines.append(f"- {h}: {threads}")
    lines += ["", "Load average (1, 5, 15 min) before / after each engine:"]
    for meta in metas:
        lines.append(f"- {meta['tag']}: " + " / ".join(
            ", ".join(f"{x:.2f}" for x in meta[k]) for k in ("load_before", "load_after")))
    if show_other:
        lines += ["", f"Top leaf frames of the unclassified (\"other\") samples:"]
        for c, h in zip(columns, head):
            top = c["sum"]["others"].most_common(show_other)
            lines.append(f"- {h}: " + ("; ".join(f"{leaf} ×{n}" for leaf, n in top)
                                      if top else "none"))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=15.0,
                        help="steady training sampled per engine (default 15)")
    parser.add_argument("--size", default="64", choices=sorted(vs_torch.SIZES),
                        help="vs_torch's size: 64 (d=64, seq 32) or 256 (d=256, seq 128)")
    parser.add_argument("--pk-schedule", default="1f1b")
    parser.add_argument("--torch-schedule", default="1F1B", choices=sorted(vs_torch.TORCH))
    parser.add_argument("--engines", default="pk,torch", help="comma-separated: pk, torch")
    parser.add_argument("--warmup", type=int, default=4,
                        help="untimed steps before the profile (>= 2; all but the first "
                             "are timed to choose the step count)")
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--blocking", action="store_true",
                        help="let py-spy pause the process for each sample (default: "
                             "--nonblocking)")
    parser.add_argument("--py-spy", default=None,
                        help="the py-spy to run (default: the one beside this Python, else "
                             "the PATH's)")
    parser.add_argument("--out", default=None, help="directory for the collapsed stacks")
    parser.add_argument("--show-other", type=int, default=8,
                        help="top unclassified leaf frames to print per rank")
    parser.add_argument("--from", dest="source", default=None,
                        help="re-classify the files of an earlier run's --out, run nothing")
    args = parser.parse_args()
    if args.source is not None:
        out = Path(args.source)
        print(report(out, json.loads((out / "meta.json").read_text()), args.show_other))
        return
    if args.warmup < 2:
        parser.error("--warmup must be >= 2 (the first step is not timed)")
    engines = [e for e in args.engines.split(",") if e]
    if not engines or any(e not in ("pk", "torch") for e in engines):
        parser.error(f"--engines takes pk and/or torch, got {args.engines!r}")
    out = Path(args.out or Path(tempfile.gettempdir())
               / time.strftime("profile-engines-%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    d, seq, _ = vs_torch.SIZES[args.size]
    print(f"torch {torch.__version__}, pipekernel {pk.__version__}; d={d}, sequence {seq}; "
          f"{vs_torch.MICRO_BATCHES} micro-batches of {vs_torch.MICRO}; 2 gloo processes; "
          f"py-spy --rate {args.rate}{'' if args.blocking else ' --nonblocking'}, "
          f"{args.seconds:g} s per engine; writing {out}/", flush=True)
    metas = []
    for engine in engines:
        schedule = args.pk_schedule if engine == "pk" else args.torch_schedule
        metas.append(profile_engine(engine, schedule, args, out))
        (out / "meta.json").write_text(json.dumps(metas, indent=1))
    print()
    print(report(out, metas, args.show_other))


if __name__ == "__main__":
    main()
