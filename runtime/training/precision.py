"""Mixed precision for a plan: torch's autocast for the compute, float32 master state, and for fp16
a dynamic loss scaler whose overflow decision is one decision for every rank of the plan.

What each precision runs (``Config.precision``, ``Plan.precision``, ``Engine(precision=...)``):

======  ==============================================================================================
fp32    float32 everywhere (no autocast): bit-identical to what the Engine ran before precisions
bf16    ``torch.autocast(device, bfloat16)`` over the step's forwards (and its backward: autocast is
        idempotent there, the saved tensors fix the backward's dtypes); parameters, gradients and the
        optimizer state stay float32 (the master copy), so gradients are reduced in float32 (or, when
        asked, ``grad_reduce="bf16"``: half the bytes, through the replica sync's comm hook)
fp16    as bf16 with float16, and a loss scale: the gradient flowing back from the loss is multiplied
        by the scale, the optimizer step sees the unscaled gradients, and a step whose gradients
        overflowed is skipped on every rank while the scale halves on every rank (it grows back after
        ``growth_interval`` clean steps); the scale is in checkpoints
======  ==============================================================================================

Why torch's pieces and what they lack. ``torch.autocast`` chooses per operator which dtype runs
(matmuls in low precision, softmax, norms and losses in float32), the same choice a single-process
run makes, so a plan's ranks compute what the reference computes. ``torch.amp.GradScaler`` grows
and backs off the scale, but it decides about one process's gradients: on a plan each rank holds a
different part of the model (stages, tensor-parallel shards), an overflow happens on one rank's
part, and a rank-local scaler would skip the step there and step everywhere else, leaving stages
and replicas out of step for good. :class:`PlanLossScaler` is a GradScaler whose overflow flags
are summed over every rank of the plan in one all-reduce before any rank decides (FSDP's
``ShardedGradScaler`` does the same over its group, but sends one all-reduce per device entry and
none from a rank without gradients, which would hang a plan that has a parameter-free stage).

Where the scale enters: the executors weight each micro-batch's loss by its share of the global
batch (:mod:`runtime.parallel`); :meth:`Precision.weighted_loss` does that weighting and, for fp16,
multiplies the gradient flowing back from the loss by the scale with an identity in the forward,
so the reported loss, the guards and the sharded cross-entropy all see the true loss value.

Invariant: the low-precision dtype only ever lives in activations and their gradients; every
parameter, gradient and optimizer-state tensor the Engine holds is float32 (the model's dtype), so
checkpoints, re-plans and the gradient reduction are the fp32 machinery unchanged.
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from whalelike.config import PRECISIONS
from whalelike.errors import WhaleError

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
GRAD_REDUCE = ("fp32", "bf16")
# torch.amp.GradScaler's defaults, named: the first scale, and how it moves
INIT_SCALE = 2.0 ** 16
GROWTH_INTERVAL = 2000


class PrecisionError(WhaleError):
    """A precision that cannot run here; the message names it and the fix."""


@dataclass(frozen=True)
class Precision:
    """One plan's training precision (see the module docstring). ``name``: fp32, bf16 or fp16.
    ``grad_reduce``: the dtype the replicas' gradient sum travels in, ``"fp32"`` (the gradients'
    own: exact) or ``"bf16"`` (half the bytes; each rank's part is rounded to 8 significant bits
    before the sum, as torch's ``bf16_compress_hook`` does)."""

    name: str = "fp32"
    grad_reduce: str = "fp32"

    def __post_init__(self):
        if self.name not in PRECISIONS:
            raise PrecisionError(f"precision {self.name!r} is not one of {', '.join(PRECISIONS)}; fp32 trains in "
                                 "float32, bf16/fp16 autocast with float32 master weights")
        if self.grad_reduce not in GRAD_REDUCE:
            raise PrecisionError(f"grad_reduce_dtype {self.grad_reduce!r} is not one of {', '.join(GRAD_REDUCE)}; "
                                 "fp32 reduces gradients exactly, bf16 in half the bytes")

    @property
    def reduce_dtype(self) -> Optional[torch.dtype]:
        """The dtype gradients are reduced in, None for their own (float32)."""
        return torch.bfloat16 if self.grad_reduce == "bf16" else None

    @property
    def dtype(self) -> Optional[torch.dtype]:
        """The autocast dtype, None for fp32."""
        return DTYPES[self.name]

    @property
    def scales_loss(self) -> bool:
        return self.name == "fp16"

    def autocast(self, device: torch.device):
        """The context a step's compute runs in on ``device`` (nothing for fp32)."""
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(device.type, dtype=self.dtype)

    def check_device(self, device: torch.device) -> None:
        """Refuse a precision this torch build cannot autocast on ``device`` (a GPU without bf16)."""
        if self.name == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise PrecisionError(f"precision bf16 on {torch.cuda.get_device_name(device)}: this GPU has no bfloat16 "
                                 "support; train with precision fp16 (a loss scaler keeps its gradients in range)")


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; the backward multiplies the incoming gradient by the loss scale."""

    @staticmethod
    def forward(ctx, loss, scaler):
        ctx.scaler = scaler
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad):
        return ctx.scaler.scale(grad), None


def weighted_loss(loss: torch.Tensor, samples: int, global_size: int,
                  scaler: "Optional[PlanLossScaler]" = None) -> torch.Tensor:
    """``loss`` (a mean over ``samples``) weighted by its share of a global batch of ``global_size``
    samples, with its backward scaled by ``scaler`` when one is given (fp16). The value is the
    weighted loss either way: only the gradient carries the scale."""
    # the whole batch (one rank, one micro-batch): its weight is 1, and no operator is needed for it
    weighted = loss if samples == global_size else loss * (samples / global_size)
    return _ScaleGradient.apply(weighted, scaler) if scaler is not None else weighted


class PlanLossScaler(torch.amp.GradScaler):
    """A dynamic loss scaler whose overflow decision is one for every rank of ``group`` (default:
    the world; see the module docstring). Use it as torch's GradScaler: ``unscale_(optimizer)``
    (a collective: it sums the ranks' overflow flags), then ``step(optimizer)`` and ``update()``;
    :attr:`overflowed` says whether the last unscale found an inf or NaN on any rank."""

    def __init__(self, device: torch.device, group: Optional[dist.ProcessGroup] = None,
                 init_scale: float = INIT_SCALE, growth_interval: int = GROWTH_INTERVAL):
        if not (isinstance(init_scale, (int, float)) and math.isfinite(init_scale) and init_scale > 0):
            raise PrecisionError(f"PlanLossScaler init_scale must be a positive finite number, got {init_scale!r}")
        super().__init__(device.type, init_scale=float(init_scale), growth_interval=growth_interval)
        self.group = group
        self._found: Optional[torch.Tensor] = None
        self.scale(torch.ones((), device=device))   # creates the scale on the device (GradScaler does it lazily)

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        total = torch.zeros_like(found_inf)
        for flag in per_device.values():
            total += flag.to(total.device)
        # exactly one all-reduce per rank and step, also from a rank without gradients
        dist.all_reduce(total, group=self.group)
        self._found = total
        return {total.device: total}

    @property
    def overflowed(self) -> bool:
        """Whether the last :meth:`unscale_` found an inf or NaN gradient on any rank."""
        return self._found is not None and bool(self._found.item() > 0)

    def current(self) -> float:
        """The scale in force (a float; reading it synchronises with the device)."""
        return float(self.get_scale())
