"""whalelike's runtime: executes a Plan under torchrun.

``Engine`` is the entry point (see :mod:`runtime.engine`), ``BalanceConfig`` its dynamic balancing
(:mod:`runtime.balance.rebalance`); ``UnevenLoader``/``UnevenSampler`` give
each rank its uneven share of a dataset; ``calibrate`` sizes the emulated devices' base rate;
:mod:`runtime.checkpoint` saves and resumes an Engine (onto any plan); ``NonFiniteLossError`` and
``BatchMismatchError`` are the step guards' errors (:mod:`runtime.guards`); ``lr_schedule`` builds
the usual warm-up + decay for ``Engine(scheduler=...)`` (:mod:`runtime.training`, the training
recipe: precision, clipping, schedules, activation checkpointing, measured memory).

The Engine is a step loop over three seams: what a rank is (:mod:`runtime.rank`), what it holds
(``state/``: the executor slot, state moves, checkpoints' background saves) and what reacts at a step
boundary (``control/``: controllers returning plan changes as values); its options are one typed
record (:mod:`runtime.config`). Floors: ``parallel/`` (the executor protocol, the executors, the
stage worker, boundaries), ``replicas/`` (the replica-sync seam: DDP, ZeRO on FSDP2),
``tensor/`` (tensor parallelism), ``balance/`` (dynamic balancing), ``elastic/`` (devices leaving and
joining), ``emulation/`` (unequal hardware on a CPU machine), ``training/`` (the recipe around a step). Invariant: every rank derives the same groups, layouts and decisions from the
same Plan without communicating, and checks that can fail run before the rendezvous.
"""
from runtime.data import Share, UnevenLoader, UnevenSampler
from runtime.distributed import DistributedStepError
from runtime.emulation.compute import Calibration, EmulatedOutOfMemoryError, Emulator, calibrate
from runtime.config import EngineConfig
from runtime.control.protocol import Controller, PlanChange, StepView
from runtime.engine import Engine
from runtime.parallel.builders import register_executor
from runtime.parallel.executor import ExecutorContext, StepExecutor
from runtime.step_stats import StepStats
from runtime.guards import BatchMismatchError, NonFiniteLossError
from runtime.balance.rebalance import BalanceConfig, ReplanEvent
from runtime.training.schedules import lr_schedule

__all__ = [
    "Engine", "EngineConfig", "ExecutorContext", "StepExecutor", "StepStats", "register_executor", "BalanceConfig",
    "ReplanEvent", "Controller", "PlanChange", "StepView",
    "Share", "UnevenLoader", "UnevenSampler", "DistributedStepError", "NonFiniteLossError", "BatchMismatchError",
    "checkpoint", "lr_schedule",
    "Calibration", "EmulatedOutOfMemoryError", "Emulator", "calibrate",
]


def __getattr__(name: str):
    """``runtime.checkpoint`` on first use (``from runtime import checkpoint`` as well): it imports
    torch.distributed.checkpoint, and with it torch.distributed.tensor, a second of CPU that a
    process which never checkpoints need not pay."""
    if name == "checkpoint":
        import importlib
        return importlib.import_module("runtime.checkpoint")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
