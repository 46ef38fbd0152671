"""Launchers: ``pk.launch`` has no wall-clock limit unless asked (then it is a deadline, and
says so); the engine and ``pk.launch`` join the world another launcher made (torchrun,
a SLURM step, Ray Train / Kubeflow's variables, a process group the caller made); the
default transport ``"auto"`` says once what it chose."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

import pipekernel as pk
from pipekernel.launcher import clusters
from pipekernel.launcher import launch as launch_mod
from pipekernel.launcher.launch import free_port


# -- no wall-clock limit by default --------------------------------------------------------------

def _slow(seconds: float) -> int:
    time.sleep(seconds)
    return int(os.environ["RANK"])


class _FastClock:
    """An hour passes at every look: a run of a second is, to the launcher, days long."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 3600.0
        return self.now


def test_launch_has_no_deadline_by_default(monkeypatch):
    monkeypatch.setattr(launch_mod, "_clock", _FastClock())
    assert pk.launch(_slow, 2, (1.0,)) == [0, 1]  # "days" of training, not killed


def test_an_explicit_timeout_is_a_deadline_on_the_whole_run_and_says_so(monkeypatch):
    monkeypatch.setattr(launch_mod, "_clock", _FastClock())
    with pytest.raises(pk.RankError) as info:
        pk.launch(_slow, 2, (30.0,), timeout=600)
    text = str(info.value)
    assert text.startswith("the launch deadline passed: timed out after 600s waiting for "
                           "ranks [0, 1]")
    assert "deadline on the whole run, not a sign of a hang" in text
    assert "timeout=None" in text and "hangs" not in text


def test_run_ranks_keeps_its_own_timeout(monkeypatch):
    import pipekernel.testing as testing

    seen = {}
    monkeypatch.setattr(testing, "launch", lambda *a, **kw: seen.update(kw) or [])
    testing.run_ranks(print, 2)
    assert seen["timeout"] == 300.0
    testing.run_ranks(print, 2, timeout=7)
    assert seen["timeout"] == 7


# -- which launcher made this world ---------------------------------------------------------------

def _no_group(monkeypatch):
    monkeypatch.setattr(clusters.ProcessGroupEnvironment, "detect", lambda self, env: False)


SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
         "SLURM_JOB_ID": "123456", "SLURM_NODELIST": "gpu[017-020],cpu3",
         "SLURM_NTASKS_PER_NODE": "4(x2)"}


def test_slurm_step_gives_the_torchrun_variables(monkeypatch):
    _no_group(monkeypatch)
    world = clusters.detect(dict(SLURM))
    assert (world.launcher, world.rank, world.world_size, world.local_rank) == ("slurm", 5, 8, 1)
    assert world.variables == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                               "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "gpu017",
                               "MASTER_PORT": str(15000 + 3456)}
    env = {**SLURM, "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.7", "MASTER_PORT": "29500"}
    assert clusters.export(env).variables["MASTER_ADDR"] == "10.0.0.7"
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["RANK"]) == ("10.0.0.7", "29500", "5")
    env = {**SLURM, "MASTER_ADDR": "head"}  # a MASTER_ADDR the user set wins
    assert clusters.detect(env).variables["MASTER_ADDR"] == "head"


def test_slurm_batch_script_and_torchrun_inside_srun_are_not_slurm_worlds(monkeypatch):
    _no_group(monkeypatch)
    batch = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}
    assert clusters.detect(batch) is None  # one process of the allocation: a job of its own
    assert clusters.detect({**SLURM, "SLURM_STEP_ID": "batch"}) is None
    torchrun = {**SLURM, "TORCHELASTIC_RUN_ID": "j", "RANK": "2", "WORLD_SIZE": "16",
                "LOCAL_RANK": "2"}
    assert clusters.detect(torchrun).launcher == "torchrun"
    assert clusters.detect(torchrun).rank == 2


def test_ray_and_kubeflow_variables_are_an_env_world(monkeypatch):
    _no_group(monkeypatch)
    ray = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "41000"}
    world = clusters.detect(ray)
    assert (world.launcher, world.rank, world.world_size, world.variables) == ("env", 1, 2, {})
    assert clusters.detect({**ray, "PIPEKERNEL_INIT_METHOD": "file:///x"}).launcher == "pk.launch"
    assert clusters.detect({"RANK": "0"}) is None  # half a world is none


@pytest.mark.parametrize("nodelist,host", [("node1", "node1"), ("a[003-005,9],b", "a003"),
                                           ("x[7],y[1-2]", "x7"), ("", None)])
def test_first_host_of_a_slurm_node_list(nodelist, host):
    assert clusters.first_host(nodelist) == host


def test_a_bad_launcher_variable_says_which(monkeypatch):
    _no_group(monkeypatch)
    with pytest.raises(pk.ConfigError, match=r"SLURM_PROCID='x' is not an integer\n  how to fix"):
        clusters.detect({**SLURM, "SLURM_PROCID": "x"})


# -- joining it, through real processes -----------------------------------------------------------

JOIN_SCRIPT = textwrap.dedent("""
    import os, sys, torch
    from torch import nn
    import pipekernel as pk

    def main(steps):
        torch.set_num_threads(1)
        layers = [pk.LayerSpec(nn.Linear, 4, 8), torch.tanh, pk.LayerSpec(nn.Linear, 8, 2)]
        module = pk.PipelineModule(layers, loss_fn=nn.MSELoss(), num_stages=2,
                                   partition="uniform", seed=3)
        engine = pk.PipelineEngine(module, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                                   micro_batches=2, timeout=120)
        g = torch.Generator().manual_seed(0)
        data = [(torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g))
                for _ in range(2 * steps)]
        losses = [engine.train_batch(iter(data[2 * s:2 * s + 2])).item() for s in range(steps)]
        engine.close()
        return {"pid": os.getpid(), "rank": engine.transport.rank, "losses": losses}

    if __name__ == "__main__":
        if sys.argv[1] == "group":  # the caller made the process group
            import torch.distributed as dist
            dist.init_process_group("gloo", rank=int(os.environ["R"]), world_size=2,
                                    init_method="tcp://127.0.0.1:" + os.environ["PORT"])
        out = pk.launch(main, 2, (2,))
        print("RESULT", os.getpid(), repr(out), flush=True)
        if sys.argv[1] == "group":
            dist.destroy_process_group()
""")


def _world_env(mode: str, rank: int, port: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "TORCHELASTIC_", "PIPEKERNEL_INIT"))
            and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    base.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    if mode == "slurm":  # srun --ntasks 2: SLURM's variables only, the address from SLURM
        base.update(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank),
                    SLURM_STEP_ID="0", SLURM_JOB_ID="77", SLURM_NODELIST="localhost",
                    SLURM_LAUNCH_NODE_IPADDR="127.0.0.1", MASTER_PORT=port)
    elif mode == "env":  # Ray Train's / Kubeflow's variables, no torchelastic
        base.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                    LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    else:
        base.update(R=str(rank), PORT=port)
    return base


@pytest.mark.parametrize("mode", ["slurm", "env", "group"])
def test_launch_joins_the_world_a_launcher_made(mode, tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOIN_SCRIPT)
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(script), mode], cwd=tmp_path,
                              env=_world_env(mode, rank, port), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in range(2)]
    outs = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=240))
    finally:
        for proc in procs:
            proc.kill()
    results = []
    for rank, (proc, (out, err)) in enumerate(zip(procs, outs)):
        assert proc.returncode == 0, f"rank {rank}:\n{out}\n{err[-4000:]}"
        line = next(line for line in out.splitlines() if line.startswith("RESULT"))
        _, pid, value = line.split(" ", 2)
        value = eval(value)  # noqa: S307 - our own script's repr
        assert value[1 - rank] is None  # this rank's result only: no job of its own
        assert value[rank]["pid"] == int(pid) == proc.pid and value[rank]["rank"] == rank
        results.append(value[rank]["losses"])
        auto = [line for line in err.splitlines() if "transport 'auto' chose" in line]
        assert len(auto) == (1 if rank == 0 else 0), err[-3000:]  # once, by rank 0
        if rank == 0:
            assert auto[0].startswith("pipekernel: transport 'auto' chose 'gloo' (")
    assert results[0] == results[1] and len(results[0]) == 2  # one job, every rank's loss


# -- the default transport ----------------------------------------------------------------------

def test_auto_follows_the_host_group_backend_and_the_gpus_per_node(monkeypatch):
    import torch
    import torch.distributed as dist

    from pipekernel.extend import manager

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # four ranks on a one-GPU machine: all gloo
    assert manager.auto_transport() == "gloo"
    assert "4 processes on this node but 1 GPU" in manager.auto_reason()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert manager.auto_transport() == "nccl"
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert manager.auto_transport() == "gloo"  # Ray Train's CPU workers on a GPU machine
    assert manager.auto_reason() == "the process group's backend is gloo"


def test_the_engine_default_is_auto():
    import inspect

    assert inspect.signature(pk.PipelineEngine).parameters["transport"].default == "auto"


def test_a_one_process_group_still_lets_launch_start_its_job(monkeypatch):
    monkeypatch.setattr(clusters.ProcessGroupEnvironment, "detect", lambda self, env: True)
    monkeypatch.setattr(clusters.ProcessGroupEnvironment, "world",
                        lambda self, env: clusters.World("process group", 0, 1, 0))
    assert launch_mod._launched_world(2) is None  # a notebook's group of one: start 2
    assert launch_mod._launched_world(1).launcher == "process group"
    monkeypatch.setattr(clusters.ProcessGroupEnvironment, "world",
                        lambda self, env: clusters.World("process group", 1, 3, 1))
    with pytest.raises(pk.ConfigError, match=r"runs inside an initialised process group of "
                                             r"WORLD_SIZE=3 \(this is RANK=1\)"):
        launch_mod._launched_world(2)
