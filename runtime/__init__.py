"""whalelike's runtime: executes a Plan under torchrun.

``Engine`` is the entry point (see :mod:`runtime.engine`), ``BalanceConfig`` its dynamic balancing
(:mod:`runtime.rebalance`); ``UnevenLoader``/``UnevenSampler`` give
each rank its uneven share of a dataset; ``calibrate`` sizes the emulated devices' base rate.
"""
from runtime.data import Share, UnevenLoader, UnevenSampler
from runtime.distributed import DistributedStepError
from runtime.emulation import Calibration, Emulator, calibrate
from runtime.engine import Engine, ExecutorContext, StepExecutor, StepStats, register_executor
from runtime.rebalance import BalanceConfig, ReplanEvent

__all__ = [
    "Engine", "ExecutorContext", "StepExecutor", "StepStats", "register_executor", "BalanceConfig", "ReplanEvent",
    "Share", "UnevenLoader", "UnevenSampler", "DistributedStepError",
    "Calibration", "Emulator", "calibrate",
]
