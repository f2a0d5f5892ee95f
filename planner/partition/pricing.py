"""Pricing a split of the pipeline partitioner (the model in :mod:`planner.partition.solve`).

:class:`Pricing` holds, per stage position and slot, the time and memory of every contiguous layer
range ``[first, last]`` as numpy matrices built from prefix sums; :func:`solve_order` runs the
exact dynamic program over them for one group order (least bottleneck, then the least sum of
squared stage times, or the least memory overflow when nothing fits) and :func:`assemble` prices a
chosen split into a :class:`~planner.partition.problem.Partition`. It is the one evaluator every
solver's answer goes through, so the greedy and ILP answers are compared on equal terms.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from planner.devices.memory import FIT_TOLERANCE
from planner.partition.problem import DeviceMemory, Partition, PartitionProblem, StageAssignment

TOLERANCE = FIT_TOLERANCE   # relative memory overflow still counted as fitting (the memory model's)


class Pricing:
    """Cost matrices ``[first, last]`` of one stage position on one slot, built from prefix sums."""

    def __init__(self, p: PartitionProblem):
        self.p = p
        L = len(p.layers)
        def prefix(values):
            return np.concatenate(([0.0], np.cumsum(np.asarray(values, dtype=float))))
        self.flops = prefix([l.flops for l in p.layers])
        self.params = prefix([l.param_bytes for l in p.layers])
        self.gradients = prefix([l.gradient_bytes for l in p.layers])
        self.optimizer = prefix([l.optimizer_bytes for l in p.layers])
        self.act = prefix([l.activation_bytes for l in p.layers])
        cut = np.array([l.cut_bytes for l in p.layers], dtype=float)
        self.cut_in = np.concatenate(([0.0], cut[:-1]))   # received by a stage starting at i
        self.cut_out = np.concatenate((cut[:-1], [0.0]))  # sent by a stage ending at j
        i, j = np.meshgrid(np.arange(L), np.arange(L), indexing="ij")
        self.invalid = j < i
        pinned = np.full(L, -1)
        for layer, stage in p.pinned.items():
            pinned[layer] = stage
        self.pinned = pinned
        self._cache: dict[tuple[int, int], np.ndarray] = {}

    def _range(self, prefix: np.ndarray) -> np.ndarray:
        return prefix[None, 1:] - prefix[:-1, None]

    def _cuts(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        S = len(self.p.slots)
        cin = self.cut_in[:, None] if k > 0 else np.zeros((1, 1))
        cout = self.cut_out[None, :] if k < S - 1 else np.zeros((1, 1))
        return cin, cout

    def time(self, k: int, g: int) -> np.ndarray:
        p, S = self.p, len(self.p.slots)
        t = p.micro_batch * self._range(self.flops) / p.slots[g].flops_per_s
        cin, cout = self._cuts(k)
        if k < S - 1:
            link = p.links[k]
            t = t + link.latency_s + p.micro_batch * cout / link.bandwidth_bytes_per_s
        if k > 0:
            link = p.links[k - 1]
            t = t + link.latency_s + p.micro_batch * cin / link.bandwidth_bytes_per_s
        return t

    def need(self, k: int, d: DeviceMemory) -> np.ndarray:
        """Bytes device ``d`` needs at position ``k`` for every range (the memory model,
        :class:`~planner.devices.memory.MemoryTerms`, over every range at once)."""
        cin, cout = self._cuts(k)
        per_sample = self._range(self.act) + cin + cout
        terms = d.terms(self._range(self.params), self._range(self.gradients), self._range(self.optimizer),
                        per_sample, self.p.in_flight[k])
        return terms.total(self.p.micro_batch)

    def overflow(self, k: int, g: int) -> np.ndarray:
        """Worst relative overflow over the slot's devices (need / capacity - 1; <= 0 fits)."""
        return np.max([self.need(k, d) / d.capacity_bytes - 1.0 for d in self.p.slots[g].memory_classes], axis=0)

    def forbidden(self, k: int) -> np.ndarray:
        """Ranges stage ``k`` may not take: reversed, or holding a layer pinned elsewhere."""
        elsewhere = np.concatenate(([0], np.cumsum((self.pinned >= 0) & (self.pinned != k))))
        return self.invalid | (self._range(elsewhere.astype(float)) > 0)

    def cost(self, k: int, g: int) -> np.ndarray:
        """Stage time where the range fits and is allowed, else inf (cached: order search reuses it)."""
        key = (k, g)
        if key not in self._cache:
            c = self.time(k, g)
            c[(self.overflow(k, g) > TOLERANCE) | self.forbidden(k)] = np.inf
            self._cache[key] = c
        return self._cache[key]


def _dp(mats: Sequence[np.ndarray], combine=np.maximum) -> tuple[float, list[int]]:
    """Best split of layers ``0..L-1`` into ``len(mats)`` contiguous non-empty ranges, where
    ``mats[k][i, j]`` prices stage ``k`` running ``i..j`` and ``combine`` folds stage prices
    (max: bottleneck; add: sum). Returns the optimum and each stage's first layer."""
    L = mats[0].shape[0]
    f = mats[0][0, :].copy()
    choices = []
    for m in mats[1:]:
        cand = combine(f[:-1, None], m[1:, :])  # stage k runs i..j after stages 0..k-1 ran 0..i-1
        arg = np.argmin(cand, axis=0)
        f = cand[arg, np.arange(L)]
        choices.append(arg + 1)
    starts, j = [0] * len(mats), L - 1
    for k in range(len(mats) - 1, 0, -1):
        starts[k] = int(choices[k - 1][j])
        j = starts[k] - 1
    return float(f[L - 1]), starts


@dataclass(frozen=True)
class Score:
    """How good a group order is, compared lexicographically: memory overflow of its least
    overflowing split (0 when one fits), then the least bottleneck, then the sum of squared stage
    times of the most balanced optimal split. The later keys give the order search a direction on
    plateaus, where a move leaves the slowest stage alone but relieves the others."""

    excess: float
    bottleneck: float
    squares: float

    def better_than(self, other: "Score") -> bool:
        for mine, theirs in ((self.excess, other.excess), (self.bottleneck, other.bottleneck), (self.squares, other.squares)):
            if mine < theirs * (1 - 1e-9):
                return True
            if mine > theirs * (1 + 1e-9):
                return False
        return False


def solve_order(pricing: Pricing, order: Sequence[int]) -> tuple[Score, list[int]]:
    """Least bottleneck for a fixed order; among optimal splits the least sum of squared times."""
    mats = [pricing.cost(k, g) for k, g in enumerate(order)]
    best, starts = _dp(mats)
    if not math.isfinite(best):
        excess, starts = _dp([np.where(pricing.forbidden(k), np.inf, pricing.overflow(k, g)) for k, g in enumerate(order)])
        return Score(max(excess, 0.0), math.inf, math.inf), starts
    bound = best * (1 + 1e-9) + 1e-15
    squares, balanced = _dp([np.where(m <= bound, m * m, np.inf) for m in mats], np.add)
    return Score(0.0, best, squares), balanced


def assemble(p: PartitionProblem, order: Sequence[int], starts: Sequence[int], solver: str,
             gap: Optional[float]) -> Partition:
    """Price a given split exactly (the one evaluator every solver's answer goes through)."""
    pricing = Pricing(p)
    L = len(p.layers)
    ends = [s - 1 for s in starts[1:]] + [L - 1]
    stages = []
    for k, (g, i, j) in enumerate(zip(order, starts, ends)):
        compute = p.micro_batch * (pricing.flops[j + 1] - pricing.flops[i]) / p.slots[g].flops_per_s
        total = float(pricing.time(k, g)[i, j])
        stages.append(StageAssignment(k, g, p.slots[g].name, i, j, float(compute), total - float(compute),
                                      float(pricing.overflow(k, g)[i, j]) + 1.0))
    return Partition(tuple(stages), max(s.time_s for s in stages), solver, gap)

