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
