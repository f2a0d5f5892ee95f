"""Data parallelism with uneven batch shares, on torch DDP.

What torch does and we reuse: DDP (parameter broadcast at construction, bucketed gradient
all-reduce overlapped with backward, ``no_sync`` for gradient accumulation). What it cannot do:
DDP averages gradients over ranks, which is the global-batch mean only when every rank holds the
same number of samples. Here rank ``i`` holds ``n_i`` of the ``B`` samples of a step, so its loss is
weighted by ``n_i / B`` and the comm hook *sums* (:func:`wrap_ddp`): the summed gradient is then
exactly the gradient of the global-batch mean loss, whatever the shares (Whale's load balancing,
Poplar's per-device micro-batch sizes).

Layout of a global batch (every rank holds all of it and slices locally): whatever
:class:`planner.shares.layout.SampleLayout` says, the one owner of it: rank ``i`` in the data-parallel
group's Plan order takes a contiguous share and runs its micro-batches inside it. Ranks may have
different numbers of micro-batches (Poplar: each device its own micro-batch size and last batch
size); ``no_sync`` holds back every backward but the rank's last, so each rank's single all-reduce
carries its whole accumulated gradient.

Re-planned shares (:meth:`DataParallelExecutor.set_plan`): the shares and micro-batch sizes are
only a slicing of the batch, so a plan of the same workers with other shares is adopted at a step
boundary by swapping the layout: no parameter moves, DDP (its buckets, its hook) stays.

The step's global loss is summed in the same all-reduce as the gradients (appended to the last
bucket, :func:`sum_with_gradients`), so a step costs one collective, as plain DDP's does.

Emulation: the forward of each micro-batch is padded by hooks on the wrapped module (DDP's own
pre-forward stays outside), the backward is a segment begun before ``loss.backward()``. Without an
emulated network the comm hook waits for its deadline before communicating, so modeled time never
includes waiting on peers. With one, the all-reduce overlaps the backward bucket by bucket in
modeled time (:func:`_emulate_overlap`); only the last bucket waits for the deadline.
"""
from __future__ import annotations

import inspect
import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from planner.shares.layout import SampleLayout
from planner.plan import Plan, PlanError
from planner.balance.state_moves import Slab
from runtime.parallel.sync_batchnorm import check_equal_micro_batches, synchronise_batchnorm
from runtime.data import Share, slice_batch
from runtime.emulation.compute import Emulator
from runtime.groups import RankGroup
from runtime.balance.state_transfer import module_state, release_ddp

log = logging.getLogger(__name__)

# torch >= 2.13 renamed ``broadcast_buffers`` (which also skipped the sync at construction).
_NO_FORWARD_BUFFER_SYNC = ("forward_sync_buffers" if "forward_sync_buffers" in
                           inspect.signature(DistributedDataParallel.__init__).parameters else "broadcast_buffers")


@dataclass
class _HookState:
    emulator: Emulator
    group: Optional[dist.ProcessGroup]
    average: bool
    passenger: Optional[torch.Tensor] = None
    fill: Optional[Callable[[torch.Tensor], None]] = None   # writes the passenger right before it is sent
    # network emulation: the group's devices in rank order (the ring), the gradient bytes of a
    # backward, and the bytes of this backward's buckets so far
    devices: Optional[tuple[str, ...]] = None
    total_bytes: int = 0
    launched_bytes: int = 0


def _deadline_allreduce(state: _HookState, bucket):  # no annotations: DDP checks them, and they are strings here
    """All-reduce the bucket (SUM, or AVG if asked), with the passenger of
    :func:`sum_with_gradients` appended to the last bucket. Under emulation without a network, wait
    out the backward's modeled time first; with one, overlap (:func:`_emulate_overlap`)."""
    network = state.emulator.network if state.devices is not None else None
    if network is None:
        state.emulator.wait_deadline()
    tensor = bucket.buffer()
    if state.average:
        tensor.div_(dist.get_world_size(state.group))
    passenger = state.passenger if bucket.is_last() else None
    if passenger is None:
        if network is not None:
            _emulate_overlap(state, bucket, tensor)
        work = dist.all_reduce(tensor, group=state.group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])
    state.passenger = None
    if state.fill is not None:
        state.fill, fill = None, state.fill
        fill(passenger)
    joint = torch.cat([tensor, passenger.reshape(-1).to(tensor.dtype)])
    if network is not None:
        _emulate_overlap(state, bucket, joint)
    work = dist.all_reduce(joint, group=state.group, async_op=True)

    def unpack(fut):
        out = fut.value()[0]
        passenger.copy_(out[tensor.numel():].view_as(passenger))
        return out[: tensor.numel()]

    return work.get_future().then(unpack)


def _emulate_overlap(state: _HookState, bucket, sent: torch.Tensor) -> None:
    """Under network emulation, record the bucket's modeled all-reduce before it is launched.

    DDP fills and launches buckets in index order as their gradients become ready (reverse layer
    order), so bucket ``k`` is modeled ready when the backward's modeled time has run the share of
    the gradient bytes of buckets ``0..k``; the last bucket closes the backward's compute segment
    first (at its modeled end), so no real waiting on peers falls inside it. Earlier buckets are
    launched for real at once (results stay exact); :meth:`Emulator.wait_communication` pads to the
    modeled end after the backward.
    """
    if bucket.index() == 0:
        state.launched_bytes = 0
    nbytes = sent.numel() * sent.element_size()
    state.launched_bytes += nbytes
    emulator = state.emulator
    if bucket.is_last():
        emulator.wait_deadline()
        ready = None
    else:
        ready = emulator.segment_ready(state.launched_bytes / max(state.total_bytes, 1))
    emulator.network.allreduce_launched(time.monotonic() if ready is None else ready, nbytes, state.devices,
                                        state.group, sent.device)


def sum_with_gradients(ddp: DistributedDataParallel, tensor: torch.Tensor,
                       fill: Optional[Callable[[torch.Tensor], None]] = None) -> None:
    """Sum ``tensor`` (in place) over the group in the gradient all-reduce of ``ddp``'s next
    synchronising backward, instead of in a collective of its own. Call it right before that
    backward; if no bucket carried it (nothing to sync), it is all-reduced on its own. ``fill``,
    if given, writes ``tensor``'s content right before it is sent: after the backward's compute
    (the straggler monitor sends this step's compute time)."""
    state: _HookState = ddp._whalelike_hook_state
    state.passenger, state.fill = tensor, fill


def _flush_passenger(ddp: DistributedDataParallel) -> None:
    state: _HookState = ddp._whalelike_hook_state
    if state.passenger is not None:
        passenger, state.passenger = state.passenger, None
        if state.fill is not None:
            state.fill, fill = None, state.fill
            fill(passenger)
        dist.all_reduce(passenger, group=state.group)


def wrap_ddp(module: nn.Module, process_group: Optional[dist.ProcessGroup], emulator: Optional[Emulator] = None,
             *, average: bool = False, devices: Optional[Sequence[str]] = None,
             bucket_cap_mb: Optional[float] = None) -> DistributedDataParallel:
    """DDP over ``process_group`` whose comm hook respects ``emulator``'s backward deadline.

    Gradients are summed (``average=False``): weight each rank's loss by its share of the global
    batch. ``average=True`` gives stock DDP semantics (equal shares), for peers in benchmarks.

    No buffer sync in forward (buffers are synced once, at construction): buffer broadcast is a collective inside every forward, which would
    fall inside the forward's compute segment (and a per-rank buffer such as BatchNorm statistics is
    computed from the rank's own share anyway, unless ``Plan.sync_batchnorm`` synchronises it:
    :mod:`runtime.parallel.sync_batchnorm`). Under emulation without a network, all gradients go in one
    bucket: the backward is one modeled segment, and a bucket fired early would either wait for
    the whole segment (then do the rest of the backward unpadded) or communicate inside it.

    With network emulation (``emulator.network``) and ``devices`` (the group's devices, in rank
    order), buckets keep DDP's sizes (``bucket_cap_mb``, default DDP's) and each all-reduce
    overlaps the rest of the backward in modeled time: bucket ``k`` is ready at its share of the
    backward (:func:`_emulate_overlap`), ends ``max(latest member's ready, bucket k-1's end) + ring
    cost`` (:class:`runtime.emulation.network.NetworkEmulator`); call
    ``emulator.wait_communication()`` after the backward to pad to the last end. Early buckets
    are launched for real at once (no real waiting inside the segment); only their modeled times
    overlap. ``bucket_cap_mb`` is DDP's (ignored under emulation without a network).
    """
    emulator = emulator or Emulator.disabled()
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ValueError("wrap_ddp: the module has no trainable parameters; data parallelism has nothing to sync")
    kwargs: dict[str, Any] = dict(process_group=process_group)
    kwargs[_NO_FORWARD_BUFFER_SYNC] = False
    total_bytes = sum(p.numel() * p.element_size() for p in params)
    overlap = emulator.enabled and emulator.network is not None and devices is not None
    if emulator.enabled and not overlap:
        kwargs["bucket_cap_mb"] = total_bytes / 2**20 + 1.0
    elif bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = bucket_cap_mb
    if params[0].device.type == "cuda":
        kwargs["device_ids"] = [params[0].device]
    ddp = DistributedDataParallel(module, **kwargs)
    ddp._whalelike_hook_state = _HookState(emulator, process_group, average,
                                           devices=tuple(devices) if overlap else None, total_bytes=total_bytes)
    ddp.register_comm_hook(ddp._whalelike_hook_state, _deadline_allreduce)
    return ddp


class DataParallelExecutor:
    """Runs a single-stage ``replicate`` Plan on one rank (see the module docstring).

    ``flops_per_sample`` is ``(forward, backward)`` of the whole model, used only for emulation.
    """

    def __init__(self, module: nn.Module, plan: Plan, rank: int, group: RankGroup, loss_fn: Callable,
                 emulator: Optional[Emulator] = None, flops_per_sample: tuple[float, float] = (0.0, 0.0)):
        self.rank = rank
        self.group = group
        self.loss_fn = loss_fn
        self.emulator = emulator or Emulator.disabled()
        self.backward_flops = flops_per_sample[1]
        self.module = module
        self.sync_batchnorm = plan.sync_batchnorm and group.size > 1
        self._adopt(plan)
        if self.sync_batchnorm:
            synchronise_batchnorm(module, group.group)
        self.ddp = wrap_ddp(module, group.group, self.emulator,
                            devices=[plan.worker(r).device for r in sorted(group.ranks)])
        # the Engine's runtime.balance.straggler_monitor.Passenger: summed in this step's all-reduce
        self.passenger = None
        self._unpad = self.emulator.pad_forward(module, flops_per_sample[0])

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
        DDP is kept); every rank of the group must adopt the same plan at the same step boundary.
        Raises :class:`planner.plan.PlanError` naming what differs for any other plan."""
        _check_same_workers(self.plan, plan)
        if plan.sync_batchnorm != self.plan.sync_batchnorm:
            raise PlanError(f"set_plan: sync_batchnorm is {plan.sync_batchnorm} in the new plan, "
                            f"{self.plan.sync_batchnorm} in the running one; that needs a new executor")
        old = self.shares
        self._adopt(plan)
        log.info("rank %d: data-parallel shares %s -> %s, micro-batches %s", self.rank, old, self.shares,
                 self.micro_batch_sizes)

    def _adopt(self, plan: Plan) -> None:
        """Take the layout of ``plan`` (checked against this rank's data-parallel group)."""
        if len(plan.stages) != 1 or any(w.tp_size > 1 for w in plan.workers):
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
        return self.module.parameters()

    def train_step(self, inputs: tuple, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of this rank's share of the global batch (gradients summed over the
        group, scaled to the global-batch mean); returns the global-mean loss, equal on every rank."""
        n = targets.shape[0]
        if n != self.global_batch_size:
            raise ValueError(f"rank {self.rank}: the batch has {n} samples but the plan's shares sum to "
                             f"global_batch_size={self.global_batch_size} ({self.shares}); pass whole global "
                             f"batches (DataLoader(drop_last=True)) or a runtime.data.Share from UnevenLoader")
        lo, hi = self.layout.split(n, self.rank)
        return self.train_share(Share(*slice_batch(inputs, targets, lo, hi), global_size=n))

    def train_share(self, share: Share) -> torch.Tensor:
        """Like :meth:`train_step` on a batch that holds only this rank's samples (from
        :class:`runtime.data.UnevenLoader`); a short last batch of an epoch is split into
        micro-batches no larger than the plan's largest."""
        # under synchronised BatchNorm every rank runs as many forwards as the plan's (each syncs)
        sizes = self.layout.micro_batches(self.rank, share.targets.shape[0], keep_count=self.sync_batchnorm)
        # the reported loss in the model's dtype (a float64 model's loss is not rounded to float32)
        dtype = next((p.dtype for p in self.module.parameters() if p.is_floating_point()), torch.get_default_dtype())
        total = torch.zeros((), device=share.targets.device, dtype=dtype)
        passenger, self.passenger = self.passenger, None
        carrier, fill = total, None
        lo = 0
        for m, size in enumerate(sizes):
            inputs, targets = slice_batch(share.inputs, share.targets, lo, lo + size)
            lo += size
            last = m == len(sizes) - 1
            with nullcontext() if last else self.ddp.no_sync():
                loss = self._weighted_loss(inputs, targets, share.global_size)
                total += loss.detach()
                if last:  # the global loss rides in the gradient all-reduce: one collective per step
                    if passenger is not None:   # and so does the Engine's passenger, written at send time
                        carrier = torch.cat([total.reshape(1), total.new_zeros(passenger.vector.numel())])
                        fill = lambda c: c[1:].copy_(passenger.fill())  # noqa: E731
                    sum_with_gradients(self.ddp, carrier, fill)
                self.emulator.begin(self.backward_flops * size, size)
                loss.backward()
                self.emulator.wait_deadline()  # no-op if the comm hook already waited
                self.emulator.wait_communication()   # the overlapped all-reduce's modeled end, if any
        _flush_passenger(self.ddp)
        if passenger is not None:
            passenger.arrived(carrier[1:])
            return carrier[0].clone()
        return total

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
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.module.load_state_dict(state)

    def named_state(self) -> dict[str, tuple[torch.Tensor, Slab]]:
        """Every parameter and buffer, whole (for :func:`runtime.balance.state_transfer.switch_executor`)."""
        return module_state(self.module)

    def close(self) -> None:
        """Take this executor's hooks off the model (emulation padding, DDP's reducer), so an
        executor of another plan can wrap it; this one is not used again."""
        self._unpad()
        release_ddp(self.ddp)
        self.ddp = None   # its buckets (a copy of the gradients) go with it

    def _weighted_loss(self, inputs: tuple, targets: torch.Tensor, global_size: int) -> torch.Tensor:
        """This slice's mean loss times its fraction of the global batch. An empty slice (a rank
        with no samples in a short last batch) still runs forward and backward so DDP's all-reduce
        happens, with a zero loss."""
        outputs = self.ddp(*inputs)
        n = targets.shape[0]
        if n == 0:
            return sum(t.sum() for t in _tensors(outputs)) * 0.0
        return self.loss_fn(outputs, targets) * (n / global_size)


_WORKER_FIELDS = ("rank", "device", "host", "replica", "stage", "dp_index", "tp_index", "tp_size")


def _check_same_workers(old: Plan, new: Plan) -> None:
    """Raise :class:`PlanError` naming the first worker field that differs between the plans."""
    if new.world_size != old.world_size:
        raise PlanError(f"set_plan: the new plan has {new.world_size} workers, the running one {old.world_size}; "
                        f"a plan of other workers needs a new executor")
    for a, b in zip(old.workers, new.workers):
        for name in _WORKER_FIELDS:
            if getattr(a, name) != getattr(b, name):
                raise PlanError(f"set_plan: plan.workers[{a.rank}].{name} is {getattr(b, name)!r} in the new plan, "
                                f"{getattr(a, name)!r} in the running one; only micro_batch_sizes may change "
                                f"(a plan of other workers or groups needs a new executor)")


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []
