"""Built-in plugins and transports use the public surface only (issue 29, item 3).

``plugins/`` (``pipekernel.plugins.*``) and ``transports/`` (``pipekernel.transports.*``)
import from ``pipekernel.plugin`` (the extension surface), ``pipekernel.comm`` (the
transport authors' surface), ``pipekernel`` (the user API) and ``pipekernel.errors`` — and from each other — never from a core module's internal path,
so what is offered to plugin authors is what the project's own plugins are built on.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"plugins": "pipekernel.plugins", "transports": "pipekernel.transports"}
ALLOWED = {"pipekernel", "pipekernel.plugin", "pipekernel.comm", "pipekernel.errors"}
OWN = tuple(f"{name}." for name in FOLDERS.values())  # a plugin may import another one


def _pipekernel_imports(path: Path) -> list[tuple[int, str, str]]:
    """``(line, module, name)`` for every import of a ``pipekernel`` module, at any depth
    (lazy imports inside functions included); ``name`` is what ``from ... import`` takes."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.lineno, node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, "") for a in node.names]
    return sorted((line, mod, name) for line, mod, name in found
                  if mod == "pipekernel" or mod.startswith("pipekernel."))


def _offends(module: str, name: str) -> bool:
    """Whether ``from module import name`` (``import module`` when ``name`` is empty) goes
    past the surface. ``from pipekernel import x`` must name a public name or ``plugin`` /
    ``errors``, not a subpackage (``from pipekernel import stage`` reaches inside)."""
    import pipekernel

    if module.startswith(OWN) or module in FOLDERS.values():
        return False
    if module == "pipekernel" and name:
        return name not in pipekernel.__all__ and f"pipekernel.{name}" not in ALLOWED
    return module not in ALLOWED


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_built_ins_import_only_the_public_surface(folder):
    files = sorted((ROOT / folder).glob("*.py"))
    assert files, f"no files under {folder}/"
    offenders = [f"{path.relative_to(ROOT)}:{line}: from {module} import {name}"
                 for path in files for line, module, name in _pipekernel_imports(path)
                 if _offends(module, name)]
    assert not offenders, ("built-in plugins and transports import only pipekernel.plugin, "
                           "pipekernel.comm, pipekernel and pipekernel.errors (add what they "
                           "need to pipekernel.plugin, or pipekernel.comm for transport "
                           "plumbing):\n" + "\n".join(offenders))


def test_the_reader_sees_every_form(tmp_path):
    src = tmp_path / "bad.py"
    src.write_text("from pipekernel.model.module import LayerSpec\n"
                   "def f():\n    from pipekernel.comm.wire import flatten\n"
                   "import pipekernel.grid.zero\nfrom pipekernel import stage\n"
                   "from pipekernel import PipelineModule\nfrom pipekernel.plugin import P2POp\n"
                   "from pipekernel.plugins.sinks import make_sink\nfrom . import sibling\n")
    bad = [(m, n) for _, m, n in _pipekernel_imports(src) if _offends(m, n)]
    assert bad == [("pipekernel.model.module", "LayerSpec"), ("pipekernel.comm.wire", "flatten"),
                   ("pipekernel.grid.zero", ""), ("pipekernel", "stage")]


@pytest.mark.parametrize("face", ["pipekernel.plugin", "pipekernel.comm"])
def test_every_name_the_built_ins_take_from_the_surface_is_documented_public(face):
    import importlib

    surface = importlib.import_module(face)
    missing = [f"{path.relative_to(ROOT)}:{line}: {name}"
               for folder in FOLDERS for path in sorted((ROOT / folder).glob("*.py"))
               for line, module, name in _pipekernel_imports(path)
               if module == face and name not in surface.__all__]
    assert not missing, f"taken from {face} but not in its __all__:\n" + "\n".join(missing)


def test_the_plugin_face_holds_no_transport_plumbing():
    """A plugin sees a transport through its contract (``Transport``, ``Handle``); what only
    a transport's author needs is ``pipekernel.comm``'s, and is offered once."""
    import pipekernel.comm as comm
    import pipekernel.plugin as plugin

    both = sorted(set(plugin.__all__) & set(comm.__all__) - {"Transport", "Handle"})
    assert not both, f"pipekernel.plugin also offers the transport plumbing {both}"
