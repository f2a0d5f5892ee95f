"""Planning from a profile: the cluster as measured, priced through the planner's one cost model.

A :class:`planner.devices.profile.Profile` (``whalelike profile``) says what each device really
does on this model: every unit's (TaskGraph's or Layer's) forward and backward seconds against
micro-batch size, and the fitted links. The planner prices compute as ``FLOPs / rate`` per device
(:func:`planner.devices.cost_model.device_tflops`) and communication on
:class:`whalelike.cluster.Network`; this module turns the profile into those two figures, so every
step of the planner (placement, partition, shards, Poplar's batch allocation, ZeRO, the simulator)
reads the measurements without a branch of its own:

* a device's rate is the FLOPs it ran over the seconds it took, on the units its stage runs and
  at the micro-batch sizes the plan gives it (:func:`device_rate`): a device whose memory
  bandwidth or small-batch efficiency its spec sheet hides is priced as slow as it measured;
* the links' fitted bandwidths and latency replace the spec's (:func:`measured_network`);
* the optimizer's measured update rate (``DeviceProfile.update_ns_per_byte``) becomes the device's
  ``measured_update_ns_per_byte``, which prices each worker's update (:func:`planner.assemble.update_ms`),
  and the time outside the compute segments per forward or backward (``DeviceProfile.action_overhead_s``)
  its ``measured_action_overhead_us``, which the simulator adds to each of a worker's compute actions.

Why a fixed point (:func:`planner.api.plan` with ``profile=``): a device's rate depends on its
micro-batch size (time per sample falls as a device fills), which the plan chooses from the rates.
The planner starts from each device's rate at its best-throughput batch (Poplar's starting point:
the batch range where a device runs at its best), plans, re-rates every device at the sizes and on
the units that plan gives it, and plans again, until the plan's sizes repeat (at most
:data:`ROUNDS` rounds); every candidate is predicted with rates measured at its own sizes, and the
fastest is kept, so the prediction never prices a plan at speeds it will not run at.

What stays analytic: memory (the planner's memory model; the profile's ``max_batch`` is checked
against it in the summary), and the per-layer mix inside a stage beyond the profile's units.

Invariant: nothing here reads the spec sheet's speeds or the emulation block; a profiled device's
rate is a ratio of measured seconds and captured FLOPs.
"""
from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Optional, Sequence

from whalelike.cluster import MAX_GBPS, Cluster, Network
from whalelike.graphs.taskgraph import TaskGraphs

from planner.devices.network import INTER_HOST, INTRA_HOST
from planner.devices.profile import DeviceProfile, Profile

# plan, re-rate at the plan's sizes, plan again: at most this many plans (the sizes settle in one or two)
ROUNDS = 4


def unit_flops(graphs: TaskGraphs, profile: Profile) -> list[float]:
    """Training FLOPs per sample (forward + backward) of each of the profile's units."""
    units = graphs.graphs if profile.unit == "taskgraph" else graphs.layers
    return [u.forward_flops + u.backward_flops for u in units]


def unit_seconds(device: DeviceProfile, unit: int, batch: int) -> float:
    """Forward plus backward seconds of ``unit`` on ``device`` for one micro-batch of ``batch``
    samples: the measured point, or the PCHIP curve of seconds per sample between them (flat
    outside: :mod:`planner.devices.speed_curves`)."""
    points = device.times[unit]
    if batch in points:
        return sum(points[batch])
    return batch * float(device.curve(unit)(batch))


def device_rate(device: DeviceProfile, flops: Sequence[float], units: Optional[Sequence[int]] = None,
                sizes: Optional[Sequence[int]] = None) -> float:
    """TFLOPS ``device`` achieved on ``units`` (all: None) at micro-batch ``sizes`` (None: its
    best-throughput batch): the FLOPs of those micro-batches over their measured seconds."""
    units = list(range(len(flops))) if units is None else list(units)
    if not sizes:
        sizes = [best_batch(device, flops, units)]
    work = math.fsum(flops[u] * b for u in units for b in sizes)
    seconds = math.fsum(unit_seconds(device, u, b) for u in units for b in sizes)
    if seconds <= 0 or work <= 0:
        # units without FLOPs (glue) or measured at zero time: the whole model's rate
        if units != list(range(len(flops))):
            return device_rate(device, flops, None, sizes)
        raise ValueError(f"profile of {device.name}: no measured time or no FLOPs to rate the device by")
    return work / seconds / 1e12


def best_batch(device: DeviceProfile, flops: Sequence[float], units: Sequence[int]) -> int:
    """The measured batch at which ``device`` runs ``units`` fastest per sample (the largest on ties)."""
    def per_sample(b: int) -> float:
        return math.fsum(unit_seconds(device, u, b) for u in units) / b
    return min(device.batches, key=lambda b: (per_sample(b), -b))


def measured_network(network: Network, profile: Profile) -> Network:
    """``network`` with the profile's fitted links: intra- and inter-host bandwidth, the latency of
    the slower measured link (the network model has one latency for both), and the measured ring
    step of a collective as the collectives' floor (``collective_latency_us``, ``collective_gbps``)."""
    intra, inter = profile.link(INTRA_HOST), profile.link(INTER_HOST)
    changes = {}
    if intra is not None:
        changes["intra_host_gbps"] = intra.gbps
    if inter is not None:
        changes["inter_host_gbps"] = inter.gbps
    latencies = [link.latency_us for link in (intra, inter) if link is not None]
    if latencies:
        changes["latency_us"] = max(latencies)
    ring = profile.link("collective")   # a ring step over the real transport: the collectives' floor
    if ring is not None:
        changes["collective_latency_us"] = ring.latency_us
        changes["collective_gbps"] = min(ring.gbps, MAX_GBPS)
    return dataclasses.replace(network, **changes)


def measured_cluster(cluster: Cluster, profile: Profile, graphs: TaskGraphs, precision: str,
                     plan=None) -> Cluster:
    """``cluster`` with every device's rate measured (at ``precision``) and the fitted links.

    Without ``plan``: each device's rate on the whole model at its best-throughput batch. With a
    plan: each worker's device rated on the units its stage runs, at the micro-batch sizes the
    plan gives it."""
    flops = unit_flops(graphs, profile)
    units_of: dict[str, list[int]] = {}
    sizes_of: dict[str, list[int]] = {}
    if plan is not None:
        for w in plan.workers:
            stage = plan.stages[w.stage]
            units_of[w.device] = (list(stage.taskgraphs) if profile.unit == "taskgraph" else list(stage.layers))
            sizes_of[w.device] = [b for b in w.micro_batch_sizes if b > 0]
    devices = []
    for d in cluster.devices:
        measured = profile.device(d.name)
        rate = device_rate(measured, flops, units_of.get(d.name), sizes_of.get(d.name))
        d = d.with_measured(precision, rate)
        if measured.update_ns_per_byte:   # the optimizer's update, priced per worker (planner.assemble.update_ms)
            d = dataclasses.replace(d, measured_update_ns_per_byte=measured.update_ns_per_byte)
        if measured.action_overhead_s:    # outside the compute segments, per forward or backward
            d = dataclasses.replace(d, measured_action_overhead_us=measured.action_overhead_s * 1e6)
        devices.append(d)
    return dataclasses.replace(cluster, devices=tuple(devices), network=measured_network(cluster.network, profile))


def sizes_signature(plan) -> tuple:
    """What re-rating reads of a plan: each worker's stage and micro-batch sizes."""
    return tuple((w.device, w.stage, tuple(sorted(Counter(w.micro_batch_sizes).items()))) for w in plan.workers)
