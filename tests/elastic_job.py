"""A tiny pipeline job that survives a lost rank, for tests/test_restart.py.

Run by ``torchrun --max-restarts N tests/elastic_job.py OUT STEPS SAVE_EVERY STAGES REPLICAS``
(or :func:`train` through ``pk.launch`` for the uninterrupted reference): it resumes from
``OUT/ckpt`` if a checkpoint is there, trains up to ``STEPS`` steps with a checkpoint every
``SAVE_EVERY``, and writes each rank's final weights to ``OUT/weights-<rank>.pt``.

The fault is deterministic: ``PK_TEST_KILL="rank:step:attempts"`` (e.g. ``"1:5:0"``, or
``"1:5:0,1"``) makes global rank ``rank`` SIGKILL itself in its first layer, at micro-batch
1 of train step ``step`` (mid-batch, its peers blocked on it), on those torchelastic
attempts (``TORCHELASTIC_RESTART_COUNT``). It writes the kill's wall-clock time to
``OUT/kill-<attempt>``; rank 0 writes the time its first step of an attempt ended to
``OUT/first-<attempt>`` (with the step it resumed from), for the report's figures.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
from torch import nn

import pipekernel as pk

_NOW = {"train_step": 0, "calls": 0}


def _die_here(x):
    """Identity; SIGKILLs this process where ``PK_TEST_KILL`` says (see the module doc)."""
    spec = os.environ.get("PK_TEST_KILL")
    if spec and torch.is_grad_enabled():
        rank, step, attempts = spec.split(":")
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        _NOW["calls"] += 1
        if (int(rank) == int(os.environ["RANK"]) and int(step) == _NOW["train_step"]
                and attempt in attempts.split(",") and _NOW["calls"] == 2):
            with open(os.path.join(os.environ["PK_TEST_OUT"], f"kill-{attempt}"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
    return x


def module(stages: int) -> pk.PipelineModule:
    layers = []
    for _ in range(stages):
        layers += [_die_here, pk.LayerSpec(nn.Linear, 8, 8), pk.LayerSpec(nn.Linear, 8, 8)]
    return pk.PipelineModule(layers, loss_fn=nn.MSELoss(), num_stages=stages,
                             partition=[3 * s for s in range(stages + 1)], seed=7)


def data(step: int, replica: int) -> list:
    """Step ``step``'s micro-batches, the same for every replica (so that a 2 x 2 job's
    weights equal the 2-stage job's bit for bit: the average of equal gradients is exact)."""
    g = torch.Generator().manual_seed(step)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)) for _ in range(2)]


def train(out: str, steps: int, save_every: int, stages: int, replicas: int) -> dict:
    """Train (resuming from ``out/ckpt``); every rank saves its final weights."""
    torch.set_num_threads(1)
    os.environ["PK_TEST_OUT"] = out
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    engine = pk.PipelineEngine(module(stages), micro_batches=2, data_parallel_size=replicas,
                               optimizer=lambda p: torch.optim.AdamW(p, lr=0.01), timeout=60)
    info = engine.resume(os.path.join(out, "ckpt"))
    first = engine.global_steps
    for step in range(first, steps):
        _NOW.update(train_step=step + 1, calls=0)
        engine.train_batch(iter(data(step, engine.data_parallel_rank)))
        if step == first and engine.rank == 0:
            with open(os.path.join(out, f"first-{attempt}"), "w") as f:
                f.write(json.dumps({"time": time.time(), "resumed_from": first}))
        if (step + 1) % save_every == 0:
            engine.save_checkpoint(os.path.join(out, "ckpt"))
    torch.save(engine.module.state_dict(), os.path.join(out, f"weights-{engine.rank}.pt"))
    engine.close()
    return {"resumed": info is not None, "first": first}


if __name__ == "__main__":
    out, steps, save_every, stages, replicas = sys.argv[1:6]
    train(out, int(steps), int(save_every), int(stages), int(replicas))
