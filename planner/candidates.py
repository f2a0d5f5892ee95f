"""The plans :func:`planner.plan` knows, and the rule that returns the fastest of them that fits.

Why: each decision the planner makes (the placement, the stage layers, the shares, the ZeRO stages)
follows a model of the step, and a model can miss what the simulator prices. Issue 30 (item 4): a
ResNet of three ``replicate`` regions with one micro-batch got stage layers that shaved its slowest
stage by moving a layer from two fast devices onto a slow one; the stages run one after another with
one micro-batch, and the simulator priced the plan at 0.81x the capacity-blind one. The partitioner's
objective was fixed (:mod:`planner.partition.pricing`), but no decision rule is trusted alone:
:func:`planner.plan` prices every plan it made with the simulator and keeps the fastest.

Invariant: the plan returned is predicted (:func:`planner.assemble.predict`) no slower than any
candidate it priced that fits its devices' memory. ``Plan.candidates`` lists them with their predicted
steps and whether they fit, ``Plan.chosen`` names the one kept, and
:func:`planner.plan_checks.check_alone` checks both on every plan it reads.

The candidates, in order:

* ``"aware"``: the hardware-aware decisions on the fastest placement
  (:func:`planner.devices.placement_search.best_aware_plan`: every placement rule, then device swaps),
  with the devices of its automatic stages searched on unequal devices (:func:`count_search`) and, when
  the asked micro-batch count could not be kept, the fastest of that count and a few larger ones
  (:func:`fastest_count`);
* ``"naive"``: the capacity-blind decisions on Whale's placement (equal shares, shards and layer
  counts: :func:`planner.decisions.naive_decisions`), the baseline of the predicted speed-up. It may
  exceed a device's memory; then it is listed with ``fits`` false and never kept;
* ``"folded"`` (only with ``Config.fold_stages``): fewer stages. Adjacent plain ``replicate`` regions
  of automatic device count and equal options (:func:`planner.partition.stage_layers.foldable_runs`)
  run as one data-parallel stage on the union of their devices
  (:func:`planner.devices.placement.fold_layout`, ``StagePlan.folded``); every way of folding each run
  (:func:`fold_patterns`: all of them up to :data:`MAX_FOLDS`, past it each run whole, all runs whole
  and each adjacent pair) is planned like the aware plan, every placement and swaps, and the fastest
  is the candidate (``CandidatePlan.stages``: its stages' TaskGraphs). Off by default: regions usually
  mean a pipeline on purpose, and each fold is a plan to make and simulate. The runtime runs a folded
  plan as it runs any (its stages' layers are what it splits the model by; one stage is data
  parallel), and a re-plan keeps the fold (:func:`planner.balance.replan.plan_layout`). Also without
  ``fold_stages``, when the partitioner's best split left a stage nothing to compute (it then keeps one
  of that stage's layers on it, ``StagePlan.kept_work``): that stage folded into its neighbour, on the
  union of their devices or with the devices dealt out again by work (:func:`idle_fold_candidate`).

A candidate with a stage that computes nothing (:func:`idle_stages`, ``CandidatePlan.idle_stages``) is
kept only when no other fits: its devices would hold a stage and do no work (issue 36).

A candidate fits when every worker's estimated peak is within its device's memory (the memory model's
rule, :func:`planner.devices.memory.fits`, which :func:`planner.plan_checks.check_cluster` applies to a
plan file). A later candidate replaces an earlier one only when it is faster by more than a relative
``1e-9`` (the aware plan wins ties, and an equal naive plan keeps the aware plan's fields).
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
from typing import Callable, NamedTuple

from whalelike.cluster import Cluster
from whalelike.config import AUTO_SCHEDULES, Config
from whalelike.graphs.taskgraph import TaskGraphs

from planner.devices.memory import fits
from planner.devices.cost_model import device_tflops
from planner.devices.placement import build_layout, fold_layout, stage_shapes
from planner.shares.batch_fit import divisors, micro_batch_counts, most_groups
from planner.devices.placement_search import best_aware_plan
from planner.errors import PlanError
from planner.partition.stage_layers import computes, foldable_runs
from planner.plan import CandidatePlan, Plan, Prediction
from planner.plan_checks import stage_regions
from planner.summary import CANDIDATE_LABELS

log = logging.getLogger(__name__)

MAX_COUNT_ROUNDS = 6   # device moves between automatic stages kept at most (count_search)
# a move of a device between stages is kept when the step it predicts is this much shorter: the predictions
# miss by several percent (issue 33), and a plan reshaped for less is a gain the model cannot promise
MOVE_GAIN = 0.05
MAX_MORE_COUNTS = 4   # larger micro-batch counts priced when no split fits the asked one (fastest_count)
# other device counts per automatic stage tried, nearest the split by work first, when that split fits no
# placement (fitting_counts): each a layout planned in full, and a count that does not fit fails fast
MAX_FIT_TRIALS = 64
TIE = 1e-9   # relative: a candidate must be faster than this to replace an earlier one (plan_checks keeps it too)
MAX_FOLDS = 16   # fold patterns planned in full at most (each one plan per placement, then swaps)

class Priced(NamedTuple):
    """A candidate: its name (``CandidatePlan.name``) and the plan, its ``prediction`` filled in."""

    name: str
    plan: Plan


@contextlib.contextmanager
def trials():
    """The planner's warnings while it plans layouts it only tries (a count search's moves, a fold, a
    micro-batch count) are at most errors: each trial's decisions (a stage recomputing to fit, more
    micro-batches) say nothing of the plan kept, whose summary states its own."""
    logger = logging.getLogger("planner")
    level = logger.level
    logger.setLevel(max(level, logging.ERROR))
    try:
        yield
    finally:
        logger.setLevel(level)


def idle_stages(plan: Plan, graphs: TaskGraphs) -> list[int]:
    """The stages of ``plan`` with nothing to compute: no FLOPs in their layers while the regions they
    stand for have some (the partitioner moved every compute layer to a neighbour and left the glue,
    a final norm, issue 36). Such a stage holds devices that do no work."""
    return [st.index for st, tgs in zip(plan.stages, stage_regions(plan))
            if not any(computes(graphs, i) for i in st.layers)
            and any(computes(graphs, i) for t in tgs for i in graphs[t].layers)]


def idle_folds(plan: Plan, graphs: TaskGraphs) -> list[list[int]]:
    """The stages of ``plan`` (runs of TaskGraph indices) with each of its :func:`idle_stages`, and each
    stage the partitioner kept a layer on so that it computes (``StagePlan.kept_work``), folded into
    the neighbour that holds most of the compute layers it was given (the one the partitioner moved
    them to); empty when there is none."""
    idle = sorted(set(idle_stages(plan, graphs)) | {st.index for st in plan.stages if st.kept_work is not None})
    if not idle:
        return []
    runs = [list(r) for r in stage_regions(plan)]
    home = [{i for t in r for i in graphs[t].layers if computes(graphs, i)} for r in runs]
    into = {}
    for s in idle:
        neighbours = [n for n in (s - 1, s + 1) if 0 <= n < len(runs) and n not in idle]
        if neighbours:
            into[s] = max(neighbours, key=lambda n: (len(home[s] & set(plan.stages[n].layers)), -n))
    merged: list[list[int]] = []
    for s, run in enumerate(runs):
        if s and (into.get(s) == s - 1 or into.get(s - 1) == s):
            merged[-1].extend(run)
        else:
            merged.append(list(run))
    return merged


def plan_fits(plan: Plan) -> bool:
    """Whether every worker's estimated peak memory is within its device's (``Worker.capacity_gib``)."""
    return all(fits(w.memory_gib, w.capacity_gib) for w in plan.workers)


def keep_fastest(candidates: list[Priced], naive_prediction: Prediction, graphs: TaskGraphs | None = None) -> Plan:
    """The fastest candidate that fits (the first one, the aware plan, when none is faster by more
    than :data:`TIE`, or when none fits: the caller's validation then says why), with
    ``naive_prediction``, ``chosen`` and every candidate recorded in ``candidates``. Given ``graphs``,
    a candidate with a stage that has nothing to compute (:func:`idle_stages`, recorded in
    ``CandidatePlan.idle_stages``) is kept only when no candidate without one fits: its devices
    would hold a stage and do no work."""
    fitting = [plan_fits(c.plan) for c in candidates]
    idle = [idle_stages(c.plan, graphs) if graphs is not None else [] for c in candidates]
    if any(f and not i for f, i in zip(fitting, idle)):
        eligible = [f and not i for f, i in zip(fitting, idle)]
    else:
        eligible = fitting
    best = 0
    for i, c in enumerate(candidates):
        if eligible[i] and (not eligible[best] or
                            c.plan.prediction.step_time_ms < candidates[best].plan.prediction.step_time_ms * (1 - TIE)):
            best = i
    kept = candidates[best]
    if best:
        aware = candidates[0].plan.prediction.step_time_ms
        log.info("the %s are predicted faster than the %s (%.2f ms against %.2f ms per step): keeping them",
                    CANDIDATE_LABELS[kept.name], CANDIDATE_LABELS[candidates[0].name], kept.plan.prediction.step_time_ms,
                    aware)
    if idle[best]:
        log.warning("stage(s) %s of the plan kept have nothing to compute (the partitioner moved their layers to a "
                    "neighbour) and no plan that folds them fits: their devices hold glue layers only",
                    ", ".join(map(str, idle[best])))
    record = [CandidatePlan(c.name, c.plan.prediction.step_time_ms, ok,
                            stage_regions(c.plan) if any(st.folded for st in c.plan.stages) else [], own_idle)
              for c, ok, own_idle in zip(candidates, fitting, idle)]
    return dataclasses.replace(kept.plan, naive_prediction=naive_prediction, chosen=kept.name, candidates=record)


def fastest_schedule(plan_with: Callable[[Config], Plan], config: Config) -> Plan:
    """``Config.schedule`` ``"auto"``: the plan of each schedule of :data:`whalelike.config.AUTO_SCHEDULES`
    (1F1B and ZB-H1), each made in full by ``plan_with`` (a :func:`planner.plan` of that schedule: its
    own stage layers, shares and memory fit, ZB-H1 holding more micro-batches on later stages), and
    the fastest predicted kept, with every one's step in ``Plan.schedule_steps_ms``. A schedule whose
    plan cannot be made (it does not fit) is left out; when none can be, the first one's error is
    raised. 1F1B, listed first, wins ties (it holds no more memory than ZB-H1 anywhere)."""
    plans: dict[str, Plan] = {}
    errors: list[PlanError] = []
    for schedule in AUTO_SCHEDULES:
        try:
            plans[schedule] = plan_with(dataclasses.replace(config, schedule=schedule))
        except PlanError as e:
            errors.append(e)
    if not plans:
        raise errors[0]
    steps = {schedule: p.prediction.step_time_ms for schedule, p in plans.items()}
    best = next(iter(plans))
    for schedule, ms in steps.items():
        if ms < steps[best] * (1 - TIE):
            best = schedule
    log.info("schedule auto: predicted %s; keeping %s", ", ".join(f"{s} {ms:.2f} ms" for s, ms in steps.items()), best)
    return dataclasses.replace(plans[best], schedule_steps_ms=steps)


def fold_patterns(graphs: TaskGraphs) -> list[list[list[int]]]:
    """The ways to fold ``graphs``' foldable runs (:func:`~planner.partition.stage_layers.foldable_runs`),
    each as runs of adjacent TaskGraph indices covering all of them (one stage each), the unfolded
    layout left out: every combination of every run's cuts into consecutive groups while there are at
    most :data:`MAX_FOLDS`; past that, each run folded whole alone, all runs whole, and each adjacent
    pair alone."""
    runs = foldable_runs(graphs)
    if not runs:
        return []

    def pattern(groups_of_run: dict[int, list[list[int]]]) -> list[list[int]]:
        out, t = [], 0
        while t < len(graphs):
            run = next((r for r in runs if r[0] == t), None)
            if run is not None and run[0] in groups_of_run:
                out.extend(groups_of_run[run[0]])
                t = run[-1] + 1
            else:
                out.append([t])
                t += 1
        return out

    def cuts(run: list[int]) -> list[list[list[int]]]:
        """Every way to cut ``run`` into consecutive groups."""
        out = []
        for mask in itertools.product((False, True), repeat=len(run) - 1):
            groups, current = [], [run[0]]
            for t, cut in zip(run[1:], mask):
                if cut:
                    groups.append(current)
                    current = []
                current.append(t)
            out.append(groups + [current])
        return out

    count = 1
    for run in runs:
        count *= 2 ** (len(run) - 1)
    if count - 1 <= MAX_FOLDS:
        ways = [pattern({run[0]: way for run, way in zip(runs, choice)})
                for choice in itertools.product(*(cuts(run) for run in runs))]
    else:
        whole = {run[0]: [run] for run in runs}
        ways = [pattern({run[0]: [run]}) for run in runs] + [pattern(whole)]
        for run in runs:
            for i in range(len(run) - 1):
                pair = [[t] for t in run[:i]] + [[run[i], run[i + 1]]] + [[t] for t in run[i + 2:]]
                ways.append(pattern({run[0]: pair}))
    unfolded = [[t] for t in range(len(graphs))]
    unique = []
    for way in ways:
        if way != unfolded and way not in unique:
            unique.append(way)
    return unique


def folded_candidate(graphs: TaskGraphs, cluster: Cluster, config: Config) -> Priced | None:
    """The fastest predicted plan of :func:`fold_patterns`' layouts, each planned as the aware plan is
    (:func:`~planner.devices.placement_search.best_aware_plan` with the fold), with its prediction;
    None when nothing folds or no fold fits."""
    best = None
    for way in fold_patterns(graphs):
        try:
            prediction, plan = best_aware_plan(graphs, cluster, config, fold=way)
        except PlanError as e:
            log.debug("folding TaskGraphs %s: %s", way, e)
            continue
        if best is None or prediction.step_time_ms < best.plan.prediction.step_time_ms * (1 - TIE):
            best = Priced("folded", dataclasses.replace(plan, prediction=prediction))
    return best


def idle_fold_candidate(graphs: TaskGraphs, cluster: Cluster, config: Config, plan: Plan) -> Priced | None:
    """When ``plan`` has stages with nothing to compute (:func:`idle_stages`): the fastest predicted of
    the plans that fold each into its neighbour (:func:`idle_folds`), planned as the aware plan is
    (every placement, swaps), in two ways: the folded stage on the union of both stages' devices
    (:func:`~planner.devices.placement.fold_layout`: a data-parallel group that may mix device kinds),
    or the devices dealt out again over the fewer stages by their work
    (:func:`~planner.devices.placement.regrouped_shapes`: a ``split`` stage that bottlenecks takes the
    idle stage's devices). None when no stage is idle or no fold can be planned."""
    way = idle_folds(plan, graphs)
    foldable = [set(run) for run in foldable_runs(graphs)]
    # only regions that may fold (plain replicate, automatic counts, equal options; plan_checks holds
    # plans to it): a stage of fixed counts keeps the layer the partitioner left on it
    if not way or any(len(run) > 1 and not any(set(run) <= f for f in foldable) for run in way):
        return None
    best = None
    for how in ("fold", "shared"):
        try:
            with trials():
                fed = _feeding(graphs, cluster, config, **{how: way})
                prediction, folded = best_aware_plan(graphs, cluster, fed, **{how: way})
        except PlanError as e:
            log.debug("folding the idle stage(s) of TaskGraphs %s (%s): %s", way, how, e)
            continue
        folded = dataclasses.replace(folded, prediction=prediction)
        best = faster(best, Priced("folded", folded))
    return best


def _feeding(graphs: TaskGraphs, cluster: Cluster, config: Config, fold: list[list[int]] | None = None,
             shared: list[list[int]] | None = None) -> Config:
    """``config`` with at most as many micro-batches as a fold's stages can feed: a folded stage has
    the data-parallel groups of both, and each needs a sample of every micro-batch
    (:func:`~planner.shares.batch_fit.check_batch`). The most micro-batches up to the ones asked that
    divide the global batch and give every group a sample; ``config`` as it is when those fit."""
    layout = build_layout(graphs, cluster, precision=config.precision, shared=shared)
    if fold is not None:
        layout = fold_layout(layout, fold)
    gbs, groups = config.global_batch_size, most_groups(layout)
    if gbs // config.num_micro_batch >= groups or gbs < groups:
        return config
    fitting = divisors(gbs, 1, min(config.num_micro_batch, gbs // groups))
    return dataclasses.replace(config, num_micro_batch=fitting[-1]) if fitting else config


def faster(one: Priced | None, other: Priced | None) -> Priced | None:
    """The one of two candidates of the same name that fits and is predicted faster (either may be None)."""
    if one is None or other is None:
        return one or other
    return min((one, other), key=lambda c: (not plan_fits(c.plan), c.plan.prediction.step_time_ms))



def aware_plan_searched(graphs: TaskGraphs, cluster: Cluster, config: Config) -> Plan:
    """The fastest hardware-aware plan (:func:`~planner.devices.placement_search.best_aware_plan`, its
    prediction filled in) with the devices of its automatic stages searched (:func:`count_search`); when
    the split by work fits no placement, from the nearest device counts that do (:func:`fitting_counts`)."""
    try:
        prediction, aware = best_aware_plan(graphs, cluster, config)
        counts = None
    except PlanError as e:
        found = fitting_counts(graphs, cluster, config, e)
        if found is None:
            raise
        counts, aware = found
        prediction = aware.prediction
    return count_search(graphs, cluster, config, dataclasses.replace(aware, prediction=prediction), counts=counts)


def _automatic_counts(graphs: TaskGraphs, cluster: Cluster) -> dict[int, int] | None:
    """The split by work's device count of each automatic stage (TaskGraph index -> count), or None when
    the counts cannot move: fewer than two automatic stages, several pipeline replicas, or devices the
    stages do not all take."""
    auto = [tg.index for tg in graphs if tg.strategy.fixed_degrees is None]
    if len(auto) < 2:
        return None
    shapes, replicas = stage_shapes(graphs, len(cluster.devices))
    counts = {sh.taskgraph: sh.devices for sh in shapes if sh.taskgraph in auto}
    fixed = sum(sh.devices for sh in shapes if sh.taskgraph not in auto)
    if replicas != 1 or len(counts) != len(auto) or fixed + sum(counts.values()) != len(cluster.devices):
        return None
    return counts


def nearest_counts(split: dict[int, int]) -> list[dict[int, int]]:
    """Every other way of dealing the split's devices to its stages (each at least one), nearest the split
    first (fewest devices moved), at most :data:`MAX_FIT_TRIALS` of them."""
    stages, total = sorted(split), sum(split.values())
    ways = []
    for cuts in itertools.combinations(range(1, total), len(stages) - 1):
        sizes = [b - a for a, b in zip((0,) + cuts, cuts + (total,))]
        moved = sum(abs(n - split[t]) for t, n in zip(stages, sizes))
        if moved:
            ways.append((moved, tuple(sizes)))
    ways.sort()
    return [dict(zip(stages, sizes)) for _, sizes in ways[:MAX_FIT_TRIALS]]


def fitting_counts(graphs: TaskGraphs, cluster: Cluster, config: Config,
                   error: PlanError) -> tuple[dict[int, int], Plan] | None:
    """When the split by work fits no placement (``error``): the nearest device counts per automatic stage
    that do (:func:`nearest_counts`), and their plan (its prediction filled in); None if none does.

    Why: the split by work gives each stage devices in proportion to its FLOPs, blind to memory. On a
    cluster of large and small devices a stage of half the layers dealt six devices, four large and
    two small, fits where the same half on five small ones does not (issue 36: 7B Llama on four A100s
    and eight T4s); moving devices toward the stage that is short fits it. The counts found are where
    :func:`count_search` starts."""
    split = _automatic_counts(graphs, cluster)
    if split is None:
        return None
    for trial in nearest_counts(split):
        plan = _plan_on_counts(graphs, cluster, config, trial)
        if plan is not None and plan_fits(plan):
            log.info("the split by work (devices per automatic stage %s) fits no placement (%s); %s fits",
                     split, str(error).split(";")[0], trial)
            return trial, plan
    return None


def _plan_on_counts(graphs: TaskGraphs, cluster: Cluster, config: Config, counts: dict[int, int]) -> Plan | None:
    """The best aware plan with ``counts`` devices per automatic stage, its prediction filled in; None
    (logged at debug) when no placement of those counts plans."""
    try:
        with trials():
            prediction, plan = best_aware_plan(graphs, cluster, config, counts=counts)
    except PlanError as e:
        log.debug("devices per stage %s: %s", counts, e)
        return None
    return dataclasses.replace(plan, prediction=prediction)


def fastest_count(graphs: TaskGraphs, cluster: Cluster, config: Config, aware: Plan) -> Plan:
    """The aware plan at the micro-batch count that is predicted fastest, when the asked count could not
    be kept (issue 36: no split of the layers fits micro-batches that large, or the stages' memory asked
    for more of them): the counts up to :data:`MAX_MORE_COUNTS` past the one the planner reached, each
    planned in full (cut points, shares, ZeRO stage and recompute for that count) and simulated; fewer,
    larger micro-batches run faster per sample and more of them fill the pipeline better, and only the
    simulator weighs the two. ``aware`` itself when the asked count was kept. Each count's plan is
    :func:`aware_plan_searched`'s, the count reached included (asked outright, every placement plans
    for it)."""
    if aware.num_micro_batch == config.num_micro_batch:
        return aware
    layout = build_layout(graphs, cluster, precision=config.precision)
    # the count reached too, asked outright: every placement then plans for it (at the asked count some
    # placement may have fit and another not)
    larger = micro_batch_counts(config.global_batch_size, aware.num_micro_batch, layout)[:MAX_MORE_COUNTS + 1]
    best = aware
    for count in larger:
        try:
            with trials():
                plan = aware_plan_searched(graphs, cluster, dataclasses.replace(config, num_micro_batch=count))
        except PlanError as e:
            log.debug("%d micro-batches: %s", count, e)
            continue
        if plan_fits(plan) and plan.prediction.step_time_ms < best.prediction.step_time_ms * (1 - TIE):
            best = plan
    if best is not aware:
        log.info("%d micro-batches are predicted fastest (%.2f ms against %.2f ms at %d, the fewest that fit)",
                 best.num_micro_batch, best.prediction.step_time_ms, aware.prediction.step_time_ms,
                 aware.num_micro_batch)
    return best


def count_search(graphs: TaskGraphs, cluster: Cluster, config: Config, aware: Plan,
                 counts: dict[int, int] | None = None) -> Plan:
    """The aware plan with the devices of the automatic stages searched (issue 36): the placement splits
    them by work alone, a device count per stage, but devices of unequal speed are not equal shares
    (a fast stage needs fewer; a slow device in a stage of fast ones gets a whole sample it takes long
    over). From the split by work (or ``counts``, the ones ``aware`` was planned on:
    :func:`fitting_counts`), one device at a time moves from one automatic stage to another
    while the simulator predicts the step shorter by :data:`MOVE_GAIN` at least, each layout planned
    in full (every placement, swaps), at most :data:`MAX_COUNT_ROUNDS` moves, each keeping the plan's
    micro-batch count. Only on a cluster of devices of unequal speed at the plan's precision with two
    or more automatic stages and one pipeline (on equal devices the split by work is the split by
    time); ``aware`` when no move helps."""
    split = _automatic_counts(graphs, cluster)
    if split is None or len({device_tflops(d, config.precision) for d in cluster.devices}) < 2:
        return aware
    auto = sorted(split)
    counts = dict(counts or split)
    config = dataclasses.replace(config, num_micro_batch=aware.num_micro_batch)
    best, start = aware, dict(counts)
    for _ in range(MAX_COUNT_ROUNDS):
        found = None
        for a, b in itertools.permutations(auto, 2):
            if counts[a] <= 1:
                continue
            trial = {**counts, a: counts[a] - 1, b: counts[b] + 1}
            plan = _plan_on_counts(graphs, cluster, config, trial)
            if plan is None:
                continue
            # the micro-batch count stays the plan's: a layout that fits only with more of them changes what
            # was asked (fastest_count searches counts, and only when the asked one cannot be kept)
            bar = (found[0] if found else best).prediction.step_time_ms * (1 - MOVE_GAIN)
            if plan_fits(plan) and plan.num_micro_batch == aware.num_micro_batch and plan.prediction.step_time_ms < bar:
                found = (plan, trial)
        if found is None:
            break
        best, counts = found
    if best is not aware:
        log.info("devices per automatic stage %s (from %s) are predicted faster: %.2f ms against %.2f ms",
                 counts, start, best.prediction.step_time_ms, aware.prediction.step_time_ms)
    return best
