"""The instruction loop (layer 1): dispatch each instruction to its handler.

The kernel knows nothing of models, tensors or transports. It owns a dispatch
table ``{instruction type: handler}`` filled once at construction, calls the
``pipekernel_before_instruction`` / ``pipekernel_after_instruction`` hooks
around each handler when a plugin implements them, and turns any failure into
an error that names the rank, stage, step and instruction.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from pipekernel.errors import InstructionError, PipelineError
from pipekernel.schedules.instructions import Instruction

Handler = Callable[[Instruction], Any]

__all__ = ["Kernel", "Handler"]


class Kernel:
    """Run steps of instructions through a fixed dispatch table.

    :param handlers: ``{instruction class: callable(instruction)}``. Lookup is by
        exact type first, then along the MRO, so a handler for a base class
        serves its subclasses (resolved once per type, not per instruction).
    :param hook: a pluggy ``HookRelay`` (``pm.hook``) or ``None``. Only
        ``pipekernel_before_instruction`` and ``pipekernel_after_instruction``
        are used, and only if some plugin implements them.
    :param rank: global rank, for error messages.
    :param stage: pipeline stage, for error messages and hooks.
    :param clock: host seconds now (default :func:`time.perf_counter`), read before and
        after each handler for ``pipekernel_after_instruction``'s ``seconds`` (only when
        some plugin implements it); handlers that launch device work return before it
        ends, so on a GPU this is host time.
    :param enter: ``enter(index)`` is called with each instruction's index in the
        flattened stream right before its handler (and before the ``before`` hook): the
        stage runtime posts the transfers due there and knows where it is without
        looking the instruction up. ``None``: nothing is called.
    """

    def __init__(self, handlers: Mapping[type, Handler], *, hook: Any = None,
                 rank: int | None = None, stage: int | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 enter: Callable[[int], None] | None = None) -> None:
        self.handlers: Mapping[type, Handler] = MappingProxyType(dict(handlers))
        self.hook, self.rank, self.stage = hook, rank, stage
        self.clock, self.enter = clock, enter
        self._by_type: dict[type, Handler] = {}  # each type's handler, resolved once
        self._stream: Sequence[Instruction] = ()
        self._step_of: Sequence[int] = ()
        self._at = -1  # index in ``_stream`` of the instruction running now; -1: none

    @property
    def position(self) -> tuple[int, Instruction] | None:
        """``(step, instruction)`` the loop is at now (``None`` between runs)."""
        if self._at < 0:
            return None
        return self._step_of[self._at], self._stream[self._at]

    def _handler(self, instruction: Instruction) -> Handler:
        cls = type(instruction)
        handler = self._by_type.get(cls)
        if handler is not None:
            return handler
        for base in cls.__mro__:
            handler = self.handlers.get(base)
            if handler is not None:
                self._by_type[cls] = handler
                return handler
        known = ", ".join(sorted(c.__name__ for c in self.handlers))
        raise InstructionError(
            f"no handler for instruction {type(instruction).__name__} ({instruction})",
            hint=f"register a handler through the pipekernel_register_instructions hook; "
                 f"handled types: {known}")

    def _hooks(self) -> tuple[Any, Any]:
        if self.hook is None:
            return None, None
        return (_direct(self.hook.pipekernel_before_instruction, ("instruction", "stage")),
                _direct(self.hook.pipekernel_after_instruction,
                        ("instruction", "stage", "seconds")))

    def _failed(self, error: PipelineError, instruction: Instruction) -> PipelineError:
        """Let plugins add diagnostics to ``error`` (error path only); returns it."""
        if self.hook is not None:
            try:
                self.hook.pipekernel_instruction_error(instruction=instruction, stage=self.stage,
                                                       error=error)
            except Exception as hook_err:  # a broken diagnostic must not hide the real error
                error.add_detail(f"(a pipekernel_instruction_error plugin failed: {hook_err!r})")
        return error

    def resolve(self, stream: Sequence[Instruction]) -> tuple[Handler, ...] | None:
        """The handler of each instruction of ``stream``, in order, or ``None`` when one has
        none (the loop then reports it at that instruction). The engine keeps the answer with
        its program (:mod:`pipekernel.engine.programs`); the kernel keeps nothing."""
        try:
            return tuple(self._handler(ins) for ins in stream)
        except PipelineError:
            return None

    @staticmethod
    def _program(program: Any) -> tuple[Sequence[Instruction], Sequence[int]]:
        """``(stream, step of each index)`` of ``program``: a program (anything with
        ``stream`` and ``step_of``, e.g. a :class:`~pipekernel.schedules.program.Program`)
        or an iterable of steps (flattened here, every run)."""
        stream = getattr(program, "stream", None)
        if stream is not None:
            return stream, program.step_of
        flat, step_of = [], []
        for step_id, step in enumerate(program):
            flat += step
            step_of += [step_id] * len(step)
        return flat, step_of

    def run(self, steps: Any, handlers: Sequence[Handler] | None = None, **when: Any) -> None:
        """Execute every instruction of every step, in order.

        :param steps: an iterable of steps (sequences of instructions), or a program
            with ``stream`` (the instructions in order) and ``step_of`` (each one's
            step), walked by index.
        :param handlers: the handler of each instruction by index (:meth:`resolve` of the
            stream, kept by the caller), else each instruction's handler looked up by type
            (resolved once per type).
        :param when: which batch this run is, for its errors (the engine passes
            ``train_step=N`` or ``eval_after=N``; see :func:`pipekernel.errors.describe_where`),
            filled in before plugins see the error.
        """
        stream, step_of = self._program(steps)
        calls = handlers
        self._stream, self._step_of = stream, step_of
        before, after = self._hooks()  # resolved once per run: no pluggy cost when unused
        stage, clock, enter = self.stage, self.clock, self.enter
        for index, instruction in enumerate(stream):
            self._at = index
            try:
                handler = calls[index] if calls is not None else self._handler(instruction)
                if enter is not None:
                    enter(index)
                if before is not None:
                    before(instruction, stage)
                if after is None:
                    handler(instruction)
                else:
                    start = clock()
                    handler(instruction)
                    after(instruction, stage, clock() - start)
            except PipelineError as err:
                raise self._failed(err.locate(
                    rank=self.rank, stage=stage, step=step_of[index], **when,
                    micro_batch=getattr(instruction, "micro_batch", None),
                    instruction=instruction), instruction)
            except Exception as err:
                # a layer that failed tags the error (pipekernel_where): name it first
                where = getattr(err, "pipekernel_where", None)
                what = f"in {where} while running {instruction}" if where else \
                    f"in the handler of {instruction}"
                raise self._failed(InstructionError(
                    f"{type(err).__name__} {what}: {err}",
                    hint="see the chained traceback above for the failing line",
                    rank=self.rank, stage=stage, step=step_of[index], **when,
                    micro_batch=getattr(instruction, "micro_batch", None),
                    instruction=instruction), instruction) from err
        self._at = -1


def _direct(caller: Any, names: tuple[str, ...]) -> Callable[..., None] | None:
    """A positional callable running ``caller``'s implementations, or ``None`` if none.

    The per-instruction hooks run twice per instruction, so the kernel resolves
    them once per run and calls plain implementations directly, as pluggy
    would (last registered first, each given the subset of arguments it names),
    without pluggy's per-call bookkeeping (~2.5 us per call; see
    ``benchmarks/monitor_overhead.py``). Wrapper implementations keep full
    pluggy semantics: then every call goes through pluggy.
    """
    impls = caller.get_hookimpls()
    if not impls:
        return None
    if any(getattr(i, "hookwrapper", False) or getattr(i, "wrapper", False) for i in impls):
        return lambda *args: caller(**dict(zip(names, args)))
    plan = [(i.function, tuple(names.index(a) for a in i.argnames)) for i in reversed(impls)]
    if len(plan) == 1:
        function, index = plan[0]
        if index == (0,):  # the common case: an observer of the instruction only
            return lambda *args: function(args[0])
        return lambda *args: function(*[args[j] for j in index])

    def call(*args: Any) -> None:
        for function, index in plan:
            function(*[args[j] for j in index])
    return call
