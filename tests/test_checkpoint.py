"""Checkpoints: round trips across shapes, bit-exact resume, atomic saves, clear errors."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from models import adam, mlp, mlp_data
from sweep import Sweep
from torch import nn

import pipekernel as pk
from pipekernel.model.module import StageModule
from pipekernel.engine import checkpoint as ckpt
from pipekernel.launcher.launch import RankError
from pipekernel.testing import assert_parity, reference_eval, reference_train, run_ranks

MB = 2  # micro-batches per step


def dropout_mlp(num_stages=None):
    layers = [pk.LayerSpec(nn.Linear, 8, 16), pk.LayerSpec(nn.Dropout, 0.3),
              pk.LayerSpec(nn.Linear, 16, 16), torch.tanh,
              pk.LayerSpec(nn.Dropout, 0.3), pk.LayerSpec(nn.Linear, 16, 4)]
    return pk.PipelineModule(layers, loss_fn=nn.MSELoss(), num_stages=num_stages,
                             partition="uniform", seed=5)


def _engine(stages, dp, schedule="1f1b", chunks=None, precision="fp32", build=mlp,
            transport="gloo", **kw):
    partition = {} if build is dropout_mlp else {"partition": "uniform"}
    module = build(num_stages=stages, **partition)
    return pk.PipelineEngine(module, optimizer=adam, micro_batches=MB, schedule=schedule,
                             chunks=chunks, data_parallel_size=dp, precision=precision,
                             transport=transport, timeout=60, **kw)


def _state(engine):
    return {k: v.detach().float().cpu() for k, v in engine.module.state_dict().items()}


def worker(root, stages, dp, steps, schedule="1f1b", chunks=None, load=False, save=False,
           precision="fp32", build="mlp", more=0, transport="gloo"):
    """Optionally load, train ``steps`` (a range of step numbers), optionally save, then
    optionally train ``more`` steps; returns losses, weights, where, and the scale."""
    engine = _engine(stages, dp, schedule, chunks, precision,
                     build=dropout_mlp if build == "dropout" else mlp, transport=transport,
                     precision_options={"init_scale": 2.0 ** 8, "growth_interval": 2}
                     if precision == "fp16" else None)
    info = engine.load_checkpoint(root) if load else None
    losses = [engine.train_batch(iter(mlp_data(s, engine.data_parallel_rank, MB))).item()
              for s in steps]
    if save:
        engine.save_checkpoint(root, client_state={"note": "hi"})
    last = steps[-1] + 1 if steps else 0
    losses += [engine.train_batch(iter(mlp_data(s, engine.data_parallel_rank, MB))).item()
               for s in range(last, last + more)]
    out = {"losses": losses, "state": _state(engine), "stage": engine.stage,
           "steps": engine.global_steps, "metrics": engine.precision.metrics(),
           "info": None if info is None else {k: info[k] for k in
                                               ("global_steps", "exact", "client_state")}}
    engine.close()
    return out


def _reference(replicas_per_step):
    batches = [[mlp_data(step, r, MB) for r in range(dp)]
               for step, dp in enumerate(replicas_per_step)]
    return reference_train(mlp(), adam, batches, MB)


_SOURCES = {"2": (2, 1, "1f1b", None), "4": (4, 1, "1f1b", None), "2x2": (2, 2, "1f1b", None),
            "interleaved": (2, 1, "interleaved", 2)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints after 2 steps at each source shape (made once, on first use)."""
    made = {}

    def get(name):
        if name not in made:
            stages, dp, schedule, chunks = _SOURCES[name]
            root = str(tmp_path_factory.mktemp(f"ckpt-{name}"))
            run_ranks(worker, stages * dp, root, stages, dp, range(2), schedule, chunks,
                      False, True)
            made[name] = (root, dp)
        return made[name]
    return get


ROUND_TRIPS = Sweep()  # the loads below, one world per world size
#: (source, stages, dp): load a checkpoint saved at ``source``'s shape, train one step; the
#: first argument (the source's name) becomes its directory when the world starts
LOADS = [ROUND_TRIPS.case(f"{source}->{stages}x{dp}", stages * dp, worker, source, stages, dp,
                          range(2, 3), "1f1b", None, True)
         for source, stages, dp in [("2", 2, 1), ("2", 4, 1), ("4", 1, 1), ("2x2", 2, 1),
                                    ("interleaved", 2, 1)]]


@pytest.mark.parametrize("case", LOADS, ids=str)
def test_round_trip_then_training_continues_like_the_reference(saved, case):
    source, stages, dp = case.args[:3]
    _, saved_dp = saved(source)
    results = ROUND_TRIPS.results(case, prepare=lambda args: (saved(args[0])[0], *args[1:]))
    ref_losses, ref_state = _reference([saved_dp, saved_dp, dp])
    covered = set()
    for r in results:
        assert r["info"]["global_steps"] == 2 and r["steps"] == 3
        assert r["info"]["exact"] == (source == "2" and stages == 2)
        assert r["info"]["client_state"] == {"note": "hi"}
        assert_parity(r["losses"], ref_losses[2:], r["state"], ref_state)
        covered |= set(r["state"])
    assert covered == set(ref_state)


def test_load_sequential_matches_the_single_process_reference(saved):
    root, _ = saved("2")
    model = pk.load_sequential(root, mlp())
    assert isinstance(model, StageModule) and not model.training
    _, ref_state = _reference([1, 1])
    assert set(model.state_dict()) == set(ref_state)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, ref_state[key], rtol=1e-5, atol=1e-6)
    items = mlp_data(9, 0, 2)
    loss, outputs = reference_eval(mlp(), ref_state, items)
    with torch.no_grad():
        ours = [model(x) for x, _ in items]
    for a, b in zip(ours, outputs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("precision,build", [("fp32", "dropout"), ("fp16", "dropout")])
def test_resume_in_new_processes_is_bit_exact(tmp_path, precision, build):
    root = str(tmp_path)
    straight = run_ranks(worker, 2, root, 2, 1, range(2), "1f1b", None, False, True,
                         precision, build, 2)
    resumed = run_ranks(worker, 2, root, 2, 1, range(2, 4), "1f1b", None, True, False,
                        precision, build)
    for a, b in zip(straight, resumed):
        assert b["info"]["exact"]
        assert a["losses"][2:] == b["losses"]  # bitwise
        assert a["metrics"] == b["metrics"]
        assert a["state"].keys() == b["state"].keys()
        for key in a["state"]:
            assert torch.equal(a["state"][key], b["state"][key]), key
    if precision == "fp16":
        assert straight[0]["metrics"]["loss_scale"] != 2.0 ** 8  # the scaler moved


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_resume_on_the_gpu_restores_the_cuda_generator(tmp_path):
    """Dropout on a GPU draws from the CUDA generator: one nccl rank, as in test_cuda.py."""
    root = str(tmp_path)
    (straight,) = run_ranks(worker, 1, root, 1, 1, range(2), "1f1b", None, False, True,
                            "fp32", "dropout", 2, "nccl", timeout=120)
    (resumed,) = run_ranks(worker, 1, root, 1, 1, range(2, 4), "1f1b", None, True, False,
                           "fp32", "dropout", 0, "nccl", timeout=120)
    assert resumed["info"]["exact"] and straight["losses"][2:] == resumed["losses"]
    for key in straight["state"]:
        assert torch.equal(straight["state"][key], resumed["state"][key]), key


# -- interrupted saves ---------------------------------------------------------------------

def interrupted_worker(root, failing_rank, how):
    engine = _engine(2, 1)
    engine.train_batch(iter(mlp_data(0, 0, MB)))
    engine.save_checkpoint(root)  # global_step1: complete
    engine.train_batch(iter(mlp_data(1, 0, MB)))
    real, calls = ckpt._write_file, []

    def broken(path, obj):
        if calls:
            if how == "exit":
                os._exit(7)
            raise OSError(28, "No space left on device", path)
        calls.append(path)
        real(path, obj)

    if engine.rank == failing_rank:
        ckpt._write_file = broken
    try:
        engine.save_checkpoint(root)
    except pk.ConfigError as err:
        return str(err)
    finally:
        ckpt._write_file = real
    return None


def _check_previous_loads(root):
    assert open(os.path.join(root, "latest")).read().strip() == "global_step1"
    assert not os.path.exists(os.path.join(root, "global_step2"))
    model = pk.load_sequential(root, mlp())
    _, ref_state = _reference([1])
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, ref_state[key], rtol=1e-5, atol=1e-6)


def test_a_write_error_fails_every_rank_and_keeps_the_previous_checkpoint(tmp_path):
    messages = run_ranks(interrupted_worker, 2, str(tmp_path), 0, "raise")
    for message in messages:  # both ranks raised, with rank 0's reason
        assert message is not None and "disk is full" in message and "rank 0" in message
    _check_previous_loads(str(tmp_path))


def test_a_rank_killed_between_files_leaves_latest_on_the_previous_checkpoint(tmp_path):
    with pytest.raises(RankError):  # rank 1 died (or rank 0 saw its peer vanish first)
        run_ranks(interrupted_worker, 2, str(tmp_path), 1, "exit", timeout=300)
    _check_previous_loads(str(tmp_path))
    # the next save cleans up the half-written directory and succeeds
    run_ranks(worker, 2, str(tmp_path), 2, 1, range(1), "1f1b", None, True, True)
    assert open(tmp_path / "latest").read().strip() == "global_step2"
    assert not any(p.name.startswith(".tmp") for p in tmp_path.iterdir())


# -- errors --------------------------------------------------------------------------------

@pytest.fixture
def copy(saved, tmp_path):
    root, _ = saved("2")
    shutil.copytree(root, tmp_path / "c")
    return tmp_path / "c"


def test_missing_file_names_the_file_and_the_layer(copy):
    (copy / "global_step2" / "layer-00001.pt").unlink()
    with pytest.raises(pk.DataError, match=r"layer-00001\.pt for layer 1 \(Linear\) is missing"):
        pk.load_sequential(copy, mlp())


def test_truncated_file_names_the_file_and_the_layer(copy):
    path = copy / "global_step2" / "layer-00003.pt"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(pk.DataError, match=r"layer-00003\.pt for layer 3 .*truncated"):
        pk.load_sequential(copy, mlp())


def test_another_model_names_the_layer_and_the_shapes(copy):
    with pytest.raises(pk.ConfigError, match=r"layer 0 .*'weight' of shape \[16, 8\] in the "
                                             r"checkpoint and \[32, 8\] here"):
        pk.load_sequential(copy, mlp(width=32))
    with pytest.raises(pk.ConfigError, match="model of 14 layers and this PipelineModule has 10"):
        pk.load_sequential(copy, mlp(depth=6))


def test_newer_format_version_says_so(copy):
    meta_path = copy / "global_step2" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["format_version"] = ckpt.FORMAT_VERSION + 1
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(pk.ConfigError, match=f"format version {ckpt.FORMAT_VERSION + 1}, "
                                             f"newer than the version {ckpt.FORMAT_VERSION}"):
        pk.load_sequential(copy, mlp())


def load_worker(root):
    engine = _engine(2, 1)
    try:
        engine.load_checkpoint(root)
    except pk.DataError as err:
        return str(err)
    return None


def test_a_file_only_one_rank_needs_fails_the_load_on_every_rank(copy):
    (copy / "global_step2" / "layer-00013.pt").unlink()  # the last layer: stage 1's
    for message in run_ranks(load_worker, 2, str(copy)):
        assert message is not None and "layer-00013.pt for layer 13" in message


def save_worker(root):
    if os.geteuid() == 0:  # root ignores permissions: refuse the way the kernel would
        real_mkdir = os.mkdir

        def mkdir(path, *args, **kwargs):
            if str(path).startswith(root):
                raise PermissionError(13, "Permission denied", str(path))
            return real_mkdir(path, *args, **kwargs)
        os.mkdir = mkdir
    engine = _engine(2, 1)
    try:
        engine.save_checkpoint(root)
    except pk.ConfigError as err:
        return str(err)
    return None


def test_save_without_permission_fails_every_rank_and_keeps_the_previous(copy):
    os.chmod(copy, 0o500)
    try:
        for message in run_ranks(save_worker, 2, str(copy)):
            assert message is not None and "permission denied" in message.lower()
            assert "rank 0" in message
    finally:
        os.chmod(copy, 0o700)
    assert (copy / "latest").read_text().strip() == "global_step2"
    assert sorted(p.name for p in copy.iterdir()) == ["global_step2", "latest"]
    pk.load_sequential(copy, mlp())


def test_train_command_saves_every_n_steps_and_resumes_bit_exactly(tmp_path, capfd):
    import dataclasses

    from pipekernel.apps.config import TrainConfig
    from pipekernel.apps.train import run

    cfg = TrainConfig(steps=4, save_every=2, dim=16, layers=2, heads=2, context=16,
                      micro_batch_size=2, micro_batches=2, corpus_bytes=50_000, sample_bytes=0,
                      out=str(tmp_path / "a"), checkpoint_dir=str(tmp_path / "ck"),
                      progress=False, every=100)
    straight = run(cfg)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [
        "global_step2", "global_step4", "latest"]
    (tmp_path / "ck" / "latest").write_text("global_step2\n")  # as if it died at step 3
    resumed = run(dataclasses.replace(cfg, resume=True, out=str(tmp_path / "b")))
    assert resumed["first_step"] == 2 and resumed["losses"] == straight["losses"][2:]
    assert f"resumed from {tmp_path / 'ck' / 'global_step2'} at step 2" in capfd.readouterr().out
