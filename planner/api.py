"""``planner.plan()``: the hardware-aware plan, and ``planner.naive_plan()``, the capacity-blind one.

The planner is a chain of pure steps (Whale's parallel planner, with Poplar's batch rules); this
module only calls them in order, each decision lives with its owner:

1. virtual devices: each TaskGraph becomes a pipeline stage on a group of devices, larger-memory
   devices on early stages (or the fastest devices on the stages with the most work per device:
   both are tried), replicated pipelines when the cluster has room (:mod:`planner.devices.placement`);
   afterwards two stages may exchange devices when the simulator predicts a gain
   (:mod:`planner.devices.placement_search`);
2. stage layers: by default each stage runs its own TaskGraph's layers; between two adjacent
   stages that are both plain ``replicate`` the planner may move boundary layers so that the
   slowest stage is as fast as possible (the pipeline partitioner, :mod:`planner.partition.solve`).
   Stages under ``split`` keep their layers: their operators were chosen for sharding;
3. shard layout of every ``split`` stage, proportional to speed within memory
   (:mod:`planner.shares.stage_shards`, :mod:`planner.shares.shard_sizes`);
4. batch shares: every micro-batch is split over the pipeline replicas by throughput, then inside
   each stage over its data-parallel groups by speed, with Whale's memory balancing; when a
   micro-batch still does not fit, more micro-batches or Poplar's per-device gradient
   accumulation, at most ``MAX_MICRO_BATCHES`` per step (:mod:`planner.shares.batch_fit`);
5. assembly and prediction (:mod:`planner.assemble`, :mod:`planner.schedule.simulator`);
6. the fastest plan it knows that fits: the hardware-aware plan, or the naive one when the simulator
   prices that faster, or with ``Config.fold_stages`` the best layout with adjacent replicate regions
   folded into fewer stages (:mod:`planner.candidates`; ``Plan.chosen`` and ``Plan.candidates`` say
   which and what each was predicted to take); under ``Config.schedule`` ``"auto"`` the whole chain
   runs once per schedule (1F1B, ZB-H1) and the faster is kept (``Plan.schedule_steps_ms``).

Steps 2 to 4 on one layout are :func:`planner.decisions.aware_decisions`. The naive plan
(:func:`planner.decisions.naive_decisions`) uses the same devices with equal shares, equal shards
and equal layer counts per movable stage: what a capacity-blind system would do, as the baseline of
the predicted speed-up. When it comes out the same as the hardware-aware plan (every field the
simulator reads equal: one device kind, even shapes), its prediction is the aware plan's rather than
a second simulation of the same step (a third of ``plan()``'s time at 1024 devices).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Optional

from whalelike.cluster import Cluster
from whalelike.config import AUTO_SCHEDULE, AUTO_SCHEDULES, Config
from whalelike.graphs.capture import with_autocast
from whalelike.graphs.taskgraph import TaskGraphs

from planner.assemble import build_plan, predict, with_predictions
from planner.balance.replan import repriced_plan
from planner.candidates import (
    Priced, aware_plan_searched, faster, fastest_count, fastest_schedule, fold_patterns, folded_candidate, idle_fold_candidate,
    keep_fastest, plan_fits,
)
from planner.decisions import check_trainable, naive_decisions
from planner.devices.memory import with_reserve
from planner.devices.measured_speeds import ROUNDS, measured_cluster, sizes_signature
from planner.devices.placement import build_layout, shared_device_groups
from planner.devices.profile import Profile
from planner.devices.placement_search import best_aware_plan
from planner.plan import Plan, PlanError
from planner.plan_checks import check_precision
from planner.shares.batch_fit import check_batch
from planner.shares.batchnorm_statistics import log_batchnorm_warnings

log = logging.getLogger(__name__)


def plan(graphs: TaskGraphs, cluster: Cluster, config: Config, profile: Optional[Profile] = None) -> Plan:
    """The hardware-aware plan of ``graphs`` on ``cluster`` under ``config``.

    ``profile``: the cluster measured on this model at ``config.precision`` (``whalelike profile``):
    device speeds and links come from it instead of the spec sheet
    (:mod:`planner.devices.measured_speeds`; the plan's ``speeds`` says which). A profile of another
    model, cluster or precision is a :class:`~planner.devices.profile.ProfileError`.

    Raises :class:`~planner.plan.PlanError` for requests the cluster cannot satisfy (a precision
    some device cannot run, too many devices, batch too small or indivisible, memory infeasible),
    naming what would fit.

    ``config.schedule`` ``"auto"``: the plans of 1F1B and ZB-H1, the fastest predicted kept
    (:func:`planner.candidates.fastest_schedule`, ``Plan.schedule_steps_ms``).
    """
    if config.schedule == AUTO_SCHEDULE:
        return fastest_schedule(lambda asked: plan(graphs, cluster, asked, profile), config)
    check_trainable(graphs)
    check_precision(cluster, config.precision)
    if profile is not None:
        profile.validate(graphs=graphs, cluster=cluster)
        profile.check_precision(config.precision)
    with reserve_named(config):
        return _plan(graphs, with_reserve(cluster, config.memory_reserve), config, profile)


def _plan(graphs: TaskGraphs, cluster: Cluster, config: Config, profile: Optional[Profile]) -> Plan:
    """:func:`plan` on ``cluster``, the view with the memory reserve set aside."""
    graphs = _for_precision(graphs, config)
    shared = shared_device_groups(graphs, len(cluster.devices))
    if shared:
        if profile is not None:
            raise PlanError(f"the regions ask {graphs.devices_asked} devices and the cluster has {len(cluster.devices)}: "
                            "a profile prices the regions as asked; plan without --profile on this cluster, or on "
                            "one with the devices the regions ask")
        result = _shared_plan(graphs, cluster, config, shared)
        result.validate(graphs=graphs, cluster=cluster)
        log.info("planned %d workers: predicted %.2f ms per step (naive %.2f ms); %s", result.world_size,
                 result.prediction.step_time_ms, result.naive_prediction.step_time_ms, result.shared_devices)
        return result
    layout = build_layout(graphs, cluster, precision=config.precision)
    check_batch(config, layout)
    if profile is None:
        naive = build_plan(graphs, cluster, config, naive_decisions(graphs, config, layout))
        aware = fastest_count(graphs, cluster, config, aware_plan_searched(graphs, cluster, config))
        naive = dataclasses.replace(naive, prediction=aware.prediction if _simulated_alike(naive, aware)
                                    else predict(naive, cluster))
        candidates = [Priced("aware", aware), Priced("naive", naive)]
        folded = folded_candidate(graphs, cluster, config) if config.fold_stages else None
        folded = faster(folded, idle_fold_candidate(graphs, cluster, config, aware))
        result = keep_fastest(candidates + ([folded] if folded is not None else []), naive.prediction, graphs)
    else:
        result = _profiled_plan(graphs, cluster, config, profile)
    result.validate(graphs=graphs, cluster=cluster)
    log_batchnorm_warnings(result)
    log.info("planned %d workers: predicted %.2f ms per step (naive %.2f ms)", result.world_size,
             result.prediction.step_time_ms, result.naive_prediction.step_time_ms)
    return result


def _shared_plan(graphs: TaskGraphs, cluster: Cluster, config: Config, groupings: list[list[list[int]]]) -> Plan:
    """The plan of a cluster smaller than the regions ask: each grouping of
    :func:`~planner.devices.placement.shared_device_groups` planned as the aware plan is (every
    placement, swaps), the fastest that fits kept as ``"aware"``; the naive decisions on the first
    grouping's layout (as many stages as the devices allow, :func:`naive_plan`'s) as ``"naive"``;
    ``Plan.shared_devices`` says what the regions asked and what the plan kept shares."""
    priced, errors = [], []
    for grouping in groupings:
        try:
            prediction, candidate = best_aware_plan(graphs, cluster, config, shared=grouping)
        except PlanError as e:
            errors.append(e)
            log.debug("regions %s sharing %d device(s): %s", grouping, len(cluster.devices), e)
            continue
        priced.append((grouping, dataclasses.replace(candidate, prediction=prediction)))
    if not priced:
        raise errors[0]
    fitting = [p for p in priced if plan_fits(p[1])] or priced
    grouping, aware = min(fitting, key=lambda p: p[1].prediction.step_time_ms)
    # the capacity-blind plan keeps as many stages as the devices allow (the first grouping), as naive_plan does
    layout = build_layout(graphs, cluster, precision=config.precision, shared=groupings[0])
    check_batch(config, layout)
    naive = build_plan(graphs, cluster, config, naive_decisions(graphs, config, layout))
    naive = dataclasses.replace(naive, prediction=aware.prediction if _simulated_alike(naive, aware)
                                else predict(naive, cluster))
    note = _shared_note(graphs, len(cluster.devices), grouping)
    kept = keep_fastest([Priced("aware", aware), Priced("naive", naive)], naive.prediction, graphs)
    return dataclasses.replace(kept, shared_devices=note)


def _shared_note(graphs: TaskGraphs, devices: int, grouping: list[list[int]]) -> str:
    """``Plan.shared_devices``: what the regions ask, what the cluster has, what was folded."""
    asked = ", ".join(f"TaskGraph {tg.index}: {tg.strategy}" for tg in graphs)
    folded = [run for run in grouping if len(run) > 1]
    how = ("; folded into one stage: " + ", ".join("TaskGraphs " + "+".join(map(str, run)) for run in folded)
           if folded else "")
    return (f"the regions ask {graphs.devices_asked} device(s) ({asked}) and the cluster has {devices}: their "
            f"counts are automatic{how}")


# what the simulator does not read: two plans equal in everything else simulate to the same step
_NOT_SIMULATED = frozenset({"prediction", "naive_prediction", "optimality_gap", "solver", "chosen", "candidates"})


def _simulated_alike(one: Plan, other: Plan) -> bool:
    """Whether ``one`` and ``other`` are the same plan but for :data:`_NOT_SIMULATED` (the naive
    plan of a cluster where the hardware-aware decisions are the naive ones): the simulator, a pure
    function of the rest, predicts the same step for both, so it runs once."""
    return all(getattr(one, f.name) == getattr(other, f.name) for f in dataclasses.fields(Plan)
               if f.name not in _NOT_SIMULATED)


def _profiled_plan(graphs: TaskGraphs, cluster: Cluster, config: Config, profile: Profile) -> Plan:
    """Plan on the measured cluster, re-rating each device at the sizes and units each plan gives
    it until they repeat (:mod:`planner.devices.measured_speeds`, :func:`_profiled_rounds`); the
    fastest plan as predicted at its own sizes, next to the naive plan priced the same way (and with
    ``Config.fold_stages`` the fastest fold, re-rated the same way), the fastest that fits kept
    (:func:`planner.candidates.keep_fastest`)."""
    result, own, measured = _profiled_rounds(graphs, cluster, config, profile)
    layout = build_layout(graphs, measured, precision=config.precision)
    naive = build_plan(graphs, measured, config, naive_decisions(graphs, config, layout))
    log.info("planned from the profile of %s (measured in %.0f s): device rates %s TFLOPS", profile.cluster,
             profile.seconds, ", ".join(f"{d.name} {d.measured(config.precision):.3g}" for d in own.devices))
    naive = _at_own_sizes(naive, graphs, cluster, profile, config.precision)[0]
    candidates = [Priced("aware", result), Priced("naive", naive)]
    folded = None
    for way in fold_patterns(graphs) if config.fold_stages else []:
        try:
            plan = _profiled_rounds(graphs, cluster, config, profile, fold=way)[0]
        except PlanError as e:
            log.debug("folding TaskGraphs %s: %s", way, e)
            continue
        if folded is None or plan.prediction.step_time_ms < folded.prediction.step_time_ms:
            folded = plan
    if folded is not None:
        candidates.append(Priced("folded", folded))
    result = keep_fastest(candidates, naive.prediction, graphs)
    return dataclasses.replace(result, speeds="profile")


def _profiled_rounds(graphs: TaskGraphs, cluster: Cluster, config: Config, profile: Profile,
                     fold: list[list[int]] | None = None) -> tuple[Plan, Cluster, Cluster]:
    """The fastest aware plan (with ``fold``: of that fold's layouts) over the re-rating rounds, as
    predicted at its own sizes' rates: (plan, the cluster rated for it, the last round's cluster)."""
    measured = measured_cluster(cluster, profile, graphs, config.precision)
    seen, best = set(), None
    for _ in range(ROUNDS):
        _, candidate = best_aware_plan(graphs, measured, config, fold=fold)
        signature = sizes_signature(candidate)
        if signature in seen:
            break
        seen.add(signature)
        candidate, own = _at_own_sizes(candidate, graphs, cluster, profile, config.precision)
        if best is None or candidate.prediction.step_time_ms < best[0].prediction.step_time_ms:
            best = (candidate, own)
        measured = own
    return best[0], best[1], measured


def _at_own_sizes(plan: Plan, graphs: TaskGraphs, cluster: Cluster, profile: Profile,
                  precision: str) -> tuple[Plan, Cluster]:
    """``plan`` with every worker's timing fields and its prediction at the rates the profile measured for
    the units and micro-batch sizes it gives each device, and the cluster rated so
    (:func:`planner.devices.measured_speeds.measured_cluster` with ``plan``)."""
    own = measured_cluster(cluster, profile, graphs, precision, plan=plan)
    return repriced_plan(plan, graphs, own), own


def naive_plan(graphs: TaskGraphs, cluster: Cluster, config: Config, profile: Optional[Profile] = None) -> Plan:
    """The capacity-blind plan on the same devices (equal shares, shards and layer counts). It may
    exceed device memory; it exists to compare against and to run side by side under emulation.
    Under ``Config.schedule`` ``"auto"`` it runs 1F1B: a capacity-blind planner prices no schedule.
    With ``profile`` its prediction is priced from the measurements, as :func:`plan` prices its own
    naive candidate (each device at its own stage's units and sizes), ``speeds`` ``"profile"``."""
    if config.schedule == AUTO_SCHEDULE:
        config = dataclasses.replace(config, schedule=AUTO_SCHEDULES[0])
    check_trainable(graphs)
    check_precision(cluster, config.precision)
    cluster = with_reserve(cluster, config.memory_reserve)
    graphs = _for_precision(graphs, config)
    shared = shared_device_groups(graphs, len(cluster.devices))
    layout = build_layout(graphs, cluster, precision=config.precision, shared=shared[0] if shared else None)
    check_batch(config, layout)
    naive = build_plan(graphs, cluster, config, naive_decisions(graphs, config, layout))
    if shared:
        naive = dataclasses.replace(naive, shared_devices=_shared_note(graphs, len(cluster.devices), shared[0]))
    if profile is None:
        return with_predictions(naive, naive, cluster)
    profile.validate(graphs=graphs, cluster=cluster)
    profile.check_precision(config.precision)
    naive = _at_own_sizes(naive, graphs, cluster, profile, config.precision)[0]
    return dataclasses.replace(naive, naive_prediction=naive.prediction, speeds="profile")


@contextlib.contextmanager
def reserve_named(config: Config):
    """A :class:`PlanError` about memory raised inside names the reserve (``Config.memory_reserve``): the
    capacities it gives are the devices' memory less it."""
    try:
        yield
    except PlanError as e:
        text = str(e)
        if config.memory_reserve and any(word in text for word in ("fit", "memory", "GiB", "MiB")):
            note = (f"each device's capacity here is its memory less the {config.memory_reserve:.0%} reserve a plan "
                    "keeps free (Config.memory_reserve, `whalelike plan --memory-reserve`)")
            e.args = (f"{text}; {note}",) + e.args[1:]
        raise


def _for_precision(graphs: TaskGraphs, config: Config) -> TaskGraphs:
    """The graphs with what a low-precision plan prices memory with (measured under autocast on the
    first such plan, :func:`whalelike.graphs.capture.with_autocast`); as they are for fp32."""
    return graphs if config.precision == "fp32" else with_autocast(graphs)
