"""``profile_cluster``: every device of a cluster measured at once, one rank per device, under torchrun.

The run, on every rank (Poplar's online profiling, seed paper 002, section "Online Profiling"):

1. checks that need no peer (world size against the cluster's devices, the precision, the
   settings), so a bad run fails alike on every rank before the rendezvous;
2. the process group, this rank's device and its emulator (:meth:`runtime.emulation.compute.Emulator.for_device`
   at the precision: on emulated hardware the emulation is what gets measured);
3. the model captured on the device (every rank the same :class:`~whalelike.graphs.taskgraph.TaskGraphs`);
4. rank 0 looks each device kind up in the cache (:mod:`runtime.profiling.cache`) and tells the
   others; a rank whose kind is cached takes those figures;
5. every other rank measures its device (:class:`DeviceMeasurement`): the largest batch by Poplar's
   Algorithm 1 (:mod:`runtime.profiling.search`) over whole training steps that fit or run out of
   memory (:meth:`runtime.profiling.steps.UnitStep.fits`), then, once every rank has its largest
   batch, each unit's forward and backward time at the powers of two up to it and at it,
   ``warmup`` steps then the median of ``repeats`` (and each step's time outside its units' segments);
   then, all measuring ranks at once, the optimizer's update, each timed update after a step at the
   largest timed batch and a barrier (:meth:`DeviceMeasurement.timed_update`);
6. all ranks gather the devices' figures, then time the links and a ring all-reduce over every device
   (:mod:`runtime.profiling.links`);
7. rank 0 stores what was measured in the cache. Every rank returns the same
   :class:`planner.devices.profile.Profile`.

Rank 0 draws a progress bar while the ranks work (:mod:`runtime.profiling.progress`) and prints
the total time. Every collective is bounded by ``timeout_s`` (the process group's timeout).

Invariant: a rank measures only its own device, and every rank ends with the identical profile
(device figures gathered, link fits and the elapsed time broadcast), so whichever rank writes it,
the file is the same.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import statistics
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from planner.devices.profile import DeviceProfile, Profile
from runtime import distributed
from runtime.emulation.compute import Emulator
from runtime.profiling import cache
from runtime.profiling.links import measure_collective, measure_links
from runtime.profiling.progress import FAILED, Board
from runtime.profiling.search import NothingFitsError, find_max_batch, timed_batches
from runtime.profiling.steps import UnitStep
from runtime.training.precision import Precision
from whalelike.cluster import Cluster
from whalelike.errors import WhaleError
from whalelike.graphs.capture import capture
from whalelike.spec import check_fields
from whalelike.workload import Workload

log = logging.getLogger(__name__)

DEFAULT_CAP = 1024
RETRIES_PER_REPEAT = 2   # timed steps that overran on emulated hardware are run again, at most this many per repeat
_runs = 0     # profiling runs of this process (the progress keys of each run are its own)


class ProfilingError(WhaleError):
    """A profiling run cannot start or cannot finish (the message names the device or value and the fix)."""


def profile_cluster(workload: Workload, cluster: Cluster, *, precision: str = "fp32", optimizer: str = "adamw",
                    unit: str = "taskgraph", cap: int = DEFAULT_CAP, warmup: int = 1, repeats: int = 3,
                    cache_directory: Optional[str] = None, refresh: bool = False, timeout_s: float = 300.0,
                    progress: bool = True, command: str = "") -> Profile:
    """Measure every device of ``cluster`` for ``workload``'s model (collective: every rank of the
    torchrun world calls it; see the module docstring). ``unit``: time each ``"taskgraph"`` or
    ``"layer"``; ``cap``: the largest batch tried; ``refresh``: measure even what the cache holds;
    ``command``: how the user launched it, for error messages."""
    global _runs
    started = time.perf_counter()
    rank, world = _launched(cluster, command)
    settings = cache.Settings(optimizer=optimizer, unit=unit, cap=cap, warmup=warmup, repeats=repeats)
    check_fields(settings, "profile: ", ProfilingError)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
        raise ProfilingError(f"profile: timeout_s (--timeout) must be a positive, finite number of seconds (how long "
                             f"a collective may wait for a peer), got {timeout_s!r}; e.g. 300")
    cluster.check_precision(precision)
    recipe = Precision(precision)
    if workload.example_kwargs:
        keywords = ", ".join(workload.example_kwargs)
        raise ProfilingError(f"profile: the model is called with keyword inputs ({keywords}); "
                             "profiling cuts it into units as the pipeline does, which passes positional inputs only: "
                             "make the factory's example_args carry every input")
    distributed.init(timeout_s)
    device = distributed.device()
    recipe.check_device(device)
    me = cluster.devices[rank]
    emulator = Emulator.for_device(cluster, me.name, rank, precision=precision)
    _runs += 1
    board = Board(rank, world, run=_runs, enabled=progress)
    board.report(0, 1, "capturing the model")

    model = workload.model.to(device).train()
    example = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in workload.example_args)
    graphs = capture(model, example, optimizer=optimizer)
    fingerprint = graphs.fingerprint

    directory = cache.cache_dir(cache_directory)
    found = _cached(rank, cluster, directory, fingerprint, precision, settings, refresh)
    entry = found.get(me.kind)
    measurement = None
    failure: Optional[str] = None
    try:
        if entry is None:
            step = UnitStep(graphs, unit, workload.loss_fn, emulator, device, recipe)
            measurement = DeviceMeasurement(step, workload, me, emulator, settings, device, board)
            measurement.find_edge()
    except WhaleError as e:
        failure = str(e)
    # every rank's memory trials end before any rank times (DeviceMeasurement's docstring), and a
    # rank that failed stops them all (its peers would otherwise wait for it until the timeout)
    _agree(failure, world)
    mine: Any = None
    try:
        if measurement is not None:
            mine = measurement.time()
        else:
            mine = entry.for_device(me.name, me.host)
            board.report(1, 1, "done")
    except WhaleError as e:
        failure = str(e)
        board.report(1, 1, FAILED)
    if rank == 0:
        board.wait(timeout_s)
    _agree(failure, world)
    # the optimizer's update, timed on every measuring rank at once, as the runtime runs it (every rank steps
    # right after the step's backward and gradient sync): ranks that share a machine's cores share them here as
    # there (on emulated hardware the update runs unpadded, at the cores' speed). Each timed update follows a
    # step at the largest timed batch and a barrier (DeviceMeasurement.timed_update); a rank whose figures came
    # from the cache joins the barriers
    dist.barrier()
    if measurement is not None:
        mine = dataclasses.replace(mine, update_ns_per_byte=measurement.timed_update(repeats))
    else:
        for _ in range(max(repeats, 1)):
            dist.barrier()
    devices: list[Any] = [None] * world
    dist.all_gather_object(devices, mine)
    devices = kind_figures(devices)
    board.report(0, 1, "timing links")
    links = measure_links(cluster, rank, device, emulator.network)
    collective = measure_collective(cluster, rank, device)
    links += [collective] if collective is not None else []
    board.report(1, 1, "done")
    elapsed = [time.perf_counter() - started]
    dist.broadcast_object_list(elapsed, src=0)
    profile = Profile(model_fingerprint=fingerprint, cluster=cluster.name, precision=precision, optimizer=optimizer,
                      unit=unit, warmup=warmup, repeats=repeats, seconds=round(elapsed[0], 3), devices=tuple(devices),
                      links=tuple(links))
    profile.validate(graphs=graphs, cluster=cluster)
    if rank == 0:
        _store(directory, profile, cluster, settings, found)
    if emulator.network is not None:
        emulator.network.close()
    measured = sum(not d.cached for d in profile.devices)
    board.close(f"profiled {len(profile.devices)} devices ({measured} measured, {len(profile.devices) - measured} "
                f"from the cache) in {profile.seconds:.1f} s (Poplar reports 67-174 s on its clusters)")
    return profile


def kind_figures(devices: list[DeviceProfile]) -> list[DeviceProfile]:
    """Each kind's per-step costs outside compute as one figure: the median over the devices of the kind
    measured in this run of ``update_ns_per_byte`` and ``action_overhead_s`` (a cached device keeps its
    entry's). Why: they are the kind's (the same GPU model and host software), measured on each device
    with noise, and the planner's data-parallel shares equalise them (:class:`planner.shares.batch_shares.Slot`
    ``fixed``): two identical devices measured 44 and 52 ms for one update and got 24 and 22 samples.
    One figure per kind is also what the cache keeps."""
    measured: dict[str, list[DeviceProfile]] = {}
    for d in devices:
        if not d.cached:
            measured.setdefault(d.kind, []).append(d)
    figures = {kind: (statistics.median(d.update_ns_per_byte for d in ds),
                      statistics.median(d.action_overhead_s for d in ds)) for kind, ds in measured.items()}
    return [d if d.cached else dataclasses.replace(d, update_ns_per_byte=figures[d.kind][0],
                                                   action_overhead_s=figures[d.kind][1])
            for d in devices]


def _agree(failure: Optional[str], world: int) -> None:
    """Every rank's failure so far (None: none), gathered; the first is raised on every rank."""
    failures: list[Any] = [None] * world
    dist.all_gather_object(failures, failure)
    for rank, message in enumerate(failures):
        if message is not None:
            raise ProfilingError(message if message.startswith(f"rank {rank}") else f"rank {rank}: {message}")


def _launched(cluster: Cluster, command: str) -> tuple[int, int]:
    """``(rank, world size)`` from torchrun's environment, checked against the cluster's devices."""
    n = len(cluster.devices)
    launch = command or (f"torchrun --nproc-per-node {n} -m whalelike.cli profile MODEL --cluster {cluster.name} "
                         "-o PROFILE.yaml")
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ProfilingError(f"profile runs one process per device of cluster {cluster.name!r} ({n}): launch it with "
                             f"torchrun, e.g. {launch}")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != n:
        raise ProfilingError(f"rank {rank}: cluster {cluster.name!r} has {n} devices but this run has {world} ranks; "
                             f"launch one rank per device: torchrun --nproc-per-node {n} ...")
    return rank, world


def _cached(rank: int, cluster: Cluster, directory: str, fingerprint: str, precision: str,
            settings: "cache.Settings", refresh: bool) -> dict[str, "cache.Entry"]:
    """Kind -> the cache entry that answers this run (rank 0 reads, every rank gets the same);
    a broken entry is the same error on every rank."""
    answer: list[Any] = [None]
    if rank == 0:
        try:
            found = {}
            for kind in dict.fromkeys(d.kind for d in cluster.devices):
                entry = None if refresh else cache.load(directory, fingerprint, kind, precision)
                why = None if entry is None else entry.answers(settings)
                if why is not None:
                    log.info("profile cache: %s at %s is measured again: %s", kind, precision, why)
                    entry = None
                found[kind] = entry
            answer[0] = found
        except cache.CacheError as e:
            answer[0] = e
    dist.broadcast_object_list(answer, src=0)
    if isinstance(answer[0], Exception):
        raise answer[0]
    return {kind: entry for kind, entry in answer[0].items() if entry is not None}


def _store(directory: str, profile: Profile, cluster: Cluster, settings: "cache.Settings", found: dict) -> None:
    """Keep each measured kind's figures (its first device's) for the next run."""
    stored = set(found)
    for d in profile.devices:
        if d.cached or d.kind in stored:
            continue
        stored.add(d.kind)
        path = cache.store(directory, cache.Entry(model_fingerprint=profile.model_fingerprint, kind=d.kind,
                                                  precision=profile.precision, cluster=cluster.name,
                                                  settings=settings, device=d))
        log.info("profile cache: %s stored in %s", d.kind, path)


# -- one device ---------------------------------------------------------------------------------------
class DeviceMeasurement:
    """This rank's device, in two phases that every measuring rank runs together: :meth:`find_edge`
    (the largest batch, by memory trials), then :meth:`time` (the unit times at the timed batches:
    ``settings.warmup`` steps, then the median of ``settings.repeats``). Between them the caller
    waits for every rank (:func:`profile_cluster`): a memory trial on CPU runs the dispatch-mode
    counter and keeps a core busy, which would slow the timed segments of ranks sharing the cores."""

    def __init__(self, step: UnitStep, workload: Workload, device_spec, emulator: Emulator,
                 settings: "cache.Settings", device: torch.device, board: Optional[Board] = None):
        self.step, self.spec, self.emulator, self.settings, self.device, self.board = \
            step, device_spec, emulator, settings, device, board
        self.batches = _Batches(workload, device)
        self.memory: dict[int, int] = {}
        self.done, self.total = 0, 1
        self.edge = None
        self.capacity = emulator.capacity_bytes
        if device.type == "cuda":
            self.capacity = torch.cuda.get_device_properties(device).total_memory

    def _tick(self, note: str) -> None:
        self.done += 1
        self.total = max(self.total, self.done)
        if self.board is not None:
            self.board.report(self.done, self.total, note)

    def _fits(self, batch: int) -> bool:
        ok, peak = self.step.fits(*self.batches.get(batch))
        if ok:
            self.memory[batch] = peak
        self._tick(f"batch {batch}: {'fits' if ok else 'out of memory'}")
        return ok

    def find_edge(self) -> None:
        """Poplar's Algorithm 1 over whole training steps, and the peak memory of every timed batch."""
        step, settings = self.step, self.settings
        if not step.prepare(*self.batches.get(1)):
            raise _nothing_fits(self.spec, step)
        estimate = step.estimate(self.batches.get(1)[0], self.capacity)
        guess = min(estimate or settings.cap, settings.cap)
        self.total = 2 * int(math.log2(guess)) + 2 + (int(math.log2(guess)) + 2) * (settings.warmup + settings.repeats)
        if self.capacity is None:
            log.warning("device %s (%s): nothing limits its memory here (on CPU only an emulation with enforce_memory "
                        "does), so its largest batch is the cap, %d", self.spec.name, self.spec.kind, settings.cap)
        try:
            self.edge = find_max_batch(self._fits, estimate, settings.cap)
        except NothingFitsError:
            raise _nothing_fits(self.spec, step) from None
        timed = timed_batches(self.edge.max_batch)
        per_step = settings.warmup + settings.repeats
        self.total = self.done + sum(b not in self.memory for b in timed) + len(timed) * per_step
        for batch in timed:
            if batch not in self.memory:   # a power of two the search jumped over (below the edge: it fits)
                self._fits(batch)
        if self.board is not None:
            self.board.report(self.done, self.total, "waiting for the other ranks' largest batch")

    def timed_update(self, repeats: int) -> float:
        """The optimizer's update as training runs it (:meth:`UnitStep.timed_update`): before each timed
        update, a step at the largest timed batch and a barrier of every rank (as the gradient sync
        aligns them), so the update starts with its gradients just made, at once on every rank. Every
        rank of the profiling world calls ``dist.barrier()`` ``repeats`` times here or beside it."""
        batch = timed_batches(self.edge.max_batch)[-1]
        inputs, targets = self.batches.get(batch)

        def before() -> None:
            self._timed(inputs, targets, batch)
            dist.barrier()

        return self.step.timed_update(repeats, before)

    def _timed(self, inputs: tuple, targets: Optional[torch.Tensor], batch: int) -> list[tuple[float, float]]:
        """One timed step; a real out-of-memory error (a GPU's allocator holds the unit-cut step's
        blocks otherwise than the whole step's) is retried once with the cache emptied, then named."""
        try:
            return self.step.timed(inputs, targets, batch)
        except torch.OutOfMemoryError:
            self.step.release()
        try:
            return self.step.timed(inputs, targets, batch)
        except torch.OutOfMemoryError:
            self.step.release()
            raise ProfilingError(
                f"device {self.spec.name} ({self.spec.kind}): the timed step at batch {batch} ran out of memory "
                f"although the whole step fitted; profile with --max-batch {max(batch - 1, 1)}") from None

    def time(self) -> DeviceProfile:
        """The unit times at the timed batches; the device's figures.

        On emulated hardware a step in which some segment's real compute overran its modeled time
        (the machine's cores were busy elsewhere: :class:`runtime.emulation.compute.EmulationStats`
        counts it) timed the machine, not the emulated device: it does not count, and the step is run
        again, up to :data:`RETRIES_PER_REPEAT` times per repeat; what still overran is kept and
        named in a warning. Real hardware never overruns (its emulator is off)."""
        step, settings = self.step, self.settings
        per_step = settings.warmup + settings.repeats
        timed = timed_batches(self.edge.max_batch)
        times: dict[int, dict[int, tuple[float, float]]] = {u: {} for u in range(step.units)}
        kept_overruns = retried = 0
        outside: list[float] = []
        for batch in timed:
            inputs, targets = self.batches.get(batch)
            runs: list = []
            spare = RETRIES_PER_REPEAT * settings.repeats
            for attempt in range(per_step):
                while True:
                    before = self.emulator.stats.snapshot()
                    start = time.perf_counter()
                    measured = self._timed(inputs, targets, batch)
                    wall = time.perf_counter() - start
                    overran = self.emulator.stats.since(before).overruns > 0
                    if attempt < settings.warmup or not overran or spare == 0:
                        break
                    spare -= 1
                    retried += 1
                if attempt >= settings.warmup:
                    runs.append(measured)
                    # outside the segments: what the step spends around its units' compute, per forward or backward
                    outside.append(max(wall - sum(f + b for f, b in measured), 0.0) / (2 * step.units))
                    kept_overruns += overran
                self._tick(f"batch {batch}: timing ({attempt + 1}/{per_step})")
            for u in range(step.units):
                times[u][batch] = (statistics.median(r[u][0] for r in runs), statistics.median(r[u][1] for r in runs))
            self.batches.drop(batch)
        if retried:
            log.info("device %s: %d timed steps overran their modeled time and were run again", self.spec.name, retried)
        if kept_overruns:
            log.warning("device %s: %d timed steps still overran their modeled time after %d retries per repeat: real "
                        "compute leaked into the emulated figures; lower the emulation's base_gflops "
                        "(runtime.calibrate) or profile on a quieter machine", self.spec.name, kept_overruns,
                        RETRIES_PER_REPEAT)
        if self.board is not None:
            self.board.report(self.done, self.done, "done")
        return DeviceProfile(name=self.spec.name, kind=self.spec.kind, host=self.spec.host,
                             max_batch=self.edge.max_batch, edge=self.edge.edge, times=times,
                             memory_bytes={b: self.memory[b] for b in timed if self.memory.get(b) is not None},
                             capacity_bytes=self.capacity, action_overhead_s=statistics.median(outside))


def _nothing_fits(device_spec, step: UnitStep) -> ProfilingError:
    return ProfilingError(
        f"device {device_spec.name} ({device_spec.kind}) cannot run a training step of one sample at "
        f"{step.precision.name}: the whole model, its gradients and optimizer state do not fit in its "
        f"{device_spec.memory_gib:g} GiB; profiling measures whole-model steps (Poplar's data-parallel setting), "
        "so profile a smaller model or on devices with more memory")


class _Batches:
    """Inputs of any batch size: the workload's ``make_batch`` (fixed seed), else its example
    inputs repeated along the batch dimension (no targets: the backward starts from the outputs)."""

    def __init__(self, workload: Workload, device: torch.device, seed: int = 0):
        self.workload, self.device, self.seed = workload, device, seed
        self._made: dict[int, tuple[tuple, Optional[torch.Tensor]]] = {}

    def get(self, batch: int) -> tuple[tuple, Optional[torch.Tensor]]:
        if batch not in self._made:
            self._made[batch] = self._make(batch)
        return self._made[batch]

    def drop(self, batch: int) -> None:
        self._made.pop(batch, None)

    def _make(self, batch: int) -> tuple[tuple, Optional[torch.Tensor]]:
        move = lambda x: x.to(self.device) if isinstance(x, torch.Tensor) else x
        if self.workload.make_batch is not None:
            inputs, targets = self.workload.make_batch(batch, torch.Generator().manual_seed(self.seed + batch))
            inputs = inputs if isinstance(inputs, tuple) else (inputs,)
            return tuple(move(x) for x in inputs), move(targets)
        out = []
        for x in self.workload.example_args:
            if isinstance(x, torch.Tensor) and x.dim() > 0:
                x = x[torch.arange(batch) % x.shape[0]]
            out.append(move(x))
        return tuple(out), None
