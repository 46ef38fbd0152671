"""Transports: the conformance suite on every installed transport (gloo and staged here,
nccl and cupy-nccl with GPUs), a transport that
breaks the contract is caught, gloo on a subgroup, and nothing is imported early."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

import pipekernel as pk
from pipekernel.testing.conformance import CHECKS, SOLO_CHECKS
from pipekernel.testing import check_transport
from pipekernel.transports.gloo import GlooTransport

ALL_CHECKS = [*CHECKS, "timeout"]


HAS_CUPY = importlib.util.find_spec("cupy") is not None
GPUS = torch.cuda.device_count()


def _on_gpus(name, gpus):
    """A device transport's case on ``gpus`` ranks, one GPU each: skipped, with the
    reason, where it cannot run."""
    marks = [pytest.mark.cuda,
             pytest.mark.skipif(not torch.cuda.is_available(), reason=f"{name} needs CUDA"),
             pytest.mark.skipif(GPUS < gpus, reason=f"{name} on {gpus} ranks needs {gpus} "
                                                    "GPUs (NCCL refuses two ranks on one GPU)")]
    if name == "cupy-nccl":
        marks.append(pytest.mark.skipif(not HAS_CUPY,
                                        reason='cupy-nccl needs CuPy: pip install '
                                               '"pipekernel[cupy]"'))
    return pytest.param(name, gpus, marks=marks, id=f"{name}-{gpus}gpu")


@pytest.mark.parametrize("name,nprocs", [
    pytest.param("gloo", 3, id="gloo"),
    pytest.param("staged", 3, id="staged"),  # CPU tensors without CUDA, one shared GPU with it
    # every GPU there is, up to 4 (at least 2: one rank is the next test)
    _on_gpus("nccl", min(max(GPUS, 2), 4)), _on_gpus("cupy-nccl", min(max(GPUS, 2), 4)),
])
def test_every_installed_transport_passes_the_conformance_suite(name, nprocs):
    assert check_transport(name, nprocs=nprocs) == ALL_CHECKS


@pytest.mark.parametrize("name,nprocs", [_on_gpus("nccl", 1), _on_gpus("cupy-nccl", 1)])
def test_device_transports_on_one_gpu_pass_the_one_rank_checks(name, nprocs):
    assert check_transport(name, nprocs=1) == list(SOLO_CHECKS)


class LossyBoolTransport(GlooTransport):
    """Breaks the contract: bool tensors arrive as all False."""

    def isend(self, tensor, dst):
        if tensor.dtype == torch.bool:
            tensor = torch.zeros_like(tensor)
        return super().isend(tensor, dst)


def test_the_suite_catches_a_transport_that_loses_bools():
    with pytest.raises(pk.RankError) as err:
        check_transport(LossyBoolTransport, nprocs=2, timeout_check=None)
    text = str(err.value)
    assert "conformance check 'dtypes' failed" in text and "torch.bool" in text


def nccl_engine_worker(transport):
    from models import mlp, mlp_data, sgd

    engine = pk.PipelineEngine(mlp(num_stages=1), optimizer=sgd, micro_batches=2,
                               transport=transport, timeout=60)
    device = str(engine.transport.device)
    return device, [engine.train_batch(iter(mlp_data(s, 0, 2))).item() for s in range(2)]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_selects_nccl_on_cuda_and_trains():
    from pipekernel.testing import run_ranks

    (device, losses), = run_ranks(nccl_engine_worker, 1, "auto")
    (_, reference), = run_ranks(nccl_engine_worker, 1, "gloo")
    assert device == "cuda:0"
    assert losses == pytest.approx(reference, rel=1e-4)


def test_pipekernel_plugins_lists_without_importing_transports():
    code = ("import sys, io, contextlib\n"
            "from pipekernel.apps.cli import main\n"
            "out = io.StringIO()\n"
            "with contextlib.redirect_stdout(out):\n"
            "    assert main(['plugins', '--json']) == 0\n"
            "print(out.getvalue())\n"
            "print(sorted(m for m in sys.modules if m.startswith('pipekernel.transports.')"
            " or m.split('.')[0] == 'cupy'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    listing, imported = out.rsplit("\n", 2)[0], out.rsplit("\n", 2)[1]
    assert imported == "[]"
    found = json.loads(listing)
    assert {e["name"] for e in found["transports"]} >= {"gloo", "nccl", "cupy-nccl", "staged"}
    gloo = next(e for e in found["transports"] if e["name"] == "gloo")
    assert gloo["distribution"] == "pipekernel" and gloo["version"] == pk.__version__
    assert {e["name"] for e in found["schedules"]} >= {"1f1b", "gpipe", "inference"}
    assert "fp32" in {e["name"] for e in found["precisions"]}
    assert {"uniform", "parameters"} <= {e["name"] for e in found["partitions"]}
    assert {"partition", "precision"} <= {e["name"] for e in found["plugins"]}


def test_pipekernel_plugins_text_and_disable():
    from pipekernel.extend.inventory import format_inventory, inventory

    text = format_inventory(inventory(disabled=["precision"]))
    listed = text.split("transports:\n")[1].split("plugins:")[0]
    assert "\n  gloo " in listed and listed.startswith("  cupy-nccl ")  # sorted by name
    assert "[disabled]" in text.split("plugins:")[1].split("schedules:")[0]
    assert "precisions: none" in text


def subgroup_tied_worker():
    import torch.distributed as dist
    from models import adam, tied_lm, token_data

    from pipekernel.errors import ConfigError

    dist.init_process_group("gloo")
    group = dist.new_group([1, 2, 3])
    if dist.get_rank() == 0:  # outside the pipeline; it hosts the store, so it waits
        try:
            GlooTransport(group=group)
        except ConfigError as err:
            out = str(err)
        else:
            out = "no error"
        dist.barrier()
        return out
    engine = pk.PipelineEngine(tied_lm(num_stages=3), optimizer=adam, micro_batches=3,
                               transport_options={"group": group}, timeout=60)
    losses = [engine.train_batch(iter(token_data(s, 0, 3))).item() for s in range(3)]
    state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    out = (losses, state, engine.stage, engine.transport.describe(engine.rank),
           sorted(engine.tied_groups))
    engine.close()
    dist.barrier()
    return out


def test_gloo_on_a_subgroup_trains_tied_layers_with_parity():
    from models import adam, tied_lm, token_data

    from pipekernel.testing import assert_parity, reference_train, run_ranks

    outside, *ranks = run_ranks(subgroup_tied_worker, 4)
    assert "global rank 0 is not a member of the group [1, 2, 3]" in outside
    ref_losses, ref_state = reference_train(tied_lm(), adam,
                                            [[token_data(s, 0, 3)] for s in range(3)], 3)
    for losses, state, stage, where, tied in ranks:
        assert_parity(losses, ref_losses, state, ref_state)
        assert where == f"rank {stage} (global rank {stage + 1})"
        assert tied == (["embed"] if stage in (0, 2) else [])  # a group inside the subgroup
