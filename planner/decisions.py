"""The planner's decisions on one device layout (steps 2 to 4 of :mod:`planner.api`), and their record.

:class:`Decisions` is everything the planner chose: which devices run which stage (the
:class:`~planner.devices.placement.Layout`), each stage's layers, its shard layout and each
tensor-parallel group's micro-batch sizes. :mod:`planner.assemble` turns it into a Plan.

* :func:`aware_decisions`, the hardware-aware ones: the pipeline partitioner's stage layers
  (:mod:`planner.partition.stage_layers`), shards proportional to speed within memory
  (:mod:`planner.shares.stage_shards`), batch shares by speed within memory with more micro-batches
  or Poplar's accumulation when they do not fit (:mod:`planner.shares.batch_fit`). A re-plan
  (:mod:`planner.balance.replan`) passes what it keeps of the plan in force.
* :func:`naive_decisions`, the capacity-blind ones: equal shares, shards and layer counts per
  movable stage, the baseline of the predicted speed-up.

Every stage is priced for the micro-batch count tried (:func:`priced_stages`): its costs, the
micro-batches in flight under the schedule (:func:`planner.schedule.actions.in_flight_per_stage`),
its shards and whether it recomputes its activations.

Activation checkpointing (``Decisions.recompute``, one reason per stage): a stage recomputes when
one of its TaskGraphs asks (``"asked"``: ``replicate(recompute=True)``), or when the planner
chooses it (``"fit"``) as the last resort: only after every micro-batch count tried (a single
stage: also Poplar's gradient accumulation) leaves the stage short of memory, only on a stage the
memory model says it helps (it keeps less than it would otherwise: per layer, its layers' inputs and
one layer's activations, :mod:`planner.devices.memory`, so with one micro-batch in flight too, a
data-parallel plan included, when the stage has more than one layer) and without training-mode
BatchNorm (whose running statistics the recompute would update twice). It is turned on one stage at
a time, the stage that did not fit first; a re-plan keeps the plan's choices.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from whalelike.config import Config
from whalelike.display import human_bytes
from whalelike.graphs.taskgraph import TaskGraphs

from planner.devices.cost_model import StageCost
from planner.devices.memory import stage_memory
from planner.devices.placement import Layout
from planner.partition.stage_layers import equal_stage_layers, partition_stage_layers
from planner.plan import PlanError
from planner.schedule.actions import in_flight_per_stage
from planner.shares.batch_fit import (
    PricedStage, StageDoesNotFit, equal_sizes, fit_pipeline, fit_single_stage, micro_batch_counts, shortfall_error,
)
from planner.shares.batchnorm_statistics import stage_batchnorms
from planner.shares.shard_sizes import ShardLayout, even_layout
from planner.shares.stage_shards import aware_shards, check_shardable, stage_shardable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Decisions:
    """Everything the planner chose. ``sizes[r][s][d]`` are the micro-batch sizes of the
    tensor-parallel group ``d`` of stage ``s`` in replica ``r``; ``recompute[s]`` why stage ``s``
    recomputes its activations (``"asked"``, ``"fit"``) or ``""`` (empty: none does)."""

    layout: Layout
    stage_layers: list[list[int]]
    costs: list[StageCost]
    in_flight: list[int]
    shards: list[ShardLayout]
    sizes: list[list[list[list[int]]]]
    num_micro_batch: int
    solver: str
    optimality_gap: float | None = None
    recompute: tuple[str, ...] = ()

    def recomputes(self, s: int) -> bool:
        return bool(self.recompute) and bool(self.recompute[s])


def asked_recompute(graphs: TaskGraphs, stage_layers: list[list[int]]) -> list[str]:
    """Per stage ``"asked"`` when a TaskGraph it runs a layer of asks for activation
    checkpointing (``Strategy.recompute``), else ``""``."""
    return ["asked" if any(graphs[graphs.layers[i].taskgraph].strategy.asks_recompute for i in layers) else ""
            for layers in stage_layers]


def _recompute_helps(graphs: TaskGraphs, st: PricedStage, layers: list[int]) -> str:
    """Why recomputing stage ``st`` cannot make it fit (empty when it may)."""
    kept = stage_memory(st.cost, st.in_flight).activations(1)
    again = stage_memory(st.cost, st.in_flight, recompute=True).activations(1)
    if again >= kept:
        return (f"recomputing layer by layer would keep {human_bytes(again)} per sample of its "
                f"{len(layers)} layer(s) ({st.in_flight} micro-batch(es) in flight), no less than the "
                f"{human_bytes(kept)} it keeps now")
    if stage_batchnorms(graphs, layers):
        return "the stage runs BatchNorm in training mode, whose running statistics the recompute would update twice"
    return ""


def check_trainable(graphs: TaskGraphs) -> None:
    """A model without parameters has nothing to train: torch's optimizers refuse an empty
    parameter list, so every rank would fail at its first step. Raises PlanError."""
    if sum(tg.param_count for tg in graphs) == 0:
        paths = ", ".join(p for tg in graphs for p in tg.module_paths) or "no modules"
        raise PlanError(
            f"the model has no parameters ({len(graphs)} TaskGraph(s) over {paths}): there is nothing to "
            "train or to balance; plan a model with at least one parameter (an nn.Linear, nn.Conv2d, ...)"
        )


def priced_stages(graphs: TaskGraphs, config: Config, layout: Layout, stage_layers: list[list[int]],
                  num_micro_batch: int, aware: bool, kept_shards: list[ShardLayout | None] | None = None,
                  recompute: list[str] | None = None) -> list[PricedStage]:
    """Every stage priced for ``num_micro_batch``; ``kept_shards[s]``, when given and not None,
    is stage ``s``'s shard layout instead of the even (naive) or speed-proportional (aware) one;
    ``recompute[s]`` (a reason, empty for none): stage ``s`` recomputes its activations."""
    in_flight_per = in_flight_per_stage(config.schedule, layout.num_stages, num_micro_batch)
    out = []
    for s, layers in enumerate(stage_layers):
        cost = StageCost.of_layers(graphs, layers, config.precision)
        in_flight = in_flight_per[s]
        again = bool(recompute and recompute[s])
        owners, shardable, groups = stage_shardable(graphs, layers)
        tp = layout.shapes[s].tp
        check_shardable(layout, s, owners, shardable, groups)
        if kept_shards is not None and kept_shards[s] is not None:
            shards = kept_shards[s]
        elif not aware:
            shards = even_layout(shardable, tp, groups, cost.flops_per_sample)
        else:
            expected = -(-config.global_batch_size // (num_micro_batch * len(layout.stage_groups(s))))
            shards = aware_shards(layout, s, cost, in_flight, shardable, groups, expected, again)
        out.append(PricedStage(s, cost, in_flight, shards, again))
    return out


def aware_decisions(graphs: TaskGraphs, config: Config, layout: Layout, network, *,
                    stage_layers: list[list[int]] | None = None, shards: list[ShardLayout | None] | None = None,
                    sizes: list | None = None, counts: list[int] | None = None,
                    recompute: list[str] | None = None) -> Decisions:
    """The hardware-aware decisions on ``layout``: steps 2 to 4 of :mod:`planner.api`.

    A re-plan of a running job (:mod:`planner.balance.replan`) passes what it keeps of the plan in force:
    ``stage_layers`` instead of the partitioner's (the decisions then say solver ``"greedy"``, gap
    None: the caller knows where they came from), ``shards`` (per stage a ShardLayout, or None to
    shard by speed), ``sizes`` (``Decisions.sizes``) instead of balanced batch shares, and
    ``counts``, the micro-batch counts a pipeline may use (default: ``num_micro_batch``, then
    every larger divisor of the global batch), ``recompute`` (per stage the reason it recomputes,
    empty for none) instead of choosing (every stage whose TaskGraph asks recomputes anyway).
    Raises PlanError when the stages do not fit.
    """
    if stage_layers is None:
        stage_layers, solver, gap = partition_stage_layers(graphs, layout, config, network)
    else:
        solver, gap = "greedy", None
    gbs, m = config.global_batch_size, config.num_micro_batch
    asked = asked_recompute(graphs, stage_layers)
    reasons = [mine or why for mine, why in zip(asked, recompute or [""] * len(asked))]
    if sizes is not None:
        count = max(len(n) for replica in sizes for stage in replica for n in stage)
        stages = priced_stages(graphs, config, layout, stage_layers, count, True, shards, reasons)
        return _decided(layout, stage_layers, stages, sizes, count, solver, gap, reasons)
    if layout.num_stages == 1:
        stages = priced_stages(graphs, config, layout, stage_layers, m, True, shards, reasons)
        try:
            sizes, count = fit_single_stage(layout, stages[0], gbs, m)
        except PlanError as e:
            why = "" if stages[0].recompute else _recompute_helps(graphs, stages[0], stage_layers[0])
            if stages[0].recompute or recompute is not None or why:
                why = why or "a re-plan keeps the recompute choices of the plan in force"
                note = "" if stages[0].recompute else f" (activation checkpointing was considered: {why})"
                raise PlanError(f"{e}{note}") from None
            # the last resort: recompute its activations, layer by layer (a data-parallel plan too)
            reasons[0] = "fit"
            log.warning("the single stage does not fit its devices even with gradient accumulation; it "
                        "recomputes its activations in the backward (activation checkpointing)")
            stages = priced_stages(graphs, config, layout, stage_layers, m, True, shards, reasons)
            sizes, count = fit_single_stage(layout, stages[0], gbs, m)
        return _decided(layout, stage_layers, stages, sizes, count, solver, gap, reasons)
    while True:
        errors, tried = [], m
        for count in micro_batch_counts(gbs, m, layout) if counts is None else counts:
            tried = count
            stages = priced_stages(graphs, config, layout, stage_layers, count, True, shards, reasons)
            try:
                sizes = fit_pipeline(layout, stages, gbs // count, count)
            except StageDoesNotFit as e:
                errors.append(e)
                continue
            if count != m:
                log.warning("micro-batches of %d samples do not fit; using num_micro_batch=%d (%d samples each)",
                            gbs // m, count, gbs // count)
            return _decided(layout, stage_layers, stages, sizes, count, solver, gap, reasons)
        # the last resort: recompute the first stage that did not fit and may (one stage at a time)
        chosen = next((e.stage for e in errors if not e.stage.recompute
                       and not _recompute_helps(graphs, e.stage, stage_layers[e.stage.index])), None)
        if chosen is None or recompute is not None:
            first = errors[0]
            note = ""
            if not first.stage.recompute:
                why = _recompute_helps(graphs, first.stage, stage_layers[first.stage.index]) or \
                    "a re-plan keeps the recompute choices of the plan in force"
                note = f" (activation checkpointing was considered: {why})"
            err = shortfall_error(layout, first, m, gbs, tried)
            raise PlanError(f"{err}{note}") from None
        reasons[chosen.index] = "fit"
        log.warning("stage %d does not fit its devices at any micro-batch count tried; it recomputes its "
                    "activations in the backward (activation checkpointing)", chosen.index)


def naive_decisions(graphs: TaskGraphs, config: Config, layout: Layout) -> Decisions:
    """The capacity-blind decisions on ``layout``: equal shares, shards and layer counts."""
    gbs, m = config.global_batch_size, config.num_micro_batch
    stage_layers = equal_stage_layers(graphs, layout)
    asked = asked_recompute(graphs, stage_layers)
    stages = priced_stages(graphs, config, layout, stage_layers, m, aware=False, recompute=asked)
    return _decided(layout, stage_layers, stages, equal_sizes(layout, gbs, m), m, "greedy", None, asked)


def _decided(layout: Layout, stage_layers, stages: list[PricedStage], sizes, count: int, solver: str,
             gap: float | None = None, recompute: list[str] | None = None) -> Decisions:
    return Decisions(layout, stage_layers, [s.cost for s in stages], [s.in_flight for s in stages],
                     [s.shards for s in stages], sizes, count, solver, gap,
                     tuple(recompute) if recompute is not None else ("",) * len(stages))
