"""Render the hook reference (``docs/hooks.md``) from the hookspec docstrings.

The docstrings in :mod:`pipekernel.extend.hookspecs` are the documentation; this
module turns them into Markdown so the two cannot drift apart (a test compares
the file with :func:`render`). Regenerate with::

    python -m pipekernel.extend.hookdoc > docs/hooks.md
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from pipekernel.extend import hookspecs

__all__ = ["hookspec_functions", "spec_options", "render"]


def hookspec_functions() -> list[Callable[..., Any]]:
    """Every hookspec in :mod:`pipekernel.extend.hookspecs`, in source order."""
    found = [fn for name, fn in vars(hookspecs).items()
             if name.startswith("pipekernel_") and spec_options(fn) is not None]
    return sorted(found, key=lambda fn: fn.__code__.co_firstlineno)


def spec_options(fn: Callable[..., Any]) -> dict[str, Any] | None:
    """The pluggy options of a hookspec (``firstresult``, ``historic``, ...)."""
    return getattr(fn, "pipekernel_spec", None)


def _kind(fn: Callable[..., Any]) -> str:
    opts = spec_options(fn) or {}
    kinds = [k for k in ("firstresult", "historic") if opts.get(k)]
    return ", ".join(kinds) or "every implementation is called"


def _markdown(doc: str) -> str:
    # reST "Use in plugins\n==============" -> a Markdown sub-heading; the rest reads as text
    lines, out = doc.splitlines(), list[str]()
    for i, line in enumerate(lines):
        if set(line.strip()) == {"="} and i and lines[i - 1].strip():
            out[-1] = f"**{out[-1].strip()}**"
            out.append("")
            continue
        out.append(line)
    return "\n".join(out).strip()


def render() -> str:
    """The Markdown hook reference."""
    parts = [
        "# Hook reference",
        "",
        "Generated from the docstrings in `pipekernel/extend/hookspecs.py` by "
        "`python -m pipekernel.extend.hookdoc > docs/hooks.md`; a test keeps the two in sync. "
        "Implement a hook with `@pipekernel.hookimpl` on a function or method of the same "
        "name; take only the parameters you need, and give them no defaults (pluggy does "
        "not pass parameters that have defaults). See `docs/writing-a-plugin.md`.",
        "",
        "| hook | kind |",
        "|---|---|",
    ]
    functions = hookspec_functions()
    parts += [f"| `{fn.__name__}` | {_kind(fn)} |" for fn in functions]
    for fn in functions:
        params = ", ".join(inspect.signature(fn).parameters)
        parts += ["", f"## `{fn.__name__}({params})`", "", f"*{_kind(fn)}*", "",
                  _markdown(inspect.cleandoc(fn.__doc__ or "(undocumented)"))]
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    print(render(), end="")
