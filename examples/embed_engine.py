"""Embedding level 3: the PipelineEngine inside a host's own training loop.

The host owns the processes, the process group, the loop, the learning-rate
scheduler, gradient clipping and logging; pipekernel only runs each batch
through the pipeline. The host created a world of 3 processes and runs the
2-stage pipeline on a subgroup (global ranks 1 and 2) by handing that group
to the transport: ``transport_options={"group": pipe_group}``. Rank 0 does
host work of its own and still takes part in world collectives.

Gradient clipping by the *global* norm over all stages needs the gradients
after the pipeline reduced them and before the optimizer steps: the host
registers a small plugin whose ``pipekernel_before_instruction`` hook clips
when the ``OptimizerStep`` instruction comes, summing squared norms over the
host's own pipeline group.

Run: ``python examples/embed_engine.py`` (starts 3 local processes), or under
``torchrun --nproc-per-node 3 examples/embed_engine.py``.
"""
from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

import pipekernel as pk
from pipekernel.schedules.instructions import OptimizerStep

PIPE_RANKS = [1, 2]
STEPS, MICRO_BATCHES, MAX_NORM = 5, 4, 0.5
log = logging.getLogger("host")


def make_module():
    layers = [pk.LayerSpec(torch.nn.Linear, 8, 16), torch.tanh,
              pk.LayerSpec(torch.nn.Linear, 16, 16), torch.tanh,
              pk.LayerSpec(torch.nn.Linear, 16, 4)]
    return pk.PipelineModule(layers, loss_fn=torch.nn.MSELoss(), num_stages=2,
                             partition="uniform", seed=42)


def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.2)


def make_scheduler(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def batch(step):
    g = torch.Generator().manual_seed(step)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g))
            for _ in range(MICRO_BATCHES)]


class ClipGlobalNorm:
    """Host plugin: clip by the norm over every stage, right before the optimizer step."""

    def __init__(self, max_norm, group):
        self.max_norm, self.group, self.module, self.norms = max_norm, group, None, []

    @pk.hookimpl
    def pipekernel_before_instruction(self, instruction, stage):
        if not isinstance(instruction, OptimizerStep):
            return
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        squares = torch.stack([g.pow(2).sum() for g in grads]).sum().reshape(1)
        dist.all_reduce(squares, group=self.group)  # the host's own group, not pipekernel's
        norm = squares.sqrt().item()
        scale = min(1.0, self.max_norm / (norm + 1e-6))  # as torch.nn.utils.clip_grad_norm_
        for g in grads:
            g.mul_(scale)
        self.norms.append(norm)


def host_worker():
    """One process of the host job; returns what the test compares."""
    dist.init_process_group("gloo")  # the host's process group, created before pipekernel
    rank = dist.get_rank()
    pipe_group = dist.new_group(PIPE_RANKS)  # every rank of the world creates it
    record = {"rank": rank, "losses": [], "lrs": [], "norms": [], "state": {}, "log": []}
    if rank in PIPE_RANKS:
        clipper = ClipGlobalNorm(MAX_NORM, pipe_group)
        engine = pk.PipelineEngine(make_module(), optimizer=make_optimizer,
                                   micro_batches=MICRO_BATCHES,  # auto: the group's gloo
                                   transport_options={"group": pipe_group},
                                   plugins=[clipper], autoload_plugins=False, timeout=60)
        clipper.module = engine.module
        scheduler = make_scheduler(engine.optimizer)
        for step in range(STEPS):
            loss = engine.train_batch(iter(batch(step)))
            record["lrs"].append(scheduler.get_last_lr()[0])
            scheduler.step()
            record["losses"].append(loss.item())
            line = f"step {step} stage {engine.stage}: loss {loss.item():.5f} " \
                   f"grad-norm {clipper.norms[-1]:.4f} lr {record['lrs'][-1]:g}"
            log.info(line)
            record["log"].append(line)
        record["norms"] = clipper.norms
        record["state"] = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
        record["stage"] = engine.stage
        engine.close()  # leaves the host's process group alone
    # host work on the whole world still works: the last stage tells everyone the final loss
    final = torch.tensor([record["losses"][-1] if record["losses"] else 0.0])
    dist.broadcast(final, src=PIPE_RANKS[-1])
    record["final"] = final.item()
    dist.barrier()
    return record


def reference():
    """The same training on one process, without pipekernel: the oracle."""
    module = make_module()
    model = module.build_stage(0, [0, len(module.layers)])
    optimizer = make_optimizer(list(model.parameters()))
    scheduler = make_scheduler(optimizer)
    losses, norms = [], []
    for step in range(STEPS):
        total = 0.0
        for x, y in batch(step):
            loss = module.loss_fn(model(x), y)
            (loss / MICRO_BATCHES).backward()
            total += loss.item() / MICRO_BATCHES
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(total)
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if "RANK" in os.environ:  # under torchrun
        host_worker()
    else:
        for record in pk.launch(host_worker, 3):
            print("\n".join(record["log"]) or f"rank {record['rank']}: host work only, "
                                                f"final loss {record['final']:.5f}")
        print("reference losses:", [f"{x:.5f}" for x in reference()[0]])
