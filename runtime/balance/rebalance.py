"""Dynamic balancing: from measured speeds to a re-plan at a step boundary, and the record of it.

Why: a plan is made from the cluster spec's nominal speeds, but on mixed, shared or throttling
clusters device speeds change while a job runs, and one slow rank sets the pace of all. Whale and
Poplar balance once; FlexTP (paper 000) rebalances tensor parallelism only, approximately; here
every kind of parallelism the runtime executes is rebalanced, exactly where it can be, and
approximately only where the policy allows it, and every re-plan says which it was.

The loop, after every optimizer step (all of it collective and identical on every rank):

1. :class:`~runtime.balance.straggler_monitor.StragglerMonitor` records this rank's *compute* time and FLOPs
   (waiting excluded: DDP makes every rank's wall time equal); every ``exchange_every`` steps the
   smoothed speeds ride in the all-reduce that ends a step anyway (DDP's last gradient bucket, the
   pipeline's loss), so sharing them costs no collective of its own;
2. if some rank's speed relative to the others changed by more than ``threshold`` since the plan in
   force was made, :func:`planner.balance.replan.rebalance` (pure, deterministic, the planner's own
   functions) computes the plan for the measured speeds, keeping every worker's device, stage and
   groups: only amounts of work move;
3. the change is applied by the Engine (:meth:`runtime.engine.Engine.apply_plan`):

   ================================  ============================================  ========
   what changed                      how it is applied                             exact?
   ================================  ============================================  ========
   data-parallel shares              new micro-batch sizes, no data moves          yes
   pipeline layers                   parameters + optimizer state moved P2P        yes
   tensor-parallel, while new        migration (runtime.state.migration): the plan in    yes
                                     force keeps parameters and optimizer state,
                                     the measured-speed layout computes
   tensor-parallel, once persistent  re-shard: columns/heads + optimizer state     yes
                                     moved P2P (after ``persist_steps``)
   ZERO-resizing (semi, resize)      a straggler drops a fraction of its matmuls'  no
                                     inner dimension (runtime.balance.flextp_resizing)
   ================================  ============================================  ========

4. a :class:`ReplanEvent` is appended to the history (``Engine.replans``) and logged once, on rank
   0: which ranks changed, old and new speed, the action, its cost in ms, exact or approximate.

Policies (:class:`BalanceConfig`): ``"exact"`` (default) re-plans shares, layers and shards, never
approximates; ``"semi"`` is FlexTP's SEMI-migration for tensor-parallel stages (the worst stragglers
get their work moved, mild ones are resized, Eq. 2/3, Algorithm 2; see planner.balance.semi_migration;
a single straggler is pre-tested first, Algorithm 2 line 1, runtime.balance.semi_pretest: resizing is
kept within ``semi_loss_budget`` of loss and the rest migrates), exact re-planning elsewhere;
``"resize"`` is ZERO-resizing alone for tensor-parallel stages (Eq. 1); ``"off"`` measures and logs,
and changes nothing. Steps run with resizing are marked approximate in ``Engine.stats`` and in the log.

Invariant: every decision is a function of values that are identical on every rank after the
exchange (the gathered speeds, the plan, the step number), so every rank makes the same decision
at the same step and no decision needs a second round of communication.
"""
from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence, Union

import torch
import torch.nn as nn

from planner.groups import group_ranks
from runtime.control.exchange import Part
from runtime.control.protocol import Controller, PlanChange, StepView
from whalelike.errors import SpecError

if TYPE_CHECKING:
    from runtime.balance.straggler_monitor import Measured, SpeedChange
    from whalelike.cluster import Cluster

log = logging.getLogger(__name__)

POLICIES = ("exact", "semi", "resize", "off")
TP_LOSSLESS = ("auto", "migrate", "reshard")


@dataclass(frozen=True)
class BalanceConfig:
    """How the Engine reacts to measured speed changes (see the module docstring).

    policy:         ``"exact"`` (default), ``"semi"``, ``"resize"`` or ``"off"``.
    threshold:      relative change of a rank's share of the total speed that triggers a re-plan
                    (0.10: a 10% change); in (0, 1).
    window:         steps the median of measured speeds is taken over (a one-step spike is ignored;
                    a sustained change is seen after ``ceil(window / 2)`` steps).
    exchange_every: steps between speed exchanges (each rides in the all-reduce that ends a step).
    warmup_steps:   first steps not measured (allocations, DDP's bucket set-up).
    max_gamma:      largest pruning ratio ZERO-resizing may use (policies semi and resize).
    tp_lossless:    how the exact policy rebalances tensor-parallel stages: ``"auto"`` (default)
                    migrates work while a change is new and re-shards for good once it has lasted
                    ``persist_steps``; ``"migrate"`` only migrates; ``"reshard"`` re-shards at once.
    persist_steps:  steps a migration lasts before ``"auto"`` makes it a permanent re-shard.
    semi_loss_budget: policy semi, a single straggler: the most resizing may raise the loss of the
                    last training batches, relative (0.005: 0.5%), as the pre-test measures it
                    (runtime.balance.semi_pretest, Algorithm 2 line 1); past it the straggler's work
                    migrates instead (exact). ``math.inf``: accuracy not priced (Eq. 2 on time alone).
    pretest_batches: the last training batches the pre-test evaluates the pruned loss on.
    """

    policy: str = "exact"
    threshold: float = 0.10
    window: int = 3
    exchange_every: int = 1
    warmup_steps: int = 2
    max_gamma: float = 0.9
    tp_lossless: str = "auto"
    persist_steps: int = 20
    semi_loss_budget: float = 0.005
    pretest_batches: int = 2

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise SpecError(f"BalanceConfig.policy must be one of {', '.join(POLICIES)}, got {self.policy!r}; "
                            "'exact' re-plans without approximation, 'off' only measures")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) \
                or not 0.0 < self.threshold < 1.0 or math.isnan(self.threshold):
            raise SpecError(f"BalanceConfig.threshold must be a fraction in (0, 1) (0.10 = a 10% speed change), "
                            f"got {self.threshold!r}")
        if self.tp_lossless not in TP_LOSSLESS:
            raise SpecError(f"BalanceConfig.tp_lossless must be one of {', '.join(TP_LOSSLESS)}, got "
                            f"{self.tp_lossless!r}")
        for name, minimum in (("window", 1), ("exchange_every", 1), ("warmup_steps", 0), ("persist_steps", 1),
                              ("pretest_batches", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise SpecError(f"BalanceConfig.{name} must be an integer >= {minimum}, got {value!r}")
        if isinstance(self.max_gamma, bool) or not isinstance(self.max_gamma, (int, float)) \
                or not 0.0 < self.max_gamma < 1.0:
            raise SpecError(f"BalanceConfig.max_gamma must be in (0, 1), got {self.max_gamma!r}")
        if isinstance(self.semi_loss_budget, bool) or not isinstance(self.semi_loss_budget, (int, float)) \
                or not self.semi_loss_budget >= 0:
            raise SpecError(f"BalanceConfig.semi_loss_budget must be a relative loss increase >= 0 (0.005 = 0.5%; "
                            f"math.inf prices no accuracy), got {self.semi_loss_budget!r}")

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
                        f"runtime.balance.rebalance.BalanceConfig, got {type(value).__name__}")


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


def replanning_cluster(view: StepView) -> Cluster:
    """The cluster a step-boundary re-plan prices on: the spec's, with the profile's measured rates
    when the run has one (the measured speeds are relative to the profile's rates, not the spec's)."""
    cluster = view.runtime.cluster
    if view.profile is not None:
        from planner.devices.measured_speeds import measured_cluster
        cluster = measured_cluster(cluster, view.profile, view.graphs, view.plan.precision, plan=view.plan)
    return cluster


class Rebalancer(Controller):
    """The exact re-planner, a step-boundary controller (:mod:`runtime.control.protocol`, name
    ``"rebalance"``, order 20): the monitor, the speeds the plan in force was made for, the history.
    Its share of the step-end exchange is the monitor's figures on exchange steps; it reacts with
    ``apply``, ``migrate`` or ``end_migration`` changes (the Engine applies them) and, under the
    approximate policies, sets ZERO-resizing on the module this rank computes with. On a world of
    one rank it neither measures nor exchanges: there is no other rank to give work to."""

    name = "rebalance"
    order = 20

    def __init__(self, config: BalanceConfig, rank: int, world_size: int):
        from runtime.balance.straggler_monitor import StragglerMonitor

        self.config = config
        self.history: list[ReplanEvent] = []
        self.reference: Optional[list[float]] = None   # speeds the plan in force was made for
        self.plan_version = 0
        self.migration_started: Optional[int] = None   # step a tensor-parallel migration began, while one runs
        self.resized: dict = {}                       # rank -> pruning ratio of ZERO-resizing in force
        self.last_measured: Optional["Measured"] = None   # the latest exchange's speeds (the slowness rule reads them)
        self.monitor = StragglerMonitor(rank, world_size, None, window=config.window, threshold=config.threshold,
                                        exchange_every=config.exchange_every)
        self.rank = rank
        self._resizer = None
        self._resize_cap: Optional[float] = None   # the SEMI pre-test's bound on this rank's pruned fraction
        # the last training batches, for the SEMI pre-test's loss evaluations (policy semi only)
        self.recent_batches: deque = deque(maxlen=config.pretest_batches)
        self._fresh = False   # the next step is the first of a rebuilt executor
        self._measured_step: Optional[int] = None
        self._start: float = 0.0    # when the change being applied was decided (its event's cost)
        self._culprit_changes: tuple = ()
        self._pending_resize: Optional[float] = None   # this rank's resizing, set once its change is applied

    # -- the controller protocol ---------------------------------------------------------------------
    def exchange(self, step: int, runtime, so_far) -> Optional[Part]:
        """The monitor's figures when an exchange is due (filled when the step's last collective is
        about to run: its compute is done then, so this step's figures travel). The same decision on
        every rank: it depends on the step and the sample count only."""
        if (runtime.world_size == 1 or step < self.config.warmup_steps or self._fresh
                or step % self.config.exchange_every or len(self.monitor.samples) + 1 < self.config.window):
            return None

        def fill() -> torch.Tensor:
            stats = so_far()
            self._measure(step, stats.flops, stats.padded_s, stats.matmul_s, stats.overruns)
            return self.monitor.outgoing()

        def arrived(values: torch.Tensor) -> None:
            self.last_measured = self.monitor.received(step, values)

        return Part(3 * runtime.world_size, fill, arrived)

    def publish(self) -> dict:
        return {"measured": self.last_measured, "reference": self.reference}

    def on_batch(self, inputs: tuple, targets) -> None:
        """Keep a reference to a training batch (the whole global batch) for SEMI's pre-test."""
        if self.config.policy == "semi":
            self.recent_batches.append((inputs, targets))

    def _measure(self, step: int, flops: float, compute_s: float, matmul_s: float, overruns: int) -> None:
        flops, compute_s, matmul_s = self._unresized(flops, compute_s, matmul_s)
        self.monitor.record(step, flops, compute_s, matmul_s, overran=overruns > 0)
        self._measured_step = step

    def react(self, view: StepView) -> Optional[PlanChange]:
        """Record this step's measurement (unless its exchange already did); after an exchange,
        compare with the speeds the plan was made for and maybe ask for a change (collective where
        SEMI pre-tests)."""
        step = view.step
        if step < self.config.warmup_steps or view.runtime.world_size == 1:   # one rank: nothing to balance
            return None
        if self._fresh:
            # the first step of a rebuilt executor pays one-time costs (shape propagation,
            # allocations): its speed is not the device's, and must not start a re-plan
            self._fresh = False
            return None
        if self._measured_step != step:
            self._measure(step, view.stats.flops, view.stats.padded_s, view.stats.matmul_s, view.stats.overruns)
        self._start = time.perf_counter()
        change = self._persisted(view)
        measured = self.last_measured
        if change is not None or measured is None or measured.step != step:
            return change
        if self.reference is None:
            self.reference = list(measured.speeds)
            return None
        changes = self.monitor.changed(measured, self.reference)
        if not changes:
            return None
        self._culprit_changes = self._culprits(changes)
        change = self._react(view, measured)
        self.reference = list(measured.speeds)
        self.monitor.reset()   # samples from before the change must not outvote the new plan's
        if change.kind == "none":     # nothing to change (or resizing alone): recorded now, nothing applied
            self._record(step, self._culprit_changes, change.action or "none", change.reason, change.exact)
            return None
        return change

    def applied(self, view: StepView, change: PlanChange, report) -> None:
        """Its change was applied (``view`` is of the plan now in force): the event is recorded with
        what moved; a new layout's first step pays one-time costs (not measured)."""
        if change.kind in ("apply", "migrate"):
            self.plan_version += 1
            self._fresh = True
        if change.kind == "migrate":
            self.migration_started = view.step   # the step just run; the layout computes from the next
        if self._pending_resize is not None:     # the approximate policies' resizing, on the module now computing
            self._set_resizing(view.module, self._pending_resize)
            self._pending_resize = None
        moved = f"; {report.describe()}" if report is not None else ""
        self._record(view.step, change.changes, change.action, change.reason + moved, change.exact)

    def changed(self, view: StepView, change: PlanChange) -> None:
        """Another controller's change at this boundary: a new executor's first step pays one-time
        costs; a leave made a new world (this rank's index and the world's size)."""
        if change.kind in ("apply", "migrate", "leave"):
            self._fresh = True
        if change.kind == "leave":
            from runtime.balance.straggler_monitor import StragglerMonitor

            self.monitor = StragglerMonitor(view.runtime.rank, view.runtime.world_size, None, window=self.config.window,
                                            threshold=self.config.threshold, exchange_every=self.config.exchange_every)
            self.rank, self.reference, self.last_measured = view.runtime.rank, None, None
            self.plan_version += 1

    def resumed(self, view: StepView) -> None:
        """Another controller held this one inert (P-Reduce's policy): the speeds it knew are stale."""
        self.reference, self.last_measured = None, None
        self.monitor.reset()

    def after_update(self, module: nn.Module, plan) -> None:
        """Priority pruning's weight-change statistics (FlexTP Algorithm 1) follow every update, on
        every rank, so a rank that becomes a straggler prunes its least-changing columns at once."""
        if self.config.policy in ("semi", "resize") and plan.tensor_parallel:
            resizer = self.resizer_of(module)
            if resizer is not None:
                resizer.observe_weights()

    @property
    def approximate(self) -> bool:
        """Whether the next step is approximate: some rank (not necessarily this one) runs it with
        ZERO-resizing, so the global loss and every gradient sum are approximate everywhere."""
        return bool(self.resized)

    # -- decisions ---------------------------------------------------------------------------------
    def _culprits(self, changes) -> tuple:
        """The ranks whose own speed changed: when one rank slows, every other rank's *share* of
        the total grows too (that is what triggers), but the event names the one that slowed."""
        own = [c for c in changes if c.old_speed > 0 and abs(c.new_speed / c.old_speed - 1) > self.config.threshold]
        return tuple(own or changes)

    def _record(self, step, changes, action, detail, exact) -> ReplanEvent:
        event = ReplanEvent(step, tuple(changes), action, detail, (time.perf_counter() - self._start) * 1e3, exact,
                            self.plan_version)
        self.history.append(event)
        if self.rank == 0:
            (log.info if exact else log.warning)("re-plan %s", event.line())
        return event

    def _unresized(self, flops: float, compute_s: float, matmul_s: float) -> tuple[float, float, float]:
        """What this step would have measured without ZERO-resizing (planner.balance.semi_migration.unresized):
        a resized straggler must keep looking as slow as it is, or Eq. (1) would switch it off again."""
        from planner.balance.semi_migration import unresized

        if self._resizer is None or not self._resizer.active or matmul_s <= 0:
            return flops, compute_s, matmul_s
        pruned = self._resizer.pruned_work
        (compute,), (matmul,) = unresized([compute_s], [matmul_s], [pruned])
        return flops / (1.0 - pruned), compute, matmul

    def _react(self, view: StepView, measured: "Measured") -> "_Proposal":
        policy = self.config.policy
        self._pending_resize = None
        if policy == "off":
            return _Proposal("none", reason="policy off: measured only")
        if not view.plan.tensor_parallel:
            return self._apply(view, measured.speeds)
        if policy in ("semi", "resize"):
            return self._approximate(view, measured)
        self._stop_resizing()
        if self.config.tp_lossless == "reshard":
            return self._apply(view, measured.speeds)
        return self._migrate(view, measured.speeds)

    def _new_plan(self, view: StepView, speeds: Sequence[float]):
        from planner.balance.replan import plan_changes, rebalance

        scale = (view.figures.get("memory") or {}).get("scale")   # devices the memory check de-rated
        new = rebalance(view.plan, view.graphs, replanning_cluster(view), list(speeds), memory_scale=scale)
        return new, plan_changes(view.plan, new)

    def _apply(self, view: StepView, speeds: Sequence[float]) -> "_Proposal":
        """The exact re-plan: shares in place, layers and shards moved with their optimizer state."""
        new, changes = self._new_plan(view, speeds)
        if changes.empty:
            if view.compute_plan is not None:
                self.migration_started = None
                return _Proposal("end_migration", reason="the plan for the measured speeds is the plan in force",
                                 action="none", changes=self._culprit_changes)
            return _Proposal("none", reason="the plan for the measured speeds is the plan in force")
        self.migration_started = None
        return _Proposal("apply", new, changes.describe().replace("\n", "; "), action=_action(changes.kinds),
                         changes=self._culprit_changes)

    def _migrate(self, view: StepView, speeds: Sequence[float], exact: bool = True) -> "_Proposal":
        """Lossless migration (runtime.state.migration): the plan for the measured speeds computes, the
        plan in force keeps the parameters and optimizer state; none at all when they agree."""
        new, changes = self._new_plan(view, speeds)
        if changes.empty:
            if view.compute_plan is not None:
                self.migration_started = None
                return _Proposal("end_migration", reason="the plan in force fits the measured speeds",
                                 action="end migration", changes=self._culprit_changes, exact=exact)
            return _Proposal("none", reason="the plan in force fits the measured speeds", exact=exact)
        return _Proposal("migrate", new, changes.describe().replace("\n", "; "), action="migrate",
                         changes=self._culprit_changes, exact=exact)

    def _persisted(self, view: StepView) -> Optional["_Proposal"]:
        """Under ``tp_lossless="auto"`` a migration that lasted ``persist_steps`` becomes the plan."""
        if (self.migration_started is None or self.config.tp_lossless != "auto"
                or view.step - self.migration_started < self.config.persist_steps or view.compute_plan is None):
            return None
        self.migration_started = None
        self.monitor.reset()
        return _Proposal("apply", view.compute_plan, f"migration lasted {self.config.persist_steps} steps",
                         action="reshard")

    def _approximate(self, view: StepView, measured: "Measured") -> "_Proposal":
        """FlexTP for tensor-parallel groups: ZERO-resizing alone (policy resize, Eq. 1 against the
        group's mean) or SEMI-migration (policy semi, Algorithm 2: the slowest stragglers migrate
        their work exactly, the others are resized by Eq. 1 against the group's fastest). Each
        tensor-parallel group decides on its own ranks' times; ranks outside them (a hybrid plan's
        data-parallel or pipeline stages) are re-planned exactly, at the speeds resizing leaves."""
        from planner.balance.semi_migration import resize_decision, semi_decision

        migrate: dict[int, float] = {}
        resize: dict[int, float] = {}
        caps: dict[int, float] = {}
        pretests: list[str] = []
        groups = _tensor_parallel_groups(view.plan)
        for ranks in groups:
            times = [measured.compute_s[r] for r in ranks]
            matmul = [measured.matmul_s[r] for r in ranks]
            decide = resize_decision if self.config.policy == "resize" else semi_decision
            # a straggler is slower than the reference by more than the trigger threshold: equal
            # ranks' measured times differ in their last bits, and must not count as stragglers
            decision = decide(times, matmul, max_gamma=self.config.max_gamma, tolerance=self.config.threshold)
            if self.config.policy == "semi" and len(decision.stragglers) == 1 and decision.resize:
                decision = self._pretested(view, ranks, decision, times, matmul, pretests)
            migrate.update((ranks[i], f) for i, f in decision.migrate.items())
            resize.update((ranks[i], g) for i, g in decision.resize.items())
            if decision.resize_cap is not None:
                caps.update((ranks[i], decision.resize_cap / max(1e-12, 1.0 - decision.migrate.get(i, 0.0)))
                            for i in decision.resize)
        # the layout to compute with: migrating ranks give up their migrated fraction, resized ranks
        # keep their work (resizing brings them back to pace), everyone else runs at measured speed
        speeds = list(measured.speeds)
        # policy resize is ZERO-resizing alone: tensor-parallel work never moves
        kept = [r for ranks in groups for r in ranks] if self.config.policy == "resize" else list(resize)
        for r in kept:
            speeds[r] = self.reference[r]
        for r, fraction in migrate.items():
            speeds[r] = self.reference[r] * (1.0 - fraction)
        proposal = self._migrate(view, speeds, exact=not resize)
        self._resize_cap = caps.get(self.rank)
        self.resized = resize
        resizing = resize.get(self.rank, 0.0)
        actions = [] if proposal.kind == "none" else [proposal.action]
        details = pretests + ([proposal.reason] if proposal.kind != "none" else [])
        if resize:
            actions.append("resize")
            details.append("gamma " + ", ".join(f"rank {r}: {g:.2f}" for r, g in sorted(resize.items())))
        action, reason = "+".join(actions) or "none", "; ".join(details)
        if proposal.kind == "none":      # no layout change: resizing (or nothing) at once
            self._set_resizing(view.module, resizing)
            return _Proposal("none", reason=reason or proposal.reason, exact=not resize, action=action)
        self._pending_resize = resizing  # set once the new layout computes (applied)
        return _Proposal(proposal.kind, proposal.plan, reason, exact=not resize, action=action,
                         changes=self._culprit_changes)

    def _pretested(self, view: StepView, ranks: Sequence[int], decision, times, matmul, notes: list[str]):
        """Algorithm 2 line 1 for a single straggler SEMI would resize: measure what resizing and
        migrating cost (runtime.balance.semi_pretest; collective) and decide again with those costs.
        The pre-test and its decision are logged and named in the event's detail."""
        from planner.balance.semi_migration import semi_decision
        from runtime.balance.semi_pretest import run_pretest

        index = decision.stragglers[0]
        gamma = decision.resize.get(index, 0.0) + decision.migrate.get(index, 0.0)
        resizer = self.resizer_of(view.module) if view.runtime.rank == ranks[index] else None
        result = run_pretest(view, list(self.recent_batches), resizer, ranks, ranks[index], gamma, matmul,
                             max_gamma=self.config.max_gamma, loss_budget=self.config.semi_loss_budget)
        if result is None:
            return decision
        decided = semi_decision(times, matmul, costs=result.costs, max_gamma=self.config.max_gamma,
                                tolerance=self.config.threshold)
        line = result.line(decided)
        if self.rank == 0:
            log.info("SEMI %s", line)
        notes.append(line)
        return decided

    def _set_resizing(self, module: nn.Module, gamma: float) -> None:
        resizer = self.resizer_of(module)
        if resizer is not None:
            # the pre-test's accuracy bound caps Algorithm 1's differentiated ratios too: statistics
            # must not raise the pruned fraction past what the pre-test priced
            cap = self.config.max_gamma if self._resize_cap is None else min(self.config.max_gamma, self._resize_cap)
            resizer.max_gamma = cap
            resizer.set_ratio(min(gamma, cap))

    def resizer_of(self, module: nn.Module):
        """The ZERO-resizer of ``module``, the module this rank computes with (a new one after a
        migration or a re-shard rebuilt it), or None where it holds no tensor-parallel Linear."""
        from runtime.tensor.layers import ParallelLinear
        from runtime.balance.flextp_resizing import ZeroResizer

        if self._resizer is not None and self._resizer.module is module:
            return self._resizer
        if self._resizer is not None:
            self._resizer.set_ratio(0.0)
        has_linear = any(isinstance(m, ParallelLinear) for m in module.modules())
        self._resizer = ZeroResizer(module, max_gamma=self.config.max_gamma) if has_linear else None
        return self._resizer

    def _stop_resizing(self) -> None:
        if self._resizer is not None:
            self._resizer.set_ratio(0.0)
        self.resized = {}
        self._resize_cap = None


@dataclass(frozen=True)
class _Proposal(PlanChange):
    """A :class:`PlanChange` of the re-planner with what its event records: the action's name and
    the speed changes that caused it (``kind`` ``"none"``: nothing to change, never applied)."""

    kind: str = "none"
    action: str = ""
    changes: tuple = ()

    def __post_init__(self):
        if self.kind != "none":
            super().__post_init__()


def _tensor_parallel_groups(plan) -> list[list[int]]:
    """The ranks of every tensor-parallel group (same replica, stage and dp_index), by tp_index."""
    return [list(ranks) for ranks in group_ranks(plan, "tp").values() if len(ranks) > 1]


def _action(kinds) -> str:
    names = {"shares": "shares", "layers": "layers", "shards": "reshard"}
    return "+".join(names[k] for k in ("shares", "layers", "shards") if k in kinds) or "none"
