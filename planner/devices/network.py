"""The network model shared by the planner, the simulator and the runtime's network emulation.

Why one module: a predicted step time is only comparable with a measured (emulated) one when both
price a transfer the same way, so the link a transfer crosses, its time and the queueing on each
host's network interface are defined once, here, from the cluster spec's
:class:`~whalelike.cluster.Network` figures. Pure Python, no ``torch.distributed``: it runs in the
planner's single process. Its users: the simulator and :mod:`planner.schedule.gradient_buckets` (rings,
queueing) and the cross-mesh resharding planner (:mod:`planner.resharding.cost`: the link between
two hosts, :meth:`NetworkModel.check_placement`).

**Units.** Bandwidths are gigaBYTES per second, 10^9 bytes/s = 10^6 bytes per millisecond
(:data:`BYTES_PER_MS_PER_GBPS`), although the cluster's fields are named ``*_gbps``: a figure of
``12.5`` means 12.5 GB/s (100 Gbit/s), not 12.5 Gbit/s. Latency is given in microseconds and every
time returned is in milliseconds.

What is modeled:

* **Links.** A transfer between two devices crosses one link: none on the same device (free), the
  intra-host link between devices of one host, or the inter-host link through the sending host's
  network interface (NIC) out and the receiving host's NIC in; its bandwidth is the slower of the
  two NICs (``inter_host_gbps`` unless ``nic_gbps`` overrides a host). A message of ``b > 0`` bytes
  takes ``latency + b / bandwidth`` (the alpha-beta model of :mod:`planner.devices.cost_model`); an empty
  one takes no time (it is not sent). :meth:`NetworkModel.host_link` is the same link between two
  hosts, for callers that place transfers by host (a model built with :meth:`NetworkModel.of_hosts`
  knows hosts but no devices).
* **NIC queueing** (:meth:`NetworkModel.schedule`). Each host's NIC is one serial resource per
  direction: an inter-host transfer holds its sender's outgoing and its receiver's incoming NIC
  for its whole time (latency included: per-message overhead occupies the interface); waiting
  transfers start in order of ready time (ties in the order given). Two sends out of one NIC take
  twice as long as one: the bottleneck of one sender host feeding many receivers (seed 001).
  Event-driven and work-conserving: a transfer whose NICs are free never waits behind one whose
  NICs are busy.
* **Ring collectives** (:class:`Ring`: all-reduce, all-gather, reduce-scatter) over devices in the order given
  (rank order, as gloo's and NCCL's rings run for host-contiguous ranks): each of the ``n - 1``
  (all-reduce: ``2(n - 1)``) steps moves a ``bytes / n`` chunk over every hop at once, so a step
  lasts as long as its slowest hop; hops leaving (entering) one host share its NIC, dividing its
  bandwidth by their number. On a uniform ring this is the textbook
  ``2(n-1)/n * bytes / bw + 2(n-1) * latency``; a host-contiguous ring over several hosts is bounded
  by the inter-host link.

Not modeled: contention inside a host (PCIe switches, NVLink ports: intra-host transfers run in
parallel), switch and core-network congestion beyond each host's NIC, bandwidth sharing between a
collective and concurrent point-to-point transfers or other collectives (rings are priced in
closed form, transfers are queued), pipelined chunking inside one transfer, and topology-aware
collective algorithms (trees, hierarchical all-reduce).

Invariant: every time is finite and >= 0, and an inter-host transfer never starts while another
transfer holds one of its NICs; a figure that is zero, negative, NaN or infinite, or a device or
host the model does not know, is a :class:`NetworkError` naming the value and the fix.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from whalelike.errors import SpecError

SAME_DEVICE, INTRA_HOST, INTER_HOST = "same device", "intra-host", "inter-host"
BYTES_PER_MS_PER_GBPS = 1e6   # 1 GB/s (gigaBYTE) moves 10^6 bytes per millisecond (as in planner.devices.cost_model)


class NetworkError(SpecError):
    """A network figure, device or host the network model cannot use."""


def _positive(value, name: str, meaning: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise NetworkError(f"network: {name} must be a finite number > 0 ({meaning}), got {value!r}; "
                           "fix the cluster spec's network block")
    return float(value)


def _bytes(nbytes, what: str) -> float:
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not math.isfinite(nbytes) or nbytes < 0:
        raise NetworkError(f"{what}: bytes must be a finite number >= 0, got {nbytes!r}")
    return float(nbytes)


@dataclass(frozen=True)
class Link:
    """The link one transfer crosses: ``kind`` (:data:`SAME_DEVICE`, :data:`INTRA_HOST`,
    :data:`INTER_HOST`), its bandwidth in GB/s (``inf`` on one device) and latency in ms;
    ``src_host``/``dst_host`` name the NICs an inter-host transfer holds."""

    kind: str
    gbps: float
    latency_ms: float
    src_host: str
    dst_host: str

    @property
    def ms_per_byte(self) -> float:
        """Milliseconds per byte on the wire (0 on one device)."""
        return 0.0 if self.kind == SAME_DEVICE else 1.0 / (self.gbps * BYTES_PER_MS_PER_GBPS)

    def time_ms(self, nbytes: float, sharing: int = 1) -> float:
        """Milliseconds to move ``nbytes`` over this link while ``sharing`` transfers split its bandwidth."""
        if self.kind == SAME_DEVICE or nbytes <= 0:
            return 0.0
        return self.latency_ms + nbytes * sharing * self.ms_per_byte


@dataclass(frozen=True)
class Transfer:
    """``nbytes`` from device ``src`` to device ``dst``, ready to leave at ``ready_ms``."""

    src: str
    dst: str
    nbytes: float
    ready_ms: float = 0.0
    label: str = ""


@dataclass(frozen=True)
class TimedTransfer:
    """A scheduled :class:`Transfer`: when it held its link, ``start_ms`` to ``end_ms`` (its arrival)."""

    transfer: Transfer
    link: Link
    start_ms: float
    end_ms: float

    @property
    def queued_ms(self) -> float:
        """Time spent waiting for a busy NIC after the transfer was ready."""
        return self.start_ms - self.transfer.ready_ms


class NetworkModel:
    """Links, transfer times, NIC queueing and ring collective costs on one cluster's network.

    ``device_hosts`` maps every device name to its host; ``nic_gbps`` optionally gives a host's
    NIC its own bandwidth (GB/s, each direction) instead of ``inter_host_gbps``; ``hosts`` lists
    hosts beyond those of ``device_hosts`` (see :meth:`of_hosts`). Bandwidths in GB/s (gigaBYTES,
    see the module docstring), latency in microseconds.
    """

    def __init__(self, intra_host_gbps: float, inter_host_gbps: float, latency_us: float,
                 device_hosts: Mapping[str, str], nic_gbps: Optional[Mapping[str, float]] = None,
                 hosts: Sequence[str] = (), collective_latency_us: Optional[float] = None,
                 collective_gbps: Optional[float] = None):
        self.intra_host_gbps = _positive(intra_host_gbps, "intra_host_gbps", "GB/s between devices of one host")
        self.inter_host_gbps = _positive(inter_host_gbps, "inter_host_gbps", "GB/s between hosts")
        if (isinstance(latency_us, bool) or not isinstance(latency_us, (int, float)) or not math.isfinite(latency_us)
                or latency_us < 0):
            raise NetworkError(f"network: latency_us must be a finite number >= 0 (per-message latency in "
                               f"microseconds), got {latency_us!r}; fix the cluster spec's network block")
        self.latency_ms = float(latency_us) * 1e-3
        # a ring step's measured floor (Network.collective_*: whalelike profile), 0 when none
        self.collective_latency_ms = float(collective_latency_us or 0.0) * 1e-3
        self.collective_ms_per_byte = (1.0 / (_positive(collective_gbps, "collective_gbps", "GB/s of a measured ring "
                                                        "step") * BYTES_PER_MS_PER_GBPS) if collective_gbps else 0.0)
        if not device_hosts and not hosts:
            raise NetworkError("network: no devices and no hosts; pass device_hosts (device name -> host), e.g. "
                               "NetworkModel.of_cluster(cluster), or hosts (NetworkModel.of_hosts)")
        self.device_hosts = dict(device_hosts)
        self.hosts = list(dict.fromkeys([*self.device_hosts.values(), *hosts]))
        self.nic_gbps = {host: self.inter_host_gbps for host in self.hosts}
        for host, gbps in (nic_gbps or {}).items():
            self._check_host(host, "nic_gbps")
            self.nic_gbps[host] = _positive(gbps, f"nic_gbps[{host!r}]", f"GB/s of host {host}'s network interface")

    @classmethod
    def of_cluster(cls, cluster, nic_gbps: Optional[Mapping[str, float]] = None) -> "NetworkModel":
        """The model of a :class:`~whalelike.cluster.Cluster`'s network and device placement."""
        net = cluster.network
        return cls(net.intra_host_gbps, net.inter_host_gbps, net.latency_us,
                   {d.name: d.host for d in cluster.devices}, nic_gbps,
                   collective_latency_us=net.collective_latency_us, collective_gbps=net.collective_gbps)

    @classmethod
    def of_hosts(cls, intra_host_gbps: float, inter_host_gbps: float, latency_us: float, hosts: Sequence[str],
                 nic_gbps: Optional[Mapping[str, float]] = None) -> "NetworkModel":
        """A model that knows hosts but no devices: for callers whose devices carry their own host
        (sharding specs, hand-made meshes); :meth:`host_link` works, :meth:`link` knows no device and
        :meth:`check_placement` checks hosts only."""
        return cls(intra_host_gbps, inter_host_gbps, latency_us, {}, nic_gbps, hosts=tuple(hosts))

    def _check_host(self, host: str, what: str) -> None:
        if host not in self.nic_gbps:
            raise NetworkError(f"network: {what} names host {host!r}, which has no devices; "
                               f"hosts: {', '.join(self.hosts)} (fix the name or remove the entry)")

    def key(self) -> tuple:
        """Every figure and placement of this model, hashable: equal keys price everything alike."""
        return (self.intra_host_gbps, self.inter_host_gbps, self.latency_ms, tuple(sorted(self.device_hosts.items())),
                tuple(sorted(self.nic_gbps.items())))

    def check_placement(self, device_hosts: Mapping[str, str], what: str) -> None:
        """Every device of ``device_hosts`` (device -> host, e.g. a mesh's) sits on a host of this
        network and, when the model knows its devices, is one of them and on that host."""
        for device, host in device_hosts.items():
            if host not in self.nic_gbps:
                raise NetworkError(f"{what} device {device!r} is on host {host!r}, which the cluster does not have; "
                                   f"hosts are {list(self.hosts)}: fix the mesh or the cluster spec")
            if self.device_hosts:
                known = self.device_hosts.get(device)
                if known is None:
                    raise NetworkError(f"{what} device {device!r} is not in the cluster; devices are "
                                       f"{sorted(self.device_hosts)[:8]}...: use the cluster's device names")
                if known != host:
                    raise NetworkError(f"{what} device {device!r} is given on host {host!r} but the cluster "
                                       f"puts it on {known!r}; fix the mesh's host")

    def host_of(self, device: str) -> str:
        try:
            return self.device_hosts[device]
        except KeyError:
            known = ", ".join(list(self.device_hosts)[:8]) + (", ..." if len(self.device_hosts) > 8 else "")
            raise NetworkError(f"network: device {device!r} is not in the cluster (devices: {known}); "
                               "use a device name from the cluster spec") from None

    # -- point to point ----------------------------------------------------------------------------
    def link(self, src: str, dst: str) -> Link:
        """The link a transfer from device ``src`` to device ``dst`` crosses."""
        src_host, dst_host = self.host_of(src), self.host_of(dst)
        if src == dst:
            return Link(SAME_DEVICE, math.inf, 0.0, src_host, dst_host)
        return self.host_link(src_host, dst_host)

    def host_link(self, src_host: str, dst_host: str) -> Link:
        """The link between two different devices on hosts ``src_host`` and ``dst_host``."""
        for host in (src_host, dst_host):
            self._check_host(host, "a transfer")
        if src_host == dst_host:
            return Link(INTRA_HOST, self.intra_host_gbps, self.latency_ms, src_host, dst_host)
        gbps = min(self.nic_gbps[src_host], self.nic_gbps[dst_host])
        return Link(INTER_HOST, gbps, self.latency_ms, src_host, dst_host)

    def nic_ms_per_byte(self, host: str) -> float:
        """Milliseconds per byte through ``host``'s network interface (each direction)."""
        self._check_host(host, "a transfer")
        return 1.0 / (self.nic_gbps[host] * BYTES_PER_MS_PER_GBPS)

    def transfer_ms(self, nbytes: float, src: str, dst: str) -> float:
        """Modeled time of one transfer alone on its link: ``latency + bytes / bandwidth``."""
        return self.link(src, dst).time_ms(_bytes(nbytes, f"transfer {src} -> {dst}"))

    def schedule(self, transfers: Sequence[Transfer]) -> list[TimedTransfer]:
        """Start and end of each transfer (in the order given) with NIC queueing. Event-driven
        and work-conserving: whenever a NIC frees up or a transfer becomes ready, the waiting
        inter-host transfers start in order of ready time (ties: the order given) if their
        sender's outgoing NIC and their receiver's incoming NIC are both free; each holds both
        until it ends. Transfers inside a host or on one device start when ready."""
        timed: list[Optional[TimedTransfer]] = [None] * len(transfers)
        waiting = []   # (ready, index, link, duration) of inter-host transfers
        for i, t in enumerate(transfers):
            what = f"transfer {i} ({t.label or f'{t.src} -> {t.dst}'})"
            nbytes = _bytes(t.nbytes, what)
            if (isinstance(t.ready_ms, bool) or not isinstance(t.ready_ms, (int, float))
                    or not math.isfinite(t.ready_ms) or t.ready_ms < 0):
                raise NetworkError(f"{what}: ready_ms must be a finite number >= 0, got {t.ready_ms!r}")
            link = self.link(t.src, t.dst)
            duration = link.time_ms(nbytes)
            if link.kind == INTER_HOST and duration > 0:
                waiting.append((float(t.ready_ms), i, link, duration))
            else:
                timed[i] = TimedTransfer(t, link, float(t.ready_ms), float(t.ready_ms) + duration)
        waiting.sort(key=lambda item: item[:2])
        out_free: dict[str, float] = {}
        in_free: dict[str, float] = {}
        now = 0.0
        while waiting:
            left = []
            for ready, i, link, duration in waiting:
                if (ready <= now and out_free.get(link.src_host, 0.0) <= now
                        and in_free.get(link.dst_host, 0.0) <= now):
                    out_free[link.src_host] = in_free[link.dst_host] = now + duration
                    timed[i] = TimedTransfer(transfers[i], link, now, now + duration)
                else:
                    left.append((ready, i, link, duration))
            waiting = left
            events = [ready for ready, *_ in waiting if ready > now]
            events += [free for free in (*out_free.values(), *in_free.values()) if free > now]
            now = min(events, default=now)
        return timed  # type: ignore[return-value]

    # -- ring collectives ----------------------------------------------------------------------------
    def ring(self, devices: Sequence[str]) -> "Ring":
        """The ring over ``devices`` in the order given, priced once: reuse it for many messages."""
        devices = list(devices)
        if len(set(devices)) != len(devices):
            twice = sorted(d for d, n in Counter(devices).items() if n > 1)
            raise NetworkError(f"ring over {devices}: devices {twice} appear twice; list each device once")
        hops = [self.link(devices[i], devices[(i + 1) % len(devices)]) for i in range(len(devices))]
        if len(devices) <= 1:
            return Ring(len(devices), 0.0, 0.0)
        leaving = Counter(h.src_host for h in hops if h.kind == INTER_HOST)
        entering = Counter(h.dst_host for h in hops if h.kind == INTER_HOST)
        # every hop has the same latency, so the slowest hop is the one with the least bandwidth
        ms_per_byte = max((max(leaving[h.src_host], entering[h.dst_host]) if h.kind == INTER_HOST else 1)
                          / (h.gbps * BYTES_PER_MS_PER_GBPS) for h in hops)
        # never faster than a ring step measured over the real transport (NetworkModel's collective floor)
        return Ring(len(devices), max(self.latency_ms, self.collective_latency_ms),
                    max(ms_per_byte, self.collective_ms_per_byte))

    def ring_allreduce_ms(self, nbytes: float, devices: Sequence[str]) -> float:
        """Ring all-reduce of ``nbytes`` per device: reduce-scatter then all-gather, ``2(n-1)`` steps."""
        return self.ring(devices).allreduce_ms(nbytes)

    def ring_allgather_ms(self, nbytes: float, devices: Sequence[str]) -> float:
        """Ring all-gather of a tensor of ``nbytes`` in total (each device holds ``nbytes / n``)."""
        return self.ring(devices).allgather_ms(nbytes)

    def ring_reduce_scatter_ms(self, nbytes: float, devices: Sequence[str]) -> float:
        """Ring reduce-scatter of ``nbytes`` per device (each ends with its reduced ``nbytes / n``)."""
        return self.ring(devices).reduce_scatter_ms(nbytes)


@dataclass(frozen=True)
class Ring:
    """A priced ring of ``size`` devices: each step moves one chunk over every hop at once and
    lasts ``latency_ms + chunk * ms_per_byte`` (its slowest hop, NIC sharing included)."""

    size: int
    latency_ms: float
    ms_per_byte: float

    def step_ms(self, chunk_bytes: float) -> float:
        return self.latency_ms + chunk_bytes * self.ms_per_byte

    def _collective_ms(self, nbytes: float, steps_per_device: int, what: str) -> float:
        nbytes = _bytes(nbytes, what)
        if self.size <= 1 or nbytes <= 0:
            return 0.0
        return steps_per_device * (self.size - 1) * self.step_ms(nbytes / self.size)

    def allreduce_ms(self, nbytes: float) -> float:
        """All-reduce of ``nbytes`` per device: ``2(n-1)`` steps of ``nbytes / n``."""
        return self._collective_ms(nbytes, 2, "ring all-reduce")

    def allgather_ms(self, nbytes: float) -> float:
        """All-gather of ``nbytes`` in total: ``n - 1`` steps of ``nbytes / n``."""
        return self._collective_ms(nbytes, 1, "ring all-gather")

    def reduce_scatter_ms(self, nbytes: float) -> float:
        """Reduce-scatter of ``nbytes`` per device: ``n - 1`` steps of ``nbytes / n``."""
        return self._collective_ms(nbytes, 1, "ring reduce-scatter")
