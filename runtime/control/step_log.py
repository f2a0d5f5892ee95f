"""``StepLog``: each step's figures as one JSON line, from rank 0 -- a controller that never changes the
plan, and the model of a new controller in one small file.

What a line holds: the step, the global-mean loss, this rank's :class:`runtime.step_stats.StepStats`
fields (time, compute, wait, FLOPs, learning rate, gradient norm, loss scale, peak memory, skipped,
approximate), the plan version, and the minimum, median and maximum over the ranks of three
figures every rank measured itself in the step before (step time, compute time, peak memory: a
step's own are known only after the collective that ends it), which it learns at no collective of
its own: its share of the step-end exchange (:mod:`runtime.control.exchange`).

Why a controller and not a callback after ``train_step``: the per-rank figures would need a
collective of their own; as a controller, they ride in the collective that ends the step, and the
line is written at the boundary where every other controller reads the same step.

Invariant: every rank takes part in the exchange alike; only rank 0 writes (through
:class:`whalelike.files.LineLog`: whole lines, flushed); the controller returns no change.
"""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
from typing import Optional

import torch

from runtime.control.exchange import Part
from runtime.control.protocol import Controller, PlanChange, StepView
from whalelike.files import LineLog

FIGURES = ("wall_s", "compute_s", "peak_memory_bytes")


class StepLog(Controller):
    """Writes one JSON line per step (every ``every`` steps) to ``path`` on rank 0 (see the module
    docstring). Add it on every rank: ``engine.add_controller(StepLog("out/steps.jsonl"))``."""

    name = "step_log"
    order = 100

    def __init__(self, path: str, every: int = 1):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"StepLog(every=...) must be a whole number of steps >= 1, got {every!r}")
        self.path, self.every = path, every
        self._log: Optional[LineLog] = None
        self._ranks: Optional[list[list[float]]] = None
        self._last: Optional[dict] = None
        self.lines = 0

    def exchange(self, step: int, runtime, so_far) -> Optional[Part]:
        if step % self.every:
            return None
        world, rank = runtime.world_size, runtime.rank

        def fill() -> torch.Tensor:
            # this rank's previous step (this step's figures exist only after it): wall, compute, peak
            out = torch.zeros(len(FIGURES) * world, dtype=torch.float64)
            last = self._last or {}
            for i, name in enumerate(FIGURES):
                value = last.get(name)
                out[i * world + rank] = math.nan if value is None else float(value)
            return out

        def arrived(values: torch.Tensor) -> None:
            self._ranks = values.view(len(FIGURES), world).tolist()

        return Part(len(FIGURES) * world, fill, arrived)

    def react(self, view: StepView) -> Optional[PlanChange]:
        stats = dataclasses.asdict(view.stats)
        if view.step % self.every == 0 and view.runtime.rank == 0:
            line = {"step": view.step, "loss": view.loss, **stats, "plan_kind": view.plan.kind}
            if self._ranks is not None:
                for name, values in zip(FIGURES, self._ranks):
                    known = [v for v in values if not math.isnan(v)]
                    if known:
                        line[f"{name}_of_ranks"] = {"min": min(known), "median": statistics.median(known),
                                                    "max": max(known), "step": view.step - 1}
            if self._log is None:
                self._log = LineLog(self.path, label="StepLog")
            self._log.write(json.dumps(line, default=float))
            self.lines += 1
        self._last = stats
        return None

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
