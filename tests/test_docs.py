"""The plugin guide shows the tested package verbatim, and the docs name real files."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "examples" / "plugin_package"


@pytest.mark.parametrize("name", ["pyproject.toml", "pk_oot_demo/monitor.py",
                                  "pk_oot_demo/transport.py"])
def test_writing_a_plugin_shows_the_tested_package_verbatim(name):
    blocks = re.findall(r"```[^\n]*\n(.*?)```", (ROOT / "docs" / "writing-a-plugin.md").read_text(),
                        re.S)
    assert (PACKAGE / name).read_text() in blocks, f"docs/writing-a-plugin.md lacks {name} as is"


@pytest.mark.parametrize("doc", ["writing-a-plugin.md", "embedding.md", "lightning.md"])
def test_files_the_docs_mention_exist(doc):
    text = (ROOT / "docs" / doc).read_text()
    paths = set(re.findall(r"`((?:examples|tests|docs|pipekernel)/[\w./-]+)`", text))
    assert paths, doc
    assert [p for p in sorted(paths) if not (ROOT / p).exists()] == []


# -- every code block that claims to run, runs ------------------------------------------------
# A ```python block in README.md or docs/ is a whole program and is run here as written;
# a piece of one (it needs an engine or a module from the text around it) is fenced
# ```python fragment and only compiled.

def _blocks():
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        for i, (info, body) in enumerate(re.findall(r"```python([^\n]*)\n(.*?)```", text, re.S)):
            yield pytest.param(doc, info.strip(), body, id=f"{doc.name}#{i}")


BLOCKS = list(_blocks())


@pytest.mark.parametrize("doc,info,body", BLOCKS)
def test_doc_code_compiles(doc, info, body):
    assert info in ("", "fragment"), f"{doc.name}: unknown fence info {info!r}"
    compile(body, str(doc), "exec")


@pytest.mark.parametrize("doc,info,body", [b for b in BLOCKS if b.values[1] == ""])
def test_doc_program_runs_as_written(doc, info, body, tmp_path):
    import os
    import subprocess
    import sys

    script = tmp_path / "block.py"
    script.write_text(body)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "examples" /
                                                                  "plugin_package")}
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=600)
    assert run.returncode == 0, f"{doc.name}:\n{body}\n{run.stdout}\n{run.stderr}"


def test_the_readme_rank_order_formula_is_the_code_default():
    from pipekernel.grid.topology import DEFAULT_RANK_ORDER, rank_map

    text = (ROOT / "README.md").read_text()
    assert f'`rank_order="{DEFAULT_RANK_ORDER}"`' in text
    formula = "rank = (stage * data_size + data) * model_size + model"
    assert f"`{formula}`" in text
    for stages, data_size, model_size in [(2, 2, 1), (3, 2, 2), (2, 3, 4)]:
        placed = rank_map(DEFAULT_RANK_ORDER, stages, data_size, model_size)
        for rank, (stage, data, model) in enumerate(placed):
            assert eval(formula.split("=", 1)[1]) == rank  # the README's words, evaluated


@pytest.mark.parametrize("module", ["pipekernel", "pipekernel.plugin"])
def test_the_api_reference_covers_every_public_name(module):
    import importlib

    mod = importlib.import_module(module)
    text = (ROOT / "docs" / "api.md").read_text()
    missing = [n for n in mod.__all__ if n != "__version__" and f"`{n}" not in text]
    assert not missing, f"docs/api.md lacks {missing} of {module}.__all__"
    assert all(hasattr(mod, n) for n in mod.__all__)
