"""Meta-tests over every hookspec that exists (including hooks added later):
each is documented pytest-style, exercised by an implementation the test suite
runs, and docs/hooks.md matches the docstrings."""
from __future__ import annotations

import ast
import functools
import inspect
from pathlib import Path

import pytest

from pipekernel.extend import hookspecs
from pipekernel.extend.hookdoc import hookspec_functions, render, spec_options

ROOT = Path(__file__).resolve().parent.parent
#: Where implementations that the test suite runs live: test plugins, tested examples,
#: and the built-in plugins and transports every engine in the tests loads.
EXERCISED_IN = ("tests", "examples", "plugins", "transports", "pipekernel")
SPECS = hookspec_functions()


def _is_hookimpl(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
    return name == "hookimpl"


@functools.lru_cache(maxsize=None)  # one read of the tree for every hook's test
def implementations() -> dict[str, dict[str, set[str]]]:
    """``{hook name: {parameter: {files whose implementation takes it}}}``."""
    found: dict[str, dict[str, set[str]]] = {}
    for folder in EXERCISED_IN:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name == "hookspecs.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                        and node.name.startswith("pipekernel_")
                        and any(_is_hookimpl(d) for d in node.decorator_list)):
                    params = found.setdefault(node.name, {})
                    for arg in node.args.args + node.args.kwonlyargs:
                        if arg.arg != "self":
                            params.setdefault(arg.arg, set()).add(str(path.relative_to(ROOT)))
                    params.setdefault("", set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_pipekernel_function_in_hookspecs_is_a_hookspec():
    names = [n for n, v in vars(hookspecs).items() if n.startswith("pipekernel_") and callable(v)]
    assert names and sorted(names) == sorted(fn.__name__ for fn in SPECS)
    assert all(spec_options(fn) is not None for fn in SPECS)


def doc_problems(spec) -> list[str]:
    """What the docstring of ``spec`` lacks, pytest-style."""
    doc, sig = inspect.getdoc(spec) or "", inspect.signature(spec)
    problems = [f"document :param {p}:" for p in sig.parameters if f":param {p}:" not in doc]
    documented = [line.split(":param ")[1].split(":")[0] for line in doc.splitlines()
                  if ":param " in line]
    problems += [f"documents :param {p}: it does not have" for p in documented
                 if p not in sig.parameters]
    if "called" not in doc.lower():
        problems.append("say when it is called and how often")
    if sig.return_annotation not in ("None", None, inspect.Signature.empty) \
            and ":returns:" not in doc:
        problems.append("document the return contract (:returns:)")
    if (spec_options(spec) or {}).get("firstresult") and "first non-``None`` result" not in doc:
        problems.append("say that it stops at the first non-``None`` result")
    if "Use in plugins" not in doc:
        problems.append("add a 'Use in plugins' section")
    elif not doc.split("Use in plugins", 1)[1].strip("= \n"):
        problems.append("write the 'Use in plugins' section (it is empty)")
    return problems


@pytest.mark.parametrize("spec", SPECS, ids=lambda fn: fn.__name__)
def test_hookspec_is_documented_pytest_style(spec):
    assert not doc_problems(spec), f"{spec.__name__}: {'; '.join(doc_problems(spec))}"


def test_the_documentation_check_catches_gaps():
    @hookspecs.hookspec(firstresult=True)
    def pipekernel_fake(name: str, extra: int) -> int:
        """Make a fake.

        :param name: documented.
        :param other: not a parameter.
        """

    assert doc_problems(pipekernel_fake) == [
        "document :param extra:", "documents :param other: it does not have",
        "say when it is called and how often", "document the return contract (:returns:)",
        "say that it stops at the first non-``None`` result", "add a 'Use in plugins' section"]


def test_the_documentation_check_catches_an_empty_use_in_plugins_section():
    @hookspecs.hookspec
    def pipekernel_fake() -> None:
        """Called never.

        Use in plugins
        =======    """

    assert doc_problems(pipekernel_fake) == ["write the 'Use in plugins' section (it is empty)"]


@pytest.mark.parametrize("spec", SPECS, ids=lambda fn: fn.__name__)
def test_hookspec_and_every_parameter_are_exercised(spec):
    impls = implementations().get(spec.__name__)
    assert impls, (f"no implementation of {spec.__name__} in {', '.join(EXERCISED_IN)}: "
                   "add a test plugin that implements it")
    missing = [p for p in inspect.signature(spec).parameters if p not in impls]
    assert not missing, (f"no tested implementation of {spec.__name__} takes "
                         f"{', '.join(missing)} (implementations in {sorted(impls[''])})")


def test_docs_hooks_md_matches_the_docstrings():
    path = ROOT / "docs" / "hooks.md"
    assert path.read_text() == render(), (
        "docs/hooks.md is out of date: run `python -m pipekernel.extend.hookdoc > docs/hooks.md`")
