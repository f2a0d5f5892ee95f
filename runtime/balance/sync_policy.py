"""Choosing between the two answers to stragglers: P-Reduce for short ones, an exact re-plan for lasting ones.

Whalelike has two remedies for a slow rank. The exact re-plan (:mod:`runtime.balance.rebalance`)
gives it a smaller share; it is exact, but it needs a few slow steps to notice, and a slowdown that
is gone by then is re-planned for nothing while every synchronous step has waited for it. Prague's
partial all-reduce (:mod:`runtime.replicas.partial_sync`) lets a slow worker hold back only its
group, so slowdowns of a step or two cost little; but it is approximate, and a rank that stays slow
falls behind its group for good. :class:`SyncPolicy` measures which kind of slowdown the run has and
switches the plan's data-parallel stages between them, so a user who does not know their cluster
gets the better one.

**The rule** (:func:`choose`, a pure function of the gathered figures). Every ``decide_every`` (2)
steps under the exact sync, every ``partial_every`` (8) under P-Reduce, each rank's compute time per step (``StepStats.padded_s``: its compute segments, waiting excluded,
as the straggler monitor measures) and FLOPs over the last ``window`` steps are gathered. A rank's
step is *slow* when its time exceeds ``slow_factor`` (1.5) times the median rank's time of that step:
the plan's shares are speed-proportional, so every rank's compute time per step is about equal
under the plan in force, and a rank well above the median is slower than its plan. Then:

1. some rank's latest ``persist_steps`` (6) steps were all slow: the slowdown *persists*; mode
   **exact** (DDP) with the shares re-planned for the measured speeds (:func:`planner.balance.replan.rebalance`,
   at once, so the straggler stops being one), and the exact re-planner
   (:mod:`runtime.balance.rebalance`, the Engine's own config) watches from there on;
2. otherwise, if at least ``transient_fraction`` (10%) of the window's steps had a slow rank, the
   slowdowns are *short-lived*: mode **partial** (P-Reduce);
3. otherwise (a calm window): P-Reduce gives way to the exact mode after ``calm_decisions`` (3)
   calm decisions in a row (exactness is worth keeping when nothing is gained without it); the exact
   mode stays.

The thresholds come from the cases they separate: a rank slowed ``5x`` with probability ``1/N`` per
step (the paper's model, ``N = 4``) is slow 6 steps in a row with probability ``4^-6`` (never in
practice), while a lasting slowdown is named within ``persist_steps + 2 partial_every`` steps (the
figures are read one decision late under P-Reduce, below); 10% of
steps with a slow rank is where all-reduce already loses a tenth of its time to waiting, and a
1.5x threshold leaves a rank's ordinary jitter (a few percent) out.

**Switching** is a re-plan of the same workers (:meth:`runtime.engine.Engine.apply_plan`): the
data-parallel stages' ``replica_sync`` becomes ``"partial"`` (with this policy's generator, group
size and Δc) or ``"ddp"``; the state moves as for any re-plan, P-Reduce's replicas first averaged
over the whole group, optimizer state included (:meth:`runtime.replicas.partial_sync.PartialSync.consensus`),
so the exact mode starts from identical replicas. While P-Reduce runs, the Engine's exact re-planner
is held inert (:meth:`SyncPolicy.suppresses`, a declared rule of the controller board: its exchanges,
one global all-reduce each, would synchronise every step, the very thing P-Reduce avoids); it
resumes, with fresh speeds, when the plan goes back to exact. The figures are gathered with an all-gather launched at one decision step and read at the
next, on a process group of the policy's own, so under P-Reduce no rank waits at a decision step
for ranks that are behind (they have ``partial_every`` steps to catch up); under the exact sync the
ranks are in step anyway, and the window is gathered and decided at once, every ``decide_every``
steps, so short slowdowns are answered within a few steps.

``mode="partial"`` never switches: it only keeps the exact re-planner inert while the plan runs
P-Reduce (the way to run a ``sync="partial"`` plan under the Engine).

A window holds the steps since the last switch only, so the steps a re-plan has just cured (or a
sync that no longer runs) never decide the next switch.

Invariant: every decision is a pure function of the all-gathered figures (identical on every
rank), the mode in force and the count of calm decisions, so every rank switches at the same step.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from planner.partial_reduce import eligible_stages, generator as pinned_generator
from runtime.control.protocol import Controller, PlanChange
from whalelike.config import GROUP_GENERATORS
from whalelike.errors import SpecError

log = logging.getLogger(__name__)

MODES = ("auto", "partial")


@dataclass(frozen=True)
class Choice:
    """What :func:`choose` decided: ``mode`` (``"exact"`` or ``"partial"``), why, the ranks slow in
    each of their latest ``persist_steps`` steps (``persistent``) and the share of the window's
    steps that had a slow rank (``slow_fraction``)."""

    mode: str
    reason: str
    persistent: tuple[int, ...] = ()
    slow_fraction: float = 0.0


@dataclass(frozen=True)
class PolicyEvent:
    """One switch: at ``step`` (in force from the next), ``from_mode`` -> ``to_mode``, why, its cost."""

    step: int
    from_mode: str
    to_mode: str
    reason: str
    cost_ms: float

    def line(self) -> str:
        kind = "APPROXIMATE (P-Reduce)" if self.to_mode == "partial" else "exact"
        return (f"step {self.step}: sync {self.from_mode} -> {self.to_mode} ({kind}, {self.cost_ms:.1f} ms): "
                f"{self.reason}")


def slow_steps(times: Sequence[Sequence[float]], slow_factor: float) -> list[list[bool]]:
    """``slow[k][r]``: rank ``r``'s compute time at step ``k`` of the window exceeds ``slow_factor``
    times the median rank's time of that step (a step without a positive median: none is slow)."""
    out = []
    for row in times:
        median = statistics.median(row)
        out.append([median > 0 and t > slow_factor * median for t in row])
    return out


def choose(times: Sequence[Sequence[float]], current: str, calm: int, *, slow_factor: float = 1.5,
           persist_steps: int = 6, transient_fraction: float = 0.1, calm_decisions: int = 3) -> Choice:
    """The rule of the module docstring. ``times[k][r]``: rank ``r``'s compute seconds at step ``k``
    of the window (oldest first); ``current``: the mode in force; ``calm``: calm decisions in a row
    before this one."""
    if current not in ("exact", "partial"):
        raise SpecError(f"sync policy: the mode in force must be 'exact' or 'partial', got {current!r}")
    if not times:
        return Choice(current, "no figures yet")
    slow = slow_steps(times, slow_factor)
    ranks = len(slow[0])
    persistent = tuple(r for r in range(ranks)
                       if len(slow) >= persist_steps and all(row[r] for row in slow[-persist_steps:]))
    fraction = sum(any(row) for row in slow) / len(slow)
    if persistent:
        return Choice("exact", f"rank(s) {list(persistent)} slower than {slow_factor:g}x the median for their last "
                      f"{persist_steps} steps: a lasting slowdown, which an exact re-plan removes",
                      persistent, fraction)
    if fraction >= transient_fraction:
        return Choice("partial", f"{fraction:.0%} of the last {len(slow)} steps had a rank slower than "
                      f"{slow_factor:g}x the median, none for {persist_steps} steps in a row: short-lived "
                      "slowdowns, which P-Reduce tolerates", (), fraction)
    if current == "partial" and calm + 1 >= calm_decisions:
        return Choice("exact", f"no slow step for {calm_decisions} decisions: nothing to gain from approximating",
                      (), fraction)
    return Choice(current, "calm" if fraction == 0 else f"{fraction:.0%} of steps slow, below "
                  f"{transient_fraction:.0%}", (), fraction)


def _check(name: str, value, kind, minimum, meaning: str, maximum=None) -> None:
    ok = (isinstance(value, kind) and not isinstance(value, bool)
          and (not isinstance(value, float) or math.isfinite(value)))
    if not ok or value < minimum or (maximum is not None and value > maximum):
        bound = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
        raise SpecError(f"SyncPolicy({name}=...): {meaning}; it must be {bound}, got {value!r}")


class SyncPolicy(Controller):
    """The policy of the module docstring, a step-boundary controller (:mod:`runtime.control.protocol`,
    name ``"sync_policy"``, order 10), attached to an Engine with :meth:`attach` (every rank).

    ``mode``: ``"auto"`` (choose) or ``"partial"`` (stay on P-Reduce, the exact re-planner inert);
    ``decide_every``, ``partial_every``, ``window``, ``slow_factor``, ``persist_steps``, ``transient_fraction``,
    ``calm_decisions``: the rule's figures; ``generator``, ``group_size``, ``delta_c``: P-Reduce's
    settings when the policy switches a stage to it (None: the plan's, if it runs P-Reduce, else
    ``"smart"``, 2 and 2).
    """

    name = "sync_policy"
    order = 10

    def __init__(self, mode: str = "auto", *, decide_every: int = 2, partial_every: int = 8, window: int = 8,
                 slow_factor: float = 1.5,
                 persist_steps: int = 6, transient_fraction: float = 0.1, calm_decisions: int = 3,
                 generator: Optional[str] = None, group_size: Optional[int] = None, delta_c: Optional[int] = None):
        if mode not in MODES:
            raise SpecError(f"SyncPolicy(mode=...) must be one of {', '.join(MODES)}, got {mode!r}: 'auto' chooses "
                            "between P-Reduce and exact re-planning, 'partial' stays on P-Reduce")
        _check("decide_every", decide_every, int, 1, "steps between decisions under the exact sync")
        _check("partial_every", partial_every, int, 1, "steps between decisions under P-Reduce")
        _check("window", window, int, 1, "steps of history a decision reads")
        _check("persist_steps", persist_steps, int, 1, "slow steps in a row that make a slowdown lasting")
        _check("calm_decisions", calm_decisions, int, 1, "calm decisions before P-Reduce gives way")
        _check("slow_factor", slow_factor, (int, float), 1.0, "how much slower than the median a slow step is")
        _check("transient_fraction", transient_fraction, (int, float), 0.0, "share of steps with a slowdown", 1.0)
        if persist_steps > window:
            raise SpecError(f"SyncPolicy(persist_steps={persist_steps}) exceeds window={window}: a lasting slowdown "
                            "must fit in the window; raise window or lower persist_steps")
        if generator is not None and generator not in GROUP_GENERATORS:
            raise SpecError(f"SyncPolicy(generator=...) must be one of {', '.join(GROUP_GENERATORS)}, "
                            f"got {generator!r}")
        if group_size is not None:
            _check("group_size", group_size, int, 2, "workers per P-Reduce group")
        if delta_c is not None:
            _check("delta_c", delta_c, int, 1, "the smart generator's threshold Δc")
        self.mode, self.decide_every, self.partial_every, self.window = mode, decide_every, partial_every, window
        self.rule = dict(slow_factor=float(slow_factor), persist_steps=persist_steps,
                         transient_fraction=float(transient_fraction), calm_decisions=calm_decisions)
        self.settings = (generator, group_size, delta_c)
        self.history: list[PolicyEvent] = []
        self.choices: list[tuple[int, Choice]] = []
        self.calm = 0
        self._group = None
        self._decided: Optional[tuple] = None
        self._pending: Optional[tuple[object, list[torch.Tensor], int]] = None
        self._since = 0   # the first step of the sync in force: a window never mixes two syncs

    # -- attaching ------------------------------------------------------------------------------------
    def attach(self, engine) -> "SyncPolicy":
        """Run this policy at every step boundary of ``engine`` (a controller,
        :meth:`runtime.engine.Engine.add_controller`; collective: attach on every rank). Creates the
        policy's process group (a collective of the world)."""
        stages = eligible_stages(engine.plan)
        if not stages:
            raise SpecError("SyncPolicy: the plan has no stage P-Reduce can run on (two or more data-parallel "
                            f"workers, no split, ZeRO stage 0; stages {[st.strategy for st in engine.plan.stages]}); "
                            "attach it to a plan with such a replicate stage")
        if engine.clip_grad_norm is not None or engine.scaler is not None:
            raise SpecError("SyncPolicy: runtime.Engine(clip_grad_norm=...) and fp16's loss scaling reduce over every "
                            "rank inside every step, where the smart generator's groups (which may span steps) would "
                            "wait across them, and P-Reduce would gain nothing from ranks held in step; run P-Reduce "
                            "without clipping, in fp32 or bf16")
        self._group = dist.new_group(backend="gloo")
        engine.add_controller(self)
        return self

    def _check_pins(self, graphs) -> None:
        """``mode="auto"`` switches stages between syncs, which a region's own ``sync=`` forbids."""
        pinned = sorted({t.index for t in graphs if getattr(t.strategy, "sync", None) is not None}) \
            if graphs is not None else []
        if pinned:
            raise SpecError(f"SyncPolicy(mode='auto'): TaskGraph(s) {pinned} fix their sync (replicate(n, sync=...)), "
                            "so the policy cannot switch them; drop sync= from the regions (Config.dp_sync says "
                            "where to start) or use SyncPolicy(mode='partial')")

    @staticmethod
    def current(plan) -> str:
        """``"partial"`` when some stage of ``plan`` runs P-Reduce, else ``"exact"``."""
        return "partial" if any(st.replica_sync == "partial" for st in plan.stages) else "exact"

    # -- the controller protocol ----------------------------------------------------------------------
    def suppresses(self, plan) -> frozenset[str]:
        """While the plan runs P-Reduce the exact re-planner is inert: its exchanges, one global
        all-reduce each, would synchronise every step, the very thing P-Reduce avoids."""
        return frozenset({"rebalance"}) if self.current(plan) == "partial" else frozenset()

    def react(self, view) -> Optional[PlanChange]:
        if self.mode == "partial":
            return None
        current = self.current(view.plan)
        if (view.step + 1) % (self.decide_every if current == "exact" else self.partial_every):
            return None
        self._check_pins(view.graphs)
        if current == "exact":   # the ranks are in step (DDP): gather this window now
            self._collect()
            self._launch(view)
        figures = self._collect()
        if current == "partial":   # read at the next decision: no rank waits here for one behind
            self._launch(view)
        if figures is None:
            return None
        times, flops = figures
        choice = choose(times, current, self.calm, **self.rule)
        self.choices.append((view.step, choice))
        self.calm = self.calm + 1 if choice.slow_fraction == 0 else 0
        if choice.mode == current:
            return None
        self._decided = (time.perf_counter(), current, choice)
        if choice.mode == "partial":
            return PlanChange("apply", self._partial_plan(view.plan), choice.reason, exact=False)
        return PlanChange("apply", self._exact_plan(view, _speeds(times, flops, self.rule["persist_steps"])),
                          choice.reason)

    def applied(self, view, change: PlanChange, report) -> None:
        start, current, choice = self._decided
        self.calm = 0
        self._collect()   # a window launched under the old sync is not read
        self._since = view.step + 1
        event = PolicyEvent(view.step, current, choice.mode, choice.reason, (time.perf_counter() - start) * 1e3)
        self.history.append(event)
        if view.runtime.rank == 0:
            (log.warning if choice.mode == "partial" else log.info)("sync policy %s", event.line())

    def changed(self, view, change: PlanChange) -> None:
        if change.kind == "leave":
            log.warning("rank %d: the sync policy's process group was made for the old world; the policy cannot "
                        "gather its figures in the new one (attach a new SyncPolicy after a leave)", view.runtime.rank)

    def _launch(self, view) -> None:
        """Start the all-gather of this rank's last ``window`` steps (compute seconds, FLOPs), on the
        policy's process group."""
        recent = [st for st in view.history[-self.window:] if st.step >= self._since]   # none from before a switch
        mine = torch.zeros(2, self.window, dtype=torch.float64)
        if recent:
            mine[0, -len(recent):] = torch.tensor([s.padded_s for s in recent], dtype=torch.float64)
            mine[1, -len(recent):] = torch.tensor([s.flops for s in recent], dtype=torch.float64)
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        work = dist.all_gather(gathered, mine, group=self._group, async_op=True)
        self._pending = (work, gathered, len(recent))

    def _collect(self) -> Optional[tuple[list[list[float]], list[list[float]]]]:
        """The figures of the all-gather launched at the last decision step (``times[k][r]``,
        ``flops[k][r]``), or None before the first."""
        if self._pending is None:
            return None
        work, gathered, steps = self._pending
        self._pending = None
        work.wait()
        if steps == 0:
            return None
        stacked = torch.stack(gathered)[:, :, -steps:]   # rank, (time, flops), step
        return stacked[:, 0].T.tolist(), stacked[:, 1].T.tolist()

    # -- switching ------------------------------------------------------------------------------------
    def _partial_plan(self, plan):
        generator, size, delta = self.settings
        eligible = eligible_stages(plan)
        stages = []
        for st in plan.stages:
            n = len({w.rank for w in plan.stage_workers(st.index) if w.tp_index == 0})
            if st.index in eligible:   # P-Reduce's rules are the planner's (planner.partial_reduce)
                chosen = pinned_generator(generator or st.partial_generator, len(plan.stages), plan.precision)
                st = dataclasses.replace(st, replica_sync="partial", partial_generator=chosen,
                                         partial_group_size=min(size or st.partial_group_size, n),
                                         partial_delta_c=delta or st.partial_delta_c)
            stages.append(st)
        return dataclasses.replace(plan, stages=stages)

    def _exact_plan(self, view, speeds: list[float]):
        from planner.balance.replan import rebalance
        from planner.errors import PlanError

        try:
            new = rebalance(view.plan, view.graphs, view.runtime.cluster, speeds)
        except PlanError as e:   # the measured speeds fit no other shares: switch the sync alone
            log.warning("sync policy: no plan for the measured speeds (%s); switching to exact sync on the same "
                        "shares", e)
            new = view.plan
        return dataclasses.replace(new, stages=[dataclasses.replace(st, replica_sync="ddp")
                                               if st.replica_sync == "partial" else st for st in new.stages])


def _speeds(times: list[list[float]], flops: list[list[float]], last: int) -> list[float]:
    """Each rank's speed (FLOP/s) over the window's last ``last`` steps: the median of its per-step
    FLOPs over seconds, the measure the straggler monitor takes."""
    rows = list(zip(times, flops))[-last:]
    ranks = len(times[0])
    out = []
    for r in range(ranks):
        values = [f[r] / t[r] for t, f in rows if t[r] > 0 and f[r] > 0]
        out.append(statistics.median(values) if values else math.nan)
    if any(math.isnan(v) for v in out):
        raise SpecError(f"sync policy: ranks {[r for r, v in enumerate(out) if math.isnan(v)]} measured no compute "
                        "(FLOPs and compute time > 0) in the window, so no exact re-plan can be made for them; run "
                        "with emulated devices or a GPU clock (runtime.emulation.compute)")
    return out

