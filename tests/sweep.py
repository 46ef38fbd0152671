"""One process world per world size for a module's multi-rank cases.

Starting a world (processes that import torch, a process group) costs seconds on a loaded
2-core machine, more than most cases' own work. A :class:`Sweep` holds a module's cases,
declared when the module is imported; the first test that asks for a case's results runs
every case of that world size not yet run, one after another in one world, and keeps the
answers for the others' tests. Each test still asserts its own case and fails by itself:
a case that raises on a rank is reported by its test with that rank's traceback (a case
that fails may leave its world's later cases failing too; the first failure is the cause).

The cases of a world share its process group and torch's caches: DTensor caches sharding
decisions by mesh *equality*, so a later case's DTensors may run on the groups of an
earlier case's equal mesh. Those groups stay alive (over the same ranks), which is why a
case must not destroy the process group it found (a case that fails does, below: the
world's later DTensor cases then fail too). A case that expects a refusal
(:func:`refused`) leaves the world as the refusal left it, so declare such cases after
the module's other cases of their world size: what a refused engine built can only meet
other refusals, which fail loudly if it does.
"""
from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipekernel.testing import run_ranks


@dataclass(frozen=True)
class Case:
    """One case: ``fn(*args)`` on ``nprocs`` ranks (``name`` for messages and test ids)."""

    name: str
    nprocs: int
    fn: Callable[..., Any]
    args: tuple

    def __str__(self) -> str:
        return self.name


class Sweep:
    """The cases of one module (see the module docstring).

    :param timeout: seconds per case; a world gets the sum of its cases'.
    """

    def __init__(self, timeout: float = 300.0) -> None:
        self.timeout = timeout
        self._cases: list[Case] = []
        self._results: dict[Case, list[tuple[bool, Any]]] = {}

    def case(self, name: str, nprocs: int, fn: Callable[..., Any], *args: Any) -> Case:
        """Declare a case (at import time, so that its world runs it with the others)."""
        case = Case(name, nprocs, fn, args)
        if case in self._cases:
            raise ValueError(f"case {name!r} is declared twice")
        self._cases.append(case)
        return case

    def results(self, case: Case, prepare: Callable[[tuple], tuple] | None = None
                ) -> list[Any]:
        """``case``'s result on each rank, by rank (its world runs on first use).

        :param prepare: ``prepare(args) -> args`` for each case of the world, right before
            it starts: what only a test can know (a fixture's directory, made on demand)."""
        if case not in self._results:
            batch = [c for c in self._cases
                     if c.nprocs == case.nprocs and c not in self._results]
            if case not in batch:
                batch.append(case)
            work = [(c.fn, prepare(c.args) if prepare is not None else c.args) for c in batch]
            per_rank = run_ranks(_run_cases, case.nprocs, work,
                                 timeout=self.timeout * len(batch))
            for k, c in enumerate(batch):
                self._results[c] = [rank[k] for rank in per_rank]
        outcome = self._results[case]
        for rank, (ok, value) in enumerate(outcome):
            if not ok:
                raise AssertionError(f"case {case.name} failed on rank {rank} "
                                     f"(world of {case.nprocs}):\n{value}")
        return [value for _, value in outcome]


def refused(build: Callable[[], Any]) -> str | None:
    """The text of the ``ConfigError`` that ``build()`` raises (``None``: it returned).

    The process group and whatever the refused engine made over it (groups, a mesh) are
    left as they are: destroying them would break the world's later cases (see the module
    docstring). Every rank of a refusal test must get the error, at the same point."""
    from pipekernel.errors import ConfigError

    try:
        build()
    except ConfigError as err:
        return str(err)
    return None


def _run_cases(cases: list[tuple[Callable[..., Any], tuple]]) -> list[tuple[bool, Any]]:
    """One rank of a world: each case in turn, its result or its traceback."""
    out: list[tuple[bool, Any]] = []
    for fn, args in cases:
        try:
            out.append((True, fn(*args)))
        except Exception:  # noqa: BLE001 - the case's test reports it
            out.append((False, traceback.format_exc()))
            _reset()
    return out


def _reset() -> None:
    """After a failed case: no process group left over for the next case to reuse."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort; the next case starts its own
            pass
