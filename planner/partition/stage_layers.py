"""Which layers each pipeline stage runs.

Stages start as the user's TaskGraphs, in order. The planner may move the boundary between two
adjacent stages only when both are plain ``replicate`` (data parallel, no ``split``): their layers
run unchanged on any device, while a ``split`` stage's operators were chosen for sharding and must
stay together. Each maximal run of adjacent movable stages is re-partitioned by the pipeline
partitioner (:mod:`planner.partition.solve`) so that the step, its stages on their device groups, is
as fast as possible within memory: the partitioner's ``"step"`` objective, ``sum + (m - 1) * max`` of
the stage times over the ``m`` micro-batches of a step, not the slowest stage alone (with one
micro-batch the stages run one after the other: a split that shaved the slowest stage by moving a
layer from two fast devices onto one slow one made a ResNet's step slower than the naive split,
issue 30). The naive plan instead gives the stages of a run equal layer counts.
"""
from __future__ import annotations

import logging
from typing import NamedTuple

from whalelike.cluster import Network
from whalelike.config import Config
from whalelike.graphs.taskgraph import TaskGraphs

from planner.devices.cost_model import GIB, device_tflops
from planner.devices.network import BYTES_PER_MS_PER_GBPS, NetworkModel
from planner.partition.solve import (
    DeviceMemory, PartitionInfeasible, PartitionProblem, StageLink, StageSlot, layer_costs, partition,
)
from planner.devices.placement import Layout

log = logging.getLogger(__name__)


def taskgraph_layers(graphs: TaskGraphs) -> list[list[int]]:
    return [sorted(tg.layers) for tg in graphs]


def movable_runs(graphs: TaskGraphs) -> list[list[int]]:
    """Maximal runs of adjacent stage indices whose boundaries may move (all plain replicate)."""
    runs: list[list[int]] = []
    for tg in graphs:
        plain = tg.strategy.kind == "replicate" and tg.strategy.inner is None
        if plain and runs and runs[-1][-1] == tg.index - 1 and _plain(graphs[tg.index - 1]):
            runs[-1].append(tg.index)
        else:
            runs.append([tg.index])
    return [r for r in runs if len(r) > 1]


def _plain(tg) -> bool:
    return tg.strategy.kind == "replicate" and tg.strategy.inner is None


def equal_stage_layers(graphs: TaskGraphs, layout: Layout) -> list[list[int]]:
    """The naive split: equal layer counts (extra layers to the earliest stages) within each run."""
    layers = taskgraph_layers(graphs)
    for run in movable_runs(graphs):
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


def partition_stage_layers(graphs: TaskGraphs, layout: Layout, config: Config, network: Network,
                           in_force: list[list[int]] | None = None) -> StageLayers:
    """The hardware-aware split (:class:`StageLayers`).

    The whole pipeline is one partition problem (stage ``k`` on replica 0's device groups of
    stage ``k``; every replica has devices of the same classes), with the layers of stages that
    may not move pinned to their stage, and the first and last layer of every run pinned to keep
    them out of a neighbouring fixed stage, under the partitioner's ``"step"`` objective (the step
    of the schedule over ``Config.num_micro_batch`` micro-batches; its split is not proven optimal,
    gap None). When the partition is infeasible at this micro-batch size, the user's boundaries
    stand (or ``in_force``, a re-plan's layers in force), ``partitioned`` False, and the memory
    balancer reports what does not fit.
    """
    layers = taskgraph_layers(graphs)
    if layout.num_stages == 1 or not movable_runs(graphs):
        return StageLayers(layers, "greedy", 0.0, True)
    movable = {s for run in movable_runs(graphs) for s in run}
    pinned: dict[int, int] = {}
    for s, stage_layers in enumerate(layers):
        if s not in movable:
            keep = stage_layers
        else:  # a run's outer layers stay, so no layer crosses into a fixed stage
            keep = ([stage_layers[0]] if s - 1 not in movable else []) + (
                [stage_layers[-1]] if s + 1 not in movable else [])
        pinned.update({i: s for i in keep})
    order = [i for stage_layers in layers for i in stage_layers]
    slots = [_slot(layout, s, config.precision) for s in range(layout.num_stages)]
    links = [_link(layout, s, network) for s in range(layout.num_stages - 1)]
    micro_batch = config.global_batch_size / (config.num_micro_batch * layout.num_replicas)
    problem = PartitionProblem.for_schedule(
        layer_costs(graphs, order, config.precision), slots, links, micro_batch, config.num_micro_batch, config.schedule,
        pinned={order.index(i): s for i, s in pinned.items()}, objective="step",
    )
    try:
        result = partition(problem)
    except PartitionInfeasible as e:
        log.warning("pipeline partition infeasible at %g samples per micro-batch (%s); keeping the %s",
                    micro_batch, e, "TaskGraph boundaries" if in_force is None else "layers in force")
        return StageLayers(layers if in_force is None else in_force, "greedy", None, False)
    return StageLayers([[order[i] for i in stage] for stage in result.stage_layers()], result.solver, result.gap, True)


def _slot(layout: Layout, stage: int, precision: str = "fp32") -> StageSlot:
    """Replica 0's groups of ``stage`` as one partition slot: every data-parallel group takes a
    batch share proportional to its speed, every device of a tensor-parallel group a shard
    proportional to its own speed at the training ``precision``, of every memory term and of the group's activations
    (:meth:`DeviceMemory.of_worker`: the memory model's rule, as the batch fitting prices a shard)."""
    groups = layout.groups[0][stage]
    speeds = [[device_tflops(d, precision) * 1e12 for d in g] for g in groups]
    total = sum(map(sum, speeds))
    devices = tuple(
        DeviceMemory.of_worker(d.memory_gib * GIB, shard=v / sum(gs), batch_share=sum(gs) / total, name=d.name)
        for g, gs in zip(groups, speeds) for d, v in zip(g, gs)
    )
    return StageSlot(f"stage {stage}", total, devices)


def _link(layout: Layout, stage: int, network: Network) -> StageLink:
    """The link the partitioner prices stage ``stage``'s activations on: the slowest link between
    a host of replica 0's stage ``stage`` and one of stage ``stage + 1``
    (:meth:`planner.devices.network.NetworkModel.host_link`: intra-host when they share a host)."""
    senders = {d.host for g in layout.groups[0][stage] for d in g}
    receivers = {d.host for g in layout.groups[0][stage + 1] for d in g}
    model = NetworkModel.of_hosts(network.intra_host_gbps, network.inter_host_gbps, network.latency_us,
                                  sorted(senders | receivers))
    slowest = min((model.host_link(a, b) for a in sorted(senders) for b in sorted(receivers)), key=lambda l: l.gbps)
    return StageLink(slowest.gbps * BYTES_PER_MS_PER_GBPS * 1e3, slowest.latency_ms * 1e-3)
