"""House rule: no function longer than 60 lines (def line to last line, docstring included)
in the core, the built-in plugins, the transports, the applications and the integrations."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 60
CHECKED = ["pipekernel", "plugins", "transports", "apps", "integrations"]
#: files exempt from the rule (none today: a file joins only with its reason beside it)
NOT_YET: set[str] = set()


def long_functions(paths=CHECKED, limit=LIMIT, skip=frozenset(NOT_YET)):
    """``[(lines, "path:line", name)]`` of the functions over ``limit`` lines, longest first
    (also a script: ``python tests/test_function_length.py [dir ...]`` lists them)."""
    found = []
    for top in paths:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in skip:
                continue
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > limit:
                        found.append((lines, f"{rel}:{node.lineno}", node.name))
    return sorted(found, reverse=True)


def test_no_function_is_longer_than_60_lines():
    assert long_functions() == [], "split these functions (one job each)"


def test_the_check_sees_a_long_function(tmp_path, monkeypatch):
    (tmp_path / "pkg").mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT))
    (tmp_path / "pkg" / "m.py").write_text(f"def long():\n{body}\n\ndef short():\n    pass\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert long_functions(["pkg"]) == [(LIMIT + 1, "pkg/m.py:1", "long")]


if __name__ == "__main__":
    import sys

    for row in long_functions(sys.argv[1:] or CHECKED, skip=frozenset()):
        print(*row)
