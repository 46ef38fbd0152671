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

# A ```console output block right after a program (the next fenced block) is what the
# program prints, exactly.

_FENCE = re.compile(r"```(\w*)([^\n]*)\n(.*?)```", re.S)


def _blocks():
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        fences = _FENCE.findall(doc.read_text())
        programs = [(k, info, body) for k, (lang, info, body) in enumerate(fences)
                    if lang == "python"]
        for i, (k, info, body) in enumerate(programs):
            after = fences[k + 1] if k + 1 < len(fences) else ("", "", "")
            output = after[2] if after[:2] == ("console", " output") else None
            yield pytest.param(doc, info.strip(), body, output, id=f"{doc.name}#{i}")


BLOCKS = list(_blocks())


@pytest.mark.parametrize("doc,info,body,output", BLOCKS)
def test_doc_code_compiles(doc, info, body, output):
    assert info in ("", "fragment"), f"{doc.name}: unknown fence info {info!r}"
    compile(body, str(doc), "exec")
    assert output is None or info == "", f"{doc.name}: output shown for a fragment"


def _run_program(body, tmp_path, *launcher):
    import os
    import subprocess
    import sys

    script = tmp_path / "block.py"
    script.write_text(body)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "examples" /
                                                                  "plugin_package")}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return subprocess.run([sys.executable, *launcher, str(script)], capture_output=True,
                          text=True, cwd=tmp_path, env=env, timeout=600)


@pytest.mark.parametrize("doc,info,body,output", [b for b in BLOCKS if b.values[1] == ""])
def test_doc_program_runs_as_written(doc, info, body, output, tmp_path):
    run = _run_program(body, tmp_path)
    assert run.returncode == 0, f"{doc.name}:\n{body}\n{run.stdout}\n{run.stderr}"
    if output is not None:  # the doc shows what it prints: exactly that
        assert run.stdout.splitlines() == output.splitlines(), run.stderr


def test_the_readme_program_prints_once_under_torchrun(tmp_path):
    """The "Use it" program under torchrun (4 processes, loopback): rank 0 alone prints,
    the lines the README shows."""
    doc, _, body, output = next(b.values for b in BLOCKS if b.id == "README.md#0")
    assert "pk.launch(main, nprocs=4)" in body and output is not None
    run = _run_program(body, tmp_path, "-m", "torch.distributed.run", "--standalone",
                       "--nproc-per-node", "4")
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.splitlines() == output.splitlines(), run.stderr
    assert output.splitlines()[0] == "step 0: loss 4.16"  # ln 64: it starts knowing nothing


def test_the_tutorial_pipeline_prints_the_plain_models_losses():
    text = (ROOT / "docs" / "tutorial.md").read_text()
    tutorial = [b.values for b in BLOCKS if b.values[0].name == "tutorial.md"]
    plain, pipeline = [b for b in tutorial if b[3] is not None][:2]
    assert "import pipekernel" not in plain[2] and "pk.launch(main" in pipeline[2]
    assert plain[3] == pipeline[3] and len(plain[3].splitlines()) == 5
    assert "docs/launchers.md" in text and "torchrun --nnodes 2" in text


def test_every_docs_page_is_in_the_index():
    index = (ROOT / "docs" / "README.md").read_text()
    linked = set(re.findall(r"\]\(([\w-]+\.md)\)", index))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert sorted(pages - linked) == [], "docs/README.md does not list these pages"


def test_the_run_time_of_pipekernel_train_has_one_source():
    """docs/train.md's run is the one place with the figure; the README quotes its losses
    (deterministic) and links to it for the time."""
    readme = (ROOT / "README.md").read_text()
    train = (ROOT / "docs" / "train.md").read_text()
    quoted = re.search(r"ends with `(loss [^`]+)`", readme).group(1)
    assert quoted in train  # the run's own report line
    timed = re.compile(r"\b\d+(\.\d+)? ?(s|min|seconds|minutes)\b")
    assert re.search(r"450 steps in \d+\.\ds", train)
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        if doc.name == "train.md":
            continue
        for line in doc.read_text().splitlines():
            if "pipekernel train" in line and "steps" in line:
                assert not timed.search(line), f"{doc.name} states a run time: {line}"


def _idle(name, stages, micro_batches, backward_cost):
    """Each stage's idle units in the simulator, as `pipekernel schedule` costs them."""
    from pipekernel.schedules import BUILTIN_SCHEDULES, simulate
    from pipekernel.schedules.instructions import Backward, BackwardInput, BackwardWeight

    costs = {Backward: backward_cost, BackwardInput: backward_cost / 2,
             BackwardWeight: backward_cost / 2}
    r = simulate(BUILTIN_SCHEDULES[name], stages, micro_batches, 1, costs=costs)
    busy = [sum(end - start for start, end, _ in events) for events in r.timeline]
    return [r.makespan - b for b in busy], [span - b for span, b in zip(r.spans, busy)]


@pytest.mark.parametrize("stages", [2, 3, 4, 8])
def test_the_readme_bubble_claims_hold_with_their_costs(stages):
    text = " ".join((ROOT / "README.md").read_text().split())
    assert "a third of 1F1B's when a backward costs two forwards, `pipekernel schedule " \
           "zb-h1 --backward-cost 2`, and a half at the command's default cost" in text
    assert "no idle time inside a stage when a backward costs two forwards, and up to " \
           "`(stages − 1) / 2` forward-times at the default cost of one" in text
    for m in (stages, 2 * stages, 4 * stages):
        for cost, ratio in ((2.0, 1 / 3), (1.0, 1 / 2)):
            ours, theirs = _idle("zb-h1", stages, m, cost)[0], _idle("1f1b", stages, m, cost)[0]
            assert ours == pytest.approx([ratio * t for t in theirs])
        if m >= 2 * stages - 1:
            assert max(_idle("zb-h2", stages, m, 2.0)[1]) == pytest.approx(0.0)
            assert max(_idle("zb-h2", stages, m, 1.0)[1]) == pytest.approx((stages - 1) / 2)


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


@pytest.mark.parametrize("module", ["pipekernel", "pipekernel.plugin", "pipekernel.comm"])
def test_the_api_reference_covers_every_public_name(module):
    import importlib

    mod = importlib.import_module(module)
    text = (ROOT / "docs" / "api.md").read_text()
    missing = [n for n in mod.__all__ if n != "__version__" and f"`{n}" not in text]
    assert not missing, f"docs/api.md lacks {missing} of {module}.__all__"
    assert all(hasattr(mod, n) for n in mod.__all__)


def _readme_commands():
    """README's "Two commands on a fresh machine": its command lines, by number."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Two commands on a fresh machine\n+```bash\n(.*?)```", readme, re.S)
    lines = [line for line in block.group(1).splitlines() if line and not line.startswith("#")]
    assert len(lines) == 2, lines
    return lines


def test_readme_command_1_installs_only_the_main_jobs_extra():
    install = _readme_commands()[0]
    assert install.startswith("pip install torch==") and install.endswith("&& pipekernel train")
    extras = re.findall(r'-e "\.\[([\w,]+)\]"', install)
    assert extras == ["train"], install  # not the test extra: that goes with command 2
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # what `pipekernel train` imports beyond the core (apps/cli.py's docstring: tqdm, matplotlib)
    assert {re.split(r"[<>=\[]", r)[0] for r in declared["optional-dependencies"]["train"]} \
        == {"tqdm", "matplotlib"}
    pin = re.search(r"torch==[\d.]+", install).group(0)
    assert (ROOT / ".ci" / "constraints.txt").read_text().splitlines()[0] == pin
    assert f"pip install -q {pin}" in (ROOT / ".ci" / "run").read_text()


def test_readme_command_2_installs_the_test_extra_and_is_what_ci_runs():
    command = _readme_commands()[1]
    assert command.startswith('pip install -e ".[test]" -c .ci/constraints.txt && '
                              "python -m pytest ")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert ci[-1] == command  # the last thing CI does, verbatim


# -- docs/train.md's flag table is the parser's ----------------------------------------------

def _subparser(name):
    import argparse

    from pipekernel.apps.cli import build_parser
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _flag_table():
    """``{flag: default cell}`` of docs/train.md's flag table."""
    text = (ROOT / "docs" / "train.md").read_text()
    table = text[text.index("| flag | default | meaning |"):]
    rows = [line.split("|")[1:3] for line in table.splitlines()[2:]
            if line.startswith("|")][:100]
    rows = rows[:next((i for i, r in enumerate(rows) if len(r) < 2), len(rows))]
    out = {}
    for flags, defaults in rows:
        names = re.findall(r"`(--[\w-]+)", flags)
        cells = [c.strip() for c in defaults.strip().split(", ")] if len(names) > 1 \
            else [defaults.strip()]
        assert len(cells) == len(names), (flags, defaults)
        out.update(zip(names, cells))
    return out


#: how the table writes a default that is no literal value
_PROSE = {"--chunks": "the schedule's", "--data": "stdlib", "--checkpoint-dir": "`<out>/checkpoints`",
          "--hf": "off", "--pack": "off", "--offload": "off", "--resume": "off", "--no-progress": "", "--corpus-bytes": "2 MB"}


def test_the_train_flag_table_has_every_flag_with_the_parsers_default():
    table = _flag_table()
    actions = [a for a in _subparser("train")._actions if a.option_strings != ["-h", "--help"]]
    flags = {a.option_strings[-1]: a.default for a in actions}
    assert sorted(set(flags) - set(table)) == [], "docs/train.md's flag table lacks these"
    assert sorted(set(table) - set(flags)) == [], "docs/train.md's flag table has no such flag"
    for flag, default in flags.items():
        cell = table[flag]
        if flag in _PROSE:
            assert cell == _PROSE[flag], (flag, cell)
            assert default in (None, False) or flag == "--corpus-bytes" and default == 2e6
        elif isinstance(default, str):
            assert cell.strip("`").strip('"') == default, (flag, cell, default)
        else:
            assert float(cell) == default, (flag, cell, default)


@pytest.mark.parametrize("command", ["plan", "schedule"])
def test_every_flag_of_plan_and_schedule_is_in_their_section(command):
    text = (ROOT / "docs" / "train.md").read_text()
    section = text[text.index(f"## `pipekernel {command}`"):]
    section = section[:section.find("\n## ", 1) if "\n## " in section[1:] else None]
    flags = {a.option_strings[-1] for a in _subparser(command)._actions
             if a.option_strings and a.option_strings != ["-h", "--help"]}
    assert sorted(f for f in flags if f not in section) == [], \
        f"docs/train.md's pipekernel {command} section does not name these flags"


def test_the_documented_train_report_has_the_lines_the_code_prints(capsys):
    """docs/train.md's run shows the report the code prints now (numbers aside): the CPU
    line included, so the docs cannot promise a figure nothing reports."""
    from pipekernel.apps.config import TrainConfig
    from pipekernel.apps.train import _report

    _report(TrainConfig(sample_bytes=0), {
        "loss_first5": 4.983, "loss_last5": 1.683, "heldout_before": 5.73,
        "heldout_after": 1.64, "losses": [0.0] * 450, "seconds": 138.0,
        "tokens_per_s": 13356.0, "first_step": 0, "cpu_seconds": [48.9, 49.0],
        "stages": [], "paths": {}})
    text = (ROOT / "docs" / "train.md").read_text()
    block = text[text.index("$ pipekernel train\n"):]
    block = block[:block.index("```")]
    digits = re.compile(r"\d[\d,.]*")
    shown = {digits.sub("N", line) for line in block.splitlines()}
    printed = [line for line in capsys.readouterr().out.splitlines() if line != "files:"]
    assert [line for line in printed if digits.sub("N", line) not in shown] == []
    assert any(line.startswith("CPU: ") for line in printed)
