"""A small LightningModule for PipelineStrategy tests, its data and its one-process oracle.

Importable by spawned processes (the Trainer's own launcher pickles the module).
"""
from __future__ import annotations

import os
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import pipekernel as pk

BATCH, MICRO = 4, 2          # samples per batch and replica; micro-batches per batch
TRAIN_BATCHES = 2            # batches per epoch and replica
VAL_BATCHES = 1
LR, MOMENTUM, GAMMA, EPOCH_GAMMA = 0.1, 0.9, 0.5, 0.8


def pipeline_module() -> pk.PipelineModule:
    layers = [pk.LayerSpec(torch.nn.Linear, 6, 8), pk.LayerSpec(torch.nn.Tanh),
              pk.LayerSpec(torch.nn.Linear, 8, 8), pk.LayerSpec(torch.nn.Tanh),
              pk.LayerSpec(torch.nn.Linear, 8, 3)]
    return pk.PipelineModule(layers, loss_fn=torch.nn.MSELoss(), partition="uniform", seed=7)


def dataset(samples: int, salt: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1000 + salt)
    return TensorDataset(torch.randn(samples, 6, generator=g), torch.randn(samples, 3, generator=g))


def train_data(replicas: int) -> TensorDataset:
    return dataset(BATCH * TRAIN_BATCHES * replicas, 0)


def val_data(replicas: int) -> TensorDataset:
    return dataset(BATCH * VAL_BATCHES * replicas, 1)


def optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


class PipeModel(LightningModule):
    """The contract of docs/lightning.md; records what it saw (``record_dir``: written
    there at the end of fit as ``record-<rank>.pt``)."""

    def __init__(self, replicas: int = 1, record_dir: str | None = None,
                 automatic: bool = False, model: str = "pipeline") -> None:
        super().__init__()
        self.automatic_optimization = automatic
        self.replicas, self.record_dir, self.model_kind = replicas, record_dir, model
        self._pipe: Any = None
        self.train_losses: list[float] = []
        self.val_losses: list[float] = []
        self.steps_seen: list[int] = []
        self.before_step_calls = 0

    def configure_model(self) -> Any:
        if self.model_kind != "pipeline":  # a misconfiguration under test
            return torch.nn.Linear(6, 3)
        if self._pipe is None:
            self._pipe = pipeline_module()
        from pipekernel.lightning import attach_whole_model  # the whole model in one process
        return attach_whole_model(self, self._pipe)

    def configure_optimizers(self) -> Any:
        opt = optimizer(self.parameters())
        every_2 = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=GAMMA)
        per_epoch = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=EPOCH_GAMMA)
        # manual optimization: the module steps it with its metric (it never fires here;
        # the strategy stepping it without one crashed at the first epoch end)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=10 ** 6)
        return [opt], [{"scheduler": every_2, "interval": "step", "frequency": 2},
                       {"scheduler": per_epoch, "interval": "epoch"},
                       {"scheduler": plateau, "interval": "epoch"}]

    def on_validation_epoch_end(self) -> None:
        if self.trainer.state.fn == "fit":
            self.lr_schedulers()[2].step(self.trainer.callback_metrics["val_loss"])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.trainer.strategy.train_batch(batch)
        self.train_losses.append(float(loss))
        self.steps_seen.append(self.trainer.global_step)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.trainer.strategy.eval_batch(batch)
        self.val_losses.append(float(loss))
        self.log("val_loss", loss)
        return loss

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.before_step_calls += 1

    def train_dataloader(self) -> DataLoader:
        return DataLoader(train_data(self.replicas), batch_size=BATCH, shuffle=True,
                          drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(val_data(self.replicas), batch_size=BATCH)

    def on_fit_end(self) -> None:
        if self.record_dir is not None:
            torch.save(self.record(), os.path.join(self.record_dir,
                                                   f"record-{self.global_rank}.pt"))

    def record(self) -> dict[str, Any]:
        stage = getattr(self, "pipeline", None)
        return {"train_losses": list(self.train_losses), "val_losses": list(self.val_losses),
                "steps_seen": list(self.steps_seen), "global_step": self.trainer.global_step,
                "epoch": self.trainer.current_epoch,
                "before_step_calls": self.before_step_calls,
                "callback_metrics": {k: float(v) for k, v in
                                     self.trainer.callback_metrics.items()},
                "state": {k: v.detach().clone() for k, v in stage.state_dict().items()}
                if stage is not None else {},
                "stage_parameters": sum(p.numel() for p in self.parameters()),
                "lr": self.trainer.optimizers[0].param_groups[0]["lr"]
                if self.trainer.optimizers else None}


class FailingModel(PipeModel):
    """Rank 1 raises in its own training_step before the second step."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_rank == 1 and self.trainer.global_step == 1:
            raise ValueError("the module failed on rank 1")
        return super().training_step(batch, batch_idx)


# -- the oracle: the same batches on one process ----------------------------------------
def _replica_batches(data: TensorDataset, replicas: int, epoch: int, shuffle: bool
                     ) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``[batch][replica] -> whole batch`` as Lightning's DistributedSampler deals them."""
    per_replica = []
    for r in range(replicas):
        sampler = DistributedSampler(data, num_replicas=replicas, rank=r, shuffle=shuffle,
                                     seed=0)
        sampler.set_epoch(epoch)
        index = list(sampler)
        batches = [index[i:i + BATCH] for i in range(0, len(index) - BATCH + 1, BATCH)]
        per_replica.append([(data.tensors[0][b], data.tensors[1][b]) for b in batches])
    return [list(step) for step in zip(*per_replica)]


def _micro(batch: tuple[torch.Tensor, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    inputs, labels = batch
    return list(zip(inputs.chunk(MICRO), labels.chunk(MICRO)))


def reference_steps(replicas: int, epochs: int) -> list[list[list[tuple]]]:
    """``batches[step][replica]`` = micro-batches, for :func:`pipekernel.testing.reference_train`."""
    steps = []
    for epoch in range(epochs):
        for step in _replica_batches(train_data(replicas), replicas, epoch, True):
            steps.append([_micro(b) for b in step])
    return steps


def reference_val_items(replicas: int) -> list[list[tuple]]:
    """Per validation batch, every replica's micro-batches."""
    return [[item for b in step for item in _micro(b)]
            for step in _replica_batches(val_data(replicas), replicas, 0, False)]


class _Scheduled(torch.optim.SGD):
    """The module's optimizer and schedulers in one, for the oracle: the step scheduler
    (every 2nd step) and the epoch one (an epoch is TRAIN_BATCHES = 2 steps)."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=LR, momentum=MOMENTUM)
        self.steps = 0
        self.every_2 = torch.optim.lr_scheduler.StepLR(self, step_size=1, gamma=GAMMA)
        self.per_epoch = torch.optim.lr_scheduler.StepLR(self, step_size=1, gamma=EPOCH_GAMMA)

    def step(self, closure: Any = None) -> Any:
        out = super().step(closure)
        self.steps += 1
        if self.steps % 2 == 0:
            self.every_2.step()
        if self.steps % TRAIN_BATCHES == 0:
            self.per_epoch.step()
        return out


def scheduled_optimizer(params: Any) -> torch.optim.Optimizer:
    return _Scheduled(params)


# -- a module written the usual way: layers in __init__, automatic optimization ---------
USUAL_BATCHES = 3            # batches per epoch: accumulate 2 leaves a short last window
USUAL_BOUNDS = [0, 2, 5]     # the stage boundary before a Linear (bf16: exact on the wire)


def usual_data(salt: int) -> TensorDataset:
    return dataset(BATCH * USUAL_BATCHES, salt)


class UsualModel(LightningModule):
    """What a Lightning user writes, plus what the pipeline needs: ``configure_model``
    listing the layers, and ``train_batch``/``eval_batch`` where the loss is computed (the
    one-process branch is the user's original code, the oracle)."""

    def __init__(self, lr: float = LR, mistake: str = "", plateau: bool = True) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(7)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(),
                                       torch.nn.Linear(8, 8), torch.nn.Tanh(),
                                       torch.nn.Linear(8, 3))
        self.loss_fn = torch.nn.MSELoss()
        self.train_losses: list[float] = []
        self.norms: list[tuple[float | None, float | None]] = []
        self.lrs: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def configure_model(self) -> Any:
        return pk.PipelineModule(list(self.net), loss_fn=self.loss_fn, partition=USUAL_BOUNDS)

    def _piped(self) -> bool:
        return type(self.trainer.strategy).__name__ == "PipelineStrategy"

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self._piped() and self.hparams.mistake != "forward":
            loss = self.trainer.strategy.train_batch(batch)
        else:
            x, y = batch
            loss = self.loss_fn(self.net(x), y)
        self.train_losses.append(float(loss))
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if self._piped():
            loss = self.trainer.strategy.eval_batch(batch)
        else:
            x, y = batch
            loss = self.loss_fn(self.net(x), y)
        self.log("val_loss", loss)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self._piped():
            from pipekernel.lightning import grad_norm
            self.norms.append((self.trainer.strategy.grad_norm,
                               grad_norm(self)["grad_2.0_norm_total"]))
        else:
            norm = float(torch.nn.utils.get_total_norm(
                [p.grad for p in self.parameters() if p.grad is not None]))
            self.norms.append((norm, norm))
        self.lrs.append(optimizer.param_groups[0]["lr"])

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=MOMENTUM)
        if not self.hparams.plateau:  # (Lightning skips a plateau step on resuming)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(
                opt, step_size=1, gamma=GAMMA)}
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5,
                                                             patience=0)
        return {"optimizer": opt,
                "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss",
                                 "interval": "epoch"}}

    def train_dataloader(self) -> DataLoader:
        if self._piped():  # Lightning puts a shuffling DistributedSampler there
            return DataLoader(usual_data(0), batch_size=BATCH)
        # one process: the same order as that sampler deals (seed 0, set_epoch per epoch)
        sampler = DistributedSampler(usual_data(0), num_replicas=1, rank=0, shuffle=True, seed=0)
        return DataLoader(usual_data(0), batch_size=BATCH, sampler=sampler)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(usual_data(1), batch_size=BATCH)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(usual_data(2), batch_size=BATCH)

    def record(self) -> dict[str, Any]:
        return {"train_losses": list(self.train_losses), "norms": list(self.norms),
                "lrs": list(self.lrs), "global_step": self.trainer.global_step,
                "state": {k: v.detach().clone() for k, v in self.state_dict().items()}}
