"""DDP's gradient buckets of each data-parallel group, for the simulator's overlap of the gradient
all-reduce with backward.

Why: torch DDP does not all-reduce after the backward; it packs gradients into buckets (the first
of 1 MiB, the others of 25 MiB, ``bucket_cap_mb``; rebuilt after the first step in the order the
gradients became ready, roughly reverse layer order) and all-reduces each bucket as soon as all of
its gradients exist, while the backward of earlier layers goes on. A simulator that all-reduces
after the backward overprices data parallelism on slow networks (issue 11: 1.16x predicted against
Whale's 1.3-1.4x).

The runtime's model, copied here (:func:`runtime.replicas.ddp_sync.wrap_ddp` under network emulation,
default ``bucket_cap_mb``): bucket ``k`` is ready when the backward has run the share of the
gradient bytes of buckets ``0..k`` (a backward is modeled uniform in gradient bytes, the last
bucket at its end), its all-reduce is a ring over the group's devices in rank order, priced by
:class:`planner.devices.network.NetworkModel`, and one process group runs the buckets in order. So a
group's buckets follow from its gradient bytes alone: :func:`ddp_buckets`;
:func:`plan_buckets` takes them from ``Worker.gradient_bytes`` (what :func:`planner.simulate`
uses given a network), :func:`gradient_buckets` from the model's TaskGraphs (parameters plus the
copies of tied weights an earlier stage owns, scaled by the shard fraction).

Not modeled: DDP's whole-parameter granularity (a bucket closes at the first parameter that fills
it, so real buckets run over the cap by up to a parameter, and a 120 MiB embedding matrix is one
bucket there, five here: the same bytes, four more latencies; the Plan and the TaskGraphs record
bytes per layer, not per parameter), the first step's single bucket (DDP has not seen the ready
order yet), and the loss riding in the last bucket.

ZeRO stages (``StagePlan.zero_stage`` >= 1, FSDP2) have no DDP buckets: their all-gathers and
reduce-scatters (:meth:`planner.devices.cost_model.CommModel.zero_ms`) are priced as communication at
the end of the step, ``Worker.allreduce_ms`` (their ``gradient_bytes`` are 0), so the simulator
overlaps none of FSDP2's prefetching: an upper bound on their exposed time.

Invariant: the buckets of a group carry exactly the worker's gradient bytes, in non-decreasing
order of ready fraction, each fraction in [0, 1], the last 1.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

from whalelike.cluster import Cluster
from whalelike.graphs.taskgraph import TaskGraphs

from planner.devices.cost_model import StageCost
from planner.devices.network import NetworkModel, Ring
from planner.groups import group_key
from planner.plan import Plan, StagePlan
from planner.shares.shard_sizes import layout_of_sizes
from planner.shares.stage_shards import stage_shardable

GroupKey = tuple[int, int]   # (stage, tp_index): one data-parallel group of gradient all-reduces (planner.groups "dp")

MIB = 2**20
DDP_FIRST_BUCKET_BYTES = 1 * MIB    # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
DDP_BUCKET_BYTES = 25 * MIB         # DistributedDataParallel's default bucket_cap_mb


class GradientBucket(NamedTuple):
    """One gradient bucket of a data-parallel group: ready once every member has run
    ``ready_fraction`` (0..1) of its last backward; its all-reduce takes ``allreduce_ms``;
    ``nbytes`` is what it carries (for display). :func:`planner.simulate` takes them per
    :data:`GroupKey` (``buckets=``)."""

    ready_fraction: float
    allreduce_ms: float
    nbytes: float = 0.0


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


def ddp_buckets(gradient_bytes: float, ring: Ring, first_bucket_bytes: float = DDP_FIRST_BUCKET_BYTES,
                bucket_bytes: float = DDP_BUCKET_BYTES) -> list[GradientBucket]:
    """The buckets of ``gradient_bytes`` all-reduced over ``ring`` (a :class:`planner.devices.network.Ring`),
    each ready at its cumulative byte share of the backward (module docstring)."""
    out, done = [], 0.0
    priced: dict[float, float] = {}   # the buckets but the first and last have one size: priced once
    for nbytes, _ in fill_buckets([(1.0, gradient_bytes)], first_bucket_bytes, bucket_bytes):
        done += nbytes
        if nbytes not in priced:
            priced[nbytes] = ring.allreduce_ms(nbytes)
        out.append(GradientBucket(min(done / gradient_bytes, 1.0), priced[nbytes], nbytes))
    return out


def plan_buckets(plan: Plan, network: NetworkModel, first_bucket_bytes: float = DDP_FIRST_BUCKET_BYTES,
                 bucket_bytes: float = DDP_BUCKET_BYTES) -> dict[GroupKey, list[GradientBucket]]:
    """The buckets of every data-parallel group ``(stage, tp_index)`` of ``plan`` whose workers
    record their ``gradient_bytes`` (a plan made before that field keeps its one all-reduce after
    the backward; a ZeRO stage has none, nor a P-Reduce one), priced on ``network``."""
    members: dict[GroupKey, list] = {}
    for w in plan.workers:
        members.setdefault(group_key("dp", w), []).append(w)
    out: dict[GroupKey, list[GradientBucket]] = {}
    network_key = network.key()
    for key, ws in members.items():
        nbytes = max(w.gradient_bytes for w in ws)
        stage = plan.stages[key[0]]
        if nbytes <= 0 or len(ws) < 2 or stage.zero_stage or stage.replica_sync == "partial":
            continue
        devices = tuple(w.device for w in sorted(ws, key=lambda w: w.rank))
        memo = (network_key, devices, nbytes, first_bucket_bytes, bucket_bytes)
        if memo not in _BUCKETS:
            if len(_BUCKETS) >= _BUCKETS_SIZE:
                _BUCKETS.pop(next(iter(_BUCKETS)))
            _BUCKETS[memo] = tuple(ddp_buckets(nbytes, network.ring(devices), first_bucket_bytes, bucket_bytes))
        out[key] = list(_BUCKETS[memo])
    return out


# (network, ring devices, gradient bytes, bucket sizes) -> the ring's buckets: a plan and its naive
# plan, or a re-plan and the plan in force, have the same groups, and a 1024-device plan ~500 of them
_BUCKETS: dict = {}
_BUCKETS_SIZE = 4096


def clear_cache() -> None:
    """Forget every memoised ring's buckets (:func:`planner.schedule.boundary_traffic.clear_caches`)."""
    _BUCKETS.clear()


def gradient_buckets(plan: Plan, graphs: TaskGraphs, cluster: Cluster,
                     first_bucket_bytes: float = DDP_FIRST_BUCKET_BYTES,
                     bucket_bytes: float = DDP_BUCKET_BYTES) -> dict[GroupKey, list[GradientBucket]]:
    """The gradient buckets of every data-parallel group ``(stage, tp_index)`` of ``plan`` (made
    for ``graphs`` on ``cluster``), in all-reduce order, for ``simulate(plan, buckets=...)``."""
    network = NetworkModel.of_cluster(cluster)
    out: dict[GroupKey, list[GradientBucket]] = {}
    for stage in plan.stages:
        if stage.zero_stage:   # FSDP2's collectives: Worker.allreduce_ms after the backward (module docstring)
            continue
        total = sum(layer_gradient_bytes(graphs, list(stage.layers)))
        members = sorted(plan.stage_workers(stage.index), key=lambda w: w.rank)
        fractions = _shard_fractions(graphs, stage, members[0].tp_size, plan.precision)
        for tp_index, fraction in enumerate(fractions):
            ring = network.ring([w.device for w in members if w.tp_index == tp_index])
            if total * fraction > 0:
                out[stage.index, tp_index] = ddp_buckets(total * fraction, ring, first_bucket_bytes, bucket_bytes)
    return out


def _shard_fractions(graphs: TaskGraphs, stage: StagePlan, tp_size: int, precision: str = "fp32") -> list[float]:
    """Each tensor-parallel index's share of the stage's parameters, priced as the planner prices it."""
    layers = list(stage.layers)
    if tp_size == 1:
        return [1.0]
    _, shardable, groups = stage_shardable(graphs, layers)
    flops = StageCost.of_layers(graphs, layers, precision).flops_per_sample
    return layout_of_sizes(shardable, stage.shard_sizes, tp_size, groups, flops).fractions
