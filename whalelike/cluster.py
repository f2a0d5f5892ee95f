"""Cluster specs: hosts, devices and network, from YAML or a built-in preset.

The *nominal* figures (``peak_tflops``, ``measured_tflops``) are what the planner may read. The
``emulated_speed`` of a device and the ``emulation`` block are the hidden truth of the emulated
"hardware" (DESIGN.md section 4): only the runtime's emulator reads them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class Device:
    name: str                               # unique, e.g. "v100-0"
    kind: str                               # e.g. "V100-32GB"
    host: str
    peak_tflops: float
    memory_gib: float
    measured_tflops: Optional[float] = None  # achieved TFLOPS from profiling, preferred by the planner
    emulated_speed: Optional[float] = None   # relative speed of an emulated device (runtime only)


@dataclass(frozen=True)
class Network:
    intra_host_gbps: float   # GB/s between devices on one host
    inter_host_gbps: float   # GB/s between hosts
    latency_us: float


@dataclass(frozen=True)
class Straggler:
    """Multiply the modeled time of ``rank`` by ``factor`` for steps in [start_step, end_step)."""

    rank: int
    factor: float
    start_step: int = 0
    end_step: Optional[int] = None


@dataclass(frozen=True)
class Emulation:
    """How the runtime emulates unequal devices on homogeneous hardware.

    modeled time of a segment = flops / (emulated_speed * base_gflops * 1e9) / efficiency(batch),
    efficiency(b) = b / (b + half_efficiency_batch) when ``half_efficiency_batch`` is set, else 1.
    """

    base_gflops: float
    half_efficiency_batch: Optional[float] = None
    stragglers: tuple[Straggler, ...] = ()


@dataclass(frozen=True)
class Cluster:
    name: str
    devices: tuple[Device, ...]     # in rank order
    network: Network
    emulation: Optional[Emulation] = None

    @property
    def hosts(self) -> list[str]:
        return list(dict.fromkeys(d.host for d in self.devices))

    def device(self, name: str) -> Device:
        for d in self.devices:
            if d.name == name:
                return d
        raise KeyError(name)
