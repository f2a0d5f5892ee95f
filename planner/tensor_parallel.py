"""Uneven shard sizes for tensor parallelism (``split``) on unequal devices.

Whale balances tensor parallelism by sharding unevenly: a device twice as fast holds twice the
columns. ``torch.distributed.tensor`` (DTensor) only shards evenly, so the sizes are computed
here and the runtime builds its sharded Linears from them.

Every sharded dimension (``TaskGraph.shardable``: Linear output features, classifier classes) is
split into granules of 8 when the dimension is a multiple of 8 with at least 8 per device (tensor
cores and vectorised kernels want aligned sizes), else into single elements; each device gets at
least one granule, shares are proportional to speed, and the memory cap of each device bounds its
share (Whale Algorithm 1 on granules, see :mod:`planner.data_parallel`). A stage uses one layout
for all its tensor-parallel groups, because data-parallel replicas of a shard must have identical
shapes to all-reduce their gradients.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from .data_parallel import DoesNotFit, Slot, balanced_shares

GRANULE = 8
_VIRTUAL_UNITS = 1024   # resolution of the shard fractions of a stage with no shardable dimension


@dataclass(frozen=True)
class ShardLayout:
    """Shard sizes per module path (one entry per tensor-parallel index) and the resulting share
    of the stage's work and memory per index."""

    shard_sizes: dict[str, list[int]]
    fractions: list[float]


def granularity(dim: int, parts: int) -> int:
    return GRANULE if dim % GRANULE == 0 and dim // GRANULE >= parts else 1


def split_dimension(dim: int, speeds: Sequence[float], max_fractions: Sequence[float]) -> list[int]:
    """Sizes of ``dim`` per device, proportional to ``speeds``, each at most ``max_fractions[i]``
    of ``dim`` (memory), each at least one granule, summing exactly to ``dim``."""
    parts = len(speeds)
    if dim < parts:
        raise ValueError(f"a dimension of size {dim} cannot be split over {parts} devices")
    g = granularity(dim, parts)
    units = dim // g
    slots = [Slot(s, math.floor(f * units)) for s, f in zip(speeds, max_fractions)]
    if any(s.cap < 1 for s in slots):
        raise DoesNotFit(units - sum(max(s.cap, 0) for s in slots), sum(max(s.cap, 0) for s in slots))
    shares = balanced_shares(units, slots, lambda i, n: n / slots[i].cap)
    return [n * g for n in shares]


def shard_layout(shardable: dict[str, int], speeds: Sequence[float], max_fractions: Sequence[float]) -> ShardLayout:
    """Uneven shards of every dimension in ``shardable`` over devices of relative ``speeds``.

    ``max_fractions[i]`` is the largest share of the stage device ``i`` can hold in memory.
    Raises :class:`~planner.data_parallel.DoesNotFit` when the devices cannot hold the stage.
    """
    if sum(max_fractions) < 1:
        raise DoesNotFit(1, 0)
    sizes = {path: split_dimension(dim, speeds, max_fractions) for path, dim in shardable.items()}
    if sizes:
        total = sum(shardable.values())
        fractions = [sum(s[i] for s in sizes.values()) / total for i in range(len(speeds))]
    else:
        fractions = [n / _VIRTUAL_UNITS for n in split_dimension(_VIRTUAL_UNITS, speeds, max_fractions)]
    return ShardLayout(sizes, fractions)


def even_layout(shardable: dict[str, int], parts: int) -> ShardLayout:
    """The capacity-blind layout: equal shards (the naive plan)."""
    return shard_layout(shardable, [1.0] * parts, [1.0] * parts)
