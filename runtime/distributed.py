"""Process-group set-up and the failure messages of a distributed step.

Under ``torchrun`` every rank finds ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` in its
environment; :func:`init` turns them into the default process group (gloo on CPU, nccl with CUDA)
with a timeout, so a rank that never arrives fails the others within that bound instead of hanging.

A failed collective says little by itself ("Connection closed by peer", "Timed out waiting 5000ms
for recv"). :class:`Progress` records in the default group's key-value store which step each rank
has begun (one small ``set`` per step), so when a collective fails the survivors can name the
ranks that never reached the step. The store lives on rank 0; if rank 0 is gone, the message says
so.
"""
from __future__ import annotations

import datetime
import logging
import os
import re
from typing import Optional

import torch
import torch.distributed as dist

from planner.plan import Plan, PlanError

log = logging.getLogger(__name__)

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class DistributedStepError(RuntimeError):
    """A collective of a training step failed or timed out; names the rank, the step and the peers
    that never reached it."""


# gloo reports timeouts and dead peers as plain RuntimeErrors ("Timed out waiting 3000ms for recv
# operation", "Connection closed by peer"); newer torch raises DistError subclasses for some.
_TRANSPORT_FAILURE = re.compile(r"gloo|nccl|timed out|connection (closed|reset|refused)|by peer|broken pipe",
                                re.IGNORECASE)


def is_communication_failure(error: BaseException) -> bool:
    """Whether ``error`` comes from a failed or timed-out collective rather than from the model."""
    return isinstance(error, dist.DistError) or bool(_TRANSPORT_FAILURE.search(str(error)))


def backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def device() -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` when CUDA exists, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def launched() -> tuple[int, int]:
    """``(rank, world_size)`` of this run: the default group's if initialised, else torchrun's."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
    if missing:
        raise RuntimeError(f"runtime.Engine must run under torchrun (environment lacks {', '.join(missing)}): "
                           "launch with `torchrun --nproc_per_node N script.py`, or initialise "
                           "torch.distributed yourself before creating the Engine")
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def check_world_size(plan: Plan, world_size: int, rank: int) -> None:
    """Raise on every rank (no communication, so no rank can hang) when the plan needs another world."""
    if plan.world_size != world_size:
        raise PlanError(
            f"rank {rank}: the plan has {plan.world_size} workers (cluster {plan.cluster!r}) but this run has "
            f"{world_size} ranks; launch `torchrun --nproc_per_node {plan.world_size} ...`, or make a plan for "
            f"{world_size} devices with `whalelike plan`"
        )


def init(timeout_s: float) -> int:
    """Initialise the default process group from the torchrun environment unless it exists; returns
    this rank. A rank that never arrives makes the others fail after ``timeout_s`` seconds."""
    if dist.is_initialized():
        return dist.get_rank()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        torch.cuda.set_device(device())
    try:
        dist.init_process_group(backend(), timeout=datetime.timedelta(seconds=timeout_s))
    except (dist.DistError, RuntimeError) as e:
        raise DistributedStepError(
            f"rank {rank}: process-group initialisation failed within timeout_s={timeout_s:g} s: not all {world} "
            f"ranks arrived at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} (a rank died before "
            f"starting, or WORLD_SIZE is wrong). Cause: {e}"
        ) from e
    log.info("rank %d of %d: %s process group initialised (timeout %g s)", rank, world, backend(), timeout_s)
    return rank


class Progress:
    """Which step each rank has begun, kept in the default group's store (see the module docstring)."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.store = dist.distributed_c10d._get_default_store()

    def begin(self, step: int) -> None:
        self.store.set(self._key(self.rank), str(step))

    def failure(self, step: int, timeout_s: float, cause: BaseException) -> DistributedStepError:
        """The error to raise when a collective of ``step`` failed on this rank."""
        return DistributedStepError(
            f"rank {self.rank}, step {step}: a collective failed or timed out (timeout_s={timeout_s:g} s); "
            f"{self._laggards(step)}. Cause: {cause}"
        )

    def _laggards(self, step: int) -> str:
        try:
            behind = {}
            for r in range(self.world_size):
                key = self._key(r)
                reached: Optional[int] = int(self.store.get(key)) if self.store.check([key]) else None
                if reached is None or reached < step:
                    behind[r] = reached
        except Exception as e:  # the store itself is gone: its host, rank 0, is the likely casualty
            return f"the progress store on rank 0 is unreachable ({type(e).__name__}), so rank 0 has likely died"
        if not behind:
            return f"every rank began step {step}, so a rank failed or died during it"
        return "; ".join(f"rank {r} never reached step {step} (last began: "
                         f"{'none' if s is None else f'step {s}'})" for r, s in behind.items())

    @staticmethod
    def _key(rank: int) -> str:
        return f"whalelike/progress/rank{rank}"
