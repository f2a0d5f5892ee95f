"""Memory measured while training, checked against the plan's prediction and fed back into it.

Why: the plan fits every worker's predicted peak into its device's memory less a reserve
(``Config.memory_reserve``), and the prediction is a model (:mod:`planner.devices.memory`): what it
misses on a given device, model or torch version (a caching allocator's blocks, a kernel's
workspace, an operator's temporaries) the reserve absorbs until it does not. The time side is
corrected from measurements already (:mod:`runtime.balance.rebalance` re-plans from the measured
speeds); this controller does the same for memory.

What it does (a step-boundary controller, :mod:`runtime.control.protocol`, name ``"memory"``,
order 15: before the re-planner):

1. :data:`CHECK_AFTER` steps after a plan starts (its first steps build what it holds: the
   optimizer's state at the first update, DDP's buckets rebuilt in the second forward), every rank
   sends its measured peak over its prediction (``StepStats.peak_memory_bytes`` over
   ``Worker.memory_gib``) in the next step's exchange (:mod:`runtime.control.exchange`: it rides
   the collective that ends that step, so no collective of its own, and none a P-Reduce group
   could be waiting in), and the ranks decide at that step's boundary. Nothing happens where a
   rank does not measure its peak (on CPU without ``Engine(measure_memory=True)``; GPUs always do).
2. Where some rank's peak is more than :data:`THRESHOLD` above its prediction, it says so in one
   line (rank 0) and re-prices: each such rank's device is de-rated by its measured ratio
   (``Device.memory_gib / ratio``: the model's figure times the ratio must fit, so the model's
   figure must fit the memory over the ratio; :func:`planner.devices.memory.derated`), and the
   plan in force is re-planned on the de-rated devices
   (:func:`planner.balance.replan.rebalance`: shares, layers and shards move within memory, every
   worker keeps its device) at the speeds last measured (the re-planner's reference; the plan's
   own rates before any), an ``apply`` change when it differs. Ranks measured below their
   prediction keep their memory: the reserve, not a prediction that was high once, is what makes
   room.
3. The de-rating stays in force: it is published (``StepView.figures["memory"]["scale"]``, by
   device name) and the re-planner de-rates the same devices whenever it re-plans for speed.

Invariant: every decision is a function of the summed ratios, the plan and the step, identical on
every rank, so every rank returns the same change; whether a step carries the check's part depends
on the count of steps under the plan and on whether peaks are measured, the same on every rank. A
run that measures no peak exchanges nothing for the check (under P-Reduce, whose steps hold no
collective of the whole group, that matters: a measured check costs one such, drained, per plan).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from planner.devices.cost_model import GIB, device_tflops
from runtime.control.exchange import Part
from runtime.control.protocol import Controller, PlanChange, StepView

log = logging.getLogger(__name__)

CHECK_AFTER = 3      # steps into a plan before its peaks are its own (state built, DDP's buckets rebuilt)
THRESHOLD = 0.05     # measured / predicted above 1 + this is a miss the plan is re-priced for


class MemoryCheck(Controller):
    """The memory check (see the module docstring). ``lines``: what it said, one line per check that
    found a miss; ``scale``: each de-rated device's factor (its memory is multiplied by it when the
    planner re-plans); ``ratios``: the last check's measured / predicted per rank (None: not run)."""

    name = "memory"
    order = 15

    def __init__(self, rank: int, check_after: int = CHECK_AFTER, threshold: float = THRESHOLD):
        if check_after < 1:
            raise ValueError(f"MemoryCheck: check_after must be >= 1 (steps into a plan), got {check_after}")
        if not threshold >= 0:
            raise ValueError(f"MemoryCheck: threshold must be >= 0 (a fraction above the prediction), got {threshold}")
        self.rank = rank
        self.check_after, self.threshold = check_after, threshold
        self.lines: list[str] = []
        self.scale: dict[str, float] = {}
        self.ratios: Optional[tuple[float, ...]] = None
        self._steps = 0          # steps run under the plan in force
        self._mine: Optional[torch.Tensor] = None     # this rank's slots of the check's vector
        self._summed: Optional[torch.Tensor] = None   # every rank's, as the exchange summed them

    def publish(self) -> dict:
        return {"scale": dict(self.scale), "ratios": self.ratios}

    def exchange(self, step: int, runtime, so_far) -> Optional[Part]:
        """The step after the check's: this rank's ratio rides the step-end exchange (every rank
        decides alike: the count of steps under the plan is the same on every rank)."""
        if runtime.world_size == 1 or self._steps != self.check_after or self._mine is None:
            return None
        mine = self._mine

        def arrived(values: torch.Tensor) -> None:
            self._summed = values.clone()

        return Part(mine.numel(), lambda: mine, arrived)

    def react(self, view: StepView) -> Optional[PlanChange]:
        self._steps += 1
        runtime, plan = view.runtime, view.plan
        if self._steps == self.check_after:
            peak = view.stats.peak_memory_bytes
            if peak is None:   # not measured here, so on no rank (the meter follows the Engine's options and
                return None    # the device type, the same on every rank): no exchange, nothing to decide
            # each rank's slot: its ratio, and 1 when it has a prediction (a rank without one leaves it undecided)
            predicted = plan.worker(runtime.rank).memory_gib * GIB
            self._mine = torch.zeros(2 * runtime.world_size, dtype=torch.float64)
            if predicted > 0:
                self._mine[2 * runtime.rank] = peak / predicted
                self._mine[2 * runtime.rank + 1] = 1.0
            if runtime.world_size > 1:
                return None   # decided at the next step, from the exchange
            self._summed = self._mine
        if self._summed is None:
            return None
        vector, self._summed, self._mine = self._summed, None, None
        if not bool((vector[1::2] == 1.0).all()):
            return None
        self.ratios = tuple(float(r) for r in vector[0::2])
        over = {w.rank: r for w, r in zip(plan.workers, self.ratios) if r > 1 + self.threshold}
        if not over:
            log.debug("memory: measured / predicted %s, within %.0f%%", self.ratios, 100 * self.threshold)
            return None
        for r, ratio in over.items():   # a device already de-rated keeps the larger correction
            device = plan.workers[r].device
            self.scale[device] = min(self.scale.get(device, 1.0), 1.0 / ratio)
        worst = max(over, key=over.get)
        line = (f"memory: measured peak / predicted up to {over[worst]:.2f} (rank {worst}, "
                f"{plan.workers[worst].device}; {len(over)} rank(s) above {1 + self.threshold:.2f}): re-priced "
                "with those devices de-rated by it")
        change = self._replan(view)
        line += f"; {change.reason}" if change is not None else "; the plan in force still fits"
        self.lines.append(line)
        if self.rank == 0:
            log.warning("%s", line)
        return change

    def _replan(self, view: StepView) -> Optional[PlanChange]:
        """The plan in force re-planned on the de-rated devices at the speeds last measured (the
        re-planner's reference), else at the plan's own assumed rates; None when nothing changes."""
        from planner.balance.replan import plan_changes, rebalance
        from runtime.balance.rebalance import replanning_cluster

        plan, cluster = view.plan, replanning_cluster(view)
        reference = (view.figures.get("rebalance") or {}).get("reference")
        speeds = list(reference) if reference else [device_tflops(cluster.device(w.device), plan.precision)
                                                    for w in plan.workers]
        new = rebalance(plan, view.graphs, cluster, speeds, memory_scale=self.scale)
        changes = plan_changes(plan, new)
        if changes.empty:
            return None
        return PlanChange("apply", new, reason=changes.describe().replace("\n", "; "))

    def applied(self, view: StepView, change: PlanChange, report) -> None:
        self._steps, self._mine, self._summed = 0, None, None

    def changed(self, view: StepView, change: PlanChange) -> None:
        if change.kind in ("apply", "migrate", "leave"):
            self._steps, self._mine, self._summed = 0, None, None
