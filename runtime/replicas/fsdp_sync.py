"""The ``fsdp`` replica sync: ZeRO stages 1, 2 and 3 on torch's FSDP2 (``fully_shard``), uneven batches.

What torch does and we reuse: FSDP2 shards every parameter on dimension 0 over the data-parallel
group (``torch.chunk``: the first ranks hold one row more when the rows do not divide), gathers
them for compute (``all_gather_into_tensor``), reduce-scatters the gradients and steps the
optimizer on the shards (the parameters are ``DTensor``s, so the optimizer's state is sharded with
them). The three ZeRO stages are three ways of driving it, chosen per stage by
``StagePlan.zero_stage``:

* **stage 1** (optimizer state sharded): ``reshard_after_forward=False``; every micro-batch but the
  rank's last runs with ``set_requires_gradient_sync(False)`` and ``set_reshard_after_backward(False)``,
  so the gradients accumulate unsharded and the parameters stay gathered (no collective) until the
  last backward reduce-scatters the whole accumulated gradient. So, as in DDP and Poplar's ZeRO-0/1,
  each rank may run its own number of micro-batches (per-device micro-batch size and last batch size).
  Why not ``ZeroRedundancyOptimizer``: it assigns whole parameters to ranks (a rank's share is as
  coarse as the largest tensor), keeps every rank's full gradient in DDP's buckets and needs a
  second wrapper around DDP; FSDP2 driven this way holds the same (full parameters and gradients
  while computing, 1/n of the optimizer state) with one wrapper and element-exact shards.
* **stage 2** (and gradients): every backward reduce-scatters (the gradient is held sharded between
  micro-batches); the parameters stay gathered from the first forward to the last backward.
* **stage 3** (and parameters): ``reshard_after_forward=True``: each FSDP unit gathers its
  parameters before its forward and again before its backward and frees them after; FSDP2
  prefetches the next unit's all-gather while one computes. Units: the executor passes the module
  paths of the model's layers (``layers``, the capture's Layers that are submodules, e.g.
  ``transformer.h.3``; in a pipeline stage, the layer modules :mod:`runtime.parallel.stage_units`
  cut it into, ``units.submod_3``); each is ``fully_shard``-ed on its own before the root, so one
  layer's parameters are whole at a time. A layer sharing a parameter with the rest of the model (tied
  input and output embeddings) is no unit of its own: the shared parameter is the root unit's,
  gathered across all its uses (:func:`runtime.replicas.sync_parts.own_units`; FSDP2 refuses a
  parameter in two units, and one freed after the embedding would be missing at the output).

At stages 2 and 3 every micro-batch issues collectives, so every rank of the group runs the same
number of micro-batches (the plan gives faster devices larger ones; :mod:`planner.plan_checks`).

Uneven batches stay exact the way DDP's do (:mod:`runtime.replicas.ddp_sync`): rank ``i``'s loss is
weighted by ``n_i / B`` and the gradients are *summed* (``set_gradient_divide_factor(1)`` with
sum-only reductions on every unit; FSDP2's default averages), so the sum is the gradient of the
global-batch mean loss whatever the shares.

The passenger (the step's loss, the monitor's figures) is summed in one all-reduce of its own after
the step's last backward: FSDP2 has no bucket to append it to.

What a rank holds (:meth:`FSDPSync.named_state`): each parameter's rows ``[i*c, min((i+1)*c, R))``
(``c = ceil(R / n)``), a :class:`~planner.balance.state_moves.Slab` along dim 0, and each buffer
whole; the tensors are the ``DTensor`` parameters themselves (the optimizer's keys), whose local
shards :func:`runtime.replicas.held_state.local` reads and writes. A rank that holds no row of a
small parameter does not name it. So checkpoints and live re-plans move ZeRO holdings with the same
``plan_moves`` as any other.

Initial values: like DDP, the group's first rank broadcasts its parameters and buffers before
sharding, so every replica starts from the same model. A module on the meta device (built empty:
each rank materialises only what it holds) is sharded first, then ``to_empty`` gives storage to its
shards alone (FSDP2's meta-device path, as torchtitan uses it); its values come from a checkpoint
or an init afterwards, written into the shards.

Emulation enters here, at the seam: under an emulated network each all-gather and reduce-scatter
is padded to its ring time on the group's devices (FSDP2's ``set_custom_all_gather`` /
``set_custom_reduce_scatter``), inside the compute segment it falls in.

Parameters tied to another pipeline stage (``keep_whole``) stay whole, outside FSDP2
(``ignored_params``): their gradients are summed over the group and then over the stages by
:mod:`runtime.parallel.tied_weights`, which adds whole gradients; their optimizer state is whole.

Invariant: every rank of the group wraps the same units in the same order with the same stage, so
FSDP2's collectives match; :meth:`release` gathers every parameter back into a plain tensor and
removes FSDP2's hooks, so another executor can take the module over.
"""
from __future__ import annotations

import time
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Mapping, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard

from planner.balance.state_moves import Slab
from runtime.emulation.compute import Emulator
from runtime.replicas.held_state import (NamedState, compute_device, drop_memo_references, dtensor_range, is_dtensor,
                                        is_materialised, module_state, place)
from runtime.replicas.sync_parts import Exact, OwnPassenger, WholeParameters, own_units
from whalelike.errors import WhaleError

try:   # torch >= 2.8: FSDP2's pluggable collectives (the emulated network pads them)
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
except ImportError:  # pragma: no cover - older torch: no padding of FSDP2's collectives
    DefaultAllGather = DefaultReduceScatter = None


class FSDPSyncError(WhaleError):
    """A ZeRO sync cannot be built as the plan asks."""


def _mesh(group: dist.ProcessGroup, device_type: str) -> DeviceMesh:
    """A 1-D device mesh over ``group`` (FSDP2's unit of sharding)."""
    return DeviceMesh.from_group(group, device_type)


class _PaddedAllGather(DefaultAllGather if DefaultAllGather is not None else object):
    """FSDP2's all-gather, then its modeled ring time on the emulated network."""

    def __init__(self, network, devices):
        self.network, self.ring = network, network.ring(tuple(devices))

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        work = super().__call__(output_tensor, input_tensor, group, async_op=False)
        _sleep_modeled(self.network, self.ring.allgather_ms(output_tensor.numel() * output_tensor.element_size()))
        return work


class _PaddedReduceScatter(DefaultReduceScatter if DefaultReduceScatter is not None else object):
    """FSDP2's reduce-scatter, then its modeled ring time (that of an all-gather of the same bytes)."""

    def __init__(self, network, devices):
        self.network, self.ring = network, network.ring(tuple(devices))

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        work = super().__call__(output_tensor, input_tensor, group, op, async_op=False)
        _sleep_modeled(self.network, self.ring.allgather_ms(input_tensor.numel() * input_tensor.element_size()))
        return work


def _sleep_modeled(network, ms: float) -> None:
    network.stats.allreduces += 1
    network.stats.allreduce_modeled_s += ms * 1e-3
    time.sleep(ms * 1e-3)


class FSDPSync(Exact, OwnPassenger, WholeParameters):
    """:class:`runtime.replicas.replica_sync.ReplicaSync` on FSDP2 at ZeRO ``stage`` 1, 2 or 3 (see the
    module docstring).

    ``module``: the stage module of this rank (sharded in place, as ``fully_shard`` does);
    ``group``: the ranks holding the same parameters; ``layers``: module paths in ``module`` to
    shard as units of their own before the root (stage 3 gathers one at a time); ``devices``: the
    group's devices in rank order (the emulated network's ring).
    """

    name = "fsdp"
    gradients_in_place = gradients_as_views = False
    syncs = True

    def __init__(self, module: nn.Module, group: Optional[dist.ProcessGroup], *, stage: int,
                 emulator: Optional[Emulator] = None, devices: Optional[Sequence[str]] = None,
                 layers: Sequence[str] = (), reduce_dtype: Optional[torch.dtype] = None,
                 keep_whole: Sequence[nn.Parameter] = (), device: Optional[torch.device] = None):
        if stage not in (1, 2, 3):
            raise FSDPSyncError(f"StagePlan.zero_stage is {stage!r} for the 'fsdp' replica sync; it shards at ZeRO "
                                "stages 1, 2 or 3 (stage 0 is replica_sync 'ddp'); make the plan with this version")
        if group is None:
            group = dist.group.WORLD
        self.inner = module
        self.group = group
        self.stage = stage
        self.emulator = emulator or Emulator.disabled()
        self.size = dist.get_world_size(group)
        self.group_rank = dist.get_rank(group)
        # a module on the meta device (built empty, materialised rank by rank) is sharded first and
        # then given storage for its shards only; its values come from a checkpoint or an init
        empty = not is_materialised(module)
        device = compute_device(module, device)
        if not empty:
            place(module, device)
            _broadcast_state(module, group)
        mesh = _mesh(group, device.type)
        reshard = stage == 3
        # a tensor-parallel slice is sharded further along its own split dimension, so what a rank
        # holds stays one range along one dimension (a Slab); everything else along dim 0
        dims = tensor_parallel_dims(module)
        placement = (lambda p: Shard(dims.get(p, 0))) if dims else None
        # parameters the caller syncs itself (tied to another pipeline stage): FSDP2 leaves them whole
        ignored = set(keep_whole) or None
        self.units: list[FSDPModule] = []
        for path in own_units(module, layers):     # a tied weight's layers leave it to the root unit
            sub = module.get_submodule(path)
            if sub is module or not any(p.requires_grad for p in sub.parameters()):
                continue
            fully_shard(sub, mesh=mesh, reshard_after_forward=reshard, shard_placement_fn=placement,
                        ignored_params=ignored)
            self.units.append(sub)
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard, shard_placement_fn=placement,
                    ignored_params=ignored)
        self.units.append(module)
        if empty:   # FSDP2 allocates each shard (and the whole ignored parameters), identities kept
            _to_empty(module, device)
        network = self.emulator.network if self.emulator.enabled and devices is not None else None
        for unit in self.units:
            unit.set_gradient_divide_factor(1.0)            # summed: the losses carry n_i / B
            unit.set_force_sum_reduction_for_comms(True)
            if network is not None and DefaultAllGather is not None:
                unit.set_custom_all_gather(_PaddedAllGather(network, devices))
                unit.set_custom_reduce_scatter(_PaddedReduceScatter(network, devices))
        if reduce_dtype is not None:
            # FSDP2 reduces in the gradients' dtype unless a MixedPrecisionPolicy says otherwise;
            # a policy must be given at fully_shard time, so low-precision reduction is not offered
            raise FSDPSyncError("grad_reduce_dtype='bf16' is not available with ZeRO (replica_sync 'fsdp'): the "
                                "gradients are reduce-scattered in float32; leave grad_reduce_dtype unset")

    # -- the protocol ---------------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        return self.inner

    def _set(self, sync: bool) -> None:
        for unit in self.units:
            if self.stage == 1:
                unit.set_requires_gradient_sync(sync, recurse=False)
            if self.stage in (1, 2):
                unit.set_reshard_after_backward(sync, recurse=False)

    def no_sync(self) -> AbstractContextManager:
        """Stage 1: accumulate unsharded gradients, parameters kept gathered (no collective). Stage 2:
        gradients are reduce-scattered anyway, the parameters stay gathered. Stage 3: nothing to
        hold back (each micro-batch gathers and reduce-scatters)."""
        if self.stage == 3:
            return nullcontext()
        return self._held()

    @contextmanager
    def _held(self):
        self._set(False)
        try:
            yield
        finally:
            self._set(True)

    def arm(self, roots: Sequence[torch.Tensor]) -> None:
        """The next backward syncs: FSDP2 reads its flags when the backward reaches each unit, so
        setting them now is enough (the forward's ``no_sync`` has ended)."""
        self._set(True)

    def named_state(self, names: Optional[Mapping[str, Sequence[str]]] = None) -> NamedState:
        """Each parameter's range this rank holds (a Slab along its shard dimension, within its
        tensor-parallel slice if it has one; parameters it holds nothing of are not
        named), each buffer whole."""
        out: NamedState = {}
        for name, (tensor, slab) in module_state(self.inner, names).items():
            if isinstance(tensor, DTensor):
                held = dtensor_range(tensor)
                if held is None:
                    continue
                slab = _within(slab, *held)
            out[name] = (tensor, slab)
        return out

    def release(self) -> nn.Module:
        """Gather every parameter back into a plain ``nn.Parameter`` (collective over the group) and
        take FSDP2's hooks and class off every unit; this sync is not used again."""
        with torch.no_grad():
            for unit in reversed(self.units):
                _unshard_permanently(unit)
        self.units = []
        return self.inner


@torch.no_grad()
def _to_empty(module: nn.Module, device: torch.device) -> None:
    """``module.to_empty(device)`` (FSDP2 gives its sharded parameters storage for their shards
    alone and re-pads them) keeping what already had values: ``to_empty`` empties every tensor,
    and a module built under ``whalelike.empty_weights`` keeps real buffers (a rotary embedding's
    frequencies, computed when it was built and saved nowhere)."""
    def named() -> dict:
        return {**dict(module.named_parameters(remove_duplicate=False)),
                **dict(module.named_buffers(remove_duplicate=False))}

    kept = {name: t.detach().clone() for name, t in named().items() if not t.is_meta and not is_dtensor(t)}
    for tensor in named().values():
        drop_memo_references(tensor)
    with _swapping():     # (buffers are replaced, not swapped: restored by name)
        module.to_empty(device=device)
    now = named()
    for name, value in kept.items():
        now[name].copy_(value)


@contextmanager
def _swapping():
    """``Module._apply`` swapping tensors in place (``torch.utils.swap_tensors``) instead of making new
    parameter objects: the model, the captured graph and tied stages keep sharing each tensor."""
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)


def _within(slab: Slab, dim: int, start: int, stop: int) -> Slab:
    """What a rank holds of a tensor whose local part (described by ``slab``: whole, or a
    tensor-parallel slice) it holds only ``[start, stop)`` of, along ``dim`` of that local part."""
    if slab.whole:
        return Slab(slab.shape, dim, ((start, stop),))
    if slab.dim != dim:
        raise FSDPSyncError(f"a ZeRO shard along dim {dim} of a tensor-parallel slice along dim {slab.dim}: "
                            "the shard must follow the slice's dimension")
    ranges, offset = [], 0
    for a, b in slab.ranges:     # the slice's ranges, concatenated in order in the local tensor
        lo, hi = max(start, offset), min(stop, offset + b - a)
        if lo < hi:
            ranges.append((a + lo - offset, a + hi - offset))
        offset += b - a
    return Slab(slab.shape, dim, tuple(ranges))


def tensor_parallel_dims(module: nn.Module) -> dict:
    """Each tensor-parallel parameter of ``module`` -> the dimension its slice is cut along."""
    from runtime.tensor.experts import experts_layers
    from runtime.tensor.layers import ParallelLinear

    dims = {}
    for layer in module.modules():
        if isinstance(layer, ParallelLinear):
            for name in ("weight", "bias"):
                param, dim = getattr(layer, name), layer.sharded_dim(name)
                if param is not None and dim is not None:
                    dims[param] = dim
    for base, layer in experts_layers(module):    # an expert-parallel layer's experts: rows along dim 0
        for target in layer.targets.values():
            dims[module.get_parameter(base + target)] = 0
    return dims


@torch.no_grad()
def _broadcast_state(module: nn.Module, group: dist.ProcessGroup) -> None:
    """Every replica starts from the group's first rank's parameters and buffers (as DDP does)."""
    src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
    for tensor in [*module.parameters(), *module.buffers()]:
        dist.broadcast(tensor.data, src=src, group=group)


def _unshard_permanently(unit: nn.Module) -> None:
    """Replace ``unit``'s own FSDP2 parameters by plain full ones and drop its FSDP2 state."""
    state = unit._get_fsdp_state() if isinstance(unit, FSDPModule) else None
    if state is None:
        return
    for group in state._fsdp_param_groups:
        for fsdp_param in group.fsdp_params:
            full = fsdp_param.sharded_param.full_tensor().detach().clone()
            param = nn.Parameter(full, requires_grad=fsdp_param.sharded_param.requires_grad)
            owner = fsdp_param._module_info.module
            setattr(owner, fsdp_param._module_info.param_name, param)
            for shared_module, shared_name in zip(fsdp_param._module_info.shared_modules,
                                                  fsdp_param._module_info.shared_param_names):
                setattr(shared_module, shared_name, param)
    for name in ("_pre_forward_hook_handle", "_post_forward_hook_handle"):
        handle = getattr(state, name, None)
        if handle is not None:
            handle.remove()
    for fsdp_param in (p for g in state._fsdp_param_groups for p in g.fsdp_params):
        handle = getattr(fsdp_param, "_post_load_hook_handle", None)
        if handle is not None:
            handle.remove()
    # forget the composable API's records, so fully_shard may wrap the module again
    import importlib
    from torch.distributed import _composable_state
    contract = importlib.import_module("torch.distributed._composable.contract")   # the module, not its function
    for key in (contract.REGISTRY_KEY, contract.STATE_KEY):
        unit.__dict__.pop(key, None)
    _composable_state._module_state_mapping.pop(unit, None)
    unit.__class__ = _original_class(unit)


def _original_class(unit: nn.Module) -> type:
    """The class ``fully_shard`` replaced with its ``FSDP<cls>`` subclass."""
    cls = unit.__class__
    if issubclass(cls, FSDPModule):
        for base in cls.__bases__:
            if base is not FSDPModule:
                return base
    return cls
