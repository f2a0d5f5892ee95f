"""Which layers each pipeline stage runs.

Stages start as the user's TaskGraphs, in order (a stage folded from adjacent regions,
:func:`planner.devices.placement.fold_layout`, from all of theirs). The planner may move the
boundary between two adjacent stages only when both are plain ``replicate`` (data parallel, no
``split``): their layers run unchanged on any device, while a ``split`` stage's operators were
chosen for sharding and must stay together. Each maximal run of adjacent movable stages is
re-partitioned by the pipeline partitioner (:mod:`planner.partition.solve`) so that the step, its
stages on their device groups, is as short as possible within memory: the partitioner's ``"step"``
objective, the schedule's action lists over the ``m`` micro-batches of a step, not the slowest stage
alone (with one micro-batch the stages run one after the other: a split that shaved the slowest
stage by moving a layer from two fast devices onto one slow one made a ResNet's step slower than the
naive split, issue 30). The naive plan instead gives the stages of a run equal layer counts.

Which regions may fold into one stage (:func:`foldable_runs`): adjacent plain ``replicate`` regions
of automatic device count and equal options (the same ``recompute``, ``zero``, ``sync``): their
layers run unchanged on any device, no count of theirs is the user's, and one stage keeps its
replicas in step one way.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import NamedTuple

from whalelike.cluster import Network
from whalelike.config import Config
from whalelike.graphs.taskgraph import TaskGraphs

from planner.devices.cost_model import GIB, CommModel, device_tflops, zero_collectives
from planner.devices.memory import NO_ZERO, REDUCE_SCATTER_COPIES, ZeroShards, runs_foreach
from planner.devices.network import BYTES_PER_MS_PER_GBPS, NetworkModel
from planner.partition.solve import (
    DeviceMemory, PartitionInfeasible, PartitionProblem, StageLink, StageSlot, layer_costs, partition,
)
from planner.devices.placement import Layout
from planner.shares.batch_shares import proportional_shares

log = logging.getLogger(__name__)


def taskgraph_layers(graphs: TaskGraphs) -> list[list[int]]:
    return [sorted(tg.layers) for tg in graphs]


def home_layers(graphs: TaskGraphs, layout: Layout | None = None) -> list[list[int]]:
    """Each stage's own layers: its TaskGraphs' (one stage per TaskGraph without ``layout``)."""
    if layout is None:
        return taskgraph_layers(graphs)
    return [sorted(i for t in shape.taskgraphs for i in graphs[t].layers) for shape in layout.shapes]


def movable_runs(graphs: TaskGraphs, layout: Layout | None = None) -> list[list[int]]:
    """Maximal runs of adjacent stage indices whose boundaries may move (all plain replicate): of
    ``layout``'s stages (each plain when all its TaskGraphs are), one stage per TaskGraph without it."""
    owners = [shape.taskgraphs for shape in layout.shapes] if layout is not None else [(tg.index,) for tg in graphs]
    runs: list[list[int]] = []
    for s, tgs in enumerate(owners):
        plain = all(_plain(graphs[t]) for t in tgs)
        if plain and runs and runs[-1][-1] == s - 1 and all(_plain(graphs[t]) for t in owners[s - 1]):
            runs[-1].append(s)
        else:
            runs.append([s])
    return [r for r in runs if len(r) > 1]


def _plain(tg) -> bool:
    return tg.strategy.kind == "replicate" and tg.strategy.inner is None


def foldable_runs(graphs: TaskGraphs) -> list[list[int]]:
    """Maximal runs of two or more adjacent TaskGraphs that may fold into one stage (the module
    docstring): plain ``replicate``, automatic device count, equal strategies."""
    runs: list[list[int]] = []
    for tg in graphs:
        mine = _plain(tg) and tg.strategy.device_count is None
        if mine and runs and runs[-1][-1] == tg.index - 1 and graphs[tg.index - 1].strategy == tg.strategy:
            runs[-1].append(tg.index)
        elif mine:
            runs.append([tg.index])
    return [r for r in runs if len(r) > 1]


def equal_stage_layers(graphs: TaskGraphs, layout: Layout) -> list[list[int]]:
    """The naive split: equal layer counts (extra layers to the earliest stages) within each run."""
    layers = home_layers(graphs, layout)
    for run in movable_runs(graphs, layout):
        pool = [i for s in run for i in layers[s]]
        base, extra = divmod(len(pool), len(run))
        start = 0
        for k, s in enumerate(run):
            n = base + (1 if k < extra else 0)
            layers[s] = pool[start:start + n]
            start += n
    return layers


class StageLayers(NamedTuple):
    """:func:`partition_stage_layers`' answer: the layers per stage, the solver and its optimality
    gap (None: unknown), and whether the partitioner made them (False: it found no split that fits,
    and the TaskGraph boundaries or the layers in force stand)."""

    layers: list[list[int]]
    solver: str
    gap: float | None
    partitioned: bool
    kept_work: tuple[tuple[int, int], ...] = ()   # (stage, the compute layer pinned to it so that it computes)


def partition_stage_layers(graphs: TaskGraphs, layout: Layout, config: Config, network: Network,
                           in_force: list[list[int]] | None = None, quiet: bool = False,
                           last_resort: bool = False) -> StageLayers:
    """The hardware-aware split (:class:`StageLayers`).

    The whole pipeline is one partition problem (stage ``k`` on replica 0's device groups of
    stage ``k``; every replica has devices of the same classes), with the layers of stages that
    may not move pinned to their stage, and the first and last layer of every run pinned to keep
    them out of a neighbouring fixed stage, under the partitioner's ``"step"`` objective (the step
    of the schedule over ``Config.num_micro_batch`` micro-batches; its split is not proven optimal,
    gap None). When the partition is infeasible at this micro-batch size, the user's boundaries
    stand (or ``in_force``, a re-plan's layers in force), ``partitioned`` False, and the memory
    balancer reports what does not fit (``quiet``: said at debug level, for a caller that tries other
    micro-batch counts first, :func:`planner.decisions.aware_decisions`). Before that, a split no
    stage holds whole is priced under ZeRO 3 and recompute (:func:`_fitting_partition`), except in a
    re-plan, which keeps the ZeRO stages and recompute in force. ``last_resort``: the split priced
    recomputing layer by layer (and sharded under ZeRO 3 where it may) outright, for the decisions'
    last resort (:func:`planner.decisions.aware_decisions`: no split fits otherwise).
    """
    layers = home_layers(graphs, layout)
    runs = movable_runs(graphs, layout)
    if layout.num_stages == 1 or not runs:
        return StageLayers(layers, "greedy", 0.0, True)
    movable = {s for run in runs for s in run}
    pinned: dict[int, int] = {}
    for s, stage_layers in enumerate(layers):
        if s not in movable:
            keep = stage_layers
        else:  # a run's outer layers stay, so no layer crosses into a fixed stage
            keep = ([stage_layers[0]] if s - 1 not in movable else []) + (
                [stage_layers[-1]] if s + 1 not in movable else [])
        pinned.update({i: s for i in keep})
    order = [i for stage_layers in layers for i in stage_layers]
    micro_batch = config.global_batch_size / (config.num_micro_batch * layout.num_replicas)
    slots = [_slot(layout, s, config.precision, micro_batch, network) for s in range(layout.num_stages)]
    links = [_link(layout, s, network) for s in range(layout.num_stages - 1)]
    problem = PartitionProblem.for_schedule(
        layer_costs(graphs, order, config.precision), slots, links, micro_batch, config.num_micro_batch, config.schedule,
        pinned={order.index(i): s for i, s in pinned.items()}, objective="step",
    )
    if last_resort:
        sharded = _sharded_slots(graphs, layout, config, micro_batch, network, order)
        problem = _recomputed(dataclasses.replace(problem, slots=sharded or problem.slots), micro_batch)
    try:
        if in_force is None:
            result, problem = _fitting_partition(problem, graphs, layout, config, micro_batch, network, order)
        else:   # a re-plan keeps the ZeRO stages and recompute in force: the split is priced as they hold
            result = partition(problem)
    except PartitionInfeasible as e:
        (log.debug if quiet else log.warning)(
            "pipeline partition infeasible at %g samples per micro-batch (%s); keeping the %s", micro_batch, e,
            "TaskGraph boundaries" if in_force is None else "layers in force")
        return StageLayers(layers if in_force is None else in_force, "greedy", None, False)
    found = [[order[i] for i in stage] for stage in result.stage_layers()]
    keep = _work_to_keep(graphs, layers, found, movable)
    if keep:
        try:
            again = partition(dataclasses.replace(problem, pinned={**problem.pinned,
                                                                   **{order.index(i): s for s, i in keep.items()}}))
        except PartitionInfeasible as e:
            log.warning("stage(s) %s have nothing to compute in the best split (their layers run on a neighbour) and "
                        "no split that keeps a layer on them fits (%s)", ", ".join(map(str, keep)), e)
            return StageLayers(found, result.solver, result.gap, True)
        log.info("the best split leaves stage(s) %s nothing to compute; each keeps one of its layers (%s) so that its "
                 "devices work, and a plan with it folded into its neighbour is priced too (planner.candidates)",
                 ", ".join(map(str, keep)), ", ".join(f"layer {i}" for i in keep.values()))
        return StageLayers([[order[i] for i in stage] for stage in again.stage_layers()], again.solver, again.gap, True,
                           tuple(sorted(keep.items())))
    return StageLayers(found, result.solver, result.gap, True)


def computes(graphs: TaskGraphs, i: int) -> bool:
    """Whether layer ``i`` has FLOPs to run (glue such as a final norm or a pooling layer has none)."""
    layer = graphs.layers[i]
    return layer.forward_flops + layer.backward_flops > 0


def _work_to_keep(graphs: TaskGraphs, home: list[list[int]], found: list[list[int]], movable: set[int]) -> dict[int, int]:
    """The movable stages ``found`` leaves with nothing to compute while their own layers (``home``)
    have some, each with the compute layer of its own to pin on it: the last when most of its compute
    layers went to the stage before, else the first (the neighbour keeps the rest)."""
    keep = {}
    for s in sorted(movable):
        mine = [i for i in home[s] if computes(graphs, i)]
        if not mine or any(computes(graphs, i) for i in found[s]):
            continue
        upstream = set(found[s - 1]) if s > 0 else set()
        before = sum(1 for i in mine if i in upstream)
        keep[s] = mine[-1] if before * 2 >= len(mine) else mine[0]
    return keep


def _fitting_partition(problem: PartitionProblem, graphs: TaskGraphs, layout: Layout, config: Config,
                       micro_batch: float, network: Network, order: list[int]):
    """``(partition, problem)``: the split of ``problem``, or, when no split holds every stage's state
    whole (weights, gradients and optimizer state, whatever the activations: a model too large for its
    stages, where no micro-batch count helps), the split priced as the ZeRO escalation and the
    recompute choice that follow it may make it fit, as every recipe for such a model does (FSDP and
    activation checkpointing): each stage's state sharded over its data-parallel workers (ZeRO 3,
    layer by layer: :func:`_sharded_slots`), then also recomputing layer by layer
    (:func:`_recomputed`). The ZeRO stage and recompute of each stage are chosen afterwards on the
    split found, the lowest that fit (:mod:`planner.decisions`). A split that fails on activations
    alone raises, as before: more micro-batches are tried first (:func:`planner.decisions._repartitioned`).
    Raises the first :class:`PartitionInfeasible` when none fits."""
    try:
        return partition(problem), problem
    except PartitionInfeasible as first:
        if _holds_state(problem):
            raise
        sharded = _sharded_slots(graphs, layout, config, micro_batch, network, order)
        tries = ([("sharded over its data-parallel workers (ZeRO 3, layer by layer)",
                   dataclasses.replace(problem, slots=sharded))] if sharded is not None else [])
        tries.append(("sharded as far as ZeRO may and recomputing layer by layer",
                      _recomputed(dataclasses.replace(problem, slots=sharded or problem.slots), micro_batch)))
        for how, again in tries:
            try:
                result = partition(again)
            except PartitionInfeasible:
                continue
            log.info("no split fits with every worker holding its stage's whole state and activations; the split is "
                     "priced with each stage's state %s; each stage's ZeRO stage and recompute are then the lowest "
                     "that fit", how)
            return result, again
        raise first


def _holds_state(problem: PartitionProblem) -> bool:
    """Whether some split of ``problem`` holds every stage's weights, gradients and optimizer state
    (its activations and boundary buffers left out)."""
    bare = dataclasses.replace(problem, layers=tuple(dataclasses.replace(l, activation_bytes=0.0, cut_bytes=0.0)
                                                     for l in problem.layers))
    try:
        partition(bare)
    except PartitionInfeasible:
        return False
    return True


def _recomputed(problem: PartitionProblem, micro_batch: float) -> PartitionProblem:
    """``problem`` with every layer recomputing its activations in the backward (per layer, as
    :mod:`runtime.training.recompute` runs a stage): a layer keeps its input per micro-batch in
    flight (the previous layer's output), its backward runs its forward again, and one layer's
    activations of one micro-batch are alive at a time, priced at the largest layer's on every
    device (an upper bound: each device's share of the micro-batch is less)."""
    before = [0.0] + [cost.cut_bytes for cost in problem.layers[:-1]]   # each layer's input
    layers = tuple(dataclasses.replace(cost, backward_flops=cost.backward_flops + cost.forward_flops,
                                       activation_bytes=min(kept, cost.activation_bytes))
                   for cost, kept in zip(problem.layers, before))
    extra = max(cost.activation_bytes for cost in problem.layers) * micro_batch
    slots = [dataclasses.replace(slot, devices=tuple(dataclasses.replace(d, fixed_bytes=d.fixed_bytes + extra)
                                                    for d in slot.devices))
             for slot in problem.slots]
    return dataclasses.replace(problem, layers=layers, slots=slots)


def _sharded_slots(graphs: TaskGraphs, layout: Layout, config: Config, micro_batch: float, network: Network,
                   order: list[int]) -> list[StageSlot] | None:
    """The partition's slots with every stage that ZeRO 3 may shard priced under it (a split that
    fits no other way), or None when no stage may: ``Config.zero_stage`` fixed below 3 or P-Reduce
    (``Config.dp_sync`` 'partial'; a region's own ``zero=`` or ``sync=`` is checked after the split,
    by the ZeRO escalation). A stage of one data-parallel worker per shard, or with tensor-parallel
    slices (one FSDP unit: ZeRO 3 gathers it whole), stays priced whole. A stage's units are its
    layers (``runtime.parallel.stage_units``), each gathered whole while it computes: priced at the
    largest movable layer's parameters, whatever layers the stage takes (an upper bound)."""
    if config.zero_stage not in (None, 3) or config.dp_sync == "partial":
        return None
    sharded = [s for s in range(layout.num_stages)
               if len(layout.stage_groups(s)) > 1 and layout.shapes[s].tp == 1]
    if not sharded:
        return None
    largest = max(float(graphs.layers[i].param_bytes) for i in order)
    return [_slot(layout, s, config.precision, micro_batch, network, zero_unit_bytes=largest if s in sharded else None,
                  micro_batches=config.num_micro_batch)
            for s in range(layout.num_stages)]


def _slot(layout: Layout, stage: int, precision: str = "fp32", micro_batch: float | None = None,
          network: Network | None = None, zero_unit_bytes: float | None = None, micro_batches: int = 1) -> StageSlot:
    """Replica 0's groups of ``stage`` as one partition slot: every data-parallel group takes a
    batch share proportional to its speed, every device of a tensor-parallel group a shard
    proportional to its own speed at the training ``precision``, of every memory term and of the group's activations
    (:meth:`DeviceMemory.of_worker`: the memory model's rule, as the batch fitting prices a shard).

    Its speed, given ``micro_batch`` (samples per micro-batch and replica), is what whole samples
    make it: the batch fitting splits a micro-batch over the data-parallel groups in integers
    (:func:`planner.shares.batch_shares.proportional_shares`), and the stage takes as long as its
    slowest group, ``max(share / speed)``; so the slot's speed is ``micro_batch / max(share / speed)``,
    not the groups' sum. With two or three samples a device the difference is large (64 samples over
    30 equal devices: a share of 3 where 2.13 is the ideal, 1.4x the summed speed's time), and a
    partitioner blind to it piled layers on such a stage (issue 30). Without ``micro_batch``: the sum.

    Given ``network``, also the stage's gradient all-reduce once per step: the ring of its
    data-parallel workers of tensor-parallel index 0 over every replica, as
    :func:`planner.assemble` prices it (:meth:`planner.devices.cost_model.CommModel.allreduce_ms`, linear
    in the bytes), which a stage of many layers on many hosts pays after its last backward.

    Given ``zero_unit_bytes``, each worker holds the stage's state under ZeRO 3 over the stage's
    data-parallel workers: its rows of every term, plus the units FSDP2 holds gathered at once (the
    one computing and the one prefetched, and the gradients of one with their reduce-scatter
    buffers: :class:`planner.devices.memory.ZeroShards`) priced at ``zero_unit_bytes`` each, and its
    collectives are ZeRO 3's instead of the all-reduce: per step, over ``micro_batches``
    micro-batches, an all-gather of the stage's parameters before each forward and each backward and a
    reduce-scatter of its gradients after each backward (:func:`planner.devices.cost_model.zero_collectives`),
    each half an all-reduce's bytes on the ring, priced per byte of the rows a worker holds (the
    gradient bytes the partition's step counts)."""
    groups = layout.groups[0][stage]
    speeds = [[device_tflops(d, precision) * 1e12 for d in g] for g in groups]
    group_speeds = [sum(gs) for gs in speeds]
    total = sum(group_speeds)
    zero, fixed = NO_ZERO, 0.0
    if zero_unit_bytes is not None:
        # the rows alone (a unit of no bytes), then the units' bytes apart: w = f + 2u, g = f + (1 + c) u
        zero = ZeroShards(3, len(layout.stage_groups(stage)), 1e-12)
        fixed = (2 + 1 + REDUCE_SCATTER_COPIES) * zero_unit_bytes
    devices = tuple(
        DeviceMemory.of_worker(d.memory_gib * GIB, shard=v / sum(gs), batch_share=sum(gs) / total, name=d.name,
                               zero=zero, fixed_bytes=fixed, foreach=runs_foreach(d))
        for g, gs in zip(groups, speeds) for d, v in zip(g, gs)
    )
    speed = total
    if micro_batch:
        samples = max(len(groups), math.ceil(micro_batch - 1e-9))
        shares = proportional_shares(samples, group_speeds, minimum=1)
        speed = samples / max(n / v for n, v in zip(shares, group_speeds))
    latency = per_byte = 0.0
    ring = [g[0] for g in layout.stage_groups(stage)]
    if network is not None and len(ring) > 1:
        comm = CommModel(network)
        latency = comm.allreduce_ms(1.0, ring) * 1e-3
        per_byte = (comm.allreduce_ms(float(GIB) + 1.0, ring) * 1e-3 - latency) / GIB
        if zero_unit_bytes is not None:
            gathers, scatters = zero_collectives(3, micro_batches)
            collectives = (gathers + scatters) / 2            # each half an all-reduce's traffic
            latency *= gathers + scatters
            per_byte *= collectives * zero.group               # per byte of the 1/n rows held
    return StageSlot(f"stage {stage}", speed, devices, latency, per_byte)


def _link(layout: Layout, stage: int, network: Network) -> StageLink:
    """The link the partitioner prices stage ``stage``'s activations on: the slowest link between
    a host of replica 0's stage ``stage`` and one of stage ``stage + 1``
    (:meth:`planner.devices.network.NetworkModel.host_link`: intra-host when they share a host), as
    many times as the transfer has lanes: a micro-batch's slices go from each sending worker to the
    receiving ones at once, through every host's own network interface (min(sending hosts, receiving
    hosts) lanes across hosts) or inside one host in parallel (min(sending, receiving devices)). One
    lane for everything, a 64-device stage over 8 hosts sent 8 times slower than the simulator
    does, and the partitioner kept layers off the stages whose sends it overpriced (1024 devices:
    predicted 821 ms a step against 484 ms with the lanes)."""
    senders = {d.host for g in layout.groups[0][stage] for d in g}
    receivers = {d.host for g in layout.groups[0][stage + 1] for d in g}
    model = NetworkModel.of_hosts(network.intra_host_gbps, network.inter_host_gbps, network.latency_us,
                                  sorted(senders | receivers))
    slowest = min((model.host_link(a, b) for a in sorted(senders) for b in sorted(receivers)), key=lambda l: l.gbps)
    if len(senders | receivers) > 1:
        lanes = min(len(senders), len(receivers))
    else:
        lanes = min(sum(len(g) for g in layout.groups[0][stage]), sum(len(g) for g in layout.groups[0][stage + 1]))
    return StageLink(lanes * slowest.gbps * BYTES_PER_MS_PER_GBPS * 1e3, slowest.latency_ms * 1e-3)
