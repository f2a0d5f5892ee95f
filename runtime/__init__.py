"""whalelike's runtime: executes a Plan under torchrun.

``Engine`` is the entry point (see :mod:`runtime.engine`); ``UnevenLoader``/``UnevenSampler`` give
each rank its uneven share of a dataset; ``calibrate`` sizes the emulated devices' base rate.
"""
from runtime.data import Share, UnevenLoader, UnevenSampler
from runtime.distributed import DistributedStepError
from runtime.emulation import Calibration, Emulator, calibrate
from runtime.engine import Engine, ExecutorContext, StepExecutor, StepStats, register_executor

__all__ = [
    "Engine", "ExecutorContext", "StepExecutor", "StepStats", "register_executor",
    "Share", "UnevenLoader", "UnevenSampler", "DistributedStepError",
    "Calibration", "Emulator", "calibrate",
]
