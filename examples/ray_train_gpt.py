"""Train the byte-level GPT of ``pipekernel train`` (``pipekernel.apps.gpt``) with Ray Train.

    pip install "pipekernel[ray]"
    python examples/ray_train_gpt.py                     # a local Ray cluster, 2 CPU workers
    python examples/ray_train_gpt.py --address auto --workers 8 --gpu   # a running cluster

Ray Train's ``TorchTrainer`` starts the workers (on any node of the cluster) and
initialises their process group; each worker builds a ``pk.PipelineEngine``, which
joins that group as it is (``transport="auto"``: nccl on GPU workers, gloo on CPU
workers) — nothing else changes from a torchrun script. ``--workers`` must be a
multiple of ``--stages``; the rest is data parallel.

On a local cluster the example starts Ray on the loopback address
(``ray.init(_node_ip_address="127.0.0.1")``): otherwise Ray Train hands its workers the
machine's first non-loopback address as ``MASTER_ADDR``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

import pipekernel as pk
from pipekernel.apps.gpt import gpt_module

DIM, LAYERS, HEADS, CONTEXT = 32, 2, 2, 16
MICRO_BATCHES, BATCH = 4, 2
TEXT = b"Pipelines split a model into stages; every stage works on a micro-batch. " * 8


def model(stages: int) -> pk.PipelineModule:
    return gpt_module(DIM, LAYERS, HEADS, CONTEXT, num_stages=stages, partition="uniform",
                      seed=0)


def optimizer(params: list) -> torch.optim.Optimizer:
    # SGD: the weights stay one process's up to fp32 rounding. Adam would divide the
    # rounding noise of gradients that are zero in exact arithmetic (attention's key
    # bias: softmax ignores it) by its own tiny size, and step on it at full rate.
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def batches(steps: int, replica: int = 0) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``steps`` lists of ``MICRO_BATCHES`` (inputs, labels) byte windows of ``TEXT``,
    each replica its own (a fixed generator per replica: reproducible anywhere)."""
    data = torch.tensor(list(TEXT), dtype=torch.long)
    g = torch.Generator().manual_seed(1000 + replica)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, len(data) - CONTEXT - 1, (MICRO_BATCHES, BATCH), generator=g)
        out.append([(torch.stack([data[s:s + CONTEXT] for s in row]),
                     torch.stack([data[s + 1:s + CONTEXT + 1] for s in row])) for row in starts])
    return out


def train_loop_per_worker(config: dict) -> None:
    """One Ray Train worker: one rank of the pipeline, in the group Ray Train made."""
    import ray.train

    torch.set_num_threads(1)
    engine = pk.PipelineEngine(model(config["stages"]), optimizer=optimizer,
                               micro_batches=MICRO_BATCHES, timeout=config["timeout"])
    losses = [engine.train_batch(iter(step)).item()
              for step in batches(config["steps"], engine.data_parallel_rank)]
    if config["save"] and engine.data_parallel_rank == 0:  # keys: global layer index
        torch.save(engine.module.state_dict(),
                   os.path.join(config["save"], f"stage{engine.stage}.pt"))
    metrics = {"losses": json.dumps(losses), "master_addr": os.environ.get("MASTER_ADDR", ""),
               "world_size": torch.distributed.get_world_size(),
               "transport": type(engine.transport).__name__}
    engine.close()
    # Ray Train keeps a run's metrics with its checkpoint: rank 0 reports one holding them
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = None
        if ray.train.get_context().get_world_rank() == 0:
            with open(os.path.join(folder, "metrics.json"), "w") as f:
                json.dump(metrics, f)
            checkpoint = ray.train.Checkpoint.from_directory(folder)
        ray.train.report(metrics, checkpoint=checkpoint)


def train(workers: int = 2, stages: int = 2, steps: int = 5, gpu: bool = False,
          address: str | None = None, save: str | None = None,
          timeout: float = 120.0) -> dict:
    """Start Ray (a local loopback cluster unless ``address``), train, return rank 0's
    metrics; ``save``: a folder every node sees, for each stage's final weights."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    if address is None:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        ray.init(_node_ip_address="127.0.0.1", num_cpus=max(workers, 2), include_dashboard=False,
                 object_store_memory=128 << 20,  # this example ships no data through it
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    else:
        ray.init(address=address)
    try:
        trainer = TorchTrainer(
            train_loop_per_worker,
            train_loop_config={"stages": stages, "steps": steps, "timeout": timeout,
                               "save": os.path.abspath(save) if save else None},
            scaling_config=ScalingConfig(num_workers=workers, use_gpu=gpu),
            torch_config=TorchConfig(backend="nccl" if gpu else "gloo",
                                     timeout_s=int(timeout)),
            run_config=RunConfig(storage_path=os.path.abspath("ray_results")))
        result = trainer.fit()
    finally:
        ray.shutdown()
    with result.checkpoint.as_directory() as folder:
        with open(os.path.join(folder, "metrics.json")) as f:
            metrics = json.load(f)
    metrics["losses"] = json.loads(metrics["losses"])
    return metrics


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--gpu", action="store_true", help="one GPU per worker (nccl)")
    parser.add_argument("--address", default=None,
                        help="a running Ray cluster ('auto'); default: a local one")
    parser.add_argument("--save", default=None,
                        help="folder (seen by every node) for each stage's final weights")
    args = parser.parse_args(argv)
    metrics = train(args.workers, args.stages, args.steps, args.gpu, args.address, args.save)
    keep = ("losses", "master_addr", "world_size", "transport")
    print("RESULT " + json.dumps({k: metrics[k] for k in keep}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
