"""Checkpoints are data, not code (issue 48): every checkpoint reader — pipekernel's layer
files, DCP, DeepSpeed's layout, the Lightning strategy's Trainer state — loads data only
by default, and hostile or broken files are refused with a ``DataError`` naming the file,
with nothing run and nothing half-loaded into the model or the optimizer.

The hostile file is the issue's: a pickle holding an object whose ``__reduce__`` runs
``touch MARKER``; each test asserts that the marker was not created (and, with the
opt-in, that it was: the switch is real)."""
from __future__ import annotations

import copy
import io
import json
import os
import pickle
import shlex
import shutil
import sys

import pytest
import torch
from deepspeed_support import FIXTURES
from models import adam, mlp, mlp_data

import pipekernel as pk
from pipekernel.engine import checkpoint_data
from pipekernel.errors import DataError, UntrustedCheckpointError
from pipekernel.testing import run_ranks

sys.path.insert(0, str(FIXTURES))
import gpt_script  # noqa: E402

DS_CKPT = FIXTURES / "ckpt"


class Evil:
    """Unpickling it creates ``path`` (a shell command: what a hostile checkpoint runs)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(self.path)}",))


# -- ways to break a file ------------------------------------------------------------------

def _hostile(path: str, marker: str) -> None:
    obj = torch.load(path, weights_only=False)
    obj["extra"] = Evil(marker)
    torch.save(obj, path)


def _truncate(path: str, marker: str) -> None:
    data = open(path, "rb").read()
    open(path, "wb").write(data[:len(data) // 2])


def _garbage(path: str, marker: str) -> None:
    open(path, "wb").write(bytes(range(256)) * 8)


def _wrong_type(path: str, marker: str) -> None:
    torch.save([1, 2, 3], path)


def _missing(path: str, marker: str) -> None:
    os.remove(path)


def _wrong_shape(path: str, marker: str) -> None:
    obj = torch.load(path, weights_only=True)
    state = obj["state"] if "state" in obj else obj
    key = next(k for k, v in state.items() if torch.is_tensor(v) and v.dim() == 2)
    state[key] = torch.zeros(state[key].shape[0] + 1, state[key].shape[1])
    torch.save(obj, path)


def _bad_rng(path: str, marker: str) -> None:
    obj = torch.load(path, weights_only=True)
    obj["rng"]["python"] = "not a state"
    torch.save(obj, path)


# -- pipekernel's own layer files and DCP, through a real engine ---------------------------------

def _snapshot(engine) -> dict:
    opt = engine.optimizer.state_dict()
    return {"model": {k: v.detach().clone() for k, v in engine.module.state_dict().items()},
            "optim": copy.deepcopy(opt), "steps": engine.global_steps}


def _same(a: dict, b: dict) -> bool:
    def equal(x, y) -> bool:
        if torch.is_tensor(x):
            return torch.is_tensor(y) and x.shape == y.shape and torch.equal(x, y)
        if isinstance(x, dict):
            return isinstance(y, dict) and x.keys() == y.keys() and all(
                equal(x[k], y[k]) for k in x)
        if isinstance(x, (list, tuple)):
            return len(x) == len(y) and all(equal(p, q) for p, q in zip(x, y))
        return x == y
    return equal(a, b)


def _outcome(call, marker: str, engine) -> dict:
    before = _snapshot(engine)
    try:
        call()
        error = None
    except Exception as err:  # noqa: BLE001 - the test reports what was raised
        error = {"type": type(err).__name__, "data_error": isinstance(err, DataError),
                 "text": str(err), "global": getattr(err, "global_name", None)}
    return {"error": error, "unchanged": _same(before, _snapshot(engine)),
            "ran": os.path.exists(marker)}


def _last_layer_file(directory: str) -> str:
    meta = json.load(open(os.path.join(directory, "meta.json")))
    return max(f for f in meta["files"] if f.startswith("layer-"))


PK_CASES = {  # case: (which file, how it is broken)
    "hostile layer": ("last layer", _hostile), "hostile rank": ("rank-00000.pt", _hostile),
    "truncated": ("last layer", _truncate), "garbage": ("last layer", _garbage),
    "wrong type": ("last layer", _wrong_type), "wrong shape": ("last layer", _wrong_shape),
    "missing shard": ("last layer", _missing), "bad rng": ("rank-00000.pt", _bad_rng),
}
DCP_CASES = {
    "hostile metadata": ("dcp/.metadata", lambda p, m: open(p, "wb").write(
        pickle.dumps({"x": Evil(m)}))),
    "truncated metadata": ("dcp/.metadata", _truncate),
    "missing shard": ("dcp/__0_0.distcp", _missing),
    "truncated shard": ("dcp/__0_0.distcp", _truncate),
    "hostile rank": ("rank-00000.pt", _hostile),
}


def _hostile_dcp_value(engine, directory: str, marker: str) -> None:
    """Rewrite the DCP files with one hyperparameter (a pickled, non-tensor value) hostile."""
    import torch.distributed.checkpoint as dcp

    from pipekernel.engine import checkpoint_dcp
    state, _ = checkpoint_dcp._state(engine)
    key = next(k for k, v in state.items() if k.startswith("optim.param_groups")
               and isinstance(v, float))
    state[key] = Evil(marker)
    shutil.rmtree(os.path.join(directory, "dcp"))
    dcp.save(state, checkpoint_id=os.path.join(directory, "dcp"))


def _engine_worker(root: str, fmt: str | None) -> dict:
    """One rank: train, save (``fmt``), train on (so a half-load would show), then load
    every broken copy of the checkpoint; and once with the opt-in."""
    torch.manual_seed(0)
    engine = pk.PipelineEngine(mlp(num_stages=1), optimizer=adam, micro_batches=2,
                               transport="gloo", timeout=60)
    engine.train_batch(iter(mlp_data(0, 0, 2)))
    good = os.path.join(root, "good")
    if fmt:  # a DCP directory, as pipekernel wrote sharded stages before issue 45
        from dcp_legacy import save_dcp
        save_dcp(engine, good, "t")
    else:
        engine.save_checkpoint(good, tag="t")
    engine.train_batch(iter(mlp_data(1, 0, 2)))
    out = {}
    cases = dict(DCP_CASES if fmt else PK_CASES)
    if fmt:
        cases["hostile value"] = (None, lambda p, m: _hostile_dcp_value(engine, p, m))
    for case, (name, corrupt) in cases.items():
        case_root = os.path.join(root, case.replace(" ", "-"))
        shutil.copytree(good, case_root)
        directory = os.path.join(case_root, "t")
        name = _last_layer_file(directory) if name == "last layer" else name
        marker = os.path.join(root, case.replace(" ", "-") + ".marker")
        corrupt(os.path.join(directory, name) if name else directory, marker)
        out[case] = _outcome(lambda: engine.load_checkpoint(case_root), marker, engine)
        out[case]["file"] = os.path.join(directory, name) if name else directory
    trusted = "hostile value" if fmt else "hostile layer"
    out["trusted"] = _outcome(lambda: engine.load_checkpoint(
        os.path.join(root, trusted.replace(" ", "-")), trust_checkpoint=True),
        os.path.join(root, trusted.replace(" ", "-") + ".marker"), engine)
    out["deepspeed dir"] = _outcome(lambda: engine.load_checkpoint(str(DS_CKPT), "step2"),
                                    os.path.join(root, "none"), engine)
    engine.close()
    return out


@pytest.fixture(scope="module")
def engine_results(tmp_path_factory):
    """Both formats in one process each (the cases share the engine: fast)."""
    return {fmt: run_ranks(_engine_worker, 1, str(tmp_path_factory.mktemp(fmt or "pk")), fmt,
                           timeout=300)[0] for fmt in (None, "dcp")}


@pytest.mark.parametrize("fmt", [None, "dcp"], ids=["layer-files", "dcp"])
def test_broken_and_hostile_checkpoints_are_refused_and_change_nothing(engine_results, fmt):
    results = engine_results[fmt]
    for case, got in results.items():
        if case in ("trusted", "deepspeed dir"):
            continue
        error = got["error"]
        assert error is not None and error["data_error"], (case, error)
        assert not got["ran"], case  # nothing executed
        assert got["unchanged"], (case, error)  # nothing half-loaded: model and optimizer
        named = got["file"] if "shard" not in case else os.path.dirname(got["file"])
        assert named in error["text"] or os.path.basename(got["file"]) in error["text"], \
            (case, error["text"])
        if case.startswith("hostile"):
            assert error["type"] == "UntrustedCheckpointError", (case, error)
            assert error["global"] == "posix.system" and "posix.system" in error["text"]
            assert "trust_checkpoint=True" in error["text"]  # the switch


@pytest.mark.parametrize("fmt", [None, "dcp"], ids=["layer-files", "dcp"])
def test_the_opt_in_unpickles_fully_and_another_layout_is_refused(engine_results, fmt):
    trusted = engine_results[fmt]["trusted"]
    assert trusted["ran"] and trusted["error"] is None  # trust_checkpoint=True unpickles all
    assert not trusted["unchanged"]  # and loaded the checkpoint
    other = engine_results[fmt]["deepspeed dir"]
    assert other["error"]["data_error"] and "meta.json" in other["error"]["text"]
    assert other["unchanged"]


# -- one process: load_sequential, the DeepSpeed converter, the Lightning state ----------------

def _saved_model(tmp_path) -> tuple[str, object]:
    """A checkpoint of an untrained 1-stage mlp, saved in one process through the files
    API (no engine): what load_sequential reads."""
    from pipekernel.engine.checkpoint_files import LAYER_FORMAT_VERSION, layer_file
    module = mlp()
    full = module.build_stage(0, [0, len(module.layers)])
    directory = tmp_path / "root" / "t"
    directory.mkdir(parents=True)
    layers = []
    for index in range(len(module.layers)):
        layer = full._modules.get(str(index))
        entry = {"index": index, "canonical": index, "type": type(layer).__name__}
        if layer is not None and layer.state_dict():
            entry["file"] = layer_file(index)
            entry["shapes"] = {k: list(v.shape) for k, v in layer.state_dict().items()}
            torch.save({"layer": index, "state": layer.state_dict(), "optimizer": {},
                        "param_groups": {}}, directory / entry["file"])
        layers.append(entry)
    meta = {"format_version": LAYER_FORMAT_VERSION, "num_layers": len(layers),
            "layers": layers, "files": [e["file"] for e in layers if "file" in e]}
    (directory / "meta.json").write_text(json.dumps(meta))
    return str(tmp_path / "root"), module


def test_load_sequential_refuses_a_hostile_layer_file_unless_trusted(tmp_path):
    root, module = _saved_model(tmp_path)
    pk.load_sequential(root, module, "t")  # the good file loads
    path = os.path.join(root, "t", _last_layer_file(os.path.join(root, "t")))
    marker = str(tmp_path / "marker")
    _hostile(path, marker)
    with pytest.raises(UntrustedCheckpointError) as err:
        pk.load_sequential(root, module, "t")
    assert not os.path.exists(marker)
    assert err.value.path == path and err.value.global_name == "posix.system"
    assert path in str(err.value) and "trust_checkpoint=True" in str(err.value)
    pk.load_sequential(root, module, "t", trust_checkpoint=True)
    assert os.path.exists(marker)


def test_dcp_metadata_with_a_foreign_global_is_refused_in_one_process(tmp_path):
    """DCP itself unpickles ``.metadata`` with plain pickle; pipekernel's reader refuses
    any global that is not one of the metadata's own classes."""
    import torch.distributed.checkpoint as dcp
    path = str(tmp_path / "dcp")
    state = {"w": torch.randn(3, 4), "lr": 0.1}
    dcp.save(state, checkpoint_id=path, no_dist=True)
    loaded = {"w": torch.zeros(3, 4), "lr": 0.0}
    checkpoint_data.dcp_load(loaded, path, no_dist=True)
    assert torch.equal(loaded["w"], state["w"]) and loaded["lr"] == 0.1  # data loads
    marker = str(tmp_path / "marker")
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump({"x": Evil(marker)}, f)
    with pytest.raises(UntrustedCheckpointError) as err:
        checkpoint_data.dcp_load(loaded, path, no_dist=True)
    assert not os.path.exists(marker)
    assert err.value.global_name == "posix.system"
    assert os.path.join(path, ".metadata") in str(err.value)
    with pytest.raises(BaseException):  # DCP's own reader runs it: the reason for ours
        dcp.load(loaded, checkpoint_id=path, no_dist=True)
    assert os.path.exists(marker)


def _ds_copy(tmp_path) -> str:
    root = tmp_path / "ds"
    shutil.copytree(DS_CKPT, root)
    return str(root)


def _ds_module():
    from pipekernel.deepspeed import pipe
    return pipe.PipelineModule(gpt_script.layers(pipe), num_stages=1,
                               loss_fn=gpt_script.loss_fn, partition_method="uniform")


@pytest.mark.parametrize("name,corrupt", [
    ("mp_rank_00_model_states.pt", _hostile), ("layer_02-model_states.pt", _hostile),
    ("mp_rank_01_model_states.pt", _truncate), ("layer_01-model_states.pt", _garbage),
    ("mp_rank_00_model_states.pt", _wrong_type), ("layer_03-model_states.pt", _wrong_type),
    ("layer_02-model_states.pt", _missing), ("mp_rank_00_model_states.pt", _missing),
    ("layer_02-model_states.pt", _wrong_shape)],
    ids=["hostile-mp_rank", "hostile-layer", "truncated", "garbage", "wrong-type-mp_rank",
         "wrong-type-layer", "missing-layer", "missing-mp_rank", "wrong-shape-layer"])
def test_deepspeed_converter_refuses_broken_and_hostile_files(tmp_path, name, corrupt):
    from pipekernel.deepspeed.checkpoint import convert
    root = _ds_copy(tmp_path)
    path = os.path.join(root, "step2", name)
    marker = str(tmp_path / "marker")
    corrupt(path, marker)
    with pytest.raises(DataError) as err:
        convert(root, tmp_path / "out", module=_ds_module())
    assert not os.path.exists(marker)
    assert path in str(err.value)
    if corrupt is _hostile:
        assert err.value.global_name == "posix.system"
        assert "pipekernel_trust_checkpoints" in str(err.value)  # the facade's config key
        assert "trust_checkpoint=True" in str(err.value)


def test_deepspeed_converter_with_the_opt_in_unpickles_fully(tmp_path):
    from pipekernel.deepspeed.checkpoint import convert
    root = _ds_copy(tmp_path)
    marker = str(tmp_path / "marker")
    _hostile(os.path.join(root, "step2", "mp_rank_00_model_states.pt"), marker)
    convert(root, tmp_path / "out", module=_ds_module(), trust_checkpoint=True)
    assert os.path.exists(marker)


def test_deepspeed_bf16_files_load_as_data_with_their_one_allowed_class(tmp_path):
    """A bf16 run's ``mp_rank`` files pickle ``fragment_address`` (what
    tests/fixtures/deepspeed/probe_globals.py found for DeepSpeed 0.19.8): it is allowed
    by name and unpickles into pipekernel's inert stand-in; nothing else is allowed."""
    from pipekernel.deepspeed.checkpoint import SAFE_GLOBALS, FragmentAddress, _torch_load
    assert [name for _, name in SAFE_GLOBALS] == [
        "deepspeed.utils.tensor_fragment.fragment_address"]
    deepspeed = pytest.importorskip("deepspeed.utils.tensor_fragment")
    root = _ds_copy(tmp_path)
    path = os.path.join(root, "step2", "mp_rank_00_model_states.pt")
    obj = torch.load(path, weights_only=False)
    obj["optimizer"] = {"param_slice_mappings": [{"0.weight": deepspeed.fragment_address(
        numel=512, start=0)}]}
    torch.save(obj, path)
    loaded = _torch_load(path)
    mapping = loaded["optimizer"]["param_slice_mappings"][0]["0.weight"]
    assert isinstance(mapping, FragmentAddress) and (mapping.numel, mapping.start) == (512, 0)
    # the optimizer is a bf16 wrapper's: refused by name, the weights convert
    from pipekernel.deepspeed.checkpoint import convert
    convert(root, tmp_path / "out", module=_ds_module(), optimizer=False)


def test_the_deepspeed_config_key_is_a_boolean_setting():
    from pipekernel.deepspeed import config as dsconfig
    base = gpt_script.config(0.0)
    assert dsconfig.parse(base, world_size=1, num_stages=1).trust_checkpoints is False
    on = dsconfig.parse({**base, "pipekernel_trust_checkpoints": True}, world_size=1,
                        num_stages=1)
    assert on.trust_checkpoints is True
    with pytest.raises(pk.ConfigError, match="pipekernel_trust_checkpoints"):
        dsconfig.parse({**base, "pipekernel_trust_checkpoints": "yes"}, world_size=1,
                       num_stages=1)


def test_untrusted_error_names_the_global_for_any_class(tmp_path):
    """A class torch does not know (not only os.system) is named too."""
    path = str(tmp_path / "f.pt")
    torch.save({"x": pk.PipelineError("x")}, path)
    with pytest.raises(UntrustedCheckpointError) as err:
        checkpoint_data.load_file(path, path)
    assert err.value.global_name in ("pipekernel.errors.PipelineError",
                                     "pipekernel.errors._rebuild")
    assert err.value.global_name in str(err.value) and path in str(err.value)


def test_a_corrupt_file_is_not_reported_as_untrusted(tmp_path):
    path = str(tmp_path / "f.pt")
    open(path, "wb").write(b"garbage")
    with pytest.raises(Exception) as err:
        checkpoint_data.load_file(path, path)
    assert not isinstance(err.value, UntrustedCheckpointError)
    blob = io.BytesIO()
    torch.save({"a": torch.ones(2)}, blob)
    assert torch.equal(checkpoint_data.load_file(io.BytesIO(blob.getvalue()), "b")["a"],
                       torch.ones(2))


def test_the_cli_converter_refuses_a_hostile_file_and_names_its_flag(tmp_path, capfd):
    from apps import cli
    root = _ds_copy(tmp_path)
    marker = str(tmp_path / "marker")
    _hostile(os.path.join(root, "step2", "mp_rank_00_model_states.pt"), marker)
    assert cli.main(["convert-deepspeed", root, str(tmp_path / "out")]) == 1
    said = capfd.readouterr().err
    assert "posix.system" in said and "--trust-checkpoint" in said
    assert not os.path.exists(marker)
    assert cli.main(["convert-deepspeed", root, str(tmp_path / "out"),
                     "--trust-checkpoint"]) == 0
    assert os.path.exists(marker)


# -- the DeepSpeed facade, as the user resumed: import pipekernel.deepspeed ----------

def _facade_worker(root: str, marker: str) -> dict:
    """One rank: ``deepspeed.initialize`` of the fixture's script, train a step, then load
    the hostile DeepSpeed checkpoint — by default, and with the config key."""
    import pipekernel.deepspeed as deepspeed
    from pipekernel.deepspeed import pipe
    out = {}
    for trust in (False, True):
        model = pipe.PipelineModule(gpt_script.layers(pipe), num_stages=1,
                                    loss_fn=gpt_script.loss_fn, partition_method="uniform",
                                    seed_layers=True, base_seed=1234)
        config = {**gpt_script.config(0.0), "pipekernel_trust_checkpoints": trust}
        engine, _, _, _ = deepspeed.initialize(model=model, config=config,
                                               model_parameters=model.parameters(),
                                               training_data=gpt_script.dataset())
        engine.train_batch()
        out[trust] = _outcome(lambda: engine.load_checkpoint(root), marker, engine.engine)
        out[trust]["steps"] = engine.global_steps
        engine.close()
    return out


def test_deepspeed_facade_refuses_a_hostile_checkpoint_unless_its_config_trusts_it(tmp_path):
    root = _ds_copy(tmp_path)
    marker = str(tmp_path / "marker")
    _hostile(os.path.join(root, "step2", "mp_rank_01_model_states.pt"), marker)
    (got,) = run_ranks(_facade_worker, 1, root, marker, timeout=300)
    refused = got[False]
    assert refused["error"]["type"] == "UntrustedCheckpointError"
    assert "mp_rank_01_model_states.pt" in refused["error"]["text"]
    assert "pipekernel_trust_checkpoints" in refused["error"]["text"]
    assert refused["unchanged"] and refused["steps"] == 1
    assert got[True]["error"] is None and got[True]["ran"] and got[True]["steps"] == 2


# -- the Lightning strategy: never less safe than Lightning's own strategies ------------------

def _strategy(blob: bytes):
    """The checkpoint half of ``PipelineStrategy`` (its real ``CheckpointMixin``) over an
    engine that returns ``client_state`` with ``blob`` as the Trainer's state (what a
    real engine returns after reading the rank files); ``trusted`` records the switch
    the engine was given."""
    from pipekernel.lightning.checkpoints import CheckpointMixin

    class Engine:
        def __init__(self) -> None:
            self.trusted = []

        def load_checkpoint(self, directory, trust_checkpoint=False):
            self.trusted.append(trust_checkpoint)
            return {"client_state": {"lightning": blob}}

    class Strategy(CheckpointMixin):
        engine = Engine()

        def broadcast(self, obj):
            return obj

        def _need_engine(self, what):
            return self.engine

    return Strategy()


@pytest.mark.parametrize("weights_only", [None, True, False])
def test_lightning_strategy_is_as_safe_as_lightnings_own(tmp_path, weights_only):
    """The same hostile Trainer state through Lightning's own ``SingleDeviceStrategy``
    and through ``PipelineStrategy``: where Lightning's refuses, ours refuses too."""
    from lightning.pytorch.strategies import SingleDeviceStrategy
    theirs_marker, ours_marker = str(tmp_path / "theirs"), str(tmp_path / "ours")
    path = tmp_path / "a.ckpt"
    torch.save({"epoch": 0, "x": Evil(theirs_marker)}, path)
    try:
        SingleDeviceStrategy("cpu").load_checkpoint(path, weights_only=weights_only)
    except Exception:  # noqa: BLE001 - refused
        pass
    blob = io.BytesIO()
    torch.save({"epoch": 0, "x": Evil(ours_marker)}, blob)
    (tmp_path / "a.ckpt.pipeline").mkdir()
    strategy = _strategy(blob.getvalue())
    try:
        strategy.load_checkpoint(str(path), weights_only=weights_only)
        error = None
    except UntrustedCheckpointError as err:
        error = err
    ran_theirs, ran_ours = os.path.exists(theirs_marker), os.path.exists(ours_marker)
    assert ran_ours <= ran_theirs  # never less safe
    assert ran_ours == (weights_only is False) and strategy.engine.trusted == [weights_only is False]
    if error is not None:
        assert error.global_name == "posix.system" and "weights_only=False" in str(error)


# -- Hugging Face directories: safetensors only, each shard named when it is broken ------------

def _hf_dir(tmp_path, shards: bool = False):
    """A tiny GPT-2 saved by ``save_pretrained`` (sharded: an index and its shards)."""
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    import hf_families
    model, why = hf_families.build("gpt2")
    assert model is not None, why
    directory = tmp_path / "hf"
    model.save_pretrained(directory, max_shard_size="20KB" if shards else "5GB")
    return directory, model


def _hf_build(directory) -> None:
    import pipekernel.hf as hf
    module = hf.pipeline_module(str(directory), num_stages=2)
    bounds = module.partition(2)
    for stage in range(2):
        module.build_stage(stage, bounds)


def test_hf_directory_is_read_as_safetensors_only(tmp_path):
    """A directory of pickled ``.bin`` weights (the other layout ``save_pretrained``
    writes) is refused by name, and its pickle is never opened."""
    directory, model = _hf_dir(tmp_path)
    os.remove(directory / "model.safetensors")
    marker = str(tmp_path / "marker")
    torch.save({"x": Evil(marker)}, directory / "pytorch_model.bin")
    with pytest.raises(DataError, match="pytorch_model.bin"):
        _hf_build(directory)
    assert not os.path.exists(marker)


@pytest.mark.parametrize("how", ["truncated", "garbage", "missing", "wrong shape"])
def test_hf_broken_shards_name_the_file(tmp_path, how):
    from safetensors.torch import load_file, save_file
    directory, _ = _hf_dir(tmp_path, shards=True)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    name = index["weight_map"]["transformer.h.1.mlp.c_fc.weight"]
    path = directory / name
    if how == "wrong shape":
        state = load_file(str(path))
        state["transformer.h.1.mlp.c_fc.weight"] = torch.zeros(3, 3)
        save_file(state, str(path), metadata={"format": "pt"})
    else:
        {"truncated": _truncate, "garbage": _garbage, "missing": _missing}[how](
            str(path), "")
    with pytest.raises(DataError) as err:
        _hf_build(directory)
    text = str(err.value)
    assert (name in text) if how != "wrong shape" else ("[3, 3]" in text and name in text)
