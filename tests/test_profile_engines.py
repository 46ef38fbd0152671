"""benchmarks/profile_engines.py: how collapsed py-spy stacks are sorted into components
(issue 29, item 6). The stacks are shaped like the ones py-spy 0.4.3 writes with
``--format raw --threads --full-filenames`` for both engines of benchmarks/vs_torch.py."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import profile_engines as pe  # noqa: E402

R = "/checkout"
SITE = "/checkout/.venv/lib/python3.11/site-packages"   # the venv inside the checkout
STDLIB = "/usr/lib/python3.11"
DRIVER = [("_worker", f"{R}/pipekernel/launcher/launch.py"),
          ("worker", f"{R}/benchmarks/profile_engines.py")]
PK = DRIVER + [("PK.step", f"{R}/benchmarks/vs_torch.py"),
               ("PipelineEngine.train_batch", f"{R}/pipekernel/engine/engine.py"),
               ("Kernel.run", f"{R}/pipekernel/kernel/loop.py")]
TORCH = DRIVER + [("Torch.step", f"{R}/benchmarks/vs_torch.py"),
                  ("_ScheduleForwardOnly.step",
                   f"{SITE}/torch/distributed/pipelining/schedules.py"),
                  ("Schedule1F1B._step_microbatches",
                   f"{SITE}/torch/distributed/pipelining/schedules.py")]
BACKWARD = [("backward", f"{SITE}/torch/autograd/__init__.py"),
            ("_engine_run_backward", f"{SITE}/torch/autograd/graph.py")]
LAYER = [("Module._wrapped_call_impl", f"{SITE}/torch/nn/modules/module.py"),
         ("Module._call_impl", f"{SITE}/torch/nn/modules/module.py"),
         ("CausalBlock.forward", f"{R}/benchmarks/vs_torch.py"),
         ("multi_head_attention_forward", f"{SITE}/torch/nn/functional.py")]


def stack(frames, thread: str = "MainThread") -> str:
    return ";".join([f"thread (7): {thread}"] + [f"{n} ({p}:1)" for n, p in frames])


CASES = [
    ("pk", PK + [("StageRuntime.backward", f"{R}/pipekernel/stage/runtime.py")] + BACKWARD,
     "autograd backward"),
    ("pk", PK + [("StageRuntime.forward", f"{R}/pipekernel/stage/runtime.py"),
                 ("_run_calls", f"{R}/pipekernel/model/module.py")] + LAYER,
     "layer forwards"),
    ("pk", PK + [("StageRuntime.forward", f"{R}/pipekernel/stage/runtime.py"),
                 ("_run_calls", f"{R}/pipekernel/model/module.py"),
                 ("Module._call_impl", f"{SITE}/torch/nn/modules/module.py"),
                 ("CausalBlock.forward", f"{R}/benchmarks/vs_torch.py")],
     "layer forwards"),
    ("pk", PK + [("StageRuntime.forward", f"{R}/pipekernel/stage/runtime.py"),
                 ("_run_calls", f"{R}/pipekernel/model/module.py")], "pk stage runtime"),
    ("pk", PK + [("StageRuntime.loss", f"{R}/pipekernel/stage/loss.py"),
                 ("loss_fn", f"{R}/benchmarks/vs_torch.py"),
                 ("cross_entropy", f"{SITE}/torch/nn/functional.py")], "loss"),
    ("pk", PK[:-1] + [("Precision.step", f"{R}/pipekernel/step/precision.py"),
                      ("AdamW.step", f"{SITE}/torch/optim/adamw.py"),
                      ("_use_grad", f"{SITE}/torch/optim/optimizer.py")], "optimizer"),
    ("pk", PK + [("StageRuntime._post_group", f"{R}/pipekernel/stage/runtime.py"),
                 ("TorchDistributedTransport.batch_isend_irecv", f"{R}/transports/gloo.py"),
                 ("TorchDistributedTransport._post", f"{R}/transports/gloo.py"),
                 ("isend", f"{SITE}/torch/distributed/distributed_c10d.py")], "pk posting"),
    ("pk", PK + [("Channel.send_ops", f"{R}/pipekernel/comm/wire.py")], "pk wire"),
    ("pk", PK + [("Channel.finish", f"{R}/pipekernel/comm/wire.py"),
                 ("_Handle.wait", f"{R}/transports/gloo.py"),
                 ("wait_sliced", f"{R}/pipekernel/comm/transport.py"),
                 ("Event.wait", f"{STDLIB}/threading.py")],
     "pk waits: handle, wait_sliced, submit"),
    ("pk", PK + [("Channel.finish", f"{R}/pipekernel/comm/wire.py"),
                 ("_Handle.wait", f"{R}/transports/gloo.py"),
                 ("_Waiter.submit", f"{R}/transports/gloo.py"),
                 ("_Box.__init__", f"{R}/transports/gloo.py")],
     "pk waits: handle, wait_sliced, submit"),
    ("pk", PK + [("Channel.finish", f"{R}/pipekernel/comm/wire.py"),
                 ("_Handle.__init__", f"{R}/transports/gloo.py")], "pk posting"),
    ("pk", PK + [("Kernel._next", f"{R}/pipekernel/kernel/loop.py")], "pk kernel loop"),
    ("pk", PK[:-1] + [("BatchStep._mean_loss", f"{R}/pipekernel/step/optimizer_step.py"),
                      ("TorchDistributedTransport.all_reduce", f"{R}/transports/gloo.py"),
                      ("TorchDistributedTransport._collective", f"{R}/transports/gloo.py"),
                      ("wrapper", f"{SITE}/torch/distributed/c10d_logger.py"),
                      ("all_reduce", f"{SITE}/torch/distributed/distributed_c10d.py")],
     "pk collectives"),
    ("pk", PK[:-1] + [("BatchStep.mean_loss", f"{R}/pipekernel/step/optimizer_step.py")],
     "pk engine/step"),
    ("pk", PK + [("lane", f"{R}/pipekernel/grid/expert_parallel.py")], "pk other"),
    ("torch", TORCH + [("_PipelineStageBase.backward_one_chunk",
                        f"{SITE}/torch/distributed/pipelining/stage.py"),
                       ("stage_backward", f"{SITE}/torch/distributed/pipelining/_backward.py")]
     + BACKWARD, "autograd backward"),
    ("torch", TORCH + [("_batch_p2p", f"{SITE}/torch/distributed/pipelining/schedules.py"),
                       ("batch_isend_irecv", f"{SITE}/torch/distributed/distributed_c10d.py"),
                       ("_coalescing_manager", f"{SITE}/torch/distributed/distributed_c10d.py"),
                       ("_get_default_group", f"{SITE}/torch/distributed/distributed_c10d.py")],
     "torch posting"),
    ("torch", TORCH + [("_wait_batch_p2p", f"{SITE}/torch/distributed/pipelining/schedules.py")],
     "torch waits"),
    ("torch", TORCH + [("_PipelineStageBase.get_fwd_send_ops",
                        f"{SITE}/torch/distributed/pipelining/stage.py")],
     "torch schedule/stage code"),
    ("torch", TORCH[:3] + [("batch", f"{R}/benchmarks/vs_torch.py")], "benchmark driver"),
    ("torch", TORCH[:3] + [("barrier", f"{SITE}/torch/distributed/distributed_c10d.py")],
     "benchmark driver"),
    ("torch", [("<module>", "<string>"), ("main", f"{STDLIB}/multiprocessing/forkserver.py")],
     "other"),
]


@pytest.mark.parametrize("engine,frames,component", CASES,
                         ids=[f"{e}-{c}-{i}" for i, (e, _, c) in enumerate(CASES)])
def test_classify(engine, frames, component):
    assert pe.classify(stack(frames), R, engine)[0] == component


def test_the_waiter_thread_is_its_own_row():
    frames = [("Thread._bootstrap", f"{STDLIB}/threading.py"),
              ("Thread.run", f"{STDLIB}/threading.py"),
              ("_Waiter._loop", f"{R}/transports/gloo.py"),
              ("Event.set", f"{STDLIB}/threading.py")]
    component, leaf = pe.classify(stack(frames, "pipekernel-wait-rank0"), R, "pk")
    assert component == "pk waits: waiter thread"
    assert leaf.startswith("Event.set (")


def test_unclassified_reports_its_leaf():
    frames = [("<module>", "<string>"), ("main", f"{STDLIB}/multiprocessing/forkserver.py")]
    assert pe.classify(stack(frames), R, "pk") == ("other", f"main ({STDLIB}/multiprocessing/"
                                                            "forkserver.py:1)")


def test_report_side_by_side(tmp_path):
    """Shares per engine and rank from the files of a run, as ``--from`` prints them."""
    lines = {("pk", 0): [(PK + BACKWARD, 3), (PK + [("_post", f"{R}/transports/gloo.py")], 1)],
             ("pk", 1): [(PK + BACKWARD, 1)],
             ("torch", 0): [(TORCH + [("_wait_batch_p2p", f"{SITE}/torch/distributed/"
                                      "pipelining/schedules.py")], 1), (TORCH + BACKWARD, 1)],
             ("torch", 1): [(TORCH + LAYER, 2)]}
    metas = []
    for engine, schedule in (("pk", "1f1b"), ("torch", "1F1B")):
        tag = f"{engine}-{schedule}"
        for rank in (0, 1):
            text = "".join(f"{stack(f)} {n}\n" for f, n in lines[engine, rank])
            (tmp_path / f"{tag}.rank{rank}.txt").write_text(text)
        metas.append({"engine": engine, "schedule": schedule, "tag": tag, "rate": 200,
                      "window": 2.0, "root": R, "load_before": [0.1, 0.2, 0.3],
                      "load_after": [0.4, 0.5, 0.6],
                      "ranks": [{"rank": r, "steps": 4, "elapsed": 2.0} for r in (0, 1)]})
    (tmp_path / "meta.json").write_text(json.dumps(metas))
    text = pe.report(tmp_path, metas)
    rows = {line.split(" | ")[0].lstrip("| "): line.rstrip(" |").split(" | ")[1:]
            for line in text.splitlines() if line.startswith("| ")}
    assert rows["autograd backward"] == ["75.0", "100.0", "50.0", "0.0"]
    assert rows["layer forwards"] == ["0.0", "0.0", "0.0", "100.0"]
    assert rows["pk posting"] == ["25.0", "0.0", "—", "—"]
    assert rows["torch waits"] == ["—", "—", "50.0", "0.0"]
    assert rows["**engine machinery, total**"] == ["**25.0**", "**0.0**", "**50.0**", "**0.0**"]
    assert rows["busy samples"] == ["4", "1", "2", "2"]
    assert "pk waits: waiter thread" not in rows  # nothing there: the row is left out
    assert "- pk-1f1b: 0.10, 0.20, 0.30 / 0.40, 0.50, 0.60" in text
