"""The monitor plugin: sinks write what they promise, the measured bubble matches the
simulator, and a stuck pipeline says which rank is stuck where."""
from __future__ import annotations

import csv
import io
import json
import os
import signal
import threading
import time
import types

import pytest
import torch
from models import mlp, mlp_data, sgd
from torch import nn

import pipekernel as pk
from pipekernel.errors import PipelineError, TransportTimeout, UnknownNameError
from pipekernel.schedules.instructions import Backward, Forward, RecvActivation, RecvGrad
from pipekernel.extend.manager import entry_points
from pipekernel.plugins.monitor import Monitor, format_positions
from pipekernel.plugins.sinks import SINKS_GROUP, Sink, flatten_record, make_sink
from pipekernel.schedules import OneFOneB, simulate
from pipekernel.testing import run_ranks

STEPS, MICRO = 3, 4


class ListSink(Sink):
    """A custom sink object: keeps the records it was given."""

    name = "list"

    def __init__(self):
        self.records, self.closed = [], False

    def write(self, record):
        self.records.append(record)

    def close(self, monitor, trace_events):
        self.closed = True


def sinks_worker(out_dir):
    console = io.StringIO()
    custom = ListSink()
    mon = Monitor(out_dir=out_dir, sinks=("console", "csv", "jsonl", "trace", custom), every=2,
                  sink_options={"console": {"stream": console}})
    engine = pk.PipelineEngine(mlp(num_stages=2), optimizer=sgd, micro_batches=MICRO,
                               plugins=[mon], timeout=60)
    losses = [engine.train_batch(iter(mlp_data(step, 0, MICRO))).item() for step in range(STEPS)]
    engine.eval_batch(iter(mlp_data(99, 0, MICRO)))
    summary = mon.stage_summary()
    gathered = mon.gather()
    engine.close()  # closes the monitor (collective), then the transport
    steps = [[str(i) for i in step]
             for step in OneFOneB(2, engine.stage, MICRO).steps()]
    return dict(losses=losses, summary=summary, gathered=gathered, paths=dict(mon.paths),
                console=console.getvalue(), records=custom.records, closed=custom.closed,
                trace_events=mon.trace_events,
                schedule=[name for step in steps for name in step], stage=engine.stage)


def test_sinks_write_what_they_promise(tmp_path):
    out = str(tmp_path / "out")
    results = run_ranks(sinks_worker, 2, out)
    r0, r1 = results
    losses = r0["losses"]
    assert set(r0["paths"]) >= {"csv", "jsonl", "trace", "summary"}
    assert r1["paths"] == {}, "sinks run on rank 0 only"

    # console: every 2 steps, on rank 0 only
    lines = r0["console"].strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("step     2") and "bubble" in lines[0]
    assert r1["console"] == ""

    # CSV: a header and one row per step with the loss and per-rank columns
    with open(r0["paths"]["csv"]) as f:
        rows = list(csv.DictReader(f))
    assert [int(row["step"]) for row in rows] == [1, 2, 3]
    assert [float(row["loss"]) for row in rows] == pytest.approx(losses, rel=1e-6)
    for row in rows:
        assert int(row["samples"]) == MICRO * 4 and int(row["tokens"]) == MICRO * 4 * 8
        for rank in (0, 1):
            assert int(row[f"rank{rank}_stage"]) == rank
            assert float(row[f"rank{rank}_forward_s"]) > 0
            assert float(row[f"rank{rank}_step_s"]) > 0
            assert 0 <= float(row[f"rank{rank}_bubble_fraction"]) < 1
        assert float(row["rank0_RecvGrad_s"]) > 0 and float(row["rank0_RecvActivation_s"]) == 0
        assert float(row["rank1_RecvActivation_s"]) > 0 and float(row["rank1_RecvGrad_s"]) == 0
        assert row["skipped"] == "False"

    # JSONL: the full record per step, the same one the custom sink object got
    with open(r0["paths"]["jsonl"]) as f:
        records = [json.loads(line) for line in f]
    assert len(records) == STEPS and records == r0["records"] and r0["closed"]
    for record, loss in zip(records, losses):
        assert record["loss"] == pytest.approx(loss, rel=1e-6)
        assert [r["stage"] for r in record["ranks"]] == [0, 1]
        stage0 = record["ranks"][0]
        assert stage0["wait_s"] == pytest.approx(stage0["instructions"]["RecvGrad"])
        assert record["samples_per_s"] == pytest.approx(record["samples"] / record["step_s"])
        assert record["peak_memory_mb"] > 0

    # trace: one JSON, a track per rank, one slice per instruction per step, in order
    with open(r0["paths"]["trace"]) as f:
        events = json.load(f)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert names == {0: "rank 0 (stage 0)", 1: "rank 1 (stage 1)"}
    slices = [e for e in events if e["ph"] == "X" and e["cat"] != "step"]
    for result in results:
        rank = result["stage"]
        for step in range(1, STEPS + 1):
            mine = sorted((e for e in slices if e["pid"] == rank and e["args"]["step"] == step),
                          key=lambda e: e["ts"])
            assert [e["name"] for e in mine] == result["schedule"]
            assert all(e["args"]["stage"] == rank for e in mine)
            forward = next(e for e in mine if e["name"] == "F1")
            assert forward["cat"] == "Forward" and forward["args"]["micro_batch"] == 1
            assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-3 for a, b in zip(mine, mine[1:]))
        evals = [e for e in slices if e["pid"] == rank and e["args"].get("phase") == "eval"]
        assert [e["name"] for e in evals if e["cat"] == "Forward"] == [f"F{m}" for m in range(MICRO)]
    # clocks are aligned: rank 1 receives F0 after rank 0 finished computing it
    f0 = next(e for e in slices if e["pid"] == 0 and e["name"] == "F0" and e["args"]["step"] == 2)
    recv = next(e for e in slices if e["pid"] == 1 and e["name"] == "RECV_F0"
                and e["args"]["step"] == 2)
    assert recv["ts"] + recv["dur"] >= f0["ts"] + f0["dur"] - 1000  # within 1 ms of skew

    # summaries: this rank's totals; gather() on rank 0 only; summary.json
    assert r1["gathered"] is None
    assert [s["stage"] for s in r0["gathered"]] == [0, 1]
    assert r0["gathered"][1] == r1["summary"]
    assert r0["trace_events"] == events and r1["trace_events"] is None
    for key in ("forward_s", "backward_s", "wait_s", "send_s", "other_s", "step_s",
                "bubble_fraction", "drain_s", "samples_per_s", "tokens_per_s", "peak_memory_mb"):
        assert key in r0["summary"]
    assert r0["summary"]["steps"] == STEPS - 1  # the warm-up step is left out
    assert r0["summary"]["samples"] == (STEPS - 1) * MICRO * 4 and r1["summary"]["samples"] == 0
    with open(r0["paths"]["summary"]) as f:
        assert [s["rank"] for s in json.load(f)["ranks"]] == [0, 1]


def single_rank_worker(out_dir, sinks, tokens_per_sample=None):
    mon = Monitor(out_dir=out_dir, sinks=sinks, tokens_per_sample=tokens_per_sample,
                  heartbeat=0, warmup_steps=0)
    engine = pk.PipelineEngine(mlp(num_stages=1), optimizer=sgd, micro_batches=2, plugins=[mon])
    losses = [engine.train_batch(iter(mlp_data(step, 0, 2))).item() for step in range(STEPS)]
    summary = mon.stage_summary()
    engine.close()
    return losses, summary, dict(mon.paths)


@pytest.mark.parametrize("tokens_per_sample,per_sample", [(None, 8), (5, 5)])
def test_tokens_default_numel_or_per_sample(tmp_path, tokens_per_sample, per_sample):
    _, summary, _ = _single(tmp_path, (), tokens_per_sample)
    samples = STEPS * 2 * 4  # steps x micro-batches x rows
    assert summary["samples"] == samples and summary["tokens"] == samples * per_sample
    assert summary["tokens_per_s"] == pytest.approx(summary["tokens"] / summary["step_s"])


def test_tokens_from_a_function(tmp_path):
    seen = []
    _, summary, _ = _single(tmp_path, (), lambda inputs: seen.append(inputs.shape) or 3)
    assert summary["tokens"] == STEPS * 2 * 3 and seen[0] == (4, 8)


def _single(tmp_path, sinks, tokens_per_sample=None):
    if callable(tokens_per_sample):
        return _in_process(single_rank_worker, str(tmp_path), sinks, tokens_per_sample)
    return run_ranks(single_rank_worker, 1, str(tmp_path), sinks, tokens_per_sample)[0]


def _in_process(fn, *args):
    """Run a one-rank worker in this process (for arguments that do not pickle)."""
    from pipekernel.launcher.launch import free_port
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return fn(*args)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_tensorboard_sink_is_readable(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    losses, _, paths = _single(tmp_path, ("tensorboard",))
    acc = EventAccumulator(paths["tensorboard"])
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"train/loss", "pipeline/bubble_fraction", "train/tokens_per_s",
            "rank0/forward_s"} <= set(tags)
    scalars = acc.Scalars("train/loss")
    assert [s.step for s in scalars] == [1, 2, 3]
    assert [s.value for s in scalars] == pytest.approx(losses, rel=1e-5)


def test_wandb_sink_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    _, _, paths = _single(tmp_path, ("wandb",))
    root = os.path.join(paths["wandb"], "wandb")
    runs = [d for d in os.listdir(root) if d.startswith("offline-run")]
    assert len(runs) == 1, "wandb wrote no offline run"
    logs = [f for f in os.listdir(os.path.join(root, runs[0])) if f.endswith(".wandb")]
    assert logs and os.path.getsize(os.path.join(root, runs[0], logs[0])) > 0


def test_sink_names_and_entry_points():
    assert {"console", "csv", "jsonl", "trace", "tensorboard", "wandb"} <= {
        ep.name for ep in entry_points(SINKS_GROUP)}
    assert make_sink("csv").name == "csv"
    custom = ListSink()
    assert make_sink(custom) is custom
    with pytest.raises(UnknownNameError, match="available sinks: .*csv"):
        make_sink("no-such-sink")
    with pytest.raises(pk.ConfigError):
        Monitor(every=0)
    row = flatten_record({"step": 1, "ranks": [{"rank": 0, "wait_s": 0.5,
                                                "instructions": {"RecvGrad": 0.5}}]})
    assert row == {"step": 1, "rank0_wait_s": 0.5, "rank0_RecvGrad_s": 0.5}


# -- the measured bubble ----------------------------------------------------------------


class _Sleep(torch.autograd.Function):
    """Identity whose forward and backward take a fixed time without using the CPU, so
    two stages on a 2-core machine do not slow each other down (uniform, heavy layers)."""

    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class SleepLayer(nn.Module):
    def __init__(self, forward_s, backward_s):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x):
        return _Sleep.apply(self.lin(x), self.forward_s, self.backward_s)


def bubble_worker(micro_batches, steps, forward_s, backward_s):
    layers = [pk.LayerSpec(SleepLayer, forward_s / 2, backward_s / 2) for _ in range(4)]
    module = pk.PipelineModule(layers, loss_fn=nn.MSELoss(), num_stages=2,
                               partition="uniform", seed=1)
    mon = Monitor(sinks=(), heartbeat=0, warmup_steps=1)
    engine = pk.PipelineEngine(module, optimizer=sgd, micro_batches=micro_batches,
                               schedule="1f1b", plugins=[mon], timeout=60)
    g = torch.Generator().manual_seed(0)  # the same micro-batches on both stages
    data = [(torch.randn(2, 4, generator=g), torch.randn(2, 4, generator=g))
            for _ in range(micro_batches)]
    for _ in range(steps):
        engine.train_batch(iter(data))
    return mon.stage_summary()


class FakeClock:
    """Host seconds that move only when the test moves them."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def replay(monitor, clock, result, stage):
    """Drive ``monitor`` through one training step of ``stage`` as the simulator timed it:
    each compute instruction at its simulated start and end, the gap before it in the
    receive it waited on (or in the instruction right before it), the rest instant, and
    the end of the step at the makespan."""
    timed = iter(result.timeline[stage])
    stream = [ins for step in result.steps[stage] for ins in step]
    engine = types.SimpleNamespace(
        transport=types.SimpleNamespace(world_size=1, device=torch.device("cpu")), rank=0,
        stage=stage, topology=types.SimpleNamespace(data_rank=0), is_first_stage=lambda: False,
        instruction_types=tuple({type(i): None for i in stream}))  # the EngineView field
    monitor.pipekernel_configure(engine)
    monitor.pipekernel_before_train_batch(engine)
    upcoming = next(timed, None)
    for n, ins in enumerate(stream):
        begin = clock.now
        if upcoming is not None and ins is upcoming[2]:
            clock.now = begin = upcoming[0]
            end, upcoming = upcoming[1], next(timed, None)
        else:  # the gap before the next compute goes into what runs last before it
            nxt = stream[n + 1] if n + 1 < len(stream) else None
            waits_here = isinstance(ins, (RecvActivation, RecvGrad)) or (
                upcoming is not None and nxt is upcoming[2])
            end = upcoming[0] if waits_here and upcoming is not None else begin
        monitor.pipekernel_before_instruction(ins)
        clock.now = end
        monitor.pipekernel_after_instruction(ins, end - begin)
    clock.now = result.makespan
    monitor.pipekernel_after_train_batch(engine, None, {"step": 1})
    return monitor.stage_summary()


@pytest.mark.parametrize("micro_batches", [4, 8])
def test_measured_bubble_is_the_simulators_on_an_injected_clock(micro_batches):
    """The monitor's bubble (waits + drain over the step) is the simulator's, to rounding,
    when the instructions take the times the simulator gave them: no sleeps, no tolerance."""
    result = simulate(OneFOneB, 2, micro_batches, costs={Forward: 1.0, Backward: 2.0})
    assert result.bubble_fraction == pytest.approx((2 - 1) / (micro_batches + 2 - 1))
    summaries = []
    for stage in range(2):
        clock = FakeClock()
        summaries.append(replay(Monitor(sinks=(), heartbeat=0, warmup_steps=0, clock=clock),
                                clock, result, stage))
    measured = sum(s["bubble_fraction"] for s in summaries) / len(summaries)
    assert measured == pytest.approx(result.bubble_fraction, abs=1e-12)
    for s in summaries:
        assert s["forward_s"] == micro_batches and s["backward_s"] == 2 * micro_batches
        assert s["step_s"] == result.makespan
    # the bubble is receive waits: stage 0 waits for gradients, stage 1 for inputs
    assert summaries[0]["instructions"]["RecvGrad"] > 0
    assert summaries[1]["instructions"]["RecvActivation"] > 0


def test_a_real_pipeline_measures_its_bubble_in_its_receives():
    summaries = run_ranks(bubble_worker, 2, 4, 3, 0.02, 0.04)
    for s in summaries:
        assert 0 < s["bubble_fraction"] < 1 and s["wait_s"] > 0
    assert summaries[0]["instructions"]["RecvGrad"] > 0
    assert summaries[1]["instructions"]["RecvActivation"] > 0


# -- hang diagnostics ------------------------------------------------------------------


class Stall(nn.Module):
    """Sleeps ``seconds`` on its first forward: a rank that is stuck computing."""

    def __init__(self, seconds):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.seconds, self.calls = seconds, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 1:
            time.sleep(self.seconds)
        return self.lin(x)


def stalled_module(num_stages, stall_s):
    layers = [pk.LayerSpec(nn.Linear, 8, 8) for _ in range(num_stages)]
    layers[1] = pk.LayerSpec(Stall, stall_s)  # on stage 1
    return pk.PipelineModule(layers, loss_fn=nn.MSELoss(), num_stages=num_stages,
                             partition=list(range(num_stages + 1)), seed=3)


def hang_worker(out_dir, num_stages, stall_s, timeout):
    mon = Monitor(out_dir=out_dir, sinks=(), heartbeat=0.1)
    # built with a generous timeout (start-up collectives under load can take seconds);
    # the short timeout applies to the training step only (a transport's timeout may
    # change between waits)
    engine = pk.PipelineEngine(stalled_module(num_stages, stall_s), optimizer=sgd,
                               micro_batches=2, plugins=[mon], timeout=60)
    engine.transport.timeout = timeout
    g = torch.Generator().manual_seed(0)  # the same micro-batches on every stage
    data = [(torch.randn(2, 8, generator=g), torch.randn(2, 8, generator=g)) for _ in range(2)]
    try:
        engine.train_batch(iter(data))
    except PipelineError as err:
        # pk.launch hosts the key-value store in rank 0: keep it up until the other
        # timed-out rank has read the positions (torchrun's agent hosts it instead)
        time.sleep(1.0 if engine.rank == 0 else 0)
        return dict(text=str(err), type=type(err).__name__, peer=getattr(err, "peer", None),
                    instruction=str(err.instruction), stage=engine.stage)
    return dict(text="", type=None, stage=engine.stage)


def test_receive_timeout_names_instruction_peer_and_every_position(tmp_path):
    out = str(tmp_path)
    # the stall outlasts the 2 s timeout by 6 s: start-up skew between ranks under load
    # stays far below that
    results = run_ranks(hang_worker, 3, out, 3, 8.0, 2.0, timeout=300)
    first, stuck, last = results
    # stage 0 waits for stage 1's gradient, stage 2 for its activation: both time out
    assert first["type"] == TransportTimeout.__name__ and first["peer"] == 1
    assert first["instruction"] == "RECV_B0" and "receive from rank 1" in first["text"]
    assert last["type"] == TransportTimeout.__name__ and last["peer"] == 1
    assert last["instruction"] == "RECV_F0"
    for result, mine in ((first, "RECV_B0 (RecvGrad) waiting"),
                         (last, "RECV_F0 (RecvActivation) waiting")):
        text = result["text"]
        assert "[rank {0}, stage {0}".format(result["stage"]) in text
        assert "pipeline positions" in text
        assert "rank 1 (stage 1" in text and "F0 (Forward) running" in text  # the stuck one
        assert mine in text
    # the stuck rank fails later, on its next transfer, naming its instruction and peer
    assert stuck["type"] == "TransportError" and stuck["instruction"] in ("SEND_F0", "RECV_B0")
    assert "rank 1 failed to" in stuck["text"]
    assert "positions" in open(os.path.join(out, "hang-rank0.txt")).read()
    assert os.path.exists(os.path.join(out, "hang-rank2.txt"))


def signal_worker(out_dir, stall_s):
    mon = Monitor(out_dir=out_dir, sinks=(), heartbeat=0.1)
    engine = pk.PipelineEngine(stalled_module(2, stall_s), optimizer=sgd, micro_batches=2,
                               plugins=[mon], timeout=60)
    g = torch.Generator().manual_seed(0)  # the same micro-batches on every stage
    data = [(torch.randn(2, 8, generator=g), torch.randn(2, 8, generator=g)) for _ in range(2)]
    if engine.rank == 0:  # poke ourselves while the main thread is blocked in a receive
        threading.Timer(stall_s / 2, os.kill, (os.getpid(), signal.SIGUSR1)).start()
    engine.train_batch(iter(data))
    engine.close()
    return mon.paths.get("positions-rank0")


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="needs SIGUSR1 (POSIX)")
def test_sigusr1_dumps_every_rank_position_while_blocked(tmp_path):
    path = run_ranks(signal_worker, 2, str(tmp_path), 6.0, timeout=300)[0]
    text = open(path).read()
    assert "RECV_B0 (RecvGrad) waiting" in text  # written while rank 0 was blocked
    assert "rank 1 (stage 1" in text and "F0 (Forward) running" in text


def test_format_positions_reports_missing_and_stale_ranks():
    now = time.time()
    text = format_positions({0: {"stage": 0, "host": "h", "pid": 1, "train_step": 4,
                                 "schedule_step": 2, "instruction": "RECV_B1",
                                 "type": "RecvGrad", "state": "waiting", "seconds": 12.0,
                                 "updated": now - 3}}, seen_from=0, world_size=2)
    assert "train step 4 (1-based), schedule step 2, RECV_B1 (RecvGrad) waiting for 12.0s" in text
    assert "as of 3.0s ago" in text and "ranks [1]: no position available" in text


def skipped_worker(out_dir):
    # fp16 with a loss scale far too large: the first steps overflow and are skipped
    # while the scale backs off, then steps are taken
    mon = Monitor(out_dir=out_dir, sinks=("jsonl",), heartbeat=0, warmup_steps=0)
    engine = pk.PipelineEngine(mlp(num_stages=1), optimizer=sgd, micro_batches=2,
                               precision="fp16", precision_options={"init_scale": 2.0 ** 20},
                               plugins=[mon])
    for step in range(8):
        engine.train_batch(iter(mlp_data(step, 0, 2)))
    engine.close()
    with open(mon.paths["jsonl"]) as f:
        records = [json.loads(line) for line in f]
    return records, mon.stage_summary()["skipped_steps"], engine.skipped_steps


def test_skipped_steps_and_precision_metrics_are_reported(tmp_path):
    records, count, engine_count = run_ranks(skipped_worker, 1, str(tmp_path))[0]
    skipped = [r["skipped"] for r in records]
    assert skipped[0] and not all(skipped), skipped
    assert sum(skipped) == count == engine_count
    scales = [r["loss_scale"] for r in records]  # extra metrics of the step are kept
    assert scales[1] < scales[0]


def replicated_worker(out_dir):
    mon = Monitor(out_dir=out_dir, sinks=(), every=1, warmup_steps=0)
    engine = pk.PipelineEngine(mlp(num_stages=2), optimizer=sgd, micro_batches=MICRO,
                               data_parallel_size=2, plugins=[mon],
                               timeout=60)
    for step in range(2):
        engine.train_batch(iter(mlp_data(step, engine.data_parallel_rank, MICRO)))
    summary = mon.stage_summary()
    engine.close()
    return summary


def test_the_monitor_times_the_data_parallel_reducers_instructions(tmp_path):
    """Under data parallelism the reducer's arm and launch points are instructions: the
    monitor times each (per class, on every rank) and counts them in ``reduce_s``."""
    for summary in run_ranks(replicated_worker, 4, str(tmp_path), timeout=240):
        spent = summary["instructions"]
        assert {"ArmGradReduce", "LaunchGradReduce", "ReduceGrads"} <= set(spent)
        assert spent["ArmGradReduce"] > 0 and spent["LaunchGradReduce"] > 0
        assert summary["reduce_s"] == pytest.approx(
            sum(spent[k] for k in ("ReduceTiedGrads", "ArmGradReduce", "LaunchGradReduce",
                                   "ReduceGrads") if k in spent))
