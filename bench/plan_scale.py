"""Planner scale: how long pipeline partitioning (and whole planning) takes for a GPT-3-sized model
on 64 to 1024 mixed devices, and how far the greedy partitioner lands from the ILP optimum.

(1) GPT-3-like model: 96 decoder layers of d_model 12288 (96 heads) at sequence 2048, plus the
    token embedding and the LM head (vocabulary 50257) as their own layers (98 movable units).
    Per layer and sample: ``12 d^2`` parameters, ``24 s d^2 + 4 s^2 d`` forward FLOPs, backward
    three times that (twice, plus the forward recomputed under full activation checkpointing, so
    only the layer input, ``2 s d`` bytes in bf16, stays alive per micro-batch in flight);
    mixed-precision AdamW keeps 16 bytes per parameter (bf16 weights and gradients, fp32 master
    weights and two moments). Every stage runs on whole hosts of 8 devices of one kind, tensor
    parallel over the host (Megatron with sequence parallelism: weights and activations split 8
    ways) and data parallel over the stage's hosts. Devices: A100-80GB, V100-32GB and T4-16GB at
    their bf16/fp16 peak times the cost model's efficiency factor. The partitioner searches the
    order of the groups; the stage count grows with the cluster (8, 32, 64 stages).
    The whole :func:`planner.plan` is timed too, on TaskGraphs of the same model (one
    ``replicate(dp)+split(8)`` TaskGraph per stage) on the same cluster (1b), and on 256 devices
    of each of 1 to 4 kinds (A100, V100, T4, H100-80GB at 989 TFLOPS; 32 stages, data parallel over
    as many hosts as kinds), Sailor's (SOSP'25) sweep of 256 GPUs per kind, with its reported
    planning times beside ours (1c; target: under 2 s at 4 kinds). Each call starts from empty
    resharding memos (:func:`planner.schedule.boundary_traffic.clear_caches`).
(2) 100 random small instances (4-12 layers, 2-5 stages, groups of 1-2 devices of three kinds)
    solved by both solvers with the order searched: relative gap ``greedy / ilp - 1``. With a
    fixed order the greedy dynamic program is exact; the second table checks that on another 100.

Run: ``.venv/bin/python bench/plan_scale.py`` (``--kinds 1 4`` picks the kind counts of (1c);
``--smoke``: the 64-device cluster, one kind and 3 instances, seconds: checks that it runs)
"""
from __future__ import annotations

import argparse
import logging
import pathlib
import random
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))

from planner.devices.cost_model import GIB, device_tflops  # noqa: E402
from planner.partition.solve import (  # noqa: E402
    DeviceMemory, LayerCost, PartitionInfeasible, PartitionProblem, StageLink, StageSlot, partition,
)
from whalelike.cluster import Cluster, Device, Network  # noqa: E402
from whalelike.display import format_table  # noqa: E402
from smoke import parse_args  # noqa: E402

KINDS = {  # kind: (peak bf16/fp16 TFLOPS, memory GiB)
    "A100-80GB": (312.0, 80.0),
    "V100-32GB": (125.0, 32.0),
    "T4-16GB": (65.0, 16.0),
    "H100-80GB": (989.4, 80.0),   # the device-kind sweep's fourth kind only
}
# devices of each kind, and pipeline stages, per cluster size
CLUSTERS = {
    64: ({"A100-80GB": 40, "V100-32GB": 16, "T4-16GB": 8}, 8),
    256: ({"A100-80GB": 64, "V100-32GB": 96, "T4-16GB": 96}, 32),
    1024: ({"A100-80GB": 256, "V100-32GB": 384, "T4-16GB": 384}, 64),
}
TP = 8
NETWORK = Network(intra_host_gbps=150.0, inter_host_gbps=12.5, latency_us=5.0)
D, SEQ, HEADS, VOCAB, LAYERS = 12288, 2048, 96, 50257, 96


# -- (1) GPT-3 on mixed clusters -------------------------------------------------------------------
def gpt3_layers() -> list[LayerCost]:
    block = 12 * D * D
    fwd = 24.0 * SEQ * D * D + 4.0 * SEQ * SEQ * D
    hidden = 2.0 * SEQ * D  # bf16 layer input, the only activation kept under full checkpointing
    embed = LayerCost("embed", 2.0 * SEQ * D, 4.0 * SEQ * D, 2.0 * VOCAB * D, 14.0 * VOCAB * D, hidden, hidden)
    blocks = [LayerCost(f"h.{i}", fwd, 3 * fwd, 2.0 * block, 14.0 * block, hidden, hidden) for i in range(LAYERS)]
    head_fwd = 2.0 * SEQ * D * VOCAB
    head = LayerCost("lm_head", head_fwd, 3 * head_fwd, 2.0 * VOCAB * D, 14.0 * VOCAB * D, hidden + 4.0 * SEQ * VOCAB, 0.0)
    return [embed, *blocks, head]


def cluster_of(size: int) -> Cluster:
    return cluster_of_counts(CLUSTERS[size][0], f"mixed-{size}")


def cluster_of_counts(counts: dict[str, int], name: str) -> Cluster:
    devices = []
    for kind, n in counts.items():
        peak, mem = KINDS[kind]
        short = kind.split("-")[0].lower()
        for _ in range(n):
            i = len(devices)
            devices.append(Device(f"{short}-{i}", kind, f"host{i // TP}", peak, mem))
    return Cluster(name, tuple(devices), NETWORK)


def stage_slots(cluster: Cluster, stages: int) -> list[StageSlot]:
    """Whole hosts per stage, given in cluster order (the partitioner searches the order)."""
    hosts = [[d for d in cluster.devices if d.host == h] for h in cluster.hosts]
    per_stage = len(hosts) // stages
    slots = []
    for s in range(stages):
        devices = [d for h in hosts[s * per_stage:(s + 1) * per_stage] for d in h]
        dp = len(devices) // TP
        slots.append(StageSlot(
            f"stage-hosts-{s}({devices[0].kind} x{len(devices)})",
            sum(device_tflops(d) * 1e12 for d in devices),
            tuple(DeviceMemory(d.memory_gib * GIB, 1.0 / TP, 1.0 / (TP * dp), d.name) for d in devices),
        ))
    return slots


def partition_rows(sizes: list[int], repeats: int) -> list[list[str]]:
    layers = gpt3_layers()
    rows = []
    for size in sizes:
        cluster = cluster_of(size)
        _, stages = CLUSTERS[size]
        slots = stage_slots(cluster, stages)
        dp = len(cluster.devices) // (stages * TP)
        problem = PartitionProblem.for_schedule(
            layers, slots, [StageLink(NETWORK.inter_host_gbps * 1e9, NETWORK.latency_us * 1e-6)] * (stages - 1),
            micro_batch=dp, num_micro_batch=2 * stages, schedule="1f1b", order="search")
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            result = partition(problem, solver="greedy")
            times.append(time.perf_counter() - start)
        counts = {}
        for s in result.stages:
            kind = slots[s.slot].devices[0].name.split("-")[0]
            counts.setdefault(kind, []).append(len(s.layers))
        spread = ", ".join(f"{k} {min(v)}-{max(v)}" for k, v in counts.items())
        rows.append([f"{size}", f"{stages}", f"{len(layers)}", f"{min(times) * 1e3:.1f} ms",
                     f"{result.bottleneck_s * 1e3:.1f} ms", result.solver, spread])
    return rows


def gpt3_taskgraphs(stage_layers: list[list[int]], strategy):
    """TaskGraphs of :func:`gpt3_layers`, one per stage with the given layers (16 bytes of
    parameters + gradients + AdamW state per parameter, as :class:`StageCost` counts them)."""
    from whalelike.graphs.taskgraph import Boundary, Layer, TaskGraph, TaskGraphs, TensorSpec

    costs = gpt3_layers()
    owner = {i: s for s, layers in enumerate(stage_layers) for i in layers}
    layers = [Layer(i, c.name, owner[i], c.forward_flops, c.backward_flops, int(c.param_bytes), int(c.param_bytes // 2),
                    c.activation_bytes, c.cut_bytes) for i, c in enumerate(costs)]
    graphs = []
    for s, idx in enumerate(stage_layers):
        mine = [layers[i] for i in idx]
        params = sum(l.param_bytes for l in mine)
        shardable = {("lm_head" if l.name == "lm_head" else f"{l.name}.mlp.fc1"): (VOCAB if l.name == "lm_head" else 4 * D)
                     for l in mine if l.name != "embed"}
        graphs.append(TaskGraph(s, strategy, tuple(l.name for l in mine), tuple(idx),
                                sum(l.forward_flops for l in mine), sum(l.backward_flops for l in mine),
                                params, params // 2, 6 * params, sum(l.activation_bytes_per_sample for l in mine),
                                shardable))
    bounds = [Boundary(s, s + 1, (TensorSpec(f"hidden_{s}", (SEQ, D), "bfloat16"),)) for s in range(len(stage_layers) - 1)]
    return TaskGraphs(graphs, layers, bounds, optimizer="adamw", example_batch_size=1, method="fx")


def timed_plan(cluster: Cluster, stages: int) -> tuple[float, str]:
    """Seconds of one ``planner.plan`` of the GPT-3 TaskGraphs on ``cluster`` with ``stages``
    ``replicate(dp)+split(8)`` stages (layers from the partitioner, see :func:`plan_rows`), and its
    outcome. The planner's memoised reshardings are cleared first, so every call plans from nothing."""
    import planner
    from planner.schedule.boundary_traffic import clear_caches
    from whalelike import Config, split
    from whalelike.strategy import Strategy

    dp = len(cluster.devices) // (stages * TP)
    problem = PartitionProblem.for_schedule(
        gpt3_layers(), stage_slots(cluster, stages), [StageLink(NETWORK.inter_host_gbps * 1e9, 5e-6)] * (stages - 1),
        micro_batch=dp, num_micro_batch=2 * stages, schedule="1f1b")
    graphs = gpt3_taskgraphs(partition(problem).stage_layers(), Strategy("replicate", dp, split(TP)))
    config = Config(global_batch_size=2 * stages * dp, num_micro_batch=2 * stages, schedule="1f1b")
    clear_caches()
    start = time.perf_counter()
    try:
        result = planner.plan(graphs, cluster, config)
        outcome = (f"{result.prediction.step_time_ms / 1e3:.1f} s/step, naive "
                   f"{result.naive_prediction.step_time_ms / 1e3:.1f} s/step")
    except planner.PlanError as e:
        outcome = f"PlanError: {str(e)[:100]}"
    return time.perf_counter() - start, outcome


def plan_rows(sizes: list[int]) -> list[list[str]]:
    """Whole ``planner.plan`` on TaskGraphs of the same model: one ``replicate(dp)+split(8)``
    TaskGraph per stage, with the layers the partitioner gives each stage in the order the planner
    places them (largest memory first). Every stage is tensor parallel, so the planner keeps these
    layer ranges; the time measured is its device layout, shard and batch balancing, plan assembly,
    simulation of one step, and the same for the naive plan."""
    rows = []
    for size in sizes:
        cluster = cluster_of(size)
        _, stages = CLUSTERS[size]
        dp = len(cluster.devices) // (stages * TP)
        elapsed, outcome = timed_plan(cluster, stages)
        rows.append([f"{size}", f"{stages} x replicate({dp})+split({TP})", f"{elapsed:.2f} s",
                     "yes" if elapsed < 5 else "NO", outcome])
    return rows


# -- (1c) device kinds: Sailor's sweep -------------------------------------------------------------
PER_KIND = 256        # devices of each kind (Sailor, SOSP'25: 256 GPUs per kind)
KIND_STAGES = 32      # pipeline stages at every kind count: replicate(kinds)+split(8) each
SAILOR_S = {1: "0.3 s", 2: "6.2 s", 3: "4900 s"}   # Sailor's reported planning time at 256 GPUs per kind


def kind_rows(counts: list[int]) -> list[list[str]]:
    """``planner.plan`` with 1 to 4 device kinds of :data:`PER_KIND` devices each (A100, V100, T4,
    H100 in that order; hosts of 8 devices of one kind), :data:`KIND_STAGES` stages of the GPT-3
    TaskGraphs, next to Sailor's reported planning time for the same kind count."""
    rows = []
    for count in counts:
        kinds = list(KINDS)[:count]
        cluster = cluster_of_counts({kind: PER_KIND for kind in kinds}, f"kinds-{count}")
        elapsed, outcome = timed_plan(cluster, KIND_STAGES)
        target = "yes" if elapsed < 2 else "NO"
        rows.append([f"{count}", f"{len(cluster.devices)}", ", ".join(k.split("-")[0] for k in kinds),
                     f"{KIND_STAGES} x replicate({count})+split({TP})", f"{elapsed:.2f} s",
                     SAILOR_S.get(count, "-"), target if count == 4 else "", outcome])
    return rows


# -- (2) greedy vs ILP on random small instances ---------------------------------------------------
def random_problem(rng: random.Random, order: str) -> PartitionProblem:
    L = rng.randint(4, 12)
    S = rng.randint(2, min(5, L))
    layers = [LayerCost(f"l{i}", rng.uniform(1, 8) * 1e11, rng.uniform(2, 16) * 1e11, rng.uniform(0.1, 2) * GIB,
                        rng.uniform(0.3, 6) * GIB, rng.uniform(0.01, 0.5) * GIB, rng.uniform(0.001, 0.1) * GIB)
                   for i in range(L)]
    slots = []
    for g in range(S):
        kind = rng.choice(list(KINDS))
        peak, mem = KINDS[kind]
        n = rng.randint(1, 2)
        slots.append(StageSlot.data_parallel(f"{kind}x{n}", [peak * 0.4e12] * n, [mem * GIB] * n))
    bw = rng.choice([1e9, 12.5e9, 150e9])
    return PartitionProblem.for_schedule(layers, slots, [StageLink(bw, 5e-6)] * (S - 1), micro_batch=rng.randint(1, 8),
                                         num_micro_batch=rng.randint(1, 8), schedule=rng.choice(["1f1b", "gpipe"]),
                                         order=order)


def gap_row(order: str, count: int, seed: int, time_limit_s: float) -> list[str]:
    rng = random.Random(seed)
    gaps, t_greedy, t_ilp, proven, infeasible, greedy_missed = [], [], [], 0, 0, 0
    while len(gaps) < count:
        p = random_problem(rng, order)
        start = time.perf_counter()
        try:
            ilp = partition(p, solver="ilp", time_limit_s=time_limit_s)
        except PartitionInfeasible:
            infeasible += 1
            continue
        t_ilp.append(time.perf_counter() - start)
        start = time.perf_counter()
        try:
            greedy = partition(p, solver="greedy")
        except PartitionInfeasible:  # only a searched order can miss a feasible split
            greedy_missed += 1
            continue
        t_greedy.append(time.perf_counter() - start)
        proven += ilp.gap == 0.0
        gaps.append(greedy.bottleneck_s / ilp.bottleneck_s - 1)
    equal = sum(g <= 1e-7 for g in gaps)
    return [order, f"{len(gaps)}", f"{statistics.mean(gaps) * 100:.3f} %", f"{max(gaps) * 100:.2f} %",
            f"{equal}/{len(gaps)}", f"{proven}/{len(gaps)}", f"{greedy_missed}", f"{infeasible}",
            f"{statistics.mean(t_greedy) * 1e3:.1f} ms", f"{statistics.mean(t_ilp) * 1e3:.0f} ms"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=sorted(CLUSTERS), choices=sorted(CLUSTERS))
    parser.add_argument("--instances", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ilp-time-limit", type=float, default=20.0)
    parser.add_argument("--skip-plan", action="store_true", help="time only the partition step")
    parser.add_argument("--kinds", type=int, nargs="*", default=[1, 2, 3, 4], choices=[1, 2, 3, 4],
                        help="device-kind counts of the sweep (1c); none skips it")
    args = parse_args(parser, smoke=dict(sizes=[64], instances=3, ilp_time_limit=5.0, kinds=[1]))
    logging.basicConfig(level=logging.ERROR)

    print(format_table(
        ["devices", "stages", "layers", "partition time", "bottleneck/micro-batch", "solver", "layers per stage by kind"],
        partition_rows(args.sizes, repeats=3),
        title="(1a) GPT-3-like (96 x d12288, seq 2048) partition step, order searched, best of 3"))
    if not args.skip_plan:
        print()
        print(format_table(["devices", "TaskGraphs", "planner.plan time", "< 5 s", "result"], plan_rows(args.sizes),
                           title="(1b) whole planner.plan(...) on synthetic TaskGraphs of the same model"))
    if not args.skip_plan and args.kinds:
        print()
        print(format_table(["kinds", "devices", "which", "TaskGraphs", "planner.plan time", "Sailor", "< 2 s",
                            "result"], kind_rows(args.kinds),
                           title=f"(1c) whole planner.plan(...) with 1-4 device kinds, {PER_KIND} devices each"))
    print()
    rows = [gap_row(order, args.instances, args.seed + i, args.ilp_time_limit) for i, order in enumerate(("search", "fixed"))]
    print(format_table(["order", "instances", "mean gap", "max gap", "equal", "ILP proven", "greedy missed",
                        "skipped infeasible", "greedy time", "ILP time"], rows,
                       title="(2) greedy vs ILP on random small instances (gap = greedy / ILP bottleneck - 1)"))


if __name__ == "__main__":
    main()
