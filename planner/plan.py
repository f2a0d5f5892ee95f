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

A Plan is saved as YAML (:meth:`Plan.to_yaml`) and loaded back exactly, floats included;
:meth:`Plan.from_dict` checks every field's type and :meth:`Plan.validate` the plan's
consistency (and, given them, its match with a model's TaskGraphs and a cluster), so a hand-edited
file fails on load with the name of the bad field.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

from whalelike.errors import SpecError

SCHEMA_VERSION = 1
SOLVERS = ("ilp", "greedy")


class PlanError(SpecError):
    """A plan cannot be made, or a plan (file) is inconsistent or made for another model/cluster."""


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
    batchnorm: list[str] = field(default_factory=list)  # BatchNorm modules in training mode (whalelike.batchnorm)


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
    sync_batchnorm: bool = False   # BatchNorm statistics over each stage's data-parallel group (runtime.batchnorm)
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

    # -- serialisation ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> "Plan":
        """Build a Plan from plain data, checking every field's presence and type (no consistency
        checks: call :meth:`validate`, as :meth:`from_yaml` does)."""
        return _convert(cls, data, "plan")

    def to_yaml(self, path: str | os.PathLike) -> None:
        """Write the plan atomically: a failed write leaves no partial file behind."""
        path = os.fspath(path)
        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        fd, tmp = tempfile.mkstemp(prefix=".plan-", suffix=".yaml", dir=os.path.dirname(path) or ".")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, graphs=None, cluster=None) -> "Plan":
        """Load and validate a plan file (against ``graphs`` and ``cluster`` when given)."""
        try:
            with open(path) as f:
                data = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise PlanError(f"{os.fspath(path)}: not valid YAML: {e}") from None
        plan = cls.from_dict(data)
        plan.validate(graphs=graphs, cluster=cluster)
        return plan

    def validate(self, graphs=None, cluster=None) -> None:
        """Raise :class:`PlanError` naming the first inconsistent field (see :mod:`planner.plan_checks`)."""
        from .plan_checks import check_plan

        check_plan(self, graphs, cluster)

    def summary(self) -> str:
        """Aligned per-device table plus the predicted step time against the naive plan."""
        from .summary import plan_summary

        return plan_summary(self)


def fingerprint_of(graphs) -> str:
    """A stable hash of what the plan depends on in a model's TaskGraphs (structure and costs)."""
    own = getattr(graphs, "fingerprint", None)
    if own is not None:
        return own
    payload = {
        "graphs": [
            [tg.index, str(tg.strategy), list(tg.layers), tg.forward_flops, tg.backward_flops, tg.param_bytes,
             tg.optimizer_state_bytes, tg.activation_bytes_per_sample, sorted(tg.shardable.items())]
            for tg in graphs.graphs
        ],
        "layers": [
            [l.index, l.name, l.taskgraph, l.forward_flops, l.backward_flops, l.param_bytes,
             l.activation_bytes_per_sample, l.cut_bytes_per_sample]
            for l in graphs.layers
        ],
        "boundaries": [[b.src, b.dst, [[t.name, list(t.shape), t.dtype] for t in b.tensors]] for b in graphs.boundaries],
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


# -- typed conversion from plain data ------------------------------------------------------------
def _convert(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise PlanError(f"{where}: expected a mapping, got {type(value).__name__}")
        hints = typing.get_type_hints(tp)
        fields = {f.name: f for f in dataclasses.fields(tp)}
        unknown = sorted(set(value) - set(fields))
        if unknown:
            raise PlanError(f"{where}: unknown field(s) {', '.join(map(str, unknown))}")
        kwargs = {}
        for name, f in fields.items():
            if name in value:
                kwargs[name] = _convert(hints[name], value[name], f"{where}.{name}")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise PlanError(f"{where}: missing field {name!r}")
        return tp(**kwargs)
    if origin is typing.Union:
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, value, where)
    if origin is list:
        if not isinstance(value, list):
            raise PlanError(f"{where}: expected a list, got {value!r}")
        (item,) = typing.get_args(tp)
        return [_convert(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise PlanError(f"{where}: expected a mapping, got {value!r}")
        key, item = typing.get_args(tp)
        return {_convert(key, k, f"{where} key"): _convert(item, v, f"{where}[{k!r}]") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise PlanError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise PlanError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise PlanError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise PlanError(f"{where}: expected a string, got {value!r}")
        return value
    raise TypeError(f"{where}: no conversion for {tp!r}")
