"""Fixtures shared by several test modules."""
from __future__ import annotations

import os

import pytest
import torch

#: what many of the suite's process worlds import again in every rank, imported once by the
#: fork server that starts them instead (pipekernel.launcher.launch.start_context): DTensor
#: and FSDP2 (~1 s of CPU per rank), transformers' model base (~4 s per rank) and Lightning
#: (~5 s per rank). Not installed: left out. Set through ``launch.PRELOAD``, not the
#: environment: every program a system test starts (the CLI, examples, docs programs) would
#: inherit PIPEKERNEL_PRELOAD, and its own fork server would import transformers and
#: Lightning (~8 s of CPU) for workers that use neither. PIPEKERNEL_PRELOAD set (empty
#: turns it off) replaces this list.
CALLER_PRELOAD = "PIPEKERNEL_PRELOAD" in os.environ
if not CALLER_PRELOAD:
    from pipekernel.launcher import launch as _launch
    _launch.PRELOAD[:] = ["torch.distributed.tensor", "torch.distributed.fsdp",
                          "transformers.modeling_utils", "lightning.pytorch"]


@pytest.fixture
def one_thread():
    """One intra-op thread for the test: timings and memory peaks on a loaded 2-core
    machine are stable only then. Modules opt in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- the tiers ---------------------------------------------------------------------------
# Every test lands in one tier, marked here so that a new test needs no marker of its own:
#   system    starts another program: a Python interpreter, torchrun, the CLI, pip, a shell
#             (examples, docs programs, installs, signals, restarts);
#   multirank starts ranks through pipekernel.testing.run_ranks / pk.launch /
#             check_transport (one process world, gloo on CPU);
#   fast      neither: no processes at all (python -m pytest -m fast tests).
# The tier is read from the test's source: the names its function, its fixtures and the
# helpers they call (in the test module, conftest and the tests/ helper modules it imports
# from), transitively, refer to. A module or test may mark itself (pytest.mark.system ...)
# instead; an explicit tier marker wins. A fast test that starts ranks after all fails
# with a message saying so (see _no_ranks_in_the_fast_tier).

import ast
import functools
from pathlib import Path

_TESTS = Path(__file__).resolve().parent
TIERS = ("system", "multirank", "fast")
#: a test without processes but too long for the fast tier (an exhaustive sweep over sizes)
#: carries this marker and gets no tier: the full run has it, ``-m fast`` does not
EXHAUSTIVE = "exhaustive"
#: names a test that starts ranks refers to
_MULTIRANK = frozenset({"run_ranks", "launch", "check_transport", "start_processes",
                        "spawn", "Process"})
#: names a test that starts another program refers to
_SYSTEM = frozenset({"subprocess", "Popen", "check_output", "check_call", "executable",
                     "torchrun", "execv", "fork"})


#: modules whose entry points start ranks (the applications run pk.launch)
_LAUNCHERS = ("pipekernel.apps.train", "pipekernel.apps.cli", "pipekernel.launcher.launch")


def _names(node: ast.AST) -> frozenset[str]:
    names = {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node)
             if isinstance(n, (ast.Name, ast.Attribute))}
    if any(isinstance(n, ast.ImportFrom) and n.module in _LAUNCHERS for n in ast.walk(node)):
        names.add("launch")  # e.g. `from pipekernel.apps.train import run` inside a test
    return frozenset(names)


@functools.lru_cache(maxsize=None)
def _table(path: Path) -> tuple[dict[str, frozenset[str]], dict[str, tuple[Path, str]]]:
    """``({top-level name or Class.method: the names it refers to}, {imported name: (helper
    module, its name there)})`` of one test or helper module."""
    table: dict[str, frozenset[str]] = {}
    imports: dict[str, tuple[Path, str]] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            table[node.name] = _names(node)
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        table[f"{node.name}.{item.name}"] = _names(item)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    table[target.id] = _names(node)
        elif isinstance(node, ast.ImportFrom) and node.module in _LAUNCHERS:
            for alias in node.names:
                table[alias.asname or alias.name] = frozenset({"launch"})
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            helper = _TESTS / f"{node.module}.py"
            if helper.exists():
                for alias in node.names:
                    imports[alias.asname or alias.name] = (helper, alias.name)
    return table, imports


def _kinds(path: Path, name: str, seen: set[tuple[Path, str]]) -> set[str]:
    """The tiers above fast that ``name`` of module ``path`` needs, transitively."""
    if (path, name) in seen:
        return set()
    seen.add((path, name))
    table, imports = _table(path)
    if name in imports:
        return _kinds(*imports[name], seen)
    refs = table.get(name)
    if refs is None:
        return set()
    kinds = {"system"} if refs & _SYSTEM else set()
    if refs & _MULTIRANK:
        kinds.add("multirank")
    for ref in refs:
        if ref != name and (ref in table or ref in imports):
            kinds |= _kinds(path, ref, seen)
    return kinds


def _tier_of(item: pytest.Item) -> str:
    path = Path(str(getattr(item, "path", None) or item.fspath))
    name = getattr(item, "originalname", None) or item.name.split("[")[0]
    if item.cls is not None:
        name = f"{item.cls.__name__}.{name}"
    seen: set[tuple[Path, str]] = set()
    kinds = _kinds(path, name, seen)
    if item.cls is not None:
        kinds |= _kinds(path, item.cls.__name__, seen)
    for fixture in getattr(item, "fixturenames", ()):
        if fixture == "_no_ranks_in_the_fast_tier":
            continue  # the guard below, on every test
        kinds |= _kinds(path, fixture, seen) | _kinds(_TESTS / "conftest.py", fixture, seen)
    return next((tier for tier in TIERS[:2] if tier in kinds), "fast")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if any(item.get_closest_marker(tier) is not None for tier in (*TIERS, EXHAUSTIVE)):
            continue  # the test (or its module) says
        if Path(str(getattr(item, "path", None) or item.fspath)).parent != _TESTS:
            continue  # a test tree of another project (e.g. pytester's)
        item.add_marker(getattr(pytest.mark, _tier_of(item)))
    # the longest files first (stable: each file's tests keep their order, and stay together)
    items.sort(key=lambda item: _LONGEST.get(Path(str(item.fspath)).name, len(_LONGEST)))


#: the files that take longest, started first: under ``-n 2 --dist loadfile`` a long file
#: handed out last runs alone at the end while the other pytest process has nothing left
#: (scheduling only: no test depends on it). xdist keeps this order only with
#: ``--no-loadscope-reorder`` (the README's command): by default it hands out the files
#: with the most tests first, which put test_partition.py first and test_exit.py near the
#: end. Per-file seconds of a full ``-n 2`` run (stop 40), longest first; the DeepSpeed
#: examples took 20 s in one run and 145 s in another, so they go early.
_LONGEST = {name: rank for rank, name in enumerate((
    "test_docs.py", "test_restart.py", "test_hf_families.py", "test_deepspeed_examples.py",
    "test_hf_expert_parallel.py", "test_cli.py", "test_hf.py", "test_hf_packing.py",
    "test_exit.py", "test_orphans.py",
    "test_checkpoint_dcp.py", "test_ray_train.py", "test_checkpoint.py",
    "test_exit_shutdown.py", "test_paired.py", "test_lightning.py", "test_checkpoint_trust.py",
    "test_faults.py", "test_sentinel.py",
    "test_comm_model.py", "test_engine.py", "test_launchers.py", "test_fuzz.py", "test_skips.py",
    "test_monitor.py", "test_dtensor_tp.py"))}


@pytest.fixture(autouse=True)
def _no_ranks_in_the_fast_tier(request: pytest.FixtureRequest,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A fast-tier test must not start ranks: if one does after all (through a helper the
    tier reading above cannot see), it fails saying how to fix it."""
    if request.node.get_closest_marker("fast") is None:
        return
    from pipekernel.launcher import launch

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError(
            f"{request.node.nodeid} is in the fast tier but starts processes: mark it "
            f"@pytest.mark.multirank (or system), or call run_ranks/pk.launch where "
            f"tests/conftest.py can see it (the test, its fixtures, their helpers)")

    monkeypatch.setattr(launch, "start_context", refuse)
