"""FSDP2 inside each pipeline stage (issue 28): ``data_parallel_shard=N`` trains like one
process accumulating every data-parallel rank's micro-batches, under plain and split
backward schedules; each rank holds 1/N of its stage; one reduce-scatter per parameter
group and batch. Every multi-rank case runs in one world of 4 ranks (tests/sweep.py)."""
from __future__ import annotations

import contextlib
import os

import pytest
import torch
from models import adam, mlp, mlp_data, sgd, tied_lm, token_data
from plugins_for_tests import Recorder
from sweep import Sweep, refused

import pipekernel as pk
from pipekernel.errors import ConfigError
from pipekernel.testing import reference_train

MB, STEPS = 4, 3
SWEEP = Sweep()  # every multi-rank case below, in one world of 4 ranks
DIR = "<a directory of the case's own>"  # a case argument, made when the world starts


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """``world(case)``: ``case``'s results by rank (the world runs on first use, each case
    that saves a checkpoint given a directory of its own)."""
    def prepare(args):
        return tuple(str(tmp_path_factory.mktemp("fsdp")) if isinstance(a, str) and a == DIR
                     else a for a in args)
    return lambda case: SWEEP.results(case, prepare=prepare)


def _full_state(engine):
    """The stage's state_dict with every DTensor gathered (a collective over its mesh)."""
    out = {}
    for name, value in engine.module.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[name] = full.detach().clone()
    return out


@contextlib.contextmanager
def _counting_reduce_scatters():
    """``[count]`` of the reduce-scatters started inside (the case after it counts anew)."""
    import torch.distributed as dist

    name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") \
        else "reduce_scatter_tensor"
    counts = [0]
    original = getattr(dist, name)

    def counting(*args, **kwargs):
        counts[0] += 1
        return original(*args, **kwargs)

    setattr(dist, name, counting)
    try:
        yield counts
    finally:
        setattr(dist, name, original)


def fsdp_worker(stages, shard, schedule, model="mlp", kw=()):
    """``kw``: extra engine options as ``(name, value)`` pairs (hashable, as a case's
    arguments must be)."""
    torch.set_num_threads(1)
    with _counting_reduce_scatters() as counts:
        return _fsdp_train(counts, stages, shard, schedule, model, dict(kw))


def _fsdp_train(counts, stages, shard, schedule, model, kw):
    build, data = {"mlp": (mlp, mlp_data), "tied": (tied_lm, token_data)}[model]
    optimizer = {"adam": adam, "sgd": sgd}[kw.pop("optimizer", "adam")]
    engine = pk.PipelineEngine(build(num_stages=stages), optimizer=optimizer, micro_batches=MB,
                               schedule=schedule, data_parallel_shard=shard, timeout=120, **kw)
    from torch.distributed.tensor import DTensor

    params = list(engine.module.parameters())
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
    full = sum(p.numel() for p in params)  # a DTensor's numel is its global one
    groups = len(engine.stage_parallel.groups) if engine.stage_parallel else 0
    losses, per_batch = [], []
    for step in range(STEPS):
        before = counts[0]
        losses.append(engine.train_batch(iter(data(step, engine.data_parallel_rank, MB)))
                      .item())
        per_batch.append(counts[0] - before)
    mesh = engine.mesh
    return {"losses": losses, "state": _full_state(engine), "local": local, "full": full,
            "groups": groups, "reduce_scatters": per_batch,
            "mesh": (mesh.mesh_dim_names, tuple(mesh.shape)),
            "dp": (engine.data_parallel_rank, engine.data_parallel_size),
            "sharded": all(isinstance(p, DTensor) for p in params),
            "norm": engine.last_grad_norm}


def _reference(model, replicas, kw=()):
    build, data = {"mlp": (mlp, mlp_data), "tied": (tied_lm, token_data)}[model]
    batches = [[data(step, r, MB) for r in range(replicas)] for step in range(STEPS)]
    kw, hook = dict(kw), None
    if kw.get("max_grad_norm"):
        def hook(model):
            torch.nn.utils.clip_grad_norm_(model.parameters(), kw["max_grad_norm"])
    optimizer = {"adam": adam, "sgd": sgd}[kw.get("optimizer", "adam")]
    return reference_train(build(num_stages=1), optimizer, batches, MB, hook=hook)


def _check_parity(results, model, replicas, kw=()):
    ref_losses, ref_state = _reference(model, replicas, kw)
    for result in results:
        assert result["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
        for name, value in result["state"].items():
            torch.testing.assert_close(value, ref_state[name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name: f"{name}: {m}")


PP2_X_FSDP2 = {schedule: SWEEP.case(f"pp2-fsdp2-{schedule}", 4, fsdp_worker, 2, 2, schedule)
               for schedule in ("1f1b", "zbv")}


@pytest.mark.parametrize("schedule", list(PP2_X_FSDP2))
def test_pp2_x_fsdp2_matches_one_process(world, schedule):
    results = world(PP2_X_FSDP2[schedule])
    _check_parity(results, "mlp", replicas=2)
    for rank, result in enumerate(results):
        assert result["mesh"] == (("pp", "dp_replicate", "dp_shard", "tp"), (2, 1, 2, 1))
        assert result["dp"] == (rank % 2, 2)  # shards read their own micro-batches
        assert result["sharded"]
        # every rank holds 1/2 of its stage's parameter elements (the mlp's are even)
        assert result["local"] * 2 == result["full"]
        # one reduce-scatter per parameter group (one per layer) per batch, not per
        # micro-batch
        assert result["groups"] > 0
        assert result["reduce_scatters"] == [result["groups"]] * STEPS


# SGD: linear in the gradient, so the comparison is of the clipped gradients themselves
# (AdamW's normalisation magnifies the rounding of near-zero ones)
HSDP_KW = (("max_grad_norm", 0.05), ("optimizer", "sgd"))
HSDP = SWEEP.case("hsdp-clipped", 4, fsdp_worker, 1, 2, "1f1b", "mlp", HSDP_KW)


def test_fsdp_with_replicas_is_hsdp_and_clips_over_dtensors(world):
    results = world(HSDP)
    _check_parity(results, "mlp", replicas=4, kw=HSDP_KW)
    norms = {round(r["norm"], 6) for r in results}
    assert len(norms) == 1 and norms.pop() > 0.05  # the same norm everywhere, and it clipped
    for result in results:
        assert result["mesh"] == (("pp", "dp_replicate", "dp_shard", "tp"), (1, 2, 2, 1))
        assert result["local"] * 2 == result["full"]


TIED = SWEEP.case("tied", 4, fsdp_worker, 2, 2, "1f1b", "tied")


def test_tied_layers_stay_replicated_and_match_one_process(world):
    results = world(TIED)
    _check_parity(results, "tied", replicas=2)
    for result in results:
        assert 0 < result["local"] < result["full"]


class ScaledAdamW(torch.optim.AdamW):
    """A subclass: not known to be elementwise, so it steps the DTensors themselves."""


def local_step_worker(local, optimizer):
    """PP2 x FSDP2 (D = 2) with ``optimizer``, its step on the local shards (``local``) or on
    the DTensors (``local_pairs`` refusing); what each step chose, the optimizer state."""
    torch.set_num_threads(1)
    from unittest import mock

    import pipekernel.step.local_shards as ls
    import pipekernel.step.optimizer_step as os_

    chose, real = [], ls.step_local_shards

    def spy(optimizer, step):
        chose.append(real(optimizer, step))
    factory = {"adam": adam, "sgd": sgd,
               "subclass": lambda params: ScaledAdamW(params, lr=1e-2)}[optimizer]
    with mock.patch.object(os_, "step_local_shards", spy), \
            mock.patch.object(ls, "local_pairs", ls.local_pairs if local else lambda o: None):
        engine = pk.PipelineEngine(mlp(num_stages=2), optimizer=factory, micro_batches=MB,
                                   data_parallel_shard=2, timeout=120)
        losses = [engine.train_batch(iter(mlp_data(s, engine.data_parallel_rank, MB))).item()
                  for s in range(STEPS)]
    return {"losses": losses, "state": _full_state(engine), "chose": chose,
            "optimizer": _optimizer_state(engine)}


def _optimizer_state(engine):
    """Per parameter, in order: each state entry's type, placements and full value."""
    out = []
    for group in engine.optimizer.param_groups:
        for p in group["params"]:
            entry = {}
            for key, value in sorted(engine.optimizer.state[p].items()):
                placements = getattr(value, "placements", None)
                full = value.full_tensor() if placements is not None else value
                entry[key] = (type(value).__name__, placements, full.detach().clone())
            out.append((getattr(p, "placements", None), entry))
    return out


LOCAL_STEP = {(local, optimizer): SWEEP.case(f"local-step-{local}-{optimizer}", 4,
                                             local_step_worker, local, optimizer)
              for optimizer in ("adam", "sgd") for local in (True, False)}
SUBCLASS_STEP = SWEEP.case("local-step-subclass", 4, local_step_worker, True, "subclass")


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_an_elementwise_optimizer_steps_local_shards_bit_identically(world, optimizer):
    """AdamW and SGD step the local shards (no DTensor dispatch per op) and end
    bit-identical to the DTensor step, their state still DTensors of the parameters'
    placements (what torch.distributed.checkpoint saves)."""
    local, dtensor = world(LOCAL_STEP[True, optimizer]), world(LOCAL_STEP[False, optimizer])
    _check_parity(local, "mlp", replicas=2, kw=(("optimizer", optimizer),))
    for a, b in zip(local, dtensor):
        assert a["chose"] == [True] * STEPS and b["chose"] == [False] * STEPS
        assert a["losses"] == b["losses"]
        for name, value in a["state"].items():
            assert torch.equal(value, b["state"][name]), name
        assert len(a["optimizer"]) == len(b["optimizer"]) > 0
        for (placements, entry), (placements_b, entry_b) in zip(a["optimizer"],
                                                                b["optimizer"]):
            assert placements == placements_b and placements is not None
            assert entry.keys() == entry_b.keys() and entry
            for key, (kind, where, full) in entry.items():
                assert (kind, where) == entry_b[key][:2], key
                assert torch.equal(full, entry_b[key][2]), key
                if full.dim():  # moments and momenta: DTensors laid out as the parameter
                    assert kind == "DTensor" and where == placements, key


def test_an_optimizer_not_known_elementwise_steps_the_dtensors(world):
    results = world(SUBCLASS_STEP)
    _check_parity(results, "mlp", replicas=2)
    for result in results:
        assert result["chose"] == [False] * STEPS


def test_bad_shard_options_say_how_to_fix():
    from pipekernel.grid.parallel import ParallelConfig
    for kwargs, message in [({"data_parallel_shard": 0}, "data_parallel_shard must be"),
                            ({"data_parallel_shard": 2, "zero_stage": 1}, "zero_stage=1"),
                            ({"data_parallel_shard": 2, "tensor_parallel_size": 2},
                             "tensor_parallel_size"),
                            ({"reshard_after_forward": 1}, "reshard_after_forward")]:
        with pytest.raises(ConfigError, match=message):
            ParallelConfig.make(**kwargs)


def features_worker(directory, schedule, reshard_after_forward):
    """Split backward, activation checkpointing, a micro-batch count change, eval in
    between, a skipped non-finite step; then a checkpoint saved and loaded back."""
    torch.set_num_threads(1)
    module = mlp(num_stages=2)
    module.activation_checkpoint_interval = 2
    engine = pk.PipelineEngine(module, optimizer=adam, micro_batches=MB, schedule=schedule,
                               data_parallel_shard=2, nonfinite="skip", timeout=120,
                               reshard_after_forward=reshard_after_forward)
    rank = engine.data_parallel_rank
    losses, evals = [], []
    for step, count in enumerate(COUNTS):
        losses.append(engine.train_batch(iter(mlp_data(step, rank, count)),
                                         micro_batches=count).item())
        evals.append(engine.eval_batch(iter(mlp_data(100 + step, 0, MB))).item())
    state = _full_state(engine)
    bad = mlp_data(99, rank, MB)
    if rank == 1:
        bad[1] = (bad[1][0] * float("nan"), bad[1][1])
    skipped = engine.train_batch(iter(bad))
    unchanged = all(torch.equal(v, state[k]) for k, v in _full_state(engine).items())
    # a sharded stage checkpoints through torch.distributed.checkpoint
    # (tests/test_checkpoint_dcp.py): after the count changes and the skipped step it
    # loads back exactly, counters included
    root = os.path.join(directory, "checkpoints")
    engine.save_checkpoint(root)
    info = engine.load_checkpoint(root)
    reloaded = all(torch.equal(v, state[k]) for k, v in _full_state(engine).items())
    return {"losses": losses, "evals": evals, "state": state, "skipped": engine.skipped_steps,
            "nan": skipped.item() != skipped.item(), "unchanged": unchanged,
            "reloaded": reloaded and info["exact"] and info["skipped_steps"] == 1}


COUNTS = [MB, 2, MB]
FEATURES = {(schedule, reshard): SWEEP.case(f"features-{schedule}", 4, features_worker, DIR,
                                            schedule, reshard)
            for schedule, reshard in [("zb-h1", False), ("zbv", True)]}


@pytest.mark.parametrize("schedule,reshard", list(FEATURES))
def test_fsdp_split_backward_checkpointing_count_changes_eval_and_skip(world, schedule,
                                                                       reshard):
    from pipekernel.testing import reference_eval

    results = world(FEATURES[schedule, reshard])
    batches = [[mlp_data(step, r, count) for r in range(2)] for step, count in enumerate(COUNTS)]
    ref_losses, ref_state = reference_train(mlp(num_stages=1), adam, batches, COUNTS)
    for result in results:
        assert result["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
        for name, value in result["state"].items():
            torch.testing.assert_close(value, ref_state[name], rtol=1e-5, atol=1e-6)
        assert result["skipped"] == 1 and result["nan"] and result["unchanged"]
        assert result["reloaded"]
    # the last eval ran on the final weights
    ref_eval, _ = reference_eval(mlp(num_stages=1), ref_state, mlp_data(100 + len(COUNTS) - 1,
                                                                        0, MB))
    assert results[0]["evals"][-1] == pytest.approx(ref_eval, rel=1e-5)


def test_mesh_lays_the_rank_order_over_its_dims():
    from pipekernel.grid.mesh import _dim_groups, mesh_ranks
    from pipekernel.grid.topology import Topology

    for order in ("tp-dp-pp", "tp-pp-dp", "pp-dp-tp"):
        for rank in range(16):
            topo = Topology(2, 4, 2, rank, order, shard_size=2)
            nested = mesh_ranks(topo)
            data, stage, model = topo.coords(rank)
            assert nested[stage][data // 2][data % 2][model] == rank
            assert (topo.replica_rank, topo.shard_rank) == (data // 2, data % 2)
            # today's groups are the mesh's: data (replicas x shards), tp, pp
            assert sorted(map(sorted, _dim_groups(topo, "dp"))) == \
                sorted(map(sorted, topo.data_groups()))
            assert sorted(map(sorted, _dim_groups(topo, "tp"))) == \
                sorted(map(sorted, topo.model_groups()))
            assert sorted(map(sorted, _dim_groups(topo, "pp"))) == \
                sorted(map(sorted, topo.pipe_groups()))
            shards = _dim_groups(topo, "dp_shard")
            assert all(len(g) == 2 for g in shards) and len(shards) == 8
    with pytest.raises(ConfigError, match="shards of 3"):
        Topology(1, 4, 1, 0, shard_size=3)


def test_a_transport_without_a_mesh_refuses_what_needs_one():
    from pipekernel.grid.mesh import build_grid
    from pipekernel.grid.topology import Topology

    class Local:  # no torch.distributed process group behind it
        rank, world_size, backend, device = 0, 2, "test-double", "cpu"

        def new_group(self, ranks):
            return ("group", tuple(ranks))

    grid = build_grid(Topology(1, 2, 1, 0, shard_size=2), Local())
    assert grid.mesh is None and grid.data == (("group", (0, 1)), [0, 1])
    with pytest.raises(ConfigError, match="data_parallel_shard=2 needs a torch DeviceMesh"):
        grid.require_mesh("data_parallel_shard=2")


def bf16_worker():
    torch.set_num_threads(1)
    # SGD: linear in the gradient, so bf16's rounding shows as is (AdamW's normalised
    # steps turn a near-zero gradient's rounding into a whole lr-sized step)
    engine = pk.PipelineEngine(mlp(num_stages=2), optimizer=sgd, micro_batches=MB,
                               data_parallel_shard=2, precision="bf16", timeout=120)
    from torch.distributed.tensor import DTensor

    losses = [engine.train_batch(iter(mlp_data(s, engine.data_parallel_rank, MB))).item()
              for s in range(STEPS)]
    params = list(engine.module.parameters())
    return {"losses": losses, "state": _full_state(engine),
            "fp32_shards": all(isinstance(p, DTensor) and p.dtype == torch.float32
                               for p in params),
            "optimizer_steps_shards": {id(p) for g in engine.optimizer.param_groups
                                       for p in g["params"]} == {id(p) for p in params}}


BF16 = SWEEP.case("bf16", 4, bf16_worker)


def test_bf16_under_fsdp2_tracks_fp32(world):
    results = world(BF16)
    ref_losses, ref_state = _reference("mlp", 2, (("optimizer", "sgd"),))
    for result in results:
        assert result["fp32_shards"] and result["optimizer_steps_shards"]
        assert result["losses"] == pytest.approx(ref_losses, rel=2e-2)
        assert result["losses"][1:] != pytest.approx(ref_losses[1:], rel=1e-6)  # bf16 ran
        for name, value in result["state"].items():
            torch.testing.assert_close(value, ref_state[name], rtol=5e-2, atol=1e-2)


# -- reshard_after_forward=True: all-gathers issued ahead by the program -----------------

def _classify_all_gathers():
    """Count FSDP2's all-gathers by who started them: a parameter group's own pre-forward
    or pre-backward (``on_demand``: the compute waits for it) or anyone earlier
    (``ahead``: the previous layer's prefetch, the runtime after the previous compute)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    counts = {"ahead": 0, "on_demand": 0}
    inside: list = []
    unshard = FSDPParamGroup.unshard

    def counting(self, async_op=False):
        idle = self._all_gather_result is None and not self.is_unsharded
        out = unshard(self, async_op)
        if idle and self._all_gather_result is not None:
            counts["on_demand" if inside and inside[-1] is self else "ahead"] += 1
        return out

    def within(original):
        def hook(self, *args, **kwargs):
            inside.append(self)
            try:
                return original(self, *args, **kwargs)
            finally:
                inside.pop()
        return hook

    saved = {name: getattr(FSDPParamGroup, name)
             for name in ("unshard", "pre_forward", "pre_backward")}
    FSDPParamGroup.unshard = counting
    FSDPParamGroup.pre_forward = within(FSDPParamGroup.pre_forward)
    FSDPParamGroup.pre_backward = within(FSDPParamGroup.pre_backward)

    def restore():  # the world runs other cases after this one (tests/sweep.py)
        for name, method in saved.items():
            setattr(FSDPParamGroup, name, method)
    return counts, restore


def prefetch_worker(schedule):
    torch.set_num_threads(1)
    counts, restore = _classify_all_gathers()
    try:
        seen = Recorder()  # what the per-instruction hooks (the monitor's) see
        engine = pk.PipelineEngine(mlp(num_stages=2), optimizer=adam, micro_batches=MB,
                                   schedule=schedule, data_parallel_shard=2,
                                   reshard_after_forward=True, timeout=120, plugins=[seen])
        losses, per_batch = [], []
        for step in range(STEPS):
            before = dict(counts)
            losses.append(engine.train_batch(iter(mlp_data(step, engine.data_parallel_rank,
                                                           MB))).item())
            per_batch.append({k: counts[k] - before[k] for k in counts})
        fsdp = [name for name, _, _ in seen.after if "SHARD" in name]
        result = {"losses": losses, "state": _full_state(engine), "per_batch": per_batch,
                  "chunks": engine.chunks, "fsdp": fsdp}
        return result
    finally:
        restore()


PREFETCH = {schedule: SWEEP.case(f"prefetch-{schedule}", 4, prefetch_worker, schedule)
            for schedule in ("interleaved", "zbv", "dualpipev")}


@pytest.mark.parametrize("schedule", list(PREFETCH))
def test_reshard_after_forward_prefetches_the_next_chunk_and_matches_one_process(world,
                                                                                 schedule):
    results = world(PREFETCH[schedule])
    _check_parity(results, "mlp", replicas=2)
    for result in results:
        assert result["chunks"] == 2
        for counts in result["per_batch"]:
            # only the batch's first all-gather waits: every other one (the next layer's,
            # the next chunk's first layer for a forward, its last for a backward) was
            # started before the compute that needs it
            assert counts["on_demand"] == 1, result["per_batch"]
            assert counts["ahead"] > 2 * MB, result["per_batch"]
        # the timing is instructions of the program, seen by the per-instruction hooks:
        # per batch one Unshard first, prefetches after the computes, one reduction
        fsdp = result["fsdp"]
        assert fsdp.count("UNSHARD") == fsdp.count("REDUCE_SHARDED") == STEPS, fsdp
        assert fsdp[0] == "UNSHARD" and fsdp[-1] == "REDUCE_SHARDED"
        assert sum(name.startswith("UNSHARD_") for name in fsdp) > 2 * MB * STEPS


def bad_shard_worker(kwargs):
    """The refusal's text. Declared last: a refusal leaves its world as it is
    (tests/sweep.py)."""
    torch.set_num_threads(1)
    return refused(lambda: pk.PipelineEngine(mlp(num_stages=2), optimizer=adam,
                                             micro_batches=2, timeout=60, **dict(kwargs)))


BAD_SHARDS = [
    (SWEEP.case("shard-3-of-4", 4, bad_shard_worker, (("data_parallel_shard", 3),)),
     "data_parallel_shard=3 needs a multiple of 6 processes"),
    (SWEEP.case("shard-fp16", 4, bad_shard_worker,
                (("data_parallel_shard", 2), ("precision", "fp16"))), "precision='fp16'"),
    (SWEEP.case("shard-no-plugin", 4, bad_shard_worker,
                (("data_parallel_shard", 2), ("disable_plugins", ("fsdp",)))),
     "no plugin applied FSDP2"),
]


@pytest.mark.parametrize("case,words", BAD_SHARDS, ids=[c.name for c, _ in BAD_SHARDS])
def test_bad_fsdp_configs_fail_before_the_first_step(world, case, words):
    for message in world(case):
        assert message is not None and words in message
