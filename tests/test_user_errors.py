"""Errors a user can act on: the failing layer, "did you mean", pk.launch inside another
launcher's world, a second Ctrl-C, a schedule grid that hides nothing, help without doubled
defaults. Exact wording is asserted: it is what users read."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch import nn

import pipekernel as pk
from pipekernel.plugin import Kernel
from pipekernel.extend.manager import make_plugin_manager, make_precision, make_transport, \
    resolve_schedule
from pipekernel.schedules import format_grid, simulate, BUILTIN_SCHEDULES
from pipekernel.schedules import instructions as isa
from pipekernel.launcher.launch import free_port


# -- the failing layer ------------------------------------------------------------------------

class Broken(nn.Module):
    def forward(self, x):
        raise ValueError("shapes do not fit")


def test_instruction_error_names_the_failing_layer_and_its_class():
    module = pk.PipelineModule([nn.Linear(4, 4), nn.Linear(4, 4), Broken(), nn.Linear(4, 4)],
                               num_stages=2, partition=[0, 1, 4])
    stage = module.build_stage(1, [0, 1, 4])
    kernel = Kernel({isa.Forward: lambda i: stage(torch.zeros(2, 4))}, rank=1, stage=1)
    with pytest.raises(pk.InstructionError) as info:
        kernel.run([[isa.Forward(3)]])
    assert str(info.value).startswith(
        "[rank 1, stage 1, schedule step 0, micro-batch 3, instruction F3] ValueError in "
        "layer 2 (Broken) while running F3: shapes do not fit")


# -- did you mean -----------------------------------------------------------------------------

def test_unknown_names_get_the_closest_known_one():
    pm = make_plugin_manager(autoload=False)
    with pytest.raises(pk.UnknownNameError) as info:
        make_transport(pm, "ncl", {})
    assert str(info.value).startswith("unknown transport 'ncl' (did you mean 'nccl'?); "
                                      "installed transports: ")
    with pytest.raises(pk.UnknownNameError) as info:
        resolve_schedule(pm, "1fb1")
    assert str(info.value).startswith("unknown schedule '1fb1' (did you mean '1f1b'?)")
    with pytest.raises(pk.UnknownNameError) as info:
        resolve_schedule(pm, "ZB_H1")
    assert str(info.value).startswith("unknown schedule 'ZB_H1' (did you mean 'zb-h1'?)")
    with pytest.raises(pk.UnknownNameError) as info:
        make_precision(pm, "bf61", {})
    assert str(info.value).startswith("unknown precision 'bf61' (did you mean 'bf16'?)")
    with pytest.raises(pk.UnknownNameError) as info:
        resolve_schedule(pm, "qwerty")
    assert str(info.value).startswith("unknown schedule 'qwerty'\n  how to fix: available")


def test_unknown_partition_method_and_sink_get_the_closest_one():
    module = pk.PipelineModule([nn.Linear(2, 2)] * 4, num_stages=2, partition="paramters")
    with pytest.raises(pk.ConfigError) as info:
        module.partition(2)
    assert str(info.value).startswith("no partition plugin understands partition='paramters' "
                                      "(did you mean 'parameters'?)")
    from pipekernel.plugins.sinks import make_sink
    with pytest.raises(pk.UnknownNameError) as info:
        make_sink("cvs")
    assert str(info.value).startswith("unknown monitor sink 'cvs' (did you mean 'csv'?)")


def test_disabling_a_plugin_nobody_has_warns_with_the_closest_name():
    with pytest.warns(UserWarning, match=r"plugin 'partiton' was disabled but no installed "
                                         r"plugin has that name \(did you mean 'partition'\?\)"):
        make_plugin_manager(autoload=False, disabled=["partiton"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_plugin_manager(autoload=False, disabled=["partition"])


# -- pk.launch inside another launcher's world --------------------------------------------------

JOIN_SCRIPT = textwrap.dedent("""
    import os, sys
    import pipekernel as pk

    def main(tag):
        return f"{tag} rank {os.environ['RANK']} pid {os.getpid()}"

    if __name__ == "__main__":
        out = pk.launch(main, int(sys.argv[1]), ("job",))
        print("RESULT", out, flush=True)
""")


def test_launch_under_torchrun_joins_its_world_instead_of_running_the_job_twice(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOIN_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(free_port()),
                          str(script), "2"], capture_output=True, text=True, env=env,
                         timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = sorted(line for line in run.stdout.splitlines() if line.startswith("RESULT"))
    assert len(lines) == 2, run.stdout  # once per torchrun rank, not nprocs more per rank
    assert "['job rank 0 pid" in lines[0] and lines[0].endswith(", None]")
    assert lines[1].startswith("RESULT [None, 'job rank 1 pid")


def test_launch_under_torchrun_with_another_size_refuses_with_the_command(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(pk.ConfigError) as info:
        pk.launch(print, 4)
    assert str(info.value) == (
        "pk.launch(fn, nprocs=4) runs inside a torchrun world of WORLD_SIZE=2 (this is RANK=1): "
        "it would start 4 more processes per rank\n  how to fix: start torchrun with 4 processes "
        "in all (e.g. torchrun --nproc-per-node 4 script.py), or pass nprocs=2; pk.launch then "
        "runs fn on each torchrun rank")


def test_launch_in_a_slurm_step_of_another_size_refuses_with_the_command(monkeypatch):
    for key in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    with pytest.raises(pk.ConfigError, match=r"^pk.launch\(fn, nprocs=2\) runs inside a SLURM "
                                             r"step of WORLD_SIZE=8 \(this is RANK=3\).*\n  how "
                                             r"to fix: start the step with 2 tasks"):
        pk.launch(print, 2)


# -- a second Ctrl-C ----------------------------------------------------------------------------

STUBBORN = textwrap.dedent("""
    import os, time, pipekernel as pk

    def stubborn():
        # one write(2) of the whole line: the two ranks share the pipe, and print's text
        # and newline can reach it as two writes ("readyready" once in CI)
        os.write(1, b"ready\\n")
        while True:  # ignores the launcher's SIGTERM: only a kill ends it
            try:
                time.sleep(0.05)
            except KeyboardInterrupt:
                pass

    if __name__ == "__main__":
        pk.launch(stubborn, 2)
""")


def test_a_second_ctrl_c_kills_the_workers_and_still_prints_the_summary(tmp_path):
    script = tmp_path / "stubborn.py"
    script.write_text(STUBBORN)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        for _ in range(2):
            assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGINT)
        # the launcher says it is stopping the workers: now the second Ctrl-C
        while "stopping 2 workers" not in (line := proc.stderr.readline()):
            assert line, "the launcher ended without announcing the stop"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert "Traceback" not in err  # no raw traceback from inside the launcher
    # the summary comes first (where pk.launch was called from, after it)
    assert err.lstrip().splitlines()[0] == (
        "pipekernel.launcher.launch.LaunchInterrupted: launch interrupted (Ctrl-C), then killed by "
        "a second Ctrl-C: stopped ranks [0, 1]; no rank had failed")
    assert err.rstrip().endswith("pk.launch(stubborn, 2)")
    assert proc.returncode != 0


# -- an error through pk.launch ------------------------------------------------------------------

BAD_SCHEDULE = textwrap.dedent("""
    import torch, pipekernel as pk

    def job():
        layers = [pk.LayerSpec(torch.nn.Linear, 4, 4) for _ in range(2)]
        module = pk.PipelineModule(layers, loss_fn=torch.nn.MSELoss(), num_stages=2)
        pk.PipelineEngine(module, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                          micro_batches=2, schedule="1f1bx", transport="gloo")

    if __name__ == "__main__":
        pk.launch(job, 2)
""")


def test_an_error_through_pk_launch_starts_with_pipekernels_message_said_once(tmp_path):
    """Not the launcher's own traceback frames first, then the message, then the message
    again at the end of the rank's traceback: the message, the rank's frames, the caller."""
    script = tmp_path / "bad_schedule.py"
    script.write_text(BAD_SCHEDULE)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=240)
    err = proc.stderr
    assert proc.returncode == 1, err
    assert re.fullmatch(r"pipekernel\.launcher\.launch\.RankError: rank [01] failed: unknown "
                        r"schedule '1f1bx' \(did you mean '1f1b'\?\)", err.splitlines()[0]), err
    assert err.count("unknown schedule '1f1bx'") == 1, err
    assert "launch.py" not in err  # neither the launcher's frames nor the worker's own
    assert 'bad_schedule.py", line 7, in job' in err  # the rank's frames stay
    assert err.rstrip().endswith("raised by pk.launch, called from (most recent call last):\n"
                                 f'    File "{script}", line 11, in <module>\n'
                                 "      pk.launch(job, 2)")


# -- the schedule grid hides nothing -----------------------------------------------------------

@pytest.mark.parametrize("name", sorted(BUILTIN_SCHEDULES))
def test_the_schedule_grid_shows_every_compute_instruction(name):
    cls = BUILTIN_SCHEDULES[name]
    chunks = getattr(cls, "default_chunks", 1)
    costs = {isa.Forward: 1.0, isa.Backward: 1.0, isa.BackwardInput: 0.5,
             isa.BackwardWeight: 0.5}
    result = simulate(cls, 4, 8, chunks=chunks, costs=costs)
    grid = format_grid(result)
    cells = {c for line in grid.splitlines()[1:] if "|" in line
             for cell in line.split("|", 1)[1].split() for c in cell.split("+")}
    shown = {str(i) for events in result.timeline for _, _, i in events}
    assert shown and shown <= cells, sorted(shown - cells)


# -- --help ------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["train", "plan", "schedule", "plugins"])
def test_help_says_each_default_once(command, capsys):
    from pipekernel.apps.cli import main
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in text
    for chunk in text.split("--")[1:]:  # one option's help each
        assert chunk.count("(default:") <= 1, chunk
