"""The Plan: what every device does in one optimizer step, as plain data.

Rank ``r`` of the torchrun world runs ``plan.workers[r]``. Workers of one pipeline stage form a
data-parallel group (uneven micro-batch shares) and, under ``split``, tensor-parallel groups of
``tp_size`` consecutive workers with uneven shard sizes (``StagePlan.shard_sizes``). When the
cluster has more devices than one pipeline needs, the pipeline is replicated (``replica``).

Micro-batch convention: ``Worker.micro_batch_sizes[m]`` is the number of samples this worker
processes in micro-batch ``m`` of a step. For a multi-stage plan every list has length
``num_micro_batch``; for a single-stage plan (pure data parallel with gradient accumulation,
Poplar) the lists may differ in length and their last entry is the worker's last batch size.
Workers of one tensor-parallel group have equal lists (they process the same samples).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

SCHEMA_VERSION = 1


@dataclass
class Worker:
    rank: int
    device: str
    host: str
    replica: int                   # pipeline replica (outer data parallel)
    stage: int                     # pipeline stage index
    dp_index: int                  # index in the stage's data-parallel group within this replica
    tp_index: int = 0              # shard index in the tensor-parallel group (0 when no split)
    tp_size: int = 1
    micro_batch_sizes: list[int] = field(default_factory=list)
    memory_gib: float = 0.0        # estimated peak memory
    capacity_gib: float = 0.0
    compute_ms: float = 0.0        # predicted forward+backward compute time per step
    forward_ms: list[float] = field(default_factory=list)   # per micro-batch, predicted
    backward_ms: list[float] = field(default_factory=list)  # per micro-batch, predicted
    allreduce_ms: float = 0.0      # predicted gradient all-reduce time at the end of the step

    @property
    def batch_share(self) -> int:
        return sum(self.micro_batch_sizes)


@dataclass
class StagePlan:
    index: int
    taskgraphs: list[int]          # TaskGraph indices whose layers this stage runs
    layers: list[int]              # contiguous layer indices
    strategy: str                  # e.g. "replicate(2)" or "replicate(2)+split(2)"
    shard_sizes: dict[str, list[int]] = field(default_factory=dict)  # module path -> size per tp_index


@dataclass
class BoundaryPlan:
    src_stage: int
    dst_stage: int
    tensors: list[str]
    bytes_per_sample: float
    transfer_ms: list[float] = field(default_factory=list)  # per micro-batch, predicted


@dataclass
class Prediction:
    step_time_ms: float
    bubble_fraction: float
    throughput: float              # samples per second


@dataclass
class Plan:
    model_fingerprint: str
    cluster: str
    global_batch_size: int
    num_micro_batch: int
    schedule: str
    solver: str                    # "ilp" or "greedy"
    stages: list[StagePlan]
    workers: list[Worker]
    boundaries: list[BoundaryPlan]
    prediction: Prediction
    naive_prediction: Prediction
    optimality_gap: Optional[float] = None
    schema_version: int = SCHEMA_VERSION

    @property
    def world_size(self) -> int:
        return len(self.workers)

    @property
    def num_replicas(self) -> int:
        return 1 + max(w.replica for w in self.workers)

    def worker(self, rank: int) -> Worker:
        return self.workers[rank]

    def stage_workers(self, stage: int, replica: Optional[int] = None) -> list[Worker]:
        return [w for w in self.workers if w.stage == stage and (replica is None or w.replica == replica)]
