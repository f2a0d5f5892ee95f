"""Data parallelism with uneven batch shares, on torch DDP.

What torch does and we reuse: DDP (parameter broadcast at construction, bucketed gradient
all-reduce overlapped with backward, ``no_sync`` for gradient accumulation). What it cannot do:
DDP averages gradients over ranks, which is the global-batch mean only when every rank holds the
same number of samples. Here rank ``i`` holds ``n_i`` of the ``B`` samples of a step, so its loss is
weighted by ``n_i / B`` and the comm hook *sums* (:func:`wrap_ddp`): the summed gradient is then
exactly the gradient of the global-batch mean loss, whatever the shares (Whale's load balancing,
Poplar's per-device micro-batch sizes).

Layout of a global batch (every rank holds all of it and slices locally): rank ``i`` in the
data-parallel group's Plan order (``replica``, then ``dp_index``) takes the contiguous samples
``[offset_i, offset_i + n_i)``; inside its share, micro-batch ``m`` is the next
``micro_batch_sizes[m]`` samples. Ranks may have different numbers of micro-batches (Poplar:
each device its own micro-batch size and last batch size); ``no_sync`` holds back every backward
but the rank's last, so each rank's single all-reduce carries its whole accumulated gradient.

The step's global loss is summed in the same all-reduce as the gradients (appended to the last
bucket, :func:`sum_with_gradients`), so a step costs one collective, as plain DDP's does.

Emulation: the forward of each micro-batch is padded by hooks on the wrapped module (DDP's own
pre-forward stays outside), the backward is a segment begun before ``loss.backward()`` whose deadline
the comm hook waits for before communicating, so modeled time never includes waiting on peers.
"""
from __future__ import annotations

import inspect
import logging
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from planner.plan import Plan
from runtime.batchnorm import check_equal_micro_batches, synchronise_batchnorm
from runtime.data import Share, proportional_split, slice_batch
from runtime.emulation import Emulator
from runtime.groups import RankGroup

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


def _deadline_allreduce(state: _HookState, bucket):  # no annotations: DDP checks them, and they are strings here
    """Wait out the backward's modeled time, then all-reduce the bucket (SUM, or AVG if asked),
    with the passenger of :func:`sum_with_gradients` appended to the last bucket."""
    state.emulator.wait_deadline()
    tensor = bucket.buffer()
    if state.average:
        tensor.div_(dist.get_world_size(state.group))
    passenger = state.passenger if bucket.is_last() else None
    if passenger is None:
        work = dist.all_reduce(tensor, group=state.group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])
    state.passenger = None
    joint = torch.cat([tensor, passenger.reshape(-1).to(tensor.dtype)])
    work = dist.all_reduce(joint, group=state.group, async_op=True)

    def unpack(fut):
        out = fut.value()[0]
        passenger.copy_(out[tensor.numel():].view_as(passenger))
        return out[: tensor.numel()]

    return work.get_future().then(unpack)


def sum_with_gradients(ddp: DistributedDataParallel, tensor: torch.Tensor) -> None:
    """Sum ``tensor`` (in place) over the group in the gradient all-reduce of ``ddp``'s next
    synchronising backward, instead of in a collective of its own. Call it right before that
    backward; if no bucket carried it (nothing to sync), it is all-reduced on its own."""
    state: _HookState = ddp._whalelike_hook_state
    state.passenger = tensor


def _flush_passenger(ddp: DistributedDataParallel) -> None:
    state: _HookState = ddp._whalelike_hook_state
    if state.passenger is not None:
        passenger, state.passenger = state.passenger, None
        dist.all_reduce(passenger, group=state.group)


def wrap_ddp(module: nn.Module, process_group: Optional[dist.ProcessGroup], emulator: Optional[Emulator] = None,
             *, average: bool = False) -> DistributedDataParallel:
    """DDP over ``process_group`` whose comm hook first waits for ``emulator``'s backward deadline.

    Gradients are summed (``average=False``): weight each rank's loss by its share of the global
    batch. ``average=True`` gives stock DDP semantics (equal shares), for peers in benchmarks.

    No buffer sync in forward (buffers are synced once, at construction): buffer broadcast is a collective inside every forward, which would
    fall inside the forward's compute segment (and a per-rank buffer such as BatchNorm statistics is
    computed from the rank's own share anyway, unless ``Plan.sync_batchnorm`` synchronises it:
    :mod:`runtime.batchnorm`). Under emulation all gradients go in one bucket: the
    backward is one modeled segment, and a bucket fired early would either wait for the whole
    segment (then do the rest of the backward unpadded) or communicate inside it.
    """
    emulator = emulator or Emulator.disabled()
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ValueError("wrap_ddp: the module has no trainable parameters; data parallelism has nothing to sync")
    kwargs: dict[str, Any] = dict(process_group=process_group)
    kwargs[_NO_FORWARD_BUFFER_SYNC] = False
    if emulator.enabled:
        kwargs["bucket_cap_mb"] = sum(p.numel() * p.element_size() for p in params) / 2**20 + 1.0
    if params[0].device.type == "cuda":
        kwargs["device_ids"] = [params[0].device]
    ddp = DistributedDataParallel(module, **kwargs)
    ddp._whalelike_hook_state = _HookState(emulator, process_group, average)
    ddp.register_comm_hook(ddp._whalelike_hook_state, _deadline_allreduce)
    return ddp


class DataParallelExecutor:
    """Runs a single-stage ``replicate`` Plan on one rank (see the module docstring).

    ``flops_per_sample`` is ``(forward, backward)`` of the whole model, used only for emulation.
    """

    def __init__(self, module: nn.Module, plan: Plan, rank: int, group: RankGroup, loss_fn: Callable,
                 emulator: Optional[Emulator] = None, flops_per_sample: tuple[float, float] = (0.0, 0.0)):
        by_rank = {w.rank: w for w in plan.workers}
        self.rank = rank
        self.group = group
        self.loss_fn = loss_fn
        self.emulator = emulator or Emulator.disabled()
        self.backward_flops = flops_per_sample[1]
        self.global_batch_size = plan.global_batch_size
        self.shares = [by_rank[r].batch_share for r in group.ranks]
        self.micro_batch_sizes = list(by_rank[rank].micro_batch_sizes)
        if sum(self.shares) != plan.global_batch_size:
            raise ValueError(f"plan: the data-parallel shares {self.shares} of ranks {list(group.ranks)} sum to "
                             f"{sum(self.shares)}, not global_batch_size={plan.global_batch_size}")
        self.module = module
        self.sync_batchnorm = plan.sync_batchnorm and group.size > 1
        if self.sync_batchnorm:
            check_equal_micro_batches([len(by_rank[r].micro_batch_sizes) for r in group.ranks], group.ranks)
            synchronise_batchnorm(module, group.group)
        self.ddp = wrap_ddp(module, group.group, self.emulator)
        self.emulator.pad_forward(module, flops_per_sample[0])

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
        lo = sum(self.shares[: self.group.index(self.rank)])
        share = Share(*slice_batch(inputs, targets, lo, lo + self.shares[self.group.index(self.rank)]),
                      global_size=n)
        return self.train_share(share)

    def train_share(self, share: Share) -> torch.Tensor:
        """Like :meth:`train_step` on a batch that holds only this rank's samples (from
        :class:`runtime.data.UnevenLoader`); a short last batch of an epoch is split into
        micro-batches no larger than the plan's largest."""
        n = share.targets.shape[0]
        if n == sum(self.micro_batch_sizes):
            sizes = self.micro_batch_sizes
        elif self.sync_batchnorm:   # every rank as many forwards as the plan's (each syncs BatchNorm)
            sizes = proportional_split(n, self.micro_batch_sizes)
        else:
            sizes = _chunks(n, max(self.micro_batch_sizes, default=n))
        # the reported loss in the model's dtype (a float64 model's loss is not rounded to float32)
        dtype = next((p.dtype for p in self.module.parameters() if p.is_floating_point()), torch.get_default_dtype())
        total = torch.zeros((), device=share.targets.device, dtype=dtype)
        lo = 0
        for m, size in enumerate(sizes):
            inputs, targets = slice_batch(share.inputs, share.targets, lo, lo + size)
            lo += size
            last = m == len(sizes) - 1
            with nullcontext() if last else self.ddp.no_sync():
                loss = self._weighted_loss(inputs, targets, share.global_size)
                total += loss.detach()
                if last:  # the global loss rides in the gradient all-reduce: one collective per step
                    sum_with_gradients(self.ddp, total)
                self.emulator.begin(self.backward_flops * size, size)
                loss.backward()
                self.emulator.wait_deadline()  # no-op if the comm hook already waited
        _flush_passenger(self.ddp)
        return total

    @torch.no_grad()
    def eval_step(self, inputs: tuple, targets: torch.Tensor) -> torch.Tensor:
        """Global-mean loss of a batch of any size (split in proportion to the plan's shares)."""
        n = targets.shape[0]
        split = self.shares if n == self.global_batch_size else proportional_split(n, self.shares)
        index = self.group.index(self.rank)
        lo = sum(split[:index])
        mine = slice_batch(inputs, targets, lo, lo + split[index])
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

    def _weighted_loss(self, inputs: tuple, targets: torch.Tensor, global_size: int) -> torch.Tensor:
        """This slice's mean loss times its fraction of the global batch. An empty slice (a rank
        with no samples in a short last batch) still runs forward and backward so DDP's all-reduce
        happens, with a zero loss."""
        outputs = self.ddp(*inputs)
        n = targets.shape[0]
        if n == 0:
            return sum(t.sum() for t in _tensors(outputs)) * 0.0
        return self.loss_fn(outputs, targets) * (n / global_size)


def _chunks(n: int, size: int) -> list[int]:
    """``n`` samples in micro-batches of at most ``size`` (at least one, possibly empty)."""
    if n == 0:
        return [0]
    count = -(-n // size)
    return proportional_split(n, [1] * count)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []
