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
    blocks = re.findall(r"```\w*\n(.*?)```", (ROOT / "docs" / "writing-a-plugin.md").read_text(),
                        re.S)
    assert (PACKAGE / name).read_text() in blocks, f"docs/writing-a-plugin.md lacks {name} as is"


@pytest.mark.parametrize("doc", ["writing-a-plugin.md", "embedding.md", "lightning.md"])
def test_files_the_docs_mention_exist(doc):
    text = (ROOT / "docs" / doc).read_text()
    paths = set(re.findall(r"`((?:examples|tests|docs|pipekernel)/[\w./-]+)`", text))
    assert paths, doc
    assert [p for p in sorted(paths) if not (ROOT / p).exists()] == []
