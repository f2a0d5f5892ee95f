"""Uneven data shares: slicing a global batch, and a sampler/loader that reads only a rank's share.

torch's ``DistributedSampler`` gives every rank the same number of samples (padding or dropping to
get there); a whalelike Plan gives rank ``i`` a share ``n_i`` proportional to its device's speed.
:class:`UnevenSampler` cuts each epoch's permutation into global batches of ``sum(n_i)`` samples
and hands rank ``i`` its contiguous slice ``[offset_i, offset_i + n_i)`` of each (the same layout
:class:`runtime.data_parallel.DataParallelExecutor` uses for a whole global batch). The last,
short global batch is split in proportion to the shares, so over an epoch every sample is read by
exactly one rank: nothing dropped, nothing duplicated. The permutation depends only on ``seed``
and the epoch, so every rank computes the same one without communicating.

This is the data-parallel layout (single-stage plans). Pipeline and tensor-parallel plans take the
whole global batch on every rank: use a plain ``DataLoader(batch_size=plan.global_batch_size,
drop_last=True)`` there.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

import torch
from torch.utils.data import Dataset, Sampler, default_collate

from planner.plan import Plan
from runtime.groups import group_ranks


class Share(NamedTuple):
    """This rank's samples of one global batch of ``global_size`` samples."""

    inputs: tuple
    targets: torch.Tensor
    global_size: int


def slice_batch(inputs: Any, targets: torch.Tensor, lo: int, hi: int) -> tuple[tuple, torch.Tensor]:
    """Samples ``[lo, hi)`` of a batch: every batched tensor input is sliced on dimension 0, other
    inputs pass through. ``inputs`` may be one tensor, a tuple or a list (as collated)."""
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    sliced = tuple(x[lo:hi] if isinstance(x, torch.Tensor) and x.dim() > 0 else x for x in inputs)
    return sliced, targets[lo:hi]


def proportional_split(n: int, weights: Sequence[float]) -> list[int]:
    """``n`` as integers in proportion to ``weights`` (largest remainder, ties to the lower index).

    Every positive weight gets at least one item while items last (so no rank is idle in a short
    batch that could feed it); zero weights get nothing.
    """
    if n < 0 or any(w < 0 for w in weights) or not any(w > 0 for w in weights):
        raise ValueError(f"proportional_split: need n >= 0 and non-negative weights with a positive one, "
                         f"got n={n}, weights={list(weights)}")
    total = sum(weights)
    exact = [n * w / total for w in weights]
    out = [int(e) for e in exact]
    for i in sorted(range(len(weights)), key=lambda i: (-(exact[i] - out[i]), i))[: n - sum(out)]:
        out[i] += 1
    idle = sorted((i for i, w in enumerate(weights) if w > 0 and out[i] == 0), key=lambda i: (-weights[i], i))
    for i in idle:
        donor = max(range(len(out)), key=lambda j: (out[j], j))
        if out[donor] < 2:
            break
        out[donor] -= 1
        out[i] += 1
    return out


def dp_shares(plan: Plan, rank: int) -> tuple[list[int], int]:
    """The batch shares of ``rank``'s data-parallel group in layout order, and ``rank``'s position."""
    by_rank = {w.rank: w for w in plan.workers}
    for ranks in group_ranks(plan, "dp").values():
        if rank in ranks:
            return [by_rank[r].batch_share for r in ranks], ranks.index(rank)
    raise ValueError(f"rank {rank} is not in the plan (world size {plan.world_size})")


class UnevenSampler(Sampler[list[int]]):
    """A batch sampler: per step, the dataset indices of this rank's share (see the module docstring).

    Call :meth:`set_epoch` before each epoch, as with ``DistributedSampler``.
    """

    def __init__(self, num_samples: int, shares: Sequence[int], index: int, seed: int = 0, shuffle: bool = True):
        if not 0 <= index < len(shares):
            raise ValueError(f"UnevenSampler: index must be in [0, {len(shares)}), got {index}")
        if any(s < 0 for s in shares) or sum(shares) <= 0:
            raise ValueError(f"UnevenSampler: shares must be non-negative with a positive sum, got {list(shares)}")
        self.num_samples, self.shares, self.index = num_samples, list(shares), index
        self.seed, self.shuffle, self.epoch = seed, shuffle, 0

    @classmethod
    def from_plan(cls, plan: Plan, rank: int, num_samples: int, seed: int = 0, shuffle: bool = True) -> "UnevenSampler":
        shares, index = dp_shares(plan, rank)
        return cls(num_samples, shares, index, seed, shuffle)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return -(-self.num_samples // sum(self.shares))

    def steps(self) -> Iterator[tuple[list[int], int]]:
        """Per step: this rank's indices and the step's global batch size."""
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_samples, generator=g).tolist()
        else:
            order = list(range(self.num_samples))
        batch = sum(self.shares)
        for start in range(0, self.num_samples, batch):
            chunk = order[start:start + batch]
            split = self.shares if len(chunk) == batch else proportional_split(len(chunk), self.shares)
            lo = sum(split[: self.index])
            yield chunk[lo:lo + split[self.index]], len(chunk)

    def __iter__(self) -> Iterator[list[int]]:
        return (indices for indices, _ in self.steps())


class UnevenLoader:
    """Iterates :class:`Share` s of a map-style dataset of ``(inputs, target)`` items for one rank;
    pass each to ``Engine.train_step``. A rank with no samples in a short last batch gets an empty
    Share (batch dimension 0) so it still takes part in the step's collectives."""

    def __init__(self, dataset: Dataset, plan: Plan, rank: int, seed: int = 0, shuffle: bool = True,
                 collate_fn: Optional[Callable] = None):
        self.dataset = dataset
        self.sampler = UnevenSampler.from_plan(plan, rank, len(dataset), seed, shuffle)
        self.collate = collate_fn or default_collate

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

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
