"""Synchronised BatchNorm over a stage's data-parallel group, uneven shares included.

Why: under ``replicate`` each worker normalises with the statistics of its own samples (what DDP
does), so training differs from one device normalising the whole batch. ``Plan.sync_batchnorm``
(``wl.Config(sync_batchnorm=True)``) takes the statistics over the stage's data-parallel group
(every worker of the stage in every replica, the same ``tp_index``), which covers each sample of a
micro-batch exactly once: with one micro-batch per step the result is the single-device one,
running statistics included.

Why not only ``torch.nn.SyncBatchNorm``: its forward refuses CPU tensors, and a BatchNorm that
``torch.export`` left inlined (``aten.batch_norm``) has no module to convert. So:

* ``nn.BatchNorm*`` modules (the user's model, or ``call_module`` leaves of a stage: torch.fx keeps
  them, and capture restores them in export graphs, :mod:`whalelike.graphs.leaves`) become
  ``torch.nn.SyncBatchNorm`` on CUDA with nccl and :class:`GroupBatchNorm` elsewhere;
* ``aten.batch_norm`` nodes still inlined (a BatchNorm module called twice) become a
  ``call_module`` of :class:`BatchNormOp`;

both share the original parameters and buffers (state-dict keys and values are unchanged).
:func:`sync_batch_norm` (an autograd Function) does the work of the last two: each rank gathers
every rank's ``(count, mean, M2)`` per channel and combines them exactly (Chan et al.'s parallel
variance; ranks may hold different sample counts, even none), normalises with the global
statistics, and updates the running statistics as single-device BatchNorm does (unbiased
variance, ``momentum``). Backward all-reduces ``sum(dy)`` and ``sum(dy * x_hat)`` and returns the
exact input gradient; the weight and bias gradients stay local sums, which DDP then sums over the
same group.

Invariant: every rank of the group runs the same BatchNorm calls in the same order (the same
number of micro-batches: :func:`check_equal_micro_batches`). With several micro-batches the
statistics are per micro-batch, as on one device accumulating gradients.
"""
from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake
from torch.nn.modules.batchnorm import _BatchNorm

from whalelike.graphs.batchnorm_layers import is_training_batchnorm
from whalelike.errors import WhaleError

log = logging.getLogger(__name__)

_ATEN_BATCH_NORM = torch.ops.aten.batch_norm.default


class _SyncBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum: float, eps: float, group):
        channels = x.shape[1]
        dims = [0, *range(2, x.dim())]
        shape = [1, channels] + [1] * (x.dim() - 2)
        count = x.numel() // channels if channels else 0
        if count:
            local_mean = x.mean(dims)
            local_m2 = ((x - local_mean.view(shape)) ** 2).sum(dims)
        else:
            local_mean = local_m2 = x.new_zeros(channels)
        mine = torch.cat([x.new_tensor([count]), local_mean, local_m2])
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, mine, group=group)
        stats = torch.stack(gathered)
        counts, means, m2s = stats[:, :1], stats[:, 1:channels + 1], stats[:, channels + 1:]
        total = counts.sum()
        if total <= 1:
            raise ValueError(f"synchronised BatchNorm: expected more than 1 value per channel when training, "
                             f"got {int(total)} over the data-parallel group (input shape {tuple(x.shape)} here)")
        mean = (counts * means).sum(0) / total
        var = (m2s.sum(0) + (counts * (means - mean) ** 2).sum(0)) / total
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            unbiased = var * (total / (total - 1))
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        x_hat = (x - mean.view(shape)) * invstd.view(shape)
        y = x_hat
        if weight is not None:
            y = y * weight.view(shape)
        if bias is not None:
            y = y + bias.view(shape)
        ctx.save_for_backward(x_hat, weight, invstd)
        ctx.group, ctx.total, ctx.shape, ctx.dims = group, total, shape, dims
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x_hat, weight, invstd = ctx.saved_tensors
        shape, dims = ctx.shape, ctx.dims
        sum_dy = dy.sum(dims)
        sum_dy_xhat = (dy * x_hat).sum(dims)
        both = torch.cat([sum_dy, sum_dy_xhat])
        dist.all_reduce(both, group=ctx.group)
        global_dy, global_dy_xhat = both.split(sum_dy.numel())
        scale = invstd if weight is None else invstd * weight
        dx = scale.view(shape) * (dy - global_dy.view(shape) / ctx.total - x_hat * global_dy_xhat.view(shape) / ctx.total)
        dweight = sum_dy_xhat if weight is not None else None
        dbias = sum_dy if ctx.has_bias else None
        return dx, dweight, dbias, None, None, None, None, None


def sync_batch_norm(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                    running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor],
                    momentum: float, eps: float, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Training-mode ``F.batch_norm`` with the batch statistics of every rank of ``group``.

    On fake or meta tensors (shape inference, cost measurement) it is plain ``F.batch_norm``: no
    data to synchronise, and no collective may run."""
    if is_fake(x) or x.is_meta:
        return F.batch_norm(x, running_mean, running_var, weight, bias, True, momentum, eps)
    return _SyncBatchNorm.apply(x, weight, bias, running_mean, running_var, momentum, eps, group)


class GroupBatchNorm(_BatchNorm):
    """``nn.BatchNorm*`` whose training-mode statistics span ``process_group`` (any backend, any
    device); in eval mode, or with one rank, plain BatchNorm."""

    def __init__(self, bn: _BatchNorm, process_group: Optional[dist.ProcessGroup]):
        super().__init__(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats,
                         device="meta")
        self.weight, self.bias = bn.weight, bn.bias
        self.running_mean, self.running_var = bn.running_mean, bn.running_var
        self.num_batches_tracked = bn.num_batches_tracked
        self.training = bn.training
        self.process_group = process_group

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        use_batch = self.training or (self.running_mean is None and self.running_var is None)
        tracked = not self.training or self.track_running_stats
        running_mean = self.running_mean if tracked else None
        running_var = self.running_var if tracked else None
        if not (use_batch and self.training) or dist.get_world_size(self.process_group) == 1:
            return F.batch_norm(x, running_mean, running_var, self.weight, self.bias, use_batch, factor, self.eps)
        return sync_batch_norm(x, self.weight, self.bias, running_mean, running_var, factor, self.eps,
                               self.process_group)


class BatchNormOp(nn.Module):
    """``aten.batch_norm``'s signature as a module, synchronised over ``process_group`` in training.

    An exported graph holds the mode it was captured in as the ``training`` argument; this module
    also honours its own mode, so ``stage.eval()`` normalises with the running statistics."""

    def __init__(self, process_group: Optional[dist.ProcessGroup]):
        super().__init__()
        self.process_group = process_group

    def forward(self, x, weight, bias, running_mean, running_var, training: bool, momentum: float, eps: float,
                cudnn_enabled: bool = True):
        if not (training and self.training):
            return F.batch_norm(x, running_mean, running_var, weight, bias, False, momentum, eps)
        return sync_batch_norm(x, weight, bias, running_mean, running_var, momentum, eps, self.process_group)


def _module_version(bn: _BatchNorm, group: Optional[dist.ProcessGroup]) -> nn.Module:
    on_cuda = bn.running_mean is not None and bn.running_mean.is_cuda
    if on_cuda and dist.get_backend(group) == "nccl":
        return nn.SyncBatchNorm.convert_sync_batchnorm(bn, group)
    return GroupBatchNorm(bn, group)


def synchronise_batchnorm(module: nn.Module, group: Optional[dist.ProcessGroup]) -> list[str]:
    """Make every BatchNorm of ``module`` take its statistics over ``group``, in place (see the
    module docstring): its ``nn.BatchNorm*`` submodules and, if it is an ``fx.GraphModule``, its
    inlined ``aten.batch_norm`` nodes. Returns what was swapped (module paths and node names)."""
    swapped = []
    for path, child in list(module.named_modules()):
        if isinstance(child, _BatchNorm) and not isinstance(child, (GroupBatchNorm, nn.SyncBatchNorm)) and path:
            parent, _, name = path.rpartition(".")
            setattr(module.get_submodule(parent), name, _module_version(child, group))
            swapped.append(path)
    if isinstance(module, fx.GraphModule):
        for node in [n for n in module.graph.nodes if n.op == "call_function" and n.target is _ATEN_BATCH_NORM]:
            name = f"_wl_sync_{node.name}"
            module.add_submodule(name, BatchNormOp(group))
            with module.graph.inserting_before(node):
                replacement = module.graph.call_module(name, node.args, node.kwargs)
            replacement.meta = dict(node.meta)
            node.replace_all_uses_with(replacement)
            module.graph.erase_node(node)
            swapped.append(node.name)
        unsupported = [n.name for n in module.graph.nodes
                       if n.op == "call_function" and is_training_batchnorm(module, n)]
        if unsupported:
            raise WhaleError(f"sync_batchnorm: nodes {unsupported} compute training-mode BatchNorm with an operator "
                             f"that cannot be synchronised (only aten.batch_norm and nn.BatchNorm modules); capture "
                             f"the model with torch.fx, or plan with sync_batchnorm=False")
        module.recompile()
    if swapped:
        log.info("BatchNorm synchronised over the data-parallel group: %s", ", ".join(swapped))
    return swapped


def check_equal_micro_batches(counts: Sequence[int], ranks: Sequence[int]) -> None:
    """Synchronised BatchNorm makes every forward a collective: the group's ranks must run as many."""
    if len(set(counts)) > 1:
        raise WhaleError(
            f"sync_batchnorm: the data-parallel ranks {list(ranks)} run {list(counts)} micro-batches per step, but "
            f"synchronised BatchNorm needs every rank of the group to run the same number (each forward is a "
            f"collective); plan with num_micro_batch=1 or a batch that divides evenly, or sync_batchnorm=False")
