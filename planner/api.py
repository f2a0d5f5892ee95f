"""``planner.plan()``: the hardware-aware plan, and ``planner.naive_plan()``, the capacity-blind one.

The planner is a chain of pure steps (Whale's parallel planner, with Poplar's batch rules):

1. virtual devices: each TaskGraph becomes a pipeline stage on a group of devices, larger-memory
   devices on early stages (or the fastest devices on the stages with the most work per device:
   both are tried), replicated pipelines when the cluster has room (:mod:`planner.devices.placement`);
   afterwards two stages may exchange devices when the simulator predicts a gain (``_swap_search``);
2. stage layers: by default each stage runs its own TaskGraph's layers; between two adjacent
   stages that are both plain ``replicate`` the planner may move boundary layers so that the
   slowest stage is as fast as possible (the pipeline partitioner, :mod:`planner.partition.solve`).
   Stages under ``split`` keep their layers: their operators were chosen for sharding;
3. shard layout of every ``split`` stage, proportional to speed within memory
   (:mod:`planner.shares.shard_sizes`);
4. batch shares: every micro-batch is split over the pipeline replicas by throughput, then inside
   each stage over its data-parallel groups by speed, with Whale's memory balancing
   (:mod:`planner.shares.batch_shares`). When a micro-batch still does not fit, a pipeline gets more
   micro-batches (the next divisor of the global batch), and a single stage switches to Poplar's
   per-device gradient accumulation (own micro-batch size and last batch size per device); either
   way at most ``MAX_MICRO_BATCHES`` per step, so the planner's work is bounded by that count and
   never by the number of samples (a global batch of 10**12 is an error in milliseconds, not a hang);
5. assembly and prediction (:mod:`planner.assemble`, :mod:`planner.schedule.simulator`).

The naive plan uses the same devices with equal shares, equal shards and equal layer counts per
movable stage: what a capacity-blind system would do, as the baseline of the predicted speed-up.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
from dataclasses import dataclass

from whalelike.cluster import Cluster, Device
from whalelike.config import Config
from whalelike.display import human_bytes
from whalelike.sharding.groups import WHAT_SPLIT_SHARDS
from whalelike.graphs.taskgraph import TaskGraphs

from planner.assemble import Decisions, build_plan, predict, with_predictions
from planner.shares.batchnorm_statistics import log_batchnorm_warnings
from planner.devices.cost_model import GIB, StageCost, device_tflops
from planner.shares.batch_shares import DoesNotFit, Slot, accumulation_sizes, balanced_shares, proportional_shares
from planner.plan import Plan, PlanError, Prediction
from planner.schedule.actions import build_schedule, gradient_accumulation, max_in_flight
from planner.partition.stage_layers import equal_stage_layers, movable_runs, partition_stage_layers
from planner.shares.shard_sizes import ShardLayout, even_layout, groups_of, shard_layout
from planner.devices.placement import PLACEMENTS, Layout, build_layout

log = logging.getLogger(__name__)

MAX_SWAP_STAGES = 8   # longest pipeline whose stage-device assignment is searched by swaps
# Most micro-batches per step a plan may have. Schedules, batch shares and the simulator are all
# linear in the count (about 0.15 ms per micro-batch to plan), so the count, never the batch size,
# bounds the planner's work: a global batch of 10**12 is planned as fast as one of 64.
MAX_MICRO_BATCHES = 16384


def plan(graphs: TaskGraphs, cluster: Cluster, config: Config) -> Plan:
    """The hardware-aware plan of ``graphs`` on ``cluster`` under ``config``.

    Raises :class:`~planner.plan.PlanError` for requests the cluster cannot satisfy (too many
    devices, batch too small or indivisible, memory infeasible), naming what would fit.
    """
    _check_model(graphs)
    layout = build_layout(graphs, cluster)
    _check_batch(config, layout)
    naive = build_plan(graphs, cluster, config, naive_decisions(graphs, config, layout))
    prediction, result = _best_aware_plan(graphs, cluster, config)
    result = dataclasses.replace(result, prediction=prediction, naive_prediction=predict(naive, cluster))
    result.validate(graphs=graphs, cluster=cluster)
    log_batchnorm_warnings(result)
    log.info("planned %d workers: predicted %.2f ms per step (naive %.2f ms)", result.world_size,
             result.prediction.step_time_ms, result.naive_prediction.step_time_ms)
    return result


def _best_aware_plan(graphs: TaskGraphs, cluster: Cluster, config: Config) -> tuple[Prediction, Plan]:
    """The fastest predicted hardware-aware plan and its prediction: one per device placement that fits (see
    ``build_layout``), the best improved by :func:`_swap_search`. Raises the error of the
    Whale-rule placement when none fits."""
    scored, first_error = [], None
    for placement in PLACEMENTS:
        try:
            scored.append(_aware_plan(graphs, cluster, config, build_layout(graphs, cluster, placement)))
        except PlanError as e:
            first_error = first_error or e
    if not scored:
        raise first_error
    prediction, best, _ = _swap_search(graphs, cluster, config, min(scored, key=lambda c: c[0].step_time_ms))
    return prediction, best


def _aware_plan(graphs: TaskGraphs, cluster: Cluster, config: Config,
                layout: Layout) -> tuple[Prediction, Plan, Layout]:
    """(prediction, plan, layout) of the hardware-aware decisions on ``layout``."""
    plan = build_plan(graphs, cluster, config, aware_decisions(graphs, config, layout, cluster.network))
    return predict(plan, cluster), plan, layout


def _swap_search(graphs: TaskGraphs, cluster: Cluster, config: Config,
                 best: tuple[Prediction, Plan, Layout]) -> tuple[Prediction, Plan, Layout]:
    """Hill-climb over exchanging the device groups of two stages of equal shape.

    Both placements deal devices to stages by a rule computed from the user's TaskGraphs, before
    the partitioner moves layers between movable stages; after it, a stage may be left light (a
    final norm) while a fixed one (a ``split`` LM head) bottlenecks on a slow device. Exchanging
    their devices fixes that. Two stages of one movable run never swap: the partitioner already
    balances them by moving layers, on devices in Whale's order (larger memory first, for the
    activations early stages keep in flight). Every candidate is re-planned and simulated, so a
    swap is kept only when the prediction improves; pipelines longer than ``MAX_SWAP_STAGES``
    stages skip the search (its cost grows with the square of the stage count).
    """
    stages = best[2].num_stages
    if stages > MAX_SWAP_STAGES:
        return best
    runs = movable_runs(graphs)
    improved = True
    while improved:
        improved = False
        for a, b in itertools.combinations(range(stages), 2):
            if not best[2].can_swap(a, b) or any(a in run and b in run for run in runs):
                continue
            try:
                candidate = _aware_plan(graphs, cluster, config, best[2].swapped(a, b))
            except PlanError:
                continue
            if candidate[0].step_time_ms < best[0].step_time_ms * (1 - 1e-6):
                log.debug("exchanging the devices of stages %d and %d: %.2f -> %.2f ms", a, b,
                          best[0].step_time_ms, candidate[0].step_time_ms)
                best, improved = candidate, True
                break
    return best


def naive_plan(graphs: TaskGraphs, cluster: Cluster, config: Config) -> Plan:
    """The capacity-blind plan on the same devices (equal shares, shards and layer counts). It may
    exceed device memory; it exists to compare against and to run side by side under emulation."""
    _check_model(graphs)
    layout = build_layout(graphs, cluster)
    _check_batch(config, layout)
    naive = build_plan(graphs, cluster, config, naive_decisions(graphs, config, layout))
    return with_predictions(naive, naive, cluster)


# -- input checks ----------------------------------------------------------------------------------
def _check_model(graphs: TaskGraphs) -> None:
    """A model without parameters has nothing to train: torch's optimizers refuse an empty
    parameter list, so every rank would fail at its first step."""
    if sum(tg.param_count for tg in graphs) == 0:
        paths = ", ".join(p for tg in graphs for p in tg.module_paths) or "no modules"
        raise PlanError(
            f"the model has no parameters ({len(graphs)} TaskGraph(s) over {paths}): there is nothing to "
            "train or to balance; plan a model with at least one parameter (an nn.Linear, nn.Conv2d, ...)"
        )


def divisors(n: int, low: int, high: int) -> list[int]:
    """The divisors of ``n`` in ``[low, high]``, ascending, by trial division over that range only:
    O(high - low), never O(n), so callers bound ``high`` (by :data:`MAX_MICRO_BATCHES`)."""
    return [d for d in range(max(low, 1), min(high, n) + 1) if n % d == 0]


def _check_batch(config: Config, layout: Layout) -> None:
    gbs, m = config.global_batch_size, config.num_micro_batch
    groups = max(len(layout.stage_groups(s)) for s in range(layout.num_stages))
    if gbs < groups:
        raise PlanError(
            f"global_batch_size {gbs} is smaller than the {groups} data-parallel groups of the plan: "
            f"every group needs at least one sample; use global_batch_size >= {groups}"
        )
    if m > MAX_MICRO_BATCHES:
        raise PlanError(
            f"num_micro_batch {m} exceeds the {MAX_MICRO_BATCHES} micro-batches per step the planner "
            f"schedules and simulates; use num_micro_batch <= {MAX_MICRO_BATCHES} (larger micro-batches)"
        )
    if layout.num_stages > 1 and gbs % m:
        options = divisors(gbs, 1, min(gbs // groups, MAX_MICRO_BATCHES))
        near = sorted(options, key=lambda d: abs(d - m))[:3]
        raise PlanError(
            f"num_micro_batch {m} does not divide global_batch_size {gbs}: a pipeline needs equal "
            f"micro-batches; use num_micro_batch in {sorted(near)}"
        )
    if gbs // m < groups:
        raise PlanError(
            f"a micro-batch of {gbs} // {m} = {gbs // m} samples is smaller than the {groups} data-parallel "
            f"groups of the plan; use num_micro_batch <= {gbs // groups}"
        )


# -- per-stage view used by the balancers ----------------------------------------------------------
@dataclass(frozen=True)
class _Stage:
    """One stage priced for a given micro-batch count: costs, in-flight micro-batches, shards."""

    index: int
    cost: StageCost
    in_flight: int
    shards: ShardLayout

    def group_speed(self, group: tuple[Device, ...]) -> float:
        """Samples per ms: a tensor-parallel group is as fast as its slowest shard. A stage that
        FlopCounterMode counts no FLOPs for (an embedding lookup) still shares by device speed."""
        flops = max(self.cost.flops_per_sample, 1.0)
        return min(device_tflops(d) * 1e9 / (flops * f)
                   for d, f in zip(group, self.shards.fractions))

    def group_cap(self, group: tuple[Device, ...]) -> int:
        return min(self.cost.max_micro_batch(d.memory_gib * GIB, self.in_flight, f)
                   for d, f in zip(group, self.shards.fractions))

    def group_util(self, group: tuple[Device, ...], samples: int) -> float:
        return max(self.cost.memory_bytes(samples, self.in_flight, f) / (d.memory_gib * GIB)
                   for d, f in zip(group, self.shards.fractions))


def _stages(graphs, config, layout, stage_layers, num_micro_batch, aware: bool, kept_shards=None) -> list[_Stage]:
    """Every stage priced for ``num_micro_batch``; ``kept_shards[s]``, when given and not None,
    is stage ``s``'s shard layout instead of the even (naive) or speed-proportional (aware) one."""
    in_flight_per_stage = _in_flight(config.schedule, layout.num_stages, num_micro_batch)
    out = []
    for s, layers in enumerate(stage_layers):
        cost = StageCost.of_layers(graphs, layers)
        in_flight = in_flight_per_stage[s]
        owners = [graphs[t] for t in sorted({graphs.layers[i].taskgraph for i in layers})]
        shardable = {p: d for tg in owners for p, d in tg.shardable.items()}
        groups = tuple(g for tg in owners for g in tg.shard_groups)
        tp = layout.shapes[s].tp
        _check_shardable(layout, s, owners, shardable, groups)
        if kept_shards is not None and kept_shards[s] is not None:
            shards = kept_shards[s]
        elif not aware:
            shards = even_layout(shardable, tp, groups, cost.flops_per_sample)
        else:
            expected = -(-config.global_batch_size // (num_micro_batch * len(layout.stage_groups(s))))
            shards = _aware_shards(layout, s, cost, in_flight, shardable, groups, expected)
        out.append(_Stage(s, cost, in_flight, shards))
    return out


def _in_flight(schedule: str, num_stages: int, count: int) -> tuple[int, ...]:
    """Micro-batches in flight per stage under ``schedule`` with ``count`` micro-batches.

    Every schedule warms up with a number of forwards that depends on the stage only, so in flight
    stops growing with the count past it (GPipe's, all forwards first, never does). When a schedule
    of ``2 * num_stages + 2`` micro-batches and one of one more agree, that is the answer for any
    larger count: the batch-size search prices up to :data:`MAX_MICRO_BATCHES` micro-batches
    without building their action lists."""
    probe = 2 * num_stages + 2
    if count > probe:
        short = _in_flight_of_schedule(schedule, num_stages, probe)
        if short == _in_flight_of_schedule(schedule, num_stages, probe + 1):
            return short
    return _in_flight_of_schedule(schedule, num_stages, count)


@functools.lru_cache(maxsize=256)
def _in_flight_of_schedule(schedule: str, num_stages: int, count: int) -> tuple[int, ...]:
    actions = build_schedule(schedule, num_stages, count) if num_stages > 1 else [gradient_accumulation(count)]
    return tuple(max_in_flight(stage) for stage in actions)


def _check_shardable(layout: Layout, s: int, owners, shardable, groups) -> None:
    """A ``split`` region must shard something, at any width (even one device: the plan would
    otherwise pass for tensor parallel and run replicated), and no wider than its narrowest group."""
    if any(_has_split(tg.strategy) for tg in owners) and not shardable:
        raise _nothing_to_shard(owners)
    tp = layout.shapes[s].tp
    narrowest = min(groups_of(shardable, groups), key=lambda g: g.units, default=None)
    if narrowest is not None and tp > narrowest.units:
        automatic = any(_split_of(tg.strategy).device_count is None for tg in owners if _has_split(tg.strategy))
        how = (f"the automatic width gives it {tp} of the cluster's devices" if automatic
               else f"it asks for {tp} devices")
        names = ", ".join(f"TaskGraph {tg.index} ({tg.strategy})" for tg in owners)
        raise PlanError(
            f"{names}, stage {s}: {how}, but its {narrowest.describe()} can be cut over at most "
            f"{narrowest.units} devices (one unit each); use split({narrowest.units}) or narrower for this "
            "region (the other devices then go to the automatic stages, or to more pipeline replicas)"
        )


def _has_split(strategy) -> bool:
    return strategy.kind == "split" or strategy.inner is not None


def _split_of(strategy):
    return strategy if strategy.kind == "split" else strategy.inner


def _nothing_to_shard(owners) -> PlanError:
    paths = ", ".join(p for tg in owners for p in tg.module_paths) or "no modules"
    strategies = ", ".join(sorted({str(tg.strategy) for tg in owners}))
    return PlanError(
        f"{strategies} over {paths}: nothing in this region can be sharded (none of these modules is a "
        "projection split can cut), so every tensor-parallel device would run all of it; split shards "
        f"{WHAT_SPLIT_SHARDS}. Use replicate for this region, or put split around (or annotate with split) "
        "a shardable module such as an nn.Linear"
    )


def _aware_shards(layout, s, cost: StageCost, in_flight: int, shardable, shard_groups, samples: int) -> ShardLayout:
    """Shards proportional to the summed speed at each tensor-parallel index, capped so that each
    device holds its shard with ``samples`` samples in flight, or failing that its weights alone
    (the batch balancer then finds out how many samples fit)."""
    groups = layout.stage_groups(s)
    tp = layout.shapes[s].tp
    speeds = [sum(device_tflops(g[t]) for g in groups) for t in range(tp)]
    for n in (samples, 0):
        need = max(cost.memory_bytes(n, in_flight), 1.0)
        max_fractions = [min(g[t].memory_gib * GIB / need for g in groups) for t in range(tp)]
        try:
            return shard_layout(shardable, speeds, max_fractions, shard_groups, cost.flops_per_sample)
        except DoesNotFit:
            continue
    raise _memory_error(layout, s, cost, in_flight, groups, None, samples=0)


# -- hardware-aware decisions ----------------------------------------------------------------------
def aware_decisions(graphs: TaskGraphs, config: Config, layout: Layout, network, *,
                    stage_layers: list[list[int]] | None = None, shards: list[ShardLayout | None] | None = None,
                    sizes: list | None = None, counts: list[int] | None = None) -> Decisions:
    """The hardware-aware decisions on ``layout``: steps 2 to 4 of the module docstring.

    A re-plan of a running job (:mod:`planner.balance.replan`) passes what it keeps of the plan in force:
    ``stage_layers`` instead of the partitioner's (the decisions then say solver ``"greedy"``, gap
    None: the caller knows where they came from), ``shards`` (per stage a ShardLayout, or None to
    shard by speed), ``sizes`` (``Decisions.sizes``) instead of balanced batch shares, and
    ``counts``, the micro-batch counts a pipeline may use (default: ``num_micro_batch``, then
    every larger divisor of the global batch). Raises PlanError when the stages do not fit.
    """
    if stage_layers is None:
        stage_layers, solver, gap = partition_stage_layers(graphs, layout, config, network)
    else:
        solver, gap = "greedy", None
    gbs, m = config.global_batch_size, config.num_micro_batch
    if sizes is not None:
        count = max(len(n) for replica in sizes for stage in replica for n in stage)
        stages = _stages(graphs, config, layout, stage_layers, count, True, shards)
        return Decisions(layout, stage_layers, [s.cost for s in stages], [s.in_flight for s in stages],
                         [s.shards for s in stages], sizes, count, solver, gap)
    if layout.num_stages == 1:
        stages = _stages(graphs, config, layout, stage_layers, m, True, shards)
        sizes, m = _single_stage_sizes(layout, stages[0], gbs, m)
        return Decisions(layout, stage_layers, [s.cost for s in stages], [s.in_flight for s in stages],
                         [s.shards for s in stages], sizes, m, solver, gap)
    first_error, tried = None, m
    for count in _micro_batch_counts(gbs, m, layout) if counts is None else counts:
        tried = count
        stages = _stages(graphs, config, layout, stage_layers, count, True, shards)
        try:
            sizes = _pipeline_sizes(layout, stages, gbs // count, count)
        except _StageDoesNotFit as e:
            first_error = first_error or e
            continue
        if count != m:
            log.warning("micro-batches of %d samples do not fit; using num_micro_batch=%d (%d samples each)",
                        gbs // m, count, gbs // count)
        return Decisions(layout, stage_layers, [s.cost for s in stages], [s.in_flight for s in stages],
                         [s.shards for s in stages], sizes, count, solver, gap)
    raise _shortfall_error(layout, first_error, m, gbs, tried)


def _micro_batch_counts(gbs: int, m: int, layout: Layout) -> list[int]:
    """``m`` and every larger divisor of ``gbs`` that still gives each group a sample, up to
    :data:`MAX_MICRO_BATCHES` (what can be tried: each count is a schedule to price)."""
    return divisors(gbs, m, min(gbs // _most_groups(layout), MAX_MICRO_BATCHES))


def _most_groups(layout: Layout) -> int:
    return max(len(layout.stage_groups(s)) for s in range(layout.num_stages))


class _StageDoesNotFit(Exception):
    def __init__(self, stage: "_Stage", shortfall: int, capacity: int, micro_batch: int):
        self.stage, self.shortfall, self.capacity, self.micro_batch = stage, shortfall, capacity, micro_batch


def _pipeline_sizes(layout: Layout, stages: list[_Stage], micro_batch: int, count: int):
    """Per replica, stage and group: ``count`` equal micro-batches split by throughput."""
    for st in stages:
        _check_fit(layout, st, samples=0)
        caps = [st.group_cap(g) for g in layout.stage_groups(st.index)]
        if min(caps) < 1:
            raise _StageDoesNotFit(st, micro_batch - sum(caps), sum(caps), micro_batch)
    # a replica is as fast as its slowest stage and holds what its tightest stage can
    replica_slots = []
    for replica in layout.groups:
        speed = min(sum(st.group_speed(g) for g in replica[st.index]) for st in stages)
        caps = [sum(st.group_cap(g) for g in replica[st.index]) for st in stages]
        replica_slots.append(Slot(speed, min(caps)))
    minimum = max(len(replica[s]) for replica in layout.groups for s in range(len(stages)))
    try:
        per_replica = balanced_shares(micro_batch, replica_slots, lambda i, n: n / max(replica_slots[i].cap, 1), minimum)
    except DoesNotFit as e:
        tightest = min(stages, key=lambda st: min(sum(st.group_cap(g) for g in r[st.index]) for r in layout.groups))
        raise _StageDoesNotFit(tightest, e.shortfall, e.capacity, micro_batch) from None
    sizes = []
    for r, replica in enumerate(layout.groups):
        per_stage = []
        for st in stages:
            groups = replica[st.index]
            shares = _group_shares(st, groups, per_replica[r], micro_batch)
            per_stage.append([[n] * count for n in shares])
        sizes.append(per_stage)
    return sizes


def _group_shares(st: _Stage, groups, samples: int, micro_batch: int) -> list[int]:
    slots = [Slot(st.group_speed(g), st.group_cap(g)) for g in groups]
    try:
        return balanced_shares(samples, slots, lambda i, n: st.group_util(groups[i], n))
    except DoesNotFit as e:
        raise _StageDoesNotFit(st, e.shortfall, e.capacity, micro_batch) from None


def _single_stage_sizes(layout: Layout, st: _Stage, gbs: int, m: int):
    """Shares of each of ``m`` near-equal micro-batches; if they do not fit, Poplar's per-device
    gradient accumulation over the whole batch."""
    _check_fit(layout, st, samples=1)
    groups = layout.stage_groups(0)
    batches = [gbs // m + (1 if i < gbs % m else 0) for i in range(m)]
    try:
        per_batch = [_group_shares(st, groups, n, n) for n in batches]
        flat = [[per_batch[i][g] for i in range(m)] for g in range(len(groups))]
        count = m
    except _StageDoesNotFit:
        speeds = [st.group_speed(g) for g in groups]
        totals = proportional_shares(gbs, speeds, minimum=1)
        _check_accumulation(layout, st, totals, groups, gbs)
        flat = [accumulation_sizes(n, st.group_cap(g)) for n, g in zip(totals, groups)]
        count = max(len(f) for f in flat)
        log.warning("the global batch does not fit in %d micro-batch(es); per-device gradient accumulation "
                    "(Poplar): up to %d micro-batches", m, count)
    sizes, i = [], 0
    for replica in layout.groups:
        n = len(replica[0])
        sizes.append([flat[i:i + n]])
        i += n
    return sizes, count


def _check_accumulation(layout: Layout, st: _Stage, totals: list[int], groups, gbs: int) -> None:
    """Per-device gradient accumulation must stay within :data:`MAX_MICRO_BATCHES` micro-batches."""
    count, group = max(((math.ceil(n / max(st.group_cap(g), 1)), g) for n, g in zip(totals, groups)),
                       key=lambda pair: pair[0])
    if count > MAX_MICRO_BATCHES:
        fits = sum(max(st.group_cap(g), 0) for g in groups)
        raise PlanError(
            f"global_batch_size {gbs} does not fit TaskGraph {layout.shapes[st.index].taskgraph}: device "
            f"{group[0].name!r} would accumulate gradients over {count} micro-batches, more than the "
            f"{MAX_MICRO_BATCHES} the planner schedules per step (its devices hold {fits} samples at once in "
            f"all, so no global batch above {fits * MAX_MICRO_BATCHES} can fit); use a smaller "
            "global_batch_size or add devices"
        )


# -- memory errors ---------------------------------------------------------------------------------
def _check_fit(layout: Layout, st: _Stage, samples: int) -> None:
    """Every device must hold its share of the weights, gradients and optimizer state, plus
    ``samples`` samples per micro-batch."""
    for group in layout.stage_groups(st.index):
        if st.group_cap(group) < samples:
            raise _memory_error(layout, st.index, st.cost, st.in_flight, [group], st.shards, samples)


def _memory_error(layout, s, cost: StageCost, in_flight: int, groups, shards: ShardLayout | None, samples: int):
    worst = None
    for group in groups:
        for t, d in enumerate(group):
            f = shards.fractions[t] if shards else 1.0 / len(group)
            need = cost.memory_bytes(samples, in_flight, f)
            short = need - d.memory_gib * GIB
            if worst is None or short > worst[0]:
                worst = (short, need, d)
    short, need, device = worst
    what = "weights, gradients and optimizer state" + (" with one sample in flight" if samples else "")
    return PlanError(
        f"TaskGraph {layout.shapes[s].taskgraph} (stage {s}, {layout.shapes[s].label}) does not fit on device "
        f"{device.name!r} ({device.kind}, {device.memory_gib:.1f} GiB): its {what} need {need / GIB:.2f} GiB, "
        f"short by {max(short, 0) / GIB:.2f} GiB; shard it with split(n) over more devices, or use devices "
        "with more memory"
    )


def _shortfall_error(layout: Layout, err: "_StageDoesNotFit", m: int, gbs: int, tried: int) -> PlanError:
    """Why the first micro-batch count tried (``m``) does not fit; ``tried``: the largest count tried."""
    st = err.stage
    per_sample = st.cost.bytes_per_sample(st.in_flight)
    groups = layout.stage_groups(st.index)
    best = max(groups, key=lambda g: st.group_cap(g))
    fits = sum(max(st.group_cap(g), 0) for g in groups)
    more = math.ceil(err.shortfall / max(st.group_cap(best), 1))
    needed = math.ceil(gbs / max(fits, 1))
    if needed > MAX_MICRO_BATCHES:
        limit = (f"; it would take at least {needed} micro-batches, more than the {MAX_MICRO_BATCHES} the planner "
                 "schedules per step")
    elif tried > m:
        limit = f"; neither does any num_micro_batch up to {tried} that divides global_batch_size {gbs}"
    else:
        limit = ""
    return PlanError(
        f"TaskGraph {layout.shapes[st.index].taskgraph} (stage {st.index}) does not fit: a micro-batch of "
        f"{err.micro_batch} samples needs {human_bytes(err.shortfall * per_sample)} more activation memory than "
        f"its devices have (short by {err.shortfall * per_sample / GIB:.2f} GiB){limit}; at most {fits} samples "
        f"per micro-batch fit (global_batch_size <= {fits * m} with num_micro_batch={m}), or add {more} more "
        f"{best[0].kind} device(s) to the stage"
    )


# -- the naive plan --------------------------------------------------------------------------------
def naive_decisions(graphs: TaskGraphs, config: Config, layout: Layout) -> Decisions:
    """The capacity-blind decisions on ``layout``: equal shares, shards and layer counts."""
    gbs, m = config.global_batch_size, config.num_micro_batch
    stage_layers = equal_stage_layers(graphs, layout)
    stages = _stages(graphs, config, layout, stage_layers, m, aware=False)
    if layout.num_stages == 1:
        groups = layout.stage_groups(0)
        batches = [gbs // m + (1 if i < gbs % m else 0) for i in range(m)]
        per_batch = [proportional_shares(n, [1.0] * len(groups), minimum=1) for n in batches]
        flat = [[per_batch[i][g] for i in range(m)] for g in range(len(groups))]
        sizes, i = [], 0
        for replica in layout.groups:
            n = len(replica[0])
            sizes.append([flat[i:i + n]])
            i += n
    else:
        per_replica = proportional_shares(gbs // m, [1.0] * layout.num_replicas, minimum=1)
        sizes = [
            [[[n] * m for n in proportional_shares(per_replica[r], [1.0] * len(replica[s]), minimum=1)]
             for s in range(layout.num_stages)]
            for r, replica in enumerate(layout.groups)
        ]
    return Decisions(layout, stage_layers, [s.cost for s in stages], [s.in_flight for s in stages],
                     [s.shards for s in stages], sizes, m, "greedy")
