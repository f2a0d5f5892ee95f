"""Decomposition of a cross-mesh resharding into unit tasks, one per unique data slice.

Seed paper 001, section 2.2: the bytes that must move are at least the tensor's size, so the
resharding is cut into *unit communication tasks*, each one data slice with the source devices
that hold it and the destination devices that need it. Here the slices are boxes of the
intersection grid of the two tilings: every box boundary of every source and destination holding
cuts its dimension, the cuts make a grid of cells, and each cell is labelled with (source devices
holding all of it, destination devices needing all of it). Neighbouring cells with the same label
are merged into larger boxes (greedily, growing along each dimension in order), so a replicated
tensor going to a replicated mesh is one task, not one per cell.

Invariant: the tasks' boxes are disjoint, and for every destination device the boxes of the tasks
naming it tile its box exactly (cells nobody needs are dropped). A needed cell no source holds is
an error naming the device, the cell and the fix. Deterministic: tasks come in the order of their
first cell (lexicographic over the grid).
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Optional

from planner.resharding.spec import Box, ReshardingError, ShardingSpec, box_size, box_text


@dataclass(frozen=True)
class UnitTask:
    """Data slice ``box``: held by the source devices ``holders``, needed by the destination
    devices ``needers`` (both in mesh order); ``elements`` entries of the tensor."""

    index: int
    box: Box
    elements: int
    holders: tuple[str, ...]
    needers: tuple[str, ...]

    def describe(self) -> str:
        return f"slice {box_text(self.box)} held by {','.join(self.holders)} needed by {','.join(self.needers)}"


def unit_tasks(src: ShardingSpec, dst: ShardingSpec) -> list[UnitTask]:
    """The unit tasks that give every device of ``dst`` its box from the devices of ``src``."""
    if src.shape != dst.shape:
        raise ReshardingError(f"resharding: source shape {src.shape} differs from destination shape {dst.shape}; "
                              "both specs must describe the same full tensor")
    rank = len(src.shape)
    live_src = [h for h in src.holdings if h.elements]
    live_dst = [h for h in dst.holdings if h.elements]
    intervals = []
    for dim in range(rank):
        cuts = sorted({edge for h in live_src + live_dst for edge in h.box[dim]})
        intervals.append(list(zip(cuts, cuts[1:])))
    # per dimension and interval: bitmask of the holdings whose range covers it
    src_masks = [_masks(live_src, dim, intervals[dim]) for dim in range(rank)]
    dst_masks = [_masks(live_dst, dim, intervals[dim]) for dim in range(rank)]
    labels: dict[tuple[int, ...], tuple[int, int]] = {}
    for cell in product(*(range(len(iv)) for iv in intervals)):
        need = _and(dst_masks[dim][i] for dim, i in enumerate(cell))
        if not need:
            continue
        have = _and(src_masks[dim][i] for dim, i in enumerate(cell))
        if not have:
            box = tuple(intervals[dim][i] for dim, i in enumerate(cell))
            device = live_dst[_first_bit(need)].device
            raise ReshardingError(f"resharding: destination device {device!r} needs {box_text(box)} but no source "
                                  "device holds it; the source spec must hold every entry the destination needs "
                                  "(check the batch shares and shard sizes of both stages)")
        labels[cell] = (have, need)
    tasks: list[UnitTask] = []
    taken: set[tuple[int, ...]] = set()
    for cell in sorted(labels):
        if cell in taken:
            continue
        lo, hi = list(cell), [i + 1 for i in cell]
        for dim in range(rank):
            while hi[dim] < len(intervals[dim]) and _uniform(labels, taken, labels[cell], lo, hi, dim):
                hi[dim] += 1
        block = list(product(*(range(a, b) for a, b in zip(lo, hi))))
        taken.update(block)
        box = tuple((intervals[dim][lo[dim]][0], intervals[dim][hi[dim] - 1][1]) for dim in range(rank))
        have, need = labels[cell]
        tasks.append(UnitTask(len(tasks), box, box_size(box), _names(live_src, have), _names(live_dst, need)))
    return tasks


def _masks(holdings, dim: int, intervals) -> list[int]:
    out = []
    for lo, hi in intervals:
        mask = 0
        for bit, holding in enumerate(holdings):
            start, stop = holding.box[dim]
            if start <= lo and hi <= stop:
                mask |= 1 << bit
        out.append(mask)
    return out


def _and(masks) -> int:
    out: Optional[int] = None
    for mask in masks:
        out = mask if out is None else out & mask
    return out or 0


def _first_bit(mask: int) -> int:
    return (mask & -mask).bit_length() - 1


def _names(holdings, mask: int) -> tuple[str, ...]:
    return tuple(h.device for bit, h in enumerate(holdings) if mask >> bit & 1)


def _uniform(labels, taken, label, lo, hi, dim) -> bool:
    """Whether the next slab along ``dim`` (index ``hi[dim]``, the current extent elsewhere) is all
    free cells carrying ``label``."""
    ranges = [range(a, b) if d != dim else range(hi[dim], hi[dim] + 1) for d, (a, b) in enumerate(zip(lo, hi))]
    return all(c not in taken and labels.get(c) == label for c in product(*ranges))
