"""``initialize(training_data=...)``: the repeating loader DeepSpeed's pipeline engine
builds (``_build_data_iter``): a ``DataLoader`` of ``train_micro_batch_size_per_gpu``
samples over a ``DistributedSampler`` (this replica's share, ``shuffle=False``), restarted
when it runs out. (DeepSpeed loads with ``2`` worker processes; this loader with none:
the same batches in the same order.)
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.utils.data

__all__ = ["RepeatingLoader", "make_loader"]


class RepeatingLoader:
    """Iterates ``loader`` forever, starting it again at its end (DeepSpeed's class)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


def make_loader(dataset: Any, micro_batch_size: int, replicas: int, replica: int, *,
                collate_fn: Callable | None = None, drop_last: bool = False) -> RepeatingLoader:
    """The repeating loader for ``dataset`` on data-parallel replica ``replica``."""
    sampler = torch.utils.data.distributed.DistributedSampler(
        dataset, num_replicas=replicas, rank=replica, shuffle=False)
    loader = torch.utils.data.DataLoader(dataset, batch_size=micro_batch_size, sampler=sampler,
                                         collate_fn=collate_fn, drop_last=drop_last)
    return RepeatingLoader(loader)

