"""Heterogeneity emulation: make a homogeneous CPU machine behave like an unequal cluster.

DESIGN.md section 4. Each compute segment (a forward or backward of a stage for one micro-batch)
takes ``max(real time, modeled time)``: the real computation runs (results stay exact), then the
rank sleeps for the rest of the modeled time. Modeled time comes from the segment's FLOPs and the
emulated device's speed, never from measured wall time, so waiting on other ranks can never feed
back into it. Segments whose real time overran the model are counted and reported.

Collectives must stay outside segments. Where a collective is launched from inside a computation
(DDP's gradient all-reduce fires during backward), call :meth:`Emulator.begin` before the
computation and :meth:`Emulator.wait_deadline` right before the collective is launched.
"""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

from whalelike.cluster import Cluster, Emulation

log = logging.getLogger(__name__)


@dataclass
class EmulationStats:
    segments: int = 0
    overruns: int = 0
    modeled_s: float = 0.0
    real_s: float = 0.0


class Emulator:
    """Pads compute segments of one rank to their modeled duration on the emulated device.

    A disabled emulator (no ``emulation`` block, or a device without ``emulated_speed``) runs
    segments as they are.
    """

    def __init__(self, speed: Optional[float], emulation: Optional[Emulation], rank: int = 0):
        self.enabled = emulation is not None and speed is not None
        self.speed = speed
        self.emulation = emulation
        self.rank = rank
        self.step = 0
        self.stats = EmulationStats()
        self._deadline: Optional[float] = None
        self._begun_at = 0.0

    @classmethod
    def for_device(cls, cluster: Cluster, device_name: str, rank: int) -> "Emulator":
        device = cluster.device(device_name)
        emulator = cls(device.emulated_speed, cluster.emulation, rank)
        if emulator.enabled:
            log.info("rank %d: emulating device %s at speed %.3g (testing feature)", rank, device.name, device.emulated_speed)
        return emulator

    @classmethod
    def disabled(cls) -> "Emulator":
        return cls(None, None)

    def straggle_factor(self) -> float:
        factor = 1.0
        for s in self.emulation.stragglers if self.emulation else ():
            if s.rank == self.rank and s.start_step <= self.step and (s.end_step is None or self.step < s.end_step):
                factor *= s.factor
        return factor

    def modeled_seconds(self, flops: float, samples: int) -> float:
        """Modeled duration of a segment of ``flops`` on ``samples`` samples on this device."""
        if not self.enabled:
            return 0.0
        em = self.emulation
        efficiency = 1.0
        if em.half_efficiency_batch:
            efficiency = samples / (samples + em.half_efficiency_batch)
        return flops / (self.speed * em.base_gflops * 1e9 * efficiency) * self.straggle_factor()

    # -- deadline API (for computations that launch collectives from inside) ----------------
    def begin(self, flops: float, samples: int) -> None:
        """Start a segment now; it may not end before its modeled duration has passed."""
        self._begun_at = time.perf_counter()
        self._deadline = self._begun_at + self.modeled_seconds(flops, samples)

    def wait_deadline(self) -> None:
        """Sleep until the current segment's modeled end (no-op once reached). Records the segment."""
        if self._deadline is None:
            return
        now = time.perf_counter()
        real = now - self._begun_at
        modeled = self._deadline - self._begun_at
        self.stats.segments += 1
        self.stats.real_s += real
        self.stats.modeled_s += modeled
        if self.enabled:
            if now > self._deadline:
                self.stats.overruns += 1
            else:
                time.sleep(self._deadline - now)
        self._deadline = None

    @contextmanager
    def segment(self, flops: float, samples: int):
        """Run the enclosed computation as one compute segment (no collectives inside)."""
        self.begin(flops, samples)
        try:
            yield
        finally:
            self.wait_deadline()
