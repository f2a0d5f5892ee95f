"""FlexTP's decisions for tensor-parallel stragglers: how much to prune (Eq. 1), how to split one
straggler's excess between migration and resizing (Eq. 2), which of several stragglers migrate
(Eq. 3) and the whole SEMI-migration choice (Algorithm 2). Wang et al., "FlexTP",
``/work/shared/papers/000_017342dbf97b3232.txt`` sections III-A and IV.

Pure functions of measured per-rank times (no torch.distributed): every rank of a tensor-parallel
group calls them with the same all-gathered measurements and gets the same decision, so no rank
needs to broadcast it. Why not a general solver: the paper's rules are closed forms plus one scalar
root (bisection on Eq. 2), cheap enough to run at every step boundary and easy to audit.

Invariants: the inputs are per-rank lists of equal length (index = tensor-parallel rank); every
returned fraction is in ``[0, 1]``, resizing ratios in ``[0, max_gamma]``; the result depends
only on the inputs (ties are broken by rank).

Where the paper is ambiguous, and what is chosen here:

* Eq. (1) can exceed 1 or be negative; it is clipped to ``[0, max_gamma]`` (a matmul pruned of
  every column does no work and learns nothing).
* Algorithm 2 line 4 counts every rank slower than ``T_min`` as a straggler; measured times are
  noisy, so ``tolerance`` (default 0, the paper's rule) lets a rank within ``T_min * (1 + tolerance)``
  count as normal.
* Algorithm 2 lines 10-11 write ``migration(L * beta)`` and ``zero-resizing(L * (1 - beta))``, but
  Eq. (2) splits the excess ``L * gamma``: the straggler migrates ``gamma * beta`` of its columns
  and prunes ``gamma * (1 - beta)`` of them (the reading that makes the two sides of Eq. 2 the
  quantities actually moved and pruned).
* Line 8 (``if T_i = T_min``) reads as "for the straggler and every normal task alike": all tasks
  run the same decision; it is computed once here.
* Eq. (3) writes ``L_i(x)`` inside the sum of ``Gamma(x)``; the sum runs over the migrating tasks
  ``k``, so ``L_k`` (each one's own columns) is used.
* Line 20 (``T_i >= T_x``) would let ties with the x-th task migrate too; here exactly the first
  ``x`` tasks of the descending order (ties by rank) migrate, the set Eq. (3) was evaluated for.
* Lines 21/23 migrate or prune ``L * gamma_i`` with ``gamma_i`` from Eq. (1) against ``T_min``;
  migration fractions are clipped to ``[0, 1]``, resizing ratios to ``[0, max_gamma]``.
* Line 1's pre-test measures time only (Omega, Phi), so Eq. (2) never weighs accuracy, though the
  paper's aim is "a good balance between accuracy loss and runtime latency". Here the pre-test
  (``runtime.balance.semi_pretest``) may also price resizing's loss (``SemiCosts.loss``), and the
  single-straggler branch then resizes at most :func:`resize_bound`'s columns, migrating the rest
  (the rest is exact). Without it (``loss=None``) Eq. (2) decides alone, as written.
"""
from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

from whalelike.errors import WhaleError

Cost = Callable[[float], float]


# -- cost functions fitted from measured samples ------------------------------------------------------
def _check_samples(what: str, samples: Sequence[tuple[float, float]], least: int) -> list[tuple[float, float]]:
    points = sorted((float(x), float(cost)) for x, cost in samples)
    if len(points) < least:
        raise WhaleError(f"{what}: needs at least {least} (x, cost) samples, got {len(points)}; measure more sizes")
    if any(not math.isfinite(x) or not math.isfinite(c) for x, c in points):
        raise WhaleError(f"{what}: samples must be finite numbers, got {points}")
    if len({x for x, _ in points}) != len(points):
        raise WhaleError(f"{what}: two samples at the same x in {points}; average them first")
    return points


@dataclass(frozen=True)
class LinearCost:
    """``cost(x) = intercept + slope * x`` (least squares over the samples)."""

    intercept: float
    slope: float

    @classmethod
    def fit(cls, samples: Sequence[tuple[float, float]]) -> "LinearCost":
        points = _check_samples("LinearCost.fit", samples, 2)
        count = len(points)
        mean_x = sum(x for x, _ in points) / count
        mean_c = sum(c for _, c in points) / count
        spread = sum((x - mean_x) ** 2 for x, _ in points)
        slope = sum((x - mean_x) * (c - mean_c) for x, c in points) / spread
        return cls(mean_c - slope * mean_x, slope)

    def __call__(self, x: float) -> float:
        return self.intercept + self.slope * x


@dataclass(frozen=True)
class PiecewiseLinearCost:
    """Linear interpolation between measured ``(x, cost)`` points, extended linearly past the ends
    (the paper: "we extract several sampling points from history statistics to simulate the curve")."""

    points: tuple[tuple[float, float], ...]

    @classmethod
    def fit(cls, samples: Sequence[tuple[float, float]]) -> "PiecewiseLinearCost":
        return cls(tuple(_check_samples("PiecewiseLinearCost.fit", samples, 2)))

    def __call__(self, x: float) -> float:
        xs = [p[0] for p in self.points]
        right = min(max(bisect_right(xs, x), 1), len(xs) - 1)
        (x0, c0), (x1, c1) = self.points[right - 1], self.points[right]
        return c0 + (c1 - c0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class SemiCosts:
    """The pre-tested costs of Algorithm 2 line 1, all in seconds, arguments in columns.

    ``omega1``: the straggler's fixed cost of resizing (allocating the pruned submatrices);
    ``omega2(n)``: its cost of extracting ``n`` pruned columns; ``phi1(n)``: the communication
    cost of migrating ``n`` columns (send and collect); ``phi2(n)``: a normal task's cost of
    computing ``n`` migrated columns.

    The pre-test also prices resizing in accuracy (migration is exact, so it costs none):
    ``loss(n)`` is the relative increase of the loss when the straggler prunes ``n`` of its columns
    (measured on a few batches, ``runtime.balance.semi_pretest``), and ``loss_budget`` the most of
    it a run accepts. Eq. (2) alone weighs time only; with ``loss`` given, the single-straggler
    branch resizes at most :func:`resize_bound`'s columns and migrates the rest
    (``beta >= 1 - bound / (L * gamma)``). Without it (None) accuracy is not priced.
    """

    omega1: float
    omega2: Cost
    phi1: Cost
    phi2: Cost
    loss: Optional[Cost] = None          # resizing's accuracy cost: relative loss increase at n pruned columns
    loss_budget: float = math.inf        # the most ``loss`` may reach; resizing past it migrates instead

    @classmethod
    def from_step(cls, matmul_times: Sequence[float], columns: Sequence[float]) -> "SemiCosts":
        """The costs one step's measurements give without a pre-test: a receiver computes a migrated
        column in the fastest rank's matmul time per column (``phi2``, the paper: "its speed L_y/T_y
        is available"); pruning, its allocation and the sending are priced at 0 (``omega1``,
        ``omega2``, ``phi1``: nothing measures them). With these, Eq. (2) gives ``beta = 0``: a
        single straggler is resized only. Pass measured costs for a split (the Engine does, from
        ``runtime.balance.semi_pretest``, under policy ``"semi"``)."""
        per_column = min(m / c for m, c in zip(matmul_times, columns))
        return cls(0.0, lambda n: 0.0, lambda n: 0.0, lambda n: n * per_column)


# -- Eq. (1) ------------------------------------------------------------------------------------------
def _check_times(times: Sequence[float], matmul_times: Sequence[float]) -> tuple[list[float], list[float]]:
    times, matmul_times = [float(t) for t in times], [float(m) for m in matmul_times]
    if not times:
        raise WhaleError("semi_migration: no step times given; pass one measured time per tensor-parallel rank")
    if len(times) != len(matmul_times):
        raise WhaleError(f"semi_migration: {len(times)} step times but {len(matmul_times)} matmul times; "
                         "pass one of each per tensor-parallel rank")
    for what, values in (("step times", times), ("matmul times", matmul_times)):
        if any(not math.isfinite(v) or v < 0 for v in values):
            raise WhaleError(f"semi_migration: {what} must be finite and >= 0 seconds, got {values}")
    return times, matmul_times


def pruning_ratio(time: float, reference: float, matmul_time: float, max_gamma: float = 0.9) -> float:
    """Eq. (1): the fraction of the inner dimension to prune so that a rank taking ``time`` per
    step, ``matmul_time`` of it in matmuls, finishes in ``reference`` (``T_avg`` for ZERO-resizing
    alone, ``T_min`` under SEMI-migration): ``(time - reference) / matmul_time`` in ``[0, max_gamma]``."""
    if not 0.0 <= max_gamma <= 1.0:
        raise WhaleError(f"pruning_ratio: max_gamma must be in [0, 1], got {max_gamma}")
    excess = time - reference
    if excess <= 0:
        return 0.0
    if matmul_time <= 0:
        raise WhaleError(f"pruning_ratio: a rank {excess:.3g}s slower than the reference spent {matmul_time}s in "
                         "matmuls, so pruning cannot help it; record the matmul time (matmul_s) of each step")
    return min(excess / matmul_time, max_gamma)


def pruning_ratios(times: Sequence[float], matmul_times: Sequence[float], reference: str = "mean",
                   max_gamma: float = 0.9) -> list[float]:
    """Eq. (1) for every rank against the mean (``"mean"``, section III-A) or the minimum
    (``"min"``, section IV-B) of ``times``."""
    times, matmul_times = _check_times(times, matmul_times)
    if reference not in ("mean", "min"):
        raise WhaleError(f"pruning_ratios: reference must be 'mean' or 'min', got {reference!r}")
    target = sum(times) / len(times) if reference == "mean" else min(times)
    return [pruning_ratio(t, target, m, max_gamma) for t, m in zip(times, matmul_times)]


def unresized(times: Sequence[float], matmul_times: Sequence[float],
              pruned_work: Sequence[float]) -> tuple[list[float], list[float]]:
    """The step and matmul times each rank would have measured without ZERO-resizing, from what it
    measured while ``pruned_work[i]`` of its matmul FLOPs were pruned (``ZeroResizer.pruned_work``):
    ``M = M' / (1 - p)``, ``T = T' + M - M'``. Feed these to Eq. (1) while resizing is on, or a
    resized straggler looks healthy, gets ``gamma = 0`` and slows down again."""
    times, matmul_times = _check_times(times, matmul_times)
    if len(pruned_work) != len(times) or any(not 0 <= p < 1 for p in pruned_work):
        raise WhaleError(f"unresized: pruned_work must be one fraction in [0, 1) per rank ({len(times)}), "
                         f"got {list(pruned_work)}")
    full = [m / (1.0 - p) for m, p in zip(matmul_times, pruned_work)]
    return [t + f - m for t, f, m in zip(times, full, matmul_times)], full


# -- decisions ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SemiDecision:
    """What each tensor-parallel rank does next: ``migrate[rank]`` is the fraction of its columns
    (of the inner dimension it holds now) computed by the other ranks, ``resize[rank]`` the
    fraction of those same columns it prunes (ZERO-resizing). Ranks absent from both run as they are."""

    migrate: dict[int, float] = field(default_factory=dict)
    resize: dict[int, float] = field(default_factory=dict)
    beta: float | None = None            # Eq. (2)'s split, when the single-straggler branch ran
    migrating: int = 0                   # x of Eq. (3)
    stragglers: tuple[int, ...] = ()     # ranks slower than the criterion, slowest first
    # the accuracy bound of the single-straggler branch (resize_bound), when the costs price accuracy:
    # the most of its columns the straggler may prune, Algorithm 1's differentiated ratios included
    resize_cap: float | None = None

    def local_ratio(self, rank: int) -> float:
        """The ratio to pass to ``ZeroResizer.set_ratio`` on ``rank`` once its migrated columns
        are gone: its pruned columns as a fraction of the columns it still computes."""
        remaining = 1.0 - self.migrate.get(rank, 0.0)
        return 0.0 if remaining <= 0 else min(self.resize.get(rank, 0.0) / remaining, 1.0)


def resize_decision(times: Sequence[float], matmul_times: Sequence[float], max_gamma: float = 0.9,
                    tolerance: float = 0.0) -> SemiDecision:
    """The resize-only policy (Algorithm 1 lines 1-2): every rank slower than the mean by more than
    ``tolerance`` (a fraction: measured times of equal ranks differ in their last bits) prunes
    Eq. (1)'s ratio against ``T_avg``."""
    if tolerance < 0:
        raise WhaleError(f"resize_decision: tolerance must be >= 0, got {tolerance}")
    ratios = pruning_ratios(times, matmul_times, "mean", max_gamma)
    mean = sum(float(t) for t in times) / len(times)
    resize = {rank: gamma for rank, gamma in enumerate(ratios) if gamma > 0 and times[rank] > mean * (1.0 + tolerance)}
    slowest = tuple(sorted(resize, key=lambda rank: (-float(times[rank]), rank)))
    return SemiDecision(resize=resize, stragglers=slowest)


def solve_beta(straggler_columns: float, gamma: float, tp_size: int, costs: SemiCosts,
               tolerance: float = 1e-12) -> float:
    """Eq. (2): the share ``beta`` of the straggler's excess ``L * gamma`` columns to migrate, where
    ``omega1 + omega2(L*gamma*(1-beta)) = phi1(L*gamma*beta) + phi2(L*gamma*beta/(e-1))``.

    Bisection on ``[0, 1]`` of ``resizing cost - migration cost``: 0 when resizing everything is
    still the cheaper side, 1 when migrating everything is, else the root (the costs are measured,
    so any continuous functions with a sign change work; without one the cheaper end is chosen).
    """
    if tp_size < 2:
        raise WhaleError(f"solve_beta: migration needs a tensor-parallel group of at least 2 ranks, got {tp_size}")
    if straggler_columns <= 0 or not 0 <= gamma <= 1:
        raise WhaleError(f"solve_beta: needs columns > 0 and gamma in [0, 1], got {straggler_columns}, {gamma}")
    excess = straggler_columns * gamma

    def gap(beta: float) -> float:
        resizing = costs.omega1 + costs.omega2(excess * (1.0 - beta))
        migrating = costs.phi1(excess * beta) + costs.phi2(excess * beta / (tp_size - 1))
        return resizing - migrating

    low, high = 0.0, 1.0
    at_low, at_high = gap(low), gap(high)
    if at_low <= 0:
        return 0.0
    if at_high >= 0:
        return 1.0
    while high - low > tolerance:
        middle = 0.5 * (low + high)
        if gap(middle) > 0:
            low = middle
        else:
            high = middle
    return 0.5 * (low + high)


def resize_bound(costs: SemiCosts, excess: float) -> float:
    """The most columns ``n`` in ``[0, excess]`` whose measured accuracy cost ``costs.loss(n)``
    stays within ``costs.loss_budget``: ``excess`` when pruning all of it does
    (or when ``costs.loss`` is None: accuracy not priced), else the first crossing of the budget
    by bisection on ``[0, excess]`` (the cost is measured at a few sizes and interpolated,
    ``loss(0) = 0``; for a cost that is not monotone this is a crossing, not necessarily the first)."""
    if costs.loss is None or costs.loss(excess) <= costs.loss_budget:
        return excess
    if not costs.loss_budget >= 0:
        raise WhaleError(f"resize_bound: loss_budget must be >= 0 (a relative loss increase), got {costs.loss_budget}")
    low, high = 0.0, excess
    while high - low > 1e-9 * max(1.0, excess):
        middle = 0.5 * (low + high)
        if costs.loss(middle) <= costs.loss_budget:
            low = middle
        else:
            high = middle
    return low


def migrated_volume(order: Sequence[int], count: int, times: Sequence[float], columns: Sequence[float],
                    fastest: float) -> float:
    """Eq. (3)'s ``Gamma(x)``: columns the ``count`` slowest tasks of ``order`` hand over so each
    finishes in ``T_min``: ``sum_k L_k * (T_k - T_min) / T_k``."""
    return sum(columns[rank] * (times[rank] - fastest) / times[rank] for rank in order[:count])


def migration_gain(order: Sequence[int], count: int, times: Sequence[float], columns: Sequence[float],
                   phi1: Cost) -> float:
    """Eq. (3): ``f(x) = (T_x - T_min) - phi1(Gamma(x)) - max_{y > x} Gamma(x)/(e-x) * T_y/L_y``,
    the time the x-th slowest task saves by migrating minus the most any receiver pays."""
    fastest = times[order[-1]]
    volume = migrated_volume(order, count, times, columns, fastest)
    receivers = order[count:]
    share = volume / len(receivers)
    slowest_receiver = max(share * times[rank] / columns[rank] for rank in receivers)
    return (times[order[count - 1]] - fastest) - phi1(volume) - slowest_receiver


def semi_decision(times: Sequence[float], matmul_times: Sequence[float],
                  columns: Union[Sequence[float], float] = 1.0, costs: Optional[SemiCosts] = None,
                  max_gamma: float = 0.9, tolerance: float = 0.0) -> SemiDecision:
    """Algorithm 2: SEMI-migration for one tensor-parallel group.

    ``times[i]``: rank i's step time; ``matmul_times[i]``: its time in matmuls (Eq. 1's ``M_i``);
    ``columns``: the inner-dimension columns each rank computes (Eq. 3's ``L``; one number when
    equal, by default 1: every rank's shard is the unit); ``costs``: the pre-tested costs
    (default :meth:`SemiCosts.from_step`, which makes a single straggler resize only).
    Stragglers are ranks slower than ``T_min * (1 + tolerance)``. One straggler: Eq. (2) splits its
    excess between migration and resizing, and when ``costs.loss`` prices accuracy the resized part
    is cut to :func:`resize_bound` (the rest migrates). Several: the ``x`` slowest migrate (Eq. 3, the largest
    ``x`` whose ``f`` stays >= 0 scanning from the slowest), the rest resize, each by ``gamma_i``
    of Eq. (1) against ``T_min``.
    """
    times, matmul_times = _check_times(times, matmul_times)
    size = len(times)
    widths = [float(columns)] * size if isinstance(columns, (int, float)) else [float(c) for c in columns]
    if len(widths) != size or any(not w > 0 for w in widths):
        raise WhaleError(f"semi_decision: columns must be one positive count per rank ({size}), got {list(widths)}")
    if tolerance < 0:
        raise WhaleError(f"semi_decision: tolerance must be >= 0, got {tolerance}")
    order = sorted(range(size), key=lambda rank: (-times[rank], rank))   # descendSort, ties by rank
    fastest = times[order[-1]]
    if fastest <= 0:
        raise WhaleError(f"semi_decision: the fastest rank's step time is {fastest}s; measure a step before deciding")
    stragglers = tuple(rank for rank in order if times[rank] > fastest * (1.0 + tolerance))
    costs = SemiCosts.from_step(matmul_times, widths) if costs is None else costs
    gammas = {rank: pruning_ratio(times[rank], fastest, matmul_times[rank], 1.0) for rank in stragglers}
    if not stragglers:
        return SemiDecision()
    if len(stragglers) == 1:
        rank = stragglers[0]
        gamma = gammas[rank]
        beta = solve_beta(widths[rank], gamma, size, costs)
        bound = resize_bound(costs, widths[rank] * gamma) / widths[rank]   # columns -> a fraction
        if gamma > 0 and bound < gamma * (1.0 - beta):   # resizing that much costs more accuracy than allowed
            beta = 1.0 - bound / gamma
        resize = min(gamma * (1.0 - beta), max_gamma)
        return SemiDecision(migrate={rank: gamma * beta} if gamma * beta > 0 else {},
                            resize={rank: resize} if resize > 0 else {},
                            beta=beta, migrating=1 if gamma * beta > 0 else 0, stragglers=stragglers,
                            resize_cap=None if costs.loss is None else bound)
    migrating = len(stragglers)
    for count in range(1, len(stragglers) + 1):
        if migration_gain(order, count, times, widths, costs.phi1) < 0:
            migrating = count - 1
            break
    migrate = {rank: gammas[rank] for rank in stragglers[:migrating] if gammas[rank] > 0}
    resize = {rank: min(gammas[rank], max_gamma) for rank in stragglers[migrating:] if gammas[rank] > 0}
    return SemiDecision(migrate=migrate, resize=resize, migrating=migrating, stragglers=stragglers)
