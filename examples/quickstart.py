"""Train a small model across 2 local processes and print its loss falling (gloo on the
CPU; nccl when every process has a GPU: the engine's default transport="auto").

    python examples/quickstart.py [--steps 30] [--stages 2] [--data-parallel 1]

Each process builds only its own stage; `pk.launch` sets the torchrun
environment, so the same `main()` also runs under
`torchrun --nproc-per-node 2 examples/quickstart.py --torchrun`.
"""
from __future__ import annotations

import argparse

import torch
from torch import nn

import pipekernel as pk

VOCAB, DIM, SEQ = 32, 32, 16


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(dim), nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(),
                                                               nn.Linear(4 * dim, dim))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(self.norm(h))


def head(embedding: nn.Embedding, h: torch.Tensor) -> torch.Tensor:
    return h @ embedding.weight.t() / DIM**0.5  # output head tied to the input embedding


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def batches(replica: int, micro_batches: int, batch: int = 8):
    """Sequences that count up by a per-sequence stride: learnable, not memorisable."""
    g = torch.Generator().manual_seed(replica)
    while True:
        start = torch.randint(0, VOCAB, (batch, 1), generator=g)
        stride = torch.randint(1, 4, (batch, 1), generator=g)
        seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB
        yield seq[:, :-1], seq[:, 1:]


def main(steps: int = 30, stages: int = 2, micro_batches: int = 4) -> list[float]:
    layers = [pk.TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM),
              *[pk.LayerSpec(Block, DIM) for _ in range(4)],
              pk.TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM, forward_fn=head)]
    module = pk.PipelineModule(layers, loss_fn=loss_fn, num_stages=stages, seed=0)
    engine = pk.PipelineEngine(module, optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3),
                               micro_batches=micro_batches)  # transport="auto"
    data = batches(engine.data_parallel_rank, micro_batches)
    losses = []
    for step in range(steps):
        loss = engine.train_batch(data).item()
        losses.append(loss)
        if engine.rank == 0 and (step % 5 == 0 or step == steps - 1):
            print(f"step {step:3d}  loss {loss:.4f}", flush=True)
    engine.close()
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--data-parallel", type=int, default=1)
    parser.add_argument("--torchrun", action="store_true", help="run this rank only (torchrun)")
    args = parser.parse_args()
    if args.torchrun:
        main(args.steps, args.stages)
    else:
        losses = pk.launch(main, args.stages * args.data_parallel, (args.steps, args.stages))[0]
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {args.steps} steps on "
              f"{args.stages} stages x {args.data_parallel} replicas")
