"""Switch a running executor to a new plan of the same ranks, moving exactly the state that moves.

Re-planning at a step boundary (pipeline layers moving between stages, tensor-parallel shard sizes
changing for good) leaves most of the model where it is: a layer moving from stage 0 to stage 1
is a few tensors out of many, a 3:1 -> 1:3 re-shard moves half a projection. So the state goes
point to point, and only what moves: every rank describes what it holds of each named tensor under
the old and the new executor (a :class:`planner.balance.state_moves.Slab`, small metadata shared with one
``all_gather_object``), :func:`planner.balance.state_moves.plan_moves` decides the pieces, and one
``batch_isend_irecv`` carries them; what a rank already holds is copied locally.

Why not an all-gather of the model (``full_state_dict`` then ``load_full_state_dict``): every rank
would receive every parameter and every optimizer moment, several times the model per re-plan for
a move of one layer. Why not ``torch.distributed.checkpoint`` resharding: it goes through storage
(a write and a read of the whole state), and it does not know our uneven or fused (q, k, v) shards.

What moves: parameters, persistent buffers, and the optimizer state of each parameter: every
state tensor shaped like its parameter is sliced like it (Adam's moments, SGD's momentum), a 0-dim
one (Adam's ``step``) is copied whole from any holder, other values ride in the metadata. The
optimizer object stays the same (learning-rate schedulers hold it): a throwaway optimizer built by
``make_optimizer`` on the new parameters gives the param-group assignment, the new parameters go
into the existing ``param_groups`` (hyperparameters kept) and the state is set per new parameter.

Invariant: after :func:`switch_executor`, every rank holds exactly the values (parameters, buffers,
optimizer state) the old plan had for what the new plan gives it, so training continues bit for
bit as if the new plan had run from the start. The sources are snapshots of the old parameters and
buffers taken *before* the new executor is built: its construction may write them (DDP broadcasts
from its group's first rank, tied parameters from their first holder, and the old and new executor
share the model's tensors), and that rank may be one that did not hold them under the old plan.
The old gradients are dropped first (the next step starts from zero), so the snapshot costs no
memory beyond what the gradients held.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from planner.balance.state_moves import Move, Slab, plan_moves
from runtime.replicas.held_state import NamedState, like, local
from whalelike.errors import WhaleError

log = logging.getLogger(__name__)

class StateTransferError(WhaleError):
    """An executor switch cannot keep the training state exact."""


@dataclass(frozen=True)
class TransferReport:
    """One switch, the same on every rank except ``seconds``: ``moved_tensors`` named tensors
    (parameters, buffers, optimizer state entries) had at least one piece cross ranks,
    ``moved_bytes`` crossed in all, ``seconds`` this rank's wall time of the whole switch."""

    moved_tensors: int
    moved_bytes: int
    seconds: float

    def describe(self) -> str:
        return f"moved {self.moved_tensors} tensors, {self.moved_bytes / 2**20:.2f} MiB, in {self.seconds * 1e3:.1f} ms"


# -- the switch ------------------------------------------------------------------------------------
def state_name(param: str, key: str) -> str:
    return f"{param}[{key}]"


def switch_executor(old, build_new: Callable[[], Any], optimizer: torch.optim.Optimizer,
                    make_optimizer: Callable, group: Optional[dist.ProcessGroup] = None):
    """Replace executor ``old`` by ``build_new()`` on every rank of ``group`` (a collective, at a
    step boundary), moving parameters, buffers and ``optimizer``'s state to where the new executor
    holds them, and rebinding ``optimizer`` to the new parameters; closes ``old``.

    ``old`` and the new executor provide ``named_state()`` (model name -> tensor and
    :class:`~planner.balance.state_moves.Slab`) and ``close()``. ``make_optimizer`` is the factory that
    built ``optimizer`` (same class; it only assigns the new parameters to param groups). Plan rank
    ``r`` is rank ``r`` of ``group`` (default: the world). Returns ``(new_executor, TransferReport)``.
    """
    start = time.perf_counter()
    held = snapshot(old, optimizer)
    return land(held, build_new(), optimizer, make_optimizer, group, start=start)


@dataclass
class Snapshot:
    """What a rank held under an executor it has let go of: ``sources`` (name -> a snapshot of the
    local tensor and its :class:`~planner.balance.state_moves.Slab`; optimizer state entries under
    :func:`state_name`), ``state`` (per parameter name, each optimizer entry's kind, see
    :func:`optimizer_state`) and ``parked``: pieces another rank handed to this one before it left
    the job (:mod:`runtime.elastic.departure`), described as held by a rank of their own."""

    sources: NamedState
    state: dict
    parked: NamedState = dataclasses.field(default_factory=dict)
    parked_state: dict = dataclasses.field(default_factory=dict)

    def dtypes(self, entries: NamedState) -> dict[str, str]:
        return {n: str(t.dtype).removeprefix("torch.") for n, (t, _) in entries.items()}


def snapshot(old, optimizer: torch.optim.Optimizer) -> Snapshot:
    """Snapshot what ``old`` holds (parameters, buffers, ``optimizer``'s state) and close it; the
    first half of :func:`switch_executor` (local, no communication besides what ``close`` does)."""
    held = old.named_state()
    for tensor, _ in held.values():
        if isinstance(tensor, nn.Parameter):
            tensor.grad = None
    # sources: snapshots of parameters and buffers (see the module docstring), optimizer state as it is
    sources: NamedState = {name: (local(t).detach().clone(), slab) for name, (t, slab) in held.items()}
    kept_state, state_meta = optimizer_state(optimizer, held)
    sources.update((state_name(p, k), (local(v), held[p][1] if v.dim() else Slab(()))) for p, entries in kept_state.items()
                   for k, v in entries.items())
    # the old executor lets go of the model before the new one wraps it (a ZeRO sync gives its parameters
    # back whole; two wrappers of one module would conflict); everything to move is in the snapshot
    old.close()
    return Snapshot(sources, state_meta)


def land(held: Snapshot, new, optimizer: torch.optim.Optimizer, make_optimizer: Callable,
         group: Optional[dist.ProcessGroup] = None, *, start: Optional[float] = None):
    """The second half of :func:`switch_executor` (collective on ``group``): move what every rank's
    :class:`Snapshot` holds to where the ``new`` executors hold it and rebind ``optimizer``. ``new``
    None is a rank that holds nothing under the new plan (it only sends). Pieces parked on a rank
    are taken as held by a virtual rank ``world + rank`` (preferred after real holders), which that
    rank sends for. Returns ``(new, TransferReport)``."""
    start = time.perf_counter() if start is None else start
    group = group if group is not None else dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    sources = held.sources
    target = new.named_state() if new is not None else {}
    state_meta = dict(held.state)
    for name, entries in held.parked_state.items():
        state_meta.setdefault(name, {}).update(entries)
    mine = {"old": {n: s for n, (_, s) in sources.items()}, "new": {n: s for n, (_, s) in target.items()},
            "dtype": {**held.dtypes(sources), **held.dtypes(held.parked)}, "state": state_meta,
            "parked": {n: s for n, (_, s) in held.parked.items()}}
    described: list[dict] = [None] * world
    dist.all_gather_object(described, mine, group=group)
    keys = state_keys(described)
    wanted = [{**d["new"], **{state_name(p, k): (d["new"][p] if meta[0] == "param" else Slab(()))
                              for p in d["new"] if p in keys for k, meta in keys[p].items() if meta[0] != "value"}}
              for d in described]
    holders = {r: d["old"] for r, d in enumerate(described)}
    holders.update((world + r, d["parked"]) for r, d in enumerate(described) if d["parked"])
    moves = plan_moves(holders, dict(enumerate(wanted)))
    destinations = dict(target)
    new_state = allocate_state(target, keys, sources, described[rank]["old"], wanted[rank])
    destinations.update(new_state)
    execute_moves(moves, rank, group, sources, destinations, parked=held.parked)
    if new is not None:
        _rebind(optimizer, make_optimizer, new, target, new_state, keys)
    dtypes = {n: getattr(torch, t) for d in described for n, t in d["dtype"].items()}
    crossing = [m for m in moves if m.src % world != m.dst]
    report = TransferReport(len({m.name for m in crossing}),
                            sum(m.elements * dtypes[m.name].itemsize for m in crossing),
                            time.perf_counter() - start)
    log.info("rank %d: switched executor, %s (%d pieces)", rank, report.describe(), len(crossing))
    return new, report


def optimizer_state(optimizer: torch.optim.Optimizer, held: NamedState):
    """This rank's optimizer state by parameter name: tensors (to move) and, per entry, its kind:
    ``("param", ...)`` shaped like the parameter, ``("scalar", dtype, on_cpu)`` 0-dim, or
    ``("value", v)`` a non-tensor value."""
    names = {id(t): n for n, (t, _) in held.items()}
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    meta: dict[str, dict[str, tuple]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names and local(p).numel() == 0:
                continue   # a ZeRO shard holding no row of this parameter (runtime.replicas.fsdp_sync)
            if id(p) not in names:
                raise StateTransferError(f"the optimizer holds a parameter of shape {tuple(p.shape)} that the "
                                         "executor does not name (named_state); build the optimizer from "
                                         "executor.parameters()")
            name = names[id(p)]
            for key, value in optimizer.state.get(p, {}).items():
                if not isinstance(value, torch.Tensor):
                    meta.setdefault(name, {})[key] = ("value", value)
                elif value.shape == p.shape:
                    tensors.setdefault(name, {})[key] = value
                    meta.setdefault(name, {})[key] = ("param", str(value.dtype).removeprefix("torch."))
                elif value.dim() == 0:
                    tensors.setdefault(name, {})[key] = value
                    meta.setdefault(name, {})[key] = ("scalar", str(value.dtype).removeprefix("torch."),
                                                      value.device.type == "cpu")
                else:
                    raise StateTransferError(
                        f"optimizer state {key!r} of {name!r} has shape {tuple(value.shape)}, neither the "
                        f"parameter's {tuple(p.shape)} nor a scalar; it cannot be sliced with its parameter "
                        f"({type(optimizer).__name__} is not supported by a plan switch)")
    return tensors, meta


def state_keys(described: list[dict]) -> dict[str, dict[str, tuple]]:
    """Parameter name -> state key -> its kind, over every rank's old optimizer."""
    keys: dict[str, dict[str, tuple]] = {}
    for d in described:
        for name, entries in d["state"].items():
            for key, meta in entries.items():
                keys.setdefault(name, {}).setdefault(key, meta)
    return keys


def allocate_state(target: NamedState, keys, sources: NamedState, had: Mapping[str, Slab],
                    wanted: Mapping[str, Slab]) -> NamedState:
    """The new optimizer state tensors of this rank: the old tensor itself where this rank held the
    same slab (nothing to copy), else an empty one to be filled by the moves."""
    out: NamedState = {}
    for name, entries in keys.items():
        if name not in target:
            continue
        param = target[name][0]
        for key, meta in entries.items():
            if meta[0] == "value":
                continue
            state = state_name(name, key)
            slab = wanted[state]
            if had.get(state) == slab:
                out[state] = (sources[state][0], slab)
            elif meta[0] == "param":
                out[state] = (torch.empty(slab.local_shape, dtype=getattr(torch, meta[1]), device=param.device), slab)
            else:
                device = torch.device("cpu") if meta[2] else param.device
                out[state] = (torch.empty((), dtype=getattr(torch, meta[1]), device=device), slab)
    return out


def _region(tensor: torch.Tensor, slab: Slab, move: Move) -> torch.Tensor:
    """The part of a local ``tensor`` (holding ``slab``) that ``move`` covers, as a view."""
    tensor = local(tensor)
    if move.dim is None:
        return tensor.reshape(1)
    return tensor.narrow(move.dim, slab.local_offset(move.dim, move.lo), move.hi - move.lo)


@torch.no_grad()
def execute_moves(moves: list[Move], rank: int, group: Optional[dist.ProcessGroup], sources: NamedState,
                  destinations: NamedState, parked: Optional[NamedState] = None) -> None:
    """Carry out ``moves`` (the same list on every rank of ``group``; plan rank = group rank, default
    group: the world) on rank ``rank``: pieces are read from ``sources`` and written into
    ``destinations`` (name -> local tensor and the :class:`~planner.balance.state_moves.Slab` it holds).
    Local copies first, then every send and receive of this rank in one ``batch_isend_irecv`` (tag:
    the move's index in the list, the same on both ends); returns once this rank's pieces arrived.
    A move from virtual rank ``world + r`` is sent by rank ``r`` from ``parked`` (see :func:`land`)."""
    group = group if group is not None else dist.group.WORLD
    wire = _wire_device(group)
    world = dist.get_world_size(group)
    ops, landing = [], []
    for index, move in enumerate(moves):
        origin = sources
        if move.src >= world:   # a parked piece: its host sends it
            move, origin = dataclasses.replace(move, src=move.src - world), parked
        if move.dst == rank:
            tensor, slab = destinations[move.name]
            into = _region(tensor, slab, move)
            if move.src == rank:
                src_tensor, src_slab = origin[move.name]
                if src_tensor is not tensor:
                    into.copy_(_region(src_tensor, src_slab, move))
                continue
            buffer = torch.empty(into.shape, dtype=into.dtype, device=wire or into.device)
            ops.append(dist.P2POp(dist.irecv, buffer, dist.get_global_rank(group, move.src), group, tag=index))
            landing.append((into, buffer))
        elif move.src == rank:
            src_tensor, src_slab = origin[move.name]
            payload = _region(src_tensor, src_slab, move).contiguous()
            payload = payload.to(wire) if wire is not None else payload
            ops.append(dist.P2POp(dist.isend, payload, dist.get_global_rank(group, move.dst), group, tag=index))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    for into, buffer in landing:
        into.copy_(buffer)


def _wire_device(group) -> Optional[torch.device]:
    """NCCL moves only CUDA tensors: CPU state (Adam's ``step``) travels through the current device."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return None


def _rebind(optimizer: torch.optim.Optimizer, make_optimizer: Callable, new, target: NamedState,
            new_state: NamedState, keys) -> None:
    """Put the new executor's parameters into ``optimizer``'s param groups (the assignment a fresh
    ``make_optimizer`` makes, the hyperparameters the running one has) and their moved state."""
    params = list(new.parameters())
    fresh = make_optimizer(params)
    if type(fresh) is not type(optimizer) or len(fresh.param_groups) != len(optimizer.param_groups):
        raise StateTransferError(
            f"make_optimizer built a {type(fresh).__name__} with {len(fresh.param_groups)} param groups for the new "
            f"executor, the running optimizer is a {type(optimizer).__name__} with {len(optimizer.param_groups)}; "
            "pass the factory that built the running optimizer")
    for group, assigned in zip(optimizer.param_groups, fresh.param_groups):
        group["params"] = list(assigned["params"])
    names = {id(t): n for n, (t, _) in target.items()}
    optimizer.state.clear()
    for p in params:
        name = names.get(id(p))
        if name is None and local(p).numel() == 0:
            continue       # a ZeRO shard holding no row of this parameter
        if name is None:
            raise StateTransferError(f"the new executor's parameter of shape {tuple(p.shape)} has no name in its "
                                     "named_state(); every parameter must be named to receive its state")
        entries = {}
        for key, meta in keys.get(name, {}).items():
            entries[key] = meta[1] if meta[0] == "value" else like(p, new_state[state_name(name, key)][0])
        if entries:
            optimizer.state[p] = entries
