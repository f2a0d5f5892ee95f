"""The optimizer update of one step, with the recipe's decisions around it: a non-finite loss raised or
skipped, fp16's unscale and overflow skip, global-norm clipping, the learning-rate schedule.

Every decision is the same on every rank without a collective of its own beyond those named: the
loss is the global mean (equal everywhere), the fp16 overflow flag comes from one all-reduce
(:class:`runtime.training.precision.PlanLossScaler`) and the gradient norm from one
(:class:`runtime.training.clipping.GlobalGradNorm`), so every rank steps or skips alike.

Invariant: a skipped step leaves the parameters and optimizer state as they were and the
gradients dropped, on every rank; a step that happened moved the optimizer and the schedule once.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from runtime import guards

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    """What the optimizer update of one step did."""

    skipped: bool = False
    overflow: bool = False          # fp16: some rank's gradients overflowed; every rank skipped and halved the scale
    norm: Optional[float] = None    # the global gradient norm before clipping, when clipping
    lr: Optional[float] = None      # the first param group's learning rate the step used


class OptimizerUpdate:
    """The update of a step (see the module docstring). ``on_nonfinite``: ``"raise"`` or ``"skip"``;
    ``clip_grad_norm``: the largest global norm, or None; ``scaler``: fp16's loss scaler or None."""

    def __init__(self, on_nonfinite: str, clip_grad_norm: Optional[float], scaler):
        self.on_nonfinite, self.clip_grad_norm, self.scaler = on_nonfinite, clip_grad_norm, scaler
        self.skipped_steps: list[int] = []     # steps whose update on_nonfinite="skip" dropped

    def run(self, loss: torch.Tensor, slot, step: int, rank: int, collective: Callable) -> Outcome:
        """Unscale (fp16), clip, step ``slot``'s optimizer and schedule, or skip the update on every
        rank alike. ``collective(fn)`` runs a collective as the rank's runtime does."""
        optimizer = slot.optimizer
        lr = float(optimizer.param_groups[0]["lr"])
        if not guards.is_finite(loss):
            return self._skip(optimizer, guards.nonfinite_error(loss, step, rank),
                              f"the loss is {guards.loss_text(loss)}", step, rank, lr=lr)
        if self.scaler is not None:
            collective(lambda: self.scaler.unscale_(optimizer))
            if self.scaler.overflowed:
                before = self.scaler.current()
                self.scaler.step(optimizer)      # skips the step: the overflow was found
                self.scaler.update()
                optimizer.zero_grad(set_to_none=True)
                log.info("rank %d, step %d: fp16 gradients overflowed on some rank; every rank skipped the step, "
                         "loss scale %g -> %g", rank, step, before, self.scaler.current())
                return Outcome(skipped=True, overflow=True, lr=lr)
        norm = None
        if self.clip_grad_norm is not None:
            norm = float(collective(lambda: slot.clipper().clip_(self.clip_grad_norm)))
            if not math.isfinite(norm):
                return self._skip(optimizer, guards.NonFiniteLossError(
                    f"rank {rank}, step {step}: the global gradient norm is {norm:g} (the loss is finite); "
                    f"the optimizer did not step. Lower the learning rate, or pass runtime.Engine(on_nonfinite='skip') "
                    f"to drop such steps on every rank"), f"the gradient norm is {norm:g}", step, rank, norm=norm, lr=lr)
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
        if slot.scheduler is not None:
            slot.scheduler.step()
        return Outcome(norm=norm, lr=lr)

    def _skip(self, optimizer, error: Exception, why: str, step: int, rank: int, norm: Optional[float] = None,
              lr: Optional[float] = None) -> Outcome:
        if self.on_nonfinite == "raise":
            raise error
        optimizer.zero_grad(set_to_none=True)
        self.skipped_steps.append(step)
        log.warning("rank %d, step %d: %s; skipped the step on every rank (no optimizer step, gradients dropped; "
                    "on_nonfinite='skip'), %d skipped so far", rank, step, why, len(self.skipped_steps))
        return Outcome(skipped=True, norm=norm, lr=lr)
