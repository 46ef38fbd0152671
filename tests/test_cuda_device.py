"""What one GPU can check of issue 20 (items 4-6) on real CUDA and NCCL. Skipped without
CUDA; run by ``gpu/check.sh`` (step ``device``). Each case runs in a fresh process with
one rank (NCCL refuses two ranks on one GPU), but the unmatched receive, which needs two.

* one host synchronisation per train step, counted twice: the calls
  (:class:`pipekernel.testing.HostSyncs`) and CUDA itself
  (``torch.cuda.set_sync_debug_mode("warn")`` warns on every synchronising call);
* nccl lanes are eager NCCL groups although the host made a gloo default group, and
  ``CUDA_DEVICE_MAX_CONNECTIONS`` was raised to 32 before CUDA started;
* an nccl receive that never matches ends the host's CUDA synchronisation through the
  watch's abort and surfaces as ``TransportTimeout`` naming the peer (two GPUs);
* a pinned micro-batch overwritten right after :func:`to_device` still arrives intact.
"""
from __future__ import annotations

import os
import time
import warnings

import pytest
import torch

from pipekernel.testing import run_ranks

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


EVERYTHING = {"precision": "fp16", "max_grad_norm": 1.0, "nonfinite": "skip",
              "loss_reduction": "tokens"}


def _sync_worker(options):
    from test_host_syncs import HOST_MEMORY, mean_loss
    from test_token_loss import MICRO_BATCHES, padded_data, padded_lm
    from models import sgd

    import pipekernel as pk
    from pipekernel.testing import HostSyncs

    module = padded_lm(1)
    if options.get("loss_reduction") != "tokens":
        module.loss_fn = mean_loss
    engine = pk.PipelineEngine(module, optimizer=sgd, micro_batches=MICRO_BATCHES,
                               transport="nccl", timeout=60, check_data_steps=0, **options)
    engine.train_batch(iter(padded_data(0, 0, MICRO_BATCHES)))  # warm-up: allocations
    torch.cuda.synchronize()
    out = []
    for step in range(1, 4):
        data = padded_data(step, 0, MICRO_BATCHES)
        with warnings.catch_warnings(record=True) as seen, HostSyncs() as syncs:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                engine.train_batch(iter(data))
            finally:
                torch.cuda.set_sync_debug_mode("default")
        # one warning per synchronising call; torch also warns once that the debug mode is
        # a prototype, which the first version of this test counted as a second sync
        cuda = [str(w.message)[:120] for w in seen
                if "called a synchronizing CUDA operation" in str(w.message)]
        calls = [r for r in syncs.records if not r[1].startswith(HOST_MEMORY)]
        out.append((calls, cuda))
    engine.close()
    return out


@pytest.mark.parametrize("options", [{}, EVERYTHING], ids=["fp32-default", "fp16-clip-skip-tokens"])
def test_a_cuda_train_step_synchronises_the_host_once(options):
    (per_step,) = run_ranks(_sync_worker, 1, options, timeout=300)
    for step, (calls, cuda) in enumerate(per_step, start=1):
        print(f"step {step}: calls {calls}; CUDA synchronisations {len(cuda)}: {cuda}")
        assert [what for what, _ in calls] == ["tolist"], calls
        assert len(cuda) == 1, cuda


def _lanes_worker():
    import datetime

    import torch.distributed as dist

    os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    assert not torch.cuda.is_initialized()
    # the host makes a gloo default group; the transport must still make NCCL lanes
    dist.init_process_group("gloo", init_method=os.environ["PIPEKERNEL_INIT_METHOD"], rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=60))
    from pipekernel.transports.nccl import NcclTransport

    transport = NcclTransport(timeout=60, lanes=2)
    backends = [dist.get_backend(group) for group in transport._lanes]
    connections = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    transport.close()
    dist.destroy_process_group()
    return backends, connections


def test_nccl_lanes_are_nccl_over_a_host_made_gloo_group():
    (result,) = run_ranks(_lanes_worker, 1, timeout=300)
    backends, connections = result
    assert all("nccl" in str(b) for b in backends), backends
    assert connections == "32"


def _timeout_worker():
    from pipekernel.comm.transport import P2POp
    from pipekernel.errors import TransportTimeout
    from pipekernel.transports.nccl import NcclTransport

    transport = NcclTransport(timeout=2.0, watch_interval=0.2, grace=60.0, lanes=2)
    if transport.rank == 1:
        time.sleep(20)  # alive and silent: rank 0's receive is never matched
        return "silent", 0.0
    buf = torch.empty(1 << 10, device=transport.device)
    start = time.monotonic()
    handle = transport.batch_isend_irecv([P2POp("recv", buf, 1, 0)])[0]  # rank 1 never sends
    handle.wait()
    outcome = "returned"
    try:
        torch.cuda.synchronize()  # the host sits here until the watch aborts the lanes
        transport.batch_isend_irecv([P2POp("send", buf, 1, 1)])
    except TransportTimeout as err:
        outcome = f"TransportTimeout peer={err.peer}: {err}"
    except Exception as err:  # noqa: BLE001 - reported below
        outcome = f"{type(err).__name__}: {err}"
    return outcome, time.monotonic() - start


# NCCL refuses two ranks on one GPU, and one rank cannot leave a receive unmatched: NCCL
# 2.28 rejects a receive from itself without the matching send in the same group
# ("invalid usage", seen on an H200), where this test first posted one
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: an unmatched NCCL "
                    "receive needs a peer on another GPU")
def test_an_unmatched_nccl_receive_ends_in_a_transport_timeout():
    result, _ = run_ranks(_timeout_worker, 2, timeout=300)
    outcome, seconds = result
    print(f"after {seconds:.1f}s: {outcome}")
    assert outcome.startswith("TransportTimeout peer=1"), outcome


def test_a_pinned_batch_overwritten_at_once_arrives_intact():
    from pipekernel.stage.device import to_device

    source = torch.arange(1 << 24, dtype=torch.float32).pin_memory()
    want = source.clone()
    torch.cuda._sleep(50_000_000)  # the stream is busy: the copy runs late
    moved = to_device(source, torch.device("cuda", torch.cuda.current_device()))
    source.fill_(-1.0)  # a loader refilling its pinned buffer
    assert torch.equal(moved.cpu(), want)
