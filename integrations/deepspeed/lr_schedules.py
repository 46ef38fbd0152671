"""DeepSpeed's learning-rate schedules ``WarmupLR``, ``WarmupDecayLR``, ``OneCycle`` and
``WarmupCosineLR``,
reimplemented from their definitions in ``deepspeed/runtime/lr_schedules.py`` (0.19):
the same learning rate (and ``OneCycle``'s momentum) at every step, the same
``state_dict`` (``{"last_batch_iteration": n}``), so a DeepSpeed checkpoint's scheduler
state loads as is.

As in DeepSpeed, ``step()`` is called once after every optimizer step taken, and the
constructor already sets the first learning rate (``last_batch_iteration=-1``: the
minimum).
"""
from __future__ import annotations

import math
from typing import Any

import torch

from pipekernel.errors import ConfigError

__all__ = ["WarmupLR", "WarmupDecayLR", "OneCycle", "WarmupCosineLR", "build_scheduler",
           "SCHEDULES"]

_LOG, _LINEAR = "log", "linear"


def _per_group(optimizer: torch.optim.Optimizer, value: Any, name: str) -> list:
    """A scalar for every param group, or a per-group list of the right length."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ConfigError(f"expected {len(optimizer.param_groups)} value for {name}, "
                              f"got {len(value)}",
                              hint="give one value, or a list with one value per optimizer "
                                   "parameter group")
        return list(value)
    return [value] * len(optimizer.param_groups)


def _set_lr(optimizer: torch.optim.Optimizer, lrs: list) -> list:
    for group, lr in zip(optimizer.param_groups, lrs):
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    return [group["lr"] for group in optimizer.param_groups]


class _Stepped:
    """What DeepSpeed's iteration-counted schedules share: ``step`` sets ``get_lr()`` on
    the optimizer; the state is the iteration alone."""

    def get_last_lr(self) -> list:
        return self._last_lr

    def step(self, last_batch_iteration: int | None = None) -> None:
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = _set_lr(self.optimizer, self.get_lr())

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        self.last_batch_iteration = state["last_batch_iteration"]


class _Warmup(_Stepped):
    """What the warm-up schedules share: the checked warm-up and its ratio."""

    def _set_warmup(self, warmup_num_steps: int, warmup_type: str) -> None:
        if not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
            raise ConfigError(f"warmup_num_steps must be a positive integer, got "
                              f"{warmup_num_steps}",
                              hint='set "warmup_num_steps" in the scheduler params to an int >= '
                                   "1, e.g. 1000")
        if warmup_type not in (_LOG, _LINEAR):
            raise ConfigError(f"warmup_type must be 'log' or 'linear', got {warmup_type!r}",
                              hint="DeepSpeed falls back to 'log' with a warning; say 'log'")
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)

    def _warmup_gamma(self) -> float:
        if self.warmup_type == _LOG:
            return self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
        return self.last_batch_iteration / self.warmup_num_steps


class WarmupLR(_Warmup):
    """From ``warmup_min_lr`` to ``warmup_max_lr`` (default: the optimizer's lr) over
    ``warmup_num_steps`` steps (at least 2), ``log`` or ``linear``, then flat."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_min_lr: Any = 0.0,
                 warmup_max_lr: Any = None, warmup_num_steps: int = 1000,
                 warmup_type: str = _LOG, last_batch_iteration: int = -1) -> None:
        self._set_warmup(warmup_num_steps, warmup_type)
        self.optimizer = optimizer
        if warmup_max_lr is None:
            warmup_max_lr = [group["lr"] for group in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "max_lr")
        self.delta_lrs = [big - small for big, small in zip(self.max_lrs, self.min_lrs)]
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            self._last_lr = _set_lr(optimizer, self.get_lr())

    def get_lr(self) -> list:
        if self.last_batch_iteration < 0:
            return self.min_lrs
        gamma = self._get_gamma()
        return [low + delta * gamma for low, delta in zip(self.min_lrs, self.delta_lrs)]

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_gamma()
        return 1.0


class WarmupDecayLR(WarmupLR):
    """:class:`WarmupLR`, then linear decay to 0 at ``total_num_steps``."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int,
                 warmup_min_lr: Any = 0.0, warmup_max_lr: Any = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = _LOG,
                 last_batch_iteration: int = -1) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps,
                         warmup_type, last_batch_iteration)

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_gamma()
        return max(0.0, float(self.total_num_steps - self.last_batch_iteration)
                   / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class OneCycle(_Stepped):
    """DeepSpeed's 1Cycle: lr from ``cycle_min_lr`` up to ``cycle_max_lr`` over
    ``cycle_first_step_size`` steps and back over ``cycle_second_step_size`` (optionally
    in stairs), then decayed by ``decay_lr_rate`` every ``decay_step_size`` steps;
    ``betas[0]`` cycled inversely between ``cycle_max_mom`` and ``cycle_min_mom``."""

    def __init__(self, optimizer: torch.optim.Optimizer, cycle_min_lr: Any, cycle_max_lr: Any,
                 decay_lr_rate: float = 0., cycle_first_step_size: int = 2000,
                 cycle_second_step_size: int | None = None, cycle_first_stair_count: int = 0,
                 cycle_second_stair_count: int | None = None, decay_step_size: int = 0,
                 cycle_momentum: bool = True, cycle_min_mom: Any = 0.8,
                 cycle_max_mom: Any = 0.9, decay_mom_rate: float = 0.,
                 last_batch_iteration: int = -1) -> None:
        self.optimizer = optimizer
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        if first <= 0 or second < 0:
            raise ConfigError(f"OneCycle needs cycle_first_step_size > 0 and "
                              f"cycle_second_step_size >= 0, got {first} and {second}",
                              hint='set "cycle_first_step_size" > 0 (and "cycle_second_step_size" '
                                   ">= 0) in the scheduler params")
        self.total_size, self.step_ratio = first + second, first / (first + second)
        self.first_step_size, self.second_step_size = first, second
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (cycle_first_stair_count if cycle_second_stair_count is None
                                   else cycle_second_stair_count)
        self.decay_step_size = decay_step_size
        self.skip_lr_decay = self.skip_mom_decay = math.isclose(decay_step_size, 0)
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        if last_batch_iteration == -1:
            _set_lr(optimizer, self.min_lrs)
        self.decay_lr_rate = decay_lr_rate
        if math.isclose(decay_lr_rate, 0):
            self.skip_lr_decay = True
        self.cycle_momentum = cycle_momentum and "betas" in optimizer.defaults
        if self.cycle_momentum:
            self._init_momentum(cycle_min_mom, cycle_max_mom, decay_mom_rate,
                                last_batch_iteration)
        self.last_batch_iteration = last_batch_iteration

    def _init_momentum(self, low: Any, high: Any, rate: float, last: int) -> None:
        self.decay_mom_rate = rate
        self.min_moms = [(m, 0.99) for m in _per_group(self.optimizer, low, "cycle_min_mom")]
        self.max_moms = [(m, 0.99) for m in _per_group(self.optimizer, high, "cycle_max_mom")]
        if last == -1:
            for betas, group in zip(self.min_moms, self.optimizer.param_groups):
                group["betas"] = betas
        if math.isclose(rate, 0):
            self.skip_mom_decay = True

    def _scale_factor(self) -> float:
        iteration = self.last_batch_iteration + 1
        cycle = math.floor(1 + iteration / self.total_size)
        x = 1. + iteration / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            position = iteration % self.total_size
            if position <= self.first_step_size:
                stair = position * stairs / self.first_step_size
            else:
                stair = (self.total_size - position) * stairs / self.second_step_size
            scale = math.floor(stair) / stairs
        return scale

    def get_lr(self) -> list:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [low + (high - low) * scale for low, high in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return self.min_lrs
        interval = (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        return [low / (1 + self.decay_lr_rate * interval) for low in self.min_lrs]

    def get_mom(self) -> list | None:
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [(high[0] - (high[0] - low[0]) * scale, low[1])
                    for low, high in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return self.max_moms
        interval = (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        return [(b0 * (1 + self.decay_mom_rate * interval), b1) for b0, b1 in self.max_moms]

    def step(self, batch_iteration: int | None = None) -> None:
        super().step(batch_iteration)
        if self.cycle_momentum:
            for group, betas in zip(self.optimizer.param_groups, self.get_mom()):
                group["betas"] = betas


class WarmupCosineLR(_Warmup):
    """Each group's lr times a ratio: from ``warmup_min_ratio`` to 1 over
    ``warmup_num_steps`` steps (at least 2; ``log`` or ``linear``), then a cosine from 1
    down to ``cos_min_ratio`` at ``total_num_steps``, where it stays. Before the first
    step the lr is 0, as in DeepSpeed (the ratio of ``last_batch_iteration=-1``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int,
                 warmup_min_ratio: float = 0.0, warmup_num_steps: int = 1000,
                 cos_min_ratio: float = 0.0001, warmup_type: str = _LOG,
                 last_batch_iteration: int = -1) -> None:
        self._set_warmup(warmup_num_steps, warmup_type)
        self.optimizer, self.total_num_steps = optimizer, total_num_steps
        self.last_batch_iteration, self.cos_min_ratio = last_batch_iteration, cos_min_ratio
        self.warmup_min_ratio = warmup_min_ratio
        self.org_lrs = [g["lr"].clone() if torch.is_tensor(g["lr"]) else g["lr"]
                        for g in optimizer.param_groups]
        if last_batch_iteration == -1:
            self._last_lr = _set_lr(optimizer, self.get_lr())

    def get_lr_ratio(self) -> float:
        step = self.last_batch_iteration
        if step < 0:
            return 0.0
        if step < self.warmup_num_steps:
            return self.warmup_min_ratio + self._warmup_gamma() * (1. - self.warmup_min_ratio)
        real_last_step = step - self.warmup_num_steps + 1
        real_total_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, real_last_step / real_total_steps)
        ratio = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1. - self.cos_min_ratio) * ratio)

    def get_lr(self) -> list:
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


SCHEDULES = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "OneCycle": OneCycle,
             "WarmupCosineLR": WarmupCosineLR}


def build_scheduler(section: dict | None) -> Any:
    """``factory(optimizer) -> scheduler`` for a config's ``scheduler`` section, or ``None``.

    :raises ConfigError: a type other than those in :data:`SCHEDULES`, or params it
        does not take (named).
    """
    if section is None:
        return None
    kind, params = section["type"], section["params"]
    cls = SCHEDULES.get(kind)
    if cls is None:
        raise ConfigError(f"scheduler.type {kind!r} is not implemented by pipekernel.deepspeed",
                          hint=f"use one of {sorted(SCHEDULES)}, or build the scheduler "
                               "yourself and pass initialize(..., lr_scheduler=...)")
    import inspect
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "optimizer"}
    unknown = sorted(set(params) - accepted)
    if unknown:
        raise ConfigError(f"scheduler.params of {kind} has unknown key(s) {unknown}",
                          hint=f"{kind} takes {sorted(accepted)}")

    def factory(optimizer: torch.optim.Optimizer) -> Any:
        return cls(optimizer, **params)
    return factory
