"""Each step's peak memory on this rank, measured, so the planner's predictions can be checked.

On a GPU the caching allocator counts every byte: ``torch.cuda.reset_peak_memory_stats`` before the
step and ``torch.cuda.max_memory_allocated`` after it, at no cost. A CPU has no such counter, so
the CPU meter is torch's own ``torch.distributed._tools.mem_tracker.MemTracker`` (the tracker
FSDP's memory estimation is built on): a dispatch mode that sees every tensor storage an operator
allocates and frees, forward and backward, and knows the parameters, gradients and optimizer
state it is told about (``track_external``). It slows each operator down (3-5x on small layers),
so on CPU it runs only when asked (``Engine(measure_memory=True)``, ``train.py
--measure-memory``); on CUDA it is on by default.

What is measured is the peak of the bytes alive during the step, counted from the step's start
(parameters, buffers and optimizer state alive then, plus everything allocated in the step), the
quantity the planner's memory model predicts (:mod:`planner.devices.memory`): the CPU figure
counts tensor storages (no allocator rounding), the CUDA figure the allocator's blocks.

Invariant: measuring never changes what the step computes (the tracker only observes), and a
step's figure is its own peak (reset before every step).
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.nn as nn

log = logging.getLogger(__name__)


class MemoryMeter:
    """Peak bytes of each step on ``device``; :meth:`step` is a context around one step and
    :attr:`peak_bytes` its result (None when not measured)."""

    def __init__(self, device: torch.device, enabled: Optional[bool] = None):
        self.device = device
        self.enabled = device.type == "cuda" if enabled is None else bool(enabled)
        self.peak_bytes: Optional[int] = None

    @contextmanager
    def step(self, modules: list[nn.Module], optimizer: Optional[torch.optim.Optimizer]) -> Iterator[None]:
        self.peak_bytes = None
        if not self.enabled:
            yield
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            yield
            torch.cuda.synchronize(self.device)
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
            return
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        for module in modules:
            tracker.track_external(module)
        if optimizer is not None:
            tracker.track_external(optimizer)
        with tracker:
            yield
        peaks = tracker.get_tracker_snapshot("peak")
        self.peak_bytes = int(sum(per_device.get("Total", 0) for per_device in peaks.values()))
