"""What the multi-process benchmarks share: seconds per step between barriers, and the spawn.

A barrier before and after the timed steps means the slowest rank decides, as it does for a real
training job; imported by the benchmark scripts, which Python runs with ``bench/`` on its path.
"""
from __future__ import annotations

import os
import tempfile
import time
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp


def spawn_ranks(worker: Callable, args: Any, world: int) -> dict:
    """Run ``worker(rank, init_file, args, results)`` on ``world`` spawned ranks (``init_file`` is a
    fresh file for ``init_process_group``'s ``file://`` rendezvous); returns what they put in the
    shared ``results`` dict."""
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(worker, args=(os.path.join(tmp, "init"), args, results), nprocs=world, join=True)
        return dict(results)


def seconds_per_step(step: Callable[[], None], steps: int) -> float:
    """Mean seconds per call of ``step`` over ``steps`` calls (a collective: every rank calls it)."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    return (time.perf_counter() - start) / steps
