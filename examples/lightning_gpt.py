"""Train the GPT of ``pipekernel train`` with Lightning's Trainer, pipelined by pipekernel.

    python examples/lightning_gpt.py [--devices 2] [--stages 2] [--steps 40] [--micro-batches 4]
    python examples/lightning_gpt.py --gpu --devices 4 --stages 2   # 2 stages x 2 replicas, nccl

``Trainer(devices=N)`` starts the processes itself (the script runs again per rank, as
with DDP); under ``torchrun`` or SLURM it uses theirs. Each rank builds only its stage.
The corpus is the Python standard library's own sources (or ``--data FILE``); the loss
printed at the end is the mean next-byte cross-entropy, the same on every rank.
"""
from __future__ import annotations

import argparse
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

import pipekernel as pk
from pipekernel.apps.gpt import gpt_module
from pipekernel.apps.train import load_corpus, split_corpus
from pipekernel.lightning import PipelineStrategy


class Windows(Dataset):
    """``count`` windows of ``context + 1`` bytes at seeded random places of ``ids``:
    ``(inputs, next-byte labels)``, the same on every rank."""

    def __init__(self, ids: torch.Tensor, context: int, count: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, len(ids) - context - 1, (count,), generator=g)
        self.ids, self.context = ids, context

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.ids[self.starts[i]:self.starts[i] + self.context + 1]
        return window[:-1], window[1:]


class GPT(LightningModule):
    """The contract of docs/lightning.md: configure_model returns the PipelineModule and
    the strategy runs each pipelined step (manual optimization here; Lightning's automatic
    optimization, the default, works the same)."""

    def __init__(self, dim: int = 96, layers: int = 4, heads: int = 4, context: int = 64,
                 lr: float = 3e-3, batch_size: int = 64, steps: int = 40,
                 data: str | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self._pipe: pk.PipelineModule | None = None
        self.losses: list[float] = []

    def configure_model(self) -> pk.PipelineModule:
        if self._pipe is None:  # Lightning may call it again: the same object
            h = self.hparams
            self._pipe = gpt_module(h.dim, h.layers, h.heads, h.context, num_stages=None,
                                    partition="parameters", seed=0)
        return self._pipe

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.hparams.steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": cosine, "interval": "step"}}

    def setup(self, stage: str) -> None:
        data, _ = load_corpus(self.hparams.data)
        self.train_ids, self.val_ids = split_corpus(data, self.hparams.context)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.trainer.strategy.train_batch(batch)
        self.losses.append(float(loss))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.trainer.strategy.eval_batch(batch)
        self.log("val_loss", loss, prog_bar=True)
        return loss

    def train_dataloader(self) -> DataLoader:
        h = self.hparams
        count = h.batch_size * h.steps * max(self.trainer.world_size, 1)
        return DataLoader(Windows(self.train_ids, h.context, count, seed=1),
                          batch_size=h.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        h = self.hparams
        count = h.batch_size * 2 * max(self.trainer.world_size, 1)
        return DataLoader(Windows(self.val_ids, h.context, count, seed=2),
                          batch_size=h.batch_size, drop_last=True)


def main(argv: list[str] | None = None) -> GPT:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32, help="samples per batch and replica")
    p.add_argument("--dim", type=int, default=96)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--data", default=None, help="a text file (default: the stdlib sources)")
    p.add_argument("--checkpoints", default=None, help="save a checkpoint here at the end")
    p.add_argument("--gpu", action="store_true", help="accelerator='gpu' (nccl)")
    args = p.parse_args(argv)
    model = GPT(dim=args.dim, layers=args.layers, context=args.context,
                batch_size=args.batch_size, steps=args.steps, data=args.data)
    trainer = Trainer(accelerator="gpu" if args.gpu else "cpu", devices=args.devices,
                      strategy=PipelineStrategy(num_stages=args.stages,
                                                micro_batches=args.micro_batches),
                      max_steps=args.steps, limit_val_batches=2, val_check_interval=args.steps,
                      num_sanity_val_steps=0, logger=False, enable_model_summary=False,
                      enable_checkpointing=bool(args.checkpoints),
                      callbacks=[ModelCheckpoint(dirpath=args.checkpoints)]
                      if args.checkpoints else None)
    trainer.fit(model)
    engine = trainer.strategy.engine
    if trainer.is_global_zero:
        first, last = model.losses[0], model.losses[-1]
        print(f"loss {first:.4f} -> {last:.4f} over {trainer.global_step} steps on "
              f"{engine.num_stages} stages x {engine.data_parallel_size} replicas; "
              f"val_loss {float(trainer.callback_metrics['val_loss']):.4f}", flush=True)
    return model


if __name__ == "__main__":
    main()
