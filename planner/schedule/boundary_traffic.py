"""The transfers a plan's stage boundaries make, per micro-batch and direction, as the runtime makes them.

Why: the runtime moves a boundary's activations (forward) and gradients (backward) with the
cross-mesh resharding :func:`planner.resharding.reshard.boundary_resharding` plans under
``Plan.resharding`` (unit tasks, strategy, order), over host network interfaces that serialize
(:mod:`planner.devices.network`). The simulator must price the same transfers, on the same interfaces, or
its predicted boundary times are not the runtime's. This module turns each boundary's resharding
into :class:`BoundarySend` records (sender, receivers, planned start offset, duration, the device
and interface resources it holds) that :mod:`planner.schedule.simulator` places on a timeline.

Speed: a 1024-device plan has dozens of boundaries and many micro-batches, and one resharding plan
costs milliseconds to tens of milliseconds. Boundaries and micro-batches that look alike share a
plan: the specs are put in a canonical form before planning (devices and hosts renamed in their
sorted order, so every name comparison the planner makes comes out the same; the micro-batch's
rows renumbered from 0 without the other micro-batches' rows between the replicas' blocks, which
nobody holds or needs: :meth:`planner.shares.layout.SampleLayout.micro_batch_rows`, the layout
being the one owner of which rank holds which samples) and the plan of each canonical form is
computed once and mapped back. A plan's whole traffic is kept too, keyed on everything it is
computed from (:func:`_traffic_key`), for the next call on an equal plan.

Values without a batch dimension (``BoundaryPlan.unbatched_bytes``: a statistic of the micro-batch)
cross whole, once per micro-batch and replica, as the runtime sends them
(:func:`planner.resharding.spec.unbatched_rows`: forward from each replica's owner slot to every
receiving worker, backward each receiving slot's gradient to the owner slot); their transfers join
the batched ones' in the boundary's :class:`BoundaryTraffic` (tasks numbered after them), so the
simulator queues them on the same devices and interfaces and a receiver waits for them too.

Invariant: every :class:`BoundarySend` is a transfer of the :class:`~planner.resharding.reshard.ReshardPlan`
that :func:`~planner.resharding.reshard.boundary_resharding` (batched values) or
:func:`~planner.resharding.reshard.unbatched_resharding` (values without a batch dimension) gives
for the same micro-batch, direction and strategy, up to that renaming (the same tasks, strategy,
durations and start offsets); a receiver's input is complete when every send naming it has arrived.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

from planner.devices.network import NetworkModel
from planner.resharding.reshard import BOUNDARY_MAX_NODES, ReshardPlan, plan_resharding
from planner.resharding.reshard import clear_cache as clear_reshard_cache
from planner.schedule.gradient_buckets import clear_cache as clear_bucket_cache
from planner.resharding.spec import ShardingSpec, unbatched_rows
from planner.shares.layout import SampleLayout

FORWARD, BACKWARD = "forward", "backward"
Resource = tuple[str, str]   # ("dev", device) | ("out", host) | ("in", host), as planner.resharding.cost


class BoundarySend(NamedTuple):
    """One transfer of a boundary's resharding: ``sender`` (a device) delivers a slice of
    ``nbytes`` to ``receivers`` by ``strategy`` (``chunks`` pipelined pieces for a broadcast),
    holding ``resources`` for ``duration_ms``; ``offset_ms`` is its planned start with every
    sender ready at once (the plan's, for its description). The runtime posts a pipeline
    boundary's sends as soon as the sender's value is ready, unpaced, and the simulator places
    them so (:mod:`planner.schedule.simulator`)."""

    sender: str
    receivers: tuple[str, ...]
    offset_ms: float
    duration_ms: float
    resources: tuple[Resource, ...]
    strategy: str
    task: int
    chunks: int
    nbytes: float


@dataclass(frozen=True)
class BoundaryTraffic:
    """Boundary ``boundary`` (index into ``Plan.boundaries``) in one ``direction`` for one
    micro-batch: stage ``sender_stage`` sends to ``receiver_stage`` (the backward reverses the
    boundary); the winning ``strategy``, the number of ``unit_tasks``, the plan's predicted time
    with every sender ready at once, its lower bound, and the sends."""

    boundary: int
    direction: str
    sender_stage: int
    receiver_stage: int
    strategy: str
    unit_tasks: int
    predicted_ms: float
    lower_bound_ms: float
    nbytes: float
    sends: tuple[BoundarySend, ...]

    def describe(self) -> str:
        return (f"stage {self.sender_stage} -> {self.receiver_stage} ({self.direction}): {self.strategy}, "
                f"{self.unit_tasks} unit task(s), {len(self.sends)} transfer(s), predicted {self.predicted_ms:.3g} ms")


def plan_traffic(plan, network: NetworkModel, strategy: Optional[str] = None,
                 max_nodes: int = BOUNDARY_MAX_NODES) -> dict[tuple[int, str], list[Optional[BoundaryTraffic]]]:
    """``(boundary index, direction) -> [traffic of micro-batch m]`` for every boundary of ``plan``
    (None where the boundary carries no bytes), under ``strategy`` (default ``Plan.resharding``).
    The boundary tensor is the one :func:`~planner.resharding.reshard.boundary_resharding` plans: a
    ``(global_batch_size, bytes_per_sample)`` byte tensor, each worker holding (needing) its rows of
    the micro-batch (:func:`planner.resharding.spec.stage_output_spec`), and, where the boundary
    carries values without a batch dimension, the ``(rows, unbatched_bytes)`` tensor of
    :func:`~planner.resharding.reshard.unbatched_resharding` beside it (the module docstring)."""
    strategy = getattr(plan, "resharding", "auto") if strategy is None else strategy
    key = _traffic_key(plan, network, strategy, max_nodes)
    if key in _TRAFFIC:
        return {k: list(v) for k, v in _TRAFFIC[key].items()}
    out = _plan_traffic(plan, network, strategy, max_nodes)
    if len(_TRAFFIC) >= _TRAFFIC_SIZE:
        _TRAFFIC.pop(next(iter(_TRAFFIC)))
    _TRAFFIC[key] = out
    return {k: list(v) for k, v in out.items()}


def _traffic_key(plan, network: NetworkModel, strategy: str, max_nodes: int) -> tuple:
    """Everything :func:`plan_traffic` reads of ``plan`` (the workers' placement and micro-batch
    sizes, which fix the sample layout; the boundaries' stages and row bytes), the network and the
    search settings: plans equal in these have the same traffic. A 1024-device plan is planned,
    priced and simulated with the same traffic several times (``planner.plan``: the plan's
    ``transfer_ms``, then its simulation; the naive plan's)."""
    workers = tuple((w.rank, w.device, w.host, w.stage, w.replica, w.dp_index, w.tp_index, tuple(w.micro_batch_sizes))
                    for w in plan.workers)
    boundaries = tuple((b.src_stage, b.dst_stage, int(round(b.bytes_per_sample)), int(round(b.unbatched_bytes)))
                       for b in plan.boundaries)
    return (strategy, max_nodes, network.key(), plan.global_batch_size, plan.num_micro_batch, len(plan.stages),
            boundaries, workers)


def _plan_traffic(plan, network: NetworkModel, strategy: str, max_nodes: int
                  ) -> dict[tuple[int, str], list[Optional[BoundaryTraffic]]]:
    by_stage: dict[int, list] = {}
    for w in plan.workers:
        by_stage.setdefault(w.stage, []).append(w)
    rows = _Rows(plan)
    out: dict[tuple[int, str], list[Optional[BoundaryTraffic]]] = {}
    for index, boundary in enumerate(plan.boundaries):
        row_bytes = int(round(boundary.bytes_per_sample))
        whole_bytes = int(round(boundary.unbatched_bytes))
        if row_bytes < 1 and whole_bytes < 1:
            out[index, FORWARD] = out[index, BACKWARD] = [None] * plan.num_micro_batch
            continue
        mesh = _Mesh(by_stage[boundary.src_stage], by_stage[boundary.dst_stage], network, rows)
        for direction, senders, receivers in ((FORWARD, boundary.src_stage, boundary.dst_stage),
                                              (BACKWARD, boundary.dst_stage, boundary.src_stage)):
            # values without a batch dimension: the same stacked rows in every micro-batch
            whole = (_planned(mesh.unbatched_key(plan, boundary.src_stage, boundary.dst_stage, direction == BACKWARD),
                              whole_bytes, mesh.network, strategy, max_nodes) if whole_bytes >= 1 else None)
            seen: dict[tuple, BoundaryTraffic] = {}   # micro-batches that look alike share one
            per_micro_batch = []
            for m in range(plan.num_micro_batch):
                key = mesh.key(m)
                key = key[::-1] if direction == BACKWARD else key
                if key not in seen:
                    parts = [p for p in (_planned(key, row_bytes, mesh.network, strategy, max_nodes)
                                         if row_bytes >= 1 else None, whole) if p is not None]
                    seen[key] = _traffic(index, direction, senders, receivers, parts, mesh)
                per_micro_batch.append(seen[key])
            out[index, direction] = per_micro_batch
    return out


def _traffic(index: int, direction: str, senders: int, receivers: int, parts: list[ReshardPlan],
             mesh: "_Mesh") -> BoundaryTraffic:
    """One boundary's traffic in one direction and micro-batch from its reshardings (the batched
    values', then those without a batch dimension): their sends together, each part's tasks
    numbered after the previous part's; the predicted time is their sum (the runtime posts all of
    them at once, and they share the senders' devices and interfaces), the lower bound the largest."""
    sends: list[BoundarySend] = []
    offset = 0
    for reshard in parts:
        sends += [s._replace(task=s.task + offset) for s in _sends(reshard, mesh.names, mesh.hosts)]
        offset += len(reshard.tasks)
    return BoundaryTraffic(index, direction, senders, receivers, " + ".join(p.strategy for p in parts),
                           sum(len(p.tasks) for p in parts), sum(p.predicted_ms for p in parts),
                           max(p.lower_bound_ms for p in parts),
                           float(sum(sum(t.elements for t in p.tasks) * p.itemsize for p in parts)), tuple(sends))


class _Rows:
    """Each micro-batch's rows per rank, renumbered without gaps, as the plan's
    :class:`~planner.shares.layout.SampleLayout` (the one owner of which rank holds which samples,
    which :func:`~planner.resharding.spec.stage_output_spec` reads too) gives them
    (:meth:`~planner.shares.layout.SampleLayout.micro_batch_rows`): the layout is built when a
    boundary first needs it, each micro-batch's rows when first asked for."""

    def __init__(self, plan):
        self.plan = plan
        self._layout: Optional[SampleLayout] = None
        self._rows: dict[int, dict[int, tuple[int, int]]] = {}

    def __call__(self, m: int) -> dict[int, tuple[int, int]]:
        if m not in self._rows:
            if self._layout is None:
                self._layout = SampleLayout.of(self.plan)
            self._rows[m] = self._layout.micro_batch_rows(m)[1]
        return self._rows[m]


class _Mesh:
    """The two stages of a boundary in canonical form (module docstring): devices and hosts
    renamed in sorted order, the network on the renamed hosts, and each micro-batch's rows
    renumbered without gaps (``rows``, from the plan's sample layout). Micro-batches whose slots
    have the same sizes on both sides hold the same rows, so a key is computed once per such sizes."""

    def __init__(self, src_workers, dst_workers, network: NetworkModel, rows: _Rows):
        workers = [*src_workers, *dst_workers]
        devices = sorted({w.device for w in workers})
        hosts = sorted({w.host for w in workers})
        device_name = {d: f"d{i:06d}" for i, d in enumerate(devices)}
        host_name = {h: f"h{i:06d}" for i, h in enumerate(hosts)}
        self.sides = []
        for side in (src_workers, dst_workers):
            slots = sorted({(w.replica, w.dp_index): w.micro_batch_sizes for w in side}.items())
            self.sides.append(([sizes for _, sizes in slots],
                               [(device_name[w.device], host_name[w.host], w.rank) for w in side]))
        self.rows = rows
        self._keys: dict[tuple, tuple] = {}   # slot sizes of a micro-batch -> its key
        self.names = {v: k for k, v in device_name.items()}
        self.hosts = {w.device: w.host for w in workers}
        nic = {host_name[h]: network.nic_gbps[h] for h in hosts if network.nic_gbps[h] != network.inter_host_gbps}
        self.network = NetworkModel.of_hosts(network.intra_host_gbps, network.inter_host_gbps,
                                             network.latency_ms * 1e3, list(host_name.values()), nic)

    def unbatched_key(self, plan, producer: int, consumer: int, backward: bool) -> tuple:
        """The canonical (holders, needers) of the rows of the values without a batch dimension
        (:func:`planner.resharding.spec.unbatched_rows`), the same for every micro-batch."""
        _, held, needed = unbatched_rows(plan, producer, consumer, backward)
        members = {rank: (device, host) for _, side in self.sides for device, host, rank in side}
        return tuple(tuple((device, host, *rows[rank]) for rank, (device, host) in members.items() if rank in rows)
                     for rows in (held, needed))

    def key(self, m: int) -> tuple:
        """The canonical (source, destination) holdings of micro-batch ``m``'s rows."""
        sizes = tuple(tuple(s[m] for s in slot_sizes) for slot_sizes, _ in self.sides)
        if sizes not in self._keys:
            self._keys[sizes] = self._key(m)
        return self._keys[sizes]

    def _key(self, m: int) -> tuple:
        rows = self.rows(m)
        return tuple(tuple((device, host, *rows[rank]) for device, host, rank in members)
                     for _, members in self.sides)


def _planned(key: tuple, row_bytes: int, network: NetworkModel, strategy: str, max_nodes: int) -> ReshardPlan:
    """The resharding of a canonical key, planned once per key, network and strategy."""
    cache_key = (key, row_bytes, network.key(), strategy, max_nodes)
    reshard = _CACHE.get(cache_key)
    if reshard is None:
        src, dst = key
        rows = max(1, max(hi for *_, hi in src + dst))
        specs = [ShardingSpec.of_boxes((rows, row_bytes), [((device, host), ((lo, hi), (0, row_bytes)))
                                                           for device, host, lo, hi in side]) for side in (src, dst)]
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
        reshard = _CACHE[cache_key] = plan_resharding(*specs, network, itemsize=1, strategy=strategy,
                                                      max_nodes=max_nodes)
    return reshard


def _sends(reshard: ReshardPlan, names: dict[str, str], hosts: dict[str, str]) -> tuple[BoundarySend, ...]:
    out = []
    for t in reshard.transfers:
        if not t.hops:   # a receiver that holds the slice keeps it
            continue
        resources = {("dev", names[t.sender])} | {("dev", names[d]) for d in t.receivers}
        for hop in t.hops:
            src, dst = names[hop.src], names[hop.dst]
            resources |= {("dev", src), ("dev", dst)}
            if hop.cross_host:
                resources |= {("out", hosts[src]), ("in", hosts[dst])}
        out.append(BoundarySend(names[t.sender], tuple(names[d] for d in t.receivers), t.start_ms,
                                t.end_ms - t.start_ms, tuple(sorted(resources)), t.strategy, t.task, t.chunks,
                                t.nbytes))
    return tuple(out)


_CACHE: dict = {}
_CACHE_SIZE = 1024
_TRAFFIC: dict = {}   # _traffic_key -> plan_traffic's answer (the lists are copied out: callers may edit them)
_TRAFFIC_SIZE = 8


def clear_caches() -> None:
    """Forget every memoised boundary plan and traffic, here and in
    :mod:`planner.resharding.reshard`, and the DDP buckets of :mod:`planner.schedule.gradient_buckets`
    (a benchmark times planning from nothing)."""
    _CACHE.clear()
    _TRAFFIC.clear()
    clear_reshard_cache()
    clear_bucket_cache()
