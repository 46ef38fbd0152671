"""Fault injection: every fault ends every rank with an error that says who failed where,
fast, and leaves no process behind.

Each test starts real processes on gloo (world size <= 4) through a harness that, unlike
``run_ranks``, keeps the survivors running when one rank dies, so that every rank's own
error is seen. Workers catch their error as a host framework would (the process stays
alive), record when they got it, close the engine and exit: a clean exit (code 0) shows
that the process group was left in a state the host can leave.

Timing: the engine's timeout is 60 s while every rank must have its error less than
``FAST`` seconds after the fault — only abort propagation gets there; a rank that waited
for its timeout would take 60 s. The bound is generous (idle: under 2 s) so that load
cannot break it, and still four times below the timeout.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
import torch
from torch import nn

import pipekernel as pk
from pipekernel.launcher.launch import free_port, start_context

TIMEOUT = 60.0   # the engine's timeout: what a rank without abort propagation would wait
FAST = 15.0      # fault -> last rank's error, with a wide margin for a loaded machine
HARNESS = 300.0  # the harness kills everything after this (a starved machine is slow)

#: figures for the report: (test, faults injected, ranks with a named error, worst seconds)
FIGURES: list[tuple[str, int, int, float]] = []


# -- the harness ------------------------------------------------------------------------
def _child(fn, args, rank, env, results):
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(1)
    try:
        results.put((rank, fn(*args)))
    except BaseException as err:  # noqa: BLE001 - reported to the test
        results.put((rank, {"uncaught": f"{type(err).__name__}: {err}"}))


def run_faulty(fn, nprocs, *args, tcp_store=False):
    """Run ``fn(*args)`` on ``nprocs`` ranks; ``({rank: result}, {rank: exit code})``.
    Ranks that die report nothing; every process is gone when this returns.
    ``tcp_store``: a raw ``env://`` launch, rank 0 serving the TCP store (else a file store,
    as ``pk.launch``)."""
    ctx = start_context()  # as pk.launch's workers: forked from a server that imported torch
    results = ctx.Queue()
    store = tempfile.mkdtemp(prefix="pk-faults-")
    base = {**os.environ, "WORLD_SIZE": str(nprocs), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()), "GLOO_SOCKET_IFNAME": "lo",
            **({} if tcp_store else {"PIPEKERNEL_INIT_METHOD": f"file://{store}/store"})}
    procs = [ctx.Process(target=_child, args=(fn, args, r, {**base, "RANK": str(r),
                                                             "LOCAL_RANK": str(r)}, results))
             for r in range(nprocs)]
    for p in procs:
        p.start()
    out, deadline = {}, time.monotonic() + HARNESS
    while time.monotonic() < deadline and any(p.is_alive() for p in procs):
        try:
            rank, value = results.get(timeout=0.2)
            out[rank] = value
        except queue.Empty:
            pass
    while True:
        try:
            rank, value = results.get(timeout=0.5)
            out[rank] = value
        except queue.Empty:
            break
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(10)
    assert not hung, f"ranks {hung} were still running after {HARNESS}s"
    for p in procs:  # nothing outlives the test
        assert not os.path.exists(f"/proc/{p.pid}/status") or \
            "zombie" not in open(f"/proc/{p.pid}/status").read()
    return out, {r: p.exitcode for r, p in enumerate(procs)}


# -- models and the worker ------------------------------------------------------------------
class Fault(nn.Module):
    """Linear layer that misbehaves once, at (train step, micro-batch) = ``at``."""

    def __init__(self, kind, at):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.kind, self.at, self.calls = kind, at, 0

    def forward(self, x):
        step, micro_batch = divmod(self.calls, 4)
        self.calls += 1
        if (step, micro_batch) == tuple(self.at) and self.training:
            if self.kind == "raise":
                _mark_fault()
                raise ValueError("boom on purpose in a layer")
            if self.kind == "kill":
                _mark_fault()
                os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "reshape" and micro_batch == 2:  # this micro-batch is wider
            return torch.cat([self.lin(x), torch.zeros(x.shape[0], 3)], dim=1)
        return self.lin(x)


def _first8(x):
    return x[:, :8]


def _mark_fault():
    with open(os.environ["PK_FAULT_FILE"], "w") as f:
        f.write(repr(time.time()))


def model(stages, kind=None, fault_stage=2, at=(1, 1)):
    layers = []
    for s in range(stages):
        if s == fault_stage and kind is not None:
            layers.append(pk.LayerSpec(Fault, kind, at))
        else:
            layers.append(pk.LayerSpec(nn.Linear, 8, 8))
        if s > 0:
            layers[-1:] = [_first8, layers[-1]]
    bounds = [0]
    for s in range(stages):
        bounds.append(bounds[-1] + (1 if s == 0 else 2))
    return pk.PipelineModule(layers, loss_fn=nn.MSELoss(), num_stages=stages,
                             partition=bounds, seed=5)


def data(step, n=4):
    g = torch.Generator().manual_seed(step)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)) for _ in range(n)]


def worker(case, stages, fault_file, steps=3):
    os.environ["PK_FAULT_FILE"] = fault_file
    rank = int(os.environ["RANK"])
    kind = {"raise": "raise", "kill": "kill", "kill-first": "kill",
            "reshape": "reshape"}.get(case)
    micro_batches = 3 if case == "config" and rank == 2 else 4
    options = {"nonfinite": "skip"} if case == "nonfinite-skip" else {}
    start = time.time()
    engine = None
    losses = []
    try:
        engine = pk.PipelineEngine(model(stages, kind, 0 if case == "kill-first" else 2),
                                   micro_batches=micro_batches,
                                   optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
                                   timeout=TIMEOUT, **options)
        for step in range(steps):
            items = data(step)
            if case == "short-iter" and engine.is_first_stage() and step == 1:
                items = items[:2]
            if case == "bad-labels" and engine.is_last_stage() and step == 1:
                items = [(x, (y, y)) for x, y in items]
            if case == "shuffled" and engine.is_last_stage():
                items = items[1:] + items[:1]
            if case.startswith("nonfinite") and step == 1:
                items[2] = (items[2][0], torch.full((4, 8), float("nan")))
            marks = {"short-iter": (engine.is_first_stage(), 1),
                     "bad-labels": (engine.is_last_stage(), 1),
                     "shuffled": (engine.is_last_stage(), 0),
                     "nonfinite": (engine.is_last_stage(), 1)}
            if marks.get(case, (False, None)) == (True, step):
                _mark_fault()  # the fault is in what this rank reads now
            losses.append(engine.train_batch(iter(items)).item())
        result = {"ok": True, "losses": losses, "skipped": engine.skipped_steps}
    except pk.PipelineError as err:
        result = {"ok": False, "when": time.time(), "type": type(err).__name__,
                  "text": str(err), "rank": err.rank, "stage": err.stage,
                  "micro_batch": err.micro_batch, "instruction": str(err.instruction)}
    result["start"] = start
    if engine is not None:
        engine.close()
    return result


def _fault_time(fault_file, results):
    if os.path.exists(fault_file):
        return float(open(fault_file).read())
    return max(r["start"] for r in results.values())  # the last rank reaching the engine


def _check(name, results, codes, fault_file, expect, dead=()):
    """Every rank but ``dead`` ended with an error matching ``expect[rank]`` fast."""
    fault = _fault_time(fault_file, results)
    worst = 0.0
    for rank, pattern in expect.items():
        r = results[rank]
        assert not r.get("ok", False) and "uncaught" not in r, (rank, r)
        assert re.search(pattern, r["text"], re.S), f"rank {rank}: {r['text']}"
        worst = max(worst, r["when"] - fault)
        assert codes[rank] == 0, f"rank {rank} exited with {codes[rank]}"
    for rank in dead:
        assert rank not in results and codes[rank] == -signal.SIGKILL
    assert worst < FAST, f"{name}: the last rank had its error {worst:.1f}s after the fault"
    FIGURES.append((name, 1, len(expect), worst))
    print(f"\n[faults] {name}: {len(expect)} ranks ended with a named error, "
          f"worst {worst:.2f}s after the fault")
    return worst


@pytest.fixture
def fault_file(tmp_path):
    return str(tmp_path / "fault")


# -- the faults ---------------------------------------------------------------------------
ABORT = (r"rank {r} failed first \(stage {r}, train step {t} \(1-based\), schedule step \d+, "
         r"micro-batch {m}, instruction {ins}\) with {typ}")


def test_a_layer_that_raises_ends_every_rank_naming_it(fault_file):
    results, codes = run_faulty(worker, 4, "raise", 4, fault_file)
    expect = {r: ABORT.format(r=2, t=2, m=1, ins="F1", typ="InstructionError") for r in (0, 1, 3)}
    expect[2] = (r"\[rank 2, stage 2, train step 2 \(1-based\), schedule step \d+, micro-batch 1, "
                 r"instruction F1\] ValueError.*boom")
    _check("layer raises", results, codes, fault_file, expect)
    for r in (0, 1, 3):  # the failing rank's location travels with the error
        assert (results[r]["type"], results[r]["rank"], results[r]["stage"],
                results[r]["micro_batch"]) == ("PeerAbort", 2, 2, 1)
        assert f"rank {r} stopped at" in results[r]["text"]


def test_a_killed_rank_ends_every_survivor_naming_its_peer(fault_file):
    results, codes = run_faulty(worker, 4, "kill", 4, fault_file)
    # neighbours see the closed connection to rank 2; rank 0 learns it from rank 1
    expect = {r: rf"(instruction \w+\] rank {r} failed to (send to|receive from) rank 2.*closed"
                 rf"|rank [13] failed first.*rank 2.*rank {r} (was waiting to|then failed too))"
              for r in (0, 1, 3)}
    _check("peer SIGKILLed", results, codes, fault_file, expect, dead=(2,))


def test_the_store_hosts_death_is_named_not_its_closed_connection(fault_file):
    # a raw env:// launch (no torchrun agent): rank 0 serves the store, so killing it
    # closes the store too; every survivor names rank 0 (not "connection closed")
    results, codes = run_faulty(worker, 2, "kill-first", 2, fault_file, tcp_store=True)
    expect = {r: r"^\[rank 0, train step 2 \(1-based\)\] the store's host, rank 0, is gone: rank 0 died "
                 r"or failed first \(the store connection failed: .*\n  how to fix: rank 0: "
                 r"look at its log and exit code; under torchrun the agent hosts the store "
                 r"instead, and --max-restarts restarts a job that lost a rank"
              for r in (1,)}
    _check("store host SIGKILLed", results, codes, fault_file, expect, dead=(0,))
    for r in (1,):
        assert (results[r]["type"], results[r]["rank"]) == ("PeerAbort", 0)


def test_configuration_mismatch_is_an_error_on_every_rank(fault_file):
    results, codes = run_faulty(worker, 4, "config", 4, fault_file)
    pattern = r"disagree on their configuration.*micro_batches: 4 on ranks 0, 1, 3; 3 on rank 2"
    _check("micro_batches mismatch", results, codes, fault_file,
           {r: pattern for r in range(4)})


def test_iterator_running_out_on_the_first_stage_only(fault_file):
    results, codes = run_faulty(worker, 4, "short-iter", 4, fault_file)
    expect = {r: r"rank 0 failed first \(stage 0, train step 2 \(1-based\), schedule step \d+, "
                 r"micro-batch 2.*DataError.*ran out"
              for r in (1, 2, 3)}
    expect[0] = (r"\[rank 0, stage 0, train step 2 \(1-based\), schedule step \d+, micro-batch 2, "
                 r"instruction LOAD2\].*ran out")
    _check("first stage's iterator runs out", results, codes, fault_file, expect)


def test_labels_of_the_wrong_structure_on_the_last_stage(fault_file):
    results, codes = run_faulty(worker, 4, "bad-labels", 4, fault_file)
    expect = {r: r"rank 3 failed first \(stage 3, train step 2 \(1-based\), schedule step \d+, "
                 r"micro-batch 0.*loss_fn" for r in range(3)}
    expect[3] = (r"\[rank 3, stage 3, train step 2 \(1-based\), schedule step \d+, micro-batch 0.*"
                 r"loss_fn\(outputs, labels\) failed")
    _check("wrong label structure", results, codes, fault_file, expect)


def test_loaders_shuffled_differently_are_caught(fault_file):
    results, codes = run_faulty(worker, 2, "shuffled", 2, fault_file)
    expect = {0: r"rank 1 failed first.*micro-batch 0.*DataError.*fingerprints differ",
              1: r"\[rank 1, stage 1, train step 1 \(1-based\), schedule step 0, micro-batch 0.*"
                 r"micro-batch 0: the labels the last "
                 r"stage read are not the ones the first stage read"}
    _check("loaders shuffled differently", results, codes, fault_file, expect)


def test_a_nan_loss_is_an_error_naming_step_micro_batch_and_stage(fault_file):
    results, codes = run_faulty(worker, 2, "nonfinite", 2, fault_file)
    pattern = r"loss is NaN/inf at train step 2 \(1-based\) .*micro-batch\(es\) \[2\] .*stage 1"
    _check("NaN loss", results, codes, fault_file, {0: pattern, 1: pattern})


def test_a_nan_loss_can_skip_the_step_on_every_rank(fault_file):
    results, _ = run_faulty(worker, 2, "nonfinite-skip", 2, fault_file)
    for r in (0, 1):
        assert results[r]["ok"] and results[r]["skipped"] == 1, results[r]
        losses = results[r]["losses"]
        assert losses[1] != losses[1] and losses[0] == losses[0] and losses[2] == losses[2]


def test_an_output_shape_that_changes_mid_batch_just_works(fault_file):
    # stage 2's output is wider for micro-batch 2 of every step: the metadata is
    # exchanged again automatically, and the next stage slices it back
    results, codes = run_faulty(worker, 4, "reshape", 4, fault_file)
    assert all(results[r]["ok"] for r in range(4)), results
    assert len({tuple(results[r]["losses"]) for r in range(4)}) == 1
    assert all(c == 0 for c in codes.values())


# -- Ctrl-C / SIGTERM and what a local job exposes --------------------------------------------
LAUNCH_SCRIPT = textwrap.dedent("""
    import os, sys, time, torch
    from torch import nn
    import pipekernel as pk

    def worker(directory):
        open(os.path.join(directory, f"pid{os.environ['RANK']}"), "w").write(str(os.getpid()))
        layers = [pk.LayerSpec(nn.Linear, 8, 8) for _ in range(2)]
        engine = pk.PipelineEngine(pk.PipelineModule(layers, loss_fn=nn.MSELoss(),
                                                     num_stages=2, seed=1),
                                   optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
                                   micro_batches=2, timeout=60)
        step = 0
        while True:  # until stopped
            torch.manual_seed(step)  # both stages read the same micro-batches
            engine.train_batch(iter([(torch.randn(4, 8), torch.randn(4, 8))] * 2))
            step += 1
            if step == 2:
                open(os.path.join(directory, f"ready{os.environ['RANK']}"), "w").close()
            if os.environ["RANK"] == "1":
                time.sleep(0.05)

    if __name__ == "__main__":
        try:
            pk.launch(worker, 2, (sys.argv[1],), timeout=300)
        except Exception as err:  # a host that catches errors must still stop on SIGTERM
            print("carried on after", type(err).__name__, flush=True)
            time.sleep(120)
""")


def test_sigterm_to_the_launcher_ends_every_worker(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(LAUNCH_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240  # two workers importing torch on a loaded machine
        while not all((tmp_path / f"ready{r}").exists() for r in range(2)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0 and "carried on" not in out, out
    assert "LaunchInterrupted: launch terminated by SIGTERM: stopped ranks [0, 1]" in err, \
        err[-3000:]
    assert took < 30, took  # the launcher gives its workers 5 s, then kills them
    # a killed worker may take a moment to be reaped on a loaded machine; a zombie holds
    # nothing but its process-table entry
    deadline = time.monotonic() + 30
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if _running(pid)]
        time.sleep(0.1)
    assert not alive, f"workers {alive} outlived the launcher"


def _running(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _listening_sockets():
    """(local address, port) of every listening TCP socket this process holds (Linux)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # LISTEN
                addr, port = local.split(":")
                found.append((addr, int(port, 16)))
    return found


def sockets_worker():
    engine = pk.PipelineEngine(model(2), optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
                               micro_batches=2, timeout=60)
    engine.train_batch(iter(data(0, 2)))
    found = _listening_sockets()
    engine.close()
    return found


LOOPBACK = {"0100007F", "00000000000000000000000001000000",  # 127.0.0.1, ::1
            "0000000000000000FFFF00000100007F"}  # ::ffff:127.0.0.1


@pytest.mark.skipif(not os.path.exists("/proc/self/net/tcp"), reason="needs Linux /proc")
def test_a_local_job_listens_on_loopback_only():
    for rank, found in enumerate(pk.launch(sockets_worker, 2, timeout=300)):
        outside = [(a, p) for a, p in found if a not in LOOPBACK]
        assert not outside, f"rank {rank} listens beyond loopback: {outside} (all: {found})"


def teardown_module(module):
    if FIGURES:
        worst = max(f[3] for f in FIGURES)
        print(f"\n[faults] {len(FIGURES)} faults injected, "
              f"{sum(f[2] for f in FIGURES)} rank errors named, worst {worst:.2f}s")


def test_a_transport_failure_after_a_published_abort_reports_the_abort():
    # a send or a collective that fails because the failing rank closed its connections
    # (no wait checked the store in between) is reported as that rank's failure
    import types

    from pipekernel.errors import PeerAbort, TransportError
    from pipekernel.engine.faults import AbortBoard, root_cause

    store = torch.distributed.HashStore()
    failing = AbortBoard(store, "pipekernel/e0", rank=2)
    failing.publish(pk.InstructionError("ValueError in the handler of F1: boom", rank=2,
                                        stage=2, micro_batch=1, instruction="F1"))
    me = types.SimpleNamespace(abort_board=AbortBoard(store, "pipekernel/e0", rank=1), rank=1,
                               transport=None)
    err = TransportError("rank 1 failed to send to rank 2: Connection closed by peer",
                         rank=1, instruction="SEND_F1")
    cause = root_cause(err, me.transport, me.abort_board, me.rank)
    assert isinstance(cause, PeerAbort) and (cause.rank, cause.micro_batch) == (2, 1)
    assert "rank 2 failed first" in str(cause)
    assert "rank 1 then failed too at SEND_F1: rank 1 failed to send to rank 2" in str(cause)
    other = ValueError("not a transport failure")
    assert root_cause(other, me.transport, me.abort_board, me.rank) is other
    quiet = types.SimpleNamespace(abort_board=AbortBoard(torch.distributed.HashStore(),
                                                         "pipekernel/e0", rank=1), rank=1,
                                  transport=None)
    assert root_cause(err, quiet.transport, quiet.abort_board, quiet.rank) is err  # nothing published: itself
