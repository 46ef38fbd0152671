"""The hot path's work, counted (issue 45, item 6): Python-level calls per instruction of
``train_batch``, per rank, on a fixed small model (2 stages, 1f1b, 8 micro-batches, 2 gloo
ranks). Counted, not timed, so the figures do not depend on the machine or its load.

What is counted: every function call the profiler sees on the training thread (Python
functions and C functions called from Python: ``sys.setprofile``'s ``call`` and
``c_call`` events), attributed to the instruction the kernel is running (from the
runtime's ``enter(index)`` to the next one); ``setup`` is what ``train_batch`` does before
the first instruction, ``finish`` what it does after the last (the optimizer step, the
batch's statistics). What is not: the transport's internals (a gloo wait takes another
branch when its transfer already finished: timing), which the counting wrapper pauses
around, and its handles report ``is_completed()`` only once waited on, so that the runtime
prunes its sends at the same points on every run. The garbage collector is off while
counting. The counted step is the third (the first two build plans and channels).

    python benchmarks/hot_path_calls.py            # this tree
    PYTHONPATH=/path/to/other/tree python benchmarks/hot_path_calls.py   # another commit
"""
from __future__ import annotations

import argparse
import collections
import gc
import sys
from typing import Any

import torch
from torch import nn

import pipekernel as pk
from pipekernel.kernel.loop import Kernel
from pipekernel.testing import run_ranks

MICRO_BATCHES, WIDTH, BATCH = 8, 16, 4
WARMUP = 2


def model(num_stages: int | None = None) -> pk.PipelineModule:
    layers = [pk.LayerSpec(nn.Linear, WIDTH, WIDTH), torch.tanh,
              pk.LayerSpec(nn.Linear, WIDTH, WIDTH), torch.tanh,
              pk.LayerSpec(nn.Linear, WIDTH, WIDTH), torch.tanh,
              pk.LayerSpec(nn.Linear, WIDTH, WIDTH)]
    return pk.PipelineModule(layers, loss_fn=nn.MSELoss(), num_stages=num_stages,
                             partition="uniform", seed=11)


def data(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(step)
    return [(torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g))
            for _ in range(MICRO_BATCHES)]


class _Pause:
    """Counts nothing while ``depth`` > 0 (inside the transport)."""

    depth = 0


class _Handle:
    """A transport handle whose ``is_completed()`` is ``True`` only once waited on, and
    whose wait is not counted."""

    __slots__ = ("_inner", "_done")

    def __init__(self, inner) -> None:
        self._inner, self._done = inner, False

    def wait(self) -> None:
        _Pause.depth += 1
        try:
            self._inner.wait()
        finally:
            _Pause.depth -= 1
        self._done = True

    def is_completed(self) -> bool:
        return self._done


def _paused(method, handles: str | None):
    def call(*args, **kwargs):
        _Pause.depth += 1
        try:
            out = method(*args, **kwargs)
        finally:
            _Pause.depth -= 1
        if handles == "one":
            return _Handle(out)
        if handles == "list":
            return [_Handle(h) for h in out]
        return out
    return call


def _wrap(transport) -> None:
    for name, handles in (("isend", "one"), ("irecv", "one"), ("batch_isend_irecv", "list"),
                          ("iall_reduce", "one"), ("all_reduce", None), ("broadcast", None),
                          ("barrier", None), ("all_gather", None)):
        method = getattr(transport, name, None)
        if method is not None:
            setattr(transport, name, _paused(method, handles))


class CallCounter:
    """``sys.setprofile`` counter of calls per instruction kind (see the module docstring).

    ``calls[kind]`` is the calls made while instructions of ``kind`` ran, ``instances[kind]``
    how many ran; ``setup`` and ``finish`` are the batch's own work around the loop."""

    def __init__(self, enter_code, run_code, detail: bool = False) -> None:
        self.calls: collections.Counter = collections.Counter()
        #: with ``detail``: calls per ``(kind, function)``, to see what a kind's calls are
        self.functions: collections.Counter | None = collections.Counter() if detail else None
        self.instances: collections.Counter = collections.Counter()
        self._enter, self._run = enter_code, run_code
        self._bucket = "setup"

    def _profile(self, frame, event, arg) -> None:
        if _Pause.depth:
            return
        if event == "call":
            code = frame.f_code
            if code is self._enter:
                kind = type(frame.f_back.f_locals["instruction"]).__name__
                self._bucket = kind
                self.instances[kind] += 1
            self.calls[self._bucket] += 1
            if self.functions is not None:
                code = frame.f_code
                name = f"{code.co_filename.split('/')[-1]}:{code.co_firstlineno}:{code.co_name}"
                self.functions[self._bucket, name] += 1
        elif event == "c_call":
            self.calls[self._bucket] += 1
            if self.functions is not None:
                self.functions[self._bucket, f"C:{getattr(arg, '__qualname__', arg)}"] += 1
        elif event == "return" and frame.f_code is self._run:
            self._bucket = "finish"

    def __enter__(self) -> CallCounter:
        self._gc = gc.isenabled()
        gc.disable()
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)
        if self._gc:
            gc.enable()

    def per_instruction(self) -> dict[str, float]:
        """Calls per instruction of each kind, and ``setup``/``finish`` per batch."""
        out = {kind: self.calls[kind] / n for kind, n in self.instances.items()}
        out["setup"], out["finish"] = self.calls["setup"], self.calls["finish"]
        return out


def calls_worker(steps: int = 2, detail: bool = False) -> list[Any]:
    """Per counted step (after :data:`WARMUP` uncounted ones), this rank's calls per
    instruction kind (with ``detail``: and per kind and function); through
    :func:`run_ranks`, 2 ranks."""
    torch.set_num_threads(1)
    engine = pk.PipelineEngine(model(2), optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
                               micro_batches=MICRO_BATCHES, schedule="1f1b", timeout=60,
                               check_data_steps=0)
    _wrap(engine.transport)
    for step in range(WARMUP):
        engine.train_batch(iter(data(step)))
    out = []
    for step in range(WARMUP, WARMUP + steps):
        batch = iter(data(step))
        with CallCounter(type(engine.runtime).enter.__code__, Kernel.run.__code__,
                         detail) as counter:
            engine.train_batch(batch)
        out.append((counter.per_instruction(), counter.functions) if detail
                   else counter.per_instruction())
    engine.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--detail", metavar="KIND", help="also list KIND's calls by function")
    args = parser.parse_args()
    if args.detail:
        for rank, per_step in enumerate(run_ranks(calls_worker, 2, 1, True, timeout=240)):
            per, functions = per_step[0]
            print(f"rank {rank}: {args.detail}")
            for (kind, name), count in sorted(functions.items(), key=lambda x: x[0][1]):
                if kind == args.detail:
                    print(f"  {count:6d}  {name}")
        return
    results = run_ranks(calls_worker, 2, 2, timeout=240)
    kinds = sorted({k for per_rank in results for k in per_rank[0]},
                   key=lambda k: (k in ("setup", "finish"), k))
    print(f"calls per instruction ({'; '.join(f'rank {r}' for r in range(2))}), "
          f"torch {torch.__version__}, Python {sys.version.split()[0]}")
    print("| instruction | " + " | ".join(f"rank {r}" for r in range(2)) + " |")
    print("|---|" + "---|" * 2)
    for kind in kinds:
        cells = [f"{per_rank[0][kind]:g}" if kind in per_rank[0] else "-" for per_rank in results]
        print(f"| {kind} | " + " | ".join(cells) + " |")
    same = all(per_rank[0] == per_rank[1] for per_rank in results)
    print(f"two counted steps equal: {same}")


if __name__ == "__main__":
    main()
