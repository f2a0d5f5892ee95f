"""Sharding specs: which index ranges of a tensor each device of a mesh holds.

A tensor crossing a stage boundary lives on the source stage's devices with one layout and must
arrive on the destination stage's devices with another (cross-mesh resharding, seed paper 001,
section 2.2). This module describes such a layout as plain data: a :class:`ShardingSpec` maps each
device (with its host) to one *box*, a ``[start, stop)`` range per dimension of the full tensor.

Why boxes rather than the paper's GSPMD strings (``S^0R``): whalelike's shards are uneven (the
planner gives data-parallel workers unequal sample counts, a ``split`` stage unequal feature
sizes), and a spec string with even tiles cannot say "rank 2 holds samples 5..7". A box per device
covers every layout the planner makes: split along the batch (uneven shares), replicated, split
along a feature dimension (uneven sizes), and their grid combinations (batch-split across
data-parallel slots x feature-split within each tensor-parallel group), padded splits included
(:func:`padded_sizes`: equal ceil-sized shards, the last ones short or empty).

Invariants (checked when a spec is built; errors name the device, the value and the fix): every
box lies inside the shape; a device appears once; a device has one host. Boxes may overlap
(replicas) and need not cover the whole tensor (a micro-batch's rows of a global-batch tensor),
and an empty box holds nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Any, Optional, Sequence

from whalelike.errors import SpecError

Range = tuple[int, int]
Box = tuple[Range, ...]


class ReshardingError(SpecError):
    """A sharding spec, link figure or mesh given to the resharding planner is wrong."""


def box_size(box: Box) -> int:
    """Number of elements in ``box`` (0 when any range is empty)."""
    return prod(max(0, hi - lo) for lo, hi in box)


def box_text(box: Box) -> str:
    """``[0:4, 0:1024]``: the box in slice notation."""
    return "[" + ", ".join(f"{lo}:{hi}" for lo, hi in box) + "]"


def padded_sizes(length: int, parts: int) -> list[int]:
    """Sizes of ``parts`` shards of ``length`` the way even-tile systems pad: every shard
    ``ceil(length / parts)`` long, the last ones short or empty (``padded_sizes(5, 4) == [2, 2, 1, 0]``)."""
    if parts < 1 or length < 0:
        raise ReshardingError(f"padded_sizes: need parts >= 1 and length >= 0, got length={length}, parts={parts}")
    tile = -(-length // parts)
    return [max(0, min(tile, length - i * tile)) for i in range(parts)]


def _device(entry: Any, where: str) -> tuple[str, str]:
    """``(name, host)`` from a pair or from a record with ``name``/``device`` and ``host`` fields
    (a :class:`whalelike.cluster.Device` or a :class:`planner.plan.Worker`)."""
    if isinstance(entry, (tuple, list)) and len(entry) == 2:
        name, host = entry
    elif hasattr(entry, "host") and (hasattr(entry, "device") or hasattr(entry, "name")):
        name, host = (entry.device if hasattr(entry, "device") else entry.name), entry.host
    else:
        raise ReshardingError(f"{where}: device {entry!r} is neither a (name, host) pair nor a record with "
                              "name/device and host fields; pass ('dev-0', 'host-a')")
    if not isinstance(name, str) or not name or not isinstance(host, str) or not host:
        raise ReshardingError(f"{where}: device {entry!r} needs a non-empty name and host, e.g. ('dev-0', 'host-a')")
    return name, host


@dataclass(frozen=True)
class Holding:
    """Device ``device`` on ``host`` holds ``box`` of the tensor."""

    device: str
    host: str
    box: Box

    @property
    def elements(self) -> int:
        return box_size(self.box)


@dataclass(frozen=True)
class ShardingSpec:
    """The layout of one tensor of full ``shape`` on one mesh: a :class:`Holding` per device, in
    mesh order. Build it with :meth:`replicated`, :meth:`split`, :meth:`grid` or :meth:`of_boxes`."""

    shape: tuple[int, ...]
    holdings: tuple[Holding, ...]

    def __post_init__(self):
        shape = tuple(self.shape)
        if not shape or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in shape):
            raise ReshardingError(f"sharding spec: shape {self.shape!r} must be a non-empty tuple of integers >= 1")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "holdings", tuple(self.holdings))
        if not self.holdings:
            raise ReshardingError("sharding spec: no devices; a mesh needs at least one device")
        hosts: dict[str, str] = {}
        for holding in self.holdings:
            if holding.device in hosts:
                raise ReshardingError(f"sharding spec: device {holding.device!r} is listed twice; list each device "
                                      "of the mesh once")
            hosts[holding.device] = holding.host
            if len(holding.box) != len(shape) or any(
                    not 0 <= lo <= hi <= n for (lo, hi), n in zip(holding.box, shape)):
                raise ReshardingError(f"sharding spec: device {holding.device!r} holds {box_text(holding.box)}, "
                                      f"which is not a [start, stop) range per dimension inside shape {shape}")

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def of_boxes(cls, shape: Sequence[int], boxes: Sequence[tuple[Any, Sequence[Range]]]) -> "ShardingSpec":
        """From ``(device, box)`` pairs; ``device`` is ``(name, host)`` or a Device/Worker record."""
        holdings = []
        for entry, box in boxes:
            name, host = _device(entry, "sharding spec")
            holdings.append(Holding(name, host, tuple((int(lo), int(hi)) for lo, hi in box)))
        return cls(tuple(shape), tuple(holdings))

    @classmethod
    def replicated(cls, shape: Sequence[int], devices: Sequence[Any]) -> "ShardingSpec":
        """Every device holds the whole tensor."""
        return cls.grid(shape, [list(devices)])

    @classmethod
    def split(cls, shape: Sequence[int], devices: Sequence[Any], dim: int, sizes: Sequence[int]) -> "ShardingSpec":
        """Device ``i`` holds the ``i``-th consecutive piece of ``sizes[i]`` along ``dim`` (uneven
        data-parallel shares along the batch, or a ``split`` stage's uneven feature shards)."""
        return cls.grid(shape, [list(devices)], col=(dim, sizes))

    @classmethod
    def grid(cls, shape: Sequence[int], mesh: Sequence[Sequence[Any]], row: Optional[tuple[int, Sequence[int]]] = None,
             col: Optional[tuple[int, Sequence[int]]] = None) -> "ShardingSpec":
        """A 2-D mesh (``mesh[i][j]``: row ``i``, column ``j``). ``row = (dim, sizes)`` splits tensor
        dimension ``dim`` across the rows (``sizes[i]`` to row ``i``); ``col`` likewise across the
        columns; None replicates along that mesh axis. Batch-split across data-parallel slots x
        feature-split within each tensor-parallel group is ``grid(shape, slots, row=(0, shares),
        col=(feature_dim, shard_sizes))``."""
        shape = tuple(shape)
        rows = [list(r) for r in mesh]
        if not rows or any(len(r) != len(rows[0]) or not r for r in rows):
            raise ReshardingError(f"sharding spec: mesh rows have lengths {[len(r) for r in rows]}; a mesh needs "
                                  "at least one row, all rows of the same non-zero length")
        row_ranges = _axis_ranges(shape, row, len(rows), "row")
        col_ranges = _axis_ranges(shape, col, len(rows[0]), "col")
        boxes = []
        for i, devices in enumerate(rows):
            for j, entry in enumerate(devices):
                box = [(0, n) for n in shape]
                for ranges, index in ((row_ranges, i), (col_ranges, j)):
                    if ranges is not None:
                        dim, spans = ranges
                        box[dim] = spans[index]
                boxes.append((entry, box))
        return cls.of_boxes(shape, boxes)

    # -- queries ---------------------------------------------------------------------------------
    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(h.device for h in self.holdings)

    @property
    def device_hosts(self) -> dict[str, str]:
        return {h.device: h.host for h in self.holdings}

    def describe(self) -> str:
        """One line per device: ``dev-0@host-a [0:3, 0:8]``."""
        return "\n".join(f"{h.device}@{h.host} {box_text(h.box)}" for h in self.holdings)


def _axis_ranges(shape: tuple[int, ...], axis: Optional[tuple[int, Sequence[int]]], count: int,
                 which: str) -> Optional[tuple[int, list[Range]]]:
    if axis is None:
        return None
    dim, sizes = axis
    sizes = [int(s) for s in sizes]
    if not isinstance(dim, int) or not 0 <= dim < len(shape):
        raise ReshardingError(f"sharding spec: {which} split dimension {dim!r} is not a dimension of shape {shape}; "
                              f"use 0..{len(shape) - 1}")
    if len(sizes) != count or any(s < 0 for s in sizes) or sum(sizes) != shape[dim]:
        raise ReshardingError(f"sharding spec: {which} sizes {sizes} along dim {dim} must be {count} non-negative "
                              f"integers summing to {shape[dim]} (shape {shape}); padded_sizes({shape[dim]}, {count}) "
                              "gives even padded shards")
    spans, start = [], 0
    for size in sizes:
        spans.append((start, start + size))
        start += size
    return dim, spans


def stage_output_spec(plan, layout, stage: int, micro_batch: int, sample_shape: Sequence[int],
                      feature_dim: Optional[int] = None, feature_sizes: Optional[Sequence[int]] = None
                      ) -> ShardingSpec:
    """The spec of a boundary tensor of one micro-batch on ``stage``'s workers (every replica).

    The full tensor is ``(plan.global_batch_size, *sample_shape)``; each worker holds its rows of
    micro-batch ``micro_batch`` (:class:`planner.shares.layout.SampleLayout`). Without ``feature_dim`` the
    members of a tensor-parallel group hold the whole feature extent (replicated, as after a gather);
    with it, ``tp_index`` ``i`` holds the ``i``-th piece of ``feature_sizes`` along ``feature_dim``
    (a ``split`` stage's output leaving as shards)."""
    shape = (plan.global_batch_size, *[int(n) for n in sample_shape])
    if feature_dim is not None and not (isinstance(feature_dim, int) and 1 <= feature_dim < len(shape)):
        raise ReshardingError(f"stage_output_spec: feature_dim {feature_dim!r} must be a non-batch dimension of "
                              f"shape {shape}: 1..{len(shape) - 1}")
    workers = plan.stage_workers(stage)
    if not workers:
        raise ReshardingError(f"stage_output_spec: the plan has no workers of stage {stage}; stages are "
                              f"0..{len(plan.stages) - 1}")
    boxes = []
    for worker in workers:
        ranges = layout.ranges(worker.rank)
        if not 0 <= micro_batch < len(ranges):
            raise ReshardingError(f"stage_output_spec: micro-batch {micro_batch} does not exist on rank {worker.rank} "
                                  f"({len(ranges)} micro-batches)")
        box = [ranges[micro_batch]] + [(0, n) for n in shape[1:]]
        if feature_dim is not None and worker.tp_size > 1:
            if feature_sizes is None or len(feature_sizes) != worker.tp_size:
                raise ReshardingError(f"stage_output_spec: stage {stage} has tensor-parallel groups of "
                                      f"{worker.tp_size}; pass feature_sizes with {worker.tp_size} sizes, got "
                                      f"{feature_sizes!r}")
            _, spans = _axis_ranges(shape, (feature_dim, feature_sizes), worker.tp_size, "feature")
            box[feature_dim] = spans[worker.tp_index]
        boxes.append(((worker.device, worker.host), box))
    return ShardingSpec.of_boxes(shape, boxes)


def unbatched_rows(plan, producer: int, consumer: int, backward: bool = False
                   ) -> tuple[int, dict[int, Range], dict[int, Range]]:
    """Where a value without a batch dimension (a statistic of a micro-batch) lives when it crosses
    from stage ``producer`` to stage ``consumer``, as rows of a stacked tensor: ``(rows, holders,
    needers)``, each rank of the two stages with the ``[lo, hi)`` rows it holds or needs (empty
    when none). The one rule the runtime's crossings (:mod:`runtime.parallel.boundaries`) and the
    simulator's traffic (:mod:`planner.schedule.boundary_traffic`) both follow.

    Every worker of the producing stage computes the value from its own samples, so within a
    pipeline replica one slot's value is *the* value: the owner slot, the stage's lowest
    ``dp_index`` in the replica (exact when every worker computes the same, e.g. a statistic
    constant across samples, or when the stage has one slot per replica). Forward (``backward``
    False): one row per replica (replicas ascending); the owner slot's workers hold their replica's
    row (every member of a tensor-parallel slot holds it whole), every worker of the consuming stage
    in that replica needs it whole. Backward: each consuming slot (of one replica and ``dp_index``)
    holds the gradient over its samples; the gradient is their sum, so the rows are one per
    consuming slot (``(replica, dp_index)`` ascending), and the owner slot's workers need their
    replica's rows (to sum them in row order); the producer's other slots get no gradient for the
    value (their copies of it were not used)."""
    def slots(stage: int) -> dict[tuple[int, int], list[int]]:
        out: dict[tuple[int, int], list[int]] = {}
        for w in plan.stage_workers(stage):
            out.setdefault((w.replica, w.dp_index), []).append(w.rank)
        return dict(sorted(out.items()))

    made, used = slots(producer), slots(consumer)
    if not made or not used:
        raise ReshardingError(f"unbatched_rows: stage {producer if not made else consumer} has no workers; the "
                              f"plan's stages are 0..{len(plan.stages) - 1}")
    owner = {}
    for replica, dp_index in made:
        owner.setdefault(replica, (replica, dp_index))   # slots ascending: the first is the lowest dp_index
    if not backward:
        row = {replica: i for i, replica in enumerate(sorted(owner))}
        holders = {rank: (row[key[0]], row[key[0]] + (key == owner[key[0]])) for key, ranks in made.items()
                   for rank in ranks}
        needers = {rank: (row[key[0]], row[key[0]] + 1) for key, ranks in used.items() for rank in ranks}
        return len(row), holders, needers
    row = {key: i for i, key in enumerate(used)}
    span = {}
    for key, i in row.items():
        lo, hi = span.get(key[0], (i, i))
        span[key[0]] = (min(lo, i), max(hi, i + 1))
    holders = {rank: (row[key], row[key] + 1) for key, ranks in used.items() for rank in ranks}
    needers = {rank: span[key[0]] if key == owner[key[0]] else (span[key[0]][0],) * 2
               for key, ranks in made.items() for rank in ranks}
    return len(row), holders, needers
