"""What the multi-process benchmarks measure: seconds per step between barriers.

A barrier before and after the timed steps means the slowest rank decides, as it does for a real
training job; imported by the benchmark scripts, which Python runs with ``bench/`` on its path.
"""
from __future__ import annotations

import time
from typing import Callable

import torch.distributed as dist


def seconds_per_step(step: Callable[[], None], steps: int) -> float:
    """Mean seconds per call of ``step`` over ``steps`` calls (a collective: every rank calls it)."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    return (time.perf_counter() - start) / steps
