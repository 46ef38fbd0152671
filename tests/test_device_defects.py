"""Device transports' and device paths' defects (issue 20, item 6), tested with fakes: no
CUDA runs here (gpu/check.sh runs the real paths).

* lanes are NCCL groups initialised eagerly on this GPU, whoever made the default group;
* ``CUDA_DEVICE_MAX_CONNECTIONS`` too low for the lanes is refused, unset is raised to 32;
* a pinned micro-batch is never read by a non-blocking copy after ``to_device`` returned;
* the data-parallel buckets of a stage's earlier chunks start when the last backward
  starts (interleaved, zbv), not after it;
* a bucket with missing gradients is filled without a host-to-device copy.
"""
from __future__ import annotations

import pytest
import torch

from pipekernel.errors import ConfigError
from pipekernel.schedules.instructions import Backward, BackwardWeight
from pipekernel.schedules.interleaved import Interleaved1F1B
from pipekernel.schedules.zero_bubble import ZBV
from pipekernel.stage import device as device_mod
from pipekernel.step.grad_reduce import GradReducer, settled_parameters
from pipekernel.testing import HostSyncs
from pipekernel.transports import gloo, nccl
from pipekernel.transports.connections import check_max_connections


# -- lanes: NCCL, eager --------------------------------------------------------------------
def test_lanes_are_eager_nccl_groups_even_over_a_host_made_gloo_group(monkeypatch):
    made = []

    def new_group(ranks, **kwargs):
        made.append(kwargs)
        return f"group{len(made)}"

    class Control:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    monkeypatch.setattr(nccl.dist, "new_group", new_group)
    monkeypatch.setattr(nccl.dist, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(gloo, "GlooTransport", Control)
    transport = nccl.NcclTransport.__new__(nccl.NcclTransport)
    transport.group, transport.timeout, transport._backstop = None, 5.0, 60.0
    transport._cuda = torch.device("cuda", 1)
    transport._make_lanes(3)
    lanes, control = made[:3], made[3]
    assert all(k["backend"] == "nccl" and k["device_id"] == torch.device("cuda", 1)
               for k in lanes)
    assert control["backend"] == "gloo" and "device_id" not in control
    assert transport.max_tags == 3 and transport._lanes == ["group1", "group2", "group3"]


# -- CUDA_DEVICE_MAX_CONNECTIONS -----------------------------------------------------------
@pytest.mark.parametrize("value", ["1", "8"])
def test_too_few_connections_for_the_lanes_are_refused(value):
    with pytest.raises(ConfigError, match=r"lanes \+ 1 = 9") as err:
        check_max_connections(8, "nccl", {"CUDA_DEVICE_MAX_CONNECTIONS": value}, lambda: False)
    assert "deadlock" in str(err.value)
    with pytest.raises(ConfigError, match="not a number"):
        check_max_connections(8, "nccl", {"CUDA_DEVICE_MAX_CONNECTIONS": "many"}, lambda: False)


def test_enough_connections_pass_and_unset_is_raised_to_the_maximum_before_cuda_starts():
    assert check_max_connections(8, "nccl", {"CUDA_DEVICE_MAX_CONNECTIONS": "9"},
                                 lambda: True) == 9
    environ = {}
    assert check_max_connections(8, "nccl", environ, lambda: False) == 32
    assert environ == {"CUDA_DEVICE_MAX_CONNECTIONS": "32"}
    with pytest.warns(RuntimeWarning, match="CUDA_DEVICE_MAX_CONNECTIONS=32"):
        assert check_max_connections(8, "nccl", {}, lambda: True) == 8
    check_max_connections(3, "nccl", {}, lambda: True)  # 4 streams fit the default 8


# -- pinned copies ----------------------------------------------------------------------
class FakeHostTensor:
    """A CPU tensor as ``to_device`` sees it; logs what is done with it."""

    def __init__(self, log, name, pinned):
        self.log, self.name, self.pinned = log, name, pinned
        self.device, self.shape = torch.device("cpu"), (2,)

    def is_pinned(self):
        return self.pinned

    def pin_memory(self):
        self.log.append(("pin_memory", self.name))
        return FakeHostTensor(self.log, f"pinned copy of {self.name}", True)

    def new_empty(self, shape, pin_memory=False):
        self.log.append(("new_empty", self.name, pin_memory))
        return FakeHostTensor(self.log, "staging", pin_memory)

    def copy_(self, other):
        self.log.append(("copy_", self.name, other.name))
        return self

    def to(self, device, non_blocking=False):
        self.log.append(("to", self.name, str(device), non_blocking))
        return "on the device"


@pytest.mark.parametrize("pinned", [True, False])
def test_the_non_blocking_copy_never_reads_the_callers_tensor(pinned):
    log = []
    source = FakeHostTensor(log, "batch", pinned)
    assert device_mod.to_device(source, torch.device("cuda", 0)) == "on the device"
    copies = [entry for entry in log if entry[0] == "to"]
    assert len(copies) == 1 and copies[0][1] != "batch" and copies[0][3] is True
    if pinned:  # the caller's pinned buffer is copied on the host first
        assert log == [("new_empty", "batch", True), ("copy_", "staging", "batch"),
                       ("to", "staging", "cuda:0", True)]


# -- data-parallel buckets of earlier chunks --------------------------------------------
@pytest.mark.parametrize("schedule", [Interleaved1F1B, ZBV])
def test_other_chunks_parameters_are_settled_before_the_last_backward(schedule):
    parts = [[torch.nn.Parameter(torch.zeros(1))], [torch.nn.Parameter(torch.zeros(1))]]
    for stage in range(2):
        steps = schedule(2, stage, 4, 2).steps()
        chunks = [ins.chunk for step in steps for ins in step
                  if isinstance(ins, (Backward, BackwardWeight))]
        last = chunks[-1]
        # the other chunk's last backward ran earlier: its gradients are final
        assert max(i for i, c in enumerate(chunks) if c != last) < len(chunks) - 1
        assert settled_parameters(last, parts) == parts[1 - last]
    assert settled_parameters(0, parts[:1]) == []  # one chunk: nothing settles early
    assert settled_parameters(None, parts) == []  # no backward
    shared = parts[0][0]
    assert settled_parameters(1, [[shared], [shared]]) == []  # still accumulating


class Handle:
    def wait(self):
        pass


class Transport:
    def iall_reduce(self, tensor, op, group):
        return Handle()


def test_arming_settled_parameters_starts_their_buckets_at_once():
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    reducer = GradReducer(net.parameters(), Transport(), None, 2, bucket_bytes=40)
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    reducer.arm(final=list(net[1].parameters()))  # a later chunk, its backward done
    assert reducer._next >= 1 and reducer._launches[0] == "backward"
    reducer.backward_done()
    reducer.finish()


def test_a_bucket_with_missing_gradients_is_filled_without_host_copies():
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    reducer = GradReducer(net.parameters(), Transport(), None, 2, bucket_bytes=0)
    net[0].weight.grad = torch.ones(3, 3)
    with HostSyncs() as syncs:
        reducer._launch(reducer.buckets[0])
    assert syncs.records == []
    flags = reducer.buckets[0].flags.tolist()
    assert sorted(flags) == [0.0, 0.0, 0.0, 1.0]


# -- gpu/check.sh ----------------------------------------------------------------------
def test_the_gpu_check_parses_and_names_only_files_that_exist():
    import re
    import shutil
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    script = root / "gpu" / "check.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    named = set(re.findall(r"\b((?:tests|benchmarks)/[\w/]+\.py)", text))
    assert "tests/test_cuda_device.py" in named
    assert [name for name in sorted(named) if not (root / name).exists()] == []
    if shutil.which("nvidia-smi") is None:  # here: one summary line, exit 2, nothing run
        run = subprocess.run(["bash", str(script)], capture_output=True, text=True,
                             timeout=60)
        assert run.returncode == 2
        assert run.stdout.strip().splitlines()[-1].startswith("GPU CHECK: 0 passed")
