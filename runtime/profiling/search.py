"""The largest micro-batch that fits: Poplar's Algorithm 1 (seed paper 002), as a pure search.

Poplar first *estimates* the largest batch from one forward of one sample (the memory it added,
against what the device has left: lines 1-8), then runs steps at batch sizes growing
*exponentially* (1, 2, 4, ...) until one runs out of memory or the estimate is reached (lines
9-16), then *binary-searches* between the last size that fitted and the first that did not
(lines 17-30). This module is that search over a predicate ``fits(batch) -> bool`` (one training
step at ``batch``: a real ``torch.OutOfMemoryError`` on CUDA, the emulated one on CPU,
:mod:`runtime.profiling.steps`), so it can be tested against any edge without a device.

Where it departs, and why:

* the estimate bounds the exponential phase but is not trusted: one sample's forward misses what
  does not grow with the batch and what the backward adds, so the estimate may be high (then a
  power of two below it fails first, as in the paper) or low (then the estimate itself is tried and,
  if it fits, growth goes on doubling from there: the paper would stop below the true edge);
* ``cap`` bounds everything (a small model on a large device would otherwise grow to batches of
  millions); when the cap fits, the answer is the cap and :attr:`Edge.edge` says ``"cap"``;
* no size is tried twice (the paper's binary search re-runs ``mbs / 2``).

Invariant: for any ``fits`` that is monotone (every batch below one that fits fits too) the
result is exactly the largest batch ``<= cap`` that fits, after at most about
``2 * log2(answer) + 2`` trials.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from whalelike.errors import WhaleError


class NothingFitsError(WhaleError):
    """Not even one sample's training step fits on a device (the message names it and the fix)."""


@dataclass(frozen=True)
class Edge:
    """The search's answer: ``max_batch``; ``edge`` is ``"memory"`` when ``max_batch + 1`` did not
    fit, ``"cap"`` when the cap fitted; ``trials`` the ``(batch, fitted)`` pairs in the order run."""

    max_batch: int
    edge: str
    trials: tuple[tuple[int, bool], ...]


def find_max_batch(fits: Callable[[int], bool], estimate: Optional[int], cap: int) -> Edge:
    """The largest batch ``<= cap`` for which ``fits`` is true (see the module docstring);
    ``estimate``: Poplar's first guess (None: no memory limit is known, grow to the cap). Raises
    :class:`NothingFitsError` when batch 1 does not fit."""
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
        raise ValueError(f"find_max_batch: cap must be an integer >= 1, got {cap!r}")
    trials: list[tuple[int, bool]] = []
    known: dict[int, bool] = {}

    def trial(batch: int) -> bool:
        if batch not in known:
            known[batch] = bool(fits(batch))
            trials.append((batch, known[batch]))
        return known[batch]

    if not trial(1):
        raise NothingFitsError("one sample does not fit")
    limit = cap if estimate is None else max(1, min(int(estimate), cap))
    fitted, failed = 1, None
    for batch in _growth(limit, cap):
        if trial(batch):
            fitted = batch
        else:
            failed = batch
            break
    if failed is None:   # the cap itself fitted
        return Edge(fitted, "cap", tuple(trials))
    while failed - fitted > 1:   # binary search: fitted fits, failed does not
        middle = (fitted + failed) // 2
        if trial(middle):
            fitted = middle
        else:
            failed = middle
    return Edge(fitted, "memory", tuple(trials))


def _growth(limit: int, cap: int):
    """Batches of the exponential phase after 1: powers of two up to ``limit`` (the estimate),
    ``limit`` itself, then doubling from it up to ``cap``, and ``cap``."""
    batch = 2
    while batch <= limit:
        yield batch
        batch *= 2
    if limit > batch // 2:
        yield limit
    batch = limit * 2
    while batch < cap:
        yield batch
        batch *= 2
    if cap > limit:
        yield cap


def timed_batches(max_batch: int) -> list[int]:
    """The batches whose step times a profile keeps: the powers of two up to ``max_batch``, and
    ``max_batch`` (Poplar's exponential phase, plus the edge so the curve reaches it)."""
    out, batch = [], 1
    while batch <= max_batch:
        out.append(batch)
        batch *= 2
    if out[-1] != max_batch:
        out.append(max_batch)
    return out
