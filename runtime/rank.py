"""What one rank *is* while it trains: :class:`RankRuntime`, one value.

A rank is its place in the plan in force (rank, plan, worker), the cluster spec it runs on, the
process groups that plan implies, its emulated device, its progress record, the device and dtype
policy it computes with, and the one way it enters a collective: :meth:`RankRuntime.collective`,
which records the entry and turns a failed collective into an error naming the rank, the step and
the missing peers (:class:`runtime.distributed.Progress`).

Why one value: what surrounds a step (the executor slot, checkpoints, controllers, the leave)
needs these facts together, and a leave replaces all of them at once (a new default group, new
ranks, new groups, a new progress record): holding them apart, in the Engine's attributes, is what
let modules reach into the Engine and update half of them. Whoever needs the rank takes this value;
nobody keeps a reference to a piece of it across a step boundary.

Invariant: a re-plan of the same workers (:meth:`RankRuntime.with_plan`) changes the plan and the
worker only; every group stays valid (:func:`planner.plan_checks.check_same_workers`). A leave
makes a new value (:meth:`RankRuntime.rewired`) in the new world. The step counter
(:class:`StepClock`) is shared by every value of one Engine, so a failure is named with the step
the Engine is in.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from planner.plan import Plan, Worker
from planner.plan_checks import check_same_workers
from runtime import distributed
from runtime.emulation.compute import Emulator
from runtime.groups import PlanGroups, build_groups
from whalelike.cluster import Cluster

log = logging.getLogger(__name__)


class StepClock:
    """The step an Engine is in (0-based), shared by every :class:`RankRuntime` it makes."""

    def __init__(self, step: int = 0):
        self.step = step


@dataclass(frozen=True)
class RankRuntime:
    """This rank under the plan in force (see the module docstring).

    ``precision``: the name of what runs (fp32, bf16, fp16): the emulated device computes at its
    rate for it. ``timeout_s`` bounds every collective of its groups.
    """

    rank: int
    plan: Plan
    cluster: Cluster
    groups: PlanGroups
    emulator: Emulator
    progress: distributed.Progress
    device: torch.device
    timeout_s: float
    precision: str
    clock: StepClock

    @classmethod
    def start(cls, plan: Plan, cluster: Cluster, timeout_s: float, precision: str,
              clock: StepClock | None = None) -> "RankRuntime":
        """Join the job (the rendezvous: :func:`runtime.distributed.init`), then build this rank's
        groups, emulated device and progress record for ``plan``. Collective."""
        rank = distributed.init(timeout_s)
        return cls._make(plan, cluster, rank, timeout_s, precision, clock or StepClock(), distributed.device())

    @classmethod
    def _make(cls, plan: Plan, cluster: Cluster, rank: int, timeout_s: float, precision: str, clock: StepClock,
              device: torch.device) -> "RankRuntime":
        emulator = Emulator.for_device(cluster, plan.worker(rank).device, rank, precision=precision)
        groups = build_groups(plan, rank, timeout_s)
        progress = distributed.Progress(rank, plan.world_size, timeout_s, emulator.busy_for)
        return cls(rank=rank, plan=plan, cluster=cluster, groups=groups, emulator=emulator, progress=progress,
                   device=device, timeout_s=timeout_s, precision=precision, clock=clock)

    # -- facts derived from the plan ----------------------------------------------------------------
    @property
    def worker(self) -> Worker:
        return self.plan.worker(self.rank)

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    @property
    def step(self) -> int:
        return self.clock.step

    # -- new values ---------------------------------------------------------------------------------
    def with_plan(self, plan: Plan) -> "RankRuntime":
        """This rank under ``plan``, a plan of the same workers (its groups stay valid)."""
        check_same_workers(self.plan, plan, "RankRuntime.with_plan")
        return dataclasses.replace(self, plan=plan)

    def rewired(self, plan: Plan, cluster: Cluster, rank: int) -> "RankRuntime":
        """This process as ``rank`` of ``plan`` on ``cluster`` after a leave re-made the default
        group: new groups, emulated device and progress record; the same clock. Collective."""
        return self._make(plan, cluster, rank, self.timeout_s, self.precision, self.clock, self.device)

    # -- collectives --------------------------------------------------------------------------------
    def collective(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` after recording that this rank entered one more collective of the current step
        (:meth:`runtime.distributed.Progress.enter`); a failed collective becomes a
        :class:`runtime.distributed.DistributedStepError` naming the rank, the step and its peers."""
        step = self.clock.step
        try:
            self.progress.enter(step)
            return fn()
        except RuntimeError as e:
            if distributed.is_communication_failure(e):
                raise self.progress.failure(step, self.timeout_s, e) from e
            raise

    def measured_once(self) -> distributed.MeasuredOnce:
        """The :data:`whalelike.graphs.capture.MeasureShare` of an Engine's capture: the ranks capture
        the same model at once and rank 0 measures it for all (:class:`runtime.distributed.MeasuredOnce`),
        in a collective of :meth:`collective`."""
        return distributed.MeasuredOnce(self.rank, self.collective)

    def sum_alone(self, vector: torch.Tensor) -> None:
        """All-reduce (sum) ``vector`` in place over the default group, on the device the backend
        needs (nccl: the current GPU), as a collective of its own; nothing to do on one rank."""
        if dist.get_world_size() == 1:
            return

        def run():
            if dist.get_backend() == "nccl":
                moved = vector.to(torch.device("cuda", torch.cuda.current_device()))
                dist.all_reduce(moved)
                vector.copy_(moved.cpu())
            else:
                dist.all_reduce(vector)
        self.collective(run)
