"""Heterogeneity emulation: make a homogeneous CPU machine behave like an unequal cluster.

docs/ARCHITECTURE.md section 4. Each compute segment (a forward or backward of a stage for one micro-batch)
takes ``max(real time, modeled time)``: the real computation runs (results stay exact), then the
rank sleeps for the rest of the modeled time. Modeled time comes from the segment's FLOPs (and the
bytes of its non-matmul operators) and the emulated device's figures, never from measured wall
time, so waiting on other ranks can never feed back into it.

The device model (:meth:`Emulator.modeled_seconds`), so that an emulated device is wrong about its
spec sheet the ways a real one is::

    modeled = (flops / (speed[precision] * base_gflops * 1e9 * b / (b + h))
               + memory_bytes / (memory_gbps * 1e9)) * straggler factors

* ``speed[precision]``: the device's emulated speed at the plan's precision
  (``Device.emulated_speed``, a number or a per-dtype mapping), so a kind whose spec sheet claims
  fast bf16 can run bf16 at its FP32 speed or slower (``emulated-slow-bf16``);
* ``b / (b + h)``: the efficiency of a micro-batch of ``b`` samples, ``h`` the device's
  ``emulated_half_efficiency_batch`` (default the emulation block's ``half_efficiency_batch``; none:
  efficiency 1), so small micro-batches run below peak and each device saturates at its own batch;
* ``memory_bytes / memory_gbps``: the segment's non-matmul operators (element-wise, norms,
  softmax, casts) are memory-bound, priced by the bytes they read and write, counted with
  :class:`whalelike.graphs.memory_traffic.MemoryTrafficMode`, a dispatch mode, not derived from
  the activations (see that module for why), and passed in by the caller beside the FLOPs
  (``begin``/``segment``/``pad_forward``'s ``memory_bytes``) exactly as the FLOPs are: the emulator
  never looks inside the computation it pads. Not divided by the efficiency (an element-wise
  kernel streams at bandwidth whatever the batch). Off (0 s) for a device without
  ``emulated_memory_gbps``, so existing clusters model what they always did. The executors pass
  each stage's captured bytes per sample times the micro-batch (``Layer.forward_memory_bytes`` /
  ``backward_memory_bytes``, summed by ``runtime.parallel.stage_split.stage_memory_bytes_from_plan``).

Segments whose real time overran the model are counted and reported; a segment with
no modeled work (no FLOPs, or no samples: a FLOP-free stage, a rank with an empty share) has no
model to overrun and is never counted as an overrun, else such a rank would warn on every run.

Collectives must stay outside segments. Where a collective is launched from inside a computation
(DDP's gradient all-reduce fires during backward), call :meth:`Emulator.begin` before the
computation and :meth:`Emulator.wait_deadline` right before the collective is launched.
:meth:`Emulator.pad_forward` pads a module's own forward with hooks, so whatever a wrapper does
around it (DDP's pre-forward bucket rebuild, a collective) stays outside the segment.

Segments have a kind: ``"stage"`` (a whole stage's forward or backward, or any other compute) or
``"matmul"`` (one matrix multiplication, as the tensor-parallel layers pad them). A straggler with
``ops="matmul"`` (the FlexTP paper's chi) slows only the latter. The stats keep the FLOPs of the
recorded segments and the time spent in matmul segments, so the straggler monitor can measure a
rank's speed (FLOPs / compute time) and the time its matmuls take, as on real hardware.

Calibration (:func:`calibrate`): ``base_gflops`` must be low enough that the real computation fits
inside the modeled time of the *fastest* emulated device even while every rank competes for the
machine's cores; otherwise real time leaks into the measurement and the emulated speeds flatten.
:func:`calibrate` times a forward+backward alone, scales it by ranks per core, and returns the
largest safe ``base_gflops``; at run time every overrun is counted (``EmulationStats.overruns``)
and the worst ratio of real to modeled time is kept, so a bad calibration is visible.

Segment clocks (:class:`HostClock`, :class:`DeviceEvents`, chosen by :func:`segment_clock`):
a segment's measured time is what the straggler monitor divides its FLOPs by, so it must be the
*device's* time. On the CPU the host's clock is the device's (``time.monotonic()``, as always). On
a CUDA device the host only launches kernels, which run asynchronously: the host's time between a
segment's start and end measures the launches, not the work (a tensor-parallel matmul segment
would read microseconds whatever the GPU's speed). There, an emulator that does not pad (no
``emulation`` block: a real device) records a pair of ``torch.cuda.Event(enable_timing=True)`` in
the current stream around each segment and keeps the pair; the elapsed time is read lazily, when
the stats are asked for (:attr:`Emulator.stats`: the Engine reads them when the step's compute is
done, the straggler monitor through it), waiting on each segment's end event only
(``Event.synchronize``). Why events and not ``torch.cuda.synchronize()`` around each segment: a
synchronize stalls the host at every segment, so the GPU idles while the host launches the next
kernels (the queue the host keeps ahead of the device is what makes a GPU fast) and the measured
time then includes the launches; it also waits for every stream, the collectives' included.
Recording an event costs the host nothing and the device nothing, and the time between two events is
the time the stream took to run what was queued between them. Reading adds no synchronisation to a
step: the stats are read when the step's compute is done, either at the step's end (after the
loss's finiteness check, a synchronisation every step has) or, on a step whose figures ride the
last collective (:class:`runtime.control.exchange.Passenger`), right before the
passenger's host-to-device copy, which synchronises the stream anyway and after the same work.
An emulator that pads keeps the host clock on any device: its padding is a host-side sleep to a
host-side deadline, and the modeled time is the emulated device's truth. :attr:`Emulator.device_timed`
says which clock runs; :attr:`Emulator.measures` whether segments are worth recording at all
(padded, or timed on a real device), which is what a caller that opens segments only to measure
(the tensor-parallel matmuls) asks.

Network: on an emulated cluster each emulator also carries a
:class:`runtime.emulation.network.NetworkEmulator` (``Emulator.network``), which pads transfers
between emulated hosts and the overlapped gradient all-reduce (:meth:`Emulator.wait_communication`)
to their modeled time; segment times are ``time.monotonic()``, the clock it shares across processes.

:meth:`Emulator.busy_for` says how long the rank has been inside its current compute segment (read
by the heartbeat of :mod:`runtime.distributed`, so a peer's error can tell a rank stuck in its
compute from one waiting in a collective). Segments run whether or not emulation is enabled, so it
works on real devices too.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from runtime.emulation.network import NetworkEmulator
from whalelike.cluster import Cluster, Emulation
from whalelike.errors import WhaleError

log = logging.getLogger(__name__)


class HostClock:
    """The host's clock, ``time.monotonic()``: a segment's time on the CPU, and the clock every
    padding deadline is kept on. Read at once (``deferred`` False)."""

    deferred = False

    def mark(self) -> float:
        return time.monotonic()

    def seconds(self, start: float, end: float) -> float:
        return end - start


def _cuda_timing_event():
    return torch.cuda.Event(enable_timing=True)


class DeviceEvents:
    """A CUDA device's clock: a timing event recorded in the current stream at each mark, the
    seconds between two marks read from the device when asked (``deferred``: see the module
    docstring, "Segment clocks"). ``event_factory`` makes an unrecorded event with ``record()``,
    ``synchronize()`` and ``elapsed_time(end)`` in milliseconds (default
    ``torch.cuda.Event(enable_timing=True)``; tests pass another)."""

    deferred = True

    def __init__(self, event_factory: Optional[Callable[[], object]] = None):
        self.event_factory = event_factory or _cuda_timing_event

    def mark(self):
        event = self.event_factory()
        event.record()
        return event

    def seconds(self, start, end) -> float:
        end.synchronize()   # this event only: the work queued before it, not the device or other streams
        return start.elapsed_time(end) / 1e3


def segment_clock(device: Optional[torch.device] = None):
    """The clock a real (unpadded) ``device``'s segments are timed by: :class:`DeviceEvents` on a
    CUDA device, else :class:`HostClock`. ``None``: the device a rank of this process computes on,
    by :func:`runtime.distributed.device`'s rule (CUDA whenever it is available)."""
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    return DeviceEvents() if torch.device(device).type == "cuda" else HostClock()


@dataclass(frozen=True)
class _Pending:
    """A segment timed by device events whose time has not been read yet."""

    start: object
    end: object
    modeled: float
    kind: str


@dataclass
class EmulationStats:
    """Cumulative over an emulator's life; subtract two snapshots for one step's figures.

    ``real_s`` is compute actually done, ``modeled_s`` what the emulated device would take,
    ``padded_s`` the time the segments occupied (``max(real, modeled)`` each); ``worst_overrun``
    is the largest real/modeled ratio among overrunning segments (0 when none overran); ``flops``
    the FLOPs of the recorded segments, ``matmul_s`` the padded time of the segments of kind
    ``"matmul"`` (part of ``padded_s``). On a device timed by events (:class:`DeviceEvents`) the
    times are the device's, read when :attr:`Emulator.stats` is asked for.
    """

    segments: int = 0
    overruns: int = 0
    modeled_s: float = 0.0
    real_s: float = 0.0
    padded_s: float = 0.0
    worst_overrun: float = 0.0
    flops: float = 0.0
    matmul_s: float = 0.0

    def snapshot(self) -> "EmulationStats":
        return dataclasses.replace(self)

    def since(self, earlier: "EmulationStats") -> "EmulationStats":
        """The figures accumulated after ``earlier`` (a :meth:`snapshot`); ``worst_overrun`` is
        the running maximum, kept as is."""
        return EmulationStats(
            segments=self.segments - earlier.segments, overruns=self.overruns - earlier.overruns,
            modeled_s=self.modeled_s - earlier.modeled_s, real_s=self.real_s - earlier.real_s,
            padded_s=self.padded_s - earlier.padded_s, worst_overrun=self.worst_overrun,
            flops=self.flops - earlier.flops, matmul_s=self.matmul_s - earlier.matmul_s,
        )


class EmulatedOutOfMemoryError(WhaleError):
    """An emulated device ran out of its memory (``Emulation.enforce_memory``): what a GPU's
    out-of-memory error is on real hardware."""


def check_capacity(emulator: "Emulator", peak_bytes: Optional[int], step: Optional[int]) -> None:
    """Raise :class:`EmulatedOutOfMemoryError` when ``peak_bytes`` (this rank's measured peak of
    ``step``, or of its set-up when ``step`` is None) exceeds the emulated device's memory; no-op when
    the emulation does not enforce it."""
    cap = emulator.capacity_bytes
    if cap is None or peak_bytes is None or peak_bytes <= cap:
        return
    when = "during set-up (building the executor and filling its weights)" if step is None else f"in step {step}"
    what = "set-up" if step is None else "the step"
    raise EmulatedOutOfMemoryError(
        f"rank {emulator.rank}: emulated out of memory on device {emulator.device_name!r} {when}: {what} "
        f"peaked at {peak_bytes:,} bytes ({peak_bytes / 2**30:.4g} GiB), more than its capacity of {cap:,} bytes "
        f"({cap / 2**30:.4g} GiB, memory_gib in the cluster spec); plan for this cluster (whalelike plan picks "
        "micro-batch sizes, a ZeRO stage and recompute that fit), or use a smaller batch or a higher zero_stage")


class Emulator:
    """Pads compute segments of one rank to their modeled duration on the emulated device.

    A disabled emulator (no ``emulation`` block, or a device without ``emulated_speed``) runs
    segments as they are. ``half_efficiency_batch`` and ``memory_gbps`` are the device's
    efficiency curve and memory bandwidth (``Device.emulated_half_efficiency_batch``,
    ``Device.emulated_memory_gbps``; :meth:`for_device` reads them): None takes the emulation
    block's ``half_efficiency_batch``, and prices no bytes, respectively. ``clock`` times the
    segments of a disabled emulator (default :class:`HostClock`; :meth:`for_device` gives a CUDA
    rank :class:`DeviceEvents`); an enabled one pads on the host's clock and takes no other.
    """

    def __init__(self, speed: Optional[float], emulation: Optional[Emulation], rank: int = 0,
                 network: Optional[NetworkEmulator] = None, *, half_efficiency_batch: Optional[float] = None,
                 memory_gbps: Optional[float] = None, clock=None):
        self.enabled = emulation is not None and speed is not None
        if self.enabled and clock is not None and clock.deferred:
            raise ValueError(f"Emulator: clock {type(clock).__name__} times a real device's segments, but this "
                             f"emulator pads them (emulated speed {speed}), which it does on the host's clock; "
                             "leave clock out for an emulated device")
        self.clock = clock if clock is not None else HostClock()
        self._pending: list[_Pending] = []
        self._started = None       # the clock's mark at the current segment's start (device clocks)
        self.network = network   # the emulated network (runtime.emulation.network), None when off
        self.speed = speed
        self.emulation = emulation
        if half_efficiency_batch is None and emulation is not None:
            half_efficiency_batch = emulation.half_efficiency_batch
        self.half_efficiency_batch = half_efficiency_batch   # the device's curve; None: efficiency 1
        self.memory_gbps = memory_gbps                       # None: non-matmul bytes cost nothing
        self.rank = rank
        self.step = 0
        self._stats = EmulationStats()
        self._deadline: Optional[float] = None
        self._begun_at = 0.0
        self._modeled = 0.0
        self._flops = 0.0
        self._kind = "stage"
        self._busy_since: Optional[float] = None   # monotonic time at the current segment's start
        # the emulated device's memory, when the emulation enforces it (Emulation.enforce_memory)
        self.capacity_bytes: Optional[int] = None
        self.device_name = ""

    @classmethod
    def for_device(cls, cluster: Cluster, device_name: str, rank: int, precision: str = "fp32",
                   compute_device: Optional[torch.device] = None) -> "Emulator":
        """The emulator of ``device_name`` (run by ``rank``) training at ``precision`` (the plan's
        ``Plan.precision``): its emulated speed for that precision
        (:meth:`whalelike.cluster.Device.emulated`, a number or a per-dtype mapping in the spec).
        A SpecError names the device when it cannot run ``precision``. Without emulation its
        segments are timed by ``compute_device``'s clock (:func:`segment_clock`; None: this
        process's, CUDA events when CUDA is available)."""
        device = cluster.device(device_name)
        speed = device.emulated(precision)
        network = NetworkEmulator.of_cluster(cluster, device_name) if speed is not None else None
        enabled = cluster.emulation is not None and speed is not None
        emulator = cls(speed, cluster.emulation, rank, network,
                       half_efficiency_batch=device.emulated_half_efficiency_batch,
                       memory_gbps=device.emulated_memory_gbps,
                       clock=None if enabled else segment_clock(compute_device))
        emulator.device_name = device.name
        if emulator.enabled and cluster.emulation.enforce_memory:
            emulator.capacity_bytes = int(device.memory_gib * 2**30)
        if emulator.enabled:
            log.info("rank %d: emulating device %s at speed %.3g in %s, half efficiency at batch %s, non-matmul "
                     "bytes at %s GB/s (testing feature)", rank, device.name, speed, precision,
                     emulator.half_efficiency_batch, emulator.memory_gbps)
        return emulator

    @classmethod
    def disabled(cls, clock=None) -> "Emulator":
        return cls(None, None, clock=clock)

    # -- the segments' times ------------------------------------------------------------------------
    @property
    def device_timed(self) -> bool:
        """Whether segment times come from device events, read when :attr:`stats` is asked for."""
        return self.clock.deferred

    @property
    def measures(self) -> bool:
        """Whether a segment opened only to measure (not to pad) tells the monitor anything: the
        emulation pads it, or a device clock times it. Host-timed real segments on the CPU do too,
        but a caller that never opened them there keeps doing so (see the module docstring)."""
        return self.enabled or self.device_timed

    @property
    def stats(self) -> EmulationStats:
        """The cumulative figures, with every segment's time read (see the module docstring,
        "Segment clocks": on a device clock this waits for the last recorded segment's end event)."""
        self.settle()
        return self._stats

    @stats.setter
    def stats(self, fresh: EmulationStats) -> None:
        """Start counting afresh (a bench resets after its warm-up): pending segments are read first,
        so their times land in the figures being replaced, not in the new ones."""
        self.settle()
        self._stats = fresh

    @property
    def pending(self) -> int:
        """Segments whose device time has not been read yet."""
        return len(self._pending)

    def settle(self) -> None:
        """Read the device time of every segment recorded since the last read, in order."""
        while self._pending:
            segment = self._pending.pop(0)
            real = self.clock.seconds(segment.start, segment.end)
            self._add_time(real, segment.modeled, segment.kind)

    def _add_time(self, real: float, modeled: float, kind: str) -> None:
        self._stats.real_s += real
        self._stats.padded_s += max(real, modeled)
        if kind == "matmul":
            self._stats.matmul_s += max(real, modeled)

    def straggle_factor(self, kind: str = "stage") -> float:
        """Product of the factors of the stragglers slowing a segment of ``kind`` on this rank now."""
        factor = 1.0
        for s in self.emulation.stragglers if self.emulation else ():
            if s.applies(self.rank, self.step, kind):
                factor *= s.factor
        return factor

    def efficiency(self, samples: int) -> float:
        """The fraction of its peak at which this device runs the matmuls of a micro-batch of
        ``samples``: ``samples / (samples + h)`` with ``h`` its half-efficiency batch, else 1."""
        h = self.half_efficiency_batch
        return samples / (samples + h) if h else 1.0

    def modeled_seconds(self, flops: float, samples: int, kind: str = "stage", memory_bytes: float = 0.0) -> float:
        """Modeled duration of a segment of ``flops`` (matmul FLOPs) and ``memory_bytes`` (the
        bytes its non-matmul operators move) on ``samples`` samples on this device (the formula
        in the module docstring)."""
        _check_kind(kind)
        if memory_bytes < 0:
            raise ValueError(f"emulator segment memory_bytes must be >= 0 (bytes moved by the segment's non-matmul "
                             f"operators), got {memory_bytes!r}")
        bytes_priced = self.memory_gbps is not None and memory_bytes > 0
        if not self.enabled or samples <= 0 or (flops <= 0 and not bytes_priced):   # no work: nothing to model
            return 0.0
        seconds = 0.0
        if flops > 0:
            seconds += flops / (self.speed * self.emulation.base_gflops * 1e9 * self.efficiency(samples))
        if bytes_priced:
            seconds += memory_bytes / (self.memory_gbps * 1e9)
        return seconds * self.straggle_factor(kind)

    # -- deadline API (for computations that launch collectives from inside) ----------------
    def begin(self, flops: float, samples: int, kind: str = "stage", memory_bytes: float = 0.0) -> None:
        """Start a segment of ``kind`` (see :data:`SEGMENT_KINDS`) now; it may not end before its
        modeled duration has passed (``memory_bytes``: its non-matmul operators' bytes)."""
        self._modeled = self.modeled_seconds(flops, samples, kind, memory_bytes)
        self._flops = float(flops)
        self._kind = kind
        self._begun_at = time.monotonic()
        self._deadline = self._begun_at + self._modeled
        self._busy_since = self._begun_at
        self._started = self.clock.mark() if self.clock.deferred else None

    def wait_deadline(self) -> None:
        """Sleep until the current segment's modeled end (no-op once reached). Records the segment
        (on a device clock: its end event, the time read later, see :attr:`stats`)."""
        if self._deadline is None:
            return
        modeled = self._modeled
        stats = self._stats
        stats.segments += 1
        stats.modeled_s += modeled
        stats.flops += self._flops
        if self.clock.deferred:   # a real device (never padded): the time is the device's, read later
            self._pending.append(_Pending(self._started, self.clock.mark(), modeled, self._kind))
            self._deadline = self._busy_since = self._started = None
            return
        now = time.monotonic()
        real = now - self._begun_at
        self._add_time(real, modeled, self._kind)
        if self.enabled and modeled > 0:   # a segment without modeled work cannot overrun it
            if now > self._deadline:
                stats.overruns += 1
                stats.worst_overrun = max(stats.worst_overrun, real / modeled)
            else:
                time.sleep(self._deadline - now)
        self._deadline = None
        self._busy_since = None

    def wait_communication(self) -> None:
        """After a backward whose gradient all-reduce overlapped it (DDP's comm hook under network
        emulation): sleep until the last bucket's modeled end. No-op without network emulation or
        when no bucket was all-reduced. Not part of any compute segment."""
        if self.network is not None:
            self.network.wait_allreduces()

    def segment_ready(self, fraction: float) -> Optional[float]:
        """Monotonic time at which ``fraction`` of the open segment's modeled time has passed
        (when a gradient bucket of the backward is modeled to be ready), or None outside segments."""
        if self._deadline is None:
            return None
        return self._begun_at + min(max(fraction, 0.0), 1.0) * self._modeled

    def busy_for(self) -> Optional[float]:
        """Seconds spent so far in the current compute segment (its padding included), or None
        outside segments. Safe to call from another thread (it reads one attribute)."""
        since = self._busy_since
        return None if since is None else time.monotonic() - since

    @contextmanager
    def segment(self, flops: float, samples: int, kind: str = "stage", memory_bytes: float = 0.0):
        """Run the enclosed computation as one compute segment of ``kind`` (no collectives inside)."""
        self.begin(flops, samples, kind, memory_bytes)
        try:
            yield
        finally:
            self.wait_deadline()

    def pad_forward(self, module: nn.Module, flops_per_sample: float,
                    memory_bytes_per_sample: float = 0.0) -> Callable[[], None]:
        """Make every forward of ``module`` one compute segment of ``flops_per_sample`` x batch
        and ``memory_bytes_per_sample`` x batch (batch: dimension 0 of its first tensor argument).
        Returns a function that removes the padding.

        Hooks on the module itself, not on a wrapper around it: DDP's pre-forward may communicate
        (bucket rebuild on the second iteration), and that must stay outside the segment.
        """

        def begin(_module, args, kwargs):
            samples = _batch_size(args, kwargs)
            self.begin(flops_per_sample * samples, samples, "stage", memory_bytes_per_sample * samples)

        def end(_module, _args, _kwargs, _output):
            self.wait_deadline()

        handles = [module.register_forward_pre_hook(begin, with_kwargs=True),
                   module.register_forward_hook(end, with_kwargs=True, always_call=True)]

        def remove() -> None:
            for h in handles:
                h.remove()

        return remove


SEGMENT_KINDS = ("stage", "matmul")


def _check_kind(kind: str) -> None:
    if kind not in SEGMENT_KINDS:
        allowed = ", ".join(map(repr, SEGMENT_KINDS))
        raise ValueError(f"emulator segment kind must be one of {allowed} ('matmul' for one matrix "
                         f"multiplication, 'stage' for anything else), got {kind!r}")


def _batch_size(args: tuple, kwargs: dict) -> int:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
    raise ValueError("pad_forward: the module was called without a batched tensor argument")


@dataclass(frozen=True)
class Calibration:
    """The result of :func:`calibrate`: the largest safe ``base_gflops`` and how it was derived."""

    base_gflops: float
    flops: float          # FLOPs of the timed forward+backward
    real_s: float         # its median real time, alone
    contention: float     # ranks per core: how much slower it gets when every rank computes at once
    margin: float

    def __str__(self) -> str:
        return (f"base_gflops <= {self.base_gflops:.3g} (forward+backward of {self.flops / 1e9:.3g} GFLOP takes "
                f"{self.real_s * 1e3:.3g} ms alone, x{self.contention:.3g} for ranks per core, margin {self.margin:g})")


def calibrate(model: nn.Module, inputs: tuple, targets: torch.Tensor, loss_fn: Callable, speeds: Sequence[float],
              ranks: int, cores: Optional[int] = None, margin: float = 1.5, repeats: int = 5) -> Calibration:
    """Largest ``base_gflops`` for which a forward+backward of ``model`` fits inside its modeled time.

    Run it on the *smallest* micro-batch any rank will process (small batches do the least work
    per second, so they overrun first). ``speeds`` are the emulated speeds; the fastest device has
    the shortest modeled time and binds. ``ranks`` processes share ``cores`` cores (default: this
    machine's), so real time is scaled by ``max(1, ranks / cores)``; ``margin`` adds headroom for
    noise. FLOPs come from torch's ``FlopCounterMode``. The model's gradients are left dirty.
    """
    if not speeds or min(speeds) <= 0:
        raise ValueError(f"calibrate: speeds must be positive, got {list(speeds)}")

    def step():
        model.zero_grad(set_to_none=True)
        loss_fn(model(*inputs), targets).backward()

    with FlopCounterMode(display=False) as counter:
        step()
    flops = float(counter.get_total_flops())
    if flops <= 0:
        raise ValueError("calibrate: FlopCounterMode counted no FLOPs in the model's forward+backward")
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    real = statistics.median(times)
    contention = max(1.0, ranks / (cores or os.cpu_count() or 1))
    base = flops / (max(speeds) * margin * real * contention) / 1e9
    result = Calibration(base_gflops=base, flops=flops, real_s=real, contention=contention, margin=margin)
    log.info("emulation calibration: %s", result)
    return result
