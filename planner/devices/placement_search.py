"""The search over device placements: which of :mod:`planner.devices.placement`'s layouts plans fastest.

:func:`planner.devices.placement.build_layout` deals devices to stages by a rule (Whale's
memory-first, or speed-first); which rule is better depends on the model, so every rule that fits
is planned and simulated (:func:`best_aware_plan`), and the fastest is then improved by exchanging
the devices of two stages (:func:`swap_search`). Each candidate is the full hardware-aware plan
(:func:`planner.decisions.aware_decisions`, :func:`planner.assemble.build_plan`) priced by the
simulator (:func:`planner.assemble.predict`), so a placement is kept only when the prediction says so.
Two rules that deal the same devices (a cluster of one device kind) give one layout, planned once:
planning is a pure function of the layout, so the plan and its prediction would be the same.
"""
from __future__ import annotations

import itertools
import logging

from whalelike.cluster import Cluster
from whalelike.config import Config
from whalelike.graphs.taskgraph import TaskGraphs

from planner.assemble import build_plan, predict
from planner.decisions import aware_decisions
from planner.devices.placement import PLACEMENTS, Layout, build_layout, fold_layout
from planner.partition.stage_layers import movable_runs
from planner.plan import Plan, PlanError, Prediction
from planner.shares.batch_fit import check_batch

log = logging.getLogger(__name__)

MAX_SWAP_STAGES = 8   # longest pipeline whose stage-device assignment is searched by swaps

Candidate = tuple[Prediction, Plan, Layout]


def best_aware_plan(graphs: TaskGraphs, cluster: Cluster, config: Config,
                    fold: list[list[int]] | None = None,
                    shared: list[list[int]] | None = None,
                    counts: dict[int, int] | None = None) -> tuple[Prediction, Plan]:
    """The fastest predicted hardware-aware plan and its prediction: one per device placement that
    fits (:data:`~planner.devices.placement.PLACEMENTS`), the best improved by :func:`swap_search`.
    ``fold``: runs of adjacent stages (one per TaskGraph, by index) each placement's layout runs as
    one stage on the union of their devices (:func:`~planner.devices.placement.fold_layout`,
    :mod:`planner.candidates`). ``shared``: the stages of a cluster smaller than the regions ask
    (:func:`~planner.devices.placement.shared_device_groups`). ``counts``: devices per automatic
    stage (:func:`planner.candidates.count_search`). Raises the error of the Whale-rule placement when
    none fits."""
    scored, first_error, tried = [], None, []
    for placement in PLACEMENTS:
        try:
            layout = build_layout(graphs, cluster, placement, config.precision, shared=shared, counts=counts)
            if fold is not None:
                layout = fold_layout(layout, fold)
            if fold is not None or shared is not None or counts is not None:
                check_batch(config, layout)   # a folded stage has more data-parallel groups to feed
            if layout in tried:   # both rules dealt the same devices: the same plan, planned once
                continue
            tried.append(layout)
            scored.append(aware_plan(graphs, cluster, config, layout))
        except PlanError as e:
            first_error = first_error or e
    if not scored:
        raise first_error
    prediction, best, _ = swap_search(graphs, cluster, config, min(scored, key=lambda c: c[0].step_time_ms))
    return prediction, best


def aware_plan(graphs: TaskGraphs, cluster: Cluster, config: Config, layout: Layout) -> Candidate:
    """(prediction, plan, layout) of the hardware-aware decisions on ``layout``. Raises PlanError
    when they do not fit. Decisions made on the split priced recomputing (the decisions' last resort,
    ``Decisions.resplit``) are simulated against recomputing on the TaskGraph boundaries instead, and
    the faster kept: which one wins depends on the devices (7B Llama on H100s and A100s: the re-split
    2.4x faster; a small model on two fast devices and two slow ones: the boundaries 7% faster)."""
    decisions = aware_decisions(graphs, config, layout, cluster.network)
    plan = build_plan(graphs, cluster, config, decisions)
    prediction = predict(plan, cluster)
    if decisions.resplit:
        try:
            other = build_plan(graphs, cluster, config, aware_decisions(graphs, config, layout, cluster.network,
                                                                          resplit=False))
        except PlanError:
            return prediction, plan, layout
        other_prediction = predict(other, cluster)
        if other_prediction.step_time_ms < prediction.step_time_ms:
            return other_prediction, other, layout
    return prediction, plan, layout


def swap_search(graphs: TaskGraphs, cluster: Cluster, config: Config, best: Candidate) -> Candidate:
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
    runs = movable_runs(graphs, best[2])
    improved = True
    while improved:
        improved = False
        for a, b in itertools.combinations(range(stages), 2):
            if not best[2].can_swap(a, b) or any(a in run and b in run for run in runs):
                continue
            try:
                candidate = aware_plan(graphs, cluster, config, best[2].swapped(a, b))
            except PlanError:
                continue
            if candidate[0].step_time_ms < best[0].step_time_ms * (1 - 1e-6):
                log.debug("exchanging the devices of stages %d and %d: %.2f -> %.2f ms", a, b,
                          best[0].step_time_ms, candidate[0].step_time_ms)
                best, improved = candidate, True
                break
    return best
