"""The monitor's timers with fake clocks: on a GPU an instruction's time is its CUDA
events' time (what ran on the device), read with one sync per step, not the host's
launch time; on the CPU it is the kernel's host measurement. The monitor's per-step
numbers follow whichever timer it has."""
from __future__ import annotations

import types

import torch

from pipekernel.schedules import instructions as isa
from pipekernel.plugins.monitor import Monitor
from pipekernel.plugins.monitor_clock import CudaTimer, HostTimer, make_timer


class GpuClock:
    """A fake device timeline: events take the time of the work queued before them."""

    def __init__(self):
        self.now_ms, self.syncs = 0.0, 0

    def event(self):
        clock = self

        class Event:
            def record(self):
                self.ms = clock.now_ms

            def synchronize(self):
                clock.syncs += 1

            def elapsed_time(self, other):
                return other.ms - self.ms

        return Event()


def test_host_timer_uses_the_kernels_seconds():
    now = [10.0]
    timer = HostTimer(lambda: now[0])
    anchor = timer.mark()
    start = timer.start(10.5)
    end = timer.stop(start, 0.25)
    now[0] = 11.0
    spans, total = timer.resolve(anchor, [(start, end)], timer.mark())
    assert spans == [(0.5, 0.25)] and total == 1.0


def test_cuda_timer_measures_device_time_with_one_sync():
    gpu = GpuClock()
    timer = CudaTimer(gpu.event)
    anchor = timer.mark()
    gpu.now_ms += 5                       # earlier work still running on the device
    a = timer.start(host=0.0)
    gpu.now_ms += 40                      # the forward's kernels: 40 ms on the GPU
    a_end = timer.stop(a, seconds=0.001)  # ... launched in 1 ms on the host
    b = timer.start(host=0.0)
    gpu.now_ms += 15
    b_end = timer.stop(b, seconds=0.002)
    gpu.now_ms += 2
    spans, total = timer.resolve(anchor, [(a, a_end), (b, b_end)], timer.mark())
    assert spans == [(0.005, 0.04), (0.045, 0.015)]
    assert total == 0.062 and gpu.syncs == 1


def test_the_timer_follows_the_device():
    assert isinstance(make_timer(torch.device("cpu")), HostTimer)
    assert isinstance(make_timer(torch.device("cuda", 0)), CudaTimer)


def fake_engine():
    handlers = {isa.Forward: None, isa.Backward: None, isa.RecvActivation: None}
    return types.SimpleNamespace(
        transport=types.SimpleNamespace(device=torch.device("cpu"), world_size=1), rank=0,
        stage=0, topology=types.SimpleNamespace(data_rank=0), is_first_stage=lambda: False,
        instruction_types=tuple(handlers), global_steps=0)  # the EngineView fields


def test_the_monitor_reports_device_time_when_it_has_the_cuda_timer():
    engine, gpu = fake_engine(), GpuClock()
    mon = Monitor(sinks=(), heartbeat=0, warmup_steps=0)
    mon.pipekernel_configure(engine)
    mon._timer = CudaTimer(gpu.event)  # what make_timer gives a stage on a GPU
    mon.pipekernel_before_train_batch(engine)
    for instruction, gpu_ms in ((isa.RecvActivation(micro_batch=0, buffer=0), 30),
                                (isa.Forward(micro_batch=0, buffer=0), 50),
                                (isa.Backward(micro_batch=0, buffer=0), 100)):
        mon.pipekernel_before_instruction(instruction)
        gpu.now_ms += gpu_ms
        mon.pipekernel_after_instruction(instruction, seconds=1e-4)  # host: launch time
    gpu.now_ms += 20  # the end of the step waits for the device (drain)
    mon.pipekernel_after_train_batch(engine, loss=torch.tensor(1.0), metrics={"step": 1})
    summary = mon.stage_summary()
    assert round(summary["forward_s"], 9) == 0.05 and round(summary["backward_s"], 9) == 0.1
    assert round(summary["wait_s"], 9) == 0.03 and round(summary["drain_s"], 9) == 0.02
    assert round(summary["step_s"], 9) == 0.2
    assert round(summary["bubble_fraction"], 9) == 0.25
    assert gpu.syncs == 1
    mon.close()


def test_the_monitor_on_the_host_timer_reports_the_bubble_of_a_fake_clock():
    # the host path end to end with a deterministic clock: the bubble is receive wait
    # plus the drain at the end of the step, over the step
    now = [100.0]
    engine = fake_engine()
    mon = Monitor(sinks=(), heartbeat=0, warmup_steps=0, clock=lambda: now[0])
    mon.pipekernel_configure(engine)
    assert isinstance(mon._timer, HostTimer) and mon._timer.clock() == 100.0  # the injected one
    for step in range(2):
        mon.pipekernel_before_train_batch(engine)
        for instruction, seconds in ((isa.RecvActivation(micro_batch=0, buffer=0), 0.3),
                                     (isa.Forward(micro_batch=0, buffer=0), 0.5),
                                     (isa.Backward(micro_batch=0, buffer=0), 1.0)):
            mon.pipekernel_before_instruction(instruction)
            now[0] += seconds
            mon.pipekernel_after_instruction(instruction, seconds=seconds)
        now[0] += 0.2  # after the last instruction: the step's drain
        mon.pipekernel_after_train_batch(engine, loss=torch.tensor(1.0),
                                         metrics={"step": step + 1})
        now[0] += 7.0  # between steps: not part of any step
    summary = mon.stage_summary()
    assert summary["steps"] == 2
    assert round(summary["forward_s"], 9) == 1.0 and round(summary["backward_s"], 9) == 2.0
    assert round(summary["wait_s"], 9) == 0.6 and round(summary["drain_s"], 9) == 0.4
    assert round(summary["bubble_fraction"], 9) == 0.25
    mon.close()


def test_a_skip_connections_receives_are_waiting_and_its_sends_sending():
    from pipekernel.plugins.monitor_stats import Totals, derive, step_numbers
    classes = ["Forward", "RecvActivation", "RecvSkip", "RecvSkipGrad", "SendSkip",
               "SendSkipGrad"]
    spans = [(0.0, 0.25, isa.RecvSkip(0, 0)), (0.25, 0.5, isa.Forward(0, 0)),
             (0.75, 0.125, isa.RecvActivation(0, 0)), (0.875, 0.0625, isa.RecvSkipGrad(0, 0)),
             (0.9375, 0.03125, isa.SendSkip(0, 0)), (0.96875, 0.015625, isa.SendSkipGrad(0, 0))]
    totals = Totals()
    totals.add({**step_numbers(classes, spans, 1.0, 1, peak_memory_mb=0.0, samples=0,
                               tokens=0), "skipped": False})
    summary = derive(0, 3, 0, totals.numbers, totals.classes)
    assert summary["wait_s"] == 0.25 + 0.125 + 0.0625
    assert summary["send_s"] == 0.03125 + 0.015625
    assert summary["forward_s"] == 0.5
