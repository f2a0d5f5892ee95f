"""Batch shares for data parallelism on unequal devices (Whale hardware-aware DP, Poplar).

Three pure functions over integer sample counts:

* :func:`proportional_shares`: shares proportional to speed that sum exactly to the total. Each
  device first gets the floor of its ideal share; every leftover sample then goes to the least
  utilised device, the one that would finish it soonest (``(share + 1) / speed`` smallest, Poplar's
  rule for the remainder). This is the makespan-optimal integer split and is monotone: a faster
  device never gets fewer samples than a slower one.
* :func:`balance_memory`: Whale's Algorithm 1, "memory-constraint load balancing". Devices whose
  share does not fit in memory are *peaks*, those with room are *valleys*; load moves, one sample at
  a time, from the peak with the highest memory utilisation to the valley with the lowest
  (flop utilisation, memory utilisation) until no peak is left or no valley can take more.
* :func:`accumulation_sizes`: Poplar's gradient accumulation when a device's share of the whole
  batch does not fit at once: its micro-batch size is the largest that fits (best throughput) and
  its last micro-batch takes the remainder, so devices may run different numbers of micro-batches.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Slot:
    """One data-parallel participant as the balancer sees it: relative speed (samples per unit
    time) and the most samples it can hold (``cap``; -1 when not even its weights fit)."""

    speed: float
    cap: int

    def __post_init__(self):
        if not self.speed > 0:
            raise ValueError(f"Slot.speed must be > 0, got {self.speed!r}")


class DoesNotFit(Exception):
    """The samples cannot be placed within the slots' memory; ``shortfall`` samples are left over."""

    def __init__(self, shortfall: int, capacity: int):
        super().__init__(f"{shortfall} samples do not fit (room for {capacity})")
        self.shortfall = shortfall
        self.capacity = capacity


def proportional_shares(total: int, speeds: Sequence[float], minimum: int = 0) -> list[int]:
    """Integers proportional to ``speeds``, each >= ``minimum``, summing exactly to ``total``."""
    n = len(speeds)
    if n == 0:
        raise ValueError("proportional_shares needs at least one device")
    if any(not s > 0 for s in speeds):
        raise ValueError(f"speeds must be > 0, got {list(speeds)}")
    if total < minimum * n:
        raise ValueError(f"cannot give {n} devices at least {minimum} of {total}")
    weight = sum(speeds)
    shares = [max(minimum, math.floor(total * s / weight)) for s in speeds]
    # raising small shares to the minimum may overshoot: take back from the most loaded
    while sum(shares) > total:
        i = max((i for i in range(n) if shares[i] > minimum), key=lambda i: (shares[i] / speeds[i], -i))
        shares[i] -= 1
    heap = [((shares[i] + 1) / speeds[i], i) for i in range(n)]
    heapq.heapify(heap)
    for _ in range(total - sum(shares)):
        _, i = heapq.heappop(heap)
        shares[i] += 1
        heapq.heappush(heap, ((shares[i] + 1) / speeds[i], i))
    return shares


def balance_memory(shares: Sequence[int], slots: Sequence[Slot], memory_util) -> list[int]:
    """Whale Algorithm 1: move samples off devices over their memory cap onto the least utilised
    devices with room. ``memory_util(i, samples)`` is device ``i``'s memory use / capacity.

    Raises :class:`DoesNotFit` when the peaks cannot all be relieved.
    """
    if any(s.cap < 0 for s in slots):
        raise ValueError("balance_memory: every slot must hold its weights (cap >= 0); check that first")
    shares = list(shares)
    peaks = {i for i, s in enumerate(slots) if shares[i] > s.cap}
    if not peaks:
        return shares
    valleys = [
        ((shares[i] + 1) / s.speed, memory_util(i, shares[i] + 1), i)
        for i, s in enumerate(slots)
        if shares[i] < s.cap
    ]
    heapq.heapify(valleys)
    while peaks and valleys:
        peak = max(peaks, key=lambda i: (memory_util(i, shares[i]), -i))
        _, _, valley = heapq.heappop(valleys)
        shares[peak] -= 1
        shares[valley] += 1
        if shares[peak] <= slots[peak].cap:
            peaks.discard(peak)
        if shares[valley] < slots[valley].cap:
            s = shares[valley]
            heapq.heappush(valleys, ((s + 1) / slots[valley].speed, memory_util(valley, s + 1), valley))
    if peaks:
        shortfall = sum(shares[i] - max(slots[i].cap, 0) for i in peaks)
        raise DoesNotFit(shortfall, sum(max(s.cap, 0) for s in slots))
    return shares


def balanced_shares(total: int, slots: Sequence[Slot], memory_util, minimum: int = 1) -> list[int]:
    """Speed-proportional shares of ``total`` (each >= ``minimum``), then memory-balanced."""
    shares = proportional_shares(total, [s.speed for s in slots], minimum)
    return balance_memory(shares, slots, memory_util)


def accumulation_sizes(share: int, cap: int) -> list[int]:
    """Poplar: micro-batch sizes for one device that processes ``share`` samples per step but holds
    at most ``cap`` at once: full micro-batches of ``min(cap, share)``, then the last batch size."""
    if cap < 1:
        raise DoesNotFit(share, 0)
    size = min(cap, share)
    steps = math.ceil(share / size)
    return [size] * (steps - 1) + [share - (steps - 1) * size]
