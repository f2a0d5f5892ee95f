"""Uneven data shares: slicing a global batch, and a sampler/loader that reads only a rank's share.

torch's ``DistributedSampler`` gives every rank the same number of samples (padding or dropping to
get there); a whalelike Plan gives rank ``i`` a share ``n_i`` proportional to its device's speed.
:class:`UnevenSampler` cuts each epoch's permutation into global batches of ``sum(n_i)`` samples
and hands rank ``i`` its slice of each, as :class:`planner.shares.layout.SampleLayout` lays it out (the
layout the data-parallel executor uses for a whole global batch): a contiguous
``[offset_i, offset_i + n_i)``, and for the last, short global batch a slice in proportion to the
shares. So over an epoch every sample is read by exactly one rank: nothing dropped, nothing
duplicated. The permutation depends only on ``seed`` and the epoch, so every rank computes the
same one without communicating.

Re-planning: :meth:`UnevenSampler.set_shares` / :meth:`UnevenLoader.set_plan` adopt new shares
from the next step on; the epoch goes on where it was (the next global batch starts right after
the last one read). A step's batch is read lazily, when the iterator is advanced, so read it
*after* applying the re-plan that applies to that step (every rank the same way), never ahead.

This is the data-parallel layout (single-stage plans). Pipeline and tensor-parallel plans take the
whole global batch on every rank: :class:`WholeBatchSampler` (as a ``DataLoader``'s
``batch_sampler``) hands every rank the same global batches, cut from the same permutation
(:func:`epoch_order`, the one both samplers use), and drops an epoch's last short batch (those
executors take exactly ``plan.global_batch_size`` samples per step).

Resuming mid-epoch: ``set_epoch(epoch, start)`` on either sampler takes the epoch's first ``start``
samples of its permutation as read; the next batch starts at sample ``start``. A position counted
in samples holds across plans: the same samples follow whatever the shares or the global batch.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

import torch
from torch.utils.data import Dataset, Sampler, default_collate

from planner.shares.layout import SampleLayout, proportional_split, slice_of
from planner.plan import Plan

__all__ = ["Share", "slice_batch", "proportional_split", "dp_shares", "epoch_order", "UnevenSampler", "UnevenLoader",
           "WholeBatchSampler"]


class Share(NamedTuple):
    """This rank's samples of one global batch of ``global_size`` samples."""

    inputs: tuple
    targets: torch.Tensor
    global_size: int


def slice_batch(inputs: Any, targets: torch.Tensor, lo: int, hi: int) -> tuple[tuple, torch.Tensor]:
    """Samples ``[lo, hi)`` of a batch: every batched tensor input is sliced on dimension 0, other
    inputs pass through. ``inputs`` may be one tensor, a tuple or a list (as collated)."""
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    sliced = tuple(_rows(x, lo, hi) if isinstance(x, torch.Tensor) and x.dim() > 0 else x for x in inputs)
    return sliced, _rows(targets, lo, hi)


def _rows(x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """``x[lo:hi]``; ``x`` itself when that is all of it (a rank holding the whole batch: no view made)."""
    return x if lo == 0 and hi == x.shape[0] else x[lo:hi]


def dp_shares(plan: Plan, rank: int) -> tuple[list[int], int]:
    """The batch shares of ``rank``'s data-parallel group in layout order, and ``rank``'s position
    (:meth:`planner.shares.layout.SampleLayout.dp_shares`)."""
    return SampleLayout.of(plan).dp_shares(rank)


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The order in which epoch ``epoch`` reads the samples: a permutation seeded by ``seed + epoch``
    (the same on every rank, with no communication), or ``0..n-1`` without ``shuffle``."""
    if not shuffle:
        return list(range(num_samples))
    return torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def _checked_start(start: int, num_samples: int, who: str) -> int:
    if not 0 <= start <= num_samples:
        raise ValueError(f"{who}.set_epoch: start must be a sample position in [0, {num_samples}] (the samples "
                         f"of the epoch already read), got {start}")
    return start


class UnevenSampler(Sampler[list[int]]):
    """A batch sampler: per step, the dataset indices of this rank's share (see the module docstring).

    ``shares``: the data-parallel group's shares in layout order, ``index``: this rank's position
    (:meth:`from_plan` takes both from :class:`planner.shares.layout.SampleLayout`). Call :meth:`set_epoch`
    before each epoch, as with ``DistributedSampler`` (``start``: resume inside it).
    """

    def __init__(self, num_samples: int, shares: Sequence[int], index: int, seed: int = 0, shuffle: bool = True):
        if not 0 <= index < len(shares):
            raise ValueError(f"UnevenSampler: index must be in [0, {len(shares)}), got {index}")
        self.num_samples, self.index = num_samples, index
        self.shares = self._checked(shares)
        self.seed, self.shuffle, self.epoch, self.start = seed, shuffle, 0, 0

    @classmethod
    def from_plan(cls, plan: Plan, rank: int, num_samples: int, seed: int = 0, shuffle: bool = True) -> "UnevenSampler":
        shares, index = SampleLayout.of(plan).dp_shares(rank)
        return cls(num_samples, shares, index, seed, shuffle)

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Read epoch ``epoch`` from sample ``start`` of its permutation on (0: the whole epoch)."""
        self.epoch, self.start = epoch, _checked_start(start, self.num_samples, "UnevenSampler")

    def set_shares(self, shares: Sequence[int]) -> None:
        """Use ``shares`` (same group, same length) from the next step on, also in an epoch under way."""
        if len(shares) != len(self.shares):
            raise ValueError(f"UnevenSampler.set_shares: the group has {len(self.shares)} ranks, got "
                             f"{len(shares)} shares {list(shares)}; a new group needs a new sampler")
        self.shares = self._checked(shares)

    def __len__(self) -> int:
        """Steps per whole epoch under the current shares."""
        return -(-self.num_samples // sum(self.shares))

    def steps(self) -> Iterator[tuple[list[int], int]]:
        """Per step: this rank's indices and the step's global batch size. Each step reads the
        shares in force when it is drawn (:meth:`set_shares`)."""
        order = epoch_order(self.num_samples, self.seed, self.epoch, self.shuffle)
        start = self.start
        while start < self.num_samples:
            chunk = order[start:start + sum(self.shares)]
            lo, hi = slice_of(len(chunk), self.shares, self.index)
            yield chunk[lo:hi], len(chunk)
            start += len(chunk)

    def __iter__(self) -> Iterator[list[int]]:
        return (indices for indices, _ in self.steps())

    @staticmethod
    def _checked(shares: Sequence[int]) -> list[int]:
        if any(s < 0 for s in shares) or sum(shares) <= 0:
            raise ValueError(f"UnevenSampler: shares must be non-negative with a positive sum, got {list(shares)}")
        return list(shares)


class UnevenLoader:
    """Iterates :class:`Share` s of a map-style dataset of ``(inputs, target)`` items for one rank;
    pass each to ``Engine.train_step``. A rank with no samples in a short last batch gets an empty
    Share (batch dimension 0) so it still takes part in the step's collectives. :meth:`set_plan`
    follows a re-planned Plan from the next step on (see the module docstring); :meth:`follow`
    does it for every re-plan of an Engine."""

    def __init__(self, dataset: Dataset, plan: Plan, rank: int, seed: int = 0, shuffle: bool = True,
                 collate_fn: Optional[Callable] = None):
        layout = SampleLayout.of(plan)
        self.dataset, self.rank, self.group = dataset, rank, layout.dp_group(rank)
        self.sampler = UnevenSampler(len(dataset), *layout.dp_shares(rank), seed, shuffle)
        self.collate = collate_fn or default_collate

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.sampler.set_epoch(epoch, start)

    def set_plan(self, plan: Plan) -> None:
        """Read this rank's shares of ``plan`` from the next step on; its data-parallel group must
        be the same ranks in the same order (only the shares may change)."""
        layout = SampleLayout.of(plan)
        group = layout.dp_group(self.rank)
        if group != self.group:
            raise ValueError(f"UnevenLoader.set_plan: rank {self.rank}'s data-parallel group is ranks "
                             f"{list(group)} in the new plan, {list(self.group)} in the old one; only the "
                             f"shares may change (a plan with other groups needs a new loader)")
        self.sampler.set_shares(layout.dp_shares(self.rank)[0])

    def follow(self, engine) -> "UnevenLoader":
        """Follow ``engine``'s re-plans (``runtime.Engine(balance=...)``): after each step, the
        next share is drawn under the plan in force (``engine.plan``). Returns the loader."""
        self._engine, self._plan = engine, engine.plan
        return self

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Share]:
        for indices, global_size in self.sampler.steps():
            if indices:
                inputs, targets = self.collate([self.dataset[i] for i in indices])
                yield Share(*slice_batch(inputs, targets, 0, len(indices)), global_size=global_size)
            else:
                inputs, targets = self.collate([self.dataset[0]])
                yield Share(*slice_batch(inputs, targets, 0, 0), global_size=global_size)
            # the step that used this share may have re-planned: the next draw follows the new plan
            engine = getattr(self, "_engine", None)
            if engine is not None and engine.plan is not self._plan:
                self._plan = engine.plan
                self.set_plan(self._plan)


class WholeBatchSampler(Sampler[list[int]]):
    """A batch sampler for plans that take the whole global batch on every rank (pipeline and
    tensor-parallel plans): per step ``batch_size`` indices of the epoch's permutation
    (:func:`epoch_order`, the same on every rank), in order; the last short batch of an epoch is
    dropped. Call :meth:`set_epoch` before each epoch (``start``: resume inside it)."""

    def __init__(self, num_samples: int, batch_size: int, seed: int = 0, shuffle: bool = True):
        if batch_size < 1:
            raise ValueError(f"WholeBatchSampler: batch_size must be at least 1, got {batch_size}")
        self.num_samples, self.batch_size = num_samples, batch_size
        self.seed, self.shuffle, self.epoch, self.start = seed, shuffle, 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Read epoch ``epoch`` from sample ``start`` of its permutation on (0: the whole epoch)."""
        self.epoch, self.start = epoch, _checked_start(start, self.num_samples, "WholeBatchSampler")

    def __len__(self) -> int:
        """Whole batches left in the epoch from the current start."""
        return (self.num_samples - self.start) // self.batch_size

    def __iter__(self) -> Iterator[list[int]]:
        order = epoch_order(self.num_samples, self.seed, self.epoch, self.shuffle)
        for lo in range(self.start, self.num_samples - self.batch_size + 1, self.batch_size):
            yield order[lo:lo + self.batch_size]
