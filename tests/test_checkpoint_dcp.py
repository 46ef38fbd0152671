"""Checkpoints of sharded stages (issue 28, item 5; issue 45: one writer, pipekernel's layer
files, DTensors gathered whole; the torch.distributed.checkpoint directories written before
stay readable, tests/dcp_legacy.py writes them): PP2 x FSDP2 saved at step k and resumed
trains on bit-exactly like the run that never stopped, from either format; the checkpoint
loads at another layout (pp x dp_shard x tp, ZeRO-1 too) with its optimizer state, in one
process (load_sequential); under expert parallelism (issue 30, item 2) PP2 x EP2 resumes
bit-exactly and the experts reshard to E=1, E=4 and FSDP2, under bf16 too (its fp32 masters
outside the module saved under the parameters' names); what a DCP directory cannot be read
into is refused by name. The 4-rank FSDP2 cases
run one after another in one process world (tests/sweep.py), several engines in each case;
the expert-parallel ones in worlds of their own."""
from __future__ import annotations

import importlib.util
import os

import models
import pytest
import torch
from models import adam, ff_plan, mlp_data, tied_lm, token_data
from sweep import Sweep, refused
from torch import nn

import pipekernel as pk
from dcp_legacy import save_dcp
from pipekernel.testing import run_ranks

pytestmark = pytest.mark.multirank

MB, K, N = 2, 2, 4  # micro-batches; save after step K; N steps in all
SWEEP = Sweep()  # the 4-rank cases below, in one world


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    """The directory under which each case saves, in the folder its name says."""
    return tmp_path_factory.mktemp("dcp")


@pytest.fixture(scope="module")
def world(roots):
    """``world(case)``: ``case``'s results by rank; its first argument, the name of its
    folder, becomes that folder (made under :func:`roots`) when the world starts."""
    def prepare(args):
        folder = roots / args[0]
        folder.mkdir()
        return (str(folder), *args[1:])
    return lambda case: SWEEP.results(case, prepare=prepare)


def dropout_model(num_stages=None):
    layers = [pk.LayerSpec(nn.Linear, 8, 16), pk.LayerSpec(nn.Dropout, 0.3),
              pk.LayerSpec(nn.Linear, 16, 16), torch.tanh, pk.LayerSpec(nn.Linear, 16, 16),
              pk.LayerSpec(nn.Dropout, 0.3), pk.LayerSpec(nn.Linear, 16, 4)]
    return pk.PipelineModule(layers, loss_fn=nn.MSELoss(), num_stages=num_stages,
                             partition="type:Linear", seed=7)


def ff_model(num_stages=None):
    return models.ff_model(num_stages, depth=2, seed=11)


def _engine(stages, shard=1, build=dropout_model, **kw):
    return pk.PipelineEngine(build(num_stages=stages), optimizer=adam, micro_batches=MB,
                             data_parallel_shard=shard, timeout=120, **kw)


def _train(engine, steps, data=mlp_data):
    return [engine.train_batch(iter(data(s, engine.data_parallel_rank, MB))).item()
            for s in steps]


def _full(value):
    return (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()


def _snapshot(engine):
    """Whole weights and optimizer state by global name (DTensors gathered: collective)."""
    weights = {k: _full(v) for k, v in engine.module.state_dict().items()}
    optim = {}
    for name, param in engine.module.named_parameters():
        state = engine.optimizer.state.get(param, {})
        optim[name] = {k: _full(v) if torch.is_tensor(v) else v for k, v in state.items()}
    return {"weights": weights, "optim": optim}


def _save(engine, root, writer, **kw):
    """``writer``: ``"layers"`` (what pipekernel writes) or ``"dcp"`` (a DCP directory, as
    pipekernel wrote sharded stages before issue 45)."""
    if writer == "dcp":
        return save_dcp(engine, root, kw.pop("tag", f"global_step{engine.global_steps}"),
                        **kw)
    return engine.save_checkpoint(root, **kw)


def resume_worker(root, precision, model, writer="layers"):
    torch.set_num_threads(1)
    build, data = {"dropout": (dropout_model, mlp_data), "hsdp": (dropout_model, mlp_data),
                   "tied": (tied_lm, token_data)}[model]
    # hsdp: 1 stage x 2 replicas x 2 shards (DCP writes the replicated shards once)
    stages, kw = (1, {"data_parallel_size": 2}) if model == "hsdp" else (2, {})
    first = _engine(stages, shard=2, build=build, precision=precision, **kw)
    losses = _train(first, range(K), data)
    _save(first, root, writer, client_state={"note": first.rank})
    losses += _train(first, range(K, N), data)  # the run that never stopped
    uninterrupted = _snapshot(first)
    first.close()

    again = _engine(stages, shard=2, build=build, precision=precision, **kw)
    info = again.resume(root)
    resumed = _train(again, range(info["global_steps"], N), data)
    return {"losses": losses, "resumed": resumed, "info": {k: info[k] for k in
            ("exact", "global_steps", "client_state", "tag")},
            "uninterrupted": uninterrupted, "after": _snapshot(again),
            "steps": again.global_steps, "files": sorted(os.listdir(info["directory"]))}


RESUMES = {(precision, model, writer): SWEEP.case(
    f"resume-{precision}-{model}-{writer}", 4, resume_worker,
    f"resume-{precision}-{model}-{writer}", precision, model, writer)
    for precision, model, writer in [
        ("fp32", "dropout", "layers"), ("bf16", "dropout", "layers"), ("fp32", "tied", "layers"),
        ("bf16", "tied", "layers"), ("fp32", "hsdp", "layers"), ("fp32", "dropout", "dcp"),
        ("bf16", "tied", "dcp")]}


@pytest.mark.parametrize("precision, model, writer", list(RESUMES))
def test_pp2_x_fsdp2_and_hsdp_resume_is_bit_exact(world, roots, precision, model, writer):
    # tied: the embedding stays whole on both stages (outside FSDP2), one DCP key; under
    # bf16 its fp32 master (outside the module) goes to DCP under the embedding's name
    case = RESUMES[precision, model, writer]
    results = world(case)
    for rank, result in enumerate(results):
        assert result["info"] == {"exact": True, "global_steps": K, "client_state":
                                  {"note": rank}, "tag": f"global_step{K}"}
        assert result["steps"] == N
        assert result["resumed"] == result["losses"][K:]  # bit for bit, dropout included
        for part in ("weights", "optim"):
            ours, theirs = result["after"][part], result["uninterrupted"][part]
            assert ours.keys() == theirs.keys() and ours
            for name in ours:
                if part == "weights":
                    assert torch.equal(ours[name], theirs[name]), name
                else:
                    assert ours[name].keys() == theirs[name].keys()
                    for key in ours[name]:
                        assert torch.equal(torch.as_tensor(ours[name][key]),
                                           torch.as_tensor(theirs[name][key])), (name, key)
    ranks = [f"rank-{r:05d}.pt" for r in range(4)]
    if writer == "dcp":
        assert results[0]["files"] == ["dcp", "meta.json", *ranks]
    else:  # one file per layer with state, whole tensors
        files = results[0]["files"]
        assert "dcp" not in files and "meta.json" in files and set(ranks) <= set(files)
        assert [f for f in files if f.startswith("layer-")]
    assert (roots / case.args[0] / "latest").read_text().strip() == f"global_step{K}"


def reshape_worker(root, build_name, writer="layers"):
    """Save at 2 stages x 2 shards (with a DTensor plan: 1 stage x 2 shards x 2 tp), load
    at 4 x 1 (4 stages; with the plan 2 x 1 x 2), save there and load that back at the
    first layout; then 2 stages x 2 replicas under ZeRO-1 load the first checkpoint (a DCP
    directory: refused, its state-dict API cannot map ZeRO-1)."""
    torch.set_num_threads(1)
    tp = build_name == "ff"
    build, data = {"dropout": (dropout_model, mlp_data), "ff": (ff_model, mlp_data),
                   "tied": (tied_lm, token_data)}[build_name]
    extra = {"tensor_parallel_size": 2, "tensor_parallel_plan": ff_plan()} if tp else {}
    sharded = _engine(1 if tp else 2, shard=2, build=build, **extra)
    _train(sharded, range(K), data)
    _save(sharded, root, writer, tag="sharded")
    saved = _snapshot(sharded)
    sharded.close()

    plain = _engine(2 if tp else 4, build=build, **extra)
    info = plain.load_checkpoint(root, tag="sharded")
    loaded = _snapshot(plain)
    plain.save_checkpoint(root, tag="plain")
    loss = _train(plain, range(K, K + 1), data)
    plain.close()

    back = _engine(1 if tp else 2, shard=2, build=build, **extra)
    back.load_checkpoint(root, tag="plain")
    returned = _snapshot(back)
    back.close()
    # every rank refuses after the load's agreement on the error, so the world's next case
    # finds its collectives in step (tests/sweep.py)
    zero = refused(lambda: pk.PipelineEngine(build(num_stages=2), optimizer=adam,
                                             micro_batches=MB, data_parallel_size=2,
                                             zero_stage=1, timeout=120)
                   .load_checkpoint(root, tag="sharded"))
    return {"saved": saved, "loaded": loaded, "returned": returned, "exact": info["exact"],
            "loss": loss, "zero": zero}


def _merge(results, key):
    out = {"weights": {}, "optim": {}}
    for result in results:
        for part in out:
            out[part].update(result[key][part])
    return out


def _assert_same(ours, theirs):
    assert ours["weights"].keys() == theirs["weights"].keys()
    for name, value in ours["weights"].items():
        assert torch.equal(value, theirs["weights"][name]), name
    assert ours["optim"].keys() == theirs["optim"].keys()
    for name, state in ours["optim"].items():
        assert state.keys() == theirs["optim"][name].keys() and state, name
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(value),
                               torch.as_tensor(theirs["optim"][name][key])), (name, key)


RESHAPES = {(name, writer): SWEEP.case(f"reshape-{name}-{writer}", 4, reshape_worker,
                                       f"reshape-{name}-{writer}", name, writer)
            for name, writer in [("dropout", "layers"), ("ff", "layers"), ("tied", "layers"),
                                 ("dropout", "dcp"), ("ff", "dcp")]}


@pytest.mark.parametrize("build_name, writer", list(RESHAPES))
def test_reshape_2x2_to_4x1_and_back_with_the_optimizer_state(world, roots, build_name,
                                                              writer):
    case = RESHAPES[build_name, writer]
    results = world(case)
    saved = _merge(results, "saved")
    _assert_same(_merge(results, "loaded"), saved)
    _assert_same(_merge(results, "returned"), saved)
    for result in results:
        assert result["exact"] is False
        assert all(torch.isfinite(torch.tensor(result["loss"])))
        if writer == "dcp":
            assert result["zero"] and "zero_stage=0" in result["zero"], result["zero"]
        else:  # the layer files load into ZeRO-1 too
            assert result["zero"] is None, result["zero"]
    build = {"dropout": dropout_model, "ff": ff_model, "tied": tied_lm}[build_name]
    sequential = pk.load_sequential(str(roots / case.args[0]), build(), tag="sharded")
    for name, value in sequential.state_dict().items():
        assert torch.equal(value, saved["weights"][name]), name


def hf_worker(directory):
    torch.set_num_threads(1)
    import test_hf as t

    import pipekernel.hf as hf

    module = hf.pipeline_module(t.llama(), num_stages=2)
    engine = pk.PipelineEngine(module, optimizer=t.sgd, micro_batches=t.MICRO_BATCHES,
                               data_parallel_shard=2, loss_reduction="tokens", timeout=120)
    engine.train_batch(iter(t.batches(0, engine.data_parallel_rank)))
    hf.save_pretrained(engine, os.path.join(directory, "hf"))
    engine.save_checkpoint(os.path.join(directory, "checkpoints"))
    state = {k.partition(".")[2]: _full(v) for k, v in engine.module.state_dict().items()}
    engine.close()
    return state


HF = SWEEP.case("hf", 4, hf_worker, "hf") if all(
    importlib.util.find_spec(name) for name in ("transformers", "safetensors")) else None


def test_save_pretrained_and_load_sequential_gather_a_sharded_run(world, roots):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    import test_hf as t

    import pipekernel.hf as hf

    results = world(HF)
    tmp_path = roots / HF.args[0]
    trained = {k: v for result in results for k, v in result.items()}
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    saved = model.state_dict()
    assert trained and set(trained) <= set(saved)
    for key, value in trained.items():
        assert torch.equal(saved[key], value), key
    whole = pk.load_sequential(str(tmp_path / "checkpoints"), hf.pipeline_module(t.llama()))
    for key, value in whole.state_dict().items():
        assert torch.equal(value, trained[key.partition(".")[2]]), key


def failing_worker(root):
    """Rank 1's write of a sharded stage's files fails (no space) in the second save:
    every rank raises, and ``latest`` still names the first checkpoint; another model is
    refused by name."""
    torch.set_num_threads(1)
    import errno

    from pipekernel.engine import checkpoint

    engine = _engine(1, shard=2)
    _train(engine, range(1))
    engine.save_checkpoint(root)
    _train(engine, range(1, 2))
    if engine.rank == 1:
        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")
        checkpoint._write_file = full
    error = refused(lambda: engine.save_checkpoint(root))
    other = refused(lambda: _engine(1, shard=2, build=ff_model).load_checkpoint(root))
    return {"error": error, "other": other, "latest": open(os.path.join(root, "latest")).read().strip(),
            "tags": sorted(os.listdir(root))}


def test_a_failed_write_of_sharded_stages_fails_every_rank_and_keeps_latest(tmp_path):
    results = run_ranks(failing_worker, 2, str(tmp_path))
    for result in results:
        assert result["error"] and "No space left on device" in result["error"], result
        assert "previous checkpoint and 'latest' are unchanged" in result["error"]
        assert result["latest"] == "global_step1"
        assert "global_step2" not in result["tags"]
        assert "holds a model of 7 layers" in result["other"], result["other"]


# -- expert parallelism: each rank's slice of the expert stacks in one DCP tensor ------------

def _moe(num_stages=None):
    import test_expert_parallel as e
    return e.build(num_stages)


def _moe_data(step, replica, micro_batches):
    import test_expert_parallel as e
    return e.data(step, replica, micro_batches)


def _sgd():
    import test_expert_parallel as e
    return e.sgd


def _ep_engine(ep, stages=2, **kw):
    # SGD with momentum (the EP tests' optimizer): AdamW would turn the round-off between
    # EP2's and EP1's near-zero gradients into lr-sized steps
    return pk.PipelineEngine(_moe(stages), optimizer=_sgd(), micro_batches=MB,
                             data_parallel_size=4 // stages, expert_parallel_size=ep,
                             timeout=120, **kw)


def _whole(engine):
    """Whole weights and optimizer state by global name, each expert slice gathered over
    the expert-parallel group (collective)."""
    from pipekernel.grid import expert_parallel as ep_mod

    ep, master = engine.ep_group, engine.precision.master
    weights = {k: _full(v) for k, v in ep_mod.whole_state_dict(engine.module, ep).items()}
    optim = {}
    for name, param in engine.module.named_parameters():
        dim = getattr(param, "expert_parallel_dim", None)
        if master(param) is not param:  # bf16: the fp32 master the optimizer steps
            value = master(param).detach()
            weights[f"{name}@master"] = _full(value if dim is None
                                              else ep_mod.gather_slices(value, dim, ep))
        state = {}
        for key, value in engine.optimizer.state.get(master(param), {}).items():
            if dim is not None and torch.is_tensor(value) and value.shape == param.shape:
                value = ep_mod.gather_slices(value, dim, ep)
            state[key] = _full(value) if torch.is_tensor(value) else value
        optim[name] = state
    return {"weights": weights, "optim": optim}


def _close(ours, theirs, exact):
    """``None`` when the snapshots agree (bit for bit, or to 1e-6), else what differs."""
    for part in ("weights", "optim"):
        if ours[part].keys() != theirs[part].keys() or not ours[part]:
            return f"{part}: keys differ"
    pairs = [(n, ours["weights"][n], theirs["weights"][n]) for n in ours["weights"]]
    for name, state in ours["optim"].items():
        if state.keys() != theirs["optim"][name].keys():
            return f"optim {name}: {sorted(state)} != {sorted(theirs['optim'][name])}"
        pairs += [((name, k), torch.as_tensor(v), torch.as_tensor(theirs["optim"][name][k]))
                  for k, v in state.items()]
    for name, a, b in pairs:
        same = torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-5, atol=1e-6)
        if not same:
            return f"{name}: {(a - b).abs().max().item()}"
    return None


def ep_worker(root):
    """PP2 x EP2 saved through DCP at step K: resumed at EP2 it trains on bit for bit;
    loaded at EP1 (and saved there, loaded back at EP2) it trains on like the run that
    never stopped, to round-off; FSDP2 (2 shards, E=1) reads it and saves a checkpoint
    EP2 reads. A bad format is refused."""
    torch.set_num_threads(1)
    first = _ep_engine(2)
    losses = _train(first, range(K), _moe_data)
    first.save_checkpoint(root, tag="ep2")
    saved = _whole(first)
    losses += _train(first, range(K, N), _moe_data)
    uninterrupted = _whole(first)
    first.close()
    out = {"losses": losses, "runs": {}, "saved": saved["weights"]}
    for name, ep, tag, save_as in (("resume", 2, None, None), ("ep1", 1, "ep2", "ep1"),
                                   ("back", 2, "ep1", None)):
        engine = _ep_engine(ep)
        info = engine.resume(root) if tag is None else engine.load_checkpoint(root, tag=tag)
        loaded = _close(_whole(engine), saved, exact=True)
        if save_as:
            engine.save_checkpoint(root, tag=save_as)
        resumed = _train(engine, range(info["global_steps"], N), _moe_data)
        after = _close(_whole(engine), uninterrupted, exact=name == "resume")
        out["runs"][name] = {"exact": info["exact"], "loaded": loaded, "losses": resumed,
                             "after": after, "local": engine.module.state_dict()}
        engine.close()
    # FSDP2 (E=1, 2 shards) reads the EP2 checkpoint and saves its own, which EP2 reads
    fsdp = pk.PipelineEngine(_moe(2), optimizer=_sgd(),
                             micro_batches=MB, data_parallel_shard=2, timeout=120)
    fsdp.load_checkpoint(root, tag="ep2")
    out["fsdp_loaded"] = _close(_whole(fsdp), saved, exact=True)
    fsdp.save_checkpoint(root, tag="fsdp")
    fsdp.close()
    engine = _ep_engine(2)
    engine.load_checkpoint(root, tag="fsdp")
    out["from_fsdp"] = _close(_whole(engine), saved, exact=True)
    out["from_fsdp_losses"] = _train(engine, range(K, N), _moe_data)
    engine.close()
    out["format"] = refused(lambda: _ep_engine(2).save_checkpoint(root, format="zip"))
    return out


def test_pp2_x_ep2_resumes_bit_exact_and_reshards_the_experts(tmp_path):
    results = run_ranks(ep_worker, 4, str(tmp_path), timeout=400)
    for result in results:
        runs, losses = result["runs"], result["losses"]
        assert runs["resume"]["exact"] is True
        assert runs["resume"]["losses"] == losses[K:]  # bit for bit
        for name in ("ep1", "back"):
            assert runs[name]["exact"] is False, name
            assert runs[name]["losses"] == pytest.approx(losses[K:], rel=1e-5, abs=1e-6)
        for name, run in runs.items():
            assert run["loaded"] is None, (name, run["loaded"])  # the state saved, exactly
            assert run["after"] is None, (name, run["after"])
        assert result["fsdp_loaded"] is None, result["fsdp_loaded"]
        assert result["from_fsdp"] is None, result["from_fsdp"]
        assert result["from_fsdp_losses"] == pytest.approx(losses[K:], rel=1e-5, abs=1e-6)
        assert result["format"] and "format='zip'" in result["format"], result["format"]
    experts = [k for k in results[0]["runs"]["resume"]["local"] if k.endswith("mlp.w_in")]
    assert experts  # each EP2 rank holds half of the experts, the EP1 ranks all of them
    for key in experts:
        assert results[0]["runs"]["resume"]["local"][key].shape[0] * 2 == \
            results[0]["runs"]["ep1"]["local"][key].shape[0]
    saved = {k: v for result in results for k, v in result["saved"].items()}
    whole = pk.load_sequential(str(tmp_path), _moe(), tag="ep2").state_dict()
    assert whole.keys() == saved.keys()
    for key, value in whole.items():  # the DCP tensors are the whole stacks
        assert torch.equal(value, saved[key]), key


def _as_masters(snapshot):
    """A bf16 snapshot as an fp32 engine holds it: each parameter its fp32 master."""
    weights = snapshot["weights"]
    return {"optim": snapshot["optim"],
            "weights": {k: weights.get(f"{k}@master", v).float() for k, v in weights.items()
                        if not k.endswith("@master")}}


def ep_bf16_worker(root):
    """PP2 x EP2 under bf16 (fp32 masters outside the module, their momentum in SGD) saved
    through DCP: resumed at EP2 the losses, weights, masters and momentum are bit for bit
    those of the run that never stopped; EP1 under bf16 loads every one of them exactly and
    trains on; an fp32 engine at EP2 reads the masters as its weights."""
    torch.set_num_threads(1)
    first = _ep_engine(2, precision="bf16")
    losses = _train(first, range(K), _moe_data)
    first.save_checkpoint(root, tag="bf16")
    saved = _whole(first)
    losses += _train(first, range(K, N), _moe_data)
    uninterrupted = _whole(first)
    first.close()
    out = {"losses": losses, "runs": {}, "masters": sorted(k for k in saved["weights"]
                                                           if k.endswith("@master"))}
    for name, ep, precision in (("resume", 2, "bf16"), ("ep1", 1, "bf16"),
                                ("fp32", 2, "fp32")):
        engine = _ep_engine(ep, precision=precision)
        info = (engine.resume(root) if name == "resume"
                else engine.load_checkpoint(root, tag="bf16"))
        loaded = _close(_whole(engine), saved if precision == "bf16" else _as_masters(saved),
                        exact=True)
        resumed = _train(engine, range(info["global_steps"], N), _moe_data)
        after = _close(_whole(engine), uninterrupted, exact=True) if name == "resume" else None
        out["runs"][name] = {"exact": info["exact"], "loaded": loaded, "losses": resumed,
                             "after": after}
        engine.close()
    return out


def test_pp2_x_ep2_bf16_resumes_bit_exact_with_its_fp32_masters(tmp_path):
    results = run_ranks(ep_bf16_worker, 4, str(tmp_path), timeout=400)
    for result in results:
        runs, losses = result["runs"], result["losses"]
        assert result["masters"]  # bf16 keeps masters outside the module here
        assert runs["resume"]["exact"] is True
        assert runs["resume"]["losses"] == losses[K:]  # bit for bit
        assert runs["resume"]["after"] is None, runs["resume"]["after"]
        for name, run in runs.items():
            assert run["loaded"] is None, (name, run["loaded"])
        assert runs["ep1"]["exact"] is False
        for name in ("ep1", "fp32"):  # another layout / precision: to bf16's round-off
            assert runs[name]["losses"] == pytest.approx(losses[K:], rel=1e-3), runs[name]


def ep_replicas_worker(root, precision, writer="layers"):
    """One stage x 4 replicas at E=2 (two expert-parallel groups holding the same slices,
    which DCP's save plan deduplicates) loads at E=4 and E=1 exactly (E=4 saving what E=1
    loads); under bf16 the fp32 masters and their momentum too."""
    torch.set_num_threads(1)
    first = _ep_engine(2, stages=1, precision=precision)
    for s in range(K):
        first.train_batch(iter(_moe_data(s, first.data_parallel_rank, MB)))
    _save(first, root, writer, tag="e2")
    saved = _whole(first)
    first.close()
    out = {}
    for ep, tag in ((4, "e2"), (1, "e4")):
        engine = _ep_engine(ep, stages=1, precision=precision)
        engine.load_checkpoint(root, tag=tag)
        out[ep] = (_close(_whole(engine), saved, exact=True),
                   tuple(engine.module.state_dict()["1.mlp.w_in"].shape))
        if ep == 4:
            _save(engine, root, writer, tag="e4")
        engine.close()
    return out


@pytest.mark.parametrize("precision, writer", [("fp32", "layers"), ("bf16", "layers"),
                                               ("bf16", "dcp")])
def test_two_expert_parallel_groups_save_at_e2_and_load_at_e4_and_e1(tmp_path, precision,
                                                                    writer):
    results = run_ranks(ep_replicas_worker, 4, str(tmp_path), precision, writer, timeout=300)
    for result in results:
        assert result[4][0] is None and result[1][0] is None, result
        assert result[4][1][0] == 1 and result[1][1][0] == 4  # 1 expert each at E=4, all at E=1


@pytest.mark.fast
def test_a_master_of_another_shape_is_refused_by_name():
    """The one precision refusal left: masters DCP cannot key by the parameter's name."""
    from types import SimpleNamespace

    from pipekernel.engine import checkpoint_dcp

    module = nn.Linear(2, 3)
    flat = {id(p): p.detach().reshape(-1) for p in module.parameters()}

    def engine(master):
        return SimpleNamespace(
            rank=1, stage=0, module=module,
            parallel=SimpleNamespace(tensor_parallel_size=1, tensor_parallel_plan=None,
                                     zero_stage=0),
            precision=SimpleNamespace(name="flat", master=master))

    checkpoint_dcp.check_engine(engine(lambda p: p.detach().float().clone()), "save")
    with pytest.raises(pk.ConfigError, match=r"precision='flat' keeps masters of another "
                                             r"shape than their parameters \(weight"):
        checkpoint_dcp.check_engine(engine(lambda p: flat[id(p)]), "save_checkpoint")
