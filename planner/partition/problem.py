"""The pipeline partitioner's data: what it is given and what it returns.

In: :class:`LayerCost` per movable layer (:func:`layer_costs` prices captured layers), one
:class:`StageSlot` per stage position (a device group: its speed and, per :class:`DeviceMemory`, which
share of the stage's weights and batch each device holds), a :class:`StageLink` between neighbouring
positions, and the :class:`PartitionProblem` tying them to a micro-batch size, the micro-batches
in flight per position and the constraints (pinned layers, order search). Out: a
:class:`Partition` of :class:`StageAssignment` s. Every value is validated when it is built, so a
solver never sees a negative, infinite or inconsistent input; the model they describe is in
:mod:`planner.partition.solve`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Optional, Sequence

from whalelike.spec import check_fields, rule
from whalelike.graphs.taskgraph import TaskGraphs

from planner.devices.cost_model import StageCost
from planner.devices.memory import (
    NO_ZERO, MemoryTerms, ZeroShards, update_bytes, worker_fractions,
)
from planner.plan import PlanError
from planner.schedule.actions import SCHEDULES as SCHEDULE_NAMES, build_schedule, max_in_flight


OBJECTIVES = ("bottleneck", "step")   # PartitionProblem.objective: what a split is scored by


class PartitionInfeasible(PlanError):
    """No contiguous split of the layers over the stages fits in memory."""


def _number(doc: str, *, positive: bool = False, **bounds):
    """A finite-number field (whalelike.spec rule): >= 0, or > 0 when ``positive``."""
    return rule(float, doc, **({"gt": 0} if positive else {"ge": 0}), **bounds)


# -- inputs ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerCost:
    """One movable layer. FLOPs and activation/cut bytes are per sample; ``param_bytes`` and
    ``state_bytes`` (gradients + optimizer state, of which ``optimizer_bytes`` is optimizer state)
    are for the whole layer."""

    name: str
    forward_flops: float = _number("FLOPs of the forward pass per sample")
    backward_flops: float = _number("FLOPs of the backward pass per sample")
    param_bytes: float = _number("bytes of the layer's parameters")
    state_bytes: float = _number("bytes of its gradients and optimizer state")
    activation_bytes: float = _number("activation bytes per sample kept for the backward pass")
    cut_bytes: float = _number("bytes per sample sent when a stage boundary follows this layer")
    optimizer_bytes: float = _number("bytes of its optimizer state, part of state_bytes (the rest is gradients)",
                                     default=0.0)
    # the optimizer update's temporaries (planner.devices.memory.update_bytes): stepping parameter by parameter
    # (a stage holds its largest layer's), and with the foreach kernels (a stage holds the sum of its layers')
    update_bytes: float = _number("bytes of the update's temporaries stepping its parameters one by one", default=0.0)
    foreach_update_bytes: float = _number("bytes of the update's temporaries stepping its parameters at once",
                                          default=0.0)

    def __post_init__(self):
        check_fields(self, f"layer {self.name!r}: ", error=ValueError)
        if self.optimizer_bytes > self.state_bytes:
            raise ValueError(f"layer {self.name!r}: optimizer_bytes {self.optimizer_bytes!r} exceeds state_bytes "
                             f"{self.state_bytes!r} (gradients and optimizer state)")

    @property
    def flops(self) -> float:
        return self.forward_flops + self.backward_flops

    @property
    def static_bytes(self) -> float:
        return self.param_bytes + self.state_bytes

    @property
    def gradient_bytes(self) -> float:
        return self.state_bytes - self.optimizer_bytes


def layer_costs(graphs: TaskGraphs, layers: Optional[Sequence[int]] = None, precision: str = "fp32"
                ) -> tuple[LayerCost, ...]:
    """:class:`LayerCost` of captured layers (all by default), priced as
    :meth:`StageCost.of_layers` prices them at the training ``precision``: gradients as large as the
    parameters, the TaskGraph's optimizer state shared out by parameter bytes, the low-precision
    weight copy counted with the weights, activations and cut bytes at the precision's bytes per
    element."""
    out = []
    for i in range(len(graphs.layers)) if layers is None else layers:
        layer, cost = graphs.layers[i], StageCost.of_layers(graphs, [i], precision)
        out.append(LayerCost(
            layer.name, cost.forward_flops, cost.backward_flops, cost.param_bytes + cost.param_copy_bytes,
            cost.static_bytes - cost.param_bytes, cost.activation_bytes, cost.layer_output_bytes[0],
            optimizer_bytes=cost.optimizer_bytes, update_bytes=update_bytes(cost, False),
            foreach_update_bytes=update_bytes(cost, True),
        ))
    return tuple(out)


@dataclass(frozen=True)
class DeviceMemory:
    """One device of a slot as the memory check sees it: its capacity and the fraction of each
    term of :class:`~planner.devices.memory.MemoryTerms` it holds: ``weight_fraction`` of the
    stage's parameters (and, unless given apart, of its gradients and optimizer state) and
    ``batch_fraction`` of each micro-batch's activations."""

    capacity_bytes: float = _number("device memory in bytes", positive=True)
    weight_fraction: float = _number("share of the stage's weights", le=1, default=1.0)
    batch_fraction: float = _number("share of each micro-batch", le=1, default=1.0)
    name: str = ""
    gradient_fraction: Optional[float] = _number("share of the stage's gradients (default: weight_fraction)",
                                                 le=1, default=None)
    optimizer_fraction: Optional[float] = _number("share of the stage's optimizer state (default: weight_fraction)",
                                                  le=1, default=None)
    fixed_bytes: float = _number("bytes held whatever layers the stage runs (ZeRO's gathered units, priced "
                                 "at the largest layer's)", default=0.0)
    foreach: bool = False   # its optimizer steps with the foreach kernels (planner.devices.memory.runs_foreach)

    def __post_init__(self):
        check_fields(self, f"device {self.name!r}: ", error=ValueError)
        for name in ("gradient_fraction", "optimizer_fraction"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, self.weight_fraction)

    @classmethod
    def of_worker(cls, capacity_bytes: float, shard: float, batch_share: float, name: str = "",
                  zero: ZeroShards = NO_ZERO, fixed_bytes: float = 0.0, foreach: bool = False) -> "DeviceMemory":
        """A worker holding ``shard`` of the stage (its tensor-parallel fraction) whose group takes
        ``batch_share`` of each micro-batch, under ``zero`` (its data-parallel group's ZeRO shards;
        ``fixed_bytes`` the units' buffers they hold whatever the layers): the fractions of
        :func:`planner.devices.memory.worker_fractions`, the planner's one rule of who holds what."""
        f = worker_fractions(shard, batch_share, zero=zero)
        return cls(capacity_bytes, f["weight_fraction"], f["activation_fraction"], name,
                   f["gradient_fraction"], f["optimizer_fraction"], fixed_bytes, foreach)

    @property
    def fractions(self) -> tuple[float, float, float, float]:
        """(weights, gradients, optimizer state, activations): what it holds of each term."""
        return (self.weight_fraction, self.gradient_fraction, self.optimizer_fraction, self.batch_fraction)

    def terms(self, weights, gradients, optimizer, activations_per_sample, in_flight: int,
              update: Any = 0.0) -> MemoryTerms:
        """This device's :class:`~planner.devices.memory.MemoryTerms` for a stage of these whole-stage
        bytes (numbers, arrays over layer ranges or ILP expressions; ``update``: its optimizer
        update's temporaries as it steps, :attr:`foreach` or not); its ``total`` takes the pipeline's
        micro-batch size."""
        return MemoryTerms(weights, gradients, optimizer, activations_per_sample, in_flight,
                           self.weight_fraction, self.gradient_fraction, self.optimizer_fraction, self.batch_fraction,
                           whole_bytes=self.fixed_bytes, update_bytes=update)


@dataclass(frozen=True)
class StageSlot:
    """A device group that can run one pipeline stage: its aggregate speed (FLOP/s; the sum of its
    data-parallel devices' speeds, or what their whole-sample shares make it) and its devices'
    memory; for the ``"step"`` objective also its gradient all-reduce once per step,
    ``allreduce_latency_s + allreduce_s_per_byte * gradient bytes`` of the layers it runs (0: not
    priced; :mod:`planner.partition.stage_layers` prices the stage's data-parallel ring)."""

    name: str
    flops_per_s: float = _number("the group's aggregate speed in FLOP/s", positive=True)
    devices: tuple[DeviceMemory, ...]
    allreduce_latency_s: float = _number("fixed seconds of the stage's gradient all-reduce per step", default=0.0)
    allreduce_s_per_byte: float = _number("seconds per byte of the stage's gradients in that all-reduce", default=0.0)

    def __post_init__(self):
        check_fields(self, f"slot {self.name!r}: ", error=ValueError)
        object.__setattr__(self, "devices", tuple(self.devices))
        if not self.devices:
            raise ValueError(f"slot {self.name!r}: devices must list at least one DeviceMemory")

    @classmethod
    def data_parallel(cls, name: str, speeds: Sequence[float], capacities: Sequence[float],
                      device_names: Sequence[str] = ()) -> "StageSlot":
        """A ``replicate`` group: every device holds all weights and a speed-proportional share of
        each micro-batch (``speeds`` in FLOP/s, ``capacities`` in bytes)."""
        if len(speeds) != len(capacities) or not speeds:
            raise ValueError(f"slot {name!r}: speeds and capacities must be non-empty and of one length, "
                             f"got {len(speeds)} and {len(capacities)}")
        total = float(sum(speeds))
        names = list(device_names) or [f"{name}[{i}]" for i in range(len(speeds))]
        return cls(name, total, tuple(DeviceMemory.of_worker(c, 1.0, s / total, n)
                                      for s, c, n in zip(speeds, capacities, names)))

    @property
    def memory_classes(self) -> tuple[DeviceMemory, ...]:
        """The devices that can bind: one per (capacity, fractions), without those another device
        dominates (no more room, no less load)."""
        unique = {(d.capacity_bytes, *d.fractions, d.foreach): d for d in self.devices}
        keep = []
        for d in unique.values():
            dominated = any(
                o is not d and o.capacity_bytes <= d.capacity_bytes and o.foreach == d.foreach
                and all(mine >= theirs for mine, theirs in zip(o.fractions, d.fractions)) for o in unique.values()
            )
            if not dominated:
                keep.append(d)
        return tuple(sorted(keep, key=lambda d: (d.capacity_bytes, -d.batch_fraction, -d.weight_fraction)))

    @property
    def signature(self) -> tuple:
        """Slots with equal signatures are interchangeable."""
        return (self.flops_per_s, tuple((d.capacity_bytes, *d.fractions, d.foreach) for d in self.memory_classes),
                self.allreduce_latency_s, self.allreduce_s_per_byte)


@dataclass(frozen=True)
class StageLink:
    """The connection between two neighbouring stage positions, as the partitioner prices it (in
    bytes/s and seconds; :mod:`planner.partition.stage_layers` takes the slowest
    :class:`planner.devices.network.Link` between the two stages' hosts)."""

    bandwidth_bytes_per_s: float = _number("bytes per second", positive=True)
    latency_s: float = _number("seconds per message", default=0.0)

    def __post_init__(self):
        check_fields(self, "link: ", error=ValueError)


@dataclass(frozen=True)
class PartitionProblem:
    """What to partition: ``layers`` in order, one :class:`StageSlot` per stage (in the given order
    ``slots[k]`` runs position ``k``), ``links[k]`` between positions ``k`` and ``k+1``, samples per
    micro-batch, micro-batches in flight per position, and constraints:

    ``pinned``: layer index -> stage position it must run in (e.g. the layers of a ``split``
    TaskGraph). ``order``: ``"fixed"`` keeps the slots in the given order, ``"search"`` lets the
    partitioner choose it, except for slots listed in ``keep_position``.

    ``objective``: ``"bottleneck"`` (the default) minimises the slowest stage's time per micro-batch,
    the step's pace when many micro-batches hide the pipeline's fill and drain. ``"step"`` minimises
    the step itself: the time ``schedule``'s action lists (:mod:`planner.schedule.actions`, what the
    simulator and the runtime run) take over ``num_micro_batch`` micro-batches when each stage's
    forward and backward take its layers' FLOPs at its slot's speed plus the send of its activations
    or gradients over its link, and each stage's gradient all-reduce (its slot's) runs in DDP's buckets
    beside its last backward (:mod:`planner.partition.pricing`). With few micro-batches the fill
    and drain are most of the step, and a split that shaves the slowest stage by piling layers on a
    slow one costs more than it saves (one micro-batch: the stages run one after another). The
    solvers search it through :meth:`pipelined_bound`, a lower bound of it that a dynamic program can
    minimise.
    """

    layers: tuple[LayerCost, ...]
    slots: tuple[StageSlot, ...]
    links: tuple[StageLink, ...]
    micro_batch: float = _number("samples per micro-batch", positive=True)
    in_flight: tuple[int, ...]
    pinned: Mapping[int, int] = field(default_factory=dict)
    order: Literal["fixed", "search"] = "fixed"
    keep_position: frozenset[int] = frozenset()
    objective: Literal["bottleneck", "step"] = "bottleneck"
    num_micro_batch: int = 1
    schedule: str = "1f1b"

    def __post_init__(self):
        for name in ("layers", "slots", "links", "in_flight"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "pinned", dict(sorted(dict(self.pinned).items())))
        object.__setattr__(self, "keep_position", frozenset(self.keep_position))
        L, S = len(self.layers), len(self.slots)
        if S < 1:
            raise ValueError("PartitionProblem.slots must list at least one StageSlot")
        if L < S:
            raise PartitionInfeasible(f"{L} layers cannot fill {S} pipeline stages: every stage needs a layer; "
                                      f"use at most {L} stages or split the model into finer layers")
        if len(self.links) != S - 1:
            raise ValueError(f"PartitionProblem.links must have one StageLink per boundary ({S - 1}), got {len(self.links)}")
        if len(self.in_flight) != S or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.in_flight):
            raise ValueError(f"PartitionProblem.in_flight must be {S} integers >= 1 (one per stage), got {self.in_flight!r}")
        check_fields(self, "PartitionProblem.", error=ValueError)
        if self.order not in ("fixed", "search"):
            raise ValueError(f"PartitionProblem.order must be 'fixed' or 'search', got {self.order!r}")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"PartitionProblem.objective must be one of {', '.join(map(repr, OBJECTIVES))}, "
                             f"got {self.objective!r}")
        if self.schedule not in SCHEDULE_NAMES:
            raise ValueError(f"PartitionProblem.schedule must be one of {', '.join(map(repr, SCHEDULE_NAMES))}, "
                             f"got {self.schedule!r}")
        if isinstance(self.num_micro_batch, bool) or not isinstance(self.num_micro_batch, int) or self.num_micro_batch < 1:
            raise ValueError(f"PartitionProblem.num_micro_batch must be an integer >= 1 (micro-batches per step), "
                             f"got {self.num_micro_batch!r}")
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
    def for_schedule(cls, layers: Sequence[LayerCost], slots: Sequence[StageSlot], links: Sequence[StageLink],
                     micro_batch: float, num_micro_batch: int, schedule: str = "1f1b", **kw) -> "PartitionProblem":
        """A problem whose in-flight micro-batches per stage come from ``schedule`` (1F1B: at most
        ``S - k`` on stage ``k``; GPipe: all of them), counted on the schedule itself, over
        ``num_micro_batch`` micro-batches (what the ``"step"`` objective prices)."""
        actions = build_schedule(schedule, len(slots), num_micro_batch)
        return cls(tuple(layers), tuple(slots), tuple(links), micro_batch, tuple(max_in_flight(a) for a in actions),
                   num_micro_batch=num_micro_batch, schedule=schedule, **kw)

    def pipelined_bound(self, times: Sequence[float]) -> float:
        """``max over k of (t_0 + ... + t_(k-1) + m * t_k)`` for stages of these ``times`` (seconds
        per micro-batch, position order; ``m = num_micro_batch``): stage ``k`` runs ``m`` forwards and
        backwards, after the stages before it forwarded the first micro-batch and before they
        backward the last one, so no schedule's step is shorter. 1F1B meets it when the stages after
        the slowest return each micro-batch while the slowest runs its warm-up forwards and pending
        backwards; one micro-batch: the sum of the stages. Linear in the stage times: the ILP
        minimises it under ``"step"``, and the greedy solver's search starts from its minimum."""
        before, most = 0.0, 0.0
        for t in times:
            most = max(most, before + self.num_micro_batch * t)
            before += t
        return most

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

