"""Batch shares for data parallelism on unequal devices (Whale hardware-aware DP, Poplar).

Three pure functions over integer sample counts:

* :func:`proportional_shares`: shares proportional to speed that sum exactly to the total, the
  one integer split in proportion of the planner (the sample layout's short batches and the
  placement's device budgets call it too). Each device first gets the floor of its ideal share;
  every leftover sample then goes to the least utilised device, the one that would finish it
  soonest (``(share + 1) / speed`` smallest, Poplar's rule for the remainder). This is the
  makespan-optimal integer split and is monotone: a faster device never gets fewer samples than a
  slower one. ``leftover="largest_remainder"`` gives leftovers to the largest remainders instead
  (every share within one of its ideal, zero weights allowed).
* :func:`balance_memory`: Whale's Algorithm 1, "memory-constraint load balancing". Devices whose
  share does not fit in memory are *peaks*, those with room are *valleys*; load moves, one sample at
  a time, from the peak with the highest memory utilisation to the valley with the lowest
  (flop utilisation, memory utilisation) until no peak is left or no valley can take more.
  A slot's fixed time (``Slot.fixed``: the optimizer's update, launches; time spent whatever the
  share) counts in both: the shares equalise each device's whole step, not its work alone.
* :func:`accumulation_sizes`: Poplar's gradient accumulation when a device's share of the whole
  batch does not fit at once: its micro-batch size is the largest that fits (best throughput) and
  its last micro-batch takes the remainder, so devices may run different numbers of micro-batches.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class Slot:
    """One data-parallel participant as the balancer sees it: relative speed (samples per unit
    time), the most samples it can hold (``cap``; -1 when not even its weights fit) and the time
    it spends whatever its share (``fixed``, in the units of ``1 / speed``: the optimizer's update,
    launches). The partitioner's device group for a pipeline stage is
    :class:`planner.partition.problem.StageSlot`."""

    speed: float
    cap: int
    fixed: float = 0.0

    def __post_init__(self):
        if not self.speed > 0:
            raise ValueError(f"Slot.speed must be > 0, got {self.speed!r}")
        if not (self.fixed >= 0 and math.isfinite(self.fixed)):
            raise ValueError(f"Slot.fixed must be a finite time >= 0, got {self.fixed!r}")


class DoesNotFit(Exception):
    """The samples cannot be placed within the slots' memory; ``shortfall`` samples are left over."""

    def __init__(self, shortfall: int, capacity: int):
        super().__init__(f"{shortfall} samples do not fit (room for {capacity})")
        self.shortfall = shortfall
        self.capacity = capacity


SOONEST, LARGEST_REMAINDER = "soonest", "largest_remainder"
LEFTOVER_RULES = (SOONEST, LARGEST_REMAINDER)


def proportional_shares(total: int, speeds: Sequence[float], minimum: int = 0, *, leftover: str = SOONEST,
                        ties: Optional[Sequence] = None, fixed: Optional[Sequence[float]] = None) -> list[int]:
    """Integers proportional to ``speeds``, each >= ``minimum``, summing exactly to ``total``.

    ``fixed`` (``"soonest"`` only): each device's time whatever its share, in the units of
    ``1 / speed``. The shares then equalise the whole time ``fixed + share / speed`` instead of
    ``share / speed`` (:func:`_finishing_together`); all zeros or None is the rule below.

    Each first gets the floor of its ideal share ``total * speed / sum(speeds)`` (at least
    ``minimum``); the leftovers then go one at a time by ``leftover``:

    * ``"soonest"`` (the default): to the one that would finish it soonest, ``(share + 1) / speed``
      smallest (Poplar's rule: makespan-optimal and monotone). Every speed must be > 0.
    * ``"largest_remainder"``: to the largest ``ideal - share`` (Hamilton's method: every share is
      within one of its ideal). Speeds are weights >= 0, one of them positive; a zero gets nothing
      beyond ``minimum``.

    Ties go to the lower index, or to the smaller ``ties[i]`` when given. Exact for any total
    (beyond 2**53 the floors are corrected until they sum right).
    """
    n = len(speeds)
    if n == 0:
        raise ValueError("proportional_shares needs at least one device")
    if leftover == SOONEST:
        if any(not s > 0 for s in speeds):
            raise ValueError(f"speeds must be > 0, got {list(speeds)}")
    elif leftover == LARGEST_REMAINDER:
        if any(not s >= 0 for s in speeds) or not any(s > 0 for s in speeds):
            raise ValueError(f"weights must be >= 0 with a positive one, got {list(speeds)}")
    else:
        raise ValueError(f"leftover must be one of {LEFTOVER_RULES}, got {leftover!r}")
    if total < minimum * n:
        raise ValueError(f"cannot give {n} devices at least {minimum} of {total}")
    if fixed is not None and any(fixed):
        if leftover != SOONEST or len(fixed) != n or any(not (f >= 0 and math.isfinite(f)) for f in fixed):
            raise ValueError(f"fixed times need the soonest rule and one finite time >= 0 per device, got {list(fixed)}")
        return _finishing_together(total, speeds, minimum, fixed, ties)
    weight = sum(speeds)
    shares = [math.floor(total * s / weight) for s in speeds]
    # beyond 2**53 samples the float shares miss the total by more than one per device: share
    # the difference out the same way until they do not (each round shrinks it ~2**-50-fold). Before
    # the minimum: correcting clamped shares would cut a faster device below a slower one
    while abs(total - sum(shares)) > n:
        rest = total - sum(shares)
        shares = [share + math.floor(rest * s / weight) for share, s in zip(shares, speeds)]
    shares = [max(minimum, share) for share in shares]
    # raising small shares to the minimum may overshoot: take back from the most loaded
    while sum(shares) > total:
        i = max((i for i in range(n) if shares[i] > minimum), key=lambda i: (shares[i] / speeds[i], -i))
        shares[i] -= 1
    tie = range(n) if ties is None else ties
    if leftover == SOONEST:
        key = lambda i: ((shares[i] + 1) / speeds[i], tie[i])  # noqa: E731
    else:
        ideal = [total * s / weight for s in speeds]
        key = lambda i: (shares[i] - ideal[i], tie[i])  # noqa: E731
    return _give_leftovers(shares, total, key)


def _give_leftovers(shares: list[int], total: int, key) -> list[int]:
    """``shares`` raised to sum to ``total``, one sample at a time to the device with the smallest
    ``key(i)`` (re-read after each sample it takes)."""
    heap = [(*key(i), i) for i in range(len(shares))]
    heapq.heapify(heap)
    for _ in range(total - sum(shares)):
        i = heapq.heappop(heap)[-1]
        shares[i] += 1
        heapq.heappush(heap, (*key(i), i))
    return shares


def _finishing_together(total: int, speeds: Sequence[float], minimum: int, fixed: Sequence[float],
                        ties: Optional[Sequence]) -> list[int]:
    """:func:`proportional_shares` with fixed times: the continuous shares that end together,
    ``(T - fixed[i]) * speed[i]`` summing to ``total`` (a device whose fixed time alone passes
    ``T`` held at ``minimum``, ``T`` found again without it), floored; every leftover then to the
    device that would end it soonest, ``fixed + (share + 1) / speed`` smallest. Makespan-optimal
    for the integer shares, as the rule without fixed times."""
    n = len(speeds)
    free, level = set(range(n)), 0.0
    while free:   # at most n rounds: each drops a device whose share would fall below the minimum
        rest = total - minimum * (n - len(free))
        level = (rest + math.fsum(fixed[i] * speeds[i] for i in free)) / math.fsum(speeds[i] for i in free)
        low = {i for i in free if (level - fixed[i]) * speeds[i] < minimum}
        if not low:
            break
        free -= low
    shares = [max(minimum, math.floor((level - fixed[i]) * speeds[i])) if i in free else minimum for i in range(n)]
    while sum(shares) > total:   # rounding at the level's edge: take back from the last to end
        i = max((i for i in range(n) if shares[i] > minimum), key=lambda i: (fixed[i] + shares[i] / speeds[i], -i))
        shares[i] -= 1
    tie = range(n) if ties is None else ties
    return _give_leftovers(shares, total, lambda i: (fixed[i] + (shares[i] + 1) / speeds[i], tie[i]))


def balance_memory(shares: Sequence[int], slots: Sequence[Slot], memory_util) -> list[int]:
    """Whale Algorithm 1: move samples off devices over their memory cap onto the least utilised
    devices with room. ``memory_util(i, samples)`` is device ``i``'s memory use / capacity (the
    planner's come from :mod:`planner.devices.memory`: ``MemoryTerms.total`` over the capacity,
    with ``MemoryTerms.max_samples`` as the slots' caps).

    Every peak ends at its cap; each moved sample goes to the valley that would finish it soonest
    (``fixed + (share + 1) / speed``, then memory utilisation), so the valleys receive the moved samples
    with the smallest such keys. Those below a threshold are placed in bulk
    (:func:`_fill_below`) and the last ones one by one, so the work is bounded by the number of
    devices, not by the number of samples moved (a batch of 10**12 samples moves as fast as 64).

    Raises :class:`DoesNotFit` when the peaks cannot all be relieved.
    """
    if any(s.cap < 0 for s in slots):
        raise ValueError("balance_memory: every slot must hold its weights (cap >= 0); check that first")
    shares = list(shares)
    peaks = [i for i, s in enumerate(slots) if shares[i] > s.cap]
    if not peaks:
        return shares
    excess = sum(shares[i] - slots[i].cap for i in peaks)
    valleys = [i for i, s in enumerate(slots) if shares[i] < s.cap]
    room = sum(slots[i].cap - shares[i] for i in valleys)
    if excess > room:
        raise DoesNotFit(excess - room, sum(max(s.cap, 0) for s in slots))
    for i in peaks:
        shares[i] = slots[i].cap
    moved = _fill_below(shares, slots, valleys, excess)
    heap = [(slots[i].fixed + (shares[i] + 1) / slots[i].speed, memory_util(i, shares[i] + 1), i)
            for i in valleys if shares[i] < slots[i].cap]
    heapq.heapify(heap)
    for _ in range(excess - moved):
        _, _, valley = heapq.heappop(heap)
        shares[valley] += 1
        if shares[valley] < slots[valley].cap:
            s = shares[valley]
            heapq.heappush(heap, (slots[valley].fixed + (s + 1) / slots[valley].speed, memory_util(valley, s + 1),
                                  valley))
    return shares


def _fill_below(shares: list[int], slots: Sequence[Slot], valleys: Sequence[int], excess: int) -> int:
    """Give the valleys, in bulk, every sample whose key ``fixed + k / speed`` (its ``k``-th sample) lies
    below the largest threshold at which they take at most ``excess - len(valleys)`` samples; those
    are among the ``excess`` smallest keys, so one-by-one placement would have placed them too.
    Returns how many samples were placed (0 for small ``excess``: the caller places them all)."""
    budget = excess - len(valleys)
    if budget <= 0:
        return 0

    def taken(threshold: float) -> list[int]:
        return [min(slots[i].cap, max(shares[i], math.ceil((threshold - slots[i].fixed) * slots[i].speed) - 1))
                - shares[i] for i in valleys]

    low, high = 0.0, max(slots[i].fixed + (slots[i].cap + 1) / slots[i].speed for i in valleys)
    for _ in range(200):
        middle = (low + high) / 2
        if middle in (low, high):
            break
        if sum(taken(middle)) <= budget:
            low = middle
        else:
            high = middle
    amounts = taken(low)
    for i, n in zip(valleys, amounts):
        shares[i] += n
    return sum(amounts)


def balanced_shares(total: int, slots: Sequence[Slot], memory_util, minimum: int = 1) -> list[int]:
    """Speed-proportional shares of ``total`` (each >= ``minimum``; equalising each slot's fixed time
    plus its share over its speed), then memory-balanced."""
    shares = proportional_shares(total, [s.speed for s in slots], minimum, fixed=[s.fixed for s in slots])
    return balance_memory(shares, slots, memory_util)


def accumulation_sizes(share: int, cap: int) -> list[int]:
    """Poplar: micro-batch sizes for one device that processes ``share`` samples per step but holds
    at most ``cap`` at once: full micro-batches of ``min(cap, share)``, then the last batch size."""
    if cap < 1:
        raise DoesNotFit(share, 0)
    size = min(cap, share)
    steps = math.ceil(share / size)
    return [size] * (steps - 1) + [share - (steps - 1) * size]
