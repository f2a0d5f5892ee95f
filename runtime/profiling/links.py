"""Link latency and bandwidth from timed transfers: an alpha-beta fit per kind of link.

The planner prices a message of ``b`` bytes at ``alpha + b * beta`` (:mod:`planner.devices.network`:
latency plus bytes over bandwidth), one figure for every link within a host and one between hosts.
This module measures both where the cluster has them: for each kind, one pair of devices (the
first pair in rank order on one host; the first device and the first device of another host)
exchanges messages of growing size with ``torch.distributed`` point-to-point operations, the ones
the pipeline's boundaries use (``batch_isend_irecv``), stamped and padded by the emulated network
(:meth:`runtime.emulation.network.NetworkEmulator.stamp_sends`) exactly as a pipeline's transfers
are, so on emulated hardware the figures are the emulated network's and on real hardware the real
links' (software overheads included, which the planner should count too).

Timing is a ping-pong: the first device sends ``b`` bytes, the second sends them back, and half the
round trip is the one-way time (a round trip needs no clock shared between hosts): the fastest
exchange, after one untimed one. The fastest, not the median (compute segments keep the median): a
transfer's time is the link's plus whatever else delays the two processes (a busy core, a late
wake-up), which only ever adds, and a small message is all delay; on the emulated network the link's
own time is a floor the padding guarantees, so the fastest exchange is the closest to it. How many
exchanges: at least ``repeats``, then more while the fastest still moves (stop once ``repeats``
exchanges in a row improved it by less than :data:`SETTLED`), at most :data:`MAX_ROUNDS_FACTOR`
times ``repeats``: on a quiet machine that is two more than ``repeats``, on a loaded one (the shared
cluster the profile is for) enough for one clean exchange to land. The sender decides and says so in
the ping itself (its first byte: "another follows"), so no message is added and both ends stop
together. Sizes grow eightfold from 4 KiB until a transfer takes :data:`SPAN` times the smallest one
(the bandwidth term then dominates, so beta is measured, not guessed) or reaches :data:`MAX_BYTES`;
at least :data:`MIN_SIZES` sizes are timed.

The fit is a least-squares fit of ``t = alpha + beta * b`` weighted by ``1 / t`` (relative
residuals: the times span orders of magnitude, and an unweighted fit would let the largest message's
noise decide the latency), with ``alpha, beta >= 0`` (scipy's ``nnls``).

Collectives (:func:`measure_collective`): a ring all-reduce over every device at a few sizes, fitted per ring
step, a floor the planner puts under every ring it prices (on emulated hardware the machine's own
collectives outlast the emulated links; the runtime pads a collective to its modeled time, never
shortens it).

Invariant: every rank takes part in every exchange's barrier and ends with the same fitted links
(each fit is broadcast from the device that timed it), so the profile is identical on every rank.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from planner.devices.network import INTER_HOST, INTRA_HOST
from planner.devices.profile import LinkProfile
from runtime.emulation.network import NetworkEmulator
from whalelike.cluster import Cluster

log = logging.getLogger(__name__)

FIRST_BYTES = 4096
GROWTH = 8
SPAN = 8.0                  # stop growing once a transfer takes this many times the smallest
MAX_BYTES = 64 << 20
MIN_SIZES = 3
SETTLED = 0.01              # an exchange faster than the fastest by less than this does not count as moving it
MAX_ROUNDS_FACTOR = 8       # at most this many times ``repeats`` timed exchanges per size
TAG = 7                     # below runtime.emulation.network.STAMP_TAG, like every data tag


def link_pairs(cluster: Cluster) -> list[tuple[str, int, int]]:
    """``(kind, src rank, dst rank)`` of the pairs measured: the first two devices of one host
    (intra-host), and device 0 with the first device of another host (inter-host); a kind the
    cluster lacks is left out."""
    devices = cluster.devices
    pairs = []
    same = next(((i, j) for i in range(len(devices)) for j in range(i + 1, len(devices))
                 if devices[i].host == devices[j].host), None)
    if same is not None:
        pairs.append((INTRA_HOST, *same))
    other = next((j for j in range(1, len(devices)) if devices[j].host != devices[0].host), None)
    if other is not None:
        pairs.append((INTER_HOST, 0, other))
    return pairs


def fit_alpha_beta(points: dict[int, float]) -> tuple[float, float]:
    """``(alpha seconds, beta seconds per byte)`` of ``t = alpha + beta * b`` through ``points``
    (bytes -> seconds), weighted least squares with both >= 0 (see the module docstring)."""
    from scipy.optimize import nnls   # a fraction of a second to import: only the profiler fits links
    if len(points) < 2:
        raise ValueError(f"fit_alpha_beta: needs at least two sizes, got {len(points)}")
    sizes = np.array(sorted(points), dtype=float)
    times = np.array([points[int(s)] for s in sizes], dtype=float)
    if np.any(times <= 0):
        raise ValueError(f"fit_alpha_beta: every time must be > 0, got {dict(points)}")
    weights = 1.0 / times
    design = np.stack([np.ones_like(sizes), sizes], axis=1) * weights[:, None]
    (alpha, beta), _ = nnls(design, times * weights)
    if beta <= 0:   # times that do not grow with size (a link far faster than its latency): bound it by the largest
        beta = max(times[-1] - alpha, 1e-12) / sizes[-1]
    return float(alpha), float(beta)


def measure_links(cluster: Cluster, rank: int, device: torch.device, network: Optional[NetworkEmulator],
                  repeats: int = 5, on_size=None) -> list[LinkProfile]:
    """Time and fit each kind of link the cluster has (collective: every rank calls it);
    ``network``: this rank's emulated network (None on real hardware); ``on_size()`` is called on
    every rank after each timed size (the progress bar)."""
    out = []
    for kind, src, dst in link_pairs(cluster):
        late = network.stats.unpadded if network is not None else 0
        points: dict[int, float] = {}
        size = FIRST_BYTES
        while True:
            dist.barrier()
            seconds = _ping_pong(rank, src, dst, size, repeats, device, network, cluster)
            # the sender's figure decides, on every rank alike, whether to grow
            decision = [seconds if rank == src else None]
            dist.broadcast_object_list(decision, src=src)
            points[size] = decision[0]
            if on_size is not None:
                on_size()
            smallest = points[FIRST_BYTES]
            if (len(points) >= MIN_SIZES and points[size] >= SPAN * smallest) or size * GROWTH > MAX_BYTES:
                break
            size *= GROWTH
        if network is not None and network.stats.unpadded > late and rank == src:
            log.warning("%s link %s -> %s: %d timed transfers outlasted their modeled time (the machine's own "
                        "transfer, or a busy core, was slower than the emulated link): the figures are the machine's "
                        "there", kind, cluster.devices[src].name, cluster.devices[dst].name,
                        network.stats.unpadded - late)
        alpha, beta = fit_alpha_beta(points)
        out.append(LinkProfile(kind=kind, src=cluster.devices[src].name, dst=cluster.devices[dst].name,
                               latency_s=alpha, seconds_per_byte=beta, points=points))
    return out


# a ring all-reduce over every device, per device: these sizes (bytes), median of the repeats
COLLECTIVE_BYTES = (1 << 14, 1 << 18, 1 << 22, 1 << 24)


def measure_collective(cluster: Cluster, rank: int, device: torch.device, repeats: int = 5,
                       on_size=None) -> Optional[LinkProfile]:
    """A ring all-reduce over every device (the default process group, rank order) at
    :data:`COLLECTIVE_BYTES` per device, each the median of ``repeats`` after an untimed one, every
    all-reduce after a barrier (as the ranks reach a step's gradient sync together): kind
    ``"collective"``, ``points`` the all-reduce seconds per size, and ``latency_s`` and
    ``seconds_per_byte`` one ring step's (``t = 2 (n - 1) (alpha + beta * b / n)`` on ``n`` devices),
    so the planner prices any ring with them as a floor under the cluster's links
    (``Network.collective_latency_us``, ``collective_gbps``). The real transport's time, unpadded: on
    emulated devices what the machine's own collectives cost beyond the emulated links (the runtime
    pads a collective to its modeled end, never shortens it), on real ones the links' with software
    overheads. Rank 0's figures, broadcast. None on one device (no collective)."""
    world = len(cluster.devices)
    if world < 2:
        return None
    points: dict[int, float] = {}
    for size in COLLECTIVE_BYTES:
        buffer = torch.zeros(size // 4, dtype=torch.float32, device=device)
        seconds = []
        for attempt in range(repeats + 1):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(buffer)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if attempt:
                seconds.append(time.perf_counter() - start)
        points[size] = float(np.median(seconds))
        if on_size is not None:
            on_size()
    shared = [points]
    dist.broadcast_object_list(shared, src=0)
    points = shared[0]
    steps = 2 * (world - 1)
    alpha, beta = fit_alpha_beta({max(size // world, 1): t / steps for size, t in points.items()})
    if beta <= 0:   # a machine so fast the per-byte term vanished: no bandwidth floor (the fit's beta must be > 0)
        beta = 1e-15
    return LinkProfile(kind="collective", src=cluster.devices[0].name, dst=cluster.devices[-1].name,
                       latency_s=alpha, seconds_per_byte=beta, points=points)


def _ping_pong(rank: int, src: int, dst: int, size: int, repeats: int, device: torch.device,
               network: Optional[NetworkEmulator], cluster: Cluster) -> Optional[float]:
    """The fastest one-way seconds of ``size`` bytes between ranks ``src`` and ``dst`` (on ``src``;
    None elsewhere, where nothing happens)."""
    if rank not in (src, dst):
        return None
    peer = dst if rank == src else src
    peer_device = cluster.devices[peer].name
    buffer = torch.zeros(size, dtype=torch.uint8, device=device)
    fastest = Fastest(repeats)
    another = True
    while another:
        start = time.perf_counter()
        if rank == src:
            another = fastest.more()
            buffer[0] = int(another)
            _send(buffer, peer, peer_device, network)
            _receive(buffer, peer, network)
        else:
            _receive(buffer, peer, network)
            another = bool(buffer[0].item())
            _send(buffer, peer, peer_device, network)
        fastest.add((time.perf_counter() - start) / 2)
    return fastest.seconds if rank == src else None


class Fastest:
    """The fastest of a ping-pong's exchanges and whether to time another: the first exchange is not
    timed (connections, buffers); then at least ``repeats`` are, then more until ``repeats`` in a row
    have left the fastest in place (faster by less than :data:`SETTLED`), never past
    ``MAX_ROUNDS_FACTOR * repeats``. :meth:`more` is asked before each exchange is sent, so the one
    then in flight is timed too."""

    def __init__(self, repeats: int):
        if repeats < 1:
            raise ValueError(f"Fastest: repeats must be >= 1, got {repeats}")
        self.repeats = repeats
        self.times: list[float] = []
        self.exchanges = 0
        self.still = 0           # timed exchanges in a row that left the fastest in place

    def add(self, seconds: float) -> None:
        if self.exchanges:
            fastest = self.seconds
            self.still = 0 if fastest is None or seconds < fastest * (1 - SETTLED) else self.still + 1
            self.times.append(seconds)
        self.exchanges += 1

    def more(self) -> bool:
        """Whether another exchange follows the one about to be sent (number ``self.exchanges``)."""
        if self.exchanges < self.repeats:
            return True
        return self.still < self.repeats and self.exchanges < MAX_ROUNDS_FACTOR * self.repeats

    @property
    def seconds(self) -> Optional[float]:
        return min(self.times) if self.times else None


def _send(tensor: torch.Tensor, peer: int, peer_device: str, network: Optional[NetworkEmulator]) -> None:
    ops = [dist.P2POp(dist.isend, tensor, peer, None, TAG)]
    if network is not None:   # priced and stamped by the sender, as runtime.parallel.pipeline's sends
        ops = network.stamp_sends(ops, [peer_device])
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _receive(tensor: torch.Tensor, peer: int, network: Optional[NetworkEmulator]) -> None:
    ops, arrival = [dist.P2POp(dist.irecv, tensor, peer, None, TAG)], None
    if network is not None:   # sleeps until the sender's modeled arrival
        ops, arrival = network.stamp_receives(ops)
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    if arrival is not None:
        arrival.wait()
