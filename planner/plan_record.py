"""The plan record: what every device does in one optimizer step, as plain data.

Rank ``r`` of the torchrun world runs ``plan.workers[r]``. Workers of one pipeline stage form a
data-parallel group (uneven micro-batch shares) and, under ``split``, tensor-parallel groups of
``tp_size`` consecutive workers with uneven shard sizes (``StagePlan.shard_sizes``). When the
cluster has more devices than one pipeline needs, the pipeline is replicated (``replica``). Which
workers form which group, and in what order: :mod:`planner.groups`.

Micro-batch convention: ``Worker.micro_batch_sizes[m]`` is the number of samples this worker
processes in micro-batch ``m`` of a step. For a multi-stage plan every list has length
``num_micro_batch``; for a single-stage plan (pure data parallel with gradient accumulation,
Poplar) the lists may differ in length and their last entry is the worker's last batch size.
Workers of one tensor-parallel group have equal lists (they process the same samples).

Every field carries a :class:`whalelike.spec.Rule` (type, bounds: no negative, NaN or infinite time
or size), which :meth:`PlanRecord.from_dict` checks while reading.

Why a record apart from :class:`planner.plan.Plan`: the plan's checks (:mod:`planner.plan_checks`)
and its printout (:mod:`planner.summary`) read the sample layout, the resharding planner and the
memory model, which read plans; the record is the floor under all of them, so no module that reads
a plan is imported back by it. Invariant: this module imports no other module of the planner but
:mod:`planner.errors` and :mod:`planner.plan_identity`; the modules the checker and the printer
reach name :class:`PlanRecord` (and its parts) from here, everything above uses
:class:`planner.plan.Plan`, which is a PlanRecord.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Self

import yaml

from whalelike.files import write_atomic
from whalelike.config import GROUP_GENERATORS, PRECISIONS, REPLICA_SYNCS, RESHARDING, SCHEDULES
from whalelike.spec import Reader, rule

from planner.errors import PlanError
from planner.plan_identity import SCHEMA_VERSION

SOLVERS = ("ilp", "greedy")
CANDIDATES = ("aware", "naive", "folded")   # Plan.chosen, CandidatePlan.name: the plans planner.candidates compares
SPEED_SOURCES = ("spec", "profile")   # Plan.speeds: the cluster spec's figures, or whalelike profile's measurements
RECOMPUTE_REASONS = ("none", "asked", "fit", "faster")   # StagePlan.recompute_reason: none, the user's, the
# planner's to fit, the planner's as faster than a higher ZeRO stage (simulated)
RECOMPUTE_UNITS = ("layer", "stage")   # StagePlan.recompute_unit: planner.devices.memory.recompute_unit
ZERO_REASONS = ("none", "asked", "fit")   # StagePlan.zero_reason: no ZeRO, the user's stage, the planner's


MS = "ms, predicted"


@dataclass
class Worker:
    """What one rank does in a step (see the module docstring): its device and host, its place in
    the plan (replica, stage, data-parallel and tensor-parallel index), its samples per
    micro-batch, and the planner's predicted memory and times for it."""

    rank: int = rule(int, "the torchrun rank running this worker", ge=0)
    device: str = rule(str, "device name in the cluster, e.g. 'v100-0'")
    host: str = rule(str, "host of the device")
    replica: int = rule(int, "pipeline replica (outer data parallel)", ge=0)
    stage: int = rule(int, "pipeline stage index", ge=0)
    dp_index: int = rule(int, "index in the stage's data-parallel group within this replica", ge=0)
    tp_index: int = rule(int, "shard index in the tensor-parallel group (0 when no split)", ge=0, default=0)
    tp_size: int = rule(int, "workers in the tensor-parallel group", ge=1, default=1)
    micro_batch_sizes: list[int] = rule(int, "samples in each micro-batch of a step", ge=1, default_factory=list)
    memory_gib: float = rule(float, "estimated peak memory in GiB", ge=0, default=0.0)
    capacity_gib: float = rule(float, "the device's memory in GiB the plan may fill (less Plan.memory_reserve)", ge=0,
                               default=0.0)
    compute_ms: float = rule(float, f"forward+backward compute time per step, {MS}", ge=0, default=0.0)
    forward_ms: list[float] = rule(float, f"forward time per micro-batch, {MS}", ge=0, default_factory=list)
    backward_ms: list[float] = rule(float, f"backward time per micro-batch, {MS}", ge=0, default_factory=list)
    allreduce_ms: float = rule(float, f"gradient all-reduce time at the end of the step (under ZeRO: the step's "
                               f"all-gathers and reduce-scatters), {MS}", ge=0, default=0.0)
    gradient_bytes: float = rule(float, "bytes of gradients the worker all-reduces per step (its shard of the "
                                 "stage's parameters; the simulator's DDP buckets; 0 under ZeRO, whose "
                                 "collectives allreduce_ms prices)", ge=0, default=0.0)
    action_overhead_ms: float = rule(float, f"time outside the compute segments per compute action (a forward or a "
                                     f"backward: the runtime's Python, dispatch and bookkeeping around it; 0: not "
                                     f"priced, the device's figure unmeasured), {MS}", ge=0, default=0.0)
    update_ms: float = rule(float, f"the optimizer's update of the parameters the worker updates, after its last "
                            f"collective of the step (0: not priced, the device's update rate unmeasured), {MS}",
                            ge=0, default=0.0)
    # planner.devices.memory's terms at the worker's peak (memory_gib is the first three plus the larger of the last
    # two: the update's temporaries come after the backward has freed the activations; 0 in plans made before them)
    weights_gib: float = rule(float, "parameters held at the peak (with autocast's copies) in GiB", ge=0, default=0.0)
    gradients_gib: float = rule(float, "gradients held at the peak in GiB", ge=0, default=0.0)
    optimizer_gib: float = rule(float, "optimizer state held in GiB", ge=0, default=0.0)
    activations_gib: float = rule(float, "activations and boundary buffers at the peak in GiB", ge=0, default=0.0)
    update_gib: float = rule(float, "the optimizer update's temporaries in GiB (after the backward)", ge=0, default=0.0)

    @property
    def batch_share(self) -> int:
        return sum(self.micro_batch_sizes)


@dataclass
class StagePlan:
    """One pipeline stage: the TaskGraphs and layers it runs, its strategy and shard sizes, how its
    data-parallel replicas stay in step (``replica_sync``, ``zero_stage``, P-Reduce's settings),
    and whether it recomputes its activations in the backward."""

    index: int = rule(int, "stage index, in pipeline order", ge=0)
    taskgraphs: list[int] = rule(int, "TaskGraph indices whose layers this stage runs", ge=0)
    layers: list[int] = rule(int, "contiguous layer indices", ge=0)
    strategy: str = rule(str, "e.g. 'replicate(2)' or 'replicate(2)+split(2)'")
    # module path -> size of its split dimension per tp_index
    shard_sizes: dict[str, list[int]] = rule(int, "elements of the split dimension on each tp_index", ge=1,
                                             default_factory=dict)
    batchnorm: list[str] = field(default_factory=list)  # BatchNorm modules in training mode (whalelike.graphs.batchnorm_layers)
    # runtime.replicas.replica_sync: how the workers holding the same parameters keep them in step
    replica_sync: str = rule(str, "how the stage's data-parallel replicas stay in step", choices=REPLICA_SYNCS,
                             default="ddp")
    # ZeRO (runtime.replicas.fsdp_sync): what the stage's data-parallel group shards over its workers
    zero_stage: int = rule(int, "ZeRO stage of the data-parallel group: 0 (DDP, nothing sharded), 1 (optimizer "
                           "state sharded), 2 (and gradients), 3 (and parameters); replica_sync 'fsdp' (or 'ragged') "
                           "when above 0", ge=0, le=3, default=0)
    # runtime.replicas.ragged_sync: each worker's fraction of the state, in the group's rank order (empty: even)
    state_fractions: list[float] = rule(float, "each data-parallel worker's fraction of the stage's sharded state, in "
                                        "rank order (replica_sync 'ragged'; empty for even shards)", ge=0,
                                        default_factory=list)
    # runtime.replicas.partial_sync (replica_sync 'partial', Prague's P-Reduce): who forms the groups, their size
    # and the smart generator's threshold; the defaults on every other stage (they are read only under 'partial')
    partial_generator: str = rule(str, "P-Reduce's group generator (replica_sync 'partial'): 'smart' (randomized "
                                  "divisions, threshold rule) or 'static' (a fixed conflict-free schedule)",
                                  choices=GROUP_GENERATORS, default="smart")
    partial_group_size: int = rule(int, "workers per P-Reduce group (replica_sync 'partial'), at most the stage's "
                                   "data-parallel workers", ge=2, default=2)
    partial_delta_c: int = rule(int, "the smart generator's threshold: a worker joins a requester's group only if "
                                "it lags it by fewer than this many requests (replica_sync 'partial')", ge=1, default=2)
    zero_reason: str = rule(str, "why the stage runs its ZeRO stage: 'asked' (a region's replicate(zero=k) or "
                            "Config.zero_stage), 'fit' (the lowest stage at which every device fits, chosen by the "
                            "planner), 'none' (zero_stage 0, or a plan written by hand)", choices=ZERO_REASONS,
                            default="none")
    # runtime.training.recompute: activation checkpointing of the stage's forward (planner.devices.memory)
    recompute: bool = rule(bool, "recompute the stage's activations in the backward (activation checkpointing)",
                           default=False)
    recompute_reason: str = rule(str, "why the stage recomputes: 'asked' (a TaskGraph's recompute=True), 'fit' "
                                 "(chosen by the planner because the stage does not fit otherwise), 'faster' (chosen by the "
                                 "planner over a higher ZeRO stage that also fits: the simulator predicted it faster), "
                                 "'none' (it does not)",
                                 choices=RECOMPUTE_REASONS, default="none")
    recompute_unit: str = rule(str, "what a recomputing stage checkpoints at once: 'layer' (each of its layers, "
                               "the default) or 'stage' (all of it, when that holds less)", choices=RECOMPUTE_UNITS,
                               default="layer")
    # planner.candidates, Config.fold_stages: the adjacent replicate regions this stage stands for, on the union of
    # their devices (empty: one region's stage, the next after the previous stage's; a re-plan keeps the fold)
    folded: list[int] = rule(int, "the TaskGraphs folded into this stage (two or more adjacent replicate regions of "
                             "automatic device count; empty: the stage of one TaskGraph)", ge=0, default_factory=list)
    kept_work: Optional[int] = rule(int, "the compute layer the partitioner kept on this stage: its best split left the "
                                    "stage nothing to compute (its layers ran on a neighbour); None: none was needed",
                                    ge=0, default=None)


@dataclass
class BoundaryPlan:
    """The activations one stage sends to a later one: the tensors, their bytes per sample (and
    those without a batch dimension, sent whole) and the predicted transfer time per micro-batch."""

    src_stage: int = rule(int, "stage sending the activations", ge=0)
    dst_stage: int = rule(int, "stage receiving them", ge=0)
    tensors: list[str]
    bytes_per_sample: float = rule(float, "bytes crossing the boundary per sample", ge=0)
    transfer_ms: list[float] = rule(float, f"transfer time per micro-batch, {MS}", ge=0, default_factory=list)
    unbatched_bytes: float = rule(float, "bytes of the values without a batch dimension crossing the boundary, "
                                  "whole, once per micro-batch and pipeline replica", ge=0, default=0.0)


@dataclass
class Prediction:
    """The planner's prediction for one optimizer step: its time, the share of the workers' time
    spent idle, and samples per second."""

    step_time_ms: float = rule(float, f"time of one step, {MS}", ge=0)
    bubble_fraction: float = rule(float, "idle share of the workers' time", ge=0)
    throughput: float = rule(float, "samples per second", ge=0)


@dataclass
class CandidatePlan:
    """One plan :func:`planner.plan` priced before keeping the fastest that fits (``Plan.candidates``,
    :mod:`planner.candidates`)."""

    name: str = rule(str, "which plan: 'aware' (the hardware-aware decisions), 'naive' (the capacity-blind ones on "
                     "the same devices), 'folded' (the hardware-aware decisions with adjacent replicate regions "
                     "folded into fewer stages, Config.fold_stages)", choices=CANDIDATES)
    step_time_ms: float = rule(float, f"its step, {MS}", ge=0)
    fits: bool = rule(bool, "whether every device holds its part (one that does not is never kept)", default=True)
    stages: list[list[int]] = rule(int, "the TaskGraphs of each stage of a plan with folded stages (the 'folded' "
                                   "candidate, or a re-plan's naive one on a folded plan; empty: one stage per "
                                   "TaskGraph)", ge=0, default_factory=list)
    idle_stages: list[int] = rule(int, "its stages with nothing to compute (the partitioner moved their compute layers "
                                  "to a neighbour); such a candidate is kept only when no other fits", ge=0,
                                  default_factory=list)


@dataclass
class PlanRecord:
    """The fields of a :class:`planner.plan.Plan` and what they alone answer (no checks, no printout:
    those sit above, in :mod:`planner.plan_checks` and :mod:`planner.summary`, and
    :class:`planner.plan.Plan` adds them as methods). Every plan is a ``planner.plan.Plan``; this
    class is what the modules below the checker and the printer name in their signatures."""

    model_fingerprint: str = rule(str, "hash of the model the plan was made for")
    cluster: str = rule(str, "name of the cluster the plan was made for")
    global_batch_size: int = rule(int, "samples per optimizer step", ge=1)
    num_micro_batch: int = rule(int, "micro-batches per step", ge=1)
    schedule: str = rule(str, "pipeline schedule", choices=SCHEDULES)
    solver: str = rule(str, "partitioner that made the plan", choices=SOLVERS)
    stages: list[StagePlan]
    workers: list[Worker]
    boundaries: list[BoundaryPlan]
    prediction: Prediction
    naive_prediction: Prediction
    optimality_gap: Optional[float] = rule(float, "the ILP's bound on how far the plan is from optimal", ge=0,
                                           default=None)
    # runtime.parallel.sync_batchnorm
    sync_batchnorm: bool = rule(bool, "BatchNorm statistics over each stage's data-parallel group", default=False)
    # runtime.parallel.boundaries: how values cross stage boundaries (planner.resharding.reshard's strategies, or the best)
    resharding: str = rule(str, "strategy of the cross-mesh resharding at stage boundaries",
                           choices=RESHARDING, default="auto")
    # runtime.parallel.split_backward: a backward computes the input gradients, sends them, then the weight gradients
    delay_weight_gradients: bool = rule(bool, "send a backward's input gradients before computing its weight "
                                        "gradients", default=False)
    # runtime.training.precision: autocast dtype (float32 master weights); planner.devices.cost_model prices it
    precision: str = rule(str, "training precision: fp32, or autocast to bf16/fp16 with float32 master weights",
                          choices=PRECISIONS, default="fp32")
    # planner.devices.measured_speeds: the device speeds and links priced from the spec sheet or a profile
    speeds: str = rule(str, "where the device speeds and links came from: 'spec' (the cluster spec) or 'profile' "
                       "(measured by whalelike profile)", choices=SPEED_SOURCES, default="spec")
    # planner.candidates: the plans planner.plan priced and which of them this one is, the fastest that fits. A
    # file written before them loads as the hardware-aware plan with no candidates (what every plan then was), so
    # the schema version stays
    chosen: str = rule(str, "which of the candidates this plan is", choices=CANDIDATES, default="aware")
    candidates: list[CandidatePlan] = field(default_factory=list)
    # planner.candidates.fastest_schedule (Config.schedule "auto"): each schedule planned in full and the step
    # predicted for its plan, the fastest kept as this plan; empty when the schedule was asked (or in a re-plan)
    schedule_steps_ms: dict[str, float] = rule(float, "each schedule planned for Config.schedule 'auto' -> the step "
                                                f"predicted for its plan ({MS}); the fastest is this plan's schedule; "
                                                "empty: the schedule was asked", ge=0, default_factory=dict)
    # planner.devices.placement.shared_device_groups: a cluster smaller than the regions ask; the regions' counts
    # became automatic and adjacent regions may share a stage (StagePlan.folded). Empty: every region got its ask
    shared_devices: str = ""
    # planner.devices.memory.with_reserve (Config.memory_reserve): the fraction of every device's memory the plan
    # leaves free; each Worker.capacity_gib is the device's memory less it (0 in plans made before the reserve)
    memory_reserve: float = rule(float, "fraction of each device's memory the plan leaves free", ge=0, le=0.9,
                                 default=0.0)
    schema_version: int = rule(int, "plan file format version", default=SCHEMA_VERSION)

    @property
    def world_size(self) -> int:
        return len(self.workers)

    @property
    def tensor_parallel(self) -> bool:
        """Whether some worker holds a ``split`` stage's shard (``tp_size > 1``): the one answer."""
        return any(w.tp_size > 1 for w in self.workers)

    @property
    def tensor_parallel_stages(self) -> frozenset[int]:
        """The stages under ``split``, whose workers hold shards (``tp_size > 1``, the rule of
        :attr:`tensor_parallel`, per stage)."""
        return frozenset(w.stage for w in self.workers if w.tp_size > 1)

    @property
    def kind(self) -> str:
        """What runs it: ``"tensor_parallel"`` (a split stage), ``"pipeline"`` (several stages) or
        ``"data_parallel"`` (one replicated stage); the runtime's executor registry is keyed by it."""
        if self.tensor_parallel:
            return "tensor_parallel"
        return "pipeline" if len(self.stages) > 1 else "data_parallel"

    @property
    def num_replicas(self) -> int:
        return 1 + max(w.replica for w in self.workers)

    def worker(self, rank: int) -> Worker:
        return self.workers[rank]

    def stage_workers(self, stage: int, replica: Optional[int] = None) -> list[Worker]:
        return [w for w in self.workers if w.stage == stage and (replica is None or w.replica == replica)]

    # -- serialisation ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any, origin: Optional[str] = None) -> Self:
        """Build a plan from plain data, checking every field's presence, type and rule (no
        consistency checks: call :meth:`planner.plan.Plan.validate`, as :meth:`planner.plan.Plan.from_yaml`
        does). Errors name the field path and, when given, ``origin`` (the file)."""
        return Reader(origin, PlanError, root="plan").record(cls, data, "plan")

    def to_yaml(self, path: str | os.PathLike) -> None:
        """Write the plan to ``path`` (.yaml or .yml) with :func:`whalelike.files.write_atomic`: the
        file keeps its old content or gets all of the new, with the mode ``open(path, "w")`` gives."""
        write_atomic(path, yaml.safe_dump(self.to_dict(), sort_keys=False), kind="yaml")
