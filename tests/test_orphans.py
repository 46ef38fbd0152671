"""A killed launcher leaves no rank behind (issue 43, item 1).

Real launchers, killed as users and the machine kill them: ``kill -9`` (the OOM killer's
signal) under the default ``forkserver`` start method, where a rank's parent is the fork
server and ``PR_SET_PDEATHSIG`` alone watched the wrong process, and under ``spawn``; a
closed terminal's SIGHUP; and SIGUSR1, which the launcher passes on to its ranks (each
prints its report) instead of dying of it. Rank 1 ignores SIGTERM, as a rank stuck where
no signal handler runs would: only the escalation to SIGKILL ends it. The three launchers
run side by side (one import of torch each, in parallel) and the check waits for the
processes to die with a generous deadline: it asserts that they end, not how fast.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.system

PROGRAM = textwrap.dedent("""
    import os, signal, sys, time
    import pipekernel as pk

    def work(directory):
        rank = int(os.environ["RANK"])
        if rank == 1:  # a rank SIGTERM does not reach: only a kill ends it
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        path = os.path.join(directory, f"rank{rank}")
        with open(path + ".tmp", "w") as f:
            f.write(f"{os.getpid()} {os.getppid()}")
        os.replace(path + ".tmp", path)
        while True:  # training, as far as anyone can tell
            sum(range(10000))
            time.sleep(0.01)

    if __name__ == "__main__":
        pk.launch(work, 2, (sys.argv[1],))
""")

#: generous: a loaded 2-core machine; the ranks need GRACE (5 s) at most after the kill
DEADLINE = 90.0


def _alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet counts as dead: it holds no CPU, no GPU)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _wait(condition, what: str, deadline: float = DEADLINE) -> None:
    end = time.monotonic() + deadline
    while not condition():
        assert time.monotonic() < end, f"after {deadline:g}s: {what}"
        time.sleep(0.2)


class Job:
    """One launcher started as a user would, its ranks' pids and the fork server's."""

    def __init__(self, tmp: Path, name: str, method: str) -> None:
        self.dir = tmp / name
        self.dir.mkdir()
        script = tmp / "job.py"
        if not script.exists():
            script.write_text(PROGRAM)
        self.err_path = tmp / f"{name}.err"
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        env["PIPEKERNEL_START_METHOD"] = method
        with open(self.err_path, "w") as err:
            self.proc = subprocess.Popen([sys.executable, str(script), str(self.dir)],
                                         stdout=subprocess.DEVNULL, stderr=err, env=env,
                                         cwd=tmp)
        self.method = method

    def ready(self) -> bool:
        assert self.proc.poll() is None, f"the launcher ended early:\n{self.stderr()}"
        return all((self.dir / f"rank{r}").exists() for r in range(2))

    def pids(self) -> list[int]:
        """The ranks' pids and, under forkserver, their parent: the fork server."""
        found = [(self.dir / f"rank{r}").read_text().split() for r in range(2)]
        pids = [int(pid) for pid, _ in found]
        parents = {int(parent) for _, parent in found}
        return pids + sorted(parents - {self.proc.pid})  # forkserver: the server

    def stderr(self) -> str:
        return self.err_path.read_text()


def test_no_rank_outlives_a_killed_launcher_and_usr1_reaches_the_ranks(tmp_path):
    jobs = {"kill9": Job(tmp_path, "kill9", "forkserver"),
            "hup": Job(tmp_path, "hup", "forkserver"),
            "kill9-spawn": Job(tmp_path, "kill9-spawn", "spawn")}
    try:
        _wait(lambda: all(job.ready() for job in jobs.values()), "the ranks did not start",
              deadline=240)
        pids = {name: job.pids() for name, job in jobs.items()}
        assert len(pids["kill9"]) == 3 and len(pids["kill9-spawn"]) == 2, pids  # the server
        # SIGUSR1 to the launcher: passed on, every rank reports, nobody dies of it
        usr1 = jobs["kill9"]
        usr1.proc.send_signal(signal.SIGUSR1)
        _wait(lambda: usr1.stderr().count("got SIGUSR1") == 2, "the ranks did not report "
              f"SIGUSR1:\n{usr1.stderr()}")
        assert "passed SIGUSR1 on to the ranks" in usr1.stderr()
        assert usr1.proc.poll() is None and all(_alive(p) for p in pids["kill9"])
        for name, sig in (("kill9", signal.SIGKILL), ("hup", signal.SIGHUP),
                          ("kill9-spawn", signal.SIGKILL)):
            jobs[name].proc.send_signal(sig)
        for name, job in jobs.items():
            job.proc.wait(timeout=DEADLINE)
            _wait(lambda: not any(_alive(p) for p in pids[name]),
                  f"{name}: still running: {[p for p in pids[name] if _alive(p)]} of "
                  f"{pids[name]}\n{job.stderr()}")
    finally:
        for job in jobs.values():
            job.proc.kill()
            for path in job.dir.glob("rank?"):  # never leave one behind, even on failure
                for pid in map(int, path.read_text().split()):
                    if _alive(pid) and pid != os.getpid():
                        os.kill(pid, signal.SIGKILL)
    assert jobs["kill9"].proc.returncode == -signal.SIGKILL
    # the ranks of a killed launcher say why they stop
    assert jobs["kill9"].stderr().count("is gone; stopping") == 2
    # SIGHUP: the launcher stops its ranks as on Ctrl-C and says so
    assert "launch terminated by SIGHUP: stopped ranks [0, 1]" in jobs["hup"].stderr()
    assert jobs["hup"].proc.returncode not in (0, None)
