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

ZeRO (``Decisions.zero``, ``zero_reason``; Poplar's escalation). Each stage's data-parallel group
(its workers of one ``tp_index`` over every replica) runs ZeRO stage 0 (DDP), 1, 2 or 3 on FSDP2
(:mod:`planner.devices.memory` says what each holds). The user fixes it (``"asked"``): a region's
``replicate(n, zero=k)`` for the stages running it (the highest a stage's TaskGraphs ask), else
``Config.zero_stage`` for every stage whose group has more than one worker (:func:`asked_zero`;
asking for ZeRO where no other worker holds the parameters is a PlanError). Otherwise the planner
gives each stage the lowest ZeRO stage at which every device fits (``"fit"``): 0, then each higher
one that holds fewer static bytes (:func:`next_zero`), the stage that does not fit first, before
activation checkpointing is tried; with recompute turned on for a stage its ZeRO stage starts from 0
again, so it is the lowest that fits recomputing. A single stage at ZeRO 2-3 runs the same number of
micro-batches on every device (:func:`fit_batch`).

Ragged shards (``Decisions.state_fractions``; Cephalo, :mod:`planner.shares.state_fractions`). A
single-stage plan without ``split`` over two workers or more may, at ZeRO 1, 2 or 3 and with
``Config.ragged_shards`` (the default), give each worker its own fraction of the sharded state, in
proportion to the memory it has left after what does not shrink with it. The planner chooses them
exactly when FSDP2's even shards do not fit at that ZeRO stage and ragged ones do, and the fractions
are not even: per ZeRO stage even shards first, then ragged ones (:func:`_single_stage`), so the
escalation runs ZeRO 0, 1 even, 1 ragged, 2 even, 2 ragged, 3 even, 3 ragged and stops at the first
that fits (an asked ZeRO stage: even, then ragged). A pipeline's stages run ragged shards only when
the plan says so (a plan written by hand, and its re-plans: each stage's group its own fractions);
the planner's pipeline escalation keeps FSDP2's even shards. Where even shards fit they are kept, even if ragged
ones would leave more slack. A re-plan keeps the plan's shards, ragged or even. The naive plan takes per stage the lowest ZeRO
stage at which its equal shares fit (FSDP2 with even shards and even batches, the bench's baseline).
The pipeline partitioner prices layer ranges at ZeRO 0 (a run that fits only under ZeRO keeps its
TaskGraph boundaries, as for recompute); a re-plan keeps the plan's ZeRO stages.

Prague's partial all-reduce (:func:`partial_stages`, :func:`stage_syncs`): a stage runs it when a
region asks (``replicate(n, sync="partial")``) or ``Config.dp_sync`` is ``"partial"``, on two or more
data-parallel workers without ``split`` (P-Reduce's rules: :mod:`planner.partial_reduce`); its ZeRO stage is 0 (P-Reduce averages whole parameters) and
its shares stay speed-proportional, as any stage's.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Sequence

from whalelike.config import ZERO_STAGES, Config
from whalelike.display import human_bytes
from whalelike.graphs.taskgraph import TaskGraphs

from planner.devices.cost_model import GIB, CommModel, StageCost, device_tflops, ragged_collectives
from planner.devices.memory import ZeroShards, fits, fsdp_unit_share, fsdp_units, ragged_unit, stage_memory
from planner.devices.placement import Layout
from planner.partial_reduce import WHY, blocker, generator, static_only
from planner.partition.stage_layers import equal_stage_layers, partition_stage_layers
from planner.plan import PlanError
from planner.schedule.actions import in_flight_per_stage
from planner.shares.batch_fit import (
    MAX_MICRO_BATCHES, PricedStage, StageDoesNotFit, StageMemoryError, equal_sizes, fit_equal_counts, fit_pipeline,
    fit_single_stage, micro_batch_counts, shortfall_error,
)
from planner.shares.batchnorm_statistics import stage_batchnorms
from planner.shares.shard_sizes import ShardLayout, even_layout
from planner.shares.stage_shards import aware_shards, check_shardable, stage_shardable
from planner.shares.state_fractions import is_even, padded_scale, ragged_fractions

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Decisions:
    """Everything the planner chose. ``sizes[r][s][d]`` are the micro-batch sizes of the
    tensor-parallel group ``d`` of stage ``s`` in replica ``r``; ``recompute[s]`` why stage ``s``
    recomputes its activations (``"asked"``, ``"fit"``, ``"faster"``: instead of a higher ZeRO stage,
    simulated faster) or ``""`` (empty: none does); ``zero[s]`` its
    data-parallel group's ZeRO stage and ``zero_reason[s]`` why (``"none"``, ``"asked"``, ``"fit"``;
    both empty: every stage 0); ``state_fractions[s]`` its ragged shards, each data-parallel group's
    fraction of the sharded state in ``Layout.stage_groups`` order (empty: even shards)."""

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
    zero: tuple[int, ...] = ()
    zero_reason: tuple[str, ...] = ()
    state_fractions: tuple[tuple[float, ...], ...] = ()
    kept_work: tuple[tuple[int, int], ...] = ()   # (stage, layer): pinned so the stage computes (StageLayers.kept_work)
    resplit: bool = False   # made on the split priced recomputing, the last resort (aware_decisions' resplit)

    def recomputes(self, s: int) -> bool:
        return bool(self.recompute) and bool(self.recompute[s])

    def zero_stage(self, s: int) -> int:
        """Stage ``s``'s ZeRO stage (0: DDP)."""
        return self.zero[s] if self.zero else 0

    def fractions(self, s: int) -> tuple[float, ...]:
        """Stage ``s``'s ragged state fractions per data-parallel group (``Layout.stage_groups`` order;
        empty: even shards)."""
        return self.state_fractions[s] if self.state_fractions else ()


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
                  recompute: list[str] | None = None, zero: list[int] | None = None,
                  fractions: list[tuple[float, ...]] | None = None) -> list[PricedStage]:
    """Every stage priced for ``num_micro_batch``; ``kept_shards[s]``, when given and not None,
    is stage ``s``'s shard layout instead of the even (naive) or speed-proportional (aware) one;
    ``recompute[s]`` (a reason, empty for none): stage ``s`` recomputes its activations; ``zero[s]``:
    its data-parallel group's ZeRO stage (:func:`zero_shards`); ``fractions[s]`` (empty: even shards)
    its ragged state fractions per data-parallel group (a stage without ``split``: one shard)."""
    in_flight_per = in_flight_per_stage(config.schedule, layout.num_stages, num_micro_batch)
    out = []
    for s, layers in enumerate(stage_layers):
        cost = StageCost.of_layers(graphs, layers, config.precision)
        in_flight = in_flight_per[s]
        again = bool(recompute and recompute[s])
        mine = tuple(fractions[s]) if fractions else ()
        sharded = zero_shards(layout, s, cost, zero[s] if zero else 0, mine)
        owners, shardable, groups = stage_shardable(graphs, layers)
        tp = layout.shapes[s].tp
        check_shardable(layout, s, owners, shardable, groups)
        ragged = tuple((tuple(d.name for d in g), f) for g, f in zip(layout.stage_groups(s), mine))
        if kept_shards is not None and kept_shards[s] is not None:
            shards = kept_shards[s]
        elif not aware or ragged:   # ragged shards: no split, so the one shard holds the whole stage
            if ragged and tp != 1:
                raise ValueError(f"ragged state shards on stage {s} under split({tp}): they run without split only")
            shards = even_layout(shardable, tp, groups, cost.flops_per_sample)
        else:
            expected = -(-config.global_batch_size // (num_micro_batch * len(layout.stage_groups(s))))
            # without split the one shard is the whole stage: only a check that it fits, at the least a
            # worker holds (one micro-batch per step); the batch fitting prices what each one holds
            caps = dataclasses.replace(sharded, single=True) if tp == 1 and sharded.stage else sharded
            shards = aware_shards(layout, s, cost, in_flight, shardable, groups, expected, again, caps)
        out.append(PricedStage(s, cost, in_flight, shards, again, sharded, ragged))
    return out


def aware_decisions(graphs: TaskGraphs, config: Config, layout: Layout, network, *,
                    stage_layers: list[list[int]] | None = None, shards: list[ShardLayout | None] | None = None,
                    sizes: list | None = None, counts: list[int] | None = None,
                    recompute: list[str] | None = None, zero: list[int] | None = None,
                    zero_reason: list[str] | None = None,
                    state_fractions: list[tuple[float, ...]] | None = None, resplit: bool = True,
                    recompute_first: Sequence[int] = ()) -> Decisions:
    """The hardware-aware decisions on ``layout``: steps 2 to 4 of :mod:`planner.api`.

    A re-plan of a running job (:mod:`planner.balance.replan`) passes what it keeps of the plan in force:
    ``stage_layers`` instead of the partitioner's (the decisions then say solver ``"greedy"``, gap
    None: the caller knows where they came from), ``shards`` (per stage a ShardLayout, or None to
    shard by speed), ``sizes`` (``Decisions.sizes``) instead of balanced batch shares, and
    ``counts``, the micro-batch counts a pipeline may use (default: ``num_micro_batch``, then
    every larger divisor of the global batch), ``recompute`` (per stage the reason it recomputes,
    empty for none) instead of choosing (every stage whose TaskGraph asks recomputes anyway), and
    ``zero`` with ``zero_reason`` (per stage its ZeRO stage and why) instead of choosing them, and
    ``state_fractions`` (per stage its ragged state fractions in ``Layout.stage_groups`` order, empty
    for even shards: the runtime keeps its replica sync only for the same ones) instead of choosing
    even or ragged shards.
    ``resplit``: at the last resort (no split fits without recomputing, the TaskGraph boundaries
    stood), first the decisions on the split priced recomputing (``Decisions.resplit``); False: recompute
    on the boundaries (the caller compares the two: :func:`planner.devices.placement_search.aware_plan`).
    ``recompute_first``: stages that recompute before their ZeRO stage is raised (reason ``"faster"``),
    where the escalation would raise it first: the caller simulates both
    (:func:`planner.devices.placement_search.aware_plan`).
    Raises PlanError when the stages do not fit.
    """
    gbs, m = config.global_batch_size, config.num_micro_batch
    searched = stage_layers is None
    partitioned = True
    if searched:
        stage_layers, solver, gap, partitioned, kept_work = partition_stage_layers(graphs, layout, config, network)
    else:
        solver, gap, kept_work = "greedy", None, ()
    asked = asked_recompute(graphs, stage_layers)
    reasons = [mine or why for mine, why in zip(asked, recompute or [""] * len(asked))]
    for s in recompute_first:
        reasons[s] = reasons[s] or "faster"
    fixed = list(zero) if zero is not None else asked_zero(graphs, config, layout, stage_layers)
    why_zero = list(zero_reason) if zero_reason is not None else [
        "asked" if z else "none" for z in fixed]
    ladders = [zero_ladder(layout, s, fixed[s]) for s in range(layout.num_stages)]
    zeros = [ladder[0] for ladder in ladders]
    kept = [tuple(f) for f in state_fractions] if state_fractions is not None else None

    def decided(stages, sizes, count):
        chosen = [why_zero[s] if fixed[s] is not None else ("fit" if z else "none") for s, z in enumerate(zeros)]
        return dataclasses.replace(_decided(layout, stage_layers, stages, sizes, count, solver, gap, reasons, zeros,
                                            chosen), kept_work=kept_work)

    if sizes is not None:
        count = max(len(n) for replica in sizes for stage in replica for n in stage)
        stages = priced_stages(graphs, config, layout, stage_layers, count, True, shards, reasons, zeros, kept)
        return decided(stages, sizes, count)
    if layout.num_stages == 1:
        return _single_stage(graphs, config, layout, network, stage_layers, shards, reasons, recompute is not None,
                             zeros, ladders[0], fixed[0], decided, kept)
    while True:
        errors, tried, short = [], m, None
        for count in micro_batch_counts(gbs, m, layout) if counts is None else counts:
            tried = count
            try:
                stages = priced_stages(graphs, config, layout, stage_layers, count, True, shards, reasons, zeros,
                                       kept)
                sizes = fit_pipeline(layout, stages, gbs // count, count)
            except StageDoesNotFit as e:
                errors.append(e)
                continue
            except StageMemoryError as e:   # its weights and state do not fit: no micro-batch count helps
                short = e
                break
            if count != m:
                if searched and not partitioned and counts is None:
                    # the cut points searched with the count (issue 36): the partition that did not fit
                    # m micro-batches may fit these smaller ones, instead of the TaskGraph boundaries
                    again = _repartitioned(graphs, dataclasses.replace(config, num_micro_batch=count), layout, network,
                                           recompute=recompute, zero=zero, zero_reason=zero_reason,
                                           state_fractions=state_fractions, shards=shards)
                    if again is not None:
                        return again
                log.warning("micro-batches of %d samples do not fit; using num_micro_batch=%d (%d samples each)",
                            gbs // m, count, gbs // count)
            return decided(stages, sizes, count)
        # Poplar: first a higher ZeRO stage for the stage that does not fit (the lowest that holds less)
        short_stages = [short.stage] if short is not None else [e.stage.index for e in errors]
        raised = next(((s, z) for s in short_stages
                       if (z := next_zero(layout, s, ladders[s], zeros[s], stage_layers, graphs, config)) is not None),
                      None)
        if raised is not None:
            s, z = raised
            log.warning("stage %d does not fit its devices under ZeRO stage %d; trying ZeRO stage %d", s, zeros[s], z)
            zeros[s] = z
            continue
        if short is not None:
            raise PlanError(f"{short}{zero_note(layout, short.stage, ladders, zeros, fixed, zero is not None)}") from None
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
            note += zero_note(layout, first.stage.index, ladders, zeros, fixed, zero is not None)
            err = shortfall_error(layout, first, m, gbs, tried)
            raise PlanError(f"{err}{note}") from None
        if resplit and searched and not partitioned and counts is None and recompute is None:
            # the boundaries stood because no split fitted without recompute: before recomputing on them,
            # the split priced recomputing (and sharded where ZeRO may), its own decisions made on it
            again = partition_stage_layers(graphs, layout, config, network, quiet=True, last_resort=True)
            if again.partitioned and again.layers != stage_layers:
                log.info("no split fits without recomputing; the layers are split as they fit recomputing")
                try:
                    return dataclasses.replace(
                        aware_decisions(graphs, config, layout, network, stage_layers=again.layers, shards=shards,
                                        zero=zero, zero_reason=zero_reason, state_fractions=state_fractions),
                        solver=again.solver, optimality_gap=again.gap, kept_work=again.kept_work, resplit=True)
                except PlanError as e:
                    log.debug("the split priced recomputing does not fit either (%s); recomputing on the boundaries", e)
            partitioned = True     # tried once
        reasons[chosen.index] = "fit"
        zeros[chosen.index] = ladders[chosen.index][0]   # the lowest ZeRO stage that fits, now recomputing
        log.warning("stage %d does not fit its devices at any micro-batch count or ZeRO stage tried; it recomputes "
                    "its activations in the backward (activation checkpointing)", chosen.index)


def _single_stage(graphs, config, layout, network, stage_layers, shards, reasons, replanning: bool, zeros, ladder,
                  fixed, decided, kept=None) -> Decisions:
    """The one stage's decisions: the lowest ZeRO stage of ``ladder`` at which its batch fits
    (:func:`fit_batch`), then, as the last resort, the same recomputing its activations.

    At each ZeRO stage of the ladder, lowest first: FSDP2's even shards (skipped at a stage that
    holds no less than the last one tried with even shards, :func:`next_zero`), then, when they do not
    fit and the stage may run them (:func:`ragged_allowed`: ZeRO 1-3, ``Config.ragged_shards``, no
    ``split``, two workers or more, not a re-plan), ragged shards with the fractions of
    :func:`planner.shares.state_fractions.ragged_fractions` (:func:`_ragged`), unless those are even.
    So the order is ZeRO 0, 1 even, 1 ragged, 2 even, 2 ragged, 3 even, 3 ragged: ragged shards are
    chosen exactly when even shards do not fit at that ZeRO stage and ragged ones do, which keeps the
    plan at a lower ZeRO stage, or fits a model even ZeRO 3 cannot (ragged ZeRO 3 holds ``f_r`` of
    everything but one layer unit and the root; ragged ZeRO 2 the whole weights but only ``f_r`` of
    the rest). A re-plan (``kept``) keeps the plan's shards, ragged or even."""
    gbs, m = config.global_batch_size, config.num_micro_batch
    error, ragged_tried = None, False
    while True:
        last_even = None
        for z in ladder[ladder.index(zeros[0]):]:
            if last_even is None or z == next_zero(layout, 0, ladder, last_even, stage_layers, graphs, config):
                zeros[0], last_even = z, z
                try:
                    stages = priced_stages(graphs, config, layout, stage_layers, m, True, shards, reasons, zeros, kept)
                    sizes, count = fit_batch(layout, stages[0], gbs, m, network)
                    return decided(stages, sizes, count)
                except PlanError as e:
                    error = e
            if ragged_allowed(config, layout, 0, z) and not replanning:
                ragged_tried = True
                try:
                    chosen = _ragged(graphs, config, layout, network, stage_layers, reasons, zeros, z, decided)
                except PlanError as e:
                    error = e
                    chosen = None
                if chosen is not None:
                    return chosen
                zeros[0] = last_even
        cost = StageCost.of_layers(graphs, stage_layers[0], config.precision)
        bare = PricedStage(0, cost, in_flight_per_stage(config.schedule, 1, m)[0], None)
        why = "" if reasons[0] else _recompute_helps(graphs, bare, stage_layers[0])
        if reasons[0] or replanning or why:
            why = why or "a re-plan keeps the recompute choices of the plan in force"
            note = "" if reasons[0] else f" (activation checkpointing was considered: {why})"
            note += zero_note(layout, 0, [ladder], zeros, [fixed], replanning, ragged_tried)
            note += " (and again recomputing its activations)" if reasons[0] == "fit" and not replanning else ""
            raise PlanError(f"{error}{note}") from None
        # the last resort: recompute its activations, layer by layer (a data-parallel plan too)
        reasons[0] = "fit"
        zeros[0] = ladder[0]
        log.warning("the single stage does not fit its devices even with gradient accumulation at any ZeRO stage "
                    "tried; it recomputes its activations in the backward (activation checkpointing)")


def ragged_allowed(config: Config, layout: Layout, s: int, zero_stage: int) -> bool:
    """Whether the planner may give stage ``s`` ragged state shards at ``zero_stage``: ZeRO 1-3,
    ``Config.ragged_shards``, a single-stage plan (the one the escalation chooses them for) without
    ``split`` (what ``runtime.replicas.ragged_sync`` runs) over two workers or more."""
    return (config.ragged_shards and zero_stage in (1, 2, 3) and layout.num_stages == 1
            and layout.shapes[s].tp == 1 and len(layout.stage_groups(s)) >= 2)


def _ragged(graphs, config, layout, network, stage_layers, reasons, zeros, z: int, decided) -> Decisions | None:
    """The single stage at ZeRO ``z`` with ragged shards: each worker's fraction of the state by the
    memory it has left (:func:`planner.shares.state_fractions.ragged_fractions`), then the batch fitted
    within what those fractions leave (:func:`fit_batch`). None when no fractions fit or they are even
    (FSDP2's even shards, already tried); PlanError when the batch does not fit."""
    gbs, m = config.global_batch_size, config.num_micro_batch
    cost = StageCost.of_layers(graphs, stage_layers[0], config.precision)
    groups = layout.stage_groups(0)
    most = MAX_MICRO_BATCHES if z < 2 else min(gbs // len(groups), MAX_MICRO_BATCHES)   # ZeRO 2-3: a sample each
    found = ragged_fractions(cost, in_flight_per_stage(config.schedule, 1, m)[0], bool(reasons[0]), z,
                             [g[0].memory_gib * GIB for g in groups],
                             [device_tflops(g[0], config.precision) for g in groups], gbs, m, most)
    if found is None or is_even(found.fractions):
        return None
    zeros[0] = z
    stages = priced_stages(graphs, config, layout, stage_layers, m, True, None, reasons, zeros, [found.fractions])
    sizes, count = fit_batch(layout, stages[0], gbs, m, network)
    log.info("FSDP2's even shards do not fit ZeRO stage %d; ragged shards by free memory do: state fractions %s",
             z, ", ".join(f"{g[0].name} {f:.1%}" for g, f in zip(groups, found.fractions)))
    return decided(stages, sizes, count)


def fit_batch(layout: Layout, st: PricedStage, gbs: int, m: int, network) -> tuple[list, int]:
    """A single stage's ``(Decisions.sizes, count)`` under its ZeRO stage: stages 0-1 by speed with
    Poplar's per-device accumulation (:func:`~planner.shares.batch_fit.fit_single_stage`), stages 2-3
    with the same micro-batch count on every device (:func:`~planner.shares.batch_fit.fit_equal_counts`,
    priced with the group's collectives on ``network``'s model)."""
    if st.zero.stage < 2:
        return fit_single_stage(layout, st, gbs, m)
    return fit_equal_counts(layout, st, gbs, m, zero_comm(layout, st, network))


def zero_comm(layout: Layout, st: PricedStage, network):
    """``k -> ms``: stage ``st``'s ZeRO collectives per step with ``k`` micro-batches, the slowest
    tensor-parallel index's ring (:meth:`planner.devices.cost_model.CommModel.zero_ms`); under ragged
    shards one collective per bucket (:func:`~planner.devices.cost_model.ragged_collectives`), each
    padded to the largest rank's rows
    (:func:`~planner.shares.state_fractions.padded_scale`)."""
    comm = CommModel(network)
    groups = layout.stage_groups(st.index)
    units = len(fsdp_units(st.cost, layout.num_stages == 1, cut_into_units(layout, st.index)))
    rings = [[g[t] for g in groups] for t in range(len(groups[0]))]
    scale = 1.0
    if st.ragged:   # one padded collective per bucket (runtime.replicas.ragged_sync)
        scale = padded_scale(st.state_fractions)
        units = ragged_collectives(st.cost, st.zero.stage, layout.num_stages == 1)
    return lambda k: max(comm.zero_ms(st.zero.stage, st.cost.param_bytes * st.shards.fractions[t] * scale, k, ring,
                                      units)
                         for t, ring in enumerate(rings))


# -- ZeRO stages ------------------------------------------------------------------------------------
def zero_shards(layout: Layout, s: int, cost: StageCost, stage: int, fractions=()) -> ZeroShards:
    """What stage ``s``'s data-parallel group (its groups over every replica) shards at ZeRO ``stage``;
    ``fractions``: the group's ragged state fractions (empty: FSDP2's even shards), whose buckets
    (:func:`~planner.devices.memory.ragged_unit`) and padding (``n * max(f)``,
    :func:`~planner.shares.state_fractions.padded_scale`) every worker's buffers follow (each
    worker's own fraction: :meth:`~planner.shares.batch_fit.PricedStage.zero_of`)."""
    whole_model = layout.num_stages == 1
    if fractions and stage:
        unit, root = ragged_unit(cost, stage, whole_model)
        return ZeroShards(stage, len(layout.stage_groups(s)), unit, share=1.0 / len(fractions),
                          padding=padded_scale(fractions), root=root)
    return ZeroShards(stage, len(layout.stage_groups(s)), fsdp_unit_share(cost, whole_model, cut_into_units(layout, s)))


def cut_into_units(layout: Layout, s: int) -> bool:
    """Whether stage ``s`` of a pipeline, sharded evenly under ZeRO, runs cut into one FSDP unit per
    layer (``runtime.parallel.stage_units``): every stage without tensor-parallel slices (a parallel
    Linear's slice stays in the stage's one unit)."""
    return layout.shapes[s].tp == 1


def partial_stages(graphs: TaskGraphs, config: Config, layout: Layout, stage_layers: list[list[int]]) -> list[bool]:
    """Per stage whether it runs Prague's partial all-reduce (``StagePlan.replica_sync`` ``"partial"``):
    a TaskGraph of it asks (``replicate(n, sync="partial")``), or ``Config.dp_sync`` is ``"partial"``
    and none of its TaskGraphs asks ``sync="exact"``, on a stage of two or more data-parallel workers
    without ``split`` (``Config.dp_sync`` leaves other stages exact). Pure: a re-plan gets the same
    answer from the same model and config. Raises PlanError for a region asking P-Reduce on a stage of
    one data-parallel worker or under ``split``, for both ``sync`` values on one stage, and for
    ``Config.dp_sync`` ``"partial"`` where no stage can run it."""
    out = []
    for s, layers in enumerate(stage_layers):
        owners = sorted({graphs.layers[i].taskgraph for i in layers})
        asks = {t: getattr(graphs[t].strategy, "sync", None) for t in owners}
        asks = {t: v for t, v in asks.items() if v is not None}
        if len(set(asks.values())) > 1:
            raise PlanError(f"stage {s} runs TaskGraphs asking sync='exact' and sync='partial' ({asks}); one stage "
                            "keeps its replicas in step one way: give the regions the same sync=, or put them on "
                            "different devices")
        workers, tp = len(layout.stage_groups(s)), layout.shapes[s].tp
        wanted = next(iter(asks.values())) if asks else config.dp_sync
        if wanted != "partial":
            out.append(False)
            continue
        blocked = blocker(workers, tp)   # a P-Reduce stage's ZeRO stage is 0 (asked_zero)
        if asks and blocked:
            t = next(iter(asks))
            why = f"is under split({tp})" if blocked == "split" else "has one data-parallel worker"
            raise PlanError(f"TaskGraph {t} ({graphs[t].strategy}) asks for sync='partial', but stage {s} "
                            f"({layout.shapes[s].label}) {why}: {WHY[blocked]}; give the region two or more devices "
                            "of its own, or drop sync='partial'")
        out.append(blocked is None)
    if config.dp_sync == "partial" and not any(out):
        raise PlanError(f"Config.dp_sync is 'partial', but no stage of the plan has two or more data-parallel workers "
                        f"without split ({', '.join(sh.label for sh in layout.shapes)}): P-Reduce averages "
                        "replicas and no stage has any to average; use dp_sync 'exact' (whalelike plan --dp-sync "
                        "exact) or give a replicate region more devices")
    if any(out):
        for s, partial in enumerate(out):
            if partial and config.partial_group_size > len(layout.stage_groups(s)):
                raise PlanError(
                    f"Config.partial_group_size is {config.partial_group_size}, larger than stage {s}'s "
                    f"{len(layout.stage_groups(s))} data-parallel workers ({layout.shapes[s].label}): a P-Reduce "
                    f"group holds at most all of them; set partial_group_size to 2..{len(layout.stage_groups(s))}")
    return out


def stage_syncs(graphs: TaskGraphs, config: Config, dec: "Decisions") -> list[dict]:
    """Per stage of ``dec`` the :class:`~planner.plan.StagePlan` fields of its replica sync:
    ``replica_sync`` (``"partial"`` where :func:`partial_stages` says, else ``"ragged"`` with state
    fractions, ``"fsdp"`` at ZeRO 1-3, ``"ddp"``) and P-Reduce's generator, group size and threshold
    from ``config`` (the defaults on exact stages; the generator as
    :func:`planner.partial_reduce.generator` pins it: static in a pipeline or at fp16)."""
    partial = partial_stages(graphs, config, dec.layout, dec.stage_layers)
    out = []
    for s in range(len(dec.stage_layers)):
        exact = ("ragged" if dec.fractions(s) else "fsdp") if dec.zero_stage(s) else "ddp"
        fields = {"replica_sync": "partial" if partial[s] else exact}
        if partial[s]:
            chosen = generator(config.partial_generator, len(dec.stage_layers), config.precision)
            if chosen != config.partial_generator:
                log.info("stage %d: P-Reduce %s runs the static group generator (Config asks %r)", s,
                         static_only(len(dec.stage_layers), config.precision), config.partial_generator)
            fields.update(partial_generator=chosen, partial_group_size=config.partial_group_size,
                          partial_delta_c=config.partial_delta_c)
        out.append(fields)
    return out


def asked_zero(graphs: TaskGraphs, config: Config, layout: Layout, stage_layers: list[list[int]]) -> list[int | None]:
    """Per stage the ZeRO stage the user fixed, or None (the planner chooses): the highest a
    TaskGraph of the stage asks (``replicate(n, zero=k)``), else ``Config.zero_stage`` (0 on a stage
    whose data-parallel group has one worker: there is nothing to shard). Raises PlanError for a
    region asking a ZeRO stage on a stage of one data-parallel worker, or a ``Config.zero_stage``
    above 0 where no stage has more than one."""
    out: list[int | None] = []
    partial = partial_stages(graphs, config, layout, stage_layers)
    for s, layers in enumerate(stage_layers):
        owners = sorted({graphs.layers[i].taskgraph for i in layers})
        asks = {t: graphs[t].strategy.zero for t in owners if graphs[t].strategy.zero is not None}
        workers = len(layout.stage_groups(s))
        if partial[s]:   # P-Reduce averages whole parameters: ZeRO stage 0
            if any(asks.values()):
                t = next(t for t, z in asks.items() if z)
                raise PlanError(f"TaskGraph {t} ({graphs[t].strategy}) asks for ZeRO stage {asks[t]}, but stage {s} "
                                "runs P-Reduce (sync='partial' or Config.dp_sync 'partial'), which averages whole "
                                "parameters; drop zero= from the region or use sync='exact' on it")
            out.append(0)
            continue
        if asks:
            k = max(asks.values())
            if k and workers == 1:
                t = next(t for t, z in asks.items() if z == k)
                raise PlanError(
                    f"TaskGraph {t} ({graphs[t].strategy}) asks for ZeRO stage {k}, but stage {s} "
                    f"({layout.shapes[s].label}) has one data-parallel worker{' per shard' if layout.shapes[s].tp > 1 else ''}: "
                    f"no other worker holds its parameters, so there is nothing to shard; give the region more "
                    f"devices (replicate(n, zero={k}) with n >= 2) or drop zero= from it"
                )
            out.append(k)
        elif config.zero_stage is not None:
            out.append(config.zero_stage if workers > 1 else 0)
        else:
            out.append(None)
    if config.zero_stage and all(len(layout.stage_groups(s)) == 1 for s in range(layout.num_stages)):
        raise PlanError(
            f"Config.zero_stage is {config.zero_stage}, but no stage of the plan has more than one data-parallel "
            f"worker ({', '.join(sh.label for sh in layout.shapes)}): no other worker holds any stage's parameters, "
            "so there is nothing to shard; use zero_stage=None or 0, or more devices per replicate region"
        )
    return out


def zero_ladder(layout: Layout, s: int, fixed: int | None) -> list[int]:
    """The ZeRO stages stage ``s`` may take, lowest first: the one fixed, else 0 alone on a stage of
    one data-parallel worker, else 0, 1, 2, 3 (Poplar's escalation)."""
    if fixed is not None:
        return [fixed]
    return [0] if len(layout.stage_groups(s)) == 1 else list(ZERO_STAGES)


def next_zero(layout: Layout, s: int, ladder: list[int], current: int, stage_layers, graphs: TaskGraphs,
              config: Config) -> int | None:
    """The next ZeRO stage of ``ladder`` above ``current`` at which stage ``s``'s workers hold less
    weights, gradients and optimizer state in all (the activations are the same at every ZeRO
    stage), or None. One that holds no less cannot fit where ``current`` does not and is skipped: in
    a stage of one FSDP unit (ragged shards or tensor-parallel slices in a pipeline), stages 2 and 3
    hold what stage 1 does; over two workers with AdamW, stage 1 holds what stage 0 does
    (``1.5 + 1.5 + 0.5 * 2 = 1 + 1 + 2``)."""
    cost = StageCost.of_layers(graphs, stage_layers[s], config.precision)

    def static(z: int) -> float:
        return stage_memory(cost, 1, zero=zero_shards(layout, s, cost, z)).static()

    now = static(current)
    for z in ladder[ladder.index(current) + 1:] if current in ladder else []:
        if static(z) < now * (1 - 1e-9):
            return z
    return None


def zero_note(layout: Layout, s: int, ladders, zeros, fixed, replanning: bool, ragged: bool = False) -> str:
    """What the ZeRO escalation tried for stage ``s`` (``ragged``: ragged state shards too), for the
    error that follows."""
    workers = len(layout.stage_groups(s))
    shards = ", with even and with ragged state shards at ZeRO 1-3" if ragged else ""
    if replanning:
        return f" (a re-plan keeps ZeRO stage {zeros[s]} of the plan in force)" if zeros[s] else ""
    if fixed[s] is not None:
        return (f" (under ZeRO stage {fixed[s]}, as asked{shards}; a higher ZeRO stage may fit)"
                if fixed[s] < 3 and workers > 1 else "")
    if workers == 1:
        return " (ZeRO cannot help: no other worker holds this stage's parameters)"
    higher = " (the higher ones hold no less here)" if zeros[s] < ladders[s][-1] else ""
    return (f" (ZeRO stages up to {zeros[s]} were tried over its {workers} data-parallel workers{higher}{shards}; "
            "more data-parallel devices shard its state thinner)")


def naive_decisions(graphs: TaskGraphs, config: Config, layout: Layout, *, recompute: list[str] | None = None,
                    zero: list[int] | None = None, zero_reason: list[str] | None = None,
                    state_fractions: list[tuple[float, ...]] | None = None) -> Decisions:
    """The capacity-blind decisions on ``layout``: equal shares, shards and layer counts, and per stage
    the lowest ZeRO stage at which every device holds its equal share (the highest tried when none
    does: the naive plan may exceed memory), unless fixed (:func:`asked_zero`).

    A re-plan (:mod:`planner.balance.replan`) passes the choices of the plan in force instead, as to
    :func:`aware_decisions` (``zero`` with ``zero_reason``, ``recompute``, ``state_fractions``): the
    naive candidate it compares with its own decisions (:mod:`planner.candidates`) then keeps the
    running replica syncs, the same equal shares, shards and layer counts."""
    gbs, m = config.global_batch_size, config.num_micro_batch
    stage_layers = equal_stage_layers(graphs, layout)
    asked = asked_recompute(graphs, stage_layers)
    if zero is not None:
        reasons = [mine or why for mine, why in zip(asked, recompute or [""] * len(asked))]
        fractions = [tuple(f) for f in state_fractions] if state_fractions is not None else None
        stages = priced_stages(graphs, config, layout, stage_layers, m, aware=False, recompute=reasons, zero=list(zero),
                               fractions=fractions)
        why_zero = list(zero_reason) if zero_reason is not None else ["asked" if z else "none" for z in zero]
        return _decided(layout, stage_layers, stages, equal_sizes(layout, gbs, m), m, "greedy", None, reasons,
                        list(zero), why_zero)
    fixed = asked_zero(graphs, config, layout, stage_layers)
    ladders = [zero_ladder(layout, s, fixed[s]) for s in range(layout.num_stages)]
    sizes = equal_sizes(layout, gbs, m)
    by_zero = {z: priced_stages(graphs, config, layout, stage_layers, m, aware=False, recompute=asked,
                                zero=[z if z in ladder else ladder[0] for ladder in ladders])
               for z in sorted({z for ladder in ladders for z in ladder})}
    zeros = [next((z for z in ladder if _holds_equal_shares(layout, by_zero[z][s], sizes)), ladder[-1])
             for s, ladder in enumerate(ladders)]
    stages = [by_zero[z][s] for s, z in enumerate(zeros)]
    reasons = ["asked" if fixed[s] else ("fit" if z else "none") for s, z in enumerate(zeros)]
    return _decided(layout, stage_layers, stages, sizes, m, "greedy", None, asked, zeros, reasons)


def _holds_equal_shares(layout: Layout, st: PricedStage, sizes) -> bool:
    """Whether every device of stage ``st`` holds its state and its largest equal micro-batch."""
    for r, replica in enumerate(layout.groups):
        for d, group in enumerate(replica[st.index]):
            samples = max(sizes[r][st.index][d])
            for t, device in enumerate(group):
                need = st.memory(st.shards.fractions[t], st.shards.unit_share(t), device=device).total(samples)
                if not fits(need, device.memory_gib * GIB):
                    return False
    return True


def _repartitioned(graphs: TaskGraphs, config: Config, layout: Layout, network, **kwargs) -> Decisions | None:
    """The decisions at ``config``'s micro-batch count with the layers partitioned for it, when no
    split fitted the count asked and the TaskGraph boundaries needed this one (issue 36: the cut
    points are searched with the count, not fixed before it); None when no split fits this count
    either (the boundaries then stand, as the caller found them)."""
    if not partition_stage_layers(graphs, layout, config, network, quiet=True).partitioned:
        return None
    log.warning("no split of the layers fits the micro-batches asked; at %d micro-batches (%d samples each), "
                "which the stages need, one does", config.num_micro_batch,
                config.global_batch_size // config.num_micro_batch)
    try:
        return aware_decisions(graphs, config, layout, network, **kwargs)
    except PlanError:
        return None


def _decided(layout: Layout, stage_layers, stages: list[PricedStage], sizes, count: int, solver: str,
             gap: float | None = None, recompute: list[str] | None = None, zero: list[int] | None = None,
             zero_reason: list[str] | None = None) -> Decisions:
    return Decisions(layout, stage_layers, [s.cost for s in stages], [s.in_flight for s in stages],
                     [s.shards for s in stages], sizes, count, solver, gap,
                     tuple(recompute) if recompute is not None else ("",) * len(stages),
                     tuple(zero) if zero is not None else (0,) * len(stages),
                     tuple(zero_reason) if zero_reason is not None else ("none",) * len(stages),
                     tuple(s.state_fractions for s in stages))
