"""What one unit task costs under each strategy, and the lower bound of a whole resharding.

Seed paper 001, section 3.1, on the cluster's link figures (:class:`whalelike.cluster.Network`,
the same figures as :class:`planner.cost_model.CommModel`: GB/s and microseconds): a message of
``b`` bytes costs ``latency + b / bandwidth``, intra-host or inter-host bandwidth by where its two
ends sit. Resources (paper section 3, "communication bottleneck at hosts", full duplex): each
device, each host's outgoing network interface (``out``) and each host's incoming one (``in``)
runs one transfer at a time; a transfer occupies all of its resources for its whole duration.

A unit task becomes one or more *transfers* (the schedulable pieces). Receivers on a host that
holds the slice are always fed from that host (intra-host, a local holder); a receiver that holds
the slice itself keeps it (strategy ``local``, no traffic). For the others:

* ``send_recv``: one transfer per receiving device, a full copy from a sender device.
* ``allgather``: one transfer per receiving host: the sender sends the slice cut in ``m`` parts
  (:func:`allgather_parts`), one to each of the host's ``m`` receivers (serially, ``m`` messages),
  which then all-gather it over the intra-host ring (``(m-1)`` steps of ``S/m``). One cross-host
  copy per receiving host.
* ``broadcast``: one transfer for all remote receivers: a ring from the sender through the
  receivers, host by host, cut in ``K`` chunks and pipelined:
  ``sum_h (L + c/bw_h) + (K-1) * max_h (L + c/bw_h)``, ``c = S/K``, ``K`` chosen to minimise it
  (at most :data:`MAX_CHUNKS`). About ``S/bw + (receivers-1)*c/bw + latency`` terms: the
  slice crosses each receiving host's interface once.

Departures from the paper: intra-host copies are priced (the paper ignores them); receivers on a
host holding the slice are fed locally (the paper's meshes are disjoint); the global all-gather
variant is not offered (on 2-host meshes it is the host-local one plus cross-host ring steps that
broadcast already beats).

:func:`lower_bound_ms`: no schedule beats the bytes that must cross the busiest interface (a
receiving host's ``in``; a host's ``out`` for slices only it holds; the average ``out`` over the
holding hosts) or enter the busiest device, over its bandwidth, plus one latency.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from .resharding_spec import ReshardingError
from .resharding_tasks import UnitTask

STRATEGIES = ("broadcast", "allgather", "send_recv")
MAX_CHUNKS = 1024   # chunks of one broadcast: enough to hide the ring's fill on 8-hop rings to < 1%

Resource = tuple[str, str]   # ("dev", device) | ("out", host) | ("in", host)


@dataclass(frozen=True)
class Links:
    """Link figures and the hosts that exist. Build it from a cluster with :meth:`of_cluster`.

    ``device_hosts`` (optional): the cluster's device -> host map; when given, a mesh device that
    is not in the cluster, or sits on another host than the spec says, is an error."""

    intra_host_gbps: float
    inter_host_gbps: float
    latency_us: float
    hosts: tuple[str, ...]
    device_hosts: Optional[Mapping[str, str]] = None

    def __post_init__(self):
        object.__setattr__(self, "hosts", tuple(self.hosts))
        for name in ("intra_host_gbps", "inter_host_gbps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
                raise ReshardingError(f"links: {name} is {value!r}; it must be a bandwidth > 0 in GB/s, e.g. "
                                      "12.5 between hosts, 150 within one (the cluster spec's network block)")
        if (not isinstance(self.latency_us, (int, float)) or isinstance(self.latency_us, bool)
                or not 0 <= self.latency_us < math.inf):
            raise ReshardingError(f"links: latency_us is {self.latency_us!r}; it must be >= 0 microseconds, e.g. 5")
        if not self.hosts:
            raise ReshardingError("links: no hosts; list the cluster's hosts (Links.of_cluster does)")

    @classmethod
    def of_cluster(cls, cluster) -> "Links":
        network = cluster.network
        return cls(network.intra_host_gbps, network.inter_host_gbps, network.latency_us, tuple(cluster.hosts),
                   {d.name: d.host for d in cluster.devices})

    @property
    def latency_ms(self) -> float:
        return self.latency_us * 1e-3

    def message_ms(self, nbytes: float, src_host: str, dst_host: str) -> float:
        gbps = self.intra_host_gbps if src_host == dst_host else self.inter_host_gbps
        return self.latency_ms + nbytes / (gbps * 1e6)

    def check_devices(self, device_hosts: Mapping[str, str], mesh: str) -> None:
        """Every device of a mesh sits on a host that exists (and, with ``device_hosts``, on its own)."""
        for device, host in device_hosts.items():
            if host not in self.hosts:
                raise ReshardingError(f"resharding: {mesh} device {device!r} is on host {host!r}, which the cluster "
                                      f"does not have; hosts are {list(self.hosts)}: fix the mesh or the cluster spec")
            if self.device_hosts is not None:
                known = self.device_hosts.get(device)
                if known is None:
                    raise ReshardingError(f"resharding: {mesh} device {device!r} is not in the cluster; devices are "
                                          f"{sorted(self.device_hosts)[:8]}...: use the cluster's device names")
                if known != host:
                    raise ReshardingError(f"resharding: {mesh} device {device!r} is given on host {host!r} but the "
                                          f"cluster puts it on {known!r}; fix the mesh's host")


@dataclass(frozen=True)
class Hop:
    """One point-to-point copy of a transfer: ``nbytes`` from ``src`` to ``dst``."""

    src: str
    dst: str
    nbytes: float
    cross_host: bool


@dataclass(frozen=True)
class Route:
    """A transfer sent by device ``sender``: its duration, the resources it holds, its copies."""

    sender: str
    sender_host: str
    duration_ms: float
    resources: frozenset
    hops: tuple[Hop, ...]
    chunks: int = 1


@dataclass(frozen=True)
class Transfer:
    """A schedulable piece of unit task ``task`` under ``strategy``: deliver the slice to
    ``receivers`` (in ring order for a broadcast) by one of ``routes`` (one per candidate sender)."""

    task: int
    strategy: str
    receivers: tuple[str, ...]
    nbytes: float
    routes: tuple[Route, ...]


def transfers(task: UnitTask, strategy: str, src_hosts: Mapping[str, str], dst_hosts: Mapping[str, str],
              links: Links, itemsize: int) -> list[Transfer]:
    """The transfers of ``task`` under ``strategy`` (see the module docstring)."""
    if strategy not in STRATEGIES:
        raise ReshardingError(f"resharding: unknown strategy {strategy!r}; use one of {STRATEGIES} or 'auto'")
    nbytes = float(task.elements * itemsize)
    holder_hosts = {src_hosts[d] for d in task.holders}
    out: list[Transfer] = []
    remote: list[str] = []
    local_by_host: dict[str, list[str]] = {}
    for device in task.needers:
        host = dst_hosts[device]
        if device in task.holders:
            route = Route(device, host, 0.0, frozenset(), ())
            out.append(Transfer(task.index, "local", (device,), nbytes, (route,)))
        elif host in holder_hosts:
            local_by_host.setdefault(host, []).append(device)
        else:
            remote.append(device)
    groups: list[tuple[list[str], list[str]]] = []   # (receivers, candidate senders)
    local_senders = {host: [d for d in task.holders if src_hosts[d] == host] for host in local_by_host}
    remote_by_host: dict[str, list[str]] = {}
    for device in remote:
        remote_by_host.setdefault(dst_hosts[device], []).append(device)
    if strategy == "send_recv":
        groups += [([d], local_senders[h]) for h, ds in local_by_host.items() for d in ds]
        groups += [([d], list(task.holders)) for d in remote]
    elif strategy == "allgather":
        groups += [(ds, local_senders[h]) for h, ds in local_by_host.items()]
        groups += [(ds, list(task.holders)) for ds in remote_by_host.values()]
    else:
        groups += [(ds, local_senders[h]) for h, ds in local_by_host.items()]
        if remote:
            groups.append(([d for ds in remote_by_host.values() for d in ds], list(task.holders)))
    for receivers, senders in groups:
        routes = tuple(_route(strategy, sender, src_hosts[sender], receivers, dst_hosts, nbytes, links, itemsize)
                       for sender in senders)
        out.append(Transfer(task.index, strategy, tuple(receivers), nbytes, routes))
    return out


def _route(strategy: str, sender: str, sender_host: str, receivers: Sequence[str], dst_hosts: Mapping[str, str],
           nbytes: float, links: Links, itemsize: int) -> Route:
    resources = {("dev", sender)} | {("dev", d) for d in receivers}
    if strategy == "broadcast" and len(receivers) > 1:
        ring = [(sender, sender_host)] + [(d, dst_hosts[d]) for d in receivers]
        hops = tuple(Hop(a, b, nbytes, ha != hb) for (a, ha), (b, hb) in zip(ring, ring[1:]))
        for (_, ha), (_, hb) in zip(ring, ring[1:]):
            if ha != hb:
                resources |= {("out", ha), ("in", hb)}
        gbps = [links.inter_host_gbps if hop.cross_host else links.intra_host_gbps for hop in hops]
        duration, chunks = _pipelined_ms(nbytes, gbps, links.latency_ms, max(1, int(nbytes // itemsize)))
        return Route(sender, sender_host, duration, frozenset(resources), hops, chunks)
    host = dst_hosts[receivers[0]]
    cross = host != sender_host
    if cross:
        resources |= {("out", sender_host), ("in", host)}
    if strategy == "allgather" and len(receivers) > 1:
        parts = [size * itemsize for size in allgather_parts(int(nbytes // itemsize), len(receivers))]
        hops = tuple(Hop(sender, d, float(part), cross) for d, part in zip(receivers, parts))
        ring = list(receivers)
        # ring all-gather: each device forwards every part but its successor's own
        hops += tuple(Hop(a, b, float(nbytes - parts[(i + 1) % len(ring)]), False)
                      for i, (a, b) in enumerate(zip(ring, ring[1:] + ring[:1])))
        gather = (len(ring) - 1) * links.message_ms(max(parts), host, host)
        duration = sum(links.message_ms(part, sender_host, host) for part in parts) + gather
        return Route(sender, sender_host, duration, frozenset(resources), hops)
    hops = tuple(Hop(sender, d, nbytes, cross) for d in receivers)
    duration = sum(links.message_ms(nbytes, sender_host, dst_hosts[d]) for d in receivers)
    return Route(sender, sender_host, duration, frozenset(resources), hops)


def allgather_parts(elements: int, count: int) -> list[int]:
    """How an all-gather transfer cuts a slice of ``elements`` entries (flattened, row-major) over
    ``count`` receivers: consecutive parts, the first ``elements % count`` one entry longer."""
    return [elements // count + (1 if i < elements % count else 0) for i in range(count)]


def _pipelined_ms(nbytes: float, gbps: Sequence[float], latency_ms: float, max_chunks: int) -> tuple[float, int]:
    """Time of a chunked ring broadcast over hops of bandwidths ``gbps`` and its best chunk count."""
    per_ms = [g * 1e6 for g in gbps]

    def time(chunks: int) -> float:
        steps = [latency_ms + nbytes / chunks / bw for bw in per_ms]
        return sum(steps) + (chunks - 1) * max(steps)

    limit = max(1, min(MAX_CHUNKS, max_chunks))
    slowest = min(per_ms)
    extra = sum(1 / bw for bw in per_ms) - 1 / slowest
    guess = limit if latency_ms <= 0 else math.sqrt(nbytes * extra / latency_ms)
    candidates = {1, limit} | {min(limit, max(1, int(guess) + k)) for k in (-1, 0, 1, 2)}
    best = min(sorted(candidates), key=time)
    return time(best), best


def lower_bound_ms(tasks: Sequence[UnitTask], src_hosts: Mapping[str, str], dst_hosts: Mapping[str, str],
                   links: Links, itemsize: int) -> float:
    """No schedule of any strategy finishes sooner (see the module docstring)."""
    into_host: dict[str, float] = {}
    only_out: dict[str, float] = {}
    into_device: dict[str, float] = {}
    leaving, senders = 0.0, set()
    for task in tasks:
        nbytes = float(task.elements * itemsize)
        holder_hosts = {src_hosts[d] for d in task.holders}
        remote_hosts = {dst_hosts[d] for d in task.needers if dst_hosts[d] not in holder_hosts}
        for device in task.needers:
            if device not in task.holders:
                gbps = links.intra_host_gbps if dst_hosts[device] in holder_hosts else links.inter_host_gbps
                into_device[device] = into_device.get(device, 0.0) + nbytes / (gbps * 1e6)
        if not remote_hosts:
            continue
        for host in remote_hosts:
            into_host[host] = into_host.get(host, 0.0) + nbytes
        if len(holder_hosts) == 1:
            (host,) = holder_hosts
            only_out[host] = only_out.get(host, 0.0) + nbytes
        leaving += nbytes
        senders |= holder_hosts
    if not into_device:
        return 0.0   # every receiver already holds what it needs
    busiest = max([0.0, *into_host.values(), *only_out.values(), leaving / max(1, len(senders))])
    return max(busiest / (links.inter_host_gbps * 1e6), *into_device.values()) + links.latency_ms
