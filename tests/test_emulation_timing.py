"""Segment timing on a real device: CUDA events, read lazily (runtime/emulation/compute.py, "Segment clocks").

On a CUDA device the host only launches kernels, so a segment's time must be read from events the
stream records, not from the host's clock, and reading it must wait for nothing but the segment's
own end event, when the stats are asked for. The clock takes an event factory, so the logic runs on
any machine: against a fake device whose work completes only when the host waits for it (an
``elapsed_time`` read before that raises, as torch's does), and, where CUDA is available, against the
real ``torch.cuda.Event`` too (``bench/gpu_check.py`` runs this module on the GPU). Whichever events,
the figures the emulator reports are checked against the events' own elapsed times, and
``torch.cuda.synchronize`` is never called.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

import whalelike as wl
from runtime.balance.straggler_monitor import StragglerMonitor
from runtime.emulation.compute import DeviceEvents, Emulator, HostClock, segment_clock
from whalelike.cluster import Emulation


class FakeDevice:
    """A device that runs queued work in order, on its own clock, only when the host waits."""

    def __init__(self):
        self.queued = 0.0      # device seconds of work launched so far (the stream's end)
        self.done = 0.0        # device seconds completed
        self.waits = 0         # Event.synchronize calls
        self.reads = 0         # Event.elapsed_time calls

    def launch(self, seconds: float) -> None:
        self.queued += seconds


class FakeEvent:
    """``torch.cuda.Event``'s timing surface on a :class:`FakeDevice`."""

    def __init__(self, device: FakeDevice):
        self.device, self.at = device, None

    def record(self) -> None:
        self.at = self.device.queued

    def synchronize(self) -> None:
        self.device.waits += 1
        self.device.done = max(self.device.done, self.at)

    def elapsed_time(self, end: "FakeEvent") -> float:
        self.device.reads += 1
        if end.at > self.device.done:
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        return (end.at - self.at) * 1e3


class CudaDevice:
    """The real thing: events from torch, work as matrix products on the current CUDA device."""

    def __init__(self):
        self.events: list = []
        self.a = torch.randn(1024, 1024, device="cuda")

    def factory(self):
        event = torch.cuda.Event(enable_timing=True)
        self.events.append(event)
        return event

    def launch(self, seconds: float) -> None:
        for _ in range(max(1, int(seconds * 40))):
            self.a = torch.tanh(self.a @ self.a)


def _devices():
    return ["fake"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("kind", _devices())
def test_segment_times_are_the_devices_read_only_when_asked_without_a_device_sync(kind, monkeypatch):
    def no_device_sync(*args, **kwargs):
        raise AssertionError("torch.cuda.synchronize called: segment timing must read events, not sync the device")

    monkeypatch.setattr(torch.cuda, "synchronize", no_device_sync)
    if kind == "fake":
        device = FakeDevice()
        factory = lambda: FakeEvent(device)    # noqa: E731
    else:
        device = CudaDevice()
        factory = device.factory
    made: list = []

    def recording_factory():
        made.append(factory())
        return made[-1]

    emulator = Emulator.disabled(clock=DeviceEvents(recording_factory))
    assert emulator.device_timed and emulator.measures and not emulator.enabled
    work = [("stage", 3e9, 0.25), ("matmul", 1e9, 0.5), ("matmul", 1e9, 0.125), ("stage", 2e9, 1.0)]
    for segment_kind, flops, seconds in work:
        with emulator.segment(flops, 4, kind=segment_kind):
            device.launch(seconds)
    assert emulator.pending == len(work) and len(made) == 2 * len(work)
    if kind == "fake":
        assert device.reads == device.waits == 0 and device.done == 0.0   # nothing read, nothing waited for

    stats = emulator.stats   # the monitor's read: now the events are waited for, one by one
    expected = [made[2 * i].elapsed_time(made[2 * i + 1]) / 1e3 for i in range(len(work))]
    assert emulator.pending == 0 and stats.segments == len(work)
    if kind == "fake":
        # the device's seconds, not the host's (the host spent microseconds launching)
        assert expected == [seconds for _, _, seconds in work]
    assert_close(stats.real_s, math.fsum(expected))
    assert_close(stats.padded_s, stats.real_s)           # nothing padded on a real device
    assert_close(stats.matmul_s, expected[1] + expected[2])
    assert stats.modeled_s == 0.0 and stats.overruns == 0 and stats.flops == 7e9
    if kind == "fake":
        reads = device.reads
        assert emulator.stats.real_s == stats.real_s and device.reads == reads   # read once, kept

    # the straggler monitor divides the FLOPs by the device's time, matmul segments included
    monitor = StragglerMonitor(0, 1)
    before = stats.snapshot()
    with emulator.segment(5e9, 4, kind="matmul"):
        device.launch(0.5)
    step = emulator.stats.since(before)
    monitor.record(0, step.flops, step.padded_s, step.matmul_s)
    speed, compute_s, matmul_s = monitor.smoothed()
    last = made[-2].elapsed_time(made[-1]) / 1e3
    assert_close(compute_s, last) and assert_close(matmul_s, last)
    assert_close(speed, 5e9 / last)


def test_reading_waits_for_each_segments_end_event_only():
    device = FakeDevice()
    emulator = Emulator.disabled(clock=DeviceEvents(lambda: FakeEvent(device)))
    with emulator.segment(1e9, 1):
        device.launch(0.5)
    device.launch(2.0)              # later work, outside any segment: never waited for by the read
    assert_close(emulator.stats.real_s, 0.5)
    assert device.done == 0.5 and device.waits == 1


def test_each_device_gets_its_clock_and_emulated_devices_keep_the_hosts():
    real = wl.Cluster.from_dict({"name": "one-gpu", "network": {"intra_host_gbps": 450, "inter_host_gbps": 50,
                                             "latency_us": 5},
                                 "hosts": [{"name": "h", "devices": [{"kind": "H100", "peak_tflops": 67, "memory_gib": 80}]}]})
    name = real.devices[0].name
    on_gpu = Emulator.for_device(real, name, 0, compute_device=torch.device("cuda", 0))
    on_cpu = Emulator.for_device(real, name, 0, compute_device=torch.device("cpu"))
    assert on_gpu.device_timed and on_gpu.measures and isinstance(on_gpu.clock, DeviceEvents)
    assert not on_cpu.device_timed and not on_cpu.measures and isinstance(on_cpu.clock, HostClock)
    assert isinstance(segment_clock(torch.device("cuda", 0)), DeviceEvents)
    assert isinstance(segment_clock(torch.device("cpu")), HostClock)
    assert isinstance(segment_clock(), DeviceEvents if torch.cuda.is_available() else HostClock)

    emulated = wl.Cluster.preset("emulated-4")
    padded = Emulator.for_device(emulated, emulated.devices[0].name, 0, compute_device=torch.device("cuda", 0))
    assert padded.enabled and padded.measures and not padded.device_timed   # it pads on the host's clock
    with pytest.raises(ValueError, match=r"clock DeviceEvents times a real device's segments.*emulated speed 1.*"
                                         r"leave clock out"):
        Emulator(1.0, Emulation(base_gflops=1.0), clock=DeviceEvents(lambda: None))
