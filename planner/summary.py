"""``Plan.summary()``: one aligned row per device, per device its memory term by term (weights,
gradients, optimizer state, activations against its memory; under ragged shards its fraction of the
state), each stage's ZeRO stage, the predicted
gain over the naive plan, the plans the planner priced and which it kept (:func:`choice_lines`) and,
given the cluster, the resharding chosen at each pipeline boundary, and a line for each stage that
runs Prague's partial all-reduce, named APPROXIMATE (:func:`partial_lines`). The
title names the training precision unless it is fp32. :meth:`planner.plan.Plan.summary` prints
:func:`plan_summary`; this module reads the record (:class:`~planner.plan_record.PlanRecord`), so the
Plan's module imports it and not the other way round.

The resharding section needs the cluster: the Plan records which host each worker is on and each
boundary's bytes per sample, but not the link figures (bandwidths, latency) that price a transfer.
"""
from __future__ import annotations

from itertools import groupby

from whalelike.display import format_table

from planner.plan_record import PlanRecord, Worker
from planner.shares.batchnorm_statistics import batchnorm_warnings
from planner.resharding.reshard import boundary_resharding, byte_size, unbatched_resharding


def plan_summary(plan: PlanRecord, cluster=None) -> str:
    """The summary; with ``cluster`` (the :class:`whalelike.cluster.Cluster` the plan was made for,
    or a :class:`planner.devices.network.NetworkModel` of it) also :func:`resharding_lines`."""
    headers = ["rank", "device", "host", "stage", "dp", "tp", "samples", "shard", "memory GiB", "compute ms"]
    rows = [
        [
            w.rank, w.device, w.host, w.stage,
            f"{w.replica}.{w.dp_index}" if plan.num_replicas > 1 else w.dp_index,
            f"{w.tp_index}/{w.tp_size}" if w.tp_size > 1 else "-",
            _samples(w), _shard(plan, w),
            f"{w.memory_gib:.2f} / {w.capacity_gib:.1f}", f"{w.compute_ms:.2f}",
        ]
        for w in plan.workers
    ]
    if any(w.update_ms for w in plan.workers):   # the optimizer's update, where a rate prices it
        headers.append("update ms")
        for row, w in zip(rows, plan.workers):
            row.append(f"{w.update_ms:.2f}")
    title = (
        f"plan for model {plan.model_fingerprint[:12]} on {plan.cluster}: {len(plan.stages)} stage(s), "
        f"{plan.num_replicas} pipeline replica(s), {plan.world_size} workers, global batch "
        f"{plan.global_batch_size} in {plan.num_micro_batch} micro-batch(es), schedule {plan.schedule}"
        # Config.schedule "auto" (planner.candidates.fastest_schedule): every schedule planned, its step
        + ("" if not plan.schedule_steps_ms else " (auto, the fastest of " + ", ".join(
            f"{s} {ms:.2f} ms" for s, ms in plan.schedule_steps_ms.items()) + ")")
        # fp32 is the default and goes unsaid (summaries of fp32 plans read as before precision existed)
        + ("" if plan.precision == "fp32" else f", precision {plan.precision} (autocast, float32 master weights)")
    )
    if plan.shared_devices:   # planner.devices.placement.shared_device_groups: a cluster smaller than the regions ask
        title += f"\n  regions share devices: {plan.shared_devices}"
    stages = [
        f"  stage {st.index}: {st.strategy}, layers {st.layers[0]}..{st.layers[-1]} (TaskGraph(s) "
        f"{', '.join(map(str, st.taskgraphs))}){_folded(st)}{_zero(st)}{_recompute(st)}"
        for st in plan.stages
    ]
    p, n = plan.prediction, plan.naive_prediction
    gap = "" if plan.optimality_gap is None else f", optimality gap {plan.optimality_gap:.2%}"
    speedup = n.step_time_ms / p.step_time_ms if p.step_time_ms > 0 else float("nan")
    lines = [
        title, *stages, "", format_table(headers, rows), "", *memory_lines(plan),
        f"solver: {plan.solver}{gap}",
        f"predicted step time {p.step_time_ms:.2f} ms, bubble {p.bubble_fraction:.1%}, "
        f"throughput {p.throughput:.1f} samples/s "
        f"({'device speeds and links measured by whalelike profile' if plan.speeds == 'profile' else 'device speeds from the cluster spec'})",
        f"naive plan (capacity-blind)  {n.step_time_ms:.2f} ms, bubble {n.bubble_fraction:.1%}, "
        f"throughput {n.throughput:.1f} samples/s",
        f"predicted speed-up over naive: {speedup:.2f}x",
        *choice_lines(plan),
        *(f"warning: {line}" for line in batchnorm_warnings(plan)),
    ]
    if cluster is not None and plan.boundaries:
        lines += ["", *resharding_lines(plan, cluster)]
    return "\n".join(lines + partial_lines(plan))


def resharding_lines(plan: PlanRecord, cluster, micro_batch: int = 0) -> list[str]:
    """One line per pipeline boundary: the resharding of micro-batch ``micro_batch``
    (:func:`planner.resharding.reshard.boundary_resharding`): bytes, strategy, unit tasks, predicted time,
    lower bound, what plain send/recv would take, and the plan's own ``BoundaryPlan.transfer_ms``
    (the simulator's figure) for comparison; before it, a line for the values without a batch
    dimension where the boundary carries some (:func:`planner.resharding.reshard.unbatched_resharding`)."""
    lines = [f"resharding at each boundary (micro-batch {micro_batch}, predicted by planner.resharding.reshard):"]
    for boundary, reshard, whole in zip(plan.boundaries, boundary_resharding(plan, cluster, micro_batch),
                                        unbatched_resharding(plan, cluster)):
        head = f"  boundary stage {boundary.src_stage} -> {boundary.dst_stage}"
        if whole is not None:   # values without a batch dimension: whole, once per micro-batch and replica
            lines.append(f"{head}: {byte_size(boundary.unbatched_bytes)} without a batch dimension, whole to every "
                         f"receiving worker, strategy {whole.strategy}, {len(whole.transfers)} transfer(s), predicted "
                         f"{whole.predicted_ms:.3g} ms")
        if reshard is None:
            if whole is None:
                lines.append(f"{head}: nothing crosses it")
            continue
        nbytes = sum(task.elements for task in reshard.tasks) * reshard.itemsize
        send_recv = reshard.alternatives_ms.get("send_recv")
        lines.append(f"{head}: {byte_size(nbytes)}, strategy {reshard.strategy}, {len(reshard.tasks)} unit task(s), "
                     f"{len(reshard.transfers)} transfer(s), predicted {reshard.predicted_ms:.3g} ms (lower bound "
                     f"{reshard.lower_bound_ms:.3g} ms)"
                     + (f", send/recv would take {send_recv:.3g} ms" if send_recv is not None else "")
                     + (f"; the plan's transfer_ms {boundary.transfer_ms[micro_batch]:.3g} ms"
                        if micro_batch < len(boundary.transfer_ms) else ""))
    return lines


# Plan.chosen / CandidatePlan.name in words (planner.candidates)
CANDIDATE_LABELS = {"aware": "hardware-aware decisions", "naive": "naive plan (capacity-blind decisions)",
                    "folded": "plan with replicate regions folded into fewer stages"}


def choice_lines(plan: PlanRecord) -> list[str]:
    """Which of the plans the planner priced it kept and why (``Plan.chosen``, ``Plan.candidates``,
    :mod:`planner.candidates`): each with its predicted step, the kept one marked, one that does not
    fit marked so; then, when the kept one is not the hardware-aware plan, the line that says it was
    predicted faster. Nothing for a plan without candidates (a re-plan, a file from before them)."""
    if not plan.candidates:
        return []
    kept = next(c for c in plan.candidates if c.name == plan.chosen)
    shown = ", ".join(f"{c.name}{_stages(c)} {c.step_time_ms:.2f} ms" + (" (kept)" if c is kept else "")
                      + ("" if c.fits else " (does not fit in memory)")
                      + (f" (stage(s) {', '.join(map(str, c.idle_stages))} with nothing to compute)" if c.idle_stages
                         else "") for c in plan.candidates)
    lines = [f"candidates (predicted step; the fastest that fits with no stage idle is kept): {shown}"]
    aware = next((c for c in plan.candidates if c.name == "aware"), None)
    if aware is not None and aware.idle_stages and kept is not aware:
        lines.append(f"kept the {CANDIDATE_LABELS.get(kept.name, kept.name)}: the hardware-aware decisions left stage(s) "
                     f"{', '.join(map(str, aware.idle_stages))} with nothing to compute on devices of their own "
                     f"({aware.step_time_ms:.2f} ms per step); the plan kept has every stage computing "
                     f"({kept.step_time_ms:.2f} ms)")
    elif aware is not None and kept is not aware:
        lines.append(f"kept the {CANDIDATE_LABELS.get(kept.name, kept.name)}: predicted faster than the hardware-aware "
                     f"decisions ({kept.step_time_ms:.2f} ms against {aware.step_time_ms:.2f} ms per step)")
    return lines


def _stages(candidate) -> str:
    """' [TaskGraphs 0+1 | 2]': a folded candidate's stages by the TaskGraphs each stands for."""
    stages = getattr(candidate, "stages", [])
    return f" [TaskGraphs {' | '.join('+'.join(map(str, s)) for s in stages)}]" if stages else ""


def _folded(st) -> str:
    """', folded from regions 0+1 (one data-parallel stage on their devices)' for a folded stage."""
    folded = getattr(st, "folded", [])
    kept = getattr(st, "kept_work", None)
    return (f", folded from regions {'+'.join(map(str, folded))} (one stage on their devices)" if folded else "") + (
        f", keeps layer {kept} so that its devices compute (the best split ran all its layers on a neighbour)"
        if kept is not None else "")


def memory_lines(plan: PlanRecord) -> list[str]:
    """Per device its weights, gradients, optimizer state and activations at its peak against its
    memory, in GiB (``Worker.weights_gib`` ...: the memory model's terms under the stage's ZeRO
    stage), then a blank line; nothing for a plan made before the terms were recorded."""
    if not any(w.weights_gib or w.gradients_gib or w.optimizer_gib or w.activations_gib for w in plan.workers):
        return []
    headers = ["rank", "device", "stage", "zero", "weights", "gradients", "optimizer", "activations", "total / memory"]
    rows = [[w.rank, w.device, w.stage, plan.stages[w.stage].zero_stage, _gib(w.weights_gib), _gib(w.gradients_gib),
             _gib(w.optimizer_gib), _gib(w.activations_gib), f"{_gib(w.memory_gib)} / {_gib(w.capacity_gib)}"]
            for w in plan.workers]
    update = any(getattr(w, "update_gib", 0.0) for w in plan.workers)
    if update:   # the optimizer update's temporaries: the peak holds them or the activations, the larger
        headers.insert(8, "update")
        for row, w in zip(rows, plan.workers):
            row.insert(8, _gib(w.update_gib))
    shares = state_shares(plan)
    if shares:   # ragged shards: each device's fraction of its stage's sharded state
        headers.insert(4, "state")
        for row, w in zip(rows, plan.workers):
            row.insert(4, shares.get(w.rank, "-"))
    notes = (["total: weights, gradients and optimizer state, plus the activations or the optimizer update's "
              "temporaries (after the backward), the larger"] if update else []) + (
        [f"memory: what the plan may fill, the device's less the {plan.memory_reserve:.0%} reserve it keeps free "
         "(Config.memory_reserve)"] if plan.memory_reserve else [])
    return [format_table(headers, rows, title="memory per device at its peak (GiB):"), *notes, ""]


def state_shares(plan: PlanRecord) -> dict[int, str]:
    """Per rank its fraction of its stage's sharded state (``'12.5%'``) under ragged shards
    (``StagePlan.state_fractions``, in the rank order of the stage's data-parallel group); empty when
    no stage runs them."""
    out = {}
    for st in plan.stages:
        fractions = getattr(st, "state_fractions", [])
        group = sorted(w.rank for w in plan.stage_workers(st.index) if w.tp_index == 0)
        if fractions and len(fractions) == len(group):
            out.update({rank: f"{f:.1%}" for rank, f in zip(group, fractions)})
    return out


def _gib(x: float) -> str:
    """GiB with two decimals, or two significant digits below 0.01 (small models stay readable)."""
    return f"{x:.2f}" if x == 0 or abs(x) >= 0.01 else f"{x:.2g}"


def _zero(st) -> str:
    """', ZeRO stage 2 (FSDP2, chosen to fit)', ', ZeRO stage 1 (ragged shards by free memory, chosen to
    fit)' or ', ZeRO stage 0 (DDP)': the stage's ZeRO stage, its shards and why."""
    z = getattr(st, "zero_stage", 0)
    if not z:
        return ", ZeRO stage 0 (DDP)"
    why = {"asked": "asked", "fit": "chosen to fit"}.get(getattr(st, "zero_reason", "none"), "")
    how = "ragged shards by free memory" if getattr(st, "replica_sync", "") == "ragged" else "FSDP2"
    return f", ZeRO stage {z} ({how}{', ' + why if why else ''})"


def _recompute(st) -> str:
    """', recomputes activations layer by layer (asked)' or '... the whole stage at once (chosen to
    fit)': activation checkpointing, its unit and why."""
    if not st.recompute:
        return ""
    why = {"asked": "asked", "fit": "chosen to fit",
           "faster": "chosen to fit, predicted faster than a higher ZeRO stage"}.get(st.recompute_reason,
                                                                                 st.recompute_reason)
    unit = "the whole stage at once" if getattr(st, "recompute_unit", "layer") == "stage" else "layer by layer"
    return f", recomputes activations {unit} ({why})"


def _samples(w: Worker) -> str:
    """'24 = 8x3', '22 = 8x2+6': the share and its micro-batch sizes, runs compressed."""
    runs = [(size, len(list(group))) for size, group in groupby(w.micro_batch_sizes)]
    parts = "+".join(f"{size}x{count}" if count > 1 else str(size) for size, count in runs)
    return f"{w.batch_share} = {parts}"


def _shard(plan: PlanRecord, w: Worker) -> str:
    sizes = plan.stages[w.stage].shard_sizes
    if w.tp_size == 1 or not sizes:
        return "-"
    mine = sum(s[w.tp_index] for s in sizes.values())
    return f"{mine / sum(sum(s) for s in sizes.values()):.1%}"


def partial_lines(plan: PlanRecord) -> list[str]:
    """One line per stage running Prague's partial all-reduce (``replica_sync`` ``"partial"``): its
    generator, group size and threshold, and that its steps are approximate (each replica steps on
    its own gradient and averages with a group, which is not the synchronous SGD of one device)."""
    return [f"stage {st.index}: P-Reduce (partial all-reduce), {st.partial_generator} group generator, groups of "
            f"{st.partial_group_size}" + (f", threshold Δc {st.partial_delta_c}" if st.partial_generator == "smart"
                                          else "") +
            ": APPROXIMATE, each replica steps on its own gradient and averages its parameters with its group "
            "(not the synchronous SGD of one device)"
            for st in plan.stages if st.replica_sync == "partial"]
