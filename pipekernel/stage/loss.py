"""How micro-batch losses become the batch's loss and gradient (``loss_reduction=``).

``"mean"`` (the default): ``loss_fn`` returns a scalar per micro-batch; the batch's
gradient is that of the mean over micro-batches and data-parallel replicas.

``"tokens"``: ``loss_fn`` returns ``(loss_sum, token_count)`` per micro-batch (e.g.
``cross_entropy(..., reduction="sum", ignore_index=-100)`` and the number of labels
that are not padding); the batch's gradient is that of ``Σ loss_sum / Σ token_count``
over every micro-batch of every replica, and the returned loss is that token mean.

The global token count is only known once every micro-batch's loss was computed, and
those are interleaved with backwards. pipekernel does not count tokens up front: it
backwards ``loss_sum / micro_batches`` (the same constant factor on every replica and
stage), lets the gradients accumulate and reduce as usual, and divides them by
``Σ token_count / (micro_batches × replicas)`` right before the optimizer step (after
fp16 unscaling, before clipping). The count travels in the one small all-reduce the
step already does for overflow flags and the gradient norm, so it costs nothing
extra, needs no labels before the first backward, and works with every schedule
(split backwards included). See ``docs/loss.md``.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pipekernel.comm.wire import flatten
from pipekernel.errors import ConfigError, DataError, PipelineError
from pipekernel.model.aux_loss import attach as attach_aux
from pipekernel.nested import describe, map_tensors
from pipekernel.stage.device import to_device
from pipekernel.stage.fingerprint import fingerprint
from pipekernel.step.optimizer_step import BatchLosses

__all__ = ["LOSS_REDUCTIONS", "TokenLoss", "check_loss_reduction", "LossKeeper"]

#: The values ``PipelineEngine(loss_reduction=...)`` accepts.
LOSS_REDUCTIONS = ("mean", "tokens")


def check_loss_reduction(value: Any) -> str:
    """``value`` if it is a known reduction, else ``ConfigError``."""
    if value not in LOSS_REDUCTIONS:
        raise ConfigError(f"loss_reduction must be one of {', '.join(map(repr, LOSS_REDUCTIONS))}"
                          f", got {value!r}",
                          hint="loss_reduction='tokens' with a loss_fn returning "
                               "(loss_sum, token_count)")
    return value


class TokenLoss:
    """Wraps a ``loss_fn`` returning ``(loss_sum, token_count)``: calls check that and
    return ``(loss_sum, count)``, the count a 0-dim float64 tensor (no device sync). It
    keeps nothing: :class:`LossKeeper` records each count with its loss in the batch's
    :class:`~pipekernel.step.optimizer_step.BatchLosses`.

    :param loss_fn: ``loss_fn(outputs, labels) -> (loss_sum, token_count)``.
    """

    def __init__(self, loss_fn: Callable[[Any, Any], Any]) -> None:
        self.loss_fn = loss_fn

    def __call__(self, outputs: Any, labels: Any) -> tuple[torch.Tensor, torch.Tensor]:
        result = self.loss_fn(outputs, labels)
        if not (isinstance(result, (tuple, list)) and len(result) == 2
                and isinstance(result[0], torch.Tensor) and result[0].numel() == 1):
            raise DataError(f"with loss_reduction='tokens' loss_fn must return (loss_sum, "
                            f"token_count), got {describe(result)}",
                            hint="return e.g. (F.cross_entropy(logits, labels, "
                                 "reduction='sum', ignore_index=-100), (labels != -100).sum())")
        loss_sum, count = result
        count = torch.as_tensor(count, device=loss_sum.device)
        if count.numel() != 1:
            raise DataError(f"token_count must be one number, got {describe(count)}",
                            hint="return the number of tokens the loss sum covers")
        return loss_sum, count.detach().reshape(()).to(torch.float64)


class LossKeeper:
    """One stage's losses in a batch: the labels the last position reads, its loss and
    token count per micro-batch, the aux losses of every chunk, and the labels'
    fingerprints (``check_data``). Fills a new :class:`~pipekernel.step.optimizer_step.BatchLosses`
    each batch.

    :param loss_fn: ``loss_fn(outputs, labels)`` (``None``: no loss on this stage).
    :param precision: the precision policy (``scale_loss`` for the aux losses' seed).
    :param tokens: ``loss_reduction="tokens"`` (``loss_fn`` returns ``(sum, count)``).
    :param stage: this stage, for errors.
    """

    def __init__(self, loss_fn: Callable | None, precision: Any, *, tokens: bool,
                 stage: int) -> None:
        self.tokens = tokens and loss_fn is not None
        self.loss_fn = TokenLoss(loss_fn) if self.tokens else loss_fn  # type: ignore[arg-type]
        self.precision, self.stage = precision, stage
        self.compute_loss, self.keep_outputs, self.check_data = True, False, False
        self.record = BatchLosses()
        self.labels: dict[int, Any] = {}  # micro-batch -> its labels, till its loss
        self.outputs: list[Any] = []  # the last position's outputs (keep_outputs)
        self._counts: dict[int, torch.Tensor] = {}  # micro-batch -> its tokens, till recorded
        self._fingerprints: dict[int, torch.Tensor] = {}  # micro-batch -> labels' fingerprint

    def begin(self, *, compute_loss: bool, keep_outputs: bool, check_data: bool) -> None:
        """Start a batch (a new :attr:`record`). With ``check_data``, each activation
        carries the fingerprint of the labels the first stage read with its inputs, and
        the last stage compares it with its own
        (:func:`~pipekernel.stage.fingerprint.fingerprint`)."""
        self.compute_loss, self.keep_outputs, self.check_data = \
            compute_loss, keep_outputs, check_data
        self.record, self.labels, self.outputs = BatchLosses(), {}, []
        self._counts, self._fingerprints = {}, {}

    def recorded(self) -> BatchLosses:
        """The running batch's losses so far (the batch step's view of them)."""
        return self.record

    def held(self) -> list[Any]:
        """The labels waiting for their loss, for memory accounting."""
        return list(self.labels.values())

    # -- labels and fingerprints ------------------------------------------------
    def read(self, micro_batch: int, labels: Any, device: Any, first: bool,
             last: bool) -> None:
        """The labels read with ``micro_batch``'s inputs (not ``None``): fingerprinted at
        the first position (check steps), kept for the loss at the last."""
        if first and self.check_data:
            self._fingerprints[micro_batch] = \
                fingerprint(labels).to(device, non_blocking=True)
        if last:
            flatten(labels, "labels")
            self.labels[micro_batch] = map_tensors(lambda t: to_device(t, device), labels)

    def fingerprint(self, micro_batch: int, device: Any) -> torch.Tensor:
        """What an activation of ``micro_batch`` carries under ``check_data``."""
        fp = self._fingerprints.get(micro_batch)
        if fp is None:
            fp = torch.zeros(2, dtype=torch.int64, device=device)
        return fp

    def received(self, micro_batch: int, fp: torch.Tensor) -> None:
        """The fingerprint an activation of ``micro_batch`` brought."""
        self._fingerprints[micro_batch] = fp

    def _check_labels(self, micro_batch: int, labels: Any) -> None:
        """Last stage, check steps: the labels read here are those the first stage read
        with this micro-batch's inputs (one host synchronisation per micro-batch)."""
        theirs = self._fingerprints.pop(micro_batch, None)
        if theirs is None or labels is None:
            return
        theirs = theirs.cpu()
        if not int(theirs[0]):
            return  # the first stage read no labels (None): nothing to compare
        if not torch.equal(theirs, fingerprint(labels).cpu()):
            raise DataError(
                f"micro-batch {micro_batch}: the labels the last stage read are not the ones "
                f"the first stage read with that micro-batch's inputs (their fingerprints "
                f"differ): the data iterators of the first and the last stage do not yield "
                f"the same micro-batches in the same order",
                hint="give both stages the same data in the same order (e.g. the same "
                     "sampler seed, or shuffle=False); pass check_data_steps=0 to the engine "
                     "to turn this check off")

    # -- losses ------------------------------------------------------------------
    def finish(self, micro_batch: int, buffer: Any, given: Any = None) -> None:
        """The last position's forward of ``micro_batch`` ended with ``buffer.outputs``:
        its outputs kept, its loss (``given``: the paired executor's ``loss0``) computed
        and recorded into ``buffer.loss`` (with the chunk's aux losses added), its labels
        checked."""
        if self.keep_outputs:
            self.outputs.append(buffer.outputs)
        labels = self.labels.pop(micro_batch, None)
        if self.compute_loss:  # first: labels of the wrong structure fail in loss_fn
            if given is not None:
                loss = _scalar(given, "overlapped_forward_backward's loss0")
            else:
                loss = self.loss_of(buffer.outputs, labels, micro_batch)
            self.record.add(loss.detach(), micro_batch, self._counts.pop(micro_batch, None))
            if buffer.aux is not None:  # the objective backwarded here
                loss = loss + buffer.aux.to(loss.dtype)
            buffer.loss = loss
        if self.check_data:
            self._check_labels(micro_batch, labels)

    def criterion(self, micro_batch: int) -> tuple[Callable | None, Any]:
        """``(criterion0, labels0)`` of the paired executor's forward half at the last
        position: the checked loss and the labels, or ``(None, None)`` without losses."""
        if not self.compute_loss:
            return None, None
        return (lambda out, labels: self.loss_of(out, labels, micro_batch),
                self.labels.get(micro_batch))

    def loss_of(self, outputs: Any, labels: Any, micro_batch: int,
                keep_count: bool = True) -> torch.Tensor:
        """``loss_fn(outputs, labels)``, checked: a 0-dim tensor, failures named. Under
        ``loss_reduction="tokens"`` the loss sum; its count waits for the micro-batch's
        record (``keep_count=False``: dropped, for a replay)."""
        try:
            loss = self.loss_fn(outputs, labels)  # type: ignore[misc]
        except Exception as err:
            raise DataError(
                f"loss_fn(outputs, labels) failed for micro-batch {micro_batch}: "
                f"{type(err).__name__}: {err} (outputs: {describe(outputs)}, "
                f"labels: {describe(labels)})",
                hint="make the labels from the data iterator match what loss_fn expects"
            ) from err
        if self.tokens:
            loss, count = loss
            if keep_count:
                self._counts[micro_batch] = count
        return _scalar(loss, "loss_fn")

    def aux(self, buffer: Any, aux: list[torch.Tensor], micro_batch: int, chunk: int,
            last: bool, micro_batches: int) -> None:
        """The aux losses a chunk's forward added (:mod:`pipekernel.model.aux_loss`):
        recorded, and their gradient made part of this stage's backward — added to the
        loss on the chunk computing it (``buffer.aux``), else attached to the chunk's
        outputs. Nothing of it travels to another stage."""
        if self.tokens:
            raise ConfigError(
                f"an auxiliary loss (pk.add_aux_loss) with loss_reduction='tokens' on stage "
                f"{self.stage}, micro-batch {micro_batch}: the token mean "
                f"rescales every gradient after the backward, aux losses included",
                hint="use loss_reduction='mean' with auxiliary losses")
        total = torch.stack([a.float() for a in aux]).sum()  # float32, as the losses
        self.record.add_aux(total.detach(), micro_batch)
        if not (torch.is_grad_enabled() and total.requires_grad):
            return  # evaluation, or a constant: reported only
        if last:
            buffer.aux = total
            return
        seed = self.precision.scale_loss(
            torch.ones((), dtype=torch.float32, device=total.device) / micro_batches)
        attached = attach_aux(buffer.outputs, total, seed.detach())
        if attached is None:
            raise PipelineError(
                f"stage {self.stage} chunk {chunk} added an auxiliary loss but "
                f"none of its outputs requires grad, so its backward never runs",
                hint="pk.add_aux_loss needs the chunk's output to depend on trained tensors")
        buffer.outputs = attached


def _scalar(loss: Any, what: str) -> torch.Tensor:
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
        raise DataError(f"{what} returned {describe(loss)}, expected a scalar tensor",
                        hint="reduce the loss to a 0-dim tensor (e.g. .mean())")
    return loss.reshape(())
