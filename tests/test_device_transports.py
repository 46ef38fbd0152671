"""The device transports' CPU-testable parts: cupy-nccl's import isolation, error texts,
dtype map, unique-id exchange through a torch store and stream/event bookkeeping (with
fakes: no NCCL runs here), the device watch's deadlines (fake clock), lane splitting,
and nccl's error without CUDA. Real NCCL runs only in gpu/check.sh."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
import types

import pytest
import torch
import torch.distributed as dist

from pipekernel.errors import ConfigError, TransportError, TransportTimeout
from pipekernel.comm.transport import P2POp
from pipekernel.transports import cupy_nccl
from pipekernel.transports.cupy_nccl import (INSTALL, NCCL_TYPES, _Comm, _Ops,
                                             decode_unique_id, encode_unique_id,
                                             exchange_unique_id, make_communicator,
                                             nccl_dtype)
from pipekernel.transports.device_watch import DeviceWatch
from pipekernel.transports.lanes import split_by_lane

HAS_CUPY = importlib.util.find_spec("cupy") is not None


# -- import isolation and error texts --------------------------------------------------
ISOLATION = """
import os, sys
import pipekernel
from pipekernel.extend.inventory import inventory
from pipekernel.extend.manager import make_plugin_manager, make_transport
names = {e.name for e in inventory()["transports"]}
t = make_transport(make_plugin_manager(), "gloo", {"timeout": 30})
t.barrier()
t.close()
print(sorted(names), "cupy" in sys.modules,
      "pipekernel.transports.cupy_nccl" in sys.modules)
"""


def test_listing_and_choosing_gloo_never_import_cupy(tmp_path):
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
           "PIPEKERNEL_INIT_METHOD": f"file://{tmp_path}/store"}
    out = subprocess.run([sys.executable, "-c", ISOLATION], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    names, cupy_imported, module_imported = out.stdout.strip().rsplit(" ", 2)
    assert "'cupy-nccl'" in names and "'staged'" in names
    assert (cupy_imported, module_imported) == ("False", "False")


@pytest.mark.skipif(HAS_CUPY, reason="CuPy is installed here")
def test_choosing_cupy_nccl_without_cupy_says_what_to_install():
    from pipekernel.extend.manager import make_plugin_manager, make_transport

    with pytest.raises(ConfigError) as err:
        make_transport(make_plugin_manager(), "cupy-nccl", {"timeout": 5})
    text = str(err.value)
    assert "needs CuPy" in text and INSTALL in text
    assert INSTALL == 'pip install "pipekernel[cupy]"'


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_cupy_without_cuda_says_a_gpu_is_missing(monkeypatch):
    fake_nccl = types.ModuleType("cupy.cuda.nccl")
    fake_cuda = types.ModuleType("cupy.cuda")
    fake_cuda.nccl = fake_nccl
    fake_cupy = types.ModuleType("cupy")
    fake_cupy.cuda = fake_cuda
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", fake_cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", fake_nccl)
    with pytest.raises(ConfigError, match="needs a CUDA GPU") as err:
        cupy_nccl.load_cupy_nccl()
    assert INSTALL in str(err.value)
    fake_nccl.available = False
    with pytest.raises(ConfigError, match="NCCL library is not available"):
        cupy_nccl.load_cupy_nccl()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_nccl_without_cuda_is_a_config_error():
    from pipekernel.transports.nccl import NcclTransport

    with pytest.raises(ConfigError, match="needs CUDA"):
        NcclTransport(timeout=5)


# -- dtype map ---------------------------------------------------------------------------
def test_dtype_map_covers_what_collectives_reduce_and_bool():
    assert nccl_dtype(torch.bool, "max") == (NCCL_TYPES["NCCL_UINT8"], 1) == (1, 1)
    assert nccl_dtype(torch.uint8) == (1, 1) and nccl_dtype(torch.int8) == (0, 1)
    assert nccl_dtype(torch.int32, "sum") == (2, 1)
    assert nccl_dtype(torch.int64, "min") == (4, 1)
    assert nccl_dtype(torch.float16) == (6, 1)
    assert nccl_dtype(torch.float32, "sum") == (7, 1)
    assert nccl_dtype(torch.float64, "max") == (8, 1)
    assert nccl_dtype(torch.bfloat16, "sum") == (9, 1)
    assert nccl_dtype(torch.complex64, "sum") == (7, 2)  # (real, imag) float pairs
    assert nccl_dtype(torch.complex128) == (8, 2)


def test_dtype_map_prefers_cupy_constants_and_falls_back_for_bfloat16():
    old_cupy = types.SimpleNamespace(NCCL_FLOAT32=7, NCCL_UINT8=1)  # no NCCL_BFLOAT16
    assert nccl_dtype(torch.bfloat16, "sum", old_cupy) == (9, 1)
    renumbered = types.SimpleNamespace(NCCL_FLOAT32=70)
    assert nccl_dtype(torch.float32, "sum", renumbered) == (70, 1)


@pytest.mark.parametrize("dtype,op", [(torch.int16, "sum"), (torch.uint16, None),
                                      (torch.complex64, "max")])
def test_dtypes_nccl_cannot_reduce_are_a_clear_error(dtype, op):
    with pytest.raises(TransportError, match="NCCL cannot"):
        nccl_dtype(dtype, op)


# -- unique id through the store --------------------------------------------------------
def test_unique_ids_round_trip_through_bytes():
    uid = tuple(range(-128, 128))[:128]
    data = encode_unique_id(uid)
    assert isinstance(data, bytes) and len(data) == 128
    assert decode_unique_id(data) == uid


@pytest.mark.parametrize("kind,form", [("hash", tuple), ("file", tuple), ("hash", bytes)])
def test_the_root_makes_the_id_and_the_others_read_it_from_the_store(kind, form, tmp_path):
    """CuPy before 14 makes the id as a tuple of signed chars, CuPy 14 as bytes: both
    travel as the same bytes."""
    store = dist.HashStore() if kind == "hash" else dist.FileStore(str(tmp_path / "s"), 2)
    made = []
    signed = tuple((i * 7) % 256 - 128 for i in range(128))

    def make_id():
        made.append(1)
        return signed if form is tuple else encode_unique_id(signed)

    got = {}
    reader = threading.Thread(target=lambda: got.setdefault(
        "other", exchange_unique_id(store, "pipekernel/cupy-nccl/x/0", False, make_id)))
    reader.start()  # blocks in store.get until the root wrote the id
    root = exchange_unique_id(store, "pipekernel/cupy-nccl/x/0", True, make_id)
    reader.join(30)
    assert got["other"] == root and made == [1]
    assert isinstance(root, bytes) and decode_unique_id(root) == signed


class _CommunicatorOf:
    """A stand-in for ``cupy.cuda.nccl``: its ``NcclCommunicator`` takes the id in one
    form and raises ``TypeError`` for the other, as CuPy's typed argument does."""

    def __init__(self, form):
        self.made = []
        outer = self

        class NcclCommunicator:
            def __init__(self, size, uid, rank):
                if not isinstance(uid, form):
                    raise TypeError(f"Argument 'commId' has incorrect type (expected "
                                    f"{form.__name__}, got {type(uid).__name__})")
                outer.made.append((size, uid, rank))

        self.NcclCommunicator = NcclCommunicator


@pytest.mark.parametrize("form", [bytes, tuple], ids=["cupy14-bytes", "cupy13-tuple"])
def test_the_communicator_gets_the_id_in_the_form_the_installed_cupy_takes(form):
    signed = tuple((i * 5) % 256 - 128 for i in range(128))
    nccl = _CommunicatorOf(form)
    make_communicator(nccl, 2, encode_unique_id(signed), 1)
    (size, uid, rank), = nccl.made
    assert (size, rank) == (2, 1)
    assert uid == (encode_unique_id(signed) if form is bytes else signed)


# -- stream/event bookkeeping with fakes -----------------------------------------------
class Log(list):
    pass


class FakeEvent:
    def __init__(self, log, name):
        self.log, self.name, self.done = log, name, False

    def record(self, stream):
        self.log.append(("record", self.name, stream.name))

    def query(self):
        self.log.append(("query", self.name))
        return self.done

    def synchronize(self):  # a host sync: the hot path must never call it
        self.log.append(("SYNC", self.name))


class FakeStream:
    def __init__(self, log, name, handle):
        self.log, self.name, self.cuda_stream = log, name, handle

    def wait_event(self, event):
        self.log.append(("wait", self.name, event.name))


class FakeCuda:
    def __init__(self, log):
        self.log, self.events = log, 0
        self.current = FakeStream(log, "current", 1)

    def current_stream(self):
        return self.current

    def Event(self):  # noqa: N802 - torch.cuda.Event's name
        self.events += 1
        return FakeEvent(self.log, f"e{self.events}")


class FakeNccl:
    def __init__(self, log):
        self.log = log

    def groupStart(self):  # noqa: N802 - CuPy's names
        self.log.append(("groupStart",))

    def groupEnd(self):  # noqa: N802
        self.log.append(("groupEnd",))


class FakeComm:
    def __init__(self, log):
        self.log = log

    def send(self, ptr, count, dtype, peer, stream):
        self.log.append(("send", ptr, count, dtype, peer, stream))

    def recv(self, ptr, count, dtype, peer, stream):
        self.log.append(("recv", ptr, count, dtype, peer, stream))

    def allReduce(self, send, recv, count, dtype, op, stream):  # noqa: N802
        self.log.append(("allReduce", send == recv, count, dtype, op, stream))

    def bcast(self, ptr, count, dtype, root, stream):
        self.log.append(("bcast", count, dtype, root, stream))

    def allGather(self, send, recv, count, dtype, stream):  # noqa: N802
        self.log.append(("allGather", count, dtype, stream))


def fake_ops():
    log = Log()
    watch = DeviceWatch(0, lambda event: event.done, thread=False)
    ops = _Ops(FakeNccl(log), FakeCuda(log), watch, lambda: 30.0)
    ops.record_stream = lambda tensor, stream: log.append(("record_stream", stream.name))
    comm = _Comm(FakeComm(log), FakeStream(log, "lane", 77), [0, 1, 2], 0)
    return log, ops, comm, watch


def test_a_posting_group_is_one_nccl_group_on_the_lane_stream_after_the_current_stream():
    log, ops, comm, watch = fake_ops()
    out = torch.zeros(3, 2)                      # 24 bytes
    mask = torch.ones(5, dtype=torch.bool)       # bool travels as 5 bytes
    got = torch.empty(4, dtype=torch.float64)    # 32 bytes
    entries = list(enumerate([P2POp("send", out, 2), P2POp("send", mask, 2),
                              P2POp("recv", got, 1)]))
    handles = ops.post(comm, entries)
    uint8 = NCCL_TYPES["NCCL_UINT8"]
    assert log == [
        ("record", "e1", "current"), ("wait", "lane", "e1"),  # lane waits for compute
        ("groupStart",),
        ("send", out.data_ptr(), 24, uint8, 2, 77), ("record_stream", "lane"),
        ("send", mask.data_ptr(), 5, uint8, 2, 77), ("record_stream", "lane"),
        ("recv", got.data_ptr(), 32, uint8, 1, 77), ("record_stream", "lane"),
        ("groupEnd",),
        ("record", "e2", "lane"),                               # the group's done event
    ]
    assert len(handles) == 3
    del log[:]
    handles[2].wait()
    assert log == [("wait", "current", "e2")]  # the stream waits; the host does not
    assert watch.pending() == 1 and not any(entry[0] == "SYNC" for entry in log)
    handles[2].wait()  # twice is fine, nothing more happens
    assert watch.pending() == 1


def test_empty_messages_are_not_posted_and_their_handles_are_complete():
    log, ops, comm, _ = fake_ops()
    empty = torch.empty(0, 3)
    handles = ops.post(comm, [(0, P2POp("recv", empty, 1))])
    assert log == [] and handles[0].is_completed()
    handles[0].wait()
    assert log == []


def test_collectives_use_the_dtype_map_and_the_communicator_stream():
    log, ops, comm, _ = fake_ops()
    ops.all_reduce(comm, torch.zeros(6, dtype=torch.bfloat16), "max")
    ops.all_reduce(comm, torch.zeros(3, dtype=torch.complex64), "sum")
    ops.broadcast(comm, torch.zeros(4, dtype=torch.bool), 2)
    ops.all_gather(comm, torch.zeros(3, 2, dtype=torch.bfloat16),
                   torch.zeros(2, dtype=torch.bfloat16))
    calls = [entry for entry in log if entry[0] in ("allReduce", "bcast", "allGather")]
    assert calls == [("allReduce", True, 6, 9, 2, 77), ("allReduce", True, 6, 7, 0, 77),
                     ("bcast", 4, 1, 2, 77), ("allGather", 4, 1, 77)]  # 2 bf16 = 4 bytes
    with pytest.raises(TransportError, match="output of 3 x the input"):
        ops.all_gather(comm, torch.zeros(2, 2), torch.zeros(2))
    with pytest.raises(ConfigError, match="all_reduce op"):
        ops.all_reduce(comm, torch.zeros(1), "prod")


def test_a_non_contiguous_tensor_is_refused():
    _, ops, comm, _ = fake_ops()
    with pytest.raises(TransportError, match="contiguous"):
        ops.post(comm, [(0, P2POp("send", torch.zeros(4, 4).t(), 1))])


# -- the device watch (fake clock) -----------------------------------------------------
class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class Work:
    def __init__(self):
        self.done = False


def test_the_watch_names_the_peer_of_an_overdue_transfer_and_expires_once():
    clock, expired = Clock(), []
    watch = DeviceWatch(3, lambda w: w.done, describe=lambda p: f"rank {p} (global rank 9)",
                        on_expire=expired.append, clock=clock, thread=False)
    fast, slow = Work(), Work()
    watch.watch(fast, 10.0, "send to", 1)
    watch.watch(slow, 10.0, "receive from", 4)
    clock.now += 5
    fast.done = True
    watch.poll()
    assert watch.error is None and watch.pending() == 1
    watch.check()
    clock.now += 6
    watch.poll()
    watch.poll()
    assert len(expired) == 1 and expired[0] is watch.error
    assert isinstance(watch.error, TransportTimeout) and watch.error.peer == 4
    assert "rank 3 waited 10s to receive from rank 4 (global rank 9)" in str(watch.error)
    with pytest.raises(TransportTimeout):
        watch.check()


def test_a_wait_drops_finished_work_at_the_head_so_nothing_is_kept_alive_long():
    watch = DeviceWatch(0, lambda w: w.done, clock=Clock(), thread=False)
    works = [Work() for _ in range(3)]
    for work in works:
        watch.watch(work, 10.0, "send to", 1)
    works[0].done = works[1].done = True
    watch.watch(Work(), 10.0, "send to", 1)
    assert [item.work for item in watch._items] == [works[2], watch._items[-1].work]


def test_synchronize_blocks_until_done_or_the_deadline():
    clock = Clock()
    watch = DeviceWatch(0, lambda w: w.done, clock=clock, thread=False)
    work = Work()
    watch.watch(work, 2.0, "receive from", 1)
    sleeps = []

    def sleep(seconds):  # the work finishes after three naps
        sleeps.append(seconds)
        clock.now += 0.1
        work.done = len(sleeps) >= 3

    watch.synchronize(sleep=sleep)
    assert len(sleeps) == 3 and watch.pending() == 0
    stuck = Work()
    watch.watch(stuck, 2.0, "receive from", 1)

    def nap(seconds):
        clock.now += 0.5

    with pytest.raises(TransportTimeout, match="waited 2s to receive from rank 1") as err:
        watch.synchronize(sleep=nap)
    assert err.value.peer == 1


def test_wait_for_checks_for_aborts_while_it_blocks():
    clock = Clock()
    watch = DeviceWatch(0, lambda w: w.done, clock=clock, thread=False)
    checks = []

    def abort_check():
        checks.append(clock.now)
        if len(checks) == 2:
            raise RuntimeError("rank 1 failed")

    def nap(seconds):
        clock.now += 0.3

    with pytest.raises(RuntimeError, match="rank 1 failed"):
        watch.wait_for(Work(), 60.0, "finish a barrier with", None, sleep=nap,
                       abort_check=abort_check)
    assert len(checks) == 2


def test_the_watch_thread_polls_on_its_own():
    watch = DeviceWatch(0, lambda w: w.done, interval=0.01)
    work = Work()
    watch.watch(work, 0.0, "send to", 1)  # overdue at once
    for _ in range(500):
        if watch.error is not None:
            break
        threading.Event().wait(0.01)
    watch.stop()
    assert isinstance(watch.error, TransportTimeout)


# -- lanes -----------------------------------------------------------------------------
def test_split_by_lane_keeps_order_within_lanes_and_lanes_by_first_use():
    x = torch.zeros(1)
    ops = [P2POp("send", x, 1, 2), P2POp("recv", x, 1, 0), P2POp("recv", x, 1, 2),
           P2POp("send", x, 0, 0)]
    split = split_by_lane(ops, 4)
    assert list(split) == [2, 0]
    assert [i for i, _ in split[2]] == [0, 2] and [i for i, _ in split[0]] == [1, 3]
    with pytest.raises(ConfigError, match="4 lanes, tag 4"):
        split_by_lane([P2POp("send", x, 1, 4)], 4)
    with pytest.raises(ConfigError, match="'send' or 'recv'"):
        split_by_lane([P2POp("put", x, 1)], 4)


# -- the staged transport's all_gather (the optional member tensor parallelism uses) ----
def staged_all_gather_worker():
    from pipekernel.transports.staged import StagedTransport

    t = StagedTransport(timeout=30)
    mine = torch.tensor([[t.rank, 10 + t.rank]], dtype=torch.int64)
    out = torch.full((t.world_size, 1, 2), -1, dtype=torch.int64)
    t.all_gather(out, mine)
    t.close()
    return out.tolist()


def test_staged_all_gather_fills_every_rank_in_order():
    from pipekernel.testing import run_ranks

    for got in run_ranks(staged_all_gather_worker, 2, timeout=300):
        assert got == [[[0, 10]], [[1, 11]]]
