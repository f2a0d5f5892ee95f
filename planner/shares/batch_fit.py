"""Batch fitting: the micro-batch sizes of every data-parallel group, within memory (step 4 of
:mod:`planner.api`).

Every micro-batch is split over the pipeline replicas by throughput, then inside each stage over
its data-parallel groups by speed, with Whale's memory balancing (:mod:`planner.shares.batch_shares`).
When a micro-batch still does not fit, a pipeline gets more micro-batches (the next divisor of the
global batch: :func:`micro_batch_counts`, tried in order by
:func:`planner.decisions.aware_decisions`), and a single stage switches to Poplar's per-device
gradient accumulation (own micro-batch size and last batch size per device); either way at most
:data:`MAX_MICRO_BATCHES` per step, so the planner's work is bounded by that count and never by the
number of samples (a global batch of 10**12 is an error in milliseconds, not a hang).

A stage that still does not fit may recompute its activations (activation checkpointing: each
:class:`PricedStage` says whether it does, and every memory figure here asks the memory model with
it); :func:`planner.decisions.aware_decisions` turns it on, stage by stage, as the last resort.

Under ZeRO (``PricedStage.zero``) every memory figure is the worker's under its ZeRO stage, and
under ragged shards (``PricedStage.ragged``: each worker's own fraction of the state,
:mod:`planner.shares.state_fractions`) the worker's under its fraction (:meth:`PricedStage.zero_of`). Stages
0-1 share as above (Poplar: speed-proportional shares, per-device accumulation with different
micro-batch counts allowed); a single stage at ZeRO 2-3 issues collectives every micro-batch, so
every device runs the same count, searched over the step time with the group's collectives
(:func:`fit_equal_counts`, Poplar's Algorithm 2). A pipeline's counts are equal anyway.

The results are ``Decisions.sizes`` (:class:`planner.decisions.Decisions`): ``sizes[r][s][d]`` are
the micro-batch sizes of the tensor-parallel group ``d`` of stage ``s`` in replica ``r``. Errors
(:class:`~planner.plan.PlanError`) say what does not fit, by how much, and what would.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Optional, Sequence

from whalelike.cluster import Device
from whalelike.config import Config
from whalelike.display import human_bytes

from planner.devices.cost_model import GIB, StageCost, device_tflops, training_flops, update_ms
from planner.devices.memory import NO_ZERO, ZeroShards, runs_foreach, stage_memory
from planner.devices.placement import Layout
from planner.plan import PlanError
from planner.shares.batch_shares import (
    DoesNotFit, Slot, accumulation_sizes, balance_memory, balanced_shares, proportional_shares,
)
from planner.shares.shard_sizes import ShardLayout

log = logging.getLogger(__name__)

# Most micro-batches per step a plan may have. Schedules, batch shares and the simulator are all
# linear in the count (about 0.15 ms per micro-batch to plan), so the count, never the batch size,
# bounds the planner's work: a global batch of 10**12 is planned as fast as one of 64.
MAX_MICRO_BATCHES = 16384


# -- the request against the layout ----------------------------------------------------------------
def divisors(n: int, low: int, high: int) -> list[int]:
    """The divisors of ``n`` in ``[low, high]``, ascending, by trial division over that range only:
    O(high - low), never O(n), so callers bound ``high`` (by :data:`MAX_MICRO_BATCHES`)."""
    return [d for d in range(max(low, 1), min(high, n) + 1) if n % d == 0]


def most_groups(layout: Layout) -> int:
    """The most data-parallel groups any stage has (over all replicas): each needs a sample."""
    return max(len(layout.stage_groups(s)) for s in range(layout.num_stages))


def check_batch(config: Config, layout: Layout) -> None:
    """``config``'s global batch and micro-batch count can be planned on ``layout``: every
    data-parallel group gets a sample of every micro-batch, a pipeline's micro-batches are equal,
    and there are at most :data:`MAX_MICRO_BATCHES` of them. Raises PlanError naming the fix."""
    gbs, m = config.global_batch_size, config.num_micro_batch
    groups = most_groups(layout)
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


def micro_batch_counts(gbs: int, m: int, layout: Layout) -> list[int]:
    """``m`` and every larger divisor of ``gbs`` that still gives each group a sample, up to
    :data:`MAX_MICRO_BATCHES` (what can be tried: each count is a schedule to price)."""
    return divisors(gbs, m, min(gbs // most_groups(layout), MAX_MICRO_BATCHES))


def equal_batches(gbs: int, m: int) -> list[int]:
    """``m`` near-equal micro-batches of ``gbs`` samples (the first ``gbs % m`` one larger)."""
    return [gbs // m + (1 if i < gbs % m else 0) for i in range(m)]


def single_stage_sizes(layout: Layout, per_group: Sequence[list[int]]) -> list:
    """``Decisions.sizes`` of a single-stage ``layout`` from each group's micro-batch sizes, groups
    in :meth:`~planner.devices.placement.Layout.stage_groups` order (replica-major)."""
    sizes, i = [], 0
    for replica in layout.groups:
        n = len(replica[0])
        sizes.append([list(per_group[i:i + n])])
        i += n
    return sizes


def _by_group(per_batch: Sequence[Sequence[int]]) -> list[list[int]]:
    """``per_batch[i][g]`` (group ``g``'s samples of micro-batch ``i``) as each group's list."""
    return [list(column) for column in zip(*per_batch)]


# -- one stage as the balancers see it -------------------------------------------------------------
@dataclass(frozen=True)
class PricedStage:
    """One stage priced for a given micro-batch count: costs, in-flight micro-batches, shards,
    whether it recomputes its activations and what its data-parallel group shards under ZeRO
    (built by :func:`planner.decisions.priced_stages`). ``ragged``: under ragged shards, each
    data-parallel group's device names with its fraction of the state (group order; empty: even
    shards, ``zero`` for every worker)."""

    index: int
    cost: StageCost
    in_flight: int
    shards: ShardLayout
    recompute: bool = False
    zero: ZeroShards = NO_ZERO
    ragged: tuple[tuple[tuple[str, ...], float], ...] = ()

    @cached_property
    def _share_of(self) -> dict[tuple[str, ...], float]:
        return dict(self.ragged)

    @property
    def state_fractions(self) -> tuple[float, ...]:
        """Each data-parallel group's fraction of the state (group order; empty: even shards)."""
        return tuple(f for _, f in self.ragged)

    def zero_of(self, group: Optional[tuple[Device, ...]] = None) -> ZeroShards:
        """What the worker(s) of ``group`` hold under the stage's ZeRO stage: ``zero`` with the group's
        own fraction under ragged shards (``zero`` itself for even shards or no group)."""
        if not self.ragged or group is None:
            return self.zero
        return dataclasses.replace(self.zero, share=self._share_of[tuple(d.name for d in group)])

    def memory(self, fraction: float, unit_share: Optional[float] = None, group: Optional[tuple[Device, ...]] = None,
               device: Optional[Device] = None):
        """The memory model of a worker of ``group`` holding ``fraction`` of this stage (``unit_share`` of
        its shard groups' units, :func:`planner.devices.memory.stage_memory`; its state fraction under
        ragged shards, :meth:`zero_of`) on ``device`` (how its optimizer steps,
        :func:`planner.devices.memory.runs_foreach`; None: parameter by parameter)."""
        return stage_memory(self.cost, self.in_flight, fraction, recompute=self.recompute, unit_share=unit_share,
                            zero=self.zero_of(group), foreach=device is not None and runs_foreach(device))

    def group_speed(self, group: tuple[Device, ...]) -> float:
        """Samples per ms: a tensor-parallel group is as fast as its slowest shard. A stage that
        FlopCounterMode counts no FLOPs for (an embedding lookup) still shares by device speed."""
        flops = max(training_flops(self.cost, self.recompute), 1.0)
        return min(device_tflops(d, self.cost.precision) * 1e9 / (flops * f)
                   for d, f in zip(group, self.shards.fractions))

    def group_fixed_ms(self, group: tuple[Device, ...], micro_batches: int) -> float:
        """The ms a worker of ``group`` spends per micro-batch whatever its samples (the slowest of
        the group): its optimizer update (:func:`planner.devices.cost_model.update_ms`) over the
        step's ``micro_batches``, and the launch cost of its forward and backward actions
        (``Device.measured_action_overhead_us``). 0 without a profile's rates."""
        return max(update_ms(self.cost, f, self.zero_of(group), d) / micro_batches
                   + 2 * (d.measured_action_overhead_us or 0.0) * 1e-3
                   for d, f in zip(group, self.shards.fractions))

    def group_cap(self, group: tuple[Device, ...]) -> int:
        """The most samples per micro-batch every device of ``group`` holds (-1: not even the weights)."""
        return min(self.memory(f, self.shards.unit_share(t), group, d).max_samples(d.memory_gib * GIB)
                   for t, (d, f) in enumerate(zip(group, self.shards.fractions)))

    def group_util(self, group: tuple[Device, ...], samples: int) -> float:
        """The highest memory use / capacity over ``group``'s devices with ``samples`` per micro-batch."""
        return max(self.memory(f, self.shards.unit_share(t), group, d).total(samples) / (d.memory_gib * GIB)
                   for t, (d, f) in enumerate(zip(group, self.shards.fractions)))


class StageMemoryError(PlanError):
    """Stage ``stage``'s devices cannot hold what :func:`memory_error` says (a PlanError that names the
    stage, so :func:`planner.decisions.aware_decisions` knows which stage's ZeRO stage to raise)."""

    def __init__(self, message: str, stage: int):
        super().__init__(message)
        self.stage = stage


class StageDoesNotFit(Exception):
    """A micro-batch of ``micro_batch`` samples leaves ``shortfall`` samples of ``stage`` without
    room; its devices hold ``capacity`` (:func:`shortfall_error` explains it to the user)."""

    def __init__(self, stage: PricedStage, shortfall: int, capacity: int, micro_batch: int):
        self.stage, self.shortfall, self.capacity, self.micro_batch = stage, shortfall, capacity, micro_batch


# -- hardware-aware sizes --------------------------------------------------------------------------
def fit_pipeline(layout: Layout, stages: list[PricedStage], micro_batch: int, count: int) -> list:
    """``Decisions.sizes``: per replica, stage and group, ``count`` equal micro-batches of
    ``micro_batch`` samples split by throughput. Raises :class:`StageDoesNotFit`."""
    for st in stages:
        check_fit(layout, st, samples=0)
        caps = [st.group_cap(g) for g in layout.stage_groups(st.index)]
        if min(caps) < 1:
            raise StageDoesNotFit(st, micro_batch - sum(caps), sum(caps), micro_batch)
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
        raise StageDoesNotFit(tightest, e.shortfall, e.capacity, micro_batch) from None
    sizes = []
    for r, replica in enumerate(layout.groups):
        per_stage = []
        for st in stages:
            groups = replica[st.index]
            shares = group_shares(st, groups, per_replica[r], micro_batch)
            per_stage.append([[n] * count for n in shares])
        sizes.append(per_stage)
    return sizes


def group_shares(st: PricedStage, groups, samples: int, micro_batch: int, micro_batches: int = 0) -> list[int]:
    """``samples`` over ``groups`` of stage ``st`` by speed, memory-balanced (Whale's Algorithm 1).
    ``micro_batches`` > 0 (a single stage, every group running that many per step): the shares
    equalise each group's whole time per micro-batch, its fixed part included
    (:meth:`PricedStage.group_fixed_ms`: a device that updates slower gets fewer samples); 0: work
    over speed alone (a pipeline's stages, whose updates run after the flush).
    Raises :class:`StageDoesNotFit` (for a micro-batch of ``micro_batch`` samples)."""
    slots = [Slot(st.group_speed(g), st.group_cap(g), st.group_fixed_ms(g, micro_batches) if micro_batches else 0.0)
             for g in groups]
    try:
        return balanced_shares(samples, slots, lambda i, n: st.group_util(groups[i], n))
    except DoesNotFit as e:
        raise StageDoesNotFit(st, e.shortfall, e.capacity, micro_batch) from None


def fit_single_stage(layout: Layout, st: PricedStage, gbs: int, m: int) -> tuple[list, int]:
    """``(Decisions.sizes, micro-batch count)`` of a single stage: shares of each of ``m``
    near-equal micro-batches; if they do not fit, Poplar's per-device gradient accumulation over
    the whole batch. With ``m`` 1 every worker runs one micro-batch, priced so (under ZeRO 1-2 it
    holds less: :class:`planner.devices.memory.ZeroShards` ``single``); accumulating workers are priced
    as such."""
    first = one_micro_batch(st) if m == 1 else st
    check_fit(layout, first, samples=1)
    groups = layout.stage_groups(0)
    try:
        per_group = _by_group([group_shares(first, groups, n, n, m) for n in equal_batches(gbs, m)])
        count = m
    except StageDoesNotFit:
        check_fit(layout, st, samples=1)
        speeds = [st.group_speed(g) for g in groups]
        # the update once per step and one micro-batch's launches (the rest follow how many micro-batches each
        # device then runs, not known here)
        totals = proportional_shares(gbs, speeds, minimum=1, fixed=[st.group_fixed_ms(g, 1) for g in groups])
        check_accumulation(layout, st, totals, groups, gbs)
        per_group = [accumulation_sizes(n, st.group_cap(g)) for n, g in zip(totals, groups)]
        count = max(len(f) for f in per_group)
        log.warning("the global batch does not fit in %d micro-batch(es); per-device gradient accumulation "
                    "(Poplar): up to %d micro-batches", m, count)
    return single_stage_sizes(layout, per_group), count


def one_micro_batch(st: PricedStage) -> PricedStage:
    """``st`` priced for workers that run one micro-batch per step (``ZeroShards.single``)."""
    if not st.zero.stage or st.zero.single:
        return st
    return dataclasses.replace(st, zero=dataclasses.replace(st.zero, single=True))


def fit_equal_counts(layout: Layout, st: PricedStage, gbs: int, m: int, comm_ms: Callable[[int], float]
                     ) -> tuple[list, int]:
    """``(Decisions.sizes, micro-batch count)`` of a single stage under ZeRO stage 2 or 3, whose
    every micro-batch issues collectives over the data-parallel group (a reduce-scatter; at stage 3
    also the all-gathers), so every group runs the same number ``k`` of micro-batches, larger ones on
    faster devices, each within its device's memory.

    Poplar's Algorithm 2 searches the time ``t`` one micro-step takes and gives each device the
    largest micro-batch it computes in ``t``; here the search is over ``k``, which ``t`` determines
    (``k = gbs / sum of the micro-batches``), so each candidate is priced exactly as Poplar prices
    one: for each ``k`` from ``num_micro_batch`` (``m``) upward, at least the count whose micro-batches
    the devices hold at all (``gbs / sum of caps``), the shares are speed-proportional (each at least
    ``k``: a sample per micro-batch), moved off devices whose ``k`` micro-batches would not fit by
    Whale's memory balancing (:func:`~planner.shares.batch_shares.balance_memory`, caps ``k`` times
    the device's micro-batch cap), each share cut into ``k`` near-equal micro-batches, and the step
    priced as the sum over micro-steps of the slowest group's compute plus ``comm_ms(k)``, the
    group's ZeRO collectives per step (:meth:`planner.devices.cost_model.CommModel.zero_ms`, on the
    network model). The fastest wins (ties: fewer micro-batches). The search stops at the count
    whose speed-proportional shares fit unbalanced (more micro-batches only add collectives) or as
    soon as ``comm_ms(k)`` plus the ideal compute exceeds the best step found; beyond 64 candidate
    counts it tries the first 32 and then every 25% more (bounded work for any global batch).
    Raises PlanError when no count fits."""
    check_fit(layout, st, samples=1)
    groups = layout.stage_groups(st.index)
    speeds = [st.group_speed(g) for g in groups]
    caps = [st.group_cap(g) for g in groups]
    most = min(gbs // len(groups), MAX_MICRO_BATCHES)
    low = max(m, -(-gbs // sum(caps)))
    where = f"TaskGraph {layout.shapes[st.index].taskgraph} under ZeRO stage {st.zero.stage}"
    if low > MAX_MICRO_BATCHES:
        tightest = groups[min(range(len(groups)), key=lambda i: caps[i])][0]
        raise PlanError(
            f"global_batch_size {gbs} does not fit {where}: every device runs the same number of micro-batches, and "
            f"device {tightest.name!r} would accumulate gradients over {low} micro-batches, more than the "
            f"{MAX_MICRO_BATCHES} the planner schedules per step (its devices hold {sum(caps)} samples at once in "
            f"all, so no global batch above {sum(caps) * MAX_MICRO_BATCHES} can fit at this ZeRO stage); use a "
            "smaller global_batch_size or add devices"
        )
    if low > most:
        raise PlanError(
            f"global_batch_size {gbs} does not fit {where}: its {len(groups)} data-parallel groups hold {sum(caps)} "
            f"samples per micro-batch in all, so it needs at least {low} micro-batches, but every group runs each "
            f"of them with at least one sample, so at most {most} fit; use global_batch_size >= {len(groups) * low} "
            f"or <= {sum(caps) * most}, or devices with more memory"
        )
    ideal = proportional_shares(gbs, speeds, minimum=1)
    free = min(max(low, max(-(-n // c) for n, c in zip(ideal, caps))), most)
    floor_ms = gbs / sum(speeds)
    best = None
    for k in _counts_to_try(low, free):
        shares = _equal_count_shares(st, groups, speeds, caps, gbs, k)
        if shares is None:
            continue
        sizes = [equal_batches(n, k) for n in shares]
        compute = sum(max(size[j] / v for size, v in zip(sizes, speeds)) for j in range(k))
        comm = comm_ms(k)
        if best is None or compute + comm < best[0] * (1 - 1e-9):
            best = (compute + comm, sizes, k)
        if comm + floor_ms >= best[0]:
            break
    if best is None:   # the largest count the search stops at always fits; here for safety
        raise memory_error(layout, st.index, st.cost, st.in_flight, groups, st.shards, 1, st.recompute, st.zero_of)
    _, per_group, count = best
    if count != m:
        log.info("ZeRO stage %d: every device runs %d micro-batches (num_micro_batch %d)", st.zero.stage, count, m)
    return single_stage_sizes(layout, per_group), count


def _counts_to_try(low: int, high: int) -> list[int]:
    """The micro-batch counts :func:`fit_equal_counts` prices: all of ``low..high`` up to 64 of
    them, else the first 32 and then every 25% more, ``high`` last."""
    if high - low < 64:
        return list(range(low, high + 1))
    counts = list(range(low, low + 32))
    k = counts[-1]
    while k < high:
        k = min(high, max(k + 1, math.ceil(k * 1.25)))
        counts.append(k)
    return counts


def _equal_count_shares(st: PricedStage, groups, speeds: list[float], caps: list[int], gbs: int, k: int):
    """Each group's samples per step when every group runs ``k`` micro-batches of at most its cap:
    speed-proportional (at least ``k`` each), memory-balanced; None when they cannot fit."""
    slots = [Slot(v, k * c) for v, c in zip(speeds, caps)]
    try:
        shares = proportional_shares(gbs, speeds, minimum=k)
        return balance_memory(shares, slots, lambda i, n: st.group_util(groups[i], -(-n // k)))
    except (DoesNotFit, ValueError):
        return None


def check_accumulation(layout: Layout, st: PricedStage, totals: list[int], groups, gbs: int) -> None:
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


# -- capacity-blind sizes --------------------------------------------------------------------------
def equal_sizes(layout: Layout, gbs: int, m: int) -> list:
    """``Decisions.sizes`` of the naive plan: equal shares of every micro-batch, whatever fits."""
    if layout.num_stages == 1:
        groups = layout.stage_groups(0)
        per_batch = [proportional_shares(n, [1.0] * len(groups), minimum=1) for n in equal_batches(gbs, m)]
        return single_stage_sizes(layout, _by_group(per_batch))
    per_replica = proportional_shares(gbs // m, [1.0] * layout.num_replicas, minimum=1)
    return [
        [[[n] * m for n in proportional_shares(per_replica[r], [1.0] * len(replica[s]), minimum=1)]
         for s in range(layout.num_stages)]
        for r, replica in enumerate(layout.groups)
    ]


# -- memory errors ---------------------------------------------------------------------------------
def check_fit(layout: Layout, st: PricedStage, samples: int) -> None:
    """Every device must hold its share of the weights, gradients and optimizer state, plus
    ``samples`` samples per micro-batch."""
    for group in layout.stage_groups(st.index):
        if st.group_cap(group) < samples:
            raise memory_error(layout, st.index, st.cost, st.in_flight, [group], st.shards, samples, st.recompute,
                               st.zero_of)


def memory_error(layout: Layout, s: int, cost: StageCost, in_flight: int, groups, shards: ShardLayout | None,
                 samples: int, recompute: bool = False,
                 zero: "ZeroShards | Callable[[tuple[Device, ...]], ZeroShards]" = NO_ZERO) -> StageMemoryError:
    """Why stage ``s`` does not fit on the tightest device of ``groups`` with ``samples`` samples
    per micro-batch (its shard of ``shards``, or an even one; ``recompute``: priced with activation
    checkpointing, ``zero``: under its ZeRO stage, or per group under ragged shards
    (:meth:`PricedStage.zero_of`), which the message then says): what it needs and what it lacks."""
    zero_of = zero if callable(zero) else (lambda group: zero)
    worst = None
    for group in groups:
        mine = zero_of(group)
        for t, d in enumerate(group):
            f = shards.fractions[t] if shards else 1.0 / len(group)
            need = stage_memory(cost, in_flight, f, recompute=recompute, unit_share=shards.unit_share(t) if shards else None,
                                zero=mine, foreach=runs_foreach(d)).total(samples)
            short = need - d.memory_gib * GIB
            if worst is None or short > worst[0]:
                worst = (short, need, d, mine)
    short, need, device, held = worst
    what = "weights, gradients and optimizer state" + (" with one sample in flight" if samples else "")
    what += ", recomputing its activations (activation checkpointing)," if recompute and samples else ""
    what += f" under ZeRO stage {held.stage} over {held.group} workers" if held.stage else ""
    what += f" with ragged shards (its fraction of the state {held.fraction:.2%})" if held.ragged else ""
    return StageMemoryError(
        f"TaskGraph {layout.shapes[s].taskgraph} (stage {s}, {layout.shapes[s].label}) does not fit on device "
        f"{device.name!r} ({device.kind}, {human_bytes(device.memory_gib * GIB)}): its {what} need {human_bytes(need)}, "
        f"short by {human_bytes(max(short, 0))} ({max(short, 0):,.0f} bytes); shard it with split(n) over more "
        "devices, or use devices "
        "with more memory", s)


def shortfall_error(layout: Layout, err: StageDoesNotFit, m: int, gbs: int, tried: int) -> PlanError:
    """Why the first micro-batch count tried (``m``) does not fit; ``tried``: the largest count tried."""
    st = err.stage
    per_sample = st.memory(1.0).activations(1)   # the whole stage's, per sample
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
    if st.recompute:
        limit += (" even with activation checkpointing (the stage recomputes its activations layer by layer "
                  "and keeps only its boundary buffers and its layers' inputs per micro-batch in flight)")
    return PlanError(
        f"TaskGraph {layout.shapes[st.index].taskgraph} (stage {st.index}) does not fit: a micro-batch of "
        f"{err.micro_batch} samples needs {human_bytes(err.shortfall * per_sample)} more activation memory than "
        f"its devices have (short by {err.shortfall * per_sample / GIB:.2f} GiB){limit}; at most {fits} samples "
        f"per micro-batch fit (global_batch_size <= {fits * m} with num_micro_batch={m}), or add {more} more "
        f"{best[0].kind} device(s) to the stage"
    )
