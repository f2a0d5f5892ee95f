"""What state a rank holds: each parameter and buffer under the model's name, with the part of it held.

One description serves every consumer of "who holds what": live re-plans move exactly the pieces
:func:`planner.balance.state_moves.plan_moves` computes from every rank's description
(:mod:`runtime.state.transfer`), and checkpoints write and read the same pieces in
full-tensor coordinates (:mod:`runtime.checkpoint`). The replica sync of a stage
(:mod:`runtime.replicas.replica_sync`) gives it, because the sync decides what a replica keeps
(DDP: everything whole; a sharded data parallel: its shard).

A held tensor may be a ``DTensor`` (ZeRO on FSDP2, :mod:`runtime.replicas.fsdp_sync`): it is named by
the ``DTensor`` itself (the optimizer's key), and every reader and writer of its values goes through
:func:`local`, the rank's own rows, which its Slab describes; optimizer state created for it is wrapped
back with :func:`like`.

Invariant: the :class:`~planner.balance.state_moves.Slab` of each tensor is derived from the
layer's own slicing (a tensor-parallel layer's ``shard_of``, FSDP2's row chunks), never restated.
"""
from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Mapping, Optional, Sequence

import torch
import torch.nn as nn

from planner.balance.state_moves import Slab
from runtime.tensor.experts import experts_layers
from runtime.tensor.layers import ParallelLinear

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

NamedState = dict[str, tuple[torch.Tensor, Slab]]


def dtensor_class() -> Optional[type]:
    """torch's ``DTensor`` class once ``torch.distributed.tensor`` is imported, else None: no DTensor
    can exist before that import, and it costs about a second of CPU (sympy, the op strategies), so
    a process that never shards with FSDP2 never pays it (only a dict lookup per call)."""
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def is_dtensor(tensor) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (without importing ``torch.distributed.tensor``)."""
    cls = dtensor_class()
    return cls is not None and isinstance(tensor, cls)


def module_state(module: nn.Module, names: Optional[Mapping[str, Sequence[str]]] = None) -> NamedState:
    """``module``'s parameters and persistent buffers under the model's names, with what each
    holds: tensor-parallel weights their shard (:func:`parallel_slab`), an expert-parallel layer's
    stacked weights this rank's experts (rows along dim 0), all else whole.

    ``names`` maps ``module``'s state-dict keys to the model's names of the same tensor (first
    one canonical, as ``StageWorker._state_names`` does); default: the keys are the model's
    names, and a tensor under several keys (tied weights) is named by its first. A tied parameter
    held twice by one tensor-parallel stage (an embedding whole, a sharded head's slice of it) is
    two tensors: the first under the model's name, the other under ``"<name>@<key>"``; every copy
    holds the same values, so each moves like a tensor of its own.
    """
    slabs: dict[int, Slab] = {}
    for layer in module.modules():
        if isinstance(layer, ParallelLinear):
            for param in ("weight", "bias"):
                if getattr(layer, param) is not None:
                    slabs[id(getattr(layer, param))] = parallel_slab(layer, param)
    for base, layer in experts_layers(module):    # expert parallel: this rank's experts, rows along dim 0
        for target in layer.targets.values():
            local = module.get_parameter(base + target)
            full = (sum(layer.counts),) + tuple(local.shape[1:])
            slabs[id(local)] = Slab(full, 0, ((layer.first, layer.first + layer.counts[layer.tp_index]),))
    seen: set[int] = set()
    out: NamedState = {}
    for key, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        name = names[key][0] if names is not None else key
        slab = slabs.get(id(tensor), Slab(tuple(tensor.shape)))
        out[f"{name}@{key}" if name in out else name] = (tensor, slab)
    return out


def parallel_slab(layer: ParallelLinear, param: str) -> Slab:
    """What ``layer``'s ``param`` holds of the full tensor, from the layer's own slicing
    (``shard_of`` of the positions along the sharded dimension): one range, or one per part of a
    fused projection."""
    local = getattr(layer, param)
    dim = layer.sharded_dim(param)
    if dim is None:
        return Slab(tuple(local.shape))
    full = sum(layer.shard_sizes)
    shape = tuple(full if d == dim else n for d, n in enumerate(local.shape))
    positions = layer.shard_of(param, torch.arange(full).view([-1 if d == dim else 1 for d in range(local.dim())]))
    ranges: list[list[int]] = []
    for p in positions.reshape(-1).tolist():
        if ranges and ranges[-1][1] == p:
            ranges[-1][1] = p + 1
        else:
            ranges.append([p, p + 1])
    return Slab(shape, dim, tuple((a, b) for a, b in ranges))


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The values this rank holds of ``tensor``: the local shard of a ``DTensor`` (an alias: writing
    it writes the parameter), the tensor itself otherwise."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def like(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` (this rank's local values of a state tensor shaped like ``param``) in ``param``'s
    form: a ``DTensor`` with ``param``'s mesh and placements when ``param`` is one (its optimizer
    state must be), else ``value`` unchanged. 0-dim values (Adam's step) stay plain."""
    if is_dtensor(param) and not is_dtensor(value) and value.dim() > 0:
        return dtensor_class().from_local(value, param.device_mesh, param.placements, run_check=False,
                                                 shape=param.shape, stride=param.stride())
    return value


def is_sharded(module: nn.Module) -> bool:
    """Whether a ZeRO sync holds ``module``'s parameters as shards (``DTensor``s)."""
    cls = dtensor_class()
    return cls is not None and any(isinstance(p, cls) for p in module.parameters())


@torch.no_grad()
def load_rows(module: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy ``module``'s part of a full state dict (keys: ``module``'s own) into it: a sharded
    parameter its rows (:func:`rows_of`), everything else whole. KeyError names what is missing."""
    mine = module.state_dict(keep_vars=True)
    missing = sorted(set(mine) - set(state))
    if missing:
        raise KeyError(f"{missing} missing from the state dict")
    for name, tensor in mine.items():
        local(tensor).copy_(rows_of(tensor, state[name]))


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of ``tensor``: a ``DTensor`` gathered (collective over its mesh), else itself."""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor


def rows_of(tensor: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """The part of ``full`` (a whole tensor) that ``tensor`` holds locally: a ``DTensor``'s range along
    its sharded dimension (:func:`dtensor_range`), else all of it."""
    if not is_dtensor(tensor):
        return full
    held = dtensor_range(tensor)
    if held is None:
        (placement,) = tensor.placements
        return full.narrow(placement.dim, 0, 0)
    dim, start, stop = held
    return full.narrow(dim, start, stop - start)


def dtensor_range(tensor: DTensor) -> Optional[tuple[int, int, int]]:
    """``(dim, start, stop)``: the positions along its sharded dimension that this rank holds of
    ``tensor`` (sharded over a 1-D mesh in torch.chunk's layout); None when it holds none."""
    (placement,) = tensor.placements
    dim = placement.dim
    size = tensor.shape[dim]
    n = tensor.device_mesh.size()
    rank = tensor.device_mesh.get_local_rank()
    chunk = math.ceil(size / n) if size else 0
    start, stop = min(rank * chunk, size), min((rank + 1) * chunk, size)
    return (dim, start, stop) if stop > start else None


def is_materialised(module: nn.Module) -> bool:
    """Whether every parameter and buffer of ``module`` has storage (none is on the meta device)."""
    return not any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def compute_device(module: nn.Module, device: Optional[torch.device]) -> torch.device:
    """``device``, or (None) where ``module``'s materialised tensors are: the CPU when none is."""
    if device is None:
        device = next((t.device for t in (*module.parameters(), *module.buffers()) if not t.is_meta),
                      torch.device("cpu"))
    return torch.device(device)


@torch.no_grad()
def place(module: nn.Module, device: Optional[torch.device]) -> int:
    """Give each parameter and buffer of ``module`` storage on ``device``, in place: a tensor on the
    meta device gets uninitialised storage (its values come later: a checkpoint, an init), one on
    another device is moved. Identity is kept (``torch.utils.swap_tensors``): the user's model, the
    captured graph and every stage module that share a tensor still share it, and a rank gives
    storage to what its part of the plan holds and nothing else. ``device`` None: where the module's
    materialised tensors are (the CPU when none is). Returns the bytes allocated. ``DTensor``s are
    FSDP2's to place (``to_empty``)."""
    device = compute_device(module, device)
    allocated, seen = 0, set()
    for tensor in (*module.parameters(), *module.buffers()):
        if id(tensor) in seen or is_dtensor(tensor):
            continue
        seen.add(id(tensor))
        allocated += place_one(tensor, device)
    return allocated


@torch.no_grad()
def place_one(tensor: torch.Tensor, device: torch.device) -> int:
    """:func:`place` for one tensor (a parameter stays a parameter); the bytes allocated."""
    if tensor.is_meta:
        new = torch.empty_like(tensor, device=device)
    elif tensor.device != torch.device(device):
        new = tensor.to(device)
    else:
        return 0
    if isinstance(tensor, nn.Parameter):
        new = nn.Parameter(new, requires_grad=tensor.requires_grad)
    drop_memo_references(tensor)
    torch.utils.swap_tensors(tensor, new)
    return new.numel() * new.element_size()


def drop_memo_references(tensor: torch.Tensor) -> None:
    """``torch.utils.swap_tensors`` refuses a tensor with weak references. Capture ran the model on
    fake tensors, and torch's fake-tensor converters remember each real tensor they converted in a
    ``torch.utils.weak.WeakIdKeyDictionary`` (a memo: a later conversion makes a new fake); those
    entries are dropped, through the dictionary's own removal callback. Any other weak reference is
    left, and the swap then says so."""
    import weakref

    from torch.utils.weak import WeakIdRef

    for ref in weakref.getweakrefs(tensor):
        callback = getattr(ref, "__callback__", None)
        if isinstance(ref, WeakIdRef) and callback is not None:
            callback(ref)


def held_part(full: torch.Tensor, slab: Slab) -> torch.Tensor:
    """The part of ``full`` (a whole tensor of ``slab.shape``) that ``slab`` describes, laid out as the
    holder's local tensor: all of it, or its ranges along ``slab.dim`` concatenated in order."""
    if tuple(full.shape) != tuple(slab.shape):
        raise ValueError(f"a whole tensor of shape {tuple(full.shape)} for a slab of a {tuple(slab.shape)} tensor")
    if slab.whole:
        return full
    parts = [full.narrow(slab.dim, a, b - a) for a, b in slab.ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=slab.dim)
