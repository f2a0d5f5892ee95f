"""The sample layout of a Plan: which rank processes which samples of each global batch.

Every rank holds (or reads) the same global batch of ``plan.global_batch_size`` samples and takes
its part locally, so no sample is ever sent. The parts:

* A *slot* is one data-parallel position of a stage: the workers of one replica, stage and
  ``dp_index``, i.e. one tensor-parallel group (a single worker without ``split``). The members of
  a slot process the same samples, so they share their ranges.
* **Replica-major**: replica ``r`` owns one contiguous block of the global batch, after the blocks
  of replicas ``0..r-1``.
* A **single-stage** plan exchanges nothing between ranks, so each slot takes one contiguous share
  of ``batch_share`` samples, slots in ``dp_index`` order, and inside it micro-batch ``m`` is the
  next ``micro_batch_sizes[m]`` samples. Slots may differ in micro-batch count (Poplar's per-device
  gradient accumulation). A rank's share is then ``[offset, offset + share)``.
* A **multi-stage** plan moves sample slices between stages per micro-batch, so the block of a
  replica is cut **micro-batch-major**: micro-batch ``m`` is a contiguous block (the sum of the
  slots' ``micro_batch_sizes[m]``, equal in every stage), and slot ``dp_index = i`` of each stage
  takes the ``i``-th piece of it. A rank's samples are then not contiguous: use :meth:`ranges`.
* A **short batch** (the last, partial batch of an epoch, or an evaluation batch of another size)
  of ``n`` samples is split over a data-parallel group in proportion to its shares
  (:func:`proportional_split`), each rank again taking a contiguous slice in group order; inside a
  rank's short share, micro-batches are at most the plan's largest (:meth:`micro_batches`).

The data-parallel group of a rank (the workers holding the same parameters: same stage and
``tp_index``, every replica and ``dp_index``) is ordered by ``(replica, dp_index)``, the order of
``runtime.groups`` ``"dp"`` groups; in a single-stage plan that is also the order of the shares in
the batch.

Invariant: every sample of a global batch is processed by exactly one slot of every stage (each
stage's ranges tile ``[0, global_batch_size)``), and the members of a tensor-parallel slot share
their ranges. ``tests/test_layout.py`` checks it on planner-made and hand-made plans.

Why it lives in ``planner/``: it is pure data derived from the Plan (no process group, no tensors),
and three users must agree on it exactly: the pipeline executor (which rank sends which slice to
which), the data-parallel executor (each rank's offset and micro-batches), and the sampler (which
dataset indices a rank reads). Computing it once, here, replaces three copies kept in step by
comments, and a re-planned Plan (new shares at run time) yields its new layout in one call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from planner.errors import GlobalBatchError, PlanError
from planner.groups import groups_of
from planner.plan_record import PlanRecord, Worker
from planner.shares.batch_shares import LARGEST_REMAINDER, proportional_shares

Range = tuple[int, int]


def proportional_split(n: int, weights: Sequence[float]) -> list[int]:
    """``n`` as integers in proportion to ``weights`` (largest remainder, ties to the lower index:
    :func:`planner.shares.batch_shares.proportional_shares`).

    Every positive weight gets at least one item while items last (so no rank is idle in a short
    batch that could feed it); zero weights get nothing.
    """
    if n < 0 or any(w < 0 for w in weights) or not any(w > 0 for w in weights):
        raise ValueError(f"proportional_split: need n >= 0 and non-negative weights with a positive one, "
                         f"got n={n}, weights={list(weights)}")
    out = proportional_shares(n, weights, leftover=LARGEST_REMAINDER)
    idle = sorted((i for i, w in enumerate(weights) if w > 0 and out[i] == 0), key=lambda i: (-weights[i], i))
    for i in idle:
        donor = max(range(len(out)), key=lambda j: (out[j], j))
        if out[donor] < 2:
            break
        out[donor] -= 1
        out[i] += 1
    return out


def check_global_batch(plan: PlanRecord, n: int, where: str, what: str = "the batch") -> None:
    """A step that takes whole global batches needs ``plan.global_batch_size`` samples: every rank
    holds all of them and takes its part by this layout. Raises :class:`~planner.errors.GlobalBatchError`
    starting with ``where`` (e.g. ``"rank 1, step 3"``) and naming ``what`` (``"the batch"``,
    ``"input 0"``, ``"targets"``) with its size, the plan's shares and the fix."""
    gbs = plan.global_batch_size
    if n == gbs:
        return
    shares = [w.batch_share for w in plan.workers if w.stage == 0 and w.tp_index == 0]
    raise GlobalBatchError(
        f"{where}: {what} has {n} samples but the plan's shares {shares} need global_batch_size={gbs}; pass "
        f"whole global batches (DataLoader(batch_size={gbs}, drop_last=True)) or use runtime.data.UnevenLoader"
    )


def batch_split(n: int, shares: Sequence[int]) -> list[int]:
    """The sizes of a batch of ``n`` samples over ``shares`` (group order): the shares themselves
    for a whole batch (``n == sum(shares)``), else :func:`proportional_split` of ``n`` over them."""
    return list(shares) if n == sum(shares) else proportional_split(n, shares)


def slice_of(n: int, shares: Sequence[int], index: int) -> Range:
    """Position ``index``'s contiguous ``[lo, hi)`` of a batch of ``n`` samples (:func:`batch_split`)."""
    sizes = batch_split(n, shares)
    lo = sum(sizes[:index])
    return lo, lo + sizes[index]


@dataclass(frozen=True)
class SampleLayout:
    """The layout of one Plan (see the module docstring). Build it with :meth:`of`.

    ``rank_ranges[r]``: rank ``r``'s global ``[start, stop)`` per micro-batch. ``rank_micro_batches[r]``:
    its ``micro_batch_sizes``. ``dp_groups``: every data-parallel group, ranks in ``(replica,
    dp_index)`` order; ``rank_dp_group[r]`` indexes it.
    """

    global_batch_size: int
    num_stages: int
    rank_ranges: tuple[tuple[Range, ...], ...]
    rank_micro_batches: tuple[tuple[int, ...], ...]
    dp_groups: tuple[tuple[int, ...], ...]
    rank_dp_group: tuple[int, ...]

    @classmethod
    def of(cls, plan: PlanRecord) -> "SampleLayout":
        """The layout of ``plan`` (assumed valid: :meth:`planner.plan.Plan.validate`)."""
        ranges = _single_stage_ranges(plan) if len(plan.stages) == 1 else _pipeline_ranges(plan)
        dp_groups = tuple(tuple(w.rank for w in ws) for ws in groups_of(plan.workers, "dp").values())
        group_of = {r: g for g, ranks in enumerate(dp_groups) for r in ranks}
        return cls(
            global_batch_size=plan.global_batch_size,
            num_stages=len(plan.stages),
            rank_ranges=tuple(tuple(ranges[w.rank]) for w in plan.workers),
            rank_micro_batches=tuple(tuple(w.micro_batch_sizes) for w in plan.workers),
            dp_groups=dp_groups,
            rank_dp_group=tuple(group_of[w.rank] for w in plan.workers),
        )

    @property
    def world_size(self) -> int:
        return len(self.rank_ranges)

    @property
    def contiguous(self) -> bool:
        """Whether each rank's samples are one contiguous slice (single-stage plans)."""
        return self.num_stages == 1

    def ranges(self, rank: int) -> list[Range]:
        """Rank ``rank``'s global ``[start, stop)`` of each of its micro-batches."""
        return list(self.rank_ranges[self._check(rank)])

    def all_ranges(self) -> dict[int, list[Range]]:
        """Rank -> :meth:`ranges`, for every rank."""
        return {r: list(rs) for r, rs in enumerate(self.rank_ranges)}

    def micro_batch_rows(self, micro_batch: int) -> tuple[int, dict[int, Range]]:
        """Micro-batch ``micro_batch`` of a multi-stage plan with its rows renumbered without gaps
        (its blocks of global samples, one per replica, end to end from 0): the row count and each
        rank's ``[lo, hi)`` in those rows. Micro-batches of equal shares give equal results (what
        lets boundary reshardings share one plan)."""
        blocks: list[Range] = []   # the micro-batch's maximal runs of global samples, in order
        for start, stop in sorted(ranges[micro_batch] for ranges in self.rank_ranges):
            if blocks and start <= blocks[-1][1]:
                blocks[-1] = (blocks[-1][0], max(blocks[-1][1], stop))
            else:
                blocks.append((start, stop))
        offsets, total = [], 0
        for start, stop in blocks:
            offsets.append((start, stop, total - start))
            total += stop - start
        rows = {}
        for rank, ranges in enumerate(self.rank_ranges):
            start, stop = ranges[micro_batch]
            shift = next(shift for lo, hi, shift in offsets if lo <= start < hi)
            rows[rank] = (start + shift, stop + shift)
        return total, rows

    def micro_batch_sizes(self, rank: int) -> list[int]:
        return list(self.rank_micro_batches[self._check(rank)])

    def share(self, rank: int) -> int:
        """How many samples of a global batch ``rank`` processes."""
        return sum(self.rank_micro_batches[self._check(rank)])

    def dp_group(self, rank: int) -> tuple[int, ...]:
        """The ranks holding the same parameters as ``rank``, in ``(replica, dp_index)`` order."""
        return self.dp_groups[self.rank_dp_group[self._check(rank)]]

    def dp_shares(self, rank: int) -> tuple[list[int], int]:
        """The shares of ``rank``'s data-parallel group in group order, and ``rank``'s position."""
        group = self.dp_group(rank)
        return [self.share(r) for r in group], group.index(rank)

    def offset(self, rank: int) -> int:
        """Where ``rank``'s contiguous share of a global batch starts (single-stage plans)."""
        self._need_contiguous("offset")
        return self.rank_ranges[self._check(rank)][0][0]

    def sizes(self, n: int, rank: int) -> list[int]:
        """The shares of ``rank``'s data-parallel group (group order) in a batch of ``n`` samples:
        the plan's shares for a global batch, else :func:`proportional_split` of ``n`` over them."""
        self._need_contiguous("a batch split")
        return batch_split(n, self.dp_shares(rank)[0])

    def split(self, n: int, rank: int) -> Range:
        """``rank``'s ``[lo, hi)`` of a batch of ``n`` samples (any ``n``, see :meth:`sizes`)."""
        self._need_contiguous("a batch split")
        shares, index = self.dp_shares(rank)
        return slice_of(n, shares, index)

    def micro_batches(self, rank: int, n: int, keep_count: bool = False) -> list[int]:
        """Micro-batch sizes for ``rank``'s share of ``n`` samples: the plan's when ``n`` is its
        share; otherwise as many as the plan's, in proportion to them, when ``keep_count`` (every
        rank must run as many forwards, e.g. synchronised BatchNorm), else micro-batches of at
        most the plan's largest (at least one, possibly empty)."""
        sizes = self.micro_batch_sizes(rank)
        if n == sum(sizes):
            return sizes
        if keep_count:
            return proportional_split(n, sizes)
        if n == 0:
            return [0]
        return proportional_split(n, [1] * -(-n // max(sizes)))

    def _check(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in the plan: ranks are 0..{self.world_size - 1}")
        return rank

    def _need_contiguous(self, what: str) -> None:
        if not self.contiguous:
            raise ValueError(f"SampleLayout: {what} needs a single-stage plan; this plan has {self.num_stages} "
                             f"stages, whose ranks hold one slice per micro-batch: use ranges(rank)")


class _Groups:
    """The plan's workers grouped once: each (stage, replica)'s slots (their ``tp_index`` 0, by
    ``dp_index``) and all its workers. A layout reads them for every stage, replica and
    micro-batch, so scanning the plan's workers each time made a layout of 1,024 workers cost
    0.6 s; grouping once makes it linear in the workers and micro-batches."""

    def __init__(self, plan: PlanRecord):
        self.slots: dict[tuple[int, int], list[Worker]] = {}
        self.members: dict[tuple[int, int], list[Worker]] = {}
        for w in plan.workers:
            self.members.setdefault((w.stage, w.replica), []).append(w)
            if w.tp_index == 0:
                self.slots.setdefault((w.stage, w.replica), []).append(w)
        for slots in self.slots.values():
            slots.sort(key=lambda w: w.dp_index)


def _single_stage_ranges(plan: PlanRecord) -> dict[int, list[Range]]:
    """Each slot one contiguous share, replicas then slots in order, micro-batches inside."""
    groups = _Groups(plan)
    ranges: dict[int, list[Range]] = {}
    cursor = 0
    for replica in range(plan.num_replicas):
        own_of: dict[int, list[Range]] = {}
        for slot in groups.slots.get((0, replica), []):
            own = own_of[slot.dp_index] = []
            for size in slot.micro_batch_sizes:
                own.append((cursor, cursor + size))
                cursor += size
        ranges.update((w.rank, own_of[w.dp_index]) for w in groups.members.get((0, replica), [])
                      if w.dp_index in own_of)
    return ranges


def _pipeline_ranges(plan: PlanRecord) -> dict[int, list[Range]]:
    """Replica blocks, micro-batch blocks inside, slots' pieces inside those, the same in every stage."""
    groups = _Groups(plan)
    ranges: dict[int, list[Range]] = {}
    offset = 0
    for replica in range(plan.num_replicas):
        first = groups.slots.get((0, replica), [])
        block = [sum(w.micro_batch_sizes[m] for w in first) for m in range(plan.num_micro_batch)]
        for stage in range(len(plan.stages)):
            slots = groups.slots.get((stage, replica), [])
            start = offset
            per_slot: dict[int, list[Range]] = {w.dp_index: [] for w in slots}
            for m in range(plan.num_micro_batch):
                cursor = start
                for w in slots:
                    per_slot[w.dp_index].append((cursor, cursor + w.micro_batch_sizes[m]))
                    cursor += w.micro_batch_sizes[m]
                if cursor != start + block[m]:
                    raise PlanError(f"plan.workers: replica {replica} micro-batch {m} has {block[m]} samples in "
                                    f"stage 0 but {cursor - start} in stage {stage}; every stage of a pipeline "
                                    f"must see the same samples")
                start += block[m]
            ranges.update((w.rank, per_slot[w.dp_index]) for w in groups.members.get((stage, replica), []))
        offset += sum(block)
    return ranges
