"""Uneven shard sizes for tensor parallelism (``split``) on unequal devices.

Whale balances tensor parallelism by sharding unevenly: a device twice as fast holds twice the
columns. ``torch.distributed.tensor`` (DTensor) only shards evenly, so the sizes are computed
here and the runtime builds its sharded Linears from them.

What is cut is a shard group (``TaskGraph.shard_groups``, :mod:`whalelike.sharding.groups`): an
attention block into heads (grouped-query attention: key/value heads with their query heads;
multi-query attention: query heads, its k/v projections replicated, outside every group and so
priced as unsharded work), an MLP or a lone projection into features, a mixture-of-experts layer
into whole experts (expert parallelism, :mod:`whalelike.sharding.experts`: a faster device holds
more experts; its router runs whole on every device). Every member of a group
gets the same units per device, so q/k/v/o (or gate/up/down, or GPT-2's fused ``c_attn``) line
up. Feature units are cut in granules of 8 when the dimension is a multiple of 8 with at least 8 per
device (tensor cores and vectorised kernels want aligned sizes), heads one by one; each device gets
at least one granule, shares are proportional to speed, and the memory cap of each device bounds its
share (Whale Algorithm 1 on granules, see :mod:`planner.shares.batch_shares`). A stage uses one layout for
all its tensor-parallel groups, because data-parallel replicas of a shard must have identical shapes
to all-reduce their gradients.

The resulting per-device *fraction* of the stage (its compute time and memory) counts only the
sharded work as divided: whatever a ``split`` region leaves unsharded (layer norms, embeddings,
residual adds) runs whole on every device, so it is never predicted to speed up.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from whalelike.sharding.groups import ShardGroup, ShardMember

from planner.devices.memory import UNBOUNDED_SAMPLES
from planner.shares.batch_shares import DoesNotFit, Slot, balanced_shares
from planner.plan import PlanError

GRANULE = 8
_VIRTUAL_UNITS = 1024   # resolution of the shard fractions of a stage with no shardable dimension


@dataclass(frozen=True)
class ShardLayout:
    """Shard sizes per module path (one entry per tensor-parallel index) and the resulting share
    of the stage's work and memory per index (shares sum to more than 1 when part of the stage is
    replicated: every rank runs that part whole). ``unit_shares``: per index, its share of the
    groups' units alone (weighted as the fractions are), which the memory model applies to the
    activations the groups divide (:func:`planner.devices.memory.activation_shard`); None for a
    layout made by hand (then the fractions price everything, as before)."""

    shard_sizes: dict[str, list[int]]
    fractions: list[float]
    unit_shares: Optional[list[float]] = None

    def unit_share(self, index: int) -> Optional[float]:
        return None if self.unit_shares is None else self.unit_shares[index]


def granularity(dim: int, parts: int) -> int:
    return GRANULE if dim % GRANULE == 0 and dim // GRANULE >= parts else 1


def split_dimension(dim: int, speeds: Sequence[float], max_fractions: Sequence[float],
                    granule: Optional[int] = None) -> list[int]:
    """Sizes of ``dim`` per device, proportional to ``speeds``, each at most ``max_fractions[i]``
    of ``dim`` (memory), each at least one granule (default :func:`granularity`), summing exactly to ``dim``."""
    parts = len(speeds)
    if dim < parts:
        raise ValueError(f"a dimension of size {dim} cannot be split over {parts} devices")
    g = granularity(dim, parts) if granule is None else granule
    units = dim // g
    # a device with room for the stage many times over may have an infinite share (1e300 GiB / need)
    slots = [Slot(s, math.floor(min(f * units, UNBOUNDED_SAMPLES))) for s, f in zip(speeds, max_fractions)]
    if any(s.cap < 1 for s in slots):
        raise DoesNotFit(units - sum(max(s.cap, 0) for s in slots), sum(max(s.cap, 0) for s in slots))
    shares = balanced_shares(units, slots, lambda i, n: n / slots[i].cap)
    return [n * g for n in shares]


def groups_of(shardable: dict[str, int], groups: Sequence[ShardGroup] = ()) -> list[ShardGroup]:
    """``groups``, or for a TaskGraph made without them one group per ``shardable`` entry."""
    if groups:
        return list(groups)
    return [ShardGroup(dim, (ShardMember(path, "column", 1),), "lone") for path, dim in shardable.items()]


def split_group(group: ShardGroup, speeds: Sequence[float], max_fractions: Sequence[float]) -> list[int]:
    """Units of ``group`` per device. Attention heads (and any unit wider than one feature) and the
    experts of a mixture-of-experts layer (kind ``"experts"``) are cut one by one; feature units in
    granules of 8 where they allow it."""
    if group.units < len(speeds):
        raise PlanError(
            f"split over {len(speeds)} devices: the {group.describe()} cannot give every device a unit; "
            f"use split({group.units}) or fewer devices for this region"
        )
    features = all(m.per_unit == 1 for m in group.members) and group.kind != "experts"
    return split_dimension(group.units, speeds, max_fractions, None if features else 1)


def shard_layout(shardable: dict[str, int], speeds: Sequence[float], max_fractions: Sequence[float],
                 groups: Sequence[ShardGroup] = (), stage_flops: float = 0.0) -> ShardLayout:
    """Uneven shards of every group (or every dimension in ``shardable``) over devices of relative ``speeds``.

    ``max_fractions[i]`` is the largest share of the stage device ``i`` can hold in memory
    (:func:`planner.devices.memory.max_shard`: every memory term scales with the shard). Every
    member of a group gets the same units per device (whole heads for q/k/v/o). ``stage_flops``:
    the stage's FLOPs per sample; the part of it no group shards (``ShardGroup.flops_per_sample``)
    runs whole on every device, so it counts fully in every device's fraction. Without group FLOPs
    (hand-made TaskGraphs) all of the stage counts as sharded.
    Raises :class:`~planner.shares.batch_shares.DoesNotFit` when the devices cannot hold the stage.
    """
    chosen = groups_of(shardable, groups)
    replicated = _replicated_share(chosen, stage_flops)
    # a device's fraction is replicated + (1 - replicated) * its share of the units: cap the share
    max_fractions = [(f - replicated) / (1.0 - replicated) if replicated < 1.0 else 1.0 for f in max_fractions]
    if sum(max_fractions) < 1 or min(max_fractions) <= 0:
        raise DoesNotFit(1, 0)
    if not chosen:
        shares = [n / _VIRTUAL_UNITS for n in split_dimension(_VIRTUAL_UNITS, speeds, max_fractions)]
        return ShardLayout({}, shares, shares)
    return _priced(chosen, [split_group(group, speeds, max_fractions) for group in chosen], replicated)


def _priced(chosen: Sequence[ShardGroup], units: Sequence[Sequence[int]], replicated: float) -> ShardLayout:
    """The layout giving ``units[k][i]`` units of group ``chosen[k]`` to device ``i``, with each
    device's fraction of the stage (``replicated`` of it runs whole on every device)."""
    sizes: dict[str, list[int]] = {}
    weights, shares = [], []
    for group, counts in zip(chosen, units):
        sizes.update(group.sizes(counts))
        weights.append(group.flops_per_sample if group.flops_per_sample > 0
                       else sum(group.dim(m) for m in group.members))
        shares.append([n / group.units for n in counts])
    total = sum(weights)
    local = [sum(w * share[i] for w, share in zip(weights, shares)) / total for i in range(len(units[0]))]
    return ShardLayout(sizes, [replicated + (1.0 - replicated) * f for f in local], local)


def layout_of_sizes(shardable: dict[str, int], shard_sizes: dict[str, list[int]], parts: int,
                    groups: Sequence[ShardGroup] = (), stage_flops: float = 0.0) -> ShardLayout:
    """The :class:`ShardLayout` of given ``shard_sizes`` (a plan's ``StagePlan.shard_sizes`` over
    ``parts`` devices), priced as :func:`shard_layout` prices its own: for a re-plan that keeps them."""
    chosen = groups_of(shardable, groups)
    if not chosen:
        if parts != 1:
            raise ValueError(f"layout_of_sizes: nothing is shardable, so {parts} devices cannot hold shards")
        return ShardLayout({}, [1.0])
    units = []
    for group in chosen:
        member = next((m for m in group.members if m.path in shard_sizes), None)
        counts = None if member is None else group.units_of(member.path, shard_sizes[member.path])
        if counts is None or len(counts) != parts or sum(counts) != group.units:
            raise ValueError(f"layout_of_sizes: shard_sizes {shard_sizes!r} do not cut the {group.describe()} "
                             f"into whole units over {parts} devices; pass the sizes of a valid plan")
        units.append(counts)
    return _priced(chosen, units, _replicated_share(chosen, stage_flops))


def _replicated_share(chosen: Sequence[ShardGroup], stage_flops: float) -> float:
    """The share of the stage's FLOPs that no group shards (it runs whole on every device)."""
    sharded = sum(g.flops_per_sample for g in chosen)
    return 1.0 - min(sharded / stage_flops, 1.0) if stage_flops > 0 and sharded > 0 else 0.0


def even_layout(shardable: dict[str, int], parts: int, groups: Sequence[ShardGroup] = (),
                stage_flops: float = 0.0) -> ShardLayout:
    """The capacity-blind layout: equal shards (the naive plan)."""
    return shard_layout(shardable, [1.0] * parts, [1.0] * parts, groups, stage_flops)
