"""Pipeline partitioning: contiguous runs of layers onto device groups of unequal speed and memory.

A pipeline of ``S`` stages runs the model's layers in ``S`` contiguous ranges; stage position ``k``
runs on one device group (a :class:`Slot`: a data-parallel and/or tensor-parallel group). The
partitioner picks the ranges, and optionally which group takes which position, so that the slowest
stage is as fast as possible while every device of every stage holds what it must. Pure and
process-free; torch's ``pipelining`` splits a model where it is told to and never chooses where.

Model (per micro-batch of ``micro_batch`` samples, SI units: FLOP/s, bytes, seconds)::

    time(k)   = micro_batch * (fwd + bwd FLOPs of its layers) / slot.flops_per_s
              + [k < S-1] (latency_k   + micro_batch * cut_out / bandwidth_k)    # activations forward
              + [k > 0]   (latency_k-1 + micro_batch * cut_in  / bandwidth_k-1)  # gradients backward
    memory(d) = d.weight_fraction * (params + gradients + optimizer state of its layers)
              + d.batch_fraction * micro_batch * in_flight[k] * (activations + cut_in + cut_out)

for every device ``d`` of the slot (``cut_in``/``cut_out``: bytes per sample of the boundary the
stage receives/sends, the buffers :class:`~planner.cost_model.StageCost` also counts). Memory is
checked per device, not per group: the binding device depends on the layers (a small-memory device
with a small batch share binds on weights, a large one with a large share on activations), so a
single "binding device" per slot would be wrong for some ranges. The fractions are the caller's:
:meth:`Slot.data_parallel` gives every device the whole stage's weights and a batch share
proportional to its speed, the shares the time model assumes; a ``split`` group gives each device
its shard fraction of both. Data-parallel gradient all-reduce happens once per step, not per
micro-batch, and is left to the plan's simulator.

Early stages keep more micro-batches in flight (1F1B: ``S - k``; GPipe: all), so the position
matters for memory: with ``order="search"`` the partitioner also chooses the group of each
position. Links belong to positions (``links[k]`` joins positions ``k`` and ``k+1``) and do not
change when groups are reordered: true when neighbouring stages never share a host.

Solvers (both return a :class:`Partition`, exact evaluation by the same model):

* ``"greedy"``: for a given group order an exact dynamic program over (stage, last layer) on
  numpy cost matrices, ``O(S L^2)``; the optimum is exact, so its gap is 0. Among the optimal
  partitions it takes the one with the least sum of squared stage times (slack spread evenly rather
  than piled on one stage). With ``order="search"`` the order starts from a rule (the best of
  most-memory-first, fastest-first and the given order) and improves by local moves (swap two
  groups, move one elsewhere) while (memory overflow, bottleneck, sum of squares) drops; the gap is
  then unknown (``None``). On 100 random small instances it matched the ILP on 98, within 0.03 %
  on average (``bench/plan_scale.py``).
* ``"ilp"``: a PuLP/CBC model (:mod:`planner.partition_ilp`), exact over layer ranges *and* group
  order, warm-started with the greedy answer so it is never worse; the dynamic program re-splits
  the layers for the ILP's order (exact, and free of CBC's tolerances). When CBC proves nothing
  beats its warm start, the greedy split is returned as the ILP's (gap 0). When CBC stops on its
  time limit the gap is read from its log; when it finds nothing in time the greedy answer is
  returned (solver ``"greedy"``).
* ``"auto"``: the ILP where it can beat the dynamic program (order search over at least two
  different groups) and the instance is small (``L * S <= ILP_MAX_CELLS`` and
  ``S <= ILP_MAX_STAGES``), the dynamic program otherwise.

Example::

    from planner.partition import LayerCost, Link, PartitionProblem, Slot, partition

    layer = LayerCost("block", forward_flops=2e9, backward_flops=4e9, param_bytes=5e7,
                      state_bytes=1.5e8, activation_bytes=3e6, cut_bytes=5e5)
    slots = [Slot.data_parallel("a100x2", [125e12] * 2, [80 * 2**30] * 2),
             Slot.data_parallel("t4", [26e12], [16 * 2**30])]
    problem = PartitionProblem.for_schedule(
        [layer] * 24, slots, [Link(12.5e9, 5e-6)], micro_batch=8, num_micro_batch=8,
        schedule="1f1b", order="search")
    result = partition(problem)            # -> Partition
    result.stage_layers()                  # [[0, ..., 21], [22, 23]]: the A100s first
    result.bottleneck_s, result.solver, result.gap  # 0.00455, "ilp", 0.0

Infeasible problems raise :class:`PartitionInfeasible` (a :class:`~planner.plan.PlanError`) naming
the stage, its layers, the device and the shortfall in GiB of the split that comes closest to
fitting.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from dataclasses import dataclass, field
from typing import Literal, Mapping, Optional, Sequence

import numpy as np

from whalelike.taskgraph import TaskGraphs

from .cost_model import GIB, StageCost
from .plan import PlanError
from .schedule import build_schedule, max_in_flight

log = logging.getLogger(__name__)

ILP_MAX_CELLS = 120      # layers x stages: CBC proves optimality within about a second up to here
ILP_MAX_STAGES = 5       # each searched position adds S assignment binaries; 6 stages can take CBC 10+ s
_PAIR_SWAP_MAX_STAGES = 16  # order search: any two positions (swap, move) up to here, neighbours beyond
_TOL = 1e-9

Solver = Literal["auto", "ilp", "greedy"]


class PartitionInfeasible(PlanError):
    """No contiguous split of the layers over the stages fits in memory."""


def _check_number(owner: str, name: str, value: float, *, positive: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{owner}: {name} must be a finite number {bound}, got {value!r}")


# -- inputs ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerCost:
    """One movable layer. FLOPs and activation/cut bytes are per sample; ``param_bytes`` and
    ``state_bytes`` (gradients + optimizer state) are for the whole layer."""

    name: str
    forward_flops: float
    backward_flops: float
    param_bytes: float
    state_bytes: float
    activation_bytes: float
    cut_bytes: float  # sent per sample when a stage boundary follows this layer

    def __post_init__(self):
        for f in ("forward_flops", "backward_flops", "param_bytes", "state_bytes", "activation_bytes", "cut_bytes"):
            _check_number(f"layer {self.name!r}", f, getattr(self, f))

    @property
    def flops(self) -> float:
        return self.forward_flops + self.backward_flops

    @property
    def static_bytes(self) -> float:
        return self.param_bytes + self.state_bytes


def layer_costs(graphs: TaskGraphs, layers: Optional[Sequence[int]] = None) -> tuple[LayerCost, ...]:
    """:class:`LayerCost` of captured layers (all by default), priced as
    :meth:`StageCost.of_layers` prices them: gradients as large as the parameters, and the
    TaskGraph's optimizer state shared out by parameter bytes."""
    out = []
    for i in range(len(graphs.layers)) if layers is None else layers:
        layer, cost = graphs.layers[i], StageCost.of_layers(graphs, [i])
        out.append(LayerCost(
            layer.name, cost.forward_flops, cost.backward_flops, cost.param_bytes,
            cost.static_bytes - cost.param_bytes, cost.activation_bytes, layer.cut_bytes_per_sample,
        ))
    return tuple(out)


@dataclass(frozen=True)
class DeviceMemory:
    """One device of a slot as the memory check sees it: it holds ``weight_fraction`` of the
    stage's parameters, gradients and optimizer state and ``batch_fraction`` of each micro-batch's
    activations."""

    capacity_bytes: float
    weight_fraction: float = 1.0
    batch_fraction: float = 1.0
    name: str = ""

    def __post_init__(self):
        _check_number(f"device {self.name!r}", "capacity_bytes", self.capacity_bytes, positive=True)
        for f in ("weight_fraction", "batch_fraction"):
            value = getattr(self, f)
            _check_number(f"device {self.name!r}", f, value)
            if value > 1:
                raise ValueError(f"device {self.name!r}: {f} must be <= 1 (a share of the stage), got {value!r}")


@dataclass(frozen=True)
class Slot:
    """A device group that can run one pipeline stage: its aggregate speed (FLOP/s; the sum of its
    data-parallel devices' speeds) and its devices' memory."""

    name: str
    flops_per_s: float
    devices: tuple[DeviceMemory, ...]

    def __post_init__(self):
        _check_number(f"slot {self.name!r}", "flops_per_s", self.flops_per_s, positive=True)
        object.__setattr__(self, "devices", tuple(self.devices))
        if not self.devices:
            raise ValueError(f"slot {self.name!r}: devices must list at least one DeviceMemory")

    @classmethod
    def data_parallel(cls, name: str, speeds: Sequence[float], capacities: Sequence[float],
                      device_names: Sequence[str] = ()) -> "Slot":
        """A ``replicate`` group: every device holds all weights and a speed-proportional share of
        each micro-batch (``speeds`` in FLOP/s, ``capacities`` in bytes)."""
        if len(speeds) != len(capacities) or not speeds:
            raise ValueError(f"slot {name!r}: speeds and capacities must be non-empty and of one length, "
                             f"got {len(speeds)} and {len(capacities)}")
        total = float(sum(speeds))
        names = list(device_names) or [f"{name}[{i}]" for i in range(len(speeds))]
        return cls(name, total, tuple(DeviceMemory(c, 1.0, s / total, n) for s, c, n in zip(speeds, capacities, names)))

    @property
    def memory_classes(self) -> tuple[DeviceMemory, ...]:
        """The devices that can bind: one per (capacity, fractions), without those another device
        dominates (no more room, no less load)."""
        unique = {(d.capacity_bytes, d.weight_fraction, d.batch_fraction): d for d in self.devices}
        keep = []
        for d in unique.values():
            dominated = any(
                o is not d and o.capacity_bytes <= d.capacity_bytes and o.weight_fraction >= d.weight_fraction
                and o.batch_fraction >= d.batch_fraction for o in unique.values()
            )
            if not dominated:
                keep.append(d)
        return tuple(sorted(keep, key=lambda d: (d.capacity_bytes, -d.batch_fraction, -d.weight_fraction)))

    @property
    def signature(self) -> tuple:
        """Slots with equal signatures are interchangeable."""
        return (self.flops_per_s, tuple((d.capacity_bytes, d.weight_fraction, d.batch_fraction) for d in self.memory_classes))


@dataclass(frozen=True)
class Link:
    """The connection between two neighbouring stage positions."""

    bandwidth_bytes_per_s: float
    latency_s: float = 0.0

    def __post_init__(self):
        _check_number("link", "bandwidth_bytes_per_s", self.bandwidth_bytes_per_s, positive=True)
        _check_number("link", "latency_s", self.latency_s)


@dataclass(frozen=True)
class PartitionProblem:
    """What to partition: ``layers`` in order, one :class:`Slot` per stage (in the given order
    ``slots[k]`` runs position ``k``), ``links[k]`` between positions ``k`` and ``k+1``, samples per
    micro-batch, micro-batches in flight per position, and constraints:

    ``pinned``: layer index -> stage position it must run in (e.g. the layers of a ``split``
    TaskGraph). ``order``: ``"fixed"`` keeps the slots in the given order, ``"search"`` lets the
    partitioner choose it, except for slots listed in ``keep_position``.
    """

    layers: tuple[LayerCost, ...]
    slots: tuple[Slot, ...]
    links: tuple[Link, ...]
    micro_batch: float
    in_flight: tuple[int, ...]
    pinned: Mapping[int, int] = field(default_factory=dict)
    order: Literal["fixed", "search"] = "fixed"
    keep_position: frozenset[int] = frozenset()

    def __post_init__(self):
        for name in ("layers", "slots", "links", "in_flight"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "pinned", dict(sorted(dict(self.pinned).items())))
        object.__setattr__(self, "keep_position", frozenset(self.keep_position))
        L, S = len(self.layers), len(self.slots)
        if S < 1:
            raise ValueError("PartitionProblem.slots must list at least one Slot")
        if L < S:
            raise PartitionInfeasible(f"{L} layers cannot fill {S} pipeline stages: every stage needs a layer; "
                                      f"use at most {L} stages or split the model into finer layers")
        if len(self.links) != S - 1:
            raise ValueError(f"PartitionProblem.links must have one Link per boundary ({S - 1}), got {len(self.links)}")
        if len(self.in_flight) != S or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.in_flight):
            raise ValueError(f"PartitionProblem.in_flight must be {S} integers >= 1 (one per stage), got {self.in_flight!r}")
        _check_number("PartitionProblem", "micro_batch", self.micro_batch, positive=True)
        if self.order not in ("fixed", "search"):
            raise ValueError(f"PartitionProblem.order must be 'fixed' or 'search', got {self.order!r}")
        bad = sorted(k for k in self.keep_position if not 0 <= k < S)
        if bad:
            raise ValueError(f"PartitionProblem.keep_position: slots {bad} do not exist (0..{S - 1})")
        self._check_pins()

    def _check_pins(self) -> None:
        L, S = len(self.layers), len(self.slots)
        previous = None
        for layer, stage in self.pinned.items():
            if not (0 <= layer < L and 0 <= stage < S):
                raise ValueError(f"PartitionProblem.pinned: layer {layer} -> stage {stage} is out of range "
                                 f"(layers 0..{L - 1}, stages 0..{S - 1})")
            if stage > layer or S - 1 - stage > L - 1 - layer:
                raise PartitionInfeasible(f"layer {layer} cannot run in stage {stage}: the stages before and after "
                                          "it need a layer each")
            if previous is not None:
                l0, s0 = previous
                if stage < s0 or stage - s0 > layer - l0:
                    raise PartitionInfeasible(
                        f"pins layer {l0} -> stage {s0} and layer {layer} -> stage {stage} contradict each other: "
                        "stages are contiguous, in order and never empty")
            previous = (layer, stage)

    @classmethod
    def for_schedule(cls, layers: Sequence[LayerCost], slots: Sequence[Slot], links: Sequence[Link],
                     micro_batch: float, num_micro_batch: int, schedule: str = "1f1b", **kw) -> "PartitionProblem":
        """A problem whose in-flight micro-batches per stage come from ``schedule`` (1F1B: at most
        ``S - k`` on stage ``k``; GPipe: all of them), counted on the schedule itself."""
        actions = build_schedule(schedule, len(slots), num_micro_batch)
        return cls(tuple(layers), tuple(slots), tuple(links), micro_batch, tuple(max_in_flight(a) for a in actions), **kw)

    @property
    def movable_slots(self) -> list[int]:
        return [g for g in range(len(self.slots)) if self.order == "search" and g not in self.keep_position]


# -- result ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StageAssignment:
    """Stage ``position`` runs layers ``first..last`` (inclusive) on ``slots[slot]``."""

    position: int
    slot: int
    slot_name: str
    first: int
    last: int
    compute_s: float
    comm_s: float
    memory_utilization: float  # peak over the slot's devices of need / capacity

    @property
    def time_s(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def layers(self) -> range:
        return range(self.first, self.last + 1)


@dataclass(frozen=True)
class Partition:
    """A partition: stages in pipeline order, the slowest stage's time per micro-batch, the solver
    that produced it (``"ilp"`` or ``"greedy"``) and its relative optimality gap (0: proven
    optimal; None: unknown)."""

    stages: tuple[StageAssignment, ...]
    bottleneck_s: float
    solver: str
    gap: Optional[float]

    def stage_layers(self) -> list[list[int]]:
        return [list(s.layers) for s in self.stages]

    @property
    def order(self) -> tuple[int, ...]:
        """``order[k]``: the slot that runs position ``k``."""
        return tuple(s.slot for s in self.stages)


# -- pricing ---------------------------------------------------------------------------------------
class _Pricing:
    """Cost matrices ``[first, last]`` of one stage position on one slot, built from prefix sums."""

    def __init__(self, p: PartitionProblem):
        self.p = p
        L = len(p.layers)
        def prefix(values):
            return np.concatenate(([0.0], np.cumsum(np.asarray(values, dtype=float))))
        self.flops = prefix([l.flops for l in p.layers])
        self.static = prefix([l.static_bytes for l in p.layers])
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
        """Bytes device ``d`` needs at position ``k`` for every range."""
        cin, cout = self._cuts(k)
        per_sample = self._range(self.act) + cin + cout
        return d.weight_fraction * self._range(self.static) + d.batch_fraction * self.p.micro_batch * self.p.in_flight[k] * per_sample

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
            c[(self.overflow(k, g) > _TOL) | self.forbidden(k)] = np.inf
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
class _Score:
    """How good a group order is, compared lexicographically: memory overflow of its least
    overflowing split (0 when one fits), then the least bottleneck, then the sum of squared stage
    times of the most balanced optimal split. The later keys give the order search a direction on
    plateaus, where a move leaves the slowest stage alone but relieves the others."""

    excess: float
    bottleneck: float
    squares: float

    def better_than(self, other: "_Score") -> bool:
        for mine, theirs in ((self.excess, other.excess), (self.bottleneck, other.bottleneck), (self.squares, other.squares)):
            if mine < theirs * (1 - 1e-9):
                return True
            if mine > theirs * (1 + 1e-9):
                return False
        return False


def _solve_order(pricing: _Pricing, order: Sequence[int]) -> tuple[_Score, list[int]]:
    """Least bottleneck for a fixed order; among optimal splits the least sum of squared times."""
    mats = [pricing.cost(k, g) for k, g in enumerate(order)]
    best, starts = _dp(mats)
    if not math.isfinite(best):
        excess, starts = _dp([np.where(pricing.forbidden(k), np.inf, pricing.overflow(k, g)) for k, g in enumerate(order)])
        return _Score(max(excess, 0.0), math.inf, math.inf), starts
    bound = best * (1 + 1e-9) + 1e-15
    squares, balanced = _dp([np.where(m <= bound, m * m, np.inf) for m in mats], np.add)
    return _Score(0.0, best, squares), balanced


def _rule_orders(p: PartitionProblem) -> list[list[int]]:
    """Starting orders: most memory first (early stages keep the most micro-batches in flight,
    faster first on ties), fastest first, and the given order; kept slots stay put."""
    def arranged(key) -> list[int]:
        it = iter(sorted(p.movable_slots, key=key))
        return [next(it) if g in p.movable_slots else g for g in range(len(p.slots))]
    memory_first = arranged(lambda g: (-sum(d.capacity_bytes for d in p.slots[g].devices), -p.slots[g].flops_per_s, g))
    fastest_first = arranged(lambda g: (-p.slots[g].flops_per_s, -sum(d.capacity_bytes for d in p.slots[g].devices), g))
    return [memory_first, fastest_first, list(range(len(p.slots)))]


def _moves(order: list[int], p: PartitionProblem):
    """Neighbouring orders: swap two movable slots that differ; for up to
    ``_PAIR_SWAP_MAX_STAGES`` stages any two and also move one slot elsewhere among the movable
    positions, beyond that neighbours only (the search stays O(S) evaluations per round)."""
    positions = [k for k in range(len(order)) if order[k] in p.movable_slots]
    small = len(order) <= _PAIR_SWAP_MAX_STAGES
    pairs = itertools.combinations(range(len(positions)), 2) if small else zip(range(len(positions) - 1), range(1, len(positions)))
    for a, b in pairs:
        ka, kb = positions[a], positions[b]
        if p.slots[order[ka]].signature != p.slots[order[kb]].signature:
            trial = list(order)
            trial[ka], trial[kb] = trial[kb], trial[ka]
            yield trial
    if small:
        sequence = [order[k] for k in positions]
        for a, b in itertools.permutations(range(len(sequence)), 2):
            if abs(a - b) > 1:  # neighbours were swapped above
                moved = list(sequence)
                moved.insert(b, moved.pop(a))
                trial = list(order)
                for k, g in zip(positions, moved):
                    trial[k] = g
                yield trial


def _search_order(pricing: _Pricing) -> tuple[list[int], _Score, list[int]]:
    """The best of the rule's starting orders, then best-improvement moves until none helps."""
    p = pricing.p
    scored = [(*_solve_order(pricing, o), o) for o in _rule_orders(p)]
    score, starts, order = min(scored, key=lambda t: (t[0].excess, t[0].bottleneck, t[0].squares))
    while True:
        improvement = None
        for trial in _moves(order, p):
            trial_score, trial_starts = _solve_order(pricing, trial)
            if trial_score.better_than(score if improvement is None else improvement[0]):
                improvement = (trial_score, trial_starts, trial)
        if improvement is None:
            return order, score, starts
        score, starts, order = improvement


def _order_is_free(p: PartitionProblem) -> bool:
    """Whether reordering can matter: two movable slots that differ."""
    return len({p.slots[g].signature for g in p.movable_slots}) > 1


def assemble(p: PartitionProblem, order: Sequence[int], starts: Sequence[int], solver: str,
             gap: Optional[float]) -> Partition:
    """Price a given split exactly (the one evaluator every solver's answer goes through)."""
    pricing = _Pricing(p)
    L = len(p.layers)
    ends = [s - 1 for s in starts[1:]] + [L - 1]
    stages = []
    for k, (g, i, j) in enumerate(zip(order, starts, ends)):
        compute = p.micro_batch * (pricing.flops[j + 1] - pricing.flops[i]) / p.slots[g].flops_per_s
        total = float(pricing.time(k, g)[i, j])
        stages.append(StageAssignment(k, g, p.slots[g].name, i, j, float(compute), total - float(compute),
                                      float(pricing.overflow(k, g)[i, j]) + 1.0))
    return Partition(tuple(stages), max(s.time_s for s in stages), solver, gap)


# -- entry point -----------------------------------------------------------------------------------
def partition(problem: PartitionProblem, solver: Solver = "auto", time_limit_s: float = 10.0) -> Partition:
    """Split ``problem.layers`` into contiguous pipeline stages (see the module docstring).

    ``solver``: ``"auto"``, ``"ilp"`` or ``"greedy"``; ``time_limit_s`` bounds CBC.
    Raises :class:`PartitionInfeasible` when no split fits in memory.
    """
    if solver not in ("auto", "ilp", "greedy"):
        raise ValueError(f"partition: solver must be 'auto', 'ilp' or 'greedy', got {solver!r}")
    p = problem
    L, S = len(p.layers), len(p.slots)
    pricing = _Pricing(p)
    free = _order_is_free(p)
    if free:
        order, score, starts = _search_order(pricing)
    else:
        order = list(range(S))
        score, starts = _solve_order(pricing, order)
    greedy = assemble(p, order, starts, "greedy", None if free else 0.0) if score.excess == 0 else None
    use_ilp = solver == "ilp" or (solver == "auto" and free and L * S <= ILP_MAX_CELLS and S <= ILP_MAX_STAGES)
    if use_ilp:
        result = _with_ilp(pricing, greedy, time_limit_s)
        if result is not None:
            return result
    if greedy is None:
        raise _infeasible(pricing, order)
    log.debug("greedy partition: bottleneck %.6g s", greedy.bottleneck_s)
    return greedy


def _with_ilp(pricing: _Pricing, greedy: Optional[Partition], time_limit_s: float) -> Optional[Partition]:
    """The ILP's answer, warm-started with (and so never worse than) the greedy one; None when
    CBC has no verdict in time. The ILP picks the order; the dynamic program splits the layers for
    it, exactly (so CBC's tolerances never let a stage overflow)."""
    from .partition_ilp import solve_ilp  # the ILP module prices with this one's types

    p = pricing.p
    found = solve_ilp(p, warm=greedy, time_limit_s=time_limit_s)
    if found.status == "no solution":
        log.warning("CBC stopped without a partition (time limit %.1f s); using the greedy one", time_limit_s)
        return None
    if found.order is not None:
        score, starts = _solve_order(pricing, found.order)
        if score.excess == 0 and (greedy is None or score.bottleneck < greedy.bottleneck_s):
            return assemble(p, found.order, starts, "ilp", found.gap)
    if greedy is None:  # CBC proved that nothing fits
        return None
    # CBC found nothing better than its warm start: the greedy answer is optimal within the gap
    return dataclasses.replace(greedy, solver="ilp", gap=found.gap if found.order is not None else 0.0)


def _infeasible(pricing: _Pricing, order: Sequence[int]) -> PartitionInfeasible:
    """Where the split that overflows least (for ``order``, the search's best) overflows."""
    p = pricing.p
    _, starts = _solve_order(pricing, order)
    ends = [s - 1 for s in starts[1:]] + [len(p.layers) - 1]
    lines = []
    for k, (g, i, j) in enumerate(zip(order, starts, ends)):
        for d in p.slots[g].memory_classes:
            need = float(pricing.need(k, d)[i, j])
            if need > d.capacity_bytes * (1 + _TOL):
                lines.append(
                    f"stage {k} (slot {p.slots[g].name!r}, layers {i}-{j} "
                    f"[{p.layers[i].name}..{p.layers[j].name}], {p.in_flight[k]} micro-batch(es) in flight) "
                    f"needs {need / GIB:.2f} GiB on device {d.name!r} of {d.capacity_bytes / GIB:.2f} GiB: "
                    f"short by {(need - d.capacity_bytes) / GIB:.2f} GiB")
                break
    return PartitionInfeasible(
        f"no split of the {len(p.layers)} layers over {len(p.slots)} pipeline stages fits in memory; "
        "the closest one overflows in " + "; ".join(lines)
        + ". Use a smaller micro-batch, fewer micro-batches in flight (1F1B instead of GPipe), "
          "devices with more memory, or shard the layers with split(n)")
