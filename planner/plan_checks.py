"""Consistency checks of a :class:`~planner.plan.Plan`, alone and against a model and a cluster, and
of a re-plan against the plan in force (:func:`check_same_workers`).

A plan file may be edited by hand or come from another run; every rule the runtime relies on is
checked here, before any process starts, and the first broken one is reported with the path of the
field (``plan.workers[3].micro_batch_sizes``), the bad value and what it should be. Single-field
rules (types, bounds, allowed values) live on the fields (:class:`whalelike.spec.Rule`); the checks
here relate fields to each other, to a model and to a cluster. They are reached through
:func:`whalelike.spec.validate` (``plan.validate``), which runs each once per plan content. They
read the record (:class:`~planner.plan_record.PlanRecord`): :mod:`planner.plan` imports this module
for :meth:`~planner.plan.Plan.validate`, never the other way round.
"""
from __future__ import annotations

import math
from collections import defaultdict

from whalelike.config import SCHEDULES
from whalelike.errors import SpecError
from whalelike.graphs.output_tree import OutputRouteError, route_outputs
from whalelike.spec import check_rules

# memory_gib (planner.devices.memory's estimate) is compared with the capacity by the model's fit
# rule: in floating point (bytes / 2**30), so within its relative tolerance
from planner.devices.memory import fits
from planner.shares.state_fractions import SUM_TOLERANCE
from planner.errors import ModelMismatchError, PlanError
from planner.partial_reduce import WHY, blocker, static_only
from planner.plan_identity import SCHEMA_VERSION, fingerprint_of
from planner.plan_record import PlanRecord

# What a re-plan never changes about a worker (check_same_workers): its process, device and groups
WORKER_MAPPING = ("rank", "device", "host", "replica", "stage", "dp_index", "tp_index", "tp_size")


def check_plan(plan: PlanRecord, graphs=None, cluster=None) -> None:
    """Every check, every time: the field rules, :func:`check_alone` and, when given,
    :func:`check_model` and :func:`check_cluster`. ``plan.validate`` (:func:`whalelike.spec.validate`)
    runs the same once per plan content."""
    check_rules(plan, "plan", PlanError)
    check_alone(plan)
    if graphs is not None:
        check_model(plan, graphs)
    if cluster is not None:
        check_cluster(plan, cluster)


def check_alone(plan: PlanRecord) -> None:
    """The plan's own consistency (its fields' rules hold: :mod:`whalelike.spec` checks them first)."""
    _check_header(plan)
    _check_stages(plan)
    _check_workers(plan)
    _check_batches(plan)
    _check_zero(plan)
    _check_partial(plan)
    _check_shards(plan)
    _check_boundaries(plan)
    _check_candidates(plan)
    _check_schedule_choice(plan)


def _check_header(plan: PlanRecord) -> None:
    if plan.schema_version != SCHEMA_VERSION:
        raise PlanError(
            f"plan.schema_version is {plan.schema_version}, this planner reads version {SCHEMA_VERSION}; "
            "re-create the plan with `whalelike plan`"
        )
    if not plan.stages:
        raise PlanError("plan.stages is empty")
    if not plan.workers:
        raise PlanError("plan.workers is empty")


def _check_stages(plan: PlanRecord) -> None:
    next_layer = 0
    for i, st in enumerate(plan.stages):
        where = f"plan.stages[{i}]"
        if st.index != i:
            raise PlanError(f"{where}.index is {st.index}, expected {i} (stages in pipeline order)")
        if not st.taskgraphs:
            raise PlanError(f"{where}.taskgraphs is empty")
        if not st.layers:
            raise PlanError(f"{where}.layers is empty: every stage runs at least one layer")
        expected = list(range(next_layer, next_layer + len(st.layers)))
        if st.layers != expected:
            raise PlanError(
                f"{where}.layers must be contiguous and continue the previous stage: expected "
                f"{_span(expected)}, got {_span(st.layers)}"
            )
        next_layer += len(st.layers)
        _check_recompute(st, where)
    stage_regions(plan)   # folded stages: runs of adjacent TaskGraphs, in order


def stage_regions(plan: PlanRecord) -> list[list[int]]:
    """The TaskGraphs each stage stands for, in order: ``StagePlan.folded`` for a stage folded from
    several regions (:mod:`planner.candidates`), else the one after the previous stage's (one stage
    per TaskGraph in a plan without folds). Raises PlanError for a ``folded`` list that is not two or
    more adjacent TaskGraphs following the previous stage's."""
    out, following = [], 0
    for st in plan.stages:
        mine = list(st.folded) if st.folded else [following]
        if st.folded and (len(st.folded) < 2 or st.folded != list(range(following, following + len(st.folded)))):
            raise PlanError(f"plan.stages[{st.index}].folded is {st.folded}: a folded stage stands for two or more "
                            f"adjacent TaskGraphs following the previous stage's ({following}, {following + 1}, ...); "
                            "re-plan with `whalelike plan`")
        out.append(mine)
        following = mine[-1] + 1
    return out


def _check_folds(plan: PlanRecord, graphs) -> None:
    """A plan with folded stages stands for every TaskGraph once, and folds only what the planner may
    (:func:`planner.partition.stage_layers.foldable_runs`'s rule: plain ``replicate`` regions of
    automatic device count and equal strategies); nothing to check in a plan without folds."""
    if not any(st.folded for st in plan.stages):
        return
    regions = stage_regions(plan)
    if regions[-1][-1] != len(graphs) - 1:
        raise PlanError(f"plan.stages stand for TaskGraphs 0..{regions[-1][-1]} (StagePlan.folded), the model has "
                        f"0..{len(graphs) - 1}; re-plan for this model with `whalelike plan`")
    if plan.shared_devices:
        asked = graphs.devices_asked
        if asked <= plan.world_size:
            raise PlanError(f"plan.shared_devices says the regions share devices, but they ask {asked} and the plan has "
                            f"{plan.world_size} workers: folded stages of other regions than adjacent plain replicate "
                            "ones are for clusters smaller than the regions ask; re-plan with `whalelike plan`")
        for st, tgs in zip(plan.stages, regions):
            if len(tgs) > 1 and any(w.tp_size != 1 for w in plan.stage_workers(st.index)):
                raise PlanError(f"plan.stages[{st.index}] folds TaskGraphs {tgs} but runs tensor-parallel groups: a "
                                "stage of several regions is data parallel; re-plan with `whalelike plan`")
        return
    for st, tgs in zip(plan.stages, regions):
        if len(tgs) < 2:
            continue
        strategies = [graphs[t].strategy for t in tgs]
        bad = next((t for t, x in zip(tgs, strategies) if x.kind != "replicate" or x.inner is not None
                    or x.device_count is not None or x != strategies[0]), None)
        if bad is not None:
            raise PlanError(f"plan.stages[{st.index}].folded is {st.folded} but TaskGraph {bad} ({graphs[bad].strategy}) "
                            f"cannot fold with TaskGraph {tgs[0]} ({strategies[0]}): only adjacent replicate regions of "
                            "automatic device count and equal options fold into one stage; re-plan with `whalelike plan`")


def _check_recompute(st, where: str) -> None:
    """``recompute`` and its reason agree; a recomputing stage has no training-mode BatchNorm (the
    recompute would run it again and update its running statistics twice, so training would no
    longer match the model's)."""
    if st.recompute != (st.recompute_reason != "none"):
        want = "'asked' or 'fit'" if st.recompute else "'none'"
        raise PlanError(f"{where}.recompute_reason is {st.recompute_reason!r} with recompute {st.recompute}; "
                        f"it must be {want}: re-create the plan with `whalelike plan`")
    if st.recompute and st.batchnorm:
        raise PlanError(
            f"{where}.recompute is true but the stage runs BatchNorm in training mode ({', '.join(st.batchnorm)}): "
            "recomputing its forward would update the running statistics twice; remove recompute=True from "
            "the region, or put the BatchNorm layers in a region that does not recompute"
        )


def _check_workers(plan: PlanRecord) -> None:
    num_stages = len(plan.stages)
    for i, w in enumerate(plan.workers):
        where = f"plan.workers[{i}]"
        if w.rank != i:
            raise PlanError(f"{where}.rank is {w.rank}, expected {i}: workers must be ranks 0..{plan.world_size - 1} in order")
        if not 0 <= w.stage < num_stages:
            raise PlanError(f"{where}.stage is {w.stage}, the plan has stages 0..{num_stages - 1}")
        if not 0 <= w.tp_index < w.tp_size:
            raise PlanError(f"{where}.tp_index is {w.tp_index}, must be in 0..{w.tp_size - 1} (tp_size {w.tp_size})")
        if w.capacity_gib > 0 and not fits(w.memory_gib, w.capacity_gib):
            raise PlanError(f"{where}.memory_gib is {w.memory_gib:g} GiB, above its capacity_gib {w.capacity_gib:g}; "
                            "the worker would run out of memory: re-create the plan with `whalelike plan`")
    devices = defaultdict(list)
    for w in plan.workers:
        devices[w.device].append(w.rank)
    for device, ranks in devices.items():
        if len(ranks) > 1:
            raise PlanError(f"plan.workers: device {device!r} is used by ranks {ranks}; one worker per device")
    replicas = sorted({w.replica for w in plan.workers})
    if replicas != list(range(len(replicas))):
        raise PlanError(f"plan.workers replica indices must be 0..{len(replicas) - 1}, got {replicas}")
    for r in replicas:
        for s in range(num_stages):
            _check_stage_group(plan, r, s)


def _check_stage_group(plan: PlanRecord, replica: int, stage: int) -> None:
    where = f"plan.workers (replica {replica}, stage {stage})"
    members = plan.stage_workers(stage, replica)
    if not members:
        raise PlanError(f"{where}: no worker runs this stage")
    tp_sizes = {w.tp_size for w in members}
    if len(tp_sizes) != 1:
        raise PlanError(f"{where}: tp_size differs between workers: {sorted(tp_sizes)}")
    (tp_size,) = tp_sizes
    groups = defaultdict(list)
    for w in members:
        groups[w.dp_index].append(w)
    if sorted(groups) != list(range(len(groups))):
        raise PlanError(f"{where}: dp_index values must be 0..{len(groups) - 1}, got {sorted(groups)}")
    for dp, group in groups.items():
        if sorted(w.tp_index for w in group) != list(range(tp_size)):
            raise PlanError(
                f"{where}, dp_index {dp}: tp_index values {sorted(w.tp_index for w in group)}, expected 0..{tp_size - 1}"
            )
        sizes = {tuple(w.micro_batch_sizes) for w in group}
        if len(sizes) != 1:
            raise PlanError(
                f"{where}, dp_index {dp}: tensor-parallel workers must process the same samples, "
                f"got micro_batch_sizes {[w.micro_batch_sizes for w in group]}"
            )


def _check_batches(plan: PlanRecord) -> None:
    multi_stage = len(plan.stages) > 1
    longest = 0
    for w in plan.workers:
        where = f"plan.workers[{w.rank}].micro_batch_sizes"
        if not w.micro_batch_sizes or any(b < 1 for b in w.micro_batch_sizes):
            raise PlanError(f"{where} must be a non-empty list of positive sizes, got {w.micro_batch_sizes}")
        if multi_stage and len(w.micro_batch_sizes) != plan.num_micro_batch:
            raise PlanError(
                f"{where} has {len(w.micro_batch_sizes)} entries; a pipeline needs one per micro-batch "
                f"(num_micro_batch = {plan.num_micro_batch})"
            )
        longest = max(longest, len(w.micro_batch_sizes))
        for name in ("forward_ms", "backward_ms"):
            times = getattr(w, name)
            if times and len(times) != len(w.micro_batch_sizes):
                raise PlanError(
                    f"plan.workers[{w.rank}].{name} has {len(times)} entries for {len(w.micro_batch_sizes)} micro-batches"
                )
    if not multi_stage and longest != plan.num_micro_batch:
        raise PlanError(
            f"plan.num_micro_batch is {plan.num_micro_batch} but the longest micro_batch_sizes list has {longest} entries"
        )
    per_stage = {}
    for s in range(len(plan.stages)):
        # one sample count per tensor-parallel group (its members process the same samples)
        heads = [w for w in plan.stage_workers(s) if w.tp_index == 0]
        total = sum(w.batch_share for w in heads)
        if total != plan.global_batch_size:
            raise PlanError(
                f"plan.workers of stage {s}: batch shares sum to {total}, expected global_batch_size "
                f"{plan.global_batch_size} ({' + '.join(str(w.batch_share) for w in heads)})"
            )
        if multi_stage:
            per_stage[s] = {
                (r, m): sum(w.micro_batch_sizes[m] for w in heads if w.replica == r)
                for r in range(plan.num_replicas)
                for m in range(plan.num_micro_batch)
            }
    for s in range(1, len(per_stage)):
        for key, n in per_stage[s].items():
            if per_stage[0][key] != n:
                r, m = key
                raise PlanError(
                    f"plan.workers: replica {r} micro-batch {m} has {per_stage[0][key]} samples in stage 0 "
                    f"but {n} in stage {s}; every stage of a pipeline must see the same samples"
                )


def _check_zero(plan: PlanRecord) -> None:
    """A stage's replica sync and ZeRO stage agree (``ddp`` exactly at ``zero_stage`` 0, ``fsdp`` or
    ``ragged`` at 1-3; a reason other than ``none`` only with a ZeRO stage), ragged
    shards have their fractions (:func:`_check_state_fractions`), a ZeRO stage has someone to shard
    with (more than one worker per ``tp_index``), and at ZeRO stages 2 and 3 every worker of the stage
    runs the same number of micro-batches (each micro-batch issues collectives over the data-parallel
    group: a rank with one fewer would leave the others waiting in a reduce-scatter that never
    completes)."""
    for st in plan.stages:
        where = f"plan.stages[{st.index}]"
        want = "fsdp" if st.zero_stage else "ddp"
        if st.replica_sync == "ragged" and st.zero_stage:   # memory-proportional shards at ZeRO 1-3
            want = "ragged"
        if st.replica_sync == "partial" and not st.zero_stage:   # P-Reduce averages whole parameters
            want = "partial"
        if st.replica_sync != want:
            ragged = " or 'ragged' (ragged state shards, with state_fractions)" if st.zero_stage else ""
            raise PlanError(f"{where}.replica_sync is {st.replica_sync!r} with zero_stage {st.zero_stage}; it must be "
                            f"{want!r}{ragged} ('ddp', or 'partial' for P-Reduce, exactly when zero_stage is 0): "
                            "re-create the plan with `whalelike plan`")
        _check_state_fractions(plan, st, where)
        if not st.zero_stage and st.zero_reason != "none":   # 'none' with a ZeRO stage: a plan written by hand
            raise PlanError(f"{where}.zero_reason is {st.zero_reason!r} with zero_stage 0; it must be 'none' (a "
                            "reason is given only for a ZeRO stage 1-3): re-create the plan with `whalelike plan`")
        if not st.zero_stage:
            continue
        members = plan.stage_workers(st.index)
        per_shard = sum(1 for w in members if w.tp_index == 0)
        if per_shard < 2:
            raise PlanError(f"{where}.zero_stage is {st.zero_stage} but the stage has one data-parallel worker per "
                            "shard: no other worker holds its parameters, so there is nothing to shard; set "
                            "zero_stage 0 and replica_sync 'ddp', or re-create the plan with `whalelike plan`")
        counts = {w.rank: len(w.micro_batch_sizes) for w in members}
        if st.zero_stage >= 2 and len(set(counts.values())) > 1:
            raise PlanError(
                f"plan.workers of stage {st.index}: micro-batch counts {sorted(set(counts.values()))} differ (rank: "
                f"count {_some([f'{r}: {n}' for r, n in counts.items()])}), but ZeRO stage {st.zero_stage} needs the "
                "same count on every worker of the data-parallel group (each micro-batch reduce-scatters over it); "
                "re-create the plan with `whalelike plan`"
            )


def _check_partial(plan: PlanRecord) -> None:
    """A stage running Prague's partial all-reduce (``replica_sync`` ``"partial"``,
    ``runtime.replicas.partial_sync``) keeps P-Reduce's rules (:mod:`planner.partial_reduce`): it has
    replicas to average (two or more data-parallel workers) and no ``split``, its groups are no
    larger than its data-parallel group, and where :func:`~planner.partial_reduce.static_only` says
    (a pipeline, an fp16 plan) it runs the static generator. Its ZeRO stage is 0 (:func:`_check_zero`)."""
    for st in plan.stages:
        if st.replica_sync != "partial":
            continue
        where = f"plan.stages[{st.index}]"
        members = plan.stage_workers(st.index)
        tp = max(w.tp_size for w in members)
        blocked = blocker(len(members), tp)   # the ZeRO stage: _check_zero
        if blocked == "split":
            raise PlanError(f"{where}.replica_sync is 'partial' on a stage under split({tp}); {WHY['split']}: set "
                            "replica_sync 'ddp', or drop sync='partial' from the region, or re-create the plan "
                            "with `whalelike plan`")
        pinned = static_only(len(plan.stages), plan.precision)
        if pinned and st.partial_generator != "static":
            raise PlanError(f"{where}.partial_generator is {st.partial_generator!r} {pinned}, and the smart "
                            "generator's groups may span steps and wait across it: set partial_generator 'static', "
                            "or re-create the plan with `whalelike plan`")
        n = len(members)
        if blocked == "one worker":
            raise PlanError(f"{where}.replica_sync is 'partial' but the stage runs on one device "
                            f"({members[0].device}): {WHY['one worker']}; set replica_sync 'ddp', give the region "
                            "two or more devices, or re-create the plan with `whalelike plan`")
        if st.partial_group_size > n:
            raise PlanError(f"{where}.partial_group_size is {st.partial_group_size}, larger than the stage's "
                            f"{n} data-parallel workers (ranks {_some([str(w.rank) for w in members])}); a P-Reduce "
                            f"group holds at most all of them: set 2..{n} ({n}: every worker, every step), or "
                            "re-create the plan with `whalelike plan`")


def _check_state_fractions(plan: PlanRecord, st, where: str) -> None:
    """``state_fractions`` exactly with replica sync ``ragged``, which runs on stages without
    ``split`` (``runtime.replicas.ragged_sync``; each pipeline stage's group its own): one fraction per worker of the stage's
    data-parallel group in rank order, summing to 1 (within
    :data:`planner.shares.state_fractions.SUM_TOLERANCE`); each is >= 0 by its field rule."""
    fractions = list(st.state_fractions)
    if st.replica_sync != "ragged":
        if fractions:
            raise PlanError(f"{where}.state_fractions is {_some([f'{f:g}' for f in fractions])} with replica_sync "
                            f"{st.replica_sync!r}; state fractions are ragged shards' (replica_sync 'ragged'): set "
                            "state_fractions to [] for even shards, or replica_sync 'ragged', or re-create the plan "
                            "with `whalelike plan`")
        return
    if not fractions:
        raise PlanError(f"{where}.state_fractions is empty with replica_sync 'ragged'; ragged shards need each "
                        "data-parallel worker's fraction of the state (in rank order, summing to 1): give them, or "
                        "set replica_sync 'fsdp' for even shards, or re-create the plan with `whalelike plan`")
    members = plan.stage_workers(st.index)
    tp = max(w.tp_size for w in members)
    if tp > 1:
        raise PlanError(f"{where}.replica_sync is 'ragged' on a stage under split({tp}); ragged state shards run on "
                        "stages without split only: set replica_sync 'fsdp' and state_fractions [] (even shards, "
                        "each tensor-parallel slice sharded), or re-create the plan with `whalelike plan`")
    group = sorted(w.rank for w in members if w.tp_index == 0)
    if len(fractions) != len(group):
        raise PlanError(f"{where}.state_fractions has {len(fractions)} entries "
                        f"({_some([f'{f:g}' for f in fractions])}); the stage's data-parallel group has "
                        f"{len(group)} workers (ranks {_some([str(r) for r in group])}): give one fraction per "
                        "worker in rank order, or re-create the plan with `whalelike plan`")
    total = math.fsum(fractions)
    if abs(total - 1.0) > SUM_TOLERANCE:
        raise PlanError(f"{where}.state_fractions {_some([f'{f:g}' for f in fractions])} sum to {total!r}; they "
                        f"must sum to 1 (within {SUM_TOLERANCE:g}): each worker's share of the state, e.g. divide "
                        f"each by {total:g}, or re-create the plan with `whalelike plan`")


def _check_shards(plan: PlanRecord) -> None:
    for st in plan.stages:
        tp_size = plan.stage_workers(st.index)[0].tp_size
        for path, sizes in st.shard_sizes.items():
            where = f"plan.stages[{st.index}].shard_sizes[{path!r}]"
            if len(sizes) != tp_size:
                raise PlanError(f"{where} has {len(sizes)} sizes for tp_size {tp_size}")
            if any(n < 1 for n in sizes):
                raise PlanError(f"{where}: every shard needs at least one element, got {sizes}")


def _check_boundaries(plan: PlanRecord) -> None:
    for i, b in enumerate(plan.boundaries):
        where = f"plan.boundaries[{i}]"
        if not 0 <= b.src_stage < b.dst_stage < len(plan.stages):
            raise PlanError(
                f"{where}: src_stage {b.src_stage} -> dst_stage {b.dst_stage} is not a forward edge between "
                f"stages 0..{len(plan.stages) - 1}"
            )
        if b.transfer_ms and len(b.transfer_ms) != plan.num_micro_batch:
            raise PlanError(f"{where}.transfer_ms has {len(b.transfer_ms)} entries for {plan.num_micro_batch} micro-batches")


def _check_candidates(plan: PlanRecord) -> None:
    """The plan is the candidate it says (``plan.chosen``, its predicted step), one that fits, and
    no candidate that fits is predicted faster (:mod:`planner.candidates`); nothing to check in a
    plan without candidates (a re-plan, a file written before them)."""
    if not plan.candidates:
        return
    names = [c.name for c in plan.candidates]
    if len(set(names)) != len(names):
        raise PlanError(f"plan.candidates names {names}: each candidate once; re-plan with `whalelike plan`")
    if plan.chosen not in names:
        raise PlanError(f"plan.chosen is {plan.chosen!r}, not one of plan.candidates ({', '.join(names)}); set it to the "
                        "candidate this plan is, or re-plan with `whalelike plan`")
    i = names.index(plan.chosen)
    mine = plan.candidates[i]
    where = f"plan.candidates[{i}]"
    regions = stage_regions(plan)
    folds = any(st.folded for st in plan.stages)
    # on a cluster smaller than the regions ask, every candidate may fold (planner.devices.placement.shared_device_groups)
    if folds != (mine.name == "folded") and mine.name != "naive" and not plan.shared_devices:
        have = f"stage(s) {[st.index for st in plan.stages if st.folded]} are folded" if folds else "no stage is folded"
        raise PlanError(f"plan.chosen is {plan.chosen!r} but {have} (StagePlan.folded): the 'folded' candidate has "
                        "folded stages, the 'aware' one none; re-plan with `whalelike plan`")
    if mine.stages != (regions if folds else []):
        raise PlanError(f"{where}.stages is {mine.stages} but the plan's stages stand for TaskGraphs "
                        f"{regions if folds else '(one stage each)'} (StagePlan.folded): the candidate kept is the "
                        "plan; re-plan with `whalelike plan`")
    if not mine.fits:
        raise PlanError(f"{where} ({mine.name!r}, the plan chosen) has fits false: a plan that does not fit is never "
                        "kept; re-plan with `whalelike plan`")
    if not math.isclose(mine.step_time_ms, plan.prediction.step_time_ms, rel_tol=1e-9, abs_tol=1e-12):
        raise PlanError(f"{where}.step_time_ms is {mine.step_time_ms!r} but the plan ({mine.name!r}) predicts "
                        f"{plan.prediction.step_time_ms!r} ms (plan.prediction.step_time_ms); they are one figure")
    for j, other in enumerate(plan.candidates):
        # a candidate with a stage that computes nothing loses to any that fits without one (planner.candidates)
        if other.fits and other.step_time_ms < mine.step_time_ms * (1 - 1e-9) and \
                not (other.idle_stages and not mine.idle_stages):
            raise PlanError(f"plan.candidates[{j}] ({other.name!r}) fits and is predicted faster ({other.step_time_ms:g} "
                            f"ms) than the plan chosen ({mine.name!r}, {mine.step_time_ms:g} ms): the planner keeps the "
                            "fastest that fits; re-plan with `whalelike plan`")


def _check_schedule_choice(plan: PlanRecord) -> None:
    """A plan made under ``Config.schedule`` ``"auto"`` (``plan.schedule_steps_ms``, planner.candidates
    .fastest_schedule) runs the schedule it lists with its own predicted step, and no schedule it
    lists is predicted faster."""
    steps = plan.schedule_steps_ms
    if not steps:
        return
    unknown = sorted(set(steps) - set(SCHEDULES))
    if unknown:
        raise PlanError(f"plan.schedule_steps_ms names {unknown}, not schedules ({', '.join(SCHEDULES)}); re-plan "
                        "with `whalelike plan --pipeline-schedule auto`")
    if plan.schedule not in steps:
        raise PlanError(f"plan.schedule is {plan.schedule!r}, not one of the schedules planned "
                        f"(plan.schedule_steps_ms: {', '.join(steps)}); set it to the one kept or re-plan")
    if not math.isclose(steps[plan.schedule], plan.prediction.step_time_ms, rel_tol=1e-9, abs_tol=1e-12):
        raise PlanError(f"plan.schedule_steps_ms[{plan.schedule!r}] is {steps[plan.schedule]!r} but the plan predicts "
                        f"{plan.prediction.step_time_ms!r} ms (plan.prediction.step_time_ms); they are one figure")
    for schedule, ms in steps.items():
        if ms < steps[plan.schedule] * (1 - 1e-9):
            raise PlanError(f"plan.schedule_steps_ms[{schedule!r}] ({ms:g} ms) is predicted faster than the schedule "
                            f"kept ({plan.schedule!r}, {steps[plan.schedule]:g} ms): the planner keeps the fastest; "
                            "re-plan with `whalelike plan --pipeline-schedule auto`")


def check_model(plan: PlanRecord, graphs) -> None:
    """The plan was made for this model (its TaskGraphs): fingerprint, layers, shardable modules,
    and every model output computed before the last stage can reach the loss (:func:`_check_outputs`)."""
    fp = fingerprint_of(graphs)
    if fp != plan.model_fingerprint:
        raise ModelMismatchError(
            f"plan was made for model {plan.model_fingerprint[:12]}, this model is {fp[:12]}; "
            "re-plan for this model with `whalelike plan`", planned=plan.model_fingerprint[:12], actual=fp[:12]
        )
    last = plan.stages[-1].layers[-1]
    if last != len(graphs.layers) - 1:
        raise PlanError(f"plan.stages cover layers 0..{last}, the model has layers 0..{len(graphs.layers) - 1}")
    for st in plan.stages:
        owners = sorted({graphs.layers[i].taskgraph for i in st.layers})
        if owners != sorted(st.taskgraphs):
            raise PlanError(f"plan.stages[{st.index}].taskgraphs is {st.taskgraphs}, its layers belong to {owners}")
        dims = {p: d for t in st.taskgraphs for p, d in graphs[t].shardable.items()}
        for path, sizes in st.shard_sizes.items():
            if path not in dims:
                raise PlanError(f"plan.stages[{st.index}].shard_sizes: {path!r} is not a shardable module of this stage")
            if sum(sizes) != dims[path]:
                raise PlanError(
                    f"plan.stages[{st.index}].shard_sizes[{path!r}] sums to {sum(sizes)}, the dimension is {dims[path]}"
                )
        for group in (g for t in st.taskgraphs for g in graphs[t].shard_groups):
            _check_group(st, group)
        asked_zero = {t: graphs[t].strategy.zero for t in st.taskgraphs if graphs[t].strategy.zero is not None}
        if asked_zero and st.zero_stage != max(asked_zero.values()):
            raise PlanError(
                f"plan.stages[{st.index}].zero_stage is {st.zero_stage} but TaskGraph(s) {sorted(asked_zero)} of this "
                f"stage ask for zero={max(asked_zero.values())} (replicate(n, zero=k)); re-plan for this model with "
                "`whalelike plan`"
            )
        partial = sorted(t for t in st.taskgraphs if getattr(graphs[t].strategy, "sync", None) == "partial")
        if partial and st.replica_sync != "partial":
            raise PlanError(
                f"plan.stages[{st.index}].replica_sync is {st.replica_sync!r} but TaskGraph(s) {partial} of this "
                "stage ask for sync='partial' (P-Reduce); re-plan for this model with `whalelike plan`"
            )
        asking = [t for t in st.taskgraphs if graphs[t].strategy.asks_recompute]
        if asking and not st.recompute:
            raise PlanError(
                f"plan.stages[{st.index}].recompute is false but TaskGraph(s) {asking} of this stage ask for "
                "recompute=True (activation checkpointing); re-plan for this model with `whalelike plan`"
            )
    _check_folds(plan, graphs)
    _check_outputs(plan, graphs)


def _check_outputs(plan: PlanRecord, graphs) -> None:
    """Model outputs computed before the last stage: the rule the runtime's stage split applies
    (:func:`whalelike.graphs.output_tree.route_outputs`, on the capture's ``TaskGraphs.outputs`` and
    ``loss_reads``), so a plan accepted here runs: each is sent on to the last stage, or left out
    where the loss does not read it; one the loss reads (or may read) that is not a batched tensor
    cannot reach it. Graphs without the record (a file from before it) are not checked."""
    leaves = getattr(graphs, "outputs", ())
    if not leaves or len(plan.stages) < 2:
        return
    stage_of_layer = {layer: st.index for st in plan.stages for layer in st.layers}
    try:
        route_outputs(leaves, lambda leaf: stage_of_layer.get(leaf.layer), len(plan.stages), graphs.loss_reads)
    except OutputRouteError as e:
        raise PlanError(f"plan.stages: {e}; then re-plan with `whalelike plan`") from None


def _check_group(st, group) -> None:
    """Members of a shard group need whole units (heads), the same number per rank."""
    where = f"plan.stages[{st.index}].shard_sizes"
    agreed = None
    for member in group.members:
        sizes = st.shard_sizes.get(member.path)
        if sizes is None:
            if member.role == "column":
                raise PlanError(f"{where} has no entry for {member.path!r}, a column of the {group.describe()}")
            continue
        units = group.units_of(member.path, sizes)
        if units is None:
            unit = "heads" if group.kind == "attention" else "units"
            raise PlanError(
                f"{where}[{member.path!r}] = {sizes} are not whole {unit} of the {group.describe()}: each "
                f"size must be a multiple of {member.per_unit}"
            )
        if agreed is not None and units != agreed[1]:
            raise PlanError(
                f"{where}: {member.path!r} holds {units} units per rank but {agreed[0]!r} holds {agreed[1]}; "
                f"every member of the {group.describe()} needs the same units per rank"
            )
        agreed = agreed or (member.path, units)


def check_precision(cluster, precision: str, devices=None, what: str = "precision") -> None:
    """Every device of ``cluster`` (or of the names ``devices``) runs ``precision``; else a PlanError
    naming the devices by kind, why they cannot, and the precisions they all run
    (:meth:`whalelike.cluster.Cluster.check_precision`). Where the cluster meets a precision:
    :func:`planner.plan` and :func:`check_cluster`."""
    try:
        cluster.check_precision(precision, devices)
    except SpecError as e:
        raise PlanError(f"{what} is {precision!r}, but in {e}") from None


def check_cluster(plan: PlanRecord, cluster) -> None:
    """Every worker's device exists in ``cluster``, on its host, in rank order, with room for it,
    and runs the plan's precision."""
    known = {d.name: d for d in cluster.devices}
    for w in plan.workers:
        device = known.get(w.device)
        if device is None:
            raise PlanError(
                f"plan.workers[{w.rank}].device: unknown device {w.device!r} for cluster {cluster.name!r} "
                f"(it has {_some(sorted(known))}); re-plan for this cluster with `whalelike plan`"
            )
        if device.host != w.host:
            raise PlanError(f"plan.workers[{w.rank}].host is {w.host!r}, device {w.device!r} is on host {device.host!r}")
        if not fits(w.memory_gib, device.memory_gib):
            raise PlanError(
                f"plan.workers[{w.rank}].memory_gib is {w.memory_gib:g} GiB, more than device {w.device!r} has "
                f"({device.memory_gib:g} GiB in cluster {cluster.name!r}); re-plan for this cluster with `whalelike plan`"
            )
    check_precision(cluster, plan.precision, [w.device for w in plan.workers], what="plan.precision")
    for before, w in zip(plan.workers, plan.workers[1:]):
        if cluster.positions[w.device] <= cluster.positions[before.device]:
            raise PlanError(
                f"plan.workers[{w.rank}].device {w.device!r} comes before or is rank {before.rank}'s device "
                f"{before.device!r} in cluster {cluster.name!r}; ranks must follow the cluster's device order "
                "(torchrun numbers processes host by host, each on its local device LOCAL_RANK)"
            )


def check_same_workers(old: PlanRecord, new: PlanRecord, who: str) -> None:
    """A re-plan keeps every worker where it is: ``new`` has ``old``'s workers and stages, and each
    worker its rank, device, host, replica, stage, ``dp_index``, ``tp_index`` and ``tp_size``
    (:data:`WORKER_MAPPING`), so every process group stays valid; only amounts of work change.

    Raises :class:`PlanError` starting with ``who`` (the caller, e.g. ``"Engine.apply_plan"``) and
    naming the first worker and field that differ with both values (``old``'s is "the running one").
    """
    if len(old.workers) != len(new.workers) or len(old.stages) != len(new.stages):
        raise PlanError(f"{who}: the new plan has {len(new.workers)} workers in {len(new.stages)} stages, the running "
                        f"one {len(old.workers)} in {len(old.stages)}; a re-plan keeps the workers (restart the job "
                        "with the new plan to change them)")
    for a, b in zip(old.workers, new.workers):
        for name in WORKER_MAPPING:
            if getattr(a, name) != getattr(b, name):
                raise PlanError(f"{who}: plan.workers[{a.rank}].{name} is {getattr(b, name)!r} in the new plan, "
                                f"{getattr(a, name)!r} in the running one; a re-plan keeps every worker's device, "
                                "stage and groups (restart the job with the new plan to change them)")


def _some(names: list[str], shown: int = 8) -> str:
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")


def _span(layers: list[int]) -> str:
    return f"{layers[0]}..{layers[-1]}" if layers else "[]"
