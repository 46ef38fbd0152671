"""House rule: no import circles among pipekernel's modules.

Reads every ``import`` in every file (function-level ones included, through ``ast``) of
``pipekernel/`` and the folders pyproject.toml maps into it (``plugins/``, ``transports/``,
``apps/``, ``integrations/*``), builds the module graph and fails naming each circle.
"""
from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent

#: circles tolerated for now, each with its reason; the entry goes when the reason does
ALLOWED: dict[frozenset[str], str] = {}


def _package_dirs() -> dict[str, Path]:
    """Import name -> folder, from pyproject.toml's ``[tool.setuptools.package-dir]``."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        table = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {name: ROOT / folder for name, folder in table.items()}


def _modules() -> dict[str, Path]:
    """Every module's dotted name -> its file."""
    modules: dict[str, Path] = {}
    dirs = _package_dirs()
    for package, folder in dirs.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            # a sub-folder that pyproject maps to a package of its own is that package's
            nested = [d for d in dirs.values() if d != folder and d.is_relative_to(folder)
                      and path.is_relative_to(d)]
            if nested or "tests" in rel.parts:
                continue
            parts = [p for p in rel.parts if p != "__init__"]
            modules[".".join([package, *parts])] = path
    return modules


def _imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The known modules the file imports anywhere (``from x import y`` counts y if it is a
    module, x otherwise)."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imported(name, path, known) for name, path in known.items()}


def _without_packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Edges into a package's ``__init__`` stand for its submodules only when the init is a
    face that re-exports; a submodule importing its own package's init is not a circle of
    concerns, so edges from a module to its ancestors are dropped."""
    return {v: {w for w in ws if not v.startswith(w + ".")} for v, ws in graph.items()}


def test_the_walk_sees_every_folder():
    roots = {name.split(".")[1] for name in _graph() if "." in name}
    assert {"plugins", "transports", "apps", "hf", "lightning", "deepspeed", "engine"} <= roots


def test_a_function_level_and_a_relative_import_are_edges(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("def f():\n    from pkg.b import g\n")
    (pkg / "b.py").write_text("from . import a\n")
    known = {"pkg.a": pkg / "a.py", "pkg.b": pkg / "b.py"}
    graph = {name: _imported(name, path, known) for name, path in known.items()}
    assert graph == {"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}}
    assert _cycles(graph) == [["pkg.a", "pkg.b"]]


def test_cycles_finds_a_circle_and_names_it():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_no_import_circles():
    cycles = _cycles(_without_packages(_graph()))
    bad = [c for c in cycles if frozenset(c) not in ALLOWED]
    assert not bad, "import circles (break each by concern):\n" + "\n".join(
        "  " + " <-> ".join(c) for c in bad)


@pytest.mark.parametrize("face", ["pipekernel.plugin", "pipekernel.comm"])
def test_the_plugin_face_reaches_nothing_in_engine(face):
    """``pipekernel.plugin`` is what plugin authors import, ``pipekernel.comm`` what transport
    authors do: each and every module it reaches (imports anywhere in a file) stay out of
    ``pipekernel.engine`` (the package inits a dotted import also runs are not counted)."""
    graph = _without_packages(_graph())
    seen, todo = set(), [face]
    while todo:
        for w in graph[todo.pop()] - seen:
            seen.add(w)
            todo.append(w)
    reached = sorted(m for m in seen if m.startswith("pipekernel.engine"))
    assert not reached, f"{face} reaches {reached}"
