"""Errors a user can cause, each saying what went wrong, where, and how to fix it.

``PipelineError`` carries an optional location (rank, stage, train step, schedule step,
micro-batch, instruction) that the kernel and the engine fill in as the error travels up;
``str()`` puts the location first, in words (:func:`describe_where`), so a log line from
any rank is self-explaining.
"""
from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "PipelineError", "ConfigError", "ScheduleError", "InstructionError", "DataError",
    "UntrustedCheckpointError",
    "TransportError", "TransportTimeout", "UnknownNameError", "PeerAbort",
    "NonFiniteLossError", "ConsistencyError", "describe_where", "did_you_mean", "shorten",
    "positive_int",
]

#: location fields, in the order the bracket names them, with the words it uses
_WHERE = (("rank", "rank"), ("stage", "stage"), ("train_step", "train step"),
          ("eval_after", "eval after train step"), ("step", "schedule step"),
          ("micro_batch", "micro-batch"), ("instruction", "instruction"))
_WHERE_FIELDS = tuple(key for key, _ in _WHERE)


def describe_where(where: object) -> str:
    """``"rank 1, stage 1, train step 126 (1-based), schedule step 6, micro-batch 3,
    instruction F3"``
    from an object's (or a mapping's) location fields; unknown ones are left out.

    ``train step N``: the N-th training batch of the job (``engine.global_steps + 1``
    while it runs; after a resume it counts on from the checkpoint's steps, as checkpoint
    tags do: ``global_stepN`` holds train steps 1 .. N). ``eval after train step N``: an
    ``eval_batch`` run after N training steps. ``schedule step``: the step within the
    batch's schedule.
    """
    get = where.get if isinstance(where, dict) else (lambda k: getattr(where, k, None))
    # the one 1-based number (a count of batches, as checkpoint tags and progress bars count
    # them) says so; ranks, stages, schedule steps and micro-batches count from 0
    return ", ".join(f"{words} {get(key)}" + (" (1-based)" if key == "train_step" else "")
                     for key, words in _WHERE if get(key) is not None)


def did_you_mean(name: object, choices: Iterable[object]) -> str:
    """``" (did you mean 'nccl'?)"`` for the closest of ``choices`` to ``name``, or ``""``.

    For the message of an unknown-name error: a typo gets the fix, not just a list."""
    import difflib

    if not isinstance(name, str):
        return ""
    close = difflib.get_close_matches(name, [str(c) for c in choices], n=1, cutoff=0.6)
    if not close:  # case and separators: 'ZB_H1' for 'zb-h1'
        folded = {str(c).lower().replace("_", "-"): str(c) for c in choices}
        close = [folded[k] for k in (name.lower().replace("_", "-"),) if k in folded]
    return f" (did you mean {close[0]!r}?)" if close else ""


def shorten(text: str, lines: int = 3, width: int = 200) -> str:
    """The first ``lines`` non-empty lines of ``text``, each cut at ``width`` characters,
    and how many lines were left out: a backend's 40-line message (gloo's
    ``connectFullMesh failed ... GLHF``) as the few lines that say what happened."""
    kept = [line.rstrip() for line in str(text).splitlines() if line.strip()]
    head = [line if len(line) <= width else line[:width - 3] + "..." for line in kept[:lines]]
    if len(kept) > lines:
        head.append(f"... ({len(kept) - lines} more line{'s' if len(kept) - lines > 1 else ''})")
    return "\n".join(head)


class PipelineError(RuntimeError):
    """Base class. ``hint`` says how to fix the problem."""

    def __init__(self, message: str, *, hint: str | None = None, rank: int | None = None,
                 stage: int | None = None, step: int | None = None,
                 micro_batch: int | None = None, instruction: object = None,
                 train_step: int | None = None, eval_after: int | None = None) -> None:
        self.message = message
        self.hint = hint
        self.rank, self.stage, self.step = rank, stage, step
        self.train_step, self.eval_after = train_step, eval_after
        self.micro_batch, self.instruction = micro_batch, instruction
        self.details: list[str] = []  # diagnostics added by plugins, printed under the message
        super().__init__(message)

    def add_detail(self, text: str) -> PipelineError:
        """Append a diagnostic paragraph (e.g. every rank's position); returns ``self``."""
        self.details.append(text)
        return self

    def add_cause(self, error: BaseException, source: str | None = None) -> PipelineError:
        """Keep ``error`` (a backend's exception: gloo's, NCCL's, the store's) as
        ``self.cause`` and put its text, :func:`shorten`-ed, under this error's message
        and fix: raise the result ``from None`` so that pipekernel's words come first and
        the backend's after them, in a few lines. Returns ``self``."""
        self.cause = error
        said = shorten(str(error)) or "(no message)"
        return self.add_detail(f"{source or type(error).__name__} said: {said}")

    def locate(self, **where: object) -> PipelineError:
        """Fill in location fields that are still unknown; returns ``self``."""
        for key, value in where.items():
            if getattr(self, key, None) is None and value is not None:
                setattr(self, key, value)
        return self

    def __str__(self) -> str:
        where = describe_where(self)
        text = f"[{where}] {self.message}" if where else self.message
        text = f"{text}\n  how to fix: {self.hint}" if self.hint else text
        for detail in getattr(self, "details", ()):
            text += "\n  " + detail.replace("\n", "\n  ")
        return text

    def __reduce__(self):  # keep location and extra fields when pickled across processes
        return (_rebuild, (type(self), self.message, dict(self.__dict__)))


def _rebuild(cls, message, state):
    err = cls.__new__(cls, message)
    Exception.__init__(err, message)
    err.__dict__.update(state)
    return err


class ConfigError(PipelineError, ValueError):
    """Invalid configuration: sizes, names, layer lists, partitions."""


class UnknownNameError(ConfigError, KeyError):
    """A transport, schedule, precision or partition name that no plugin provides."""

    __str__ = PipelineError.__str__  # KeyError would quote the message


class ScheduleError(PipelineError):
    """A schedule that deadlocks, mismatches sends and receives, or misuses buffers."""


class InstructionError(PipelineError):
    """An instruction had no handler or its handler failed."""


def positive_int(name: str, value: object, hint: str, **where: int | None) -> int:
    """``value`` if it is an int >= 1 (not a bool), else ``ConfigError`` "``name`` must be
    a positive int, got ``value``" with ``hint`` and the location ``where`` (rank, stage)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}", hint=hint, **where)
    return value


class DataError(PipelineError, ValueError):
    """The data iterator ran out or yielded something of the wrong structure."""


class UntrustedCheckpointError(DataError):
    """A checkpoint file that is not data only: unpickling it would run code (an object
    of ``global_name``, the global torch's data-only loader refused; ``None`` when torch
    named none). ``path``: the file. Raised before anything was loaded; the hint names
    the switch that loads it anyway (docs/checkpoints.md)."""

    def __init__(self, message: str, *, path: str | None = None,
                 global_name: str | None = None, **kwargs) -> None:
        super().__init__(message, **kwargs)
        self.path, self.global_name = path, global_name


class NonFiniteLossError(PipelineError):
    """A training loss was NaN or inf (``PipelineEngine(nonfinite="error")``)."""


class ConsistencyError(PipelineError):
    """A run-time invariant failed (``PipelineEngine(check_every=K)``, see
    :mod:`pipekernel.engine.sentinel`): replicas or tied copies that should be identical
    are not, the stages normalised the loss differently, or a transfer arrived different
    from what was sent; or a replayed batch's gradients differ from the schedule's
    (``engine.verify_batch``, :mod:`pipekernel.engine.replay`). Raised on every rank.

    ``check``: which invariant (``"replicas"``, ``"replicas (optimizer state)"``,
    ``"replicas (experts)"``, ``"tied"``, ``"normalisation"``, ``"transfers"``,
    ``"replay"``); ``parameter``: the parameter (its global layer index key,
    ``"3.weight"``), module (``"4"``, replay) or quantity; ``ranks``: the ranks holding the
    odd value; ``train_step``: the step at which the check first saw it."""

    def __init__(self, message: str, *, check: str | None = None,
                 parameter: str | None = None, ranks: list[int] | None = None,
                 **kwargs) -> None:
        super().__init__(message, **kwargs)
        self.check, self.parameter, self.ranks = check, parameter, list(ranks or [])


class TransportError(PipelineError):
    """A transfer or collective failed; ``peer`` names the peer when one is known."""

    def __init__(self, message: str, *, peer: int | None = None, **kwargs) -> None:
        super().__init__(message, **kwargs)
        self.peer = peer


class TransportTimeout(TransportError):
    """A wait on a peer did not finish within the timeout; ``peer`` names it."""


class PeerAbort(PipelineError):
    """Another rank failed first and said so (see :mod:`pipekernel.engine.faults`).

    The location fields (``rank``, ``stage``, ``train_step``, ``step``, ``micro_batch``,
    ``instruction``) are the *failing* rank's; ``error_type`` is the class name of
    its error. Where this rank was when it learnt of the failure is in ``seen_by``
    (this rank) and ``seen_at`` (its instruction), and in the message.
    """

    def __init__(self, message: str, *, error_type: str | None = None,
                 seen_by: int | None = None, **kwargs) -> None:
        super().__init__(message, **kwargs)
        self.error_type, self.seen_by = error_type, seen_by
        self.seen_at: object = None

    def locate(self, **where: object) -> PipelineError:
        """Keep the failing rank's location (its train step, when it did not say, is this
        rank's: ranks fail within one batch); remember this rank's instruction."""
        for key in ("train_step", "eval_after"):
            if getattr(self, key, None) is None and where.get(key) is not None:
                setattr(self, key, where[key])
        if self.seen_at is None and where.get("instruction") is not None:
            self.seen_at = where["instruction"]
            self.add_detail(f"rank {self.seen_by} stopped at {where['instruction']}"
                            + (f" (stage {where['stage']}, micro-batch {where['micro_batch']})"
                               if where.get("stage") is not None else ""))
        return self
