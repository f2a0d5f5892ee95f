"""What the multi-process benchmarks share: seconds per step between barriers, and the spawn.

A barrier before and after the timed steps means the slowest rank decides, as it does for a real
training job; imported by the benchmark scripts, which Python runs with ``bench/`` on its path.
"""
from __future__ import annotations

import logging
import os
import tempfile
import time
from contextlib import contextmanager
from typing import Any, Callable

import torch
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


@contextmanager
def process_group(rank: int, init_file: str, world: int, log_level: int = logging.WARNING):
    """What every spawned bench rank does around its work: quiet logging, one intra-op thread (the
    ranks share the machine's cores), a gloo group over ``init_file``, destroyed on the way out."""
    logging.basicConfig(level=log_level)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def seconds_per_step(step: Callable[[], None], steps: int) -> float:
    """Mean seconds per call of ``step`` over ``steps`` calls (a collective: every rank calls it)."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    return (time.perf_counter() - start) / steps
