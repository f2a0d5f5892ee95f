"""Checkpoints of a running Engine with ``torch.distributed.checkpoint``, loadable onto any plan.

A checkpoint holds what training needs to continue exactly: the model's parameters and persistent
buffers, the optimizer's state and hyperparameters, the step, each rank's RNG states, the plan in
force, the Engine's LR scheduler and fp16 loss scale (:mod:`runtime.training`), and the caller's
own ``extra`` state (the data position). The tensors are stored in
*full-tensor coordinates*: every tensor under the model's name (``model/<name>``, optimizer
entries ``optim/<name>/<key>``) as chunks at offsets of the whole tensor, so a checkpoint is not
tied to the plan that wrote it. Loading reads, for each rank of the *new* plan, exactly the
pieces its executor holds, from whatever chunks cover them: another cluster, more or fewer ranks,
other shares, layers in other stages, other tensor-parallel shard sizes.

Why ``torch.distributed.checkpoint`` (DCP) and not our own format: DCP already writes every rank's
pieces in parallel, keeps a global metadata file of the chunks, and reads overlapping chunks into
differently shaped destinations (its resharding). What DCP does not know is our uneven and fused
(q, k, v) shards, which are neither DTensors nor ShardedTensors. So each rank's holding of a
tensor is described the way live re-planning describes it (:class:`planner.balance.state_moves.Slab`, from
the executor's ``named_state()``, :mod:`runtime.state.transfer`), and :class:`_Pieces` presents
those pieces to DCP through its ``_Checkpointable`` protocol (``__create_write_items__``,
``__create_chunk_list__``); the two planners below only look those pieces up. One description of
what a rank holds serves both moving state between plans live and through storage.

Who writes what: the same decision as a live re-plan, :func:`planner.balance.state_moves.plan_moves`, with
the storage as the one destination that holds everything whole. Each piece is written once, by the
holder that has written the least so far (data-parallel copies share the writing), never twice and
never overlapping (DCP rejects overlapping chunks, which replicas with different tensor-parallel
shard sizes would otherwise produce). Buffers are written by their lowest-ranked holder: under DDP
that is the copy every replica uses next (DDP broadcasts buffers from its first rank).

Atomicity: a checkpoint is written into ``.step-<N>.partial`` next to its final name; once DCP has
finished on every rank (its metadata file is written last, by the coordinator, after every rank's
data), rank 0 adds ``plan.yaml`` and ``checkpoint.json``, syncs them and renames the directory to
``step-<N>``. A rename is atomic, so a directory called ``step-<N>`` is complete; anything else
(a crash mid-save) is ignored by :func:`latest` and removed by the next save. The directory must be
one file system that every rank sees (local disk for one host, a shared file system across hosts).

Resuming: build the Engine for the plan to continue on (the checkpoint's own, or a new one), then
:func:`load`. The continuation on the same plan is bit-identical to the uninterrupted run; on
another plan it equals the uninterrupted single-device reference to rounding (gradients are
exact; only the order of floating-point sums changes). The straggler monitor starts afresh (its
speed window is not state of the model).
"""
from __future__ import annotations

import copy
import json
import logging
import os
import random
import re
import shutil
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from planner.plan import Plan
from planner.balance.state_moves import Move, Slab, plan_moves
from runtime.state.transfer import NamedState, allocate_state, optimizer_state, state_keys, state_name
from runtime.replicas.held_state import like, local as local_values
from whalelike.errors import WhaleError
from whalelike.files import flush_to_disk, write_atomic

log = logging.getLogger(__name__)

FORMAT = 1                        # the layout of checkpoint.json and the key names; bump on change
MANIFEST = "checkpoint.json"
PLAN_FILE = "plan.yaml"
_FINAL = re.compile(r"^step-(\d{8,})$")
_STORAGE = -1                     # the virtual rank "storage" in plan_moves: it holds everything whole


class CheckpointError(WhaleError):
    """A checkpoint cannot be written, found or loaded onto this run."""


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint on disk: its directory, the step it continues from (the number of
    optimizer steps taken), the world size and plan that wrote it (``plan`` is the plan file's path)."""

    path: str
    step: int
    world_size: int
    plan: str
    saved_at: float

    def load_plan(self) -> Plan:
        return Plan.from_yaml(self.plan)


# -- finding checkpoints ---------------------------------------------------------------------------
def step_directory(directory: str | os.PathLike, step: int) -> str:
    """The path of the checkpoint of ``step`` in ``directory``: ``step-<N>``, ``N`` zero-padded to
    eight digits."""
    return os.path.join(os.fspath(directory), f"step-{step:08d}")


def complete(directory: str | os.PathLike) -> list[CheckpointInfo]:
    """Every complete checkpoint in ``directory``, oldest first (none if it does not exist)."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return []
    found = []
    for entry in sorted(os.listdir(directory)):
        match = _FINAL.match(entry)
        path = os.path.join(directory, entry)
        if match is None or not os.path.isdir(path):
            continue
        info = _read_manifest(path)
        if info is None:
            log.warning("ignoring %s: no %s, .metadata or %s in it (not written by runtime.checkpoint, or "
                        "damaged)", path, MANIFEST, PLAN_FILE)
            continue
        found.append(info)
    return sorted(found, key=lambda info: info.step)


def latest(directory: str | os.PathLike) -> Optional[CheckpointInfo]:
    """The newest complete checkpoint in ``directory``, or None."""
    found = complete(directory)
    return found[-1] if found else None


def _read_manifest(path: str) -> Optional[CheckpointInfo]:
    manifest = os.path.join(path, MANIFEST)
    if not all(os.path.isfile(os.path.join(path, f)) for f in (MANIFEST, ".metadata", PLAN_FILE)):
        return None
    try:
        with open(manifest, encoding="utf-8") as f:
            data = json.load(f)
        if data.get("format") != FORMAT:
            raise CheckpointError(f"{path}: checkpoint format {data.get('format')!r}, this whalelike reads format "
                                  f"{FORMAT}; resume with the whalelike version that wrote it")
        return CheckpointInfo(path, int(data["step"]), int(data["world_size"]), os.path.join(path, PLAN_FILE),
                              float(data["saved_at"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("ignoring %s: unreadable %s (%s)", path, MANIFEST, e)
        return None


# -- what DCP sees -----------------------------------------------------------------------------------
class _Pieces:
    """Pieces of one full tensor held by this rank, in DCP's ``_Checkpointable`` protocol: a list of
    ``(local view, chunk)``, each view the part of a local tensor that holds ``chunk`` of the full
    tensor of shape ``shape``."""

    def __init__(self, shape: tuple[int, ...], properties_from: torch.Tensor):
        self.shape = torch.Size(shape)
        self.properties = TensorProperties.create_from_tensor(properties_from)
        self.pieces: list[tuple[torch.Tensor, ChunkStorageMetadata]] = []

    def add(self, local: torch.Tensor, slab: Slab, dim: Optional[int], lo: int, hi: int) -> None:
        """Add the entries ``[lo, hi)`` along ``dim`` (None: the whole, 0-dim or not) of ``local``,
        a tensor holding ``slab``."""
        if dim is None or not self.shape:
            view, offsets, sizes = local, [0] * len(self.shape), list(self.shape)
        else:
            view = local.narrow(dim, slab.local_offset(dim, lo), hi - lo)
            offsets = [lo if d == dim else 0 for d in range(len(self.shape))]
            sizes = [hi - lo if d == dim else n for d, n in enumerate(self.shape)]
        self.pieces.append((view, ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))))

    def add_slab(self, local: torch.Tensor, slab: Slab) -> None:
        """Add every range ``local`` holds."""
        if slab.whole:
            self.add(local, slab, None, 0, 0)
        else:
            for lo, hi in slab.ranges:
                self.add(local, slab, slab.dim, lo, hi)

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=chunk, properties=self.properties, size=self.shape))
                for _, chunk in self.pieces]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [chunk for _, chunk in self.pieces]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        # loading gives the position in our chunk list (two copies of one tensor may share offsets)
        if index.index is not None and index.index < len(self.pieces) \
                and self.pieces[index.index][1].offsets == index.offset:
            return self.pieces[index.index][0]
        for view, chunk in self.pieces:
            if chunk.offsets == index.offset:
                return view
        raise CheckpointError(f"{index.fqn}: no local piece at offset {tuple(index.offset)}")


class _SavePlanner(DefaultSavePlanner):
    """DCP's planner, looking our pieces up by offset. Nothing to deduplicate: every piece has one
    writer (:func:`_writers`)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, dedup_save_to_lowest_rank=True)

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        return obj.__get_tensor_shard__(index) if isinstance(obj, _Pieces) else super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    """DCP's planner, writing into our pieces (DCP reads the overlap of every stored chunk with them)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # the default also initialises meta tensors, walking the values with a function that
        # turns every object it does not know (our pieces) into None; we hold no meta tensors
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        return obj.__get_tensor_shard__(index) if isinstance(obj, _Pieces) else super().lookup_tensor(index)


# -- what this rank holds ------------------------------------------------------------------------------
def _model_key(name: str) -> str:
    return f"model/{name}"


def _optim_key(name: str, key: str) -> str:
    return f"optim/{name}/{key}"


def _canonical(name: str) -> str:
    """A second copy of a tied tensor on one rank is named ``"<name>@<key>"``; it holds the same values."""
    return name.split("@", 1)[0]


def _holdings(engine) -> tuple[NamedState, dict[str, torch.Tensor | Any], dict]:
    """This rank's parameters and buffers, optimizer state tensors and their kinds, all by name."""
    executor = _executor(engine)
    held = executor.named_state()
    tensors, kinds = optimizer_state(engine.optimizer, held)
    return held, tensors, kinds


def _executor(engine):
    if not engine.slot.built:
        raise CheckpointError("the Engine has not built its executor yet (it does so at its first step): pass "
                              "runtime.Engine(..., example_args=<a batch's inputs>), or run a step, before saving "
                              "or loading a checkpoint")
    return engine.slot.executor     # a migration's names the owner's state: what the plan in force holds


# -- saving ----------------------------------------------------------------------------------------------
def save(engine, directory: str | os.PathLike, *, extra: Optional[Mapping[str, Any]] = None,
         keep: Optional[int] = 2) -> CheckpointInfo:
    """Write a checkpoint of ``engine`` after its last completed step into ``directory`` (collective:
    every rank calls it at the same step boundary, with the same ``directory`` and ``extra``).

    ``extra``: the caller's own state (the data position, anything the Engine does not own), any
    picklable values, given back by :func:`load`. ``keep``: how many complete checkpoints to keep
    (the newest; None keeps all). Returns once the checkpoint is complete on disk."""
    job = _prepare(engine, directory, extra, keep, snapshot=False)
    engine.runtime.collective(lambda: _write(job, group=None))
    return job.info


def save_async(engine, directory: str | os.PathLike, *, extra: Optional[Mapping[str, Any]] = None,
               keep: Optional[int] = 2) -> "PendingCheckpoint":
    """Like :func:`save`, but training goes on while the checkpoint is written: this rank's pieces
    are copied (the only stall), then a thread writes them through a process group of its own.
    Call ``.wait()`` on the result before the next save and before the job ends (collective). A
    failed write raises from ``wait()``; the half-written directory is removed, never loaded. A
    rank that leaves the job (:mod:`runtime.elastic.departure`) first waits for the writes in flight
    on every rank (:func:`finish_pending`), so a leave never tears a checkpoint.

    Why not ``dcp.async_save``: its stager copies only tensors, DTensors and ShardedTensors out of
    the state dict; our pieces (uneven, fused shards) would be written from the live parameters
    while the next steps change them."""
    group = engine.checkpointer.group(engine.runtime.collective)   # made once, on the first asynchronous save
    job = _prepare(engine, directory, extra, keep, snapshot=True)
    pending = PendingCheckpoint(job, group)
    # a leave (runtime.elastic.departure) ends this group's world: it waits for the writes in flight first
    engine.checkpointer.started(pending)
    return pending


def finish_pending(engine) -> None:
    """Wait (collectively: every rank started the same saves) for the asynchronous checkpoints this
    Engine has in flight, and forget the process group they write through
    (:meth:`runtime.state.checkpointer.Checkpointer.finish`)."""
    engine.runtime.collective(engine.checkpointer.finish)


@dataclass
class _Job:
    state: dict[str, Any]
    partial: str
    final: str
    directory: str
    plan: Plan
    keep: Optional[int]
    info: CheckpointInfo
    started: float


def _prepare(engine, directory, extra, keep, snapshot: bool) -> _Job:
    """The foreground half of a save: who writes what, and this rank's state to write (copied out
    of the live tensors when ``snapshot``: the write then runs while training goes on)."""
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise CheckpointError(f"checkpoint keep={keep!r}: keep at least 1 checkpoint (or None for all)")
    started = time.perf_counter()
    directory = os.fspath(directory)
    rank, world = dist.get_rank(), dist.get_world_size()
    step = engine.step
    final = step_directory(directory, step)
    partial = os.path.join(directory, f".step-{step:08d}.partial")
    if rank == 0:                       # before the first collective: no rank has begun writing yet
        _remove_stale(directory)
        os.makedirs(directory, exist_ok=True)
    held, opt_tensors, kinds = _holdings(engine)
    described: list[dict] = [None] * world
    mine = {"slabs": {name: slab for name, (t, slab) in held.items() if "@" not in name},
            "buffers": [name for name, (t, _) in held.items() if "@" not in name and not isinstance(t, nn.Parameter)],
            "state": {name: entries for name, entries in kinds.items() if "@" not in name}}
    engine.runtime.collective(lambda: dist.all_gather_object(described, mine))
    state = _state_to_write(rank, held, opt_tensors, _writers(described), snapshot)
    state[f"rng/rank{rank}"] = _rng_state()
    if rank == 0:
        state["meta"] = {"step": step, "param_groups": _hyperparameters(engine.optimizer),
                         "kinds": state_keys(described), "extra": dict(extra or {}),
                         "scheduler": _state_of(engine.scheduler),
                         "loss_scaler": _state_of(engine.scaler)}
        if snapshot:
            state["meta"] = copy.deepcopy(state["meta"])
    info = CheckpointInfo(final, step, world, os.path.join(final, PLAN_FILE), time.time())
    return _Job(state, partial, final, directory, engine.plan, keep, info, started)


def _write(job: _Job, group: Optional[dist.ProcessGroup]) -> None:
    """The background half: DCP writes every rank's pieces, rank 0 completes the checkpoint (plan,
    manifest, rename), drops the oldest; every rank returns once it is complete."""
    rank = dist.get_rank()
    try:
        dcp.save(job.state, storage_writer=dcp.FileSystemWriter(job.partial, sync_files=True),
                 planner=_SavePlanner(), process_group=group)
        if rank == 0:
            _finish(job.partial, job.final, job.plan, job.info.step, job.info.world_size)
            if job.keep is not None:
                for old in complete(job.directory)[:-job.keep]:
                    shutil.rmtree(old.path, ignore_errors=True)
    except Exception as e:
        if rank == 0:
            shutil.rmtree(job.partial, ignore_errors=True)
        if isinstance(e, OSError):
            raise CheckpointError(f"rank {rank}: writing checkpoint {job.final} failed: {e}; check the space and "
                                  f"permissions of {job.directory}") from e
        raise
    # every rank returns once the checkpoint is complete (a rank restarted right after sees it)
    dist.barrier(group=group)
    log.info("rank %d: checkpoint of step %d written to %s in %.1f ms", rank, job.info.step, job.final,
             (time.perf_counter() - job.started) * 1e3)


class PendingCheckpoint:
    """A checkpoint being written by a thread (:func:`save_async`)."""

    def __init__(self, job: _Job, group: dist.ProcessGroup):
        self.info = job.info
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(job, group), daemon=True,
                                        name=f"whalelike-checkpoint-{job.info.step}")
        self._thread.start()

    def _run(self, job: _Job, group) -> None:
        try:
            _write(job, group)
        except BaseException as e:      # handed to wait(), on the training thread
            self._error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> CheckpointInfo:
        """Block until the checkpoint is complete on every rank; raise if writing it failed."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.info


def _remove_stale(directory: str) -> None:
    """Rank 0: remove the half-written directories of saves that never completed (a crash mid-save)."""
    if not os.path.isdir(directory):
        return
    for entry in os.listdir(directory):
        if entry.startswith(".step-") and entry.endswith(".partial"):
            shutil.rmtree(os.path.join(directory, entry), ignore_errors=True)


def _writers(described: list[dict]) -> list[Move]:
    """Which rank writes which piece of which tensor: every piece once (module docstring)."""
    holders: dict[int, dict[str, Slab]] = {}
    buffer_owner: dict[str, int] = {}
    for rank, d in enumerate(described):
        for name in d["buffers"]:
            buffer_owner.setdefault(name, rank)
    for rank, d in enumerate(described):
        holders[rank] = {name: slab for name, slab in d["slabs"].items() if buffer_owner.get(name, rank) == rank}
        for name, entries in d["state"].items():
            for key, kind in entries.items():
                if kind[0] != "value":
                    holders[rank][state_name(name, key)] = d["slabs"][name] if kind[0] == "param" else Slab(())
    everything = {name: Slab(slab.shape) for held in holders.values() for name, slab in held.items()}
    return plan_moves(holders, {_STORAGE: everything})


def _state_to_write(rank: int, held: NamedState, opt_tensors: Mapping[str, Mapping[str, torch.Tensor]],
                    moves: Iterable[Move], snapshot: bool) -> dict[str, Any]:
    """This rank's share of the writing: a :class:`_Pieces` per tensor it writes pieces of (views
    of the live tensors, or copies on the CPU when ``snapshot``)."""
    local: dict[str, tuple[str, torch.Tensor, Slab]] = {}
    for name, (tensor, slab) in held.items():
        if "@" in name:
            continue
        local[name] = (_model_key(name), local_values(tensor).detach(), slab)
        for key, value in opt_tensors.get(name, {}).items():
            local[state_name(name, key)] = (_optim_key(name, key), local_values(value), slab if value.dim() else Slab(()))
    state: dict[str, Any] = {}
    for move in moves:
        if move.src != rank:
            continue
        fqn, tensor, slab = local[move.name]
        pieces = state.get(fqn)
        if pieces is None:
            pieces = state[fqn] = _Pieces(slab.shape, tensor)
        pieces.add(tensor, slab, move.dim, move.lo, move.hi)
    if snapshot:
        for pieces in state.values():
            pieces.pieces = [(view.to("cpu", copy=True), chunk) for view, chunk in pieces.pieces]
    return state


def _finish(partial: str, final: str, plan: Plan, step: int, world: int) -> None:
    """Rank 0, after DCP finished everywhere: the plan and the manifest (each synced to disk by
    :func:`whalelike.files.write_atomic`), then the rename, synced too."""
    plan.to_yaml(os.path.join(partial, PLAN_FILE))
    manifest = {"format": FORMAT, "step": step, "world_size": world, "saved_at": time.time(),
                "torch": torch.__version__}
    write_atomic(os.path.join(partial, MANIFEST), json.dumps(manifest, indent=1), kind="json")
    if os.path.exists(final):             # a save of the same step again (a resumed run re-saving)
        shutil.rmtree(final)
    os.rename(partial, final)
    flush_to_disk(os.path.dirname(final))


def _state_of(obj: Any) -> Optional[dict]:
    """The ``state_dict()`` of an LR scheduler or loss scaler (equal on every rank), or None."""
    return copy.deepcopy(obj.state_dict()) if obj is not None else None


def _restore_recipe(engine, meta: Mapping[str, Any], info: CheckpointInfo) -> None:
    """The LR schedule's position and the fp16 loss scale, where both the checkpoint and the Engine
    have them; a mismatch is said once (rank 0), since the run then differs from the uninterrupted one."""
    for key, attr, what in (("scheduler", "scheduler", "an LR scheduler"), ("loss_scaler", "scaler", "an fp16 loss scale")):
        saved, live = meta.get(key), getattr(engine, attr, None)
        if saved is not None and live is not None:
            live.load_state_dict(saved)
        elif (saved is None) != (live is None) and dist.get_rank() == 0:
            log.warning("checkpoint %s %s %s but this Engine %s; %s", info.path,
                        "holds" if saved is not None else "holds no", what,
                        "has none" if live is None else "has one",
                        "it is ignored" if live is None else "this Engine's starts afresh")


def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def _rng_state() -> dict:
    import numpy as np

    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_rng_state(state: dict) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if state["cuda"] is not None and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


# -- loading ---------------------------------------------------------------------------------------------
def load(engine, checkpoint: "CheckpointInfo | str | os.PathLike") -> dict[str, Any]:
    """Load ``checkpoint`` (a :class:`CheckpointInfo` or a checkpoint directory) into ``engine``,
    whatever plan it runs: each rank reads the pieces its executor holds; the optimizer state,
    hyperparameters and ``engine.step`` follow; each rank's RNG states too when the world size is the
    one that saved. Collective. Returns the ``extra`` given to :func:`save`."""
    info = checkpoint if isinstance(checkpoint, CheckpointInfo) else _read_manifest(os.fspath(checkpoint))
    if info is None:
        raise CheckpointError(f"{checkpoint}: not a complete checkpoint ({MANIFEST}, .metadata and {PLAN_FILE} "
                              "are written last); pass a step-<N> directory, or runtime.checkpoint.latest(dir)")
    rank, world = dist.get_rank(), dist.get_world_size()
    reader = dcp.FileSystemReader(info.path)
    metadata = reader.read_metadata()
    stored = metadata.state_dict_metadata
    meta_box: dict[str, Any] = {"meta": None}
    engine.runtime.collective(lambda: dcp.load(meta_box, storage_reader=reader, planner=_LoadPlanner()))
    meta = meta_box["meta"]
    keys = meta["kinds"]
    held = _executor(engine).named_state()
    _check_model(info, held, stored)
    state: dict[str, Any] = {}
    for name, (tensor, slab) in held.items():
        _pieces(state, _model_key(_canonical(name)), local_values(tensor).detach(), slab)
    wanted = {state_name(name, key): (slab if kind[0] == "param" else Slab(()))
              for name, (_, slab) in held.items() for key, kind in keys.get(_canonical(name), {}).items()
              if kind[0] != "value"}
    new_state = allocate_state(held, {name: keys[_canonical(name)] for name in held if _canonical(name) in keys},
                               {}, {}, wanted)
    for name in held:
        for key in keys.get(_canonical(name), {}):
            if state_name(name, key) in new_state:
                tensor, slab = new_state[state_name(name, key)]
                _pieces(state, _optim_key(_canonical(name), key), tensor, slab)
    if world == info.world_size and f"rng/rank{rank}" in stored:
        state[f"rng/rank{rank}"] = None
    engine.runtime.collective(lambda: dcp.load(state, storage_reader=reader, planner=_LoadPlanner()))
    _restore_optimizer(engine.optimizer, held, new_state, keys, meta["param_groups"], info)
    if state.get(f"rng/rank{rank}") is not None:
        _set_rng_state(state[f"rng/rank{rank}"])
    _restore_recipe(engine, meta, info)
    engine.runtime.clock.step = meta["step"]
    engine.filled()     # a model built on the meta device has its values now
    log.info("rank %d: resumed from %s (step %d, saved by %d ranks)", rank, info.path, info.step, info.world_size)
    return meta["extra"]


def _pieces(state: dict[str, Any], fqn: str, tensor: torch.Tensor, slab: Slab) -> None:
    pieces = state.get(fqn)
    if pieces is None:
        pieces = state[fqn] = _Pieces(slab.shape, tensor)
    pieces.add_slab(tensor, slab)


def _check_model(info: CheckpointInfo, held: NamedState, stored: Mapping[str, Any]) -> None:
    """The checkpoint must hold every tensor of this model with the same full shape."""
    problems = []
    for name, (_, slab) in held.items():
        key = _model_key(_canonical(name))
        md = stored.get(key)
        if md is None or isinstance(md, BytesStorageMetadata):
            problems.append(f"{_canonical(name)} is missing")
        elif tuple(md.size) != slab.shape:
            problems.append(f"{_canonical(name)} has shape {tuple(md.size)} there, {slab.shape} here")
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise CheckpointError(f"checkpoint {info.path} is not of this model: {shown}; resume with the model that "
                              "wrote it, or start without --checkpoint-dir")


def _restore_optimizer(optimizer: torch.optim.Optimizer, held: NamedState, new_state: NamedState,
                       keys: Mapping[str, Mapping[str, tuple]], param_groups: list[dict], info: CheckpointInfo) -> None:
    if len(param_groups) != len(optimizer.param_groups):
        raise CheckpointError(f"checkpoint {info.path} has {len(param_groups)} optimizer param groups, this "
                              f"optimizer {len(optimizer.param_groups)}; resume with the optimizer factory that "
                              "wrote it")
    for group, saved in zip(optimizer.param_groups, param_groups):
        group.update(saved)
    names = {id(tensor): name for name, (tensor, _) in held.items()}
    optimizer.state.clear()
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in names and local_values(param).numel() == 0:
                continue            # a ZeRO shard holding no row of this parameter (runtime.replicas.fsdp_sync)
            name = names[id(param)]
            entries = {key: kind[1] if kind[0] == "value" else like(param, new_state[state_name(name, key)][0])
                       for key, kind in keys.get(_canonical(name), {}).items()}
            if entries:
                optimizer.state[param] = entries
