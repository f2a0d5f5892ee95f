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

import contextlib
import dataclasses
import itertools
import logging

from whalelike.cluster import Cluster
from whalelike.config import Config
from whalelike.graphs.taskgraph import TaskGraphs

from planner.assemble import build_plan, predict
from planner.decisions import Decisions, aware_decisions
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
    2.4x faster; a small model on two fast devices and two slow ones: the boundaries 7% faster).
    Then a stage the decisions raised to a higher ZeRO stage to fit is simulated recomputing instead,
    at the lowest ZeRO stage that then fits (:func:`_recompute_instead`), and the faster kept."""
    decisions = aware_decisions(graphs, config, layout, cluster.network)
    best = _planned(graphs, cluster, config, layout, decisions), decisions
    if decisions.resplit:
        with contextlib.suppress(PlanError):   # recomputing on the boundaries may not fit: the re-split stands
            again = aware_decisions(graphs, config, layout, cluster.network, resplit=False)
            best = min(best, (_planned(graphs, cluster, config, layout, again), again), key=_step_ms)
    return _recompute_instead(graphs, cluster, config, layout, *best)


def _planned(graphs: TaskGraphs, cluster: Cluster, config: Config, layout: Layout, decisions: Decisions) -> Candidate:
    """The plan of ``decisions`` and its prediction, as a :data:`Candidate`."""
    plan = build_plan(graphs, cluster, config, decisions)
    return predict(plan, cluster), plan, layout


def _step_ms(option: tuple[Candidate, Decisions]) -> float:
    return option[0][0].step_time_ms


def _recompute_instead(graphs: TaskGraphs, cluster: Cluster, config: Config, layout: Layout, best: Candidate,
                       decisions: Decisions) -> Candidate:
    """``best``, or the same split with recomputing in place of a higher ZeRO stage, whichever the
    simulator predicts faster.

    The decisions fit a stage that does not hold its micro-batches by raising its ZeRO stage first
    (Poplar's escalation) and recompute only as the last resort. Both free memory at a price: ZeRO 3
    re-gathers each layer's parameters before its forward and again before its backward, every
    micro-batch, and ZeRO 2 reduce-scatters the gradients every micro-batch, where ZeRO 0-1 communicate
    once a step, the parameters kept gathered through it (FSDP2 with ``reshard_after_forward=False``,
    torchtitan's default under pipelining); recomputing runs each layer's forward twice. Which costs
    less depends on the links and the devices' speed,
    so each stage raised to fit (``zero_reason`` ``"fit"``, not recomputing) is planned once more
    recomputing first (``aware_decisions(recompute_first=...)``: reason ``"faster"``), all such stages
    together and, when there are several, each alone; an alternative whose ZeRO stages are not lower
    cannot be faster and is not simulated."""
    raised = [s for s in range(layout.num_stages)
              if decisions.zero_reason and decisions.zero_reason[s] == "fit" and not decisions.recomputes(s)]
    if not raised:
        return best
    escalated_ms = best[0].step_time_ms
    for stages in [raised] + ([[s] for s in raised] if len(raised) > 1 else []):
        with contextlib.suppress(PlanError):   # recomputing first may not fit: the ZeRO stage stands
            other = aware_decisions(graphs, config, layout, cluster.network, stage_layers=decisions.stage_layers,
                                    recompute_first=stages)
            if not any(other.zero_stage(s) < decisions.zero_stage(s) for s in stages):
                continue
            other = dataclasses.replace(other, solver=decisions.solver, optimality_gap=decisions.optimality_gap,
                                        kept_work=decisions.kept_work, resplit=decisions.resplit)
            candidate = _planned(graphs, cluster, config, layout, other)
            log.info("stage(s) %s: ZeRO stage(s) %s predicted %.4g ms a step, recomputing at ZeRO stage(s) %s "
                     "%.4g ms", stages, [decisions.zero_stage(s) for s in stages], escalated_ms,
                     [other.zero_stage(s) for s in stages], candidate[0].step_time_ms)
            best = min(best, candidate, key=lambda c: c[0].step_time_ms)
    return best


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
