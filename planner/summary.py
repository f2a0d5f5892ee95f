"""``Plan.summary()``: one aligned row per device and the predicted gain over the naive plan."""
from __future__ import annotations

from itertools import groupby

from whalelike.display import format_table

from .batchnorm import batchnorm_warnings
from .plan import Plan, Worker


def plan_summary(plan: Plan) -> str:
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
    title = (
        f"plan for model {plan.model_fingerprint[:12]} on {plan.cluster}: {len(plan.stages)} stage(s), "
        f"{plan.num_replicas} pipeline replica(s), {plan.world_size} workers, global batch "
        f"{plan.global_batch_size} in {plan.num_micro_batch} micro-batch(es), schedule {plan.schedule}"
    )
    stages = [
        f"  stage {st.index}: {st.strategy}, layers {st.layers[0]}..{st.layers[-1]} (TaskGraph(s) "
        f"{', '.join(map(str, st.taskgraphs))})"
        for st in plan.stages
    ]
    p, n = plan.prediction, plan.naive_prediction
    gap = "" if plan.optimality_gap is None else f", optimality gap {plan.optimality_gap:.2%}"
    speedup = n.step_time_ms / p.step_time_ms if p.step_time_ms > 0 else float("nan")
    lines = [
        title, *stages, "", format_table(headers, rows), "",
        f"solver: {plan.solver}{gap}",
        f"predicted step time {p.step_time_ms:.2f} ms, bubble {p.bubble_fraction:.1%}, "
        f"throughput {p.throughput:.1f} samples/s",
        f"naive plan (capacity-blind)  {n.step_time_ms:.2f} ms, bubble {n.bubble_fraction:.1%}, "
        f"throughput {n.throughput:.1f} samples/s",
        f"predicted speed-up over naive: {speedup:.2f}x",
        *(f"warning: {line}" for line in batchnorm_warnings(plan)),
    ]
    return "\n".join(lines)


def _samples(w: Worker) -> str:
    """'24 = 8x3', '22 = 8x2+6': the share and its micro-batch sizes, runs compressed."""
    runs = [(size, len(list(group))) for size, group in groupby(w.micro_batch_sizes)]
    parts = "+".join(f"{size}x{count}" if count > 1 else str(size) for size, count in runs)
    return f"{w.batch_share} = {parts}"


def _shard(plan: Plan, w: Worker) -> str:
    sizes = plan.stages[w.stage].shard_sizes
    if w.tp_size == 1 or not sizes:
        return "-"
    mine = sum(s[w.tp_index] for s in sizes.values())
    return f"{mine / sum(sum(s) for s in sizes.values()):.1%}"
