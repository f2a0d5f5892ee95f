"""DDP's gradient buckets of each data-parallel group, for the simulator's overlap of the gradient
all-reduce with backward.

Why: torch DDP does not all-reduce after the backward; it packs gradients into buckets (the first
of 1 MiB, the others of 25 MiB, ``bucket_cap_mb``) in the order they become ready, roughly reverse
layer order, and all-reduces each bucket as soon as all of its gradients exist, while the backward
of earlier layers goes on. A simulator that all-reduces after the backward overprices data
parallelism on slow networks (issue 11: 1.16x predicted against Whale's 1.3-1.4x). The Plan does
not carry per-layer sizes, so the buckets are built here from the model's TaskGraphs and handed to
:func:`planner.simulator.simulate` (``buckets=``).

What is modeled: a stage's gradient bytes per layer (parameters plus the copies of tied weights an
earlier stage owns), scaled by the worker's tensor-parallel shard fraction; layers' gradients
become ready in reverse layer order, each when its layer's backward ends, the backward of a layer
taking its share of the stage's backward FLOPs; buckets are filled to the byte (a layer may span
two buckets); each bucket's all-reduce is a ring over the group's devices in rank order, priced by
:class:`planner.network.NetworkModel`. Not modeled: DDP's whole-parameter granularity (a 120 MiB
embedding matrix is one bucket there, five here: the same bytes, four more latencies), gradients
that become ready inside a layer's backward, and the loss riding in the last bucket.

Invariant: the buckets of a group carry exactly the worker's gradient bytes (its shard of
``StageCost.param_bytes``), in non-decreasing order of ready fraction, each fraction in [0, 1].
"""
from __future__ import annotations

from typing import Sequence

from whalelike.cluster import Cluster
from whalelike.taskgraph import TaskGraphs

from .cost_model import StageCost
from .network import NetworkModel
from .plan import Plan, StagePlan
from .simulator import GradientBucket, GroupKey
from .tensor_parallel import layout_of_sizes

MIB = 2**20
DDP_FIRST_BUCKET_BYTES = 1 * MIB    # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
DDP_BUCKET_BYTES = 25 * MIB         # DistributedDataParallel's default bucket_cap_mb


def layer_gradient_bytes(graphs: TaskGraphs, layers: Sequence[int]) -> list[float]:
    """Gradient bytes of each of ``layers`` (a stage): its own parameters, plus each tied weight an
    earlier stage owns, counted once, on the first layer here that uses it (the last to finish its
    backward, so the copy's gradient is complete then)."""
    inside = set(layers)
    out = [float(graphs.layers[i].param_bytes) for i in layers]
    seen: set[str] = set()
    for position, index in enumerate(layers):
        for owner, name, size in graphs.layers[index].borrowed_params:
            if owner not in inside and name not in seen:
                seen.add(name)
                out[position] += size
    return out


def fill_buckets(ready_bytes: Sequence[tuple[float, float]], first_bucket_bytes: float = DDP_FIRST_BUCKET_BYTES,
                 bucket_bytes: float = DDP_BUCKET_BYTES) -> list[tuple[float, float]]:
    """``(bytes, ready fraction)`` of each bucket, from ``(ready fraction, bytes)`` of each layer in
    the order the gradients become ready: the first bucket holds up to ``first_bucket_bytes``, the
    others up to ``bucket_bytes``; a bucket is ready when the last layer it takes bytes from is."""
    buckets: list[tuple[float, float]] = []
    cap, filled, ready = first_bucket_bytes, 0.0, 0.0
    for fraction, nbytes in ready_bytes:
        left = float(nbytes)
        while left > 0:
            take = min(left, cap - filled)
            filled, left, ready = filled + take, left - take, fraction
            if filled >= cap:
                buckets.append((filled, ready))
                cap, filled = bucket_bytes, 0.0
    if filled > 0:
        buckets.append((filled, ready))
    return buckets


def gradient_buckets(plan: Plan, graphs: TaskGraphs, cluster: Cluster,
                     first_bucket_bytes: float = DDP_FIRST_BUCKET_BYTES,
                     bucket_bytes: float = DDP_BUCKET_BYTES) -> dict[GroupKey, list[GradientBucket]]:
    """The gradient buckets of every data-parallel group ``(stage, tp_index)`` of ``plan`` (made
    for ``graphs`` on ``cluster``), in all-reduce order, for ``simulate(plan, buckets=...)``."""
    network = NetworkModel.of_cluster(cluster)
    out: dict[GroupKey, list[GradientBucket]] = {}
    for stage in plan.stages:
        layers = list(stage.layers)
        per_layer = layer_gradient_bytes(graphs, layers)
        backward = [graphs.layers[i].backward_flops for i in layers]
        total_backward = sum(backward)
        # reverse layer order; a layer's gradients are ready when its backward ends
        ready_bytes, done = [], 0.0
        for flops, nbytes in zip(reversed(backward), reversed(per_layer)):
            done += flops
            ready_bytes.append((min(done / total_backward, 1.0) if total_backward > 0 else 1.0, nbytes))
        members = sorted(plan.stage_workers(stage.index), key=lambda w: w.rank)
        fractions = _shard_fractions(graphs, stage, members[0].tp_size)
        for tp_index, fraction in enumerate(fractions):
            ring = network.ring([w.device for w in members if w.tp_index == tp_index])
            scaled = [(ready, nbytes * fraction) for ready, nbytes in ready_bytes]
            out[stage.index, tp_index] = [
                GradientBucket(ready, ring.allreduce_ms(nbytes), nbytes)
                for nbytes, ready in fill_buckets(scaled, first_bucket_bytes, bucket_bytes)]
    return out


def _shard_fractions(graphs: TaskGraphs, stage: StagePlan, tp_size: int) -> list[float]:
    """Each tensor-parallel index's share of the stage's parameters, priced as the planner prices it."""
    layers = list(stage.layers)
    if tp_size == 1:
        return [1.0]
    owners = [graphs[t] for t in sorted({graphs.layers[i].taskgraph for i in layers})]
    shardable = {path: dim for tg in owners for path, dim in tg.shardable.items()}
    groups = tuple(group for tg in owners for group in tg.shard_groups)
    flops = StageCost.of_layers(graphs, layers).flops_per_sample
    return layout_of_sizes(shardable, stage.shard_sizes, tp_size, groups, flops).fractions
