"""One training step on one rank, as numbers: :class:`StepStats`, and the one warning they raise.

The Engine appends a record per step (``Engine.stats``); the straggler monitor's speeds, the sync
policy's windows, the run timeline and the metrics read them. ``compute_s`` is real compute inside
emulated segments, ``padded_s`` the time those segments took (``max(real, modeled)`` each),
``wait_s`` the rest of the step: communication, waiting for peers, loss and optimizer work.

Invariant: a record describes a step that completed on this rank (a skipped update is still a
step: ``skipped``), and its figures are this rank's own (nothing here is reduced).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepStats:
    """One training step on this rank (see the module docstring)."""

    step: int
    wall_s: float
    compute_s: float
    modeled_s: float
    padded_s: float
    wait_s: float
    segments: int
    overruns: int
    flops: float = 0.0              # FLOPs of the step's compute segments (what the monitor divides by time)
    matmul_s: float = 0.0           # of padded_s, the time in matmul segments (ZERO-resizing prices it)
    approximate: bool = False       # the step ran with ZERO-resizing (runtime.balance.rebalance policies semi/resize)
    #                                 or Prague's partial all-reduce (replica_sync 'partial', runtime.replicas.partial_sync)
    plan_version: int = 0           # how many re-plans were in force before this step
    skipped: bool = False           # no update: a NaN or inf loss or gradient norm (on_nonfinite="skip"), or an fp16 overflow
    overflow: bool = False          # fp16: some rank's gradients overflowed; every rank skipped and halved the scale
    grad_norm: Optional[float] = None   # the whole model's gradient norm before clipping (with clip_grad_norm)
    loss_scale: Optional[float] = None  # fp16: the scale the step's backward used
    lr: Optional[float] = None      # the first param group's learning rate the step used
    peak_memory_bytes: Optional[int] = None   # this rank's measured peak (runtime.training.memory_meter)


class OverrunWarning:
    """Warns once per Engine when an emulated segment took longer than modeled (from the second
    step on: the first pays one-time costs), naming the factor to lower ``base_gflops`` by."""

    def __init__(self):
        self.warned = False

    def check(self, stats: StepStats, rank: int, emulated: bool, worst: float) -> None:
        if stats.overruns and emulated and stats.step > 0 and not self.warned:
            self.warned = True
            log.warning("rank %d, step %d: %d of %d compute segments took longer than modeled (worst %.1fx); "
                        "the emulated speeds are distorted: lower emulation.base_gflops by at least that "
                        "factor (runtime.emulation.compute.calibrate)", rank, stats.step, stats.overruns,
                        stats.segments, worst)
