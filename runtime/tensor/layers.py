"""Uneven tensor-parallel building blocks: Megatron region ops, parallel Linears, sharded cross-entropy.

Why our own: DTensor shards a dimension only the way ``torch.chunk`` does (equal pieces, the last
one shorter), but on unequal devices the planner gives each tensor-parallel rank a shard
*proportional to its speed* (``StagePlan.shard_sizes``, e.g. ``[24, 8]`` of a hidden size of 32).
Everything here takes an explicit list of per-rank sizes. Collectives that need equal sizes
(``all_gather`` on gloo and nccl) get padded to the largest shard and trimmed again.

The pieces (Megatron-LM, Shoeybi et al. 2019; Whale's class-sharded classifier):

* region ops, autograd-aware: :func:`copy_to_region` (identity forward, all-reduce backward),
  :func:`reduce_from_region` (all-reduce forward, identity backward), :func:`gather_from_region`
  (uneven all-gather of the last dimension forward, own slice backward);
* :class:`ColumnParallelLinear` (output features sharded) and :class:`RowParallelLinear` (input
  features sharded), built from an existing ``nn.Linear`` or GPT-2 ``Conv1D`` by copying this
  rank's slice, so a column-row pair costs one all-reduce in forward and one in backward and is
  exact against the unsharded pair; a fused column projection (GPT-2's ``c_attn``) holds the
  rank's slice of each of its parts (q, k, v heads);
* :func:`sharded_cross_entropy`: softmax cross-entropy over class-sharded logits that never
  materialises the full logits on any rank (two small all-reduces over the batch, no gradient
  communication).

Heterogeneity emulation (docs/ARCHITECTURE.md section 4): every local matmul, forward and backward, is one
compute segment on the rank's :class:`~runtime.emulation.compute.Emulator` with the FLOPs of the *local*
shard, so a rank holding a bigger shard takes longer on the emulated device. Segments never span a
collective: the collectives live in separate autograd nodes. Consequently a stage holding
tensor-parallel layers must not also be wrapped in one stage-wide segment (it would span the
collectives, and segments do not nest); :class:`PaddedLinear` pads its other Linears the same way.
On an emulated network the region ops' collectives are padded to their ring time over the
group's devices (:func:`runtime.emulation.network.pad_collective`, once the group is priced).
"""
from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Mapping, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from runtime.emulation.compute import Emulator
from runtime.emulation.network import launch_collective, pad_collective
from whalelike.errors import WhaleError
from whalelike.sharding.analysis import projection_dims

log = logging.getLogger(__name__)

ProcessGroup = Optional[dist.ProcessGroup]


# -- uneven collectives ----------------------------------------------------------------------------
def shard_range(shard_sizes: Sequence[int], index: int) -> slice:
    """The slice of the full dimension that shard ``index`` holds."""
    start = sum(shard_sizes[:index])
    return slice(start, start + shard_sizes[index])


def all_gather_uneven(tensor: torch.Tensor, shard_sizes: Sequence[int], dim: int, group: ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim`` where rank ``i`` holds ``shard_sizes[i]`` entries.

    gloo and nccl gather equal sizes only: pad each shard to the largest, gather, trim, concatenate.
    """
    dim = dim % tensor.dim()
    width = max(shard_sizes)
    pad_shape = list(tensor.shape)
    pad_shape[dim] = width - tensor.shape[dim]
    padded = torch.cat([tensor, tensor.new_zeros(pad_shape)], dim).contiguous()
    pieces = [torch.empty_like(padded) for _ in shard_sizes]
    dist.all_gather(pieces, padded, group=group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(pieces, shard_sizes)], dim)


def _all_reduce(tensor: torch.Tensor, group: ProcessGroup, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """A step's all-reduce on ``group``, padded to its ring time on an emulated network."""
    out = tensor.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=op, group=group)
    pad_collective(group, "allreduce", out.numel() * out.element_size())
    return out


# -- Megatron region ops ---------------------------------------------------------------------------
class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # the collectives of _ColumnParallelMatmul's backward, in its order: a group may mix the two
        # paths (ZERO-resizing is per rank)
        out = grad.clone(memory_format=torch.contiguous_format)
        _start_input_grad_all_reduce(out, ctx.group)()
        return out, None


def _start_input_grad_all_reduce(grad_x: torch.Tensor, group: ProcessGroup):
    """Launch the in-place sum of an input gradient over ``group`` (and, on an emulated network,
    the stamp of its launch time); returns the function that waits for both."""
    work = dist.all_reduce(grad_x, group=group, async_op=True)
    pending = launch_collective(group, "allreduce", grad_x.numel() * grad_x.element_size(), grad_x.device)

    def wait() -> None:
        work.wait()
        if pending is not None:
            pending.wait()

    return wait


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shard_sizes, index, group):
        ctx.own = shard_range(shard_sizes, index)
        out = all_gather_uneven(x, shard_sizes, -1, group)
        pad_collective(group, "allgather", out.numel() * out.element_size())
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad[..., ctx.own].contiguous(), None, None, None


def copy_to_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Enter a tensor-parallel region with a replicated input: identity forward, gradients summed backward."""
    return _CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Leave a region by summing partial results: all-reduce forward, identity backward."""
    return _ReduceFromRegion.apply(x, group)


def gather_from_region(x: torch.Tensor, shard_sizes: Sequence[int], index: int, group: ProcessGroup) -> torch.Tensor:
    """Leave a region by concatenating uneven last-dimension shards; backward keeps this rank's slice."""
    return _GatherFromRegion.apply(x, list(shard_sizes), index, group)


# -- the local matmul, padded to its modeled time ------------------------------------------------
def _samples(x: torch.Tensor) -> int:
    return x.shape[0] if x.dim() > 1 else 1


class _EmulatedLinear(torch.autograd.Function):
    """``F.linear`` whose forward and backward are each one emulator compute segment.

    Backward FLOPs count only the gradients autograd asks for (no input gradient for a first layer).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, emulator: Emulator):
        rows = x.numel() // x.shape[-1]
        ctx.unit_flops = 2.0 * rows * weight.shape[0] * weight.shape[1]
        ctx.samples = _samples(x)
        ctx.emulator = emulator
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)
        with emulator.segment(ctx.unit_flops, ctx.samples, kind="matmul"):
            return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        flops = ctx.unit_flops * (int(need_x) + int(need_w))
        grad_x = grad_w = grad_b = None
        with ctx.emulator.segment(flops, ctx.samples, kind="matmul"):
            if need_x:
                grad_x = grad.matmul(weight)
            flat = grad.reshape(-1, grad.shape[-1])
            if need_w:
                grad_w = flat.t().matmul(x.reshape(-1, x.shape[-1]))
            if ctx.has_bias and need_b:
                grad_b = flat.sum(0)
        return grad_x, grad_w, grad_b, None


def local_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 emulator: Optional[Emulator]) -> torch.Tensor:
    """This rank's matmul; a segment forward and backward when ``emulator`` pads or times them
    (:attr:`runtime.emulation.compute.Emulator.measures`: emulation, or CUDA events on a GPU)."""
    if emulator is None or not emulator.measures:
        return F.linear(x, weight, bias)
    return _EmulatedLinear.apply(x, weight, bias, emulator)


class _ColumnParallelMatmul(torch.autograd.Function):
    """``F.linear`` of a column-parallel layer with a replicated input (``copy_to_region`` and the
    local matmul in one node), whose backward overlaps the input gradient's all-reduce with the
    weight gradient (Megatron-LM's asynchronous tensor-parallel all-reduce): dX, launch its
    all-reduce, dW and db while it runs, wait. The numbers are those of ``copy_to_region`` followed
    by :func:`local_linear`: the same dX, summed over the group by the same all-reduce. Emulated
    as a forward segment and two backward segments (dX, then dW), with the all-reduce padded to its
    ring time from the latest member's launch (:func:`runtime.emulation.network.launch_collective`).
    Members of one group may take this path or ``copy_to_region``'s (a ZERO-resized rank), so both
    issue the same collectives in the same order: the dX all-reduce, then the launch stamp.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, emulator: Optional[Emulator]):
        rows = x.numel() // x.shape[-1]
        ctx.unit_flops = 2.0 * rows * weight.shape[0] * weight.shape[1]
        ctx.samples = _samples(x)
        ctx.emulator = emulator if emulator is not None and emulator.measures else None
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        with _maybe_segment(ctx.emulator, ctx.unit_flops, ctx.samples):
            return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = grad_w = grad_b = wait = None
        if need_x:
            with _maybe_segment(ctx.emulator, ctx.unit_flops, ctx.samples):
                grad_x = grad.matmul(weight)
            wait = _start_input_grad_all_reduce(grad_x, ctx.group)
        flat = grad.reshape(-1, grad.shape[-1])
        with _maybe_segment(ctx.emulator, ctx.unit_flops if need_w else 0.0, ctx.samples):
            if need_w:
                grad_w = flat.t().matmul(x.reshape(-1, x.shape[-1]))
            if ctx.has_bias and need_b:
                grad_b = flat.sum(0)
        if wait is not None:
            wait()
        return grad_x, grad_w, grad_b, None, None


def _maybe_segment(emulator: Optional[Emulator], flops: float, samples: int):
    return emulator.segment(flops, samples, kind="matmul") if emulator is not None else nullcontext()


class PaddedLinear(nn.Linear):
    """An unsharded ``nn.Linear`` whose matmul is an emulation segment, forward and backward, for
    stages padded matmul by matmul (see the module docstring). Shares the wrapped Linear's
    parameters, so optimizers, DDP and state dicts see the same tensors under the same names."""

    def __init__(self, linear: nn.Linear, emulator: Emulator):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.emulator = emulator

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return local_linear(x, self.weight, self.bias, self.emulator)


# -- parallel Linears ------------------------------------------------------------------------------
def _check_shards(what: str, shard_sizes: Sequence[int], full: int, tp_index: int, group: ProcessGroup) -> list[int]:
    sizes = [int(s) for s in shard_sizes]
    if sum(sizes) != full or any(s < 1 for s in sizes):
        raise WhaleError(
            f"{what}: shard_sizes must be positive and sum to {full}, got {sizes}; "
            f"give every tensor-parallel rank at least one row/column of the {full}"
        )
    if not 0 <= tp_index < len(sizes):
        raise WhaleError(f"{what}: tp_index must be in [0, {len(sizes)}), got {tp_index}")
    if dist.is_initialized():
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if world != len(sizes) or rank != tp_index:
            raise WhaleError(
                f"{what}: the tensor-parallel group has {world} ranks and this is rank {rank} in it, but "
                f"shard_sizes has {len(sizes)} entries and tp_index is {tp_index}; dist.new_group orders "
                "members by global rank, so pass this rank's tensor-parallel group and make tp_index grow with the rank"
            )
    return sizes


class ParallelLinear(nn.Module):
    """What column and row parallel projections share: the shard layout, the group and the emulator.

    The projection is an ``nn.Linear`` (``weight`` is ``[out, in]``) or GPT-2's ``Conv1D``
    (``weight`` is ``[in, out]``, ``y = x @ W + b``); ``weight``/``bias`` keep the module's names
    and orientation so state-dict keys and shapes match the unsharded model. ``pieces`` > 1 (column
    only) is a fused projection whose output is ``pieces`` equal parts (GPT-2's ``c_attn``: q, k, v):
    this rank holds its slice of *each* part, ``shard_sizes[i] / pieces`` features of every one.
    """

    column: bool  # True: output features sharded; False: input features sharded

    def __init__(self, linear: nn.Module, shard_sizes: Sequence[int], tp_index: int,
                 group: ProcessGroup, emulator: Optional[Emulator], name: str, pieces: int = 1):
        super().__init__()
        dims = projection_dims(linear)
        if dims is None:
            raise WhaleError(f"{name}: expected an nn.Linear or a GPT-2 Conv1D to shard, got {type(linear).__name__}")
        self.in_features, self.out_features = dims
        self.transposed = not isinstance(linear, nn.Linear)  # Conv1D keeps its weight as [in, out]
        self.shard_dim = (1 if self.transposed else 0) if self.column else (0 if self.transposed else 1)
        self.shard_sizes = _check_shards(name, shard_sizes, linear.weight.shape[self.shard_dim], tp_index, group)
        if pieces < 1 or (pieces > 1 and (not self.column or any(n % pieces for n in self.shard_sizes)
                                          or self.out_features % pieces)):
            raise WhaleError(f"{name}: a fused projection of {pieces} parts needs column shards divisible by "
                             f"{pieces}, got shard_sizes={self.shard_sizes} of {self.out_features} features")
        self.pieces = pieces
        self.tp_index = tp_index
        self.group = group
        self.emulator = emulator
        self.name = name
        self.weight = nn.Parameter(self.shard_of("weight", linear.weight.detach()),
                                   requires_grad=linear.weight.requires_grad)
        self.bias = None if linear.bias is None else nn.Parameter(
            self.shard_of("bias", linear.bias.detach()), requires_grad=linear.bias.requires_grad)

    @property
    def own(self) -> slice:
        return shard_range(self.shard_sizes, self.tp_index)

    def sharded_dim(self, param: str) -> Optional[int]:
        """The dimension of ``param`` ("weight" or "bias") that is sharded, or None if replicated."""
        if param == "weight":
            return self.shard_dim
        return 0 if self.column else None

    def _piece_sizes(self) -> list[int]:
        return [n // self.pieces for n in self.shard_sizes]

    def shard_of(self, param: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full ``param`` (also used to load a full state dict)."""
        dim = self.sharded_dim(param)
        if dim is None:
            return full.clone()
        if self.pieces == 1:
            return full.narrow(dim, self.own.start, self.shard_sizes[self.tp_index]).clone()
        part = full.shape[dim] // self.pieces
        own = shard_range(self._piece_sizes(), self.tp_index)
        return torch.cat([full.narrow(dim, p * part + own.start, own.stop - own.start)
                          for p in range(self.pieces)], dim).clone()

    def full_tensors(self, values: Optional[Mapping[str, torch.Tensor]] = None) -> dict[str, torch.Tensor]:
        """The unsharded ``weight``/``bias``: a collective over the group (every rank must call it).
        ``values``: this rank's slices to gather instead of the parameters (a ZeRO group's gathers)."""
        out = {}
        values = values or {}
        for param, value in (("weight", self.weight), ("bias", self.bias)):
            if value is None:
                continue
            value = values.get(param, value)
            dim = self.sharded_dim(param)
            value = value.detach()
            if dim is None:
                out[param] = value.clone()
            elif self.pieces == 1:
                out[param] = all_gather_uneven(value, self.shard_sizes, dim, self.group)
            else:
                sizes = self._piece_sizes()
                out[param] = torch.cat([all_gather_uneven(part, sizes, dim, self.group)
                                        for part in value.split(sizes[self.tp_index], dim)], dim)
        return out

    # ZERO-resizing's pruned matmul, (x, weight [out, in], bias, emulator) -> y, installed by
    # runtime.balance.flextp_resizing.ZeroResizer while this rank straggles; None: the exact matmul
    zero_resizing = None

    def local(self, x: torch.Tensor, bias: bool) -> torch.Tensor:
        """This rank's matmul (an emulation segment when emulating; dual-pruned while ZERO-resized)."""
        weight = self.weight.t() if self.transposed else self.weight
        matmul = local_linear if self.zero_resizing is None else self.zero_resizing
        return matmul(x, weight, self.bias if bias else None, self.emulator)

    def extra_repr(self) -> str:
        fused = f", pieces={self.pieces}" if self.pieces > 1 else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"shard_sizes={self.shard_sizes}, tp_index={self.tp_index}{fused}")


class ColumnParallelLinear(ParallelLinear):
    """Output features sharded: ``y_i = x W_i^T + b_i`` with ``W_i`` rows ``shard_range(sizes, i)``.

    The input is replicated (its gradient is all-reduced backward). ``gather_output=True`` returns
    the full output (a lone Linear); ``False`` leaves it sharded for a following
    :class:`RowParallelLinear` or for :func:`sharded_cross_entropy` (the class-sharded classifier).
    """

    column = True

    def __init__(self, linear: nn.Module, shard_sizes: Sequence[int], tp_index: int, group: ProcessGroup = None,
                 gather_output: bool = True, emulator: Optional[Emulator] = None, name: str = "ColumnParallelLinear",
                 pieces: int = 1):
        super().__init__(linear, shard_sizes, tp_index, group, emulator, name, pieces)
        if gather_output and pieces > 1:
            raise WhaleError(f"{name}: a fused projection's output cannot be gathered as one tensor; it feeds its group")
        self.gather_output = gather_output

    # overlap the input gradient's all-reduce with the weight gradient (False: all-reduce after
    # the local backward, as copy_to_region does; the same numbers either way)
    overlap_input_grad = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.overlap_input_grad and self.zero_resizing is None:
            weight = self.weight.t() if self.transposed else self.weight
            y = _ColumnParallelMatmul.apply(x, weight, self.bias, self.group, self.emulator)
        else:
            y = self.local(copy_to_region(x, self.group), bias=True)
        return gather_from_region(y, self.shard_sizes, self.tp_index, self.group) if self.gather_output else y


class RowParallelLinear(ParallelLinear):
    """Input features sharded: ``y = sum_i x_i W_i^T + b``; the input is the sharded output of a
    :class:`ColumnParallelLinear` with the same ``shard_sizes``. One all-reduce forward; the
    replicated bias is added once, after it."""

    column = False

    def __init__(self, linear: nn.Module, shard_sizes: Sequence[int], tp_index: int, group: ProcessGroup = None,
                 emulator: Optional[Emulator] = None, name: str = "RowParallelLinear"):
        super().__init__(linear, shard_sizes, tp_index, group, emulator, name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.shard_sizes[self.tp_index]:
            raise WhaleError(
                f"{self.name}: tensor-parallel rank {self.tp_index} expects its input shard of "
                f"{self.shard_sizes[self.tp_index]} features (shard_sizes={self.shard_sizes}), got {x.shape[-1]}"
            )
        y = reduce_from_region(self.local(x, bias=False), self.group)
        return y if self.bias is None else y + self.bias


# -- sharded softmax cross-entropy -----------------------------------------------------------------
class _ShardedCrossEntropy(torch.autograd.Function):
    """Mean softmax cross-entropy over logits whose classes are spread over the group.

    Forward: all-reduce the row max, then one all-reduce of (sum of exp, target logit) where a
    target outside this rank's class range contributes 0. Backward needs no communication: the
    gradient of the local logits is ``(softmax - onehot) / count`` on the local classes.
    """

    @staticmethod
    def forward(ctx, logits, target, class_start, num_classes, ignore_index, group):
        # at least float32 (half-precision logits overflow exp), never less than the logits' own precision
        local = logits.to(torch.promote_types(logits.dtype, torch.float32)).reshape(-1, logits.shape[-1])
        target = target.reshape(-1)
        if local.shape[0] != target.shape[0]:
            raise WhaleError(f"sharded_cross_entropy: {local.shape[0]} rows of logits but {target.shape[0]} targets")
        valid = target != ignore_index
        if ((target < 0) | (target >= num_classes))[valid].any():
            raise WhaleError(
                f"sharded_cross_entropy: targets must be class indices in [0, {num_classes}) or "
                f"ignore_index={ignore_index}, got values in [{int(target.min())}, {int(target.max())}]"
            )
        row_max = _all_reduce(local.max(-1).values, group, dist.ReduceOp.MAX)
        exp = (local - row_max[:, None]).exp()
        local_target = target - class_start
        mine = valid & (local_target >= 0) & (local_target < local.shape[1])
        rows = torch.arange(local.shape[0], device=local.device)
        picked = torch.where(mine, local[rows, local_target.clamp(0, local.shape[1] - 1)] - row_max,
                             local.new_zeros(()))
        sums = _all_reduce(torch.stack([exp.sum(-1), picked]), group)
        count = valid.sum()
        losses = torch.where(valid, sums[0].log() - sums[1], local.new_zeros(()))
        ctx.save_for_backward(exp.div_(sums[0][:, None]), local_target, mine, valid, count)
        ctx.logits_shape, ctx.logits_dtype = logits.shape, logits.dtype
        # the loss stays in (at least) float32, as F.cross_entropy's is under autocast: a bf16 loss would
        # report 3 significant digits and differ from what the unsharded model computes
        return losses.sum() / count

    @staticmethod
    def backward(ctx, grad):
        softmax, local_target, mine, valid, count = ctx.saved_tensors
        rows = torch.nonzero(mine).squeeze(-1)
        softmax[rows, local_target[rows]] -= 1.0
        softmax.mul_((valid[:, None] * (grad.to(softmax.dtype) / count)))
        return softmax.to(ctx.logits_dtype).reshape(ctx.logits_shape), None, None, None, None, None


def sharded_cross_entropy(local_logits: torch.Tensor, target: torch.Tensor, shard_sizes: Sequence[int],
                          tp_index: int, group: ProcessGroup = None, ignore_index: int = -100) -> torch.Tensor:
    """``F.cross_entropy(full_logits, target)`` (mean reduction) from this rank's class shard.

    ``local_logits`` is ``[..., shard_sizes[tp_index]]`` (classes in the last dimension, as a
    Linear produces them), ``target`` is ``[...]`` with global class indices; every rank of the
    group passes the same targets and gets the same loss.
    """
    sizes = list(shard_sizes)
    if local_logits.shape[-1] != sizes[tp_index]:
        raise WhaleError(
            f"sharded_cross_entropy: rank {tp_index} holds {sizes[tp_index]} classes (shard_sizes={sizes}), "
            f"but its logits have {local_logits.shape[-1]} in the last dimension"
        )
    return _ShardedCrossEntropy.apply(local_logits, target, shard_range(sizes, tp_index).start, sum(sizes),
                                      ignore_index, group)
