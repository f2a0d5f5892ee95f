"""Stage boundaries as cross-mesh reshardings: how values and their gradients cross stage groups.

Why: a value produced by one stage group and consumed by another is laid out differently on the
two sides: each worker of a stage holds its uneven share of a micro-batch's samples, and every
member of a tensor-parallel group holds (forward) or needs (backward) the whole of its slot's
rows. Plain send/receive from one holder per slot to every member sends a slice across one host
interface once per receiving device; seed paper 001 (sections 3-4) sends each unique slice once
per host (broadcast along the receivers, or all-gather inside the receiving host), picks among the
holders so sender hosts share the load, and orders the transfers. :mod:`planner.resharding.reshard` plans
that; this module gives every boundary crossing of a :class:`planner.plan.Plan` its plan and runs
it with :mod:`runtime.parallel.resharding`'s split sides.

A ``split`` stage's output that only a lone column projection makes leaves as that projection's
feature shards, without the gather (:func:`runtime.tensor.shard_pass.outputs_leaving_sharded`): the
source spec then holds each member's features, and the gradient comes back as shards.

A *crossing* is one value (:class:`runtime.parallel.stage_split.ValueId`) for one consuming stage, one direction
and one micro-batch: forward, the producing stage's workers hold it, the consumer's need it;
backward, the consumer's workers hold the gradient (each member of a tensor-parallel group holds
it whole, after the group's own all-reduce) and the producer's need it. Every crossing is one
:class:`~planner.resharding.reshard.ReshardPlan` over a ``(rows, positions, features)`` tensor (the
micro-batch's samples, the value's per-sample shape as the product of all but its last dimension
and its last; its dtype's item size) whose holdings are the workers' rows from
:class:`planner.shares.layout.SampleLayout`, every replica at once (replicas hold disjoint rows, so
their unit tasks never mix); micro-batches with equal shares share one plan and program. The strategy is ``Plan.resharding`` (``auto``: the fastest predicted).
With one worker per side it is the plain send/receive of the overlapping rows, as before.

A value without a batch dimension (a statistic of the micro-batch, say; ``ValueSpec.batched``
False) is not split by samples: it crosses whole, replicated, once per micro-batch and pipeline
replica, as the rows of a stacked tensor that :func:`planner.resharding.spec.unbatched_rows` lays
out (the rule the simulator prices too). Forward, the owner slot of the producing stage in each
replica (its lowest ``dp_index``) holds its replica's row and every consuming worker of the replica
needs it; backward, each consuming slot holds its gradient as one row, the owner slot receives its
replica's rows and sums them in row order (the gradient over every sample of the micro-batch),
and the producer's other slots take a zero gradient. Values computed from constants, parameters
and shapes alone never get here: capture recomputes them in every Layer that uses them
(:mod:`whalelike.graphs.constant_copies`).

Why not torch's DTensor ``redistribute``: see :mod:`runtime.parallel.resharding` (even tiles, one mesh,
blind to hosts).

Sides: the producing stage posts its sends after the action that made the value and does not wait
for them (:meth:`ReshardProgram.post_sends`); the consuming stage blocks in
:meth:`ReshardProgram.receive` before the action that needs it, forwarding ranges to the other
receivers of its host as they arrive. Both are the runtime's existing rules (receives block, sends
do not), so :mod:`planner.schedule.deadlock`'s deadlock proof of the stage schedule still covers the stages;
the forwarding inside a receiving stage is between workers at the same action of the same schedule.

Tags: crossing ``i`` (its index in one canonical order every rank derives from the plan: micro-batch,
direction, value, consumer) uses ``i * stride ..``, ``stride = 2**30 // crossings`` (below the
emulated network's stamp tags); a crossing with more messages than ``stride`` is an error.

Invariant: after :meth:`BoundaryExchange.receive` returns, the buffer holds exactly the producer's
rows (or gradient rows) it covers, bitwise, whatever the strategy.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from planner.shares.layout import SampleLayout
from planner.devices.network import NetworkModel
from planner.plan import Plan
from planner.resharding.reshard import BOUNDARY_MAX_NODES, ReshardPlan, ShardingSpec, plan_resharding
from planner.resharding.spec import unbatched_rows
from runtime.emulation.network import STAMP_TAG, NetworkEmulator
from runtime.parallel.resharding import Posted, ReshardProgram, compile_resharding, device_ranks
from runtime.parallel.stage_split import PipelineSplit, ValueId, ValueSpec
from whalelike.errors import WhaleError

__all__ = ["Crossing", "BoundaryExchange", "BoundaryError", "default_network"]

# Link figures when neither the cluster nor the emulated network is known: NVLink-class inside a
# host, 100 Gb/s Ethernet between hosts. They only rank the strategies; every one is exact.
DEFAULT_INTRA_HOST_GBPS = 150.0
DEFAULT_INTER_HOST_GBPS = 12.5
DEFAULT_LATENCY_US = 5.0


class BoundaryError(WhaleError):
    """A stage boundary cannot be planned or run as a resharding."""


@dataclass(frozen=True)
class Crossing:
    """``value`` for ``consumer`` stage in ``direction`` (``"F"``: the value, producer ->
    consumer; ``"B"``: its gradient, consumer -> producer) of micro-batch ``micro_batch``."""

    value: ValueId
    consumer: int
    direction: str
    micro_batch: int

    @property
    def source_stage(self) -> int:
        return self.value.stage if self.direction == "F" else self.consumer

    @property
    def destination_stage(self) -> int:
        return self.consumer if self.direction == "F" else self.value.stage


def default_network(plan: Plan) -> NetworkModel:
    """A network of ``plan``'s hosts with the module's default figures."""
    return NetworkModel.of_hosts(DEFAULT_INTRA_HOST_GBPS, DEFAULT_INTER_HOST_GBPS, DEFAULT_LATENCY_US,
                                 sorted({w.host for w in plan.workers}))


class BoundaryExchange:
    """Every boundary crossing of ``plan`` that plan rank ``rank`` takes part in, planned once per
    value shapes and run on ``group`` (plan rank ``r`` is rank ``r`` of ``group``).

    ``network``: the link figures the plans are priced with (the cluster's; default
    :func:`default_network`); ``emulated``: this rank's :class:`NetworkEmulator` on an emulated
    network (its model is then the figures used, and every message is padded to its modeled time).
    ``feature_shards``: values that leave their (tensor-parallel) stage as shards of the last
    dimension, with the shard size of each ``tp_index``
    (:func:`runtime.tensor.shard_pass.outputs_leaving_sharded`); their gradients come back sharded
    alike. The same on every rank.
    """

    def __init__(self, plan: Plan, split: PipelineSplit, rank: int, group: Optional[dist.ProcessGroup] = None,
                 network: Optional[NetworkModel] = None, emulated: Optional[NetworkEmulator] = None,
                 max_nodes: int = BOUNDARY_MAX_NODES, feature_shards: Optional[Mapping[ValueId, Sequence[int]]] = None):
        self.plan, self.split, self.rank = plan, split, rank
        self.feature_shards = {v: list(sizes) for v, sizes in (feature_shards or {}).items()}
        self.group = group if group is not None else dist.group.WORLD
        self.emulated = emulated
        self.network = emulated.model if emulated is not None else (network or default_network(plan))
        self.max_nodes = max_nodes
        self.ranks = device_ranks(plan, self.group)
        self.global_rank = dist.get_global_rank(self.group, rank) if self.group is not dist.group.WORLD else rank
        pairs = sorted({(v, c) for stage in split.stages for v in stage.outputs for c in split.consumers(v)},
                       key=lambda vc: (vc[0].stage, vc[0].index, vc[1]))
        self.pairs: tuple[tuple[ValueId, int], ...] = tuple(pairs)
        self._compiled: dict[tuple, ReshardProgram] = {}   # (source spec, destination spec, item size) -> program
        self.set_plan(plan)

    def set_plan(self, plan: Plan) -> None:
        """Take ``plan``'s micro-batch sizes and count: a plan of the same workers, stages, shards,
        resharding strategy and boundary values as the one in force, which only moves samples
        (:meth:`runtime.parallel.pipeline.PipelineExecutor.set_plan` checks that). What depends on
        the sizes is derived again (the sample layout, the tag stride, which program each crossing
        runs); the compiled programs stay, keyed by their source and destination specs, which hold
        the rows, so shares seen before (a straggler that recovers) reuse theirs. No communication."""
        self.plan = plan
        self.layout = SampleLayout.of(plan)
        self.stride = STAMP_TAG // max(1, plan.num_micro_batch * 2 * len(self.pairs))
        self._programs: dict[tuple, ReshardProgram] = {}
        self._unbatched: dict[tuple, tuple] = {}   # (producer, consumer, backward) -> unbatched_rows

    # -- what this rank does at each action -----------------------------------------------------------
    def crossings(self, stage: int, micro_batch: int, direction: str, side: str,
                  peer: Optional[int] = None) -> list[Crossing]:
        """The crossings of ``micro_batch`` in ``direction`` whose ``side`` (``"source"`` or
        ``"destination"``) is ``stage``, in the canonical order; with ``peer``, only those whose
        other side is stage ``peer`` (one send or receive action of a program,
        :mod:`planner.schedule.program`)."""
        out = []
        for value, consumer in self.pairs:
            crossing = Crossing(value, consumer, direction, micro_batch)
            here, there = ((crossing.source_stage, crossing.destination_stage) if side == "source"
                           else (crossing.destination_stage, crossing.source_stage))
            if here == stage and (peer is None or there == peer):
                out.append(crossing)
        return out

    def rows(self, crossing: Crossing, spec: ValueSpec, samples: int) -> int:
        """How many rows of ``crossing`` this rank holds (on the source side) or needs (on the
        destination side): its ``samples`` of the micro-batch for a batched value; for one without
        a batch dimension, its rows of :func:`planner.resharding.spec.unbatched_rows` (forward 0 or
        1; backward, on the producer's owner slot, one per consuming slot of its replica)."""
        if spec.batched:
            return samples
        key = (crossing.value.stage, crossing.consumer, crossing.direction == "B")
        if key not in self._unbatched:
            self._unbatched[key] = unbatched_rows(self.plan, *key)
        _, holders, needers = self._unbatched[key]
        stage = self.plan.worker(self.rank).stage
        lo, hi = (holders if stage == crossing.source_stage else needers)[self.rank]
        return hi - lo

    def send(self, crossing: Crossing, rows: torch.Tensor, specs: Mapping[ValueId, ValueSpec]) -> Posted:
        """Post this rank's sends of ``crossing`` (``rows``: its rows of the value or gradient,
        ``(samples, *shape)``; a value without a batch dimension, or its gradient, as it is: sent
        where this rank holds its row, :meth:`rows`); wait for the returned sends before changing
        ``rows``."""
        program = self.program(crossing, specs)
        spec = specs[crossing.value]
        if not spec.batched:
            rows = rows.unsqueeze(0)[:self.rows(crossing, spec, 0)]
        return program.post_sends(_flat(rows.detach()), self.group, self._tag_base(crossing, program),
                                  self.global_rank, self.emulated)

    def receive(self, crossing: Crossing, into: torch.Tensor, specs: Mapping[ValueId, ValueSpec]) -> Posted:
        """Fill ``into`` (this rank's rows, ``(rows, *shape)`` with :meth:`rows` rows, contiguous)
        with ``crossing``'s rows; returns once they are all here, with the ranges it forwarded
        pending. For a value without a batch dimension the rows are stacked whole values (forward:
        one; backward: the consuming slots' gradients, to be summed)."""
        program = self.program(crossing, specs)
        if not into.is_contiguous():
            raise BoundaryError(f"boundary {crossing}: the receive buffer must be contiguous (it is written in place)")
        return program.receive(_flat(into), self.group, self._tag_base(crossing, program),
                               self.global_rank, self.emulated)

    # -- plans -------------------------------------------------------------------------------------------
    def program(self, crossing: Crossing, specs: Mapping[ValueId, ValueSpec]) -> ReshardProgram:
        """The compiled resharding of ``crossing`` for values of ``specs``' shapes (cached)."""
        spec = specs[crossing.value]
        key = (crossing, tuple(spec.shape), spec.dtype)
        if key not in self._programs:
            src, dst = self.specs(crossing, spec)
            itemsize = torch.empty((), dtype=spec.dtype).element_size()
            plan_key = (src, dst, itemsize)   # micro-batches of equal shares share it (compact rows)
            if plan_key not in self._compiled:
                plan = plan_resharding(src, dst, self.network, itemsize=itemsize, strategy=self.plan.resharding,
                                       max_nodes=self.max_nodes)
                self._compiled[plan_key] = compile_resharding(plan, src, dst, self.ranks)
            self._programs[key] = self._compiled[plan_key]
        return self._programs[key]

    def specs(self, crossing: Crossing, spec: ValueSpec) -> tuple[ShardingSpec, ShardingSpec]:
        """Source and destination :class:`ShardingSpec` of ``crossing`` over the micro-batch's
        value as ``(rows, positions, features)`` (its per-sample shape's last dimension, and the
        product of the others): each worker of a stage holds (needs) its rows of the micro-batch
        and every feature, or, on the producing stage of a value in ``feature_shards``, its
        ``tp_index``'s features. Rows are :meth:`planner.shares.layout.SampleLayout.micro_batch_rows`
        (the micro-batch's blocks of samples end to end from 0), so micro-batches with equal shares
        have equal specs and share one plan (a box matters only relative to its holder's box). A
        value without a batch dimension is ``(rows, positions, features)`` of whole values stacked
        by :func:`planner.resharding.spec.unbatched_rows` (its ``shape`` is the whole value's)."""
        features = spec.shape[-1] if spec.shape else 1
        if spec.batched:
            rows, holdings = self.layout.micro_batch_rows(crossing.micro_batch)
            held = needed = holdings
        else:   # stacked whole values: planner.resharding.spec.unbatched_rows, the one rule
            rows, held, needed = unbatched_rows(self.plan, crossing.value.stage, crossing.consumer,
                                                crossing.direction == "B")
        shape = (rows, prod(spec.shape[:-1]), features)
        return (self._spec(crossing.source_stage, shape, crossing.value, held),
                self._spec(crossing.destination_stage, shape, crossing.value, needed))

    def local_shape(self, value: ValueId, spec: ValueSpec, stage: int, tp_index: int) -> tuple[int, ...]:
        """The per-sample shape of ``value`` (or its gradient) on a worker of ``stage``."""
        sizes = self.feature_shards.get(value) if stage == value.stage else None
        return tuple(spec.shape) if sizes is None else (*spec.shape[:-1], sizes[tp_index])

    @property
    def program_count(self) -> int:
        """Distinct compiled programs so far (micro-batches with equal shares share one)."""
        return len(self._compiled)

    def plans(self) -> dict[Crossing, ReshardPlan]:
        """Each crossing planned so far -> its plan (for logs and tests)."""
        return {key[0]: program.plan for key, program in self._programs.items()}

    def _spec(self, stage: int, shape: Sequence[int], value: ValueId, rows: Mapping[int, tuple[int, int]]
              ) -> ShardingSpec:
        sizes = self.feature_shards.get(value) if stage == value.stage else None
        boxes = []
        for w in self.plan.stage_workers(stage):
            features = (0, shape[2]) if sizes is None else (sum(sizes[:w.tp_index]), sum(sizes[:w.tp_index + 1]))
            boxes.append(((w.device, w.host), [rows[w.rank], (0, shape[1]), features]))
        return ShardingSpec.of_boxes(shape, boxes)

    def _tag_base(self, crossing: Crossing, program: ReshardProgram) -> int:
        slot = (crossing.micro_batch * 2 + (crossing.direction == "B")) * len(self.pairs) + \
            self.pairs.index((crossing.value, crossing.consumer))
        if program.message_count > self.stride:
            raise BoundaryError(f"boundary {crossing}: {program.message_count} messages, more than the {self.stride} "
                                f"tags each crossing gets ({self.plan.num_micro_batch} micro-batches x "
                                f"{len(self.pairs)} boundary values x 2 directions share 2**30); use fewer "
                                "micro-batches or Plan.resharding 'send_recv' (fewer, larger messages)")
        return slot * self.stride


def _flat(rows: torch.Tensor) -> Optional[torch.Tensor]:
    """``(rows, *shape)`` as the ``(rows, positions, features)`` tensor a resharding moves (a view of
    a contiguous one, so a receive writes in place), or None when it holds nothing."""
    if not rows.numel():
        return None
    return rows.reshape(rows.shape[0], -1, rows.shape[-1] if rows.dim() > 1 else 1)
