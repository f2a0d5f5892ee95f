"""What one unit task costs under each strategy, and the lower bound of a whole resharding.

Seed paper 001, section 3.1, on the network model the simulator uses
(:class:`planner.devices.network.NetworkModel`: link figures, units, which link joins two hosts, the
alpha-beta time ``latency + b / bandwidth`` of a message; nothing about links is defined here).
This module adds only what is resharding-specific: the transfers each strategy makes of a unit
task, their resources, and the lower bound. Resources (paper section 3, "communication bottleneck
at hosts", full duplex): each host's outgoing network interface (``out``) and incoming one
(``in``) runs one transfer at a time, the rule :meth:`NetworkModel.schedule` queues by; the
resharding search adds each device as a resource (the paper's rule: a device runs one send or
receive at a time) and places transfers itself (:mod:`planner.resharding.order`), since a
broadcast holds several hosts' interfaces at once. A transfer occupies all of its resources for
its whole duration.

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

:func:`lower_bound_ms`: no schedule beats the time the busiest resource must be held: a receiving
host's ``in`` (one transfer per unit task it needs from another host), a host's ``out`` for slices
only it holds (one per such task), the interfaces of the holding hosts together (every task that
leaves a host, spread over them by bandwidth), or a receiving device (one transfer per task it
needs, over the fastest link from a holder's host, plus one per task that only it holds and another
device needs: a device runs one transfer at a time, sending or receiving). Every transfer holds its
resources for at least one latency plus its bytes over the link, so each counts ``latency + bytes /
bandwidth`` (a chunked broadcast, an all-gather's parts and the send/recv copies all take longer);
at least one latency is added to the spread bytes. Per-host interface figures (``nic_gbps``) count.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from whalelike.config import RESHARDING_STRATEGIES

from planner.devices.network import NetworkModel
from planner.resharding.spec import ReshardingError
from planner.resharding.tasks import UnitTask

STRATEGIES = RESHARDING_STRATEGIES   # whalelike.config lists them once (a Config names one, or "auto")
MAX_CHUNKS = 1024   # chunks of one broadcast: enough to hide the ring's fill on 8-hop rings to < 1%

Resource = tuple[str, str]   # ("dev", device) | ("out", host) | ("in", host)


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
class SliceTransfer:
    """A schedulable piece of unit task ``task`` under ``strategy``: deliver the slice to
    ``receivers`` (in ring order for a broadcast) by one of ``routes`` (one per candidate sender).
    Not a :class:`planner.devices.network.Transfer` (one message between two devices): a route may
    make several copies (:class:`Hop`)."""

    task: int
    strategy: str
    receivers: tuple[str, ...]
    nbytes: float
    routes: tuple[Route, ...]


def transfers(task: UnitTask, strategy: str, src_hosts: Mapping[str, str], dst_hosts: Mapping[str, str],
              network: NetworkModel, itemsize: int) -> list[SliceTransfer]:
    """The transfers of ``task`` under ``strategy`` (see the module docstring)."""
    if strategy not in STRATEGIES:
        raise ReshardingError(f"resharding: unknown strategy {strategy!r}; use one of {STRATEGIES} or 'auto'")
    nbytes = float(task.elements * itemsize)
    holder_hosts = {src_hosts[d] for d in task.holders}
    out: list[SliceTransfer] = []
    remote: list[str] = []
    local_by_host: dict[str, list[str]] = {}
    for device in task.needers:
        host = dst_hosts[device]
        if device in task.holders:
            route = Route(device, host, 0.0, frozenset(), ())
            out.append(SliceTransfer(task.index, "local", (device,), nbytes, (route,)))
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
        routes = tuple(_route(strategy, sender, src_hosts[sender], receivers, dst_hosts, nbytes, network, itemsize)
                       for sender in senders)
        out.append(SliceTransfer(task.index, strategy, tuple(receivers), nbytes, routes))
    return out


def _route(strategy: str, sender: str, sender_host: str, receivers: Sequence[str], dst_hosts: Mapping[str, str],
           nbytes: float, network: NetworkModel, itemsize: int) -> Route:
    resources = {("dev", sender)} | {("dev", d) for d in receivers}
    if strategy == "broadcast" and len(receivers) > 1:
        ring = [(sender, sender_host)] + [(d, dst_hosts[d]) for d in receivers]
        hops = tuple(Hop(a, b, nbytes, ha != hb) for (a, ha), (b, hb) in zip(ring, ring[1:]))
        for (_, ha), (_, hb) in zip(ring, ring[1:]):
            if ha != hb:
                resources |= {("out", ha), ("in", hb)}
        links = [network.host_link(ha, hb) for (_, ha), (_, hb) in zip(ring, ring[1:])]
        duration, chunks = _pipelined_ms(nbytes, [link.ms_per_byte for link in links], network.latency_ms,
                                         max(1, int(nbytes // itemsize)))
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
        gather = (len(ring) - 1) * network.host_link(host, host).time_ms(max(parts))
        link = network.host_link(sender_host, host)
        duration = sum(link.time_ms(part) for part in parts) + gather
        return Route(sender, sender_host, duration, frozenset(resources), hops)
    hops = tuple(Hop(sender, d, nbytes, cross) for d in receivers)
    duration = sum(network.host_link(sender_host, dst_hosts[d]).time_ms(nbytes) for d in receivers)
    return Route(sender, sender_host, duration, frozenset(resources), hops)


def allgather_parts(elements: int, count: int) -> list[int]:
    """How an all-gather transfer cuts a slice of ``elements`` entries (flattened, row-major) over
    ``count`` receivers: consecutive parts, the first ``elements % count`` one entry longer."""
    return [elements // count + (1 if i < elements % count else 0) for i in range(count)]


def _pipelined_ms(nbytes: float, ms_per_byte: Sequence[float], latency_ms: float, max_chunks: int
                  ) -> tuple[float, int]:
    """Time of a chunked ring broadcast over hops of ``ms_per_byte`` and its best chunk count."""

    def time(chunks: int) -> float:
        steps = [latency_ms + nbytes / chunks * per_byte for per_byte in ms_per_byte]
        return sum(steps) + (chunks - 1) * max(steps)

    limit = max(1, min(MAX_CHUNKS, max_chunks))
    extra = sum(ms_per_byte) - max(ms_per_byte)
    guess = limit if latency_ms <= 0 else math.sqrt(nbytes * extra / latency_ms)
    candidates = {1, limit} | {min(limit, max(1, int(guess) + k)) for k in (-1, 0, 1, 2)}
    best = min(sorted(candidates), key=time)
    return time(best), best


def lower_bound_ms(tasks: Sequence[UnitTask], src_hosts: Mapping[str, str], dst_hosts: Mapping[str, str],
                   network: NetworkModel, itemsize: int) -> float:
    """No schedule of any strategy finishes sooner (see the module docstring)."""
    latency = network.latency_ms
    into_host: dict[str, float] = {}     # ms through each receiving host's incoming interface
    only_out: dict[str, float] = {}      # ms through a host's outgoing interface for slices only it holds
    into_device: dict[str, float] = {}   # ms of transfers holding each receiving device
    out_of_device: dict[str, float] = {}  # ms of transfers holding a device for slices only it holds
    leaving, crossing, senders = 0.0, 0, set()
    for task in tasks:
        nbytes = float(task.elements * itemsize)
        holder_hosts = {src_hosts[d] for d in task.holders}
        remote_hosts = {dst_hosts[d] for d in task.needers if dst_hosts[d] not in holder_hosts}
        fastest = None   # ms per byte over the fastest link from a holder to a receiver that lacks the slice
        for device in task.needers:
            if device not in task.holders:
                per_byte = min(network.host_link(host, dst_hosts[device]).ms_per_byte for host in holder_hosts)
                into_device[device] = into_device.get(device, 0.0) + latency + nbytes * per_byte
                fastest = per_byte if fastest is None else min(fastest, per_byte)
        if fastest is not None and len(task.holders) == 1:   # its one holder sends it at least once
            (holder,) = task.holders
            out_of_device[holder] = out_of_device.get(holder, 0.0) + latency + nbytes * fastest
        if not remote_hosts:
            continue
        for host in remote_hosts:
            into_host[host] = into_host.get(host, 0.0) + latency + nbytes * network.nic_ms_per_byte(host)
        if len(holder_hosts) == 1:
            (host,) = holder_hosts
            only_out[host] = only_out.get(host, 0.0) + latency + nbytes * network.nic_ms_per_byte(host)
        leaving += nbytes
        crossing += 1
        senders |= holder_hosts
    if not into_device:
        return 0.0   # every receiver already holds what it needs
    # the transfers leaving the sender hosts share their interfaces at best evenly: bandwidth-weighted,
    # each busy for at least (latency + bytes / bandwidth) per task that leaves through it
    spread = spread_latency = 0.0
    if senders:
        rates = [1.0 / network.nic_ms_per_byte(host) for host in senders]   # bytes per ms
        spread = leaving / sum(rates)
        spread_latency = (leaving + crossing * latency * min(rates)) / sum(rates)
    # a device runs one transfer at a time, sending or receiving: its receives and its sole sends add up
    device_busy = [into_device.get(d, 0.0) + out_of_device.get(d, 0.0) for d in {*into_device, *out_of_device}]
    return max(spread + latency, spread_latency, *into_host.values(), *only_out.values(), *device_busy)
