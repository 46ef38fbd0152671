"""The ``pipekernel`` command: ``schedule`` against the simulator, ``train`` end to end."""
from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipekernel.apps import cli
from pipekernel.launcher.launch import free_port
from pipekernel.schedules import BUILTIN_SCHEDULES, format_grid, simulate

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# A model small enough that 20 steps take a few seconds on one core per stage.
SMALL = ["--dim", "32", "--layers", "2", "--heads", "2", "--context", "32",
         "--micro-batch-size", "8", "--micro-batches", "4", "--corpus-bytes", "300000",
         "--sample-bytes", "60", "--lr", "1e-2"]


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 240.0
         ) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.run([sys.executable, "-m", "pipekernel.apps.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env={**clean, **(env or {})})


# -- pipekernel schedule ---------------------------------------------------------------------


@pytest.mark.parametrize("name,stages,micro_batches", [
    ("1f1b", 3, 5), ("1f1b", 4, 2), ("gpipe", 2, 3), ("inference", 3, 4)])
def test_schedule_prints_what_the_simulator_computes(capsys, name, stages, micro_batches):
    assert cli.main(["schedule", name, "--stages", str(stages),
                     "--micro-batches", str(micro_batches)]) == 0
    out = capsys.readouterr().out
    result = simulate(BUILTIN_SCHEDULES[name], stages, micro_batches)
    grid = format_grid(result)
    assert grid in out
    assert len(grid.splitlines()) == stages
    assert f"bubble fraction: {result.bubble_fraction:.4f}" in out
    buffers = ", ".join(f"stage {s}: {n}" for s, n in enumerate(result.buffers))
    assert f"buffers per stage: {buffers}" in out
    assert f"makespan: {result.makespan:g}" in out


def test_schedule_1f1b_small_case_by_hand(capsys):
    # 2 stages, 2 micro-batches, unit costs: written out so a simulator bug cannot hide
    cli.main(["schedule", "1f1b", "--stages", "2", "--micro-batches", "2"])
    out = capsys.readouterr().out.splitlines()
    assert out[1].split() == ["stage", "0", "|", "F0", "F1", ".", "B0", ".", "B1"]
    assert out[2].split() == ["stage", "1", "|", ".", "F0", "B0", "F1", "B1", "."]
    assert "bubble fraction: 0.3333" in "\n".join(out)
    assert "buffers per stage: stage 0: 2, stage 1: 1" in "\n".join(out)


def test_schedule_backward_cost_and_png(tmp_path, capsys):
    png = tmp_path / "sched.png"
    cli.main(["schedule", "gpipe", "--stages", "2", "--micro-batches", "3",
              "--backward-cost", "2", "--png", str(png)])
    out = capsys.readouterr().out
    assert "B0 B0" in out  # a backward spans two columns
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_schedule_unknown_name_is_a_clean_error(capsys):
    assert cli.main(["schedule", "nope", "--stages", "2", "--micro-batches", "2"]) == 1
    err = capsys.readouterr().err
    assert "unknown schedule 'nope'" in err and "1f1b" in err and "Traceback" not in err


def test_schedule_console_entry_point():
    proc = _cli("schedule", "1f1b", "--stages", "2", "--micro-batches", "4")
    assert proc.returncode == 0, proc.stderr
    grid = format_grid(simulate(BUILTIN_SCHEDULES["1f1b"], 2, 4))
    assert grid in proc.stdout


# -- pipekernel train ------------------------------------------------------------------------


def test_train_rejects_bad_sizes_before_starting_processes(capsys):
    assert cli.main(["train", "--dim", "30", "--heads", "4"]) == 1
    err = capsys.readouterr().err
    assert "--dim 30 is not divisible by --heads 4" in err and "how to fix" in err
    assert cli.main(["train", "--stages", "5", "--layers", "2"]) == 1
    assert "cannot fill 5 stages" in capsys.readouterr().err
    assert cli.main(["train", "--rank-order", "tp-pp"]) == 1
    assert "rank_order='tp-pp' is not an order" in capsys.readouterr().err
    assert cli.main(["train", "--expert-parallel", "2"]) == 1
    assert "expert_parallel_size=2 does not divide the data-parallel size 1" in \
        capsys.readouterr().err
    assert cli.main(["train", "--experts", "3", "--expert-parallel", "2",
                     "--data-parallel", "2"]) == 1
    assert "--experts 3 is not divisible by --expert-parallel 2" in capsys.readouterr().err


@pytest.mark.parametrize("flags,text", [
    (["--schedule", "1f1bx"], "unknown schedule '1f1bx' (did you mean '1f1b'?)"),
    (["--schedule", "dualpipev", "--micro-batches", "2"],
     "dualpipev with 2 stage(s) needs micro_batches >= 4 (2 x num_stages), got 2"),
    (["--schedule", "inference"], "--schedule 'inference' does not train"),
    (["--chunks", "2"], "schedule '1f1b' supports exactly 1 chunk(s) per stage, got chunks=2"),
    (["--precision", "fp33"], "unknown precision 'fp33' (did you mean 'fp32'?)"),
    (["--transport", "glo"], "unknown transport 'glo' (did you mean 'gloo'?)"),
    (["--partition", "0,1,2"], "partition boundaries [0, 1, 2] do not cover all 6 layers"),
    (["--partition", "uniforn"], "no partition plugin understands partition='uniforn'"),
    (["--data", "/no/such/corpus.txt"], "cannot read --data /no/such/corpus.txt"),
    (["--data", __file__, "--context", "100000"], "too few for --context 100000"),
    (["--hf", "/no/such/model_dir"], "--hf /no/such/model_dir: no such file or directory")])
def test_train_checks_the_plan_before_starting_processes(capsys, flags, text):
    """Each of these used to start every rank first, each raising the same error (the
    fast tier refuses to start processes: a check that came too late fails here)."""
    assert cli.main(["train", *flags]) == 1
    err = capsys.readouterr().err
    assert text in err and "how to fix" in err and "Traceback" not in err
    assert err.startswith("pipekernel train: error: ")


def _losses_from_csv(path: str) -> list[float]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and "loss" in rows[0], f"no loss column in {path}"
    by_step: dict[int, float] = {}
    for row in rows:  # one row per step (rank 0) or per rank and step: the loss is equal
        if row.get("loss") not in (None, ""):
            by_step[int(float(row.get("step", len(by_step) + 1)))] = float(row["loss"])
    return [by_step[s] for s in sorted(by_step)]


def _check_run(out_dir: Path, stdout: str, ranks: int, steps: int) -> dict:
    summary = json.loads((out_dir / "train.json").read_text())
    losses = summary["losses"]
    assert len(losses) == steps
    # the loss falls: the mean of the last 5 steps is well under the first 5
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses
    assert summary["heldout_after"] < summary["heldout_before"] - 0.5
    csv_losses = _losses_from_csv(summary["paths"]["csv"])
    assert len(csv_losses) == steps
    assert csv_losses == pytest.approx(losses, rel=1e-5)
    trace = json.loads(Path(summary["paths"]["trace"]).read_text())
    slices = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert {e["pid"] for e in slices} == set(range(ranks))
    for rank in range(ranks):
        names = {e["name"] for e in slices if e["pid"] == rank}
        assert {f"F{m}" for m in range(4)} <= names and {f"B{m}" for m in range(4)} <= names
    assert Path(summary["paths"]["timeline"]).read_bytes()[:8] == PNG_MAGIC
    # the report names the partition, every stage, and the files
    assert "partition (" in stdout and "stage 1: layer" in stdout
    # which rank is which (the rank order, innermost first)
    assert "ranks (order tp-dp-pp, innermost first" in stdout
    assert "rank 1: stage 1, replica 0" in stdout
    # each rank's pid, for kill -USR1 (the ranks are not the launcher's children)
    pids = [re.search(rf"rank {r}: stage \d+, replica \d+, pid (\d+)", stdout)
            for r in range(ranks)]
    assert all(pids) and len({m.group(1) for m in pids}) == ranks, stdout
    assert summary["bounds"][0] == 0 and summary["bounds"][-1] == 4
    for rank in range(ranks):
        assert any(line.split()[:1] == [str(rank)] for line in stdout.splitlines()), stdout
    for key in ("csv", "trace", "timeline"):
        assert summary["paths"][key] in stdout
    assert "sample (prompt" in stdout
    # each rank's own CPU seconds (a launcher sees none of them), summed in the report
    cpu = summary["cpu_seconds"]
    assert len(cpu) == ranks and all(c > 0.2 for c in cpu) and len(set(cpu)) == ranks, cpu
    assert f"CPU: {sum(cpu):.1f} s over {ranks} rank(s)" in stdout
    return summary


def test_train_end_to_end(tmp_path):
    out = tmp_path / "run"
    proc = _cli("train", "--steps", "20", "--out", str(out), *SMALL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = _check_run(out, proc.stdout, ranks=2, steps=20)
    assert summary["config"]["stages"] == 2
    assert "loss " in proc.stdout and " -> " in proc.stdout
    assert "20/20" in proc.stderr and "loss=" in proc.stderr and "tok_s=" in proc.stderr  # tqdm


def test_train_under_torchrun_runs_only_its_rank(tmp_path):
    """With RANK/WORLD_SIZE set (as torchrun does) each process runs one rank, none spawns."""
    out = tmp_path / "run"
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
        clean = {k: v for k, v in os.environ.items() if k not in env}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "pipekernel.apps.cli", "train", "--steps", "20", "--out", str(out),
             *SMALL, "--no-progress", "--every", "5", "--partition", "0,3,4"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**clean, **env}))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=240))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, (stdout, stderr) in zip(procs, outputs):
        assert proc.returncode == 0, stdout + stderr
    summary = _check_run(out, outputs[0][0], ranks=2, steps=20)
    assert summary["bounds"] == [0, 3, 4]
    assert "stage 0: layers 0-2" in outputs[0][0] and "stage 1: layer 3 (Head)" in outputs[0][0]
    # --no-progress: the monitor's console line every 5 steps instead of a bar
    assert [line.split()[1] for line in outputs[0][0].splitlines()
            if line.startswith("step ")] == ["5", "10", "15", "20"]
    assert "loss " not in outputs[1][0]  # only rank 0 reports


def test_train_under_torchrun_with_the_wrong_world_size_says_so(tmp_path):
    proc = _cli("train", "--stages", "2", "--out", str(tmp_path), *SMALL,
                env={"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": str(free_port())}, timeout=120)
    assert proc.returncode == 1
    assert "torchrun started 3 processes" in proc.stderr and "needs 2" in proc.stderr


def test_import_pipekernel_does_not_load_the_command_or_its_extras():
    # (not tqdm: torch itself imports it when it is installed)
    code = ("import sys, pipekernel; bad = [m for m in ('pipekernel.apps.cli', 'pipekernel.apps', "
            "'matplotlib') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_timeline_rows_from_a_trace(tmp_path):
    from pipekernel.apps.timeline import draw_trace, rows_from_trace

    def ev(pid, name, cat, ts, dur, step, tid=0):
        return {"ph": "X", "pid": pid, "tid": tid, "name": name, "cat": cat, "ts": ts,
                "dur": dur, "args": {"stage": pid, "micro_batch": 0, "step": step}}

    trace = {"traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "rank 0"}},
        ev(0, "F0", "Forward", 1000, 500, 1), ev(0, "B0", "Backward", 9000, 1000, 1),
        ev(0, "F0", "Forward", 20000, 500, 2), ev(0, "B0", "Backward", 21000, 1000, 2),
        ev(0, "step 2", "step", 20000, 3000, 2, tid=1),
        ev(1, "RA0", "RecvActivation", 20000, 600, 2), ev(1, "F0", "Forward", 20600, 400, 2),
        ev(1, "SG0", "SendGrad", 21000, 100, 2)]}
    rows = rows_from_trace(trace, last_steps=1)
    assert [label for label, _ in rows] == ["rank 0 (stage 0)", "rank 1 (stage 1)"]
    # times in ms from the first kept slice; the whole-step slice is not an instruction
    assert rows[0][1] == [(0.0, 0.5, "forward", "F0"), (1.0, 1.0, "backward", "B0")]
    assert [b[2] for b in rows[1][1]] == ["wait", "forward", "send"]
    assert len(rows_from_trace(trace, last_steps=None)[0][1]) == 4
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace))
    assert draw_trace(path, tmp_path / "t.png").read_bytes()[:8] == PNG_MAGIC


def test_the_timeline_says_which_steps_it_shows_and_names_the_gaps(tmp_path, monkeypatch):
    from pipekernel.apps import timeline

    def ev(pid, name, cat, ts, dur, step):
        return {"ph": "X", "pid": pid, "tid": 0, "name": name, "cat": cat, "ts": ts,
                "dur": dur, "args": {"stage": pid, "micro_batch": 0, "step": step}}

    trace = {"traceEvents": [ev(0, "F0", "Forward", 1000 * s, 500, s) for s in (7, 8, 9)]
             + [ev(0, "B0", "Backward", 1000 * s + 500, 500, s) for s in (7, 8, 9)]}
    assert timeline.kept_steps(trace, 2) == [8, 9] and timeline.kept_steps(trace, None) == [7, 8, 9]
    seen = {}
    monkeypatch.setattr(timeline, "draw_timeline",
                        lambda rows, path, **kw: seen.update(rows=rows, **kw) or Path(path))
    timeline.draw_trace(trace, tmp_path / "t.png", last_steps=2, title="2 stages")
    assert seen["title"] == "steps 8-9 (numbered as in metrics.csv): 2 stages"
    # steps 8 and 9 back to back fill the row: no gap, no gap entry
    assert timeline.legend_labels(seen["rows"]) == ["forward", "backward"]
    gappy = [("rank 0", [(0.0, 1.0, "forward", "F0"), (3.0, 1.0, "backward", "B0")])]
    assert timeline.legend_labels(gappy)[-1] == timeline.GAP_LABEL
    ended = [("rank 0", [(0.0, 4.0, "forward", "F0")]), ("rank 1", [(0.0, 1.0, "send", "S")])]
    assert timeline.has_gaps(ended)  # rank 1 idles after its send, until the picture's end


# -- pipekernel plan -------------------------------------------------------------------------

PLAN_SMALL = ["--dim", "16", "--layers", "2", "--heads", "2", "--context", "8",
              "--micro-batch-size", "2", "--micro-batches", "2", "--repeats", "1",
              "--counts", "1,2,4", "--schedules", "1f1b,gpipe,zbv"]


def test_plan_prints_the_ranked_candidates(capsys):
    assert cli.main(["plan", *PLAN_SMALL]) == 0
    out = capsys.readouterr().out.splitlines()
    plan_line = next(line for line in out if line.startswith("plan: "))
    table = [line for line in out if line[:1] in ("*", " ") and line[1:5].strip().isdigit()]
    # #, schedule, chunks, micro, partition, recompute, ms
    rows = [line[2:].split() for line in table]
    assert table[0].startswith("*") and f"plan: {rows[0][1]}, chunks {rows[0][2]}, " \
        f"{rows[0][3]} micro-batches" in plan_line  # the choice is ranked first
    predicted = [float(r[6]) for r in rows if r[6] != "-"]
    # 3 schedules x 3 counts, each simulated or listed as another's twin (gpipe with one
    # micro-batch runs 1f1b's streams)
    twins = [line for line in table if "the same instruction streams as" in line]
    assert predicted == sorted(predicted) and len(predicted) + len(twins) >= 9
    assert {r[1] for r in rows} == {"1f1b", "gpipe", "zbv"}


def test_plan_with_recompute_fixed_prints_it_and_trains_with_it(capsys):
    assert cli.main(["plan", *PLAN_SMALL, "--stages", "2", "--recompute", "1,0"]) == 0
    out = capsys.readouterr().out
    assert "recompute: stage 0: every 1 layer(s), stage 1: none" in out
    assert "--recompute 1,0" in out  # the train command line carries it
    assert cli.main(["plan", *PLAN_SMALL, "--recompute", "1,0,1"]) == 1
    assert "recompute=[1, 0, 1] gives 3 stage(s)" in capsys.readouterr().err


def test_plan_with_a_budget_nothing_fits_is_a_clean_error(capsys):
    assert cli.main(["plan", *PLAN_SMALL, "--memory-budget", "1KiB"]) == 1
    err = capsys.readouterr().err
    assert "no candidate fits memory_budget=1.0 KiB" in err and "Traceback" not in err


@pytest.mark.system  # runs the printed train command: processes
def test_plan_prints_the_train_command_that_runs_its_choice(tmp_path, capsys):
    import shlex

    assert cli.main(["plan", *PLAN_SMALL]) == 0
    out = capsys.readouterr().out.splitlines()
    plan_line = next(line for line in out if line.startswith("plan: "))
    command = next(line for line in out if line.startswith("train with it: "))
    argv = shlex.split(command.removeprefix("train with it: "))
    assert argv[:2] == ["pipekernel", "train"]
    args = cli.build_parser().parse_args(argv[1:])
    assert f"plan: {args.schedule}, chunks {args.chunks}, {args.micro_batches} micro-batches, "\
        in plan_line
    assert f"[{args.partition.replace(',', ', ')}]" in plan_line  # the chosen boundaries
    assert args.micro_batches * args.micro_batch_size == 2 * 2  # the batch the plan kept
    assert (args.dim, args.layers, args.heads, args.context) == (16, 2, 2, 8)
    # and the command runs: a 2-step train with that schedule, chunks and partition
    out_dir = tmp_path / "run"
    assert cli.main([*argv[1:], "--steps", "2", "--corpus-bytes", "20000", "--sample-bytes",
                     "0", "--no-progress", "--out", str(out_dir)]) == 0
    summary = json.loads((out_dir / "train.json").read_text())
    assert summary["bounds"] == [int(b) for b in args.partition.split(",")]
    assert summary["config"]["schedule"] == args.schedule


def test_schedule_into_a_closed_pipe_exits_quietly():
    """`pipekernel schedule ... | head -1`: the reader leaves; no BrokenPipeError traceback,
    the exit status a shell shows for a tool SIGPIPE ended (128 + 13)."""
    read, write = os.pipe()
    os.close(read)  # the reader has gone before the first write: every write fails
    try:
        proc = subprocess.run([sys.executable, "-m", "pipekernel.apps.cli", "schedule", "1f1b",
                               "--stages", "2", "--micro-batches", "4"], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert proc.returncode == 141 and proc.stderr == "", proc.stderr


def test_train_flags_resume_and_keep_last_parse():
    parse = cli.build_parser().parse_args
    assert parse(["train"]).resume is False and parse(["train"]).keep_last == 3
    assert parse(["train", "--resume"]).resume is True  # alone: the latest, if any
    assert parse(["train", "--resume", "--steps", "5"]).resume is True
    assert parse(["train", "--resume", "global_step20"]).resume == "global_step20"
    assert parse(["train", "--keep-last", "0"]).keep_last == 0


@pytest.mark.parametrize("flags,text", [
    (["--keep-last", "-1"], "--keep-last must be 0 or a positive integer"),
    (["--verify-every", "-1"], "--verify-every must be 0 or a positive integer"),
    (["--check-every", "-2"], "--check-every must be 0 or a positive integer"),
    (["--resume", "ck/global_step2"], "--resume 'ck/global_step2' is not a checkpoint tag")])
def test_train_refuses_a_bad_keep_last_or_tag_before_starting_processes(capsys, flags, text):
    assert cli.main(["train", *flags]) == 1
    err = capsys.readouterr().err
    assert text in err and "how to fix" in err and "Traceback" not in err


@pytest.mark.multirank
def test_train_verify_every_replays_and_trains(tmp_path):
    """--verify-every 1: every batch is replayed on every stage, then trained (a clean
    model passes); --check-every 1 runs the sentinel after every step, and the report
    says the last check's step, result and cost."""
    out = tmp_path / "run"
    assert cli.main(["train", "--steps", "3", "--verify-every", "1", "--check-every", "1",
                     "--schedule", "zbv", "--no-progress", "--out", str(out),
                     "--dim", "16", "--layers", "2", "--heads", "2", "--context", "8",
                     "--micro-batch-size", "2", "--corpus-bytes", "20000",
                     "--sample-bytes", "0"]) == 0
    summary = json.loads((out / "train.json").read_text())
    assert summary["config"]["verify_every"] == 1 and summary["config"]["check_every"] == 1
    # the monitor's summaries (the report's table): the last check, on every rank
    checks = [s["last_check"] for s in summary["stages"]]
    assert len(checks) == 2 and all(c["step"] == 3 and c["result"] == "passed"
                                    and c["seconds"] > 0 for c in checks), checks


@pytest.mark.fast
def test_the_report_and_the_console_say_the_last_checks_result_and_cost():
    import io

    from pipekernel.apps.train import last_check
    from pipekernel.plugins.sinks import ConsoleSink

    ranks = [{"last_check": {"step": 200, "result": "passed", "seconds": s}}
             for s in (0.002, 0.0035)]
    assert last_check(ranks, 100) == ["last consistency check (every 100 steps): after step "
                                      "200, passed on 2 rank(s), 3.5 ms on the slowest"]
    assert last_check([{"last_check": None}], 100) == \
        ["consistency checks: none ran (every 100 steps)"]
    assert last_check(ranks, 0) == ["consistency checks: off (--check-every 0)"]
    out = io.StringIO()
    sink = ConsoleSink(every=1, stream=out)
    record = {"step": 4, "loss": 1.0, "step_s": 0.1, "samples_per_s": 1.0,
              "tokens_per_s": 1.0, "bubble_fraction": 0.1, "peak_memory_mb": None}
    sink.write(record)
    sink.write({**record, "check_seconds": 0.0021})
    first, second = out.getvalue().splitlines()
    assert "check" not in first and second.endswith("check passed 2.1 ms")
