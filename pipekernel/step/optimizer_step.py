"""The end of a batch: gradient reductions, the optimizer step (unscaling, the token
rescale, clipping, skipping a step on overflow or a non-finite loss, all decided by one small
all-reduce read by the host once: :mod:`pipekernel.step.stats`) and the batch's loss, the same
on every rank.

:class:`BatchStep` serves the step's instructions (``ReduceTiedGrads``, ``ReduceGrads``,
``OptimizerStep``) in the kernel's dispatch table like the runtime's handlers serve the
others. It reads the batch's losses (:class:`BatchLosses`: losses, auxiliary losses and
token counts, which the stage runtime records): those recorded so far through
``losses()`` at ``OptimizerStep``, and those the runtime's ``end()`` returned for the
batch's loss (:meth:`BatchStep.mean_loss`). Nothing here reads the engine or the runtime.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from pipekernel.errors import ConfigError, DataError, NonFiniteLossError
from pipekernel.grid.expert_parallel import is_expert
from pipekernel.grid.mesh import local_share
from pipekernel.schedules import instructions as isa
from pipekernel.step.local_shards import step_local_shards
from pipekernel.step.stats import StepStats, nonfinite_flag

__all__ = ["BatchStep", "BatchLosses"]


class BatchLosses:
    """The losses one rank computed in one batch, in the order computed: ``values`` (0-dim
    tensors, detached) and ``micro_batches`` (which micro-batch each is), the token count
    of each under ``loss_reduction="tokens"`` (``tokens``, 0-dim float64), and the same
    for the auxiliary losses its chunks added (``aux_values``, ``aux_micro_batches``; one
    sum per chunk forward, any stage: :mod:`pipekernel.model.aux_loss`). A new one per
    batch: the stage runtime's :class:`~pipekernel.stage.loss.LossKeeper` appends, the
    runtime's ``end()`` hands it over (empty on stages that compute no loss)."""

    __slots__ = ("values", "micro_batches", "tokens", "aux_values", "aux_micro_batches")

    def __init__(self) -> None:
        self.values: list[torch.Tensor] = []
        self.micro_batches: list[int] = []
        self.tokens: list[torch.Tensor] = []
        self.aux_values: list[torch.Tensor] = []
        self.aux_micro_batches: list[int] = []

    def add(self, loss: torch.Tensor, micro_batch: int,
            tokens: torch.Tensor | None = None) -> None:
        self.values.append(loss)
        self.micro_batches.append(micro_batch)
        if tokens is not None:
            self.tokens.append(tokens)

    def local_tokens(self, device: Any) -> torch.Tensor:
        """This rank's tokens in the batch (0-dim float64 on ``device``)."""
        if not self.tokens:
            return torch.zeros((), dtype=torch.float64, device=device)
        return torch.stack(self.tokens).sum().to(device)

    def add_aux(self, aux: torch.Tensor, micro_batch: int) -> None:
        self.aux_values.append(aux)
        self.aux_micro_batches.append(micro_batch)



class BatchStep:
    """Reductions, the optimizer step and the batch loss of one stage of one replica.

    :param module: the stage's :class:`~pipekernel.model.module.StageModule` (its
        ``tied_modules`` and parameters).
    :param precision: the precision policy (unscaling, master copies, the step).
    :param optimizer: the optimizer over the precision's parameters (``None``: no training).
    :param lr_scheduler: stepped after each step taken, or ``None``.
    :param transport: for the world-wide all-reduces of the step's statistics and the loss.
    :param topology: this rank's place in the grid.
    :param tied_groups: ``{tied key: (group, ranks)}`` of this stage.
    :param tied_reducers: ``{tied key: GradReducer}`` summing tied gradients.
    :param grad_reducer: the data-parallel ``GradReducer`` or ``None``.
    :param max_grad_norm: clip to this global norm, or ``None``.
    :param nonfinite: ``"error"`` or ``"skip"`` (see the engine).
    :param tokens: ``loss_reduction="tokens"``: the losses come with token counts, the
        gradients and the loss are divided by the batch's tokens.
    :param expert_parallel: the :class:`~pipekernel.grid.expert_parallel.ExpertParallelGroup`
        when experts are spread over replicas (``None``: every replica holds every parameter).
    :param losses: ``losses()``: the running batch's losses recorded so far (the stage
        runtime's, read at ``OptimizerStep``; ``None``: none).
    """

    def __init__(self, *, module: Any, precision: Any, optimizer: Any, lr_scheduler: Any,
                 transport: Any, topology: Any, tied_groups: dict, tied_reducers: dict,
                 grad_reducer: Any, max_grad_norm: float | None, nonfinite: str,
                 tokens: bool = False, expert_parallel: Any = None,
                 losses: Callable[[], BatchLosses] | None = None) -> None:
        self.module, self.precision, self.optimizer = module, precision, optimizer
        self.lr_scheduler, self.transport, self.topology = lr_scheduler, transport, topology
        self.tied_groups, self._tied_reducers = tied_groups, tied_reducers
        self.grad_reducer, self.max_grad_norm = grad_reducer, max_grad_norm
        self.nonfinite, self.tokens = nonfinite, tokens
        self.expert_parallel = expert_parallel
        self.rank, self.stage, self.num_stages = topology.rank, topology.stage, topology.pipe_size
        #: Global gradient norm of the last step (before clipping), when clipping.
        self.last_grad_norm: float | None = None
        self.last_grad_scale = 1.0  # the token scale of the last step (1.0: none)
        self.last_aux_loss: float | None = None
        self._last_step_taken = True
        self._losses = losses if losses is not None else BatchLosses
        self.micro_batches, self.global_steps = 1, 0
        #: the step's read statistics, for the batch's loss (pipekernel/step/stats.py)
        self._read_stats: tuple[StepStats, list[float]] | None = None

    def begin(self, micro_batches: int, global_steps: int) -> None:
        """Start a batch of ``micro_batches`` after ``global_steps`` steps."""
        self.micro_batches, self.global_steps = micro_batches, global_steps
        self._read_stats = None

    @property
    def last_step_taken(self) -> bool:
        """Whether the last ``OptimizerStep`` stepped (``False``: skipped on overflow or a
        non-finite loss, on every rank)."""
        return self._last_step_taken

    def handlers(self) -> dict[type, Callable[[Any], None]]:
        """The step's part of the kernel's dispatch table."""
        return {isa.ReduceTiedGrads: self.on_reduce_tied_grads,
                isa.ReduceGrads: self.on_reduce_grads, isa.OptimizerStep: self.on_optimizer_step}

    def on_reduce_tied_grads(self, instruction: isa.ReduceTiedGrads) -> None:
        self.reduce_tied_grads()

    def on_reduce_grads(self, instruction: isa.ReduceGrads) -> None:
        self.reduce_grads()

    def on_optimizer_step(self, instruction: isa.OptimizerStep) -> None:
        self._optimizer_step()

    def mean_loss(self, losses: BatchLosses, training: bool = False) -> torch.Tensor:
        """The batch's loss from its ``losses`` (see :meth:`_mean_loss`)."""
        return self._mean_loss(losses, training)

    # -- reductions and the step ------------------------------------------------
    def _master_grads(self, params: Iterable[torch.Tensor]
                      ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(parameter, gradient)`` pairs, the gradient living on the precision's
        master copy (the parameter itself under fp32); parameters without one are skipped."""
        for p in params:
            grad = self.precision.master(p).grad
            if grad is not None:
                yield p, grad

    def reduce_tied_grads(self) -> None:
        """Sum each tied weight's gradient over the stages that hold it."""
        for reducer in self._tied_reducers.values():
            reducer.finish()

    def reduce_grads(self) -> None:
        """Average gradients over data-parallel replicas: wait for the buckets started
        during the last backward, start and wait for the rest, write back."""
        if self.grad_reducer is not None:
            self.grad_reducer.finish()

    def _optimizer_step(self) -> None:
        if self.optimizer is None:
            raise ConfigError("train_batch needs an optimizer",
                              hint="pass optimizer=lambda params: torch.optim.SGD(params, lr=0.1)")
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        found_inf = self.precision.unscale_(params)  # a device flag, a bool or None
        clip = self.max_grad_norm is not None
        skip_bad, tokens = self.nonfinite == "skip", self.tokens
        overflow = skipped = False
        scale = 1.0  # gradients are divided by the tokens per micro-batch and replica
        if found_inf is not None or clip or skip_bad or tokens:
            # One all-reduce over the world of one device vector carries the overflow
            # flags, the squared norm, the non-finite-loss flags, the token count and the
            # batch's loss, read with one host synchronisation (pipekernel/step/stats.py):
            # every stage and replica takes the same decision, the step waits for the
            # device once, and the batch's loss needs no second read. (With nothing to
            # decide the step does not wait for the other stages; the loss is read once,
            # after the batch.)
            losses = self._losses()
            stats = self._step_stats(losses, training=True)
            stats.put(stats.OVERFLOW, found_inf)
            if clip:
                stats.put(stats.NORM_SQ, self.local_grad_norm_sq())
            if skip_bad:
                stats.put(stats.BAD, nonfinite_flag(losses.values + losses.aux_values))
            self.transport.all_reduce(stats.vec)
            values = stats.read()
            self._read_stats = (stats, values)
            overflow = values[stats.OVERFLOW] > 0
            skipped = overflow or values[stats.BAD] > 0
            if tokens:
                scale = self._token_scale(values[stats.TOKENS])
            if clip:
                self.last_grad_norm = math.sqrt(values[stats.NORM_SQ]) * scale  # rescaled
        if not skipped:
            coef = self._clip_coef(self.last_grad_norm) if clip else 1.0  # type: ignore[arg-type]
            if scale * coef != 1.0:
                self._scale_grads(params, scale * coef)
            # DTensor parameters (FSDP2, DTensor plans) step on their local shards
            step_local_shards(self.optimizer, lambda: self.precision.step(self.optimizer))
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        self.precision.update(overflow)  # only an overflow moves the loss scale
        self._last_step_taken = not skipped
        self.last_grad_scale = scale  # what the sentinel compares over the stages
        self.optimizer.zero_grad(set_to_none=True)

    def _step_stats(self, losses: BatchLosses, training: bool) -> StepStats:
        """The batch's statistics vector with this rank's ``losses`` and tokens in it."""
        stats = StepStats(self.transport.device, self.micro_batches, self.transport.world_size,
                          flags=training and self.nonfinite == "error")
        stats.put_losses(losses.values, losses.micro_batches, self.rank)
        stats.put_aux(losses.aux_values, losses.aux_micro_batches, self.rank)
        if self.tokens:
            stats.put(stats.TOKENS, losses.local_tokens(stats.vec.device))
        return stats

    def local_grad_norm_sq(self) -> torch.Tensor | None:
        """This rank's share of the global squared gradient norm (0-dim float64 on the
        device, ``None`` for nothing): one replica counts (gradients are equal after the
        data-parallel reduction), a tied weight counts on the first stage holding it only,
        and a plain parameter (replicated over the tensor-parallel group) on its rank 0 only.
        A DTensor gradient (FSDP2, DTensor plans) counts its
        local shard where it is not a copy (:func:`~pipekernel.grid.mesh.local_share`);
        a plain one under ``data_parallel_shard`` on the first shard only. Spread experts
        count on the first member of their expert-data-parallel group (together those hold
        every expert once)."""
        topo, ep = self.topology, self.expert_parallel
        dense = topo.replica_rank == 0
        experts = dense if ep is None else ep.expert_data_rank == 0
        if not (dense or experts):
            return None
        replicated = topo.model_rank != 0  # counted on tensor-parallel rank 0
        not_owner = {id(p) for key, (_, ranks) in self.tied_groups.items() if ranks[0] != self.rank
                     for p in self.module.tied_modules[key].parameters()}
        squares = []
        for p, grad in self._master_grads(self.module.parameters()):
            if id(p) in not_owner or not (experts if ep is not None and is_expert(p) else dense):
                continue
            share = local_share(grad, topo.model_rank)
            if share is False:  # a plain tensor: equal on every shard and (maybe) tp rank
                if topo.shard_rank != 0 or replicated:
                    continue
                share = grad
            if share is not None:
                squares.append(share.detach().double().pow(2).sum())
        return torch.stack(squares).sum() if squares else None  # stays on the device

    def _token_scale(self, total_tokens: float) -> float:
        """The factor turning accumulated ``Σ loss_sum / micro_batches`` gradients
        (averaged over replicas) into those of the loss averaged over all tokens."""
        if total_tokens <= 0:
            raise DataError(
                f"train step {self.global_steps + 1} (1-based): the batch has {total_tokens:g} tokens "
                f"over its {self.micro_batches} micro-batch(es) and "
                f"{self.topology.data_size} replica(s) (loss_reduction='tokens')",
                hint="the token_count loss_fn returns must be > 0 over the batch: check "
                     "the padding mask of the labels", rank=self.rank, stage=self.stage,
                train_step=self.global_steps + 1)
        # every tensor-parallel rank of a last stage counts the same tokens
        return self.micro_batches * self._loss_copies() / total_tokens

    def _clip_coef(self, norm: float) -> float:
        if self.max_grad_norm is None:  # no clipping
            return 1.0
        return min(self.max_grad_norm / (norm + 1e-6), 1.0)  # as clip_grad_norm_

    @staticmethod
    def _scale_grads(params: list[torch.Tensor], factor: float) -> None:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(factor)


    def _mean_loss(self, losses: BatchLosses, training: bool = False) -> torch.Tensor:
        """The batch's loss, the same on every rank: one all-reduce of the last stages'
        loss sum (and token count), and, when training with ``nonfinite="error"``, of
        which micro-batches and ranks had a NaN/inf loss. A train step already carried
        these in its statistics (read once there); otherwise they are all-reduced here
        and read with one host synchronisation."""
        read, self._read_stats = self._read_stats, None
        if training and read is not None:
            stats, values = read
        else:
            stats = self._step_stats(losses, training)
            self.transport.all_reduce(stats.vec)  # only last stages contribute
            values = stats.read()
        loss_sum, aux_sum = values[stats.LOSS], values[stats.AUX]
        if stats.flags and not math.isfinite(loss_sum + aux_sum):
            self._raise_nonfinite(stats.bad_micro_batches(values), stats.bad_ranks(values))
        copies = self.micro_batches * self._loss_copies()
        #: The batch's auxiliary loss (part of the returned loss), or ``None`` when no
        #: stage added one (:mod:`pipekernel.model.aux_loss`).
        self.last_aux_loss = aux_sum / copies if values[stats.AUX_COUNT] > 0 else None
        if not self.tokens:
            # float32 as the losses (the reference's division)
            loss = torch.tensor(loss_sum, dtype=torch.float32) / copies
            if self.last_aux_loss is not None:
                loss = loss + torch.tensor(aux_sum, dtype=torch.float32) / copies
            return loss
        tokens = values[stats.TOKENS]
        if tokens <= 0:
            raise DataError(f"the batch has no tokens (loss_reduction='tokens'): the "
                            f"token counts of its {self.micro_batches} micro-batch(es) sum to "
                            f"{tokens:g}",
                            hint="the token_count loss_fn returns must be > 0 over the batch",
                            rank=self.rank, stage=self.stage)
        return torch.tensor(loss_sum / tokens, dtype=torch.float32)

    def _raise_nonfinite(self, mbs: list[int], ranks: list[int]) -> None:
        raise NonFiniteLossError(
            f"the loss is NaN/inf at train step {self.global_steps + 1} (1-based) "
            f"(global_steps={self.global_steps}) for micro-batch(es) {mbs} on rank(s) "
            f"{ranks} (the loss of the last stage, stage {self.num_stages - 1}, or an "
            f"auxiliary loss a layer added); this step's gradients were not finite either",
            hint="lower the learning rate, clip gradients (max_grad_norm=1.0), check the "
                 "data of those micro-batches, or pass nonfinite='skip' to skip such "
                 "steps on every rank", rank=self.rank, stage=self.stage,
            step=self.global_steps + 1, micro_batch=mbs[0] if mbs else None)

    def _loss_copies(self) -> int:
        """Ranks computing each micro-batch's loss: one per replica and tensor-parallel rank."""
        return self.topology.data_size * self.topology.model_size
