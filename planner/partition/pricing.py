"""Pricing a split of the pipeline partitioner (the model in :mod:`planner.partition.solve`).

:class:`Pricing` holds, per stage position and slot, the time and memory of every contiguous layer
range ``[first, last]`` as numpy matrices built from prefix sums; :func:`solve_order` runs the
exact dynamic program over them for one group order (least bottleneck, then the least sum of
squared stage times, or the least memory overflow when nothing fits) and :func:`assemble` prices a
chosen split into a :class:`~planner.partition.problem.Partition`. It is the one evaluator every
solver's answer goes through, so the greedy and ILP answers are compared on equal terms.

Under the ``"step"`` objective the score of a split is the step itself (:meth:`Pricing.step_s`):
the schedule's action lists run on the stage times :meth:`Pricing.time` prices (each split into a
forward and a backward part), then each stage's gradient all-reduce in DDP's buckets, as the
simulator runs a plan. No dynamic program minimises a schedule's makespan, so :func:`_least_step`
searches: it starts from the least-bottleneck split, the least-sum split and the split of least
:meth:`~planner.partition.problem.PartitionProblem.pipelined_bound` (a lower bound of the step;
bisected on its bound ``E``, each test one dynamic program of the least time of the stages so far
among the splits that keep every stage within ``E``: a smaller prefix never hurts a later stage),
keeps the one the schedule runs fastest, then moves one stage boundary by one layer at a time while
that makes the step shorter. The answer is not claimed optimal (gap None), only never slower, by
this step, than the least-bottleneck split.

How close it comes to the simulator (the judge: :mod:`planner.candidates` keeps the plan it prices
fastest): on 100 random pipelines of 8-64 devices of 1-3 kinds and 2-8 replicate regions, the splits
of this objective simulated 0.5% slower on average than the best of the objectives tried, 5.9% at
worst; the least bottleneck 10% (worst 2.1x); a send priced as a delay between the stages instead of
in its sender's time 0.5% (worst 20%, and an uneven split on one device kind, see
:meth:`Pricing.step_s`). The links' lanes: :func:`planner.partition.stage_layers._link`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from planner.devices.memory import FIT_TOLERANCE
from planner.partition.problem import DeviceMemory, Partition, PartitionProblem, StageAssignment
from planner.schedule.actions import build_schedule
from planner.schedule.gradient_buckets import fill_buckets

TOLERANCE = FIT_TOLERANCE   # relative memory overflow still counted as fitting (the memory model's)


class Pricing:
    """Cost matrices ``[first, last]`` of one stage position on one slot, built from prefix sums."""

    def __init__(self, p: PartitionProblem):
        self.p = p
        L = len(p.layers)
        def prefix(values):
            return np.concatenate(([0.0], np.cumsum(np.asarray(values, dtype=float))))
        self.flops = prefix([l.flops for l in p.layers])
        self.forward_flops = prefix([l.forward_flops for l in p.layers])
        self.params = prefix([l.param_bytes for l in p.layers])
        self.gradients = prefix([l.gradient_bytes for l in p.layers])
        self.optimizer = prefix([l.optimizer_bytes for l in p.layers])
        self.act = prefix([l.activation_bytes for l in p.layers])
        self.foreach_update = prefix([l.foreach_update_bytes for l in p.layers])
        # stepping parameter by parameter, a range holds its largest layer's update temporaries: [i, j] their max
        each = np.array([l.update_bytes for l in p.layers], dtype=float)
        self.loop_update = np.maximum.accumulate(np.triu(np.broadcast_to(each, (L, L))), axis=1)
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

    def step_s(self, order: Sequence[int], starts: Sequence[int]) -> float:
        """The step of the split starting at ``starts`` on the slots ``order``: the schedule's action
        lists (``p.schedule`` over ``p.num_micro_batch`` micro-batches, :func:`_makespan`) on the
        stage times :meth:`time` prices, each split into its forward (the forward compute, then the
        activations' send) and its backward (the backward compute, then the gradients' send back); and
        each stage's gradient all-reduce in DDP's buckets
        (:func:`planner.schedule.gradient_buckets.fill_buckets`, each priced by its slot's ring), each
        bucket once the last backward has run its share of the gradient bytes and the bucket before it
        is done, as the simulator runs them.

        Why a send counts in its stage's time although the runtime's sends do not block (``isend``):
        a stage's data-parallel workers receive their slices one after another through the hosts'
        network interfaces, so the slowest worker of the next stage starts a transfer's time later;
        priced as a delay between the stages instead, the pipeline's later stages look idle enough
        to take more layers, and on one device kind an uneven split priced 3% faster simulated 5%
        slower (tests/test_planner_speed.py's one-kind case)."""
        p = self.p
        S = len(order)
        ends = [s - 1 for s in starts[1:]] + [len(p.layers) - 1]
        links = [p.links[k].latency_s + p.micro_batch * p.layers[ends[k]].cut_bytes / p.links[k].bandwidth_bytes_per_s
                 for k in range(S - 1)]
        forward, backward, sync = [], [], []
        for k, (g, i, j) in enumerate(zip(order, starts, ends)):
            slot = p.slots[g]
            fwd = p.micro_batch * (self.forward_flops[j + 1] - self.forward_flops[i]) / slot.flops_per_s
            bwd = p.micro_batch * (self.flops[j + 1] - self.flops[i]) / slot.flops_per_s - fwd
            forward.append(fwd + (links[k] if k < S - 1 else 0.0))
            backward.append(bwd + (links[k - 1] if k > 0 else 0.0))
            held = max(d.gradient_fraction for d in slot.devices) * (self.gradients[j + 1] - self.gradients[i])
            sync.append([] if held <= 0 or not (slot.allreduce_latency_s or slot.allreduce_s_per_byte) else
                        [(ready / held, slot.allreduce_latency_s + slot.allreduce_s_per_byte * nbytes)
                         for nbytes, ready in _buckets(held)])
        return _makespan(build_schedule(p.schedule, S, p.num_micro_batch), forward, backward, sync)

    def need(self, k: int, d: DeviceMemory) -> np.ndarray:
        """Bytes device ``d`` needs at position ``k`` for every range (the memory model,
        :class:`~planner.devices.memory.MemoryTerms`, over every range at once)."""
        cin, cout = self._cuts(k)
        per_sample = self._range(self.act) + cin + cout
        update = self._range(self.foreach_update) if d.foreach else self.loop_update
        terms = d.terms(self._range(self.params), self._range(self.gradients), self._range(self.optimizer),
                        per_sample, self.p.in_flight[k], update)
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


BISECTION_TOLERANCE = 1e-9   # relative: the pipelined bound's minimum is bisected to within this
MAX_BOUNDARY_MOVES = 256     # one-layer boundary moves the "step" search makes at most


@dataclass(frozen=True)
class Score:
    """How good a group order is, compared lexicographically: memory overflow of its least
    overflowing split (0 when one fits), then the problem's objective (the least bottleneck, or the
    shortest step found), then the sum of squared stage times of the chosen split. The later keys
    give the order search a direction on plateaus, where a move leaves the objective alone but
    relieves the other stages. ``exact``: the split is proven optimal for this order."""

    excess: float
    objective: float
    squares: float
    exact: bool = True

    def better_than(self, other: "Score") -> bool:
        for mine, theirs in ((self.excess, other.excess), (self.objective, other.objective), (self.squares, other.squares)):
            if mine < theirs * (1 - 1e-9):
                return True
            if mine > theirs * (1 + 1e-9):
                return False
        return False


def solve_order(pricing: Pricing, order: Sequence[int]) -> tuple[Score, list[int]]:
    """The best split for a fixed order under the problem's objective: the least bottleneck and,
    among those splits, the least sum of squared times; or the shortest step found (:func:`_least_step`)."""
    mats = [pricing.cost(k, g) for k, g in enumerate(order)]
    best, starts = _dp(mats)
    if not math.isfinite(best):
        excess, starts = _dp([np.where(pricing.forbidden(k), np.inf, pricing.overflow(k, g)) for k, g in enumerate(order)])
        return Score(max(excess, 0.0), math.inf, math.inf), starts
    bound = best * (1 + 1e-9) + 1e-15
    squares, balanced = _dp([np.where(m <= bound, m * m, np.inf) for m in mats], np.add)
    if pricing.p.objective == "bottleneck":
        return Score(0.0, best, squares), balanced
    return _least_step(pricing, order, mats, best, balanced)


def _buckets(nbytes: float) -> list[tuple[float, float]]:
    """DDP's buckets of ``nbytes`` of gradients: (bytes, cumulative bytes when it is ready)."""
    out, done = [], 0.0
    for size, _ in fill_buckets([(1.0, nbytes)]):
        done += size
        out.append((size, done))
    return out


def _makespan(actions, forward: Sequence[float], backward: Sequence[float],
              sync: Sequence[Sequence[tuple[float, float]]] = ()) -> float:
    """When the last action of ``actions`` (per stage, in order; compute actions) ends: forward ``i``
    of stage ``k`` after forward ``i`` of stage ``k - 1``; a backward ``i`` (whole, or its input half)
    after the backward (or input half) ``i`` of stage ``k + 1`` (the last stage: after its own forward
    ``i``); a weight half when reached; each stage one action at a time. A split backward's input half
    takes ``planner.schedule.program.input_share``'s share of it (none on the first stage, which
    nothing feeds; half on the others), the weight half the rest. Then each stage's gradient buckets
    ``sync[k]`` (ready fraction of its last action, all-reduce seconds), one after another, each from
    when its share of that action has run. The schedules are deadlock-free
    (:mod:`planner.schedule.deadlock`), so every sweep over the stages runs at least one action."""
    S = len(actions)
    took = {"F": list(forward), "B": list(backward),
            "BI": [b * (0.5 if k else 0.0) for k, b in enumerate(backward)],
            "BW": [b * (0.5 if k else 1.0) for k, b in enumerate(backward)]}
    done: dict[tuple[str, int, int], float] = {}   # ("F" | "B", stage, micro-batch): values, input gradients
    free, position, last_start = [0.0] * S, [0] * S, [0.0] * S
    left = sum(len(a) for a in actions)
    while left:
        before = left
        for k in range(S):
            while position[k] < len(actions[k]):
                a = actions[k][position[k]]
                if a.kind == "F":
                    ready = 0.0 if k == 0 else done.get(("F", k - 1, a.micro_batch))
                elif a.kind == "BW":
                    ready = 0.0
                else:
                    ready = done.get(("F", k, a.micro_batch) if k == S - 1 else ("B", k + 1, a.micro_batch))
                if ready is None:
                    break
                last_start[k] = max(free[k], ready)
                free[k] = last_start[k] + took[a.kind][k]
                if a.kind != "BW":
                    done[("B" if a.kind == "BI" else a.kind, k, a.micro_batch)] = free[k]
                position[k] += 1
                left -= 1
        if left == before:
            raise ValueError(f"the action lists deadlock: stages wait at positions {position}")
    ends = list(free)
    for k, buckets in enumerate(sync):
        previous = 0.0
        for ready, seconds in buckets:
            previous = max(last_start[k] + ready * (free[k] - last_start[k]), previous) + seconds
        ends[k] = max(ends[k], previous)
    return max(ends)


def _times(mats: Sequence[np.ndarray], starts: Sequence[int]) -> list[float]:
    """Each stage's time per micro-batch under the split starting at ``starts``."""
    L = mats[0].shape[0]
    ends = [s - 1 for s in starts[1:]] + [L - 1]
    return [float(m[i, j]) for m, i, j in zip(mats, starts, ends)]


def _least_step(pricing: Pricing, order: Sequence[int], mats: Sequence[np.ndarray], bottleneck: float,
                balanced: list[int]) -> tuple[Score, list[int]]:
    """The shortest step found (the module docstring's search) among the splits that fit."""
    p = pricing.p
    least_sum, spread = _dp(mats, np.add)
    seeds = [balanced, spread, _least_pipelined(p, mats, bottleneck, least_sum, [balanced, spread])]
    seen = {tuple(s): pricing.step_s(order, s) for s in seeds}
    starts = min(seen, key=lambda s: (seen[s], s != tuple(balanced)))
    L, S = len(p.layers), len(order)
    for _ in range(MAX_BOUNDARY_MOVES):
        moves = []
        for k in range(1, S):
            for shift in (-1, 1):
                trial = list(starts)
                trial[k] += shift
                ends = trial[1:] + [L]
                if all(a < b for a, b in zip(trial, ends)) and all(
                        math.isfinite(mats[q][trial[q], ends[q] - 1]) for q in (k - 1, k)):
                    moves.append(tuple(trial))
        for trial in moves:
            if trial not in seen:
                seen[trial] = pricing.step_s(order, trial)
        better = min(moves, key=lambda t: seen[t], default=None)
        if better is None or seen[better] >= seen[starts] * (1 - 1e-12):
            break
        starts = better
    times = _times(mats, starts)
    return Score(0.0, seen[starts], math.fsum(t * t for t in times), False), list(starts)


def _within(mats: Sequence[np.ndarray], m: int, bound: float) -> Optional[list[int]]:
    """A split whose every stage ``k`` keeps ``t_0 + ... + t_(k-1) + m t_k <= bound``, or None: the
    dynamic program of the least prefix (stages ``0..k`` covering layers ``0..j``)."""
    L = mats[0].shape[0]
    first = mats[0][0, :]
    f = np.where(m * first <= bound, first, np.inf)
    choices = []
    for mat in mats[1:]:
        before = f[:-1, None]   # the stages so far end at layer i - 1, this one runs i..j
        cand = np.where(before + m * mat[1:, :] <= bound, before + mat[1:, :], np.inf)
        arg = np.argmin(cand, axis=0)
        f = cand[arg, np.arange(L)]
        choices.append(arg + 1)
    if not math.isfinite(f[L - 1]):
        return None
    starts, j = [0] * len(mats), L - 1
    for k in range(len(mats) - 1, 0, -1):
        starts[k] = int(choices[k - 1][j])
        j = starts[k] - 1
    return starts


def _least_pipelined(p: PartitionProblem, mats: Sequence[np.ndarray], bottleneck: float, least_sum: float,
                     known: list[list[int]]) -> list[int]:
    """The split of least :meth:`~planner.partition.problem.PartitionProblem.pipelined_bound` (to
    :data:`BISECTION_TOLERANCE`), no worse than those in ``known``: bisection between its lower
    bounds ``m * least bottleneck`` and the least sum, and the best of ``known``."""
    def bound(starts):
        return p.pipelined_bound(_times(mats, starts))

    best = min(known, key=bound)
    low = max(p.num_micro_batch * bottleneck, least_sum)
    high = bound(best)
    while high - low > BISECTION_TOLERANCE * high:
        middle = (low + high) / 2
        starts = _within(mats, p.num_micro_batch, middle)
        if starts is None:
            low = middle
            continue
        if bound(starts) < bound(best):
            best = starts
        high = min(middle, bound(best))
    return best


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

