"""Training configuration that the planner and runtime share (typed, validated at construction)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .errors import SpecError

Schedule = Literal["gpipe", "1f1b", "eager-1f1b"]
Optimizer = Literal["sgd", "sgd_momentum", "adam", "adamw"]
SCHEDULES = ("gpipe", "1f1b", "eager-1f1b")
OPTIMIZERS = ("sgd", "sgd_momentum", "adam", "adamw")


@dataclass(frozen=True)
class Config:
    """What one optimizer step looks like.

    global_batch_size: samples per optimizer step, summed over every device.
    num_micro_batch:   micro-batches per step: pipeline depth for several TaskGraphs, gradient
                       accumulation for one.
    schedule:          pipeline schedule, ``"gpipe"``, ``"1f1b"`` or ``"eager-1f1b"`` (1F1B with more
                       warm-up forwards so transfers overlap compute; more activations in flight).
    optimizer:         optimizer whose state the memory model counts.
    sync_batchnorm:    BatchNorm in training mode takes its batch statistics over each stage's
                       data-parallel group instead of each worker's own samples (the default, as
                       DDP does); exact against one device when ``num_micro_batch == 1``
                       (``runtime.batchnorm``).
    """

    global_batch_size: int
    num_micro_batch: int = 1
    schedule: str = "1f1b"
    optimizer: str = "adamw"
    sync_batchnorm: bool = False

    def __post_init__(self):
        for name in ("global_batch_size", "num_micro_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise SpecError(f"Config.{name} must be a positive integer, got {value!r}")
        if self.schedule not in SCHEDULES:
            raise SpecError(f"Config.schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.optimizer not in OPTIMIZERS:
            raise SpecError(f"Config.optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if not isinstance(self.sync_batchnorm, bool):
            raise SpecError(f"Config.sync_batchnorm must be True or False, got {self.sync_batchnorm!r}")
        if self.num_micro_batch > self.global_batch_size:
            raise SpecError(
                f"Config.num_micro_batch ({self.num_micro_batch}) exceeds global_batch_size "
                f"({self.global_batch_size}): every micro-batch needs at least one sample"
            )
