"""Dynamic balancing: from measured speeds to a re-plan at a step boundary, and the record of it.

Why: a plan is made from the cluster spec's nominal speeds, but on mixed, shared or throttling
clusters device speeds change while a job runs, and one slow rank sets the pace of all. Whale and
Poplar balance once; FlexTP (paper 000) rebalances tensor parallelism only, approximately; here
every kind of parallelism the runtime executes is rebalanced, exactly where it can be, and
approximately only where the policy allows it, and every re-plan says which it was.

The loop, after every optimizer step (all of it collective and identical on every rank):

1. :class:`~runtime.straggler_monitor.StragglerMonitor` records this rank's *compute* time and FLOPs
   (waiting excluded: DDP makes every rank's wall time equal) and every ``exchange_every`` steps
   shares the smoothed speeds in one small all-gather;
2. if some rank's speed relative to the others changed by more than ``threshold`` since the plan in
   force was made, :func:`planner.rebalance.rebalance` (pure, deterministic, the planner's own
   functions) computes the plan for the measured speeds, keeping every worker's device, stage and
   groups: only amounts of work move;
3. the change is applied by the Engine (:meth:`runtime.engine.Engine.apply_plan`):

   ==============================  =============================================  ========
   what changed                    how it is applied                               exact?
   ==============================  =============================================  ========
   data-parallel shares            new micro-batch sizes, no data moves            yes
   pipeline layers                 parameters + optimizer state moved P2P          yes
   tensor-parallel shard sizes     columns/heads + optimizer state moved P2P       yes
   ZERO-resizing (semi, resize)    a straggler drops a fraction of its matmuls'    no
                                   inner dimension (runtime.zero_resizing)
   ==============================  =============================================  ========

4. a :class:`ReplanEvent` is appended to the history (``Engine.replans``) and logged once, on rank
   0: which ranks changed, old and new speed, the action, its cost in ms, exact or approximate.

Policies (:class:`BalanceConfig`): ``"exact"`` (default) re-plans shares, layers and shards, never
approximates; ``"semi"`` is FlexTP's SEMI-migration for tensor-parallel stages (the worst stragglers
get their work moved, mild ones are resized, Eq. 2/3, Algorithm 2; see planner.semi_migration),
exact re-planning elsewhere; ``"resize"`` is ZERO-resizing alone for tensor-parallel stages
(Eq. 1); ``"off"`` measures and logs, and changes nothing. Steps run with resizing are marked
approximate in ``Engine.stats`` and in the log.

Invariant: every decision is a function of values that are identical on every rank after the
exchange (the gathered speeds, the plan, the step number), so every rank makes the same decision
at the same step and no decision needs a second round of communication.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence, Union

from whalelike.errors import SpecError

if TYPE_CHECKING:
    from planner.plan import Plan
    from runtime.straggler_monitor import Measured, SpeedChange

log = logging.getLogger(__name__)

POLICIES = ("exact", "semi", "resize", "off")


@dataclass(frozen=True)
class BalanceConfig:
    """How the Engine reacts to measured speed changes (see the module docstring).

    policy:         ``"exact"`` (default), ``"semi"``, ``"resize"`` or ``"off"``.
    threshold:      relative change of a rank's share of the total speed that triggers a re-plan
                    (0.10: a 10% change); in (0, 1).
    window:         steps the median of measured speeds is taken over (a one-step spike is ignored;
                    a sustained change is seen after ``ceil(window / 2)`` steps).
    exchange_every: steps between speed exchanges (one small all-gather each).
    warmup_steps:   first steps not measured (allocations, DDP's bucket set-up).
    max_gamma:      largest pruning ratio ZERO-resizing may use (policies semi and resize).
    """

    policy: str = "exact"
    threshold: float = 0.10
    window: int = 3
    exchange_every: int = 1
    warmup_steps: int = 2
    max_gamma: float = 0.9

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise SpecError(f"BalanceConfig.policy must be one of {', '.join(POLICIES)}, got {self.policy!r}; "
                            "'exact' re-plans without approximation, 'off' only measures")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) \
                or not 0.0 < self.threshold < 1.0 or math.isnan(self.threshold):
            raise SpecError(f"BalanceConfig.threshold must be a fraction in (0, 1) (0.10 = a 10% speed change), "
                            f"got {self.threshold!r}")
        for name, minimum in (("window", 1), ("exchange_every", 1), ("warmup_steps", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise SpecError(f"BalanceConfig.{name} must be an integer >= {minimum}, got {value!r}")
        if isinstance(self.max_gamma, bool) or not isinstance(self.max_gamma, (int, float)) \
                or not 0.0 < self.max_gamma < 1.0:
            raise SpecError(f"BalanceConfig.max_gamma must be in (0, 1), got {self.max_gamma!r}")

    @classmethod
    def of(cls, value: Union["BalanceConfig", str, None]) -> "BalanceConfig":
        """A config from what ``Engine(balance=...)`` accepts: a BalanceConfig, a policy name, or
        None (the default, policy ``"exact"``)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls(policy=value)
        raise SpecError(f"Engine(balance=...) takes a policy name ({', '.join(POLICIES)}) or a "
                        f"runtime.rebalance.BalanceConfig, got {type(value).__name__}")


@dataclass(frozen=True)
class ReplanEvent:
    """One reaction to a measured speed change. ``action`` is ``"none"`` (policy off, or nothing to
    change), ``"shares"``, ``"layers"``, ``"reshard"``, ``"resize"`` or a ``+``-joined mix;
    ``cost_ms`` is the time this rank spent planning and applying it; ``exact`` is False when steps
    from here on are approximate (ZERO-resizing)."""

    step: int
    changes: tuple["SpeedChange", ...]
    action: str
    detail: str
    cost_ms: float
    exact: bool
    plan_version: int

    def line(self) -> str:
        who = ", ".join(f"rank {c.rank} {_rate(c.old_speed)} -> {_rate(c.new_speed)} ({c.ratio:.2f}x)"
                        for c in self.changes)
        kind = "exact" if self.exact else "APPROXIMATE"
        return (f"step {self.step}: speed change: {who}; action: {self.action} ({kind}, {self.cost_ms:.1f} ms)"
                + (f": {self.detail}" if self.detail else ""))


def _rate(flops_per_s: float) -> str:
    return f"{flops_per_s / 1e9:.3g} GFLOP/s"


@dataclass
class Rebalancer:
    """The per-Engine state of dynamic balancing: the monitor, the speeds the plan in force was
    made for, the history. ``engine`` is the :class:`runtime.engine.Engine` it re-plans."""

    engine: object
    config: BalanceConfig
    history: list[ReplanEvent] = field(default_factory=list)
    reference: Optional[list[float]] = None   # speeds the plan in force was made for
    plan_version: int = 0
    resizing: bool = False                      # ZERO-resizing active on some rank

    def __post_init__(self):
        from runtime.straggler_monitor import StragglerMonitor

        e = self.engine
        self.monitor = StragglerMonitor(e.rank, e.plan.world_size, None, window=self.config.window,
                                        threshold=self.config.threshold, exchange_every=self.config.exchange_every)
        self._resizer = None

    # -- the step boundary --------------------------------------------------------------------------
    def after_step(self, step: int, flops: float, compute_s: float, matmul_s: float) -> Optional[ReplanEvent]:
        """Record this step's measurement; at exchange steps compare and maybe re-plan (collective)."""
        if step < self.config.warmup_steps:
            return None
        self.monitor.record(step, flops, compute_s, matmul_s)
        if len(self.monitor.samples) < self.config.window:
            return None
        measured = self.monitor.exchange(step)
        if measured is None:
            return None
        if self.reference is None:
            self.reference = list(measured.speeds)
            return None
        changes = self.monitor.changed(measured, self.reference)
        if not changes:
            return None
        start = time.perf_counter()
        action, detail, exact = self._react(measured)
        cost_ms = (time.perf_counter() - start) * 1e3
        self.reference = list(measured.speeds)
        self.monitor.reset()   # samples from before the change must not outvote the new plan's
        event = ReplanEvent(step, tuple(changes), action, detail, cost_ms, exact, self.plan_version)
        self.history.append(event)
        if self.engine.rank == 0:
            (log.warning if not exact else log.info)("re-plan %s", event.line())
        return event

    # -- decisions ---------------------------------------------------------------------------------
    def _react(self, measured: "Measured") -> tuple[str, str, bool]:
        policy = self.config.policy
        if policy == "off":
            return "none", "policy off: measured only", True
        tensor_parallel = any(w.tp_size > 1 for w in self.engine.plan.workers)
        if tensor_parallel and policy in ("semi", "resize"):
            return self._approximate(measured)
        return self._exact(measured)

    def _exact(self, measured: "Measured") -> tuple[str, str, bool]:
        from planner.rebalance import plan_changes, rebalance

        engine = self.engine
        self._stop_resizing()
        new = rebalance(engine.plan, engine.graphs, engine.cluster, measured.speeds)
        changes = plan_changes(engine.plan, new)
        if changes.empty:
            return "none", "the plan for the measured speeds is the plan in force", True
        report = engine.apply_plan(new)
        self.plan_version += 1
        action = "+".join(k for k in ("shares", "layers", "shards") if k in changes.kinds).replace("shards", "reshard")
        moved = f"; moved {report.moved_tensors} tensors, {report.moved_bytes / 2**20:.2f} MiB" if report else ""
        return action, changes.describe().replace("\n", "; ") + moved, True

    def _approximate(self, measured: "Measured") -> tuple[str, str, bool]:
        """FlexTP for tensor-parallel plans: ZERO-resizing (policy resize) or SEMI-migration (semi):
        stragglers chosen for migration get their work moved exactly (a re-shard towards the
        measured speeds), the others are resized by their own pruning ratio."""
        from planner.semi_migration import resize_decision, semi_decision

        engine, rank = self.engine, self.engine.rank
        times, matmul = list(measured.compute_s), list(measured.matmul_s)
        if self.config.policy == "resize":
            decision = resize_decision(times, matmul, max_gamma=self.config.max_gamma)
        else:
            decision = semi_decision(times, matmul, max_gamma=self.config.max_gamma)
        actions, details = [], []
        if decision.migrate:
            speeds = list(measured.speeds)
            for r in range(len(speeds)):
                if r not in decision.migrate and r in decision.resize:
                    # a resized rank keeps its shard: plan as if it ran at the others' pace
                    speeds[r] = max(speeds)
            action, detail, _ = self._exact_for(speeds)
            if action != "none":
                actions.append(action)
                details.append(f"migrated ranks {sorted(decision.migrate)}: {detail}")
        gamma = decision.resize.get(rank, 0.0)
        self._set_resizing(gamma)
        if decision.resize:
            actions.append("resize")
            details.append("gamma " + ", ".join(f"rank {r}: {g:.2f}" for r, g in sorted(decision.resize.items())))
        self.resizing = bool(decision.resize)
        return ("+".join(actions) or "none"), "; ".join(details), not decision.resize

    def _exact_for(self, speeds: Sequence[float]) -> tuple[str, str, bool]:
        from planner.rebalance import plan_changes, rebalance

        engine = self.engine
        new = rebalance(engine.plan, engine.graphs, engine.cluster, speeds)
        changes = plan_changes(engine.plan, new)
        if changes.empty:
            return "none", "", True
        engine.apply_plan(new)
        self.plan_version += 1
        return "reshard" if "shards" in changes.kinds else "+".join(sorted(changes.kinds)), changes.describe(), True

    def _set_resizing(self, gamma: float) -> None:
        from runtime.zero_resizing import ZeroResizer

        module = self.engine.executor_module()
        if self._resizer is None or self._resizer.module is not module:
            self._resizer = ZeroResizer(module)
        self._resizer.set_ratio(gamma)

    def _stop_resizing(self) -> None:
        if self._resizer is not None:
            self._resizer.set_ratio(0.0)
        self.resizing = False

    def after_optimizer_step(self) -> None:
        """Priority pruning's weight-change statistics (FlexTP Algorithm 1) follow every update."""
        if self._resizer is not None:
            self._resizer.observe_weights()

    @property
    def approximate(self) -> bool:
        """Whether this rank's next step runs with ZERO-resizing."""
        return self._resizer is not None and self._resizer.active
