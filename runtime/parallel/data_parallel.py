"""Data parallelism with uneven batch shares: the single-stage executor.

Rank ``i`` holds ``n_i`` of the ``B`` samples of a step, so its loss is weighted by ``n_i / B`` and
the replica sync *sums* gradients (:mod:`runtime.replicas.replica_sync`; DDP by default,
:mod:`runtime.replicas.ddp_sync`): the summed gradient is then exactly the gradient of the
global-batch mean loss, whatever the shares (Whale's load balancing, Poplar's per-device
micro-batch sizes). This executor owns the samples (which micro-batches, which weights); the sync
owns the collective and how it is emulated.

Layout of a global batch (every rank holds all of it and slices locally): whatever
:class:`planner.shares.layout.SampleLayout` says, the one owner of it: rank ``i`` in the
data-parallel group's Plan order takes a contiguous share and runs its micro-batches inside it.
Ranks may have different numbers of micro-batches (Poplar: each device its own micro-batch size
and last batch size); ``no_sync`` holds back every backward but the rank's last, so each rank's
single sync carries its whole accumulated gradient.

Re-planned shares (:meth:`DataParallelExecutor.set_plan`): the shares and micro-batch sizes are
only a slicing of the batch, so a plan of the same workers with other shares is adopted at a step
boundary by swapping the layout: no parameter moves, the sync (its buckets, its hook) stays.

The step's global loss and the Engine's passenger ride in the sync's collective
(:meth:`ReplicaSync.carry`), so a step costs one collective, as plain DDP's does.

Emulation: the forward of each micro-batch is padded by hooks on the stage module (a wrapper's own
pre-forward stays outside), the backward is a segment begun before ``loss.backward()``; the sync
pads its own communication.
"""
from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from planner.shares.layout import SampleLayout, check_global_batch
from planner.plan import Plan, PlanError
from planner.plan_checks import check_same_workers
from runtime.parallel.sync_batchnorm import check_equal_micro_batches, synchronise_batchnorm
from runtime.data import Share, slice_batch
from runtime.emulation.compute import Emulator
from runtime.parallel.executor import StepExecutor
from runtime.replicas.held_state import NamedState, full_tensor, is_sharded, load_rows
from runtime.replicas.replica_sync import ReplicaSync, build_replica_sync
from runtime.groups import RankGroup
from runtime.training import recompute
from runtime.training.precision import PlanLossScaler, weighted_loss

log = logging.getLogger(__name__)

def idle_parameters(module: nn.Module, names: Sequence[str]) -> list[nn.Parameter]:
    """The parameters of ``module`` among ``names`` (buffers among them need nothing: no sync reduces
    a buffer, and the whole model holds them)."""
    params = dict(module.named_parameters(remove_duplicate=False))
    return [params[n] for n in names if n in params]


class DataParallelExecutor(StepExecutor):
    """Runs a single-stage ``replicate`` Plan on one rank (see the module docstring); a
    :class:`runtime.parallel.executor.StepExecutor` that takes rank-local shares and adopts plans of
    other shares in place.

    ``flops_per_sample`` is ``(forward, backward)`` of the whole model, used only for emulation;
    ``memory_bytes_per_sample`` the same for the bytes its non-matmul operators move
    (:func:`runtime.parallel.stage_split.stage_memory_bytes_from_plan`), which the emulator prices at
    the device's memory bandwidth: both are passed to every forward and backward segment, scaled by
    the micro-batch's samples.
    ``recompute_layers``: the capture's ``Layer.name`` s, in order; when the plan recomputes, the
    submodule of each that is a module path is checkpointed on its own
    (:func:`runtime.training.recompute.wrap_layers`; none given: the module recomputes whole).
    ``zero_layers``: the layer names ZeRO shards as units of their own
    (:func:`planner.devices.cost_model.fsdp_unit_names`, what the memory model priced: tied weights
    stay in the root unit); None: ``recompute_layers``. ``idle``: the names of the module's
    parameters the captured forward never reads (``Layer.idle_state``), which the replica sync holds
    whole and never reduces. ``device``: where this rank computes; the replica sync gives storage
    there to what the rank holds of the model (a model on the meta device is materialised only there).
    """

    def __init__(self, module: nn.Module, plan: Plan, rank: int, group: RankGroup, loss_fn: Callable,
                 emulator: Optional[Emulator] = None, flops_per_sample: tuple[float, float] = (0.0, 0.0),
                 recompute_layers: Sequence[str] = (),
                 memory_bytes_per_sample: tuple[float, float] = (0.0, 0.0),
                 scaler: Optional[PlanLossScaler] = None, reduce_dtype: Optional[torch.dtype] = None,
                 zero_layers: Optional[Sequence[str]] = None, idle: Sequence[str] = (),
                 device: Optional[torch.device] = None):
        self.rank = rank
        self.scaler = scaler   # fp16's loss scale (runtime.training.precision), None otherwise
        self.group = group
        self.loss_fn = loss_fn
        self.emulator = emulator or Emulator.disabled()
        self.backward_flops = flops_per_sample[1]
        self.backward_memory_bytes = memory_bytes_per_sample[1]
        self.model = module
        self.sync_batchnorm = plan.sync_batchnorm and group.size > 1
        self._adopt(plan)
        if self.sync_batchnorm:
            synchronise_batchnorm(module, group.group)
        # activation checkpointing (runtime.training.recompute), one layer module at a time, inside
        # the replica sync's wrapper (never DDP itself); the emulated backward runs the forward again
        self.recomputes = plan.stages[0].recompute
        if self.recomputes:
            recompute.wrap_stage(module, plan.stages[0].recompute_unit, recompute_layers)
            self.backward_flops += flops_per_sample[0]
            self.backward_memory_bytes += memory_bytes_per_sample[0]
        # ZeRO shards each of the model's layer modules as a unit of its own (stage 3 gathers one at a
        # time), but a layer sharing a parameter with another (tied weights) leaves it to the root unit
        zero = plan.stages[0].zero_stage
        zero_layers = recompute_layers if zero_layers is None else zero_layers
        self.sync: ReplicaSync = build_replica_sync(plan.stages[0].replica_sync, module, group.group,
                                                    emulator=self.emulator,
                                                    devices=[plan.worker(r).device for r in sorted(group.ranks)],
                                                    # one worker: no replica to keep in step, no DDP buckets
                                                    alone=len(group.ranks) == 1,
                                                    reduce_dtype=reduce_dtype, zero_stage=zero,
                                                    fractions=plan.stages[0].state_fractions,
                                                    layers=recompute.layer_module_paths(module, zero_layers)
                                                    if zero else (), idle=idle_parameters(module, idle),
                                                    device=device)
        # the Engine's runtime.control.exchange.Passenger: summed in this step's all-reduce
        self.passenger = None
        self._unpad = self.emulator.pad_forward(module, flops_per_sample[0], memory_bytes_per_sample[0])

    takes_shares = True

    @property
    def module(self) -> nn.Module:
        """What this rank runs: the whole model."""
        return self.model

    def syncs(self) -> list[ReplicaSync]:
        return [self.sync]

    def takes_in_place(self, plan: Plan) -> bool:
        """Whether :meth:`set_plan` adopts ``plan``: the same replica sync (ZeRO stage, fractions),
        BatchNorm sync and recompute; only the shares differ (a pure function of the two plans)."""
        return (self.keeps_sync(plan) and plan.sync_batchnorm == self.plan.sync_batchnorm
                and plan.stages[0].recompute == self.recomputes and len(plan.stages) == 1)

    @property
    def shares(self) -> list[int]:
        """The data-parallel group's shares of a global batch, in group order."""
        return self.layout.dp_shares(self.rank)[0]

    @property
    def micro_batch_sizes(self) -> list[int]:
        return self.layout.micro_batch_sizes(self.rank)

    @property
    def global_batch_size(self) -> int:
        return self.layout.global_batch_size

    def set_plan(self, plan: Plan) -> None:
        """Adopt ``plan`` from the next step on: a plan of the same workers (ranks, devices, hosts,
        groups) whose micro-batch sizes, hence shares, may differ. Pure bookkeeping (no data moves,
        the replica sync is kept); every rank of the group must adopt the same plan at the same step boundary.
        Raises :class:`planner.plan.PlanError` naming what differs for any other plan."""
        check_same_workers(self.plan, plan, "set_plan")
        if not self.keeps_sync(plan):
            old, new = self.plan.stages[0], plan.stages[0]
            raise PlanError(f"set_plan: the replica sync is {new.replica_sync!r} at ZeRO stage {new.zero_stage} with state "
                            f"fractions {new.state_fractions} in the new plan, {old.replica_sync!r} at "
                            f"{old.zero_stage} with {old.state_fractions} in the running one; that moves state: "
                            "a new executor (Engine.apply_plan does it)")
        if plan.sync_batchnorm != self.plan.sync_batchnorm:
            raise PlanError(f"set_plan: sync_batchnorm is {plan.sync_batchnorm} in the new plan, "
                            f"{self.plan.sync_batchnorm} in the running one; that needs a new executor")
        if plan.stages[0].recompute != self.recomputes:
            raise PlanError(f"set_plan: stages[0].recompute is {plan.stages[0].recompute} in the new plan, "
                            f"{self.recomputes} in the running one; that needs a new executor")
        old = self.shares
        self._adopt(plan)
        log.info("rank %d: data-parallel shares %s -> %s, micro-batches %s", self.rank, old, self.shares,
                 self.micro_batch_sizes)

    def keeps_sync(self, plan: Plan) -> bool:
        """Whether ``plan`` keeps this executor's replica sync (name, ZeRO stage, state fractions): only
        then can it be adopted in place (:meth:`set_plan`); otherwise state moves."""
        old, new = self.plan.stages[0], plan.stages[0]
        return (old.replica_sync, old.zero_stage, old.state_fractions) == \
            (new.replica_sync, new.zero_stage, new.state_fractions)

    def _adopt(self, plan: Plan) -> None:
        """Take the layout of ``plan`` (checked against this rank's data-parallel group)."""
        if len(plan.stages) != 1 or plan.tensor_parallel:
            raise PlanError(f"DataParallelExecutor runs single-stage plans without split; this plan has "
                            f"{len(plan.stages)} stages and tp_size {max(w.tp_size for w in plan.workers)}")
        layout = SampleLayout.of(plan)
        if layout.dp_group(self.rank) != self.group.ranks:
            raise PlanError(f"rank {self.rank}: the plan's data-parallel group is ranks "
                            f"{list(layout.dp_group(self.rank))}, the process group holds {list(self.group.ranks)}; "
                            f"build the groups from this plan (runtime.groups.build_groups)")
        shares = layout.dp_shares(self.rank)[0]
        if sum(shares) != plan.global_batch_size:
            raise PlanError(f"plan: the data-parallel shares {shares} of ranks {list(self.group.ranks)} sum to "
                            f"{sum(shares)}, not global_batch_size={plan.global_batch_size}")
        if self.sync_batchnorm:
            check_equal_micro_batches([len(layout.micro_batch_sizes(r)) for r in self.group.ranks], self.group.ranks)
        self.plan, self.layout = plan, layout

    def parameters(self) -> Iterator[nn.Parameter]:
        """What the optimizer steps (the replica sync says: the module's parameters, or this rank's shards)."""
        return iter(self.sync.parameters())

    def train_step(self, inputs: tuple, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of this rank's share of the global batch (gradients summed over the
        group, scaled to the global-batch mean); returns the global-mean loss, equal on every rank."""
        n = targets.shape[0]
        check_global_batch(self.plan, n, f"rank {self.rank}")
        lo, hi = self.layout.split(n, self.rank)
        return self.train_share(Share(*slice_batch(inputs, targets, lo, hi), global_size=n))

    def train_share(self, share: Share) -> torch.Tensor:
        """Like :meth:`train_step` on a batch that holds only this rank's samples (from
        :class:`runtime.data.UnevenLoader`); a short last batch of an epoch is split into
        micro-batches no larger than the plan's largest."""
        # under synchronised BatchNorm every rank runs as many forwards as the plan's (each syncs)
        sizes = self.layout.micro_batches(self.rank, share.targets.shape[0], keep_count=self.sync_batchnorm)
        total = torch.zeros((), device=share.targets.device, dtype=self._loss_dtype())
        passenger, self.passenger = self.passenger, None
        carrier, fill = total, None
        lo = 0
        for m, size in enumerate(sizes):
            inputs, targets = slice_batch(share.inputs, share.targets, lo, lo + size)
            lo += size
            last = m == len(sizes) - 1
            with nullcontext() if last else self.sync.no_sync():
                loss = self._weighted_loss(inputs, targets, share.global_size)
                total += loss.detach()
                if last:  # the global loss rides in the gradient all-reduce: one collective per step
                    if passenger is not None:   # and so does the Engine's passenger, written at send time
                        carrier, fill = passenger.load(total)
                    self.sync.carry(carrier, fill)
                self.emulator.begin(self.backward_flops * size, size, memory_bytes=self.backward_memory_bytes * size)
                loss.backward()
                self.emulator.wait_deadline()  # no-op if the comm hook already waited
                self.emulator.wait_communication()   # the overlapped all-reduce's modeled end, if any
        self.sync.flush()
        return passenger.unload(carrier) if passenger is not None else total

    @torch.no_grad()
    def eval_step(self, inputs: tuple, targets: torch.Tensor) -> torch.Tensor:
        """Global-mean loss of a batch of any size (split in proportion to the plan's shares)."""
        n = targets.shape[0]
        mine = slice_batch(inputs, targets, *self.layout.split(n, self.rank))
        was_training = self.module.training
        self.module.eval()
        try:
            total = self._weighted_loss(*mine, n).detach().clone()
        finally:
            self.module.train(was_training)
        dist.all_reduce(total, group=self.group.group)
        return total

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every rank holds the whole model: its own state is the full state."""
        self.sync.current()
        return {k: full_tensor(v).detach().clone() for k, v in self.module.state_dict().items()}

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if is_sharded(self.module):          # ZeRO: this rank's rows of each parameter
            load_rows(self.module, state)
        else:
            self.sync.current()              # a sync that frees its whole parameters gives them storage
            self.module.load_state_dict(state)
            self.sync.loaded()

    def named_state(self) -> NamedState:
        """What this rank holds of every parameter and buffer, as its replica sync keeps them (DDP:
        whole); for :func:`runtime.state.transfer.switch_executor` and checkpoints."""
        return self.sync.named_state()

    def close(self) -> None:
        """Take this executor's hooks off the model (emulation padding, the replica sync's), so an
        executor of another plan can wrap it; this one is not used again."""
        self._unpad()
        self.sync.release()
        recompute.unwrap_stage(self.module)

    _dtype: Optional[torch.dtype] = None

    def _loss_dtype(self) -> torch.dtype:
        """The reported loss's dtype: the model's (a float64 model's loss is not rounded to float32);
        read once, the module's parameters keep their dtype while this executor runs it."""
        if self._dtype is None:
            self._dtype = next((p.dtype for p in self.module.parameters() if p.is_floating_point()),
                               torch.get_default_dtype())
        return self._dtype

    def _weighted_loss(self, inputs: tuple, targets: torch.Tensor, global_size: int) -> torch.Tensor:
        """This slice's mean loss times its fraction of the global batch. An empty slice (a rank
        with no samples in a short last batch) still runs forward and backward so DDP's all-reduce
        happens, with a zero loss."""
        outputs = self.sync.module(*inputs)
        n = targets.shape[0]
        if n == 0:
            return sum(t.sum() for t in _tensors(outputs)) * 0.0
        return weighted_loss(self.loss_fn(outputs, targets), n, global_size, self.scaler)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []
