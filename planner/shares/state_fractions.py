"""Ragged ZeRO state shards (Cephalo): each worker's fraction of the sharded state, from its free memory.

Why. FSDP2 gives every worker of a data-parallel group ``1/n`` of the parameters' rows, the gradients
and the optimizer state, so the smallest device of the group bounds what the group can train. At
ZeRO stages 1-3 the runtime can instead give worker ``r`` its own fraction ``f_r`` of every
parameter's rows (``runtime.replicas.ragged_sync``, ``StagePlan.replica_sync`` ``"ragged"``,
``StagePlan.state_fractions``); the memory model prices it with ``f = f_r``
(:class:`planner.devices.memory.ZeroShards` ``share``).

The rule (:func:`ragged_fractions`). Under ragged shards a worker's peak is linear in its fraction:
``need_r(f) = fixed_r + C + f * S``, where ``S`` is the whole stage's sharded bytes (what one more unit
of fraction adds: weights, optimizer state, and the gradients at stages 2-3), ``fixed_r`` what does not
shrink with the fraction: its activations at its batch share, the full weights at stages 1-2 (a layer
unit and the root at stage 3), the full gradients at stage 1 (a bucket's at stages 2-3), and ``C``
the collectives' padded buffers, the same on every rank: ``n * max(f)`` times a bucket (times the
buffers per byte, :attr:`~planner.devices.memory.ZeroShards.buffers`), so ``C = k * F`` with
``F = max(f)``. All three come from the memory model itself (:func:`planner.devices.memory.stage_memory`
at ``share`` 0 and 1, ``padding`` 0 and 1), so the rule reads the one model. With
``free_r = capacity_r - fixed_r - C``:

    ``f_r = free_r / sum(free)``

Every device then fills the same fraction ``S / sum(free)`` of its free memory, the largest uniform
slack for that ``C``. ``F`` is then the largest device's ``free / sum(free)``, which depends on ``C``
and so on itself: with ``M = max(capacity - fixed)`` and ``Σ = sum(capacity - fixed)`` over the
``n`` workers, ``F = (M - k F) / (Σ - n k F)``, the smaller root of ``n k F^2 - (Σ + k) F + M = 0``
(``M / Σ`` without buffers; no root: the buffers alone do not fit). The fractions fit exactly when
every ``free_r >= 0`` and ``sum(free) >= S``.

The batch share a worker's activations are priced at: the step's samples split by speed
(:func:`~planner.shares.batch_shares.proportional_shares`, as Poplar and the batch fitting do),
each worker's micro-batch ``ceil(share_r / k)`` for the fewest micro-batches per step ``k`` (from
``num_micro_batch``) at which the fractions fit; ``k = 1`` is priced as one micro-batch per step
(at ZeRO 1 the whole gradients are then not held) and tried first; from 2 on more micro-batches only
shrink the activations, so ``k`` is found by bisection, up to every worker's micro-batch of one sample (at most
``MAX_MICRO_BATCHES``). The batch fitting (:mod:`planner.shares.batch_fit`) then cuts the batch
within the memory the fractions leave, which holds those micro-batches.

The fractions are per data-parallel worker in the planner's group order
(:meth:`~planner.devices.placement.Layout.stage_groups`); :func:`in_rank_order` and
:func:`in_group_order` convert to and from the plan's rank order. Invariant: the fractions are
``>= 0`` and sum to 1; equal free memory gives equal fractions, which the planner keeps as FSDP2's
even shards (:func:`is_even`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from planner.devices.cost_model import StageCost
from planner.devices.memory import ZeroShards, fits, ragged_unit, stage_memory
from planner.shares.batch_shares import proportional_shares

EVEN_TOLERANCE = 1e-9    # fractions this close to 1/n are even shards (FSDP2)
SUM_TOLERANCE = 1e-9     # StagePlan.state_fractions sum to 1 within this


@dataclass(frozen=True)
class RaggedShares:
    """What :func:`ragged_fractions` found: ``fractions`` (per worker, summing to 1), the micro-batch
    count ``micro_batches`` whose speed-proportional micro-batches (``samples``, per worker) the
    activations were priced at, each worker's ``free`` bytes after what does not shrink with its
    fraction, and ``sharded`` (``S``) the bytes the fractions divide."""

    fractions: tuple[float, ...]
    micro_batches: int
    samples: tuple[int, ...]
    free: tuple[float, ...]
    sharded: float

    @property
    def slack(self) -> float:
        """The share of its free memory every worker leaves unused: ``1 - S / sum(free)``."""
        return 1.0 - self.sharded / sum(self.free)


def proportional_fractions(free: Sequence[float]) -> tuple[float, ...]:
    """``free_r / sum(free)``, a negative free taken as 0 (such a worker cannot hold even fraction 0,
    so the fractions do not fit anyway: :func:`ragged_fractions` checks); all zero: even."""
    kept = [max(float(x), 0.0) for x in free]
    total = sum(kept)
    if total <= 0:
        return tuple(1.0 / len(kept) for _ in kept)
    return tuple(x / total for x in kept)


def worker_memory(cost: StageCost, in_flight: int, recompute: "bool | str", zero_stage: int, workers: int,
                  share: float, padding: float = 1.0, whole_model: bool = True, single: bool = False):
    """The memory model of a worker holding ``share`` of the sharded state under ragged shards at
    ZeRO ``zero_stage`` (1-3) of a stage (``whole_model``: a single-stage plan's) over ``workers``
    workers whose collectives are padded ``padding`` (``n * max(f)``) times (``single``: it runs one
    micro-batch per step)."""
    unit, root = ragged_unit(cost, zero_stage, whole_model)
    return stage_memory(cost, in_flight, recompute=recompute,
                        zero=ZeroShards(zero_stage, workers, unit, share=share, padding=padding, root=root,
                                        single=single))


def largest_fraction(base_free: Sequence[float], per_fraction: float) -> float | None:
    """``F``, the largest worker's fraction, when every worker has ``base_free`` bytes before the
    padded buffers and the buffers take ``per_fraction * F`` bytes on every worker (module docstring);
    None when no ``F`` satisfies it (the buffers do not fit)."""
    n, big, total = len(base_free), max(base_free), sum(base_free)
    if total <= 0:
        return None
    if per_fraction <= 0:
        return big / total
    b = total + per_fraction
    disc = b * b - 4.0 * n * per_fraction * big
    if disc < 0:
        return None
    return (b - math.sqrt(disc)) / (2.0 * n * per_fraction)


def ragged_fractions(cost: StageCost, in_flight: int, recompute: "bool | str", zero_stage: int,
                     capacities: Sequence[float], speeds: Sequence[float], global_batch: int,
                     num_micro_batch: int, most_micro_batches: int, whole_model: bool = True) -> RaggedShares | None:
    """The state fractions of a stage's data-parallel workers (module docstring; ``whole_model``: of a
    single-stage plan): devices of ``capacities`` bytes and relative ``speeds``, ``global_batch``
    samples per step in at least ``num_micro_batch`` micro-batches, at most ``most_micro_batches``.
    None when no fractions fit (a worker cannot hold even fraction 0 with the padded buffers, or all of
    them together not the state)."""
    if zero_stage not in (1, 2, 3):
        raise ValueError(f"ragged shards run at ZeRO stages 1, 2 and 3, got {zero_stage}")
    n = len(capacities)
    if n < 2 or len(speeds) != n:
        raise ValueError(f"ragged shards need two workers or more, one speed each: {n} capacities, {len(speeds)} speeds")

    def memory(share: float, padding: float, single: bool):
        return worker_memory(cost, in_flight, recompute, zero_stage, n, share, padding, whole_model, single)

    shares = proportional_shares(global_batch, list(speeds), minimum=1)   # the batch fitting's first split

    def attempt(k: int) -> RaggedShares | None:
        # one micro-batch per step: a worker holds less under ZeRO 1 (planner.devices.memory, "ZeRO")
        bare = memory(0.0, 0.0, k == 1)
        sharded = memory(1.0, 0.0, k == 1).static() - bare.static()
        per_fraction = n * (memory(0.0, 1.0, k == 1).static() - bare.static())   # C = per_fraction * max(f)
        samples = tuple(max(math.ceil(x / k), 1) for x in shares)
        base_free = [c - bare.total(b) for c, b in zip(capacities, samples)]
        largest = largest_fraction(base_free, per_fraction)
        if largest is None:
            return None
        free = tuple(x - per_fraction * largest for x in base_free)
        if min(free) < 0 or not fits(sharded, sum(free)):
            return None
        return RaggedShares(proportional_fractions(free), k, samples, free, sharded)

    low = max(num_micro_batch, 1)
    if low == 1:   # one micro-batch is priced apart (it holds less), so it is tried first
        found = attempt(1)
        if found is not None:
            return found
        low = 2
    high = max(low, min(max(shares), most_micro_batches))   # beyond max(shares) every micro-batch is one sample
    if attempt(high) is None:
        return None
    while low < high:   # the fewest micro-batches that fit: fitting is monotone in k (from 2 on)
        mid = (low + high) // 2
        if attempt(mid) is None:
            low = mid + 1
        else:
            high = mid
    return attempt(low)


def is_even(fractions: Sequence[float]) -> bool:
    """Whether ``fractions`` are ``1/n`` each (within :data:`EVEN_TOLERANCE`): FSDP2's even shards."""
    n = len(fractions)
    return all(abs(f - 1.0 / n) <= EVEN_TOLERANCE for f in fractions)


def padded_scale(fractions: Sequence[float]) -> float:
    """How many times the bytes of an even collective a ragged one moves: each parameter's rows are
    padded to the largest rank's for ``reduce_scatter_tensor`` / ``all_gather_into_tensor``
    (``runtime.replicas.ragged_sync``), so every rank sends ``n * max(f)`` times its even share."""
    return len(fractions) * max(fractions) if fractions else 1.0


def in_rank_order(fractions: Sequence[float], group_devices: Sequence[str], ranks: dict[str, int]) -> list[float]:
    """``fractions`` per worker in group order (``group_devices``: each worker's device name) as
    ``StagePlan.state_fractions``: in the order of the workers' ranks (``ranks``: device -> rank)."""
    order = sorted(range(len(group_devices)), key=lambda i: ranks[group_devices[i]])
    return [float(fractions[i]) for i in order]


def in_group_order(fractions: Sequence[float], group_devices: Sequence[str], ranks: dict[str, int]) -> tuple[float, ...]:
    """The inverse of :func:`in_rank_order`: ``StagePlan.state_fractions`` per worker in group order."""
    order = sorted(range(len(group_devices)), key=lambda i: ranks[group_devices[i]])
    out = [0.0] * len(group_devices)
    for f, i in zip(fractions, order):
        out[i] = float(f)
    return tuple(out)
