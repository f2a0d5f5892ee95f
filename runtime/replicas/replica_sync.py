"""The replica-sync seam: how a data-parallel group keeps its replicas of a stage module in step.

Every executor that runs a stage on several workers holding the same parameters (the stage's
workers of one ``tp_index`` in every replica) needs the same few things from whatever keeps those
replicas in step, and nothing else:

* ``module``: what the forward runs through (a wrapper may prepare its sync there);
* ``no_sync()``: accumulate gradients without syncing (every micro-batch but the last);
* ``arm(roots)``: make the next backward from ``roots`` sync although its forward ran under
  ``no_sync`` (a pipeline's last backward, whose forward ran long before);
* ``carry(tensor, fill)`` then ``flush()``: sum a small passenger (the step's loss, the straggler
  monitor's figures) in the collective that ends the step, not in one of its own;
* ``release()``: take every hook off the module, for a state move or another executor;
* ``named_state(names)``: what state this rank holds (:mod:`runtime.replicas.held_state`), for
  live re-plans and checkpoints;
* ``parameters()``: what the optimizer steps (the module's parameters, or this rank's shards of
  them); ``current()``: make the module's parameters current before they are read whole (a sync
  that refreshes them lazily); ``loaded()``: the module's parameters were overwritten whole, take
  what the sync keeps from them;
* ``after_step(plan, step, optimizer)``: called by the Engine on every rank after each step's
  optimizer step (or its skip), with the plan in force and the optimizer (:func:`after_step`; the
  exact syncs have nothing to do there: :class:`runtime.replicas.sync_parts.Exact`). Prague's partial all-reduce
  averages its parameters with its group here: its replicas step apart and meet afterwards;
* ``exact``: False for a sync whose steps are not the synchronous SGD of one device (P-Reduce;
  True for the others, :class:`runtime.replicas.sync_parts.Exact`); the Engine marks such steps
  approximate (:func:`runs_exact`).

Implementations, named by ``StagePlan.replica_sync`` (the names are
:data:`whalelike.config.REPLICA_SYNCS`): ``ddp`` (:mod:`runtime.replicas.ddp_sync`, torch DDP with
summed gradients: ZeRO stage 0), ``fsdp`` (:mod:`runtime.replicas.fsdp_sync`, ZeRO stages 1-3 on torch's
FSDP2, even shards, ``StagePlan.zero_stage`` says which) and ``ragged``
(:mod:`runtime.replicas.ragged_sync`, ZeRO stages 1-3 with memory-proportional shards,
``StagePlan.state_fractions``) and ``partial`` (:mod:`runtime.replicas.partial_sync`, Prague's
partial all-reduce: each replica steps on its own gradient, then averages with a group, in
``after_step``; approximate). A stage whose parameters no other worker holds gets :class:`AloneSync`, whatever
the plan names. Emulation enters inside the implementation (the comm hook pads DDP's all-reduce,
P-Reduce stamps its messages), so the executors never branch on it. P-Reduce registered here and no
executor changed; the Engine reaches each executor's syncs through its declared ``syncs()``
(:class:`runtime.parallel.executor.StepExecutor`).

Why a protocol of our own and not torch's: DDP, FSDP2's ``fully_shard`` and a partial all-reduce
have no common interface in torch (``no_sync`` vs ``set_requires_gradient_sync``, a reducer armed by
hand vs ``unshard``/``reshard``), and the executors must not know which one runs.

Invariant: every worker of a data-parallel group builds the same implementation from the same plan
(the name is plan data, checked by :mod:`planner.plan_checks`), so their collectives match.
"""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Callable, Mapping, Optional, Protocol, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from runtime.emulation.compute import Emulator
from runtime.replicas.ddp_sync import DDPSync
from runtime.replicas.ragged_sync import RaggedSync
from runtime.replicas.held_state import NamedState, is_materialised, module_state, place
from runtime.replicas.partial_sync import PartialSync
from runtime.replicas.sync_parts import Exact, OwnPassenger, WholeParameters
from whalelike.config import REPLICA_SYNCS
from whalelike.errors import WhaleError

if TYPE_CHECKING:
    from runtime.replicas.fsdp_sync import FSDPSync


class ReplicaSync(Protocol):
    """What an executor needs from the sync of one stage's replicas (see the module docstring)."""

    name: str
    syncs: bool          # whether a collective keeps replicas in step (False: the worker is alone)

    @property
    def module(self) -> nn.Module: ...

    def no_sync(self) -> AbstractContextManager: ...

    def arm(self, roots: Sequence[torch.Tensor]) -> None: ...

    def carry(self, tensor: torch.Tensor, fill: Optional[Callable[[torch.Tensor], None]] = None) -> None: ...

    def flush(self) -> None: ...

    def named_state(self, names: Optional[Mapping[str, Sequence[str]]] = None) -> NamedState: ...

    def parameters(self) -> list[nn.Parameter]: ...

    def current(self) -> None: ...

    def loaded(self) -> None: ...

    def release(self) -> nn.Module: ...

    exact: bool          # False for a sync whose steps are approximate (P-Reduce)
    # the parameters' gradients are views of the sync's own buffers (DDP's buckets): the optimizer
    # zeroes them in place between steps (set to None, the next backward would allocate them anew
    # beside the buffers, and accumulation over micro-batches hold both)
    gradients_in_place: bool
    # the gradients become views of the sync's buffers after its first synced backward, though it does not
    # yet say gradients_in_place (DDP until it has rebuilt its buckets): an executor that accumulates over
    # micro-batches zeroes them in place all the same (runtime.parallel.executor.StepExecutor.gradients_in_place)
    gradients_as_views: bool

    def after_step(self, plan, step: int, optimizer: Optional[torch.optim.Optimizer] = None) -> None: ...


class AloneSync(Exact, OwnPassenger, WholeParameters):
    """No replicas to keep in step (one worker holds these parameters, or there are none to train):
    the module runs as is. A passenger is still summed over ``group`` if one is given."""

    name = "alone"
    syncs = False
    gradients_in_place = gradients_as_views = False

    def __init__(self, module: nn.Module, group: Optional[dist.ProcessGroup] = None):
        self.inner = module
        self.group = group

    @property
    def module(self) -> nn.Module:
        return self.inner

    def no_sync(self) -> AbstractContextManager:
        return nullcontext()

    def arm(self, roots: Sequence[torch.Tensor]) -> None:
        """Nothing to arm: no collective follows this worker's backward."""

    def named_state(self, names: Optional[Mapping[str, Sequence[str]]] = None) -> NamedState:
        return module_state(self.inner, names)

    def release(self) -> nn.Module:
        return self.inner


def _ddp(module, group, *, emulator, devices, reduce_dtype, zero_stage, layers, fractions, keep_whole,
         idle, device) -> DDPSync:
    if zero_stage:
        raise WhaleError(f"StagePlan.replica_sync is 'ddp' with zero_stage {zero_stage}; DDP is ZeRO stage 0 "
                         "(make the plan with this version of whalelike: stages 1-3 use replica_sync 'fsdp')")
    empty = not is_materialised(module)    # built on meta: filled from one source later, no broadcast
    place(module, device)
    return DDPSync(module, group, emulator=emulator, devices=devices, reduce_dtype=reduce_dtype, idle=idle,
                   init_sync=not empty)


def _fsdp(module, group, *, emulator, devices, reduce_dtype, zero_stage, layers, fractions, keep_whole,
          idle, device) -> FSDPSync:
    from runtime.replicas.fsdp_sync import FSDPSync   # FSDP2 imports torch.distributed.tensor: a second of CPU
    return FSDPSync(module, group, stage=zero_stage, emulator=emulator, devices=devices, layers=layers,
                    reduce_dtype=reduce_dtype, keep_whole=[*keep_whole, *idle], device=device)


def _ragged(module, group, *, emulator, devices, reduce_dtype, zero_stage, layers, fractions, keep_whole,
            idle, device) -> RaggedSync:
    return RaggedSync(module, group, stage=zero_stage, fractions=fractions, emulator=emulator, devices=devices,
                      reduce_dtype=reduce_dtype, layers=layers, keep_whole=[*keep_whole, *idle], device=device)


def _partial(module, group, *, emulator, devices, reduce_dtype, zero_stage, layers, fractions,
             keep_whole, idle, device) -> PartialSync:
    if zero_stage:
        raise WhaleError(f"StagePlan.replica_sync is 'partial' with zero_stage {zero_stage}; P-Reduce averages whole "
                         "parameters (ZeRO stage 0): re-create the plan with `whalelike plan`")
    if keep_whole:
        raise WhaleError("P-Reduce (replica_sync 'partial') on a ZeRO stage's kept-whole parameters: P-Reduce runs "
                         "at ZeRO stage 0; re-create the plan with `whalelike plan`")
    place(module, device)
    return PartialSync(module, group, emulator=emulator, devices=devices)


_IMPLEMENTATIONS: dict[str, Callable[..., ReplicaSync]] = {"ddp": _ddp, "fsdp": _fsdp, "ragged": _ragged,
                                                           "partial": _partial}
assert set(_IMPLEMENTATIONS) == set(REPLICA_SYNCS), "whalelike.config.REPLICA_SYNCS names every implementation"


def build_replica_sync(kind: str, module: nn.Module, group: Optional[dist.ProcessGroup], *,
                       emulator: Optional[Emulator] = None, devices: Optional[Sequence[str]] = None,
                       alone: bool = False, reduce_dtype: Optional[torch.dtype] = None,
                       zero_stage: int = 0, layers: Sequence[str] = (), fractions: Sequence[float] = (),
                       keep_whole: Sequence[nn.Parameter] = (),
                       idle: Sequence[nn.Parameter] = (), device: Optional[torch.device] = None) -> ReplicaSync:
    """The ``kind`` sync (a ``StagePlan.replica_sync`` name) of ``module`` over ``group``.

    ``devices``: the group's devices in rank order (an emulated network prices its collectives on
    them). ``alone``: no other worker holds these parameters, or none is trainable: an
    :class:`AloneSync`, whatever ``kind`` says. ``reduce_dtype``: the dtype gradients are reduced in
    (None: their own; ``Engine(grad_reduce_dtype="bf16")``). ``zero_stage``: the plan's
    ``StagePlan.zero_stage`` (0 for ``ddp``, 1-3 for ``fsdp``); ``layers``: module paths of
    ``module`` that ZeRO shards as units of their own (stage 3 gathers one at a time); ``fractions``:
    ``StagePlan.state_fractions`` (the ragged sync's share of the state per group rank);
    ``keep_whole``: parameters a ZeRO sync leaves whole and does not reduce (the caller sums their
    gradients over the group: weights tied across pipeline stages; DDP reduces everything);
    ``idle``: parameters the forward never reads (``Layer.idle_state``: no gradient ever reaches
    them), which every sync holds whole and never reduces (DDP would wait for their gradients).
    P-Reduce averages them with the rest: they never change, so the average is themselves.
    ``device``: where this rank computes; the sync gives storage there to what it holds of
    ``module`` (:func:`runtime.replicas.held_state.place`: a module on the meta device, built empty,
    is materialised rank by rank, the whole of it only where this rank keeps it whole, its shards
    alone under ZeRO; a module on another device is moved). None: where the module is.
    """
    if kind not in _IMPLEMENTATIONS:
        raise WhaleError(f"StagePlan.replica_sync is {kind!r}; the replica syncs are {sorted(_IMPLEMENTATIONS)} "
                         f"(make the plan with this version of whalelike)")
    idle_ids = {id(p) for p in idle}
    if alone or not any(p.requires_grad and id(p) not in idle_ids for p in module.parameters()):
        place(module, device)
        return AloneSync(module, group)
    return _IMPLEMENTATIONS[kind](module, group, emulator=emulator, devices=devices, reduce_dtype=reduce_dtype,
                                  zero_stage=zero_stage, layers=layers, fractions=fractions, keep_whole=keep_whole,
                                  idle=tuple(idle), device=device)


def after_step(executor, plan, step: int, optimizer=None) -> None:
    """The seam's hook after an optimizer step: each of ``executor``'s syncs runs its ``after_step``
    (P-Reduce averages with its group; an exact sync does nothing). Every rank calls it at every
    step, skipped or not."""
    for sync in executor.syncs():
        sync.after_step(plan, step, optimizer)


def runs_exact(executor) -> bool:
    """Whether every sync of ``executor`` is exact."""
    return all(sync.exact for sync in executor.syncs())
