"""Each pipeline stage's shard layout as the planner decides it (step 3 of :mod:`planner.api`).

A stage runs the layers of one or more TaskGraphs; what it can shard is their shardable modules
and shard groups (:func:`stage_shardable`, the one place that gathers them: the planner's pricing,
re-plans that keep a plan's shard sizes, and the simulator's gradient buckets all read it). A
``split`` region must shard something and be no wider than its narrowest group
(:func:`check_shardable`). The hardware-aware layout is proportional to the summed speed at each
tensor-parallel index, within memory (:func:`aware_shards`); the naive one is even
(:func:`planner.shares.shard_sizes.even_layout`). The sizes themselves come from
:mod:`planner.shares.shard_sizes`.
"""
from __future__ import annotations

from whalelike.graphs.taskgraph import TaskGraphs
from whalelike.sharding.groups import WHAT_SPLIT_SHARDS, ShardGroup

from planner.devices.cost_model import GIB, StageCost, device_tflops
from planner.devices.memory import NO_ZERO, ZeroShards, max_shard, runs_foreach
from planner.devices.placement import Layout
from planner.plan import PlanError
from planner.shares.batch_fit import memory_error
from planner.shares.batch_shares import DoesNotFit
from planner.shares.shard_sizes import ShardLayout, groups_of, shard_layout


def stage_shardable(graphs: TaskGraphs, layers) -> tuple[list, dict[str, int], tuple[ShardGroup, ...]]:
    """``(owners, shardable, groups)`` of a stage running ``layers``: the TaskGraphs its layers
    belong to (by index), their shardable module paths with the size of the split dimension, and
    their shard groups."""
    owners = [graphs[t] for t in sorted({graphs.layers[i].taskgraph for i in layers})]
    shardable = {p: d for tg in owners for p, d in tg.shardable.items()}
    groups = tuple(g for tg in owners for g in tg.shard_groups)
    return owners, shardable, groups


def check_shardable(layout: Layout, s: int, owners, shardable, groups) -> None:
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


def aware_shards(layout: Layout, s: int, cost: StageCost, in_flight: int, shardable, shard_groups,
                 samples: int, recompute: bool = False, zero: ZeroShards = NO_ZERO) -> ShardLayout:
    """Shards proportional to the summed speed at each tensor-parallel index, capped so that each
    device holds its shard with ``samples`` samples in flight (``recompute``: under activation
    checkpointing; ``zero``: under its data-parallel group's ZeRO stage, :mod:`planner.devices.memory`),
    or failing that its weights alone (the batch balancer then finds out how many samples fit)."""
    groups = layout.stage_groups(s)
    tp = layout.shapes[s].tp
    speeds = [sum(device_tflops(g[t], cost.precision) for g in groups) for t in range(tp)]
    for n in (samples, 0):
        max_fractions = [min(max_shard(cost, in_flight, n, g[t].memory_gib * GIB, recompute, zero, runs_foreach(g[t]))
                             for g in groups)
                         for t in range(tp)]
        try:
            return shard_layout(shardable, speeds, max_fractions, shard_groups, cost.flops_per_sample)
        except DoesNotFit:
            continue
    raise memory_error(layout, s, cost, in_flight, groups, None, samples=0, zero=zero)


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
