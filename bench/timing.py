"""What the multi-process benchmarks share: seconds per step between barriers, and the spawn.

A barrier before and after the timed steps means the slowest rank decides, as it does for a real
training job; imported by the benchmark scripts, which Python runs with ``bench/`` on its path.
Ranks meet through a fresh file (``file://`` rendezvous), so no port is chosen; a bench whose ranks
meet as under torchrun (``env://``, ``MASTER_PORT``) takes :func:`free_port`, so two benches (or
a bench and the test suite) can run at once.

Ranks are started with ``spawn`` (a fresh interpreter each, which imports torch and the library
again: ~3 s of CPU per rank on this machine). A smoke run (``--smoke``, bench/smoke.py) forks them
from the bench process instead, where those imports are done and no torch op has run yet, so a
10-rank bench starts in a fraction of a second; what the ranks then run is the same
(:func:`start_method`).
"""
from __future__ import annotations

import gc
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import smoke

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# console scripts the benches start, by name: their entry points (what a smoke run calls in a fork, Forked)
ENTRY_POINTS = {"torchrun": ("torch.distributed.run", "main"), "whalelike": ("whalelike.cli", "main")}


class Forked:
    """A smoke run's stand-in for ``subprocess.Popen`` of a console script (``torchrun``, ``whalelike``):
    the bench process forked, in a new session, its output (stdout and stderr merged) on a pipe, the
    environment, working directory and ``sys.argv`` of the command, calling the script's entry point
    (``ENTRY_POINTS``) and exiting with its status. The same code runs as in the process the script
    would start (a torchrun agent then starts its workers as fresh interpreters, as always); only
    the interpreter's start-up and its imports (torch: seconds of CPU per process) are skipped,
    as :func:`start_method` does for ranks. ``cwd``: the working directory (the repository's root
    by default)."""

    def __init__(self, command: list[str], env: dict[str, str], cwd: str = ROOT):
        import importlib

        module, name = ENTRY_POINTS[os.path.basename(command[0])]
        entry = getattr(importlib.import_module(module), name)
        read, write = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:   # the child: never returns into the bench
            code = 1
            try:
                gc.freeze()   # the inherited heap: left alone by the collector (no copy of its pages)
                os.setsid()
                os.close(read)
                for fd in (1, 2):
                    os.dup2(write, fd)
                os.close(write)
                os.environ.clear()
                os.environ.update(env)
                os.chdir(cwd)
                sys.stdout = open(1, "w", buffering=1, closefd=False)
                sys.stderr = open(2, "w", buffering=1, closefd=False)
                sys.argv = [command[0], *command[1:]]
                code = entry()
                code = code if isinstance(code, int) else 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:  # noqa: BLE001 - as the interpreter does for an uncaught exception
                import traceback
                traceback.print_exc()
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)
        os.close(write)
        self.pid, self.returncode = pid, None
        self.stdout = os.fdopen(read, "r", errors="replace")

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.pid, timeout)
            time.sleep(0.02)
        return self.returncode


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it; the race window is tiny), as
    ``tests/dist_utils.py`` picks them."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_method() -> str:
    """How bench ranks start: ``spawn``, or ``fork`` in a smoke run (see the module doc). Before a
    fork, the modules a capture (``wl.capture``, the Engine) imports on first use are imported here
    once (~0.6 s of CPU), so the ranks inherit them instead of each importing them again; importing
    runs no torch op, so the forked ranks start as clean as spawned ones."""
    if not smoke.active():
        return "spawn"
    import torch._dynamo  # noqa: F401
    import torch.fx  # noqa: F401
    return "fork"


def spawn_ranks(worker: Callable, args: Any, world: int, warm: Optional[Callable[[], Any]] = None) -> dict:
    """Run ``worker(rank, init_file, args, results)`` on ``world`` new ranks (``init_file`` is a
    fresh file for ``init_process_group``'s ``file://`` rendezvous); returns what they put in the
    shared ``results`` dict.

    ``warm`` (no arguments; smoke runs only): called once here before the ranks fork, so that they
    inherit what it leaves in the process, e.g. whalelike's capture cache filled by capturing the
    models every rank will capture (the same classes, configurations, annotations, devices and
    example inputs), which makes the ranks' captures hits instead of one trace per rank. The ranks
    then run exactly the code they run without it. It must run no collective and create no process
    group; the random state (torch's, numpy's) is put back as it was, so the ranks draw what they
    would have drawn. A spawned rank (a full-size run) inherits nothing: ``warm`` is not called."""
    method = start_method()
    if warm is not None and method == "fork":
        warmed(warm)
    with tempfile.TemporaryDirectory() as tmp, results_manager() as manager, frozen(method == "fork"):
        results = manager.dict()
        mp.start_processes(worker, args=(os.path.join(tmp, "init"), args, results), nprocs=world, join=True,
                           start_method=method)
        return dict(results)


def results_manager():
    """The ``multiprocessing`` manager whose dict the ranks put their results in, forked from this
    process. Not the default context's: where that is ``forkserver`` (a process the test suite's
    forkserver started, or Python 3.14's default), the manager's first start launches a fresh
    forkserver, which imports this bench script (``__main__``) and so torch and the library again:
    seconds of CPU for a process that only holds a dict. The manager runs no torch code, so a
    fork is as clean as any start method for it."""
    return mp.get_context("fork").Manager()


@contextmanager
def frozen(active: bool = True):
    """While the ranks fork and run: the objects of this process (torch, the library, a warm-up's
    captures) in the collector's permanent generation (``gc.freeze()``), so that a collection in a
    forked rank (the benches' own ``gc.collect()`` between measurements, and the automatic ones)
    walks only what the rank made, not the whole inherited heap, which it would also copy page by
    page (writing each object's header). What a rank makes is collected as before."""
    if not active:
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def warmed(warm: Callable[[], Any]) -> Any:
    """``warm()`` with the random state (torch's, numpy's) put back afterwards, and one intra-op
    thread while it runs (as the ranks it prepares run), its answer returned; see :func:`spawn_ranks`."""
    import numpy

    seeds, threads = (torch.random.get_rng_state(), numpy.random.get_state()), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return warm()
    finally:
        torch.set_num_threads(threads)
        torch.random.set_rng_state(seeds[0])
        numpy.random.set_state(seeds[1])


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


def timed(fn: Callable[[], Any]) -> float:
    """Seconds of one call of ``fn`` between barriers (a collective: every rank calls it)."""
    return seconds_per_step(fn, 1)


def seconds_per_step(step: Callable[[], None], steps: int) -> float:
    """Mean seconds per call of ``step`` over ``steps`` calls (a collective: every rank calls it)."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    return (time.perf_counter() - start) / steps
