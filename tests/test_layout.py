"""The core (``pipekernel/``) does not know the applications (``apps/``, ``pipekernel.apps``)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "pipekernel"


def test_importing_every_core_module_loads_no_app():
    code = (
        "import pkgutil, sys, importlib, pipekernel\n"
        "names = [m.name for m in pkgutil.walk_packages(pipekernel.__path__, 'pipekernel.')]\n"
        "assert len(names) > 20, names\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "bad = sorted(m for m in sys.modules if m == 'pipekernel.apps' or "
        "m.startswith('pipekernel.apps.'))\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_no_core_source_imports_the_apps():
    offenders = []
    for path in sorted(CORE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if isinstance(node, ast.ImportFrom) and node.module == "pipekernel":
                names += [f"pipekernel.{a.name}" for a in node.names]
            offenders += [f"{path.relative_to(CORE.parent)}:{node.lineno}: {n}" for n in names
                          if n == "pipekernel.apps" or n.startswith("pipekernel.apps.")]
    assert not offenders, "the core imports the apps:\n" + "\n".join(offenders)


def test_the_console_script_lives_beside_the_apps():
    from importlib.metadata import entry_points

    (script,) = [ep for ep in entry_points(group="console_scripts") if ep.name == "pipekernel"]
    assert script.value == "pipekernel.apps.cli:main"
    assert not (CORE / "cli.py").exists()


# -- the layers, as folders: each may import only the ones listed (and itself) ---------------
# Bottom to top. ``errors`` is the shared vocabulary every layer speaks; ``testing`` and the
# two facades (``pipekernel``, ``pipekernel.plugin``) sit on top of everything.
_BASE = {"errors", "nested"}  # the shared vocabulary: errors and the container walker
LAYERS = {
    "errors": set(),
    "nested": set(),                               # the one nested-container walker
    "schedules": _BASE,                            # layer 0: ISA, schedules, simulator
    "comm": _BASE,                                 # transport protocol, wire, collectives
    "grid": _BASE | {"comm"},                      # topology, mesh, FSDP2, experts, ZeRO
    "kernel": _BASE | {"schedules"},               # layer 1: the instruction loop
    "step": _BASE | {"schedules", "grid"},         # reductions, precision, the step's handlers
    "extend": _BASE | {"schedules", "comm", "grid", "step"},  # hookspecs, plugin manager, views
    "launcher": _BASE,                             # launch, lifeline, cluster detection
    "model": _BASE | {"schedules", "comm", "grid", "extend"},  # the user's model vocabulary
    "stage": _BASE | {"schedules", "comm", "grid", "kernel", "step", "extend", "model"},
    "engine": _BASE | {"schedules", "comm", "grid", "kernel", "step", "extend", "model", "stage",
                       "launcher"},
}
TOP = {"__init__", "plugin", "testing"}


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods = ([f"pipekernel.{a.name}" for a in node.names] if node.module == "pipekernel"
                    else [node.module])
        elif isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        else:
            continue
        found += [(node.lineno, m.split(".")[1]) for m in mods
                  if m.startswith("pipekernel.") and len(m.split(".")) > 1]
    return found


def test_every_core_module_sits_in_a_layer():
    homes = {p.relative_to(CORE).parts[0].removesuffix(".py") for p in CORE.rglob("*.py")}
    assert homes - TOP - {"schedules"} <= set(LAYERS), sorted(homes - TOP - set(LAYERS))


def test_layers_import_only_downwards():
    """The import contract per layer: no arrow up, no folder reaching sideways."""
    offenders = []
    for path in sorted(CORE.rglob("*.py")):
        home = path.relative_to(CORE).parts[0].removesuffix(".py")
        if home in TOP:
            continue
        allowed = LAYERS[home] | {home}
        offenders += [f"{path.relative_to(CORE.parent)}:{line}: {home} -> {target}"
                      for line, target in _imports(path)
                      if target not in allowed]
    assert not offenders, "imports against the layer order:\n" + "\n".join(offenders)


def test_the_import_reader_sees_every_form(tmp_path):
    src = tmp_path / "bad.py"
    src.write_text("from pipekernel.engine.engine import PipelineEngine\n"
                   "def f():\n    from pipekernel import stage\n    import pipekernel.grid.zero\n"
                   "from . import sibling\n")
    assert [t for _, t in _imports(src)] == ["engine", "stage", "grid"]
