"""Run a function on N local ranks of a gloo (or nccl) process group, for multi-process tests.

Usage (from a test module in ``tests/``; pytest puts this directory on ``sys.path``)::

    from dist_utils import run_ranks

    def _check(rank, world_size, lr):           # module-level: spawned processes import it by name
        ...                                     # the default process group is already initialised
        return {"loss": loss}                   # anything torch.save can write (tensors included)

    def test_something():
        results = run_ranks(_check, 4, args=(0.1,))   # list indexed by rank; raises if any rank failed
        assert_close(results[0]["loss"], results[3]["loss"])

Each rank is a fresh process with the environment ``torchrun`` would give it
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` on a
free port), so code that initialises the process group itself (``runtime.Engine``) runs exactly as
under torchrun: pass ``init_process_group=False`` for that. Otherwise the harness initialises the
default group (``backend``, ``pg_timeout_s``) before calling ``fn`` and destroys it afterwards.

Why not ``torch.multiprocessing.spawn``: it kills the surviving ranks as soon as one fails, which
hides the survivors' errors, and fault tests need exactly those (a rank that dies must make the
others time out with a clear message). Here every rank runs to completion or to ``timeout_s``, and
:func:`spawn_ranks` returns one :class:`RankOutcome` per rank (value, error, exit code) so a test can
assert on each; :func:`run_ranks` is the strict form that raises :class:`RanksFailed` listing every
failed rank's traceback.

Why a forkserver and not ``spawn``: a spawned rank imports torch, transformers and the library
anew, seconds of CPU each, and the suite starts over a hundred ranks. The forkserver (one per test
process, started on first use) imports them once (:data:`PRELOAD`) and never runs a tensor op or a
collective, so every rank is still a fresh process with no torch thread pools, no process group
and no state from other tests; it only starts with the modules imported. Each rank takes exactly
its launcher's environment at launch (the server's own, from its start, is replaced), as a spawned
process would.

Each rank also reports the CPU seconds it used (:data:`RANK_CPU_S` sums them in the launching
process), which ``tests/conftest.py`` adds to each test's own and its subprocesses' CPU: the
suite's budget is CPU on two cores, and a rank's CPU is otherwise invisible to the test process
(ranks are the forkserver's children, not its own).

Results travel back as ``torch.save`` bytes rather than as tensors through a torch queue, so a
rank may exit right after returning without invalidating shared-memory handles.
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import io
import logging
import multiprocessing as std_mp
import multiprocessing.connection as mp_connection
import os
import queue as queue_mod
import resource
import signal
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

# imported once by the forkserver, so ranks start with them loaded (a module missing here is skipped
# by the server and imported by the rank as usual). Besides the library: torch._dynamo, which the
# first torch.optim optimizer a rank builds imports (half a second to a second of CPU, in nearly every rank);
# transformers.modeling_utils, which the first Hugging Face model class a rank builds imports (half
# a second); pytest, which the test modules a rank unpickles its function from import. The library
# imports some modules only where they are used (a cold process that never uses them skips them):
# FSDP2 (ZeRO), scipy (measured speed curves, the link fit), named here so that ranks find them loaded.
PRELOAD = ["torch", "torch.distributed", "torch.fx", "torch.distributed.checkpoint", "torch.nn.parallel",
           "torch._dynamo", "transformers", "transformers.modeling_utils", "pytest", "whalelike", "planner",
           "runtime", "runtime.engine", "runtime.parallel.pipeline", "runtime.checkpoint",
           "runtime.replicas.fsdp_sync", "scipy.interpolate", "scipy.optimize", "dist_utils", "reference",
           # what ranks capturing with torch.export, or building the suite's transformers models, import
           "torch.export._trace", *(f"transformers.models.{m}.modeling_{m}" for m in (
               "gpt2", "llama", "phi3", "vit", "t5", "swin", "qwen2_moe", "olmoe", "mixtral", "bert", "bart", "resnet",
               "deberta_v2")),
           "frozen_heap"]   # last: the preloaded heap into gc's permanent generation (tests/frozen_heap.py)


# CPU seconds (user + system) of every rank this process launched that reported back, summed
RANK_CPU_S = [0.0]


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _context():
    """The forkserver context, its server started (with :data:`PRELOAD`) before any environment
    change of a launch, so the server's environment is the test process's own."""
    from multiprocessing import forkserver

    ctx = std_mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    # multiprocessing hands the server our sys.path, and this Python's (3.11) forkserver main() takes it and
    # never applies it: the server would start with the interpreter's own path, in which this folder's
    # modules (dist_utils, reference, frozen_heap) are not found, and the preload would skip them
    # without a word (the preloaded heap then never frozen). PYTHONPATH, read when the server starts,
    # puts this folder on its path; the ranks' own sys.path is ours anyway (multiprocessing sends it
    # with every launch) and their environment the launch's.
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(os.path.abspath(__file__)), before) if p)
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before
    return ctx


@dataclass
class RankOutcome:
    """What one rank did: ``value`` (``fn``'s return), or ``error`` (the formatted traceback) and
    ``error_type`` (the exception's class name); ``exitcode`` is the process's exit status
    (``None`` when it hung and was killed at ``timeout_s``)."""

    rank: int
    value: Any = None
    error: Optional[str] = None
    error_type: Optional[str] = None
    exitcode: Optional[int] = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.exitcode == 0


class RanksFailed(AssertionError):
    """One or more ranks raised, crashed or hung; the message holds every failed rank's story."""

    def __init__(self, outcomes: list[RankOutcome]):
        self.outcomes = outcomes
        parts = []
        for o in outcomes:
            if o.ok:
                continue
            if o.error is not None:
                parts.append(f"--- rank {o.rank} raised {o.error_type}:\n{o.error}")
            elif o.exitcode is None:
                parts.append(f"--- rank {o.rank} hung and was killed")
            else:
                parts.append(f"--- rank {o.rank} exited with code {o.exitcode} without a result")
        super().__init__("\n".join(parts))


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it; the race window is tiny)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    *,
    init_process_group: bool = True,
    backend: str = "gloo",
    pg_timeout_s: float = 60.0,
    timeout_s: float = 180.0,
    env: Optional[dict[str, str]] = None,
    warm: Optional[Callable[[], Any]] = None,
) -> list[RankOutcome]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes; one outcome per rank.

    ``timeout_s`` bounds the whole run: ranks still alive then are killed and reported as hung.
    ``env`` adds environment variables to every rank; ``OMP_NUM_THREADS`` defaults to 1 (several
    ranks share few cores).

    ``warm`` (a module-level function of no arguments, or ``(function, args)``): run once, in the
    ranks' environment, by a process that then forks the ranks, so that they start with what it
    left behind. Its use is whalelike's capture cache: ``warm`` captures the models every rank will
    capture (same classes, configuration and input shapes), once, and each rank's own capture is
    then a cache hit (a fifth of a fresh capture's CPU) instead of a capture of its own. The ranks
    run exactly the code they run without it; a warm-up that raises fails every rank with its
    traceback. ``warm`` runs no collective and creates no process group (the ranks would inherit it).
    """
    ctx = _context()
    queue = ctx.Queue()
    base_env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    environment = {**os.environ, **base_env}   # each rank's, exactly (see _rank_main)
    common = (fn, world_size, args, init_process_group, backend, pg_timeout_s, queue, environment)
    if warm is None:
        procs = [ctx.Process(target=_rank_main, args=(common[0], rank, *common[1:]), daemon=False)
                 for rank in range(world_size)]
    else:
        procs = [ctx.Process(target=_zygote_main, args=(warm, "MASTER_PORT" not in (env or {}), *common),
                             daemon=False)]
    for p in procs:
        p.start()
    outcomes = {rank: RankOutcome(rank) for rank in range(world_size)}
    reported: set[int] = set()
    exits: dict[int, int] = {}     # the ranks' exit codes, from the warm-up process
    deadline = time.monotonic() + timeout_s
    # Drain the queue while waiting: a child blocks on exit until its queued bytes are read.
    while (len(reported) < world_size or (warm is not None and len(exits) < world_size)) \
            and time.monotonic() < deadline:
        if not any(p.is_alive() for p in procs) and queue.empty():
            break
        try:
            rank, kind, payload, cpu_s = queue.get(timeout=0.2)
        except queue_mod.Empty:
            continue
        RANK_CPU_S[0] += cpu_s
        if kind in ("exit", "warm"):
            if kind == "exit":
                exits[rank] = payload
            continue
        reported.add(rank)
        if kind == "ok":
            outcomes[rank].value = torch.load(io.BytesIO(payload), weights_only=False)
        else:
            outcomes[rank].error_type, outcomes[rank].error = payload
    for i, p in enumerate(procs):
        p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            if warm is not None:      # the ranks are its children, in its process group
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
            p.kill()
            p.join()
            if warm is None:
                outcomes[i].exitcode = None
        elif warm is None:
            outcomes[i].exitcode = p.exitcode
    while warm is not None:   # what the warm-up process sent before it ended (or was killed)
        try:
            rank, kind, payload, cpu_s = queue.get(timeout=0.05)
        except (queue_mod.Empty, OSError, EOFError):
            break
        RANK_CPU_S[0] += cpu_s
        if kind == "exit":
            exits[rank] = payload
    if warm is not None:
        for rank in range(world_size):
            outcomes[rank].exitcode = exits.get(rank)
    queue.close()
    return [outcomes[r] for r in range(world_size)]


def run_ranks(fn: Callable[..., Any], world_size: int, args: tuple = (), **kwargs) -> list[Any]:
    """Like :func:`spawn_ranks` but returns the values by rank and raises :class:`RanksFailed` if
    any rank raised, crashed or hung."""
    outcomes = spawn_ranks(fn, world_size, args, **kwargs)
    if not all(o.ok for o in outcomes):
        raise RanksFailed(outcomes)
    return [o.value for o in outcomes]


def _rank_main(fn, rank, world_size, args, init_pg, backend, pg_timeout_s, queue, environment) -> None:
    # the launcher's environment at launch, not the forkserver's from its start
    os.environ.clear()
    os.environ.update(environment, RANK=str(rank), LOCAL_RANK=str(rank))
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():   # torch is imported already: apply it here
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    try:
        if init_pg:
            if backend == "nccl":
                torch.cuda.set_device(rank % torch.cuda.device_count())
            dist.init_process_group(backend, rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=pg_timeout_s))
        try:
            value = _profiled(fn, rank, world_size, args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        buf = io.BytesIO()
        torch.save(value, buf)
        queue.put((rank, "ok", buf.getvalue(), _cpu_s()))
    except BaseException as e:  # report everything, including SystemExit from the code under test
        queue.put((rank, "error", (type(e).__name__, traceback.format_exc()), _cpu_s()))
        queue.close()
        queue.join_thread()
        os._exit(1)
    queue.close()
    queue.join_thread()


def _profiled(fn, rank: int, world_size: int, args: tuple):
    """``fn(rank, world_size, *args)``, under cProfile when ``WHALELIKE_RANK_PROFILE`` names a folder:
    each rank's statistics go to ``FOLDER/<test>-<fn>-rank<r>.prof`` (``python -m pstats``, or
    ``pstats.Stats(path).sort_stats("cumulative").print_stats(40)``), to see where a test's ranks
    spend their CPU."""
    folder = os.environ.get("WHALELIKE_RANK_PROFILE")
    if not folder:
        return fn(rank, world_size, *args)
    import cProfile
    import re

    test = re.sub(r"[^A-Za-z0-9_.-]+", "_", os.environ.get("PYTEST_CURRENT_TEST", "run").split(" ")[0])[-120:]
    profile = cProfile.Profile()
    profile.enable()
    try:
        return fn(rank, world_size, *args)
    finally:
        profile.disable()
        os.makedirs(folder, exist_ok=True)
        profile.dump_stats(os.path.join(folder, f"{test}-{getattr(fn, '__name__', 'fn')}-rank{rank}.prof"))


def _zygote_main(warm, repick_port, fn, world_size, args, init_pg, backend, pg_timeout_s, queue,
                 environment) -> None:
    """Run the warm-up in the ranks' environment, then fork the ranks and report their exit codes
    (``spawn_ranks``' ``warm``); its own process group, so that a hung run is killed whole."""
    os.setpgid(0, 0)
    os.environ.clear()
    os.environ.update(environment)
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    warm_fn, warm_args = warm if isinstance(warm, tuple) else (warm, ())
    import numpy

    # the ranks start from the random state they would have had (a warm-up building models draws from
    # it); Python's own ``random`` is reseeded in every forked child by Python itself, with or without
    seeds = (torch.random.get_rng_state(), numpy.random.get_state())
    try:
        warm_fn(*warm_args)
        torch.random.set_rng_state(seeds[0])
        numpy.random.set_state(seeds[1])
    except BaseException:  # noqa: BLE001 - every rank fails with the warm-up's story
        story = traceback.format_exc()
        for rank in range(world_size):
            queue.put((rank, "error", ("WarmUpFailed", f"the warm-up {warm_fn.__name__} raised:\n{story}"), 0.0))
        for rank in range(world_size):
            queue.put((rank, "exit", 1, 0.0))
        queue.put((-1, "warm", None, _cpu_s()))
        queue.close()
        queue.join_thread()
        os._exit(1)
    gc.collect()
    gc.freeze()   # what the warm-up made, like the preloaded heap (tests/frozen_heap.py): ranks never walk it
    if repick_port:
        # the port was free when the launch began; the warm-up took seconds, in which the OS may have
        # given it to another process (an outgoing connection, another test's rank 0): choose it now
        environment = {**environment, "MASTER_PORT": str(free_port())}
    fork = std_mp.get_context("fork")
    ranks = [fork.Process(target=_rank_main, args=(fn, rank, world_size, args, init_pg, backend, pg_timeout_s,
                                                  queue, environment), daemon=False) for rank in range(world_size)]
    for p in ranks:
        p.start()
    running = dict(enumerate(ranks))
    while running:   # each rank's exit status as it ends (a hung one's never comes: the launcher kills us)
        ended = mp_connection.wait([p.sentinel for p in running.values()])
        for rank, p in list(running.items()):
            if p.sentinel in ended:
                p.join()
                queue.put((rank, "exit", p.exitcode, 0.0))
                del running[rank]
    queue.put((-1, "warm", None, _cpu_s()))
    queue.close()
    queue.join_thread()


class LogLines(logging.Handler):
    """The messages a rank's logger records (INFO and up), for a rank function to return:
    ``lines = LogLines.attach("runtime.tensor.shard_pass")``, then ``lines.lines``."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    @classmethod
    def attach(cls, name: str) -> "LogLines":
        handler = cls()
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        return handler
