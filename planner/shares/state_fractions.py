"""Ragged ZeRO state shards (Cephalo): each worker's fraction of the sharded state, from its free memory.

Why. FSDP2 gives every worker of a data-parallel group ``1/n`` of the parameters' rows, the gradients
and the optimizer state, so the smallest device of the group bounds what the group can train. At
ZeRO stages 1 and 2 the runtime can instead give worker ``r`` its own fraction ``f_r`` of every
parameter's rows (``runtime.replicas.ragged_sync``, ``StagePlan.replica_sync`` ``"ragged"``,
``StagePlan.state_fractions``); the memory model prices it with ``f = f_r``
(:class:`planner.devices.memory.ZeroShards` ``share``).

The rule (:func:`ragged_fractions`). Under ragged shards a worker's peak is linear in its fraction:
``need_r(f) = fixed_r + f * S``, where ``S`` is the whole stage's sharded bytes (weights + gradients +
optimizer state, each term once: what one more unit of fraction adds) and ``fixed_r`` what does not
shrink with the fraction: its activations at its batch share, the full weights, and the full
gradients at stage 1 (``u`` of them at stage 2: the largest parameter's, reduce-scattered as soon as
it is produced). Both come from the memory model itself (:func:`planner.devices.memory.stage_memory`
at ``share`` 0 and 1), so the rule reads the one model. With ``free_r = capacity_r - fixed_r``:

    ``f_r = free_r / sum(free)``

Every device then fills the same fraction ``S / sum(free)`` of its free memory, the largest uniform
slack: no other fractions leave every device more than ``1 - S / sum(free)`` of its free memory
unused; and they fit exactly when any fractions do (every ``free_r >= 0`` and ``sum(free) >= S``).

The batch share a worker's activations are priced at: the step's samples split by speed
(:func:`~planner.shares.batch_shares.proportional_shares`, as Poplar and the batch fitting do),
each worker's micro-batch ``ceil(share_r / k)`` for the fewest micro-batches per step ``k`` (from
``num_micro_batch``) at which the fractions fit; more micro-batches only shrink the activations, so
``k`` is found by bisection, up to every worker's micro-batch of one sample (at most
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
from planner.devices.memory import ZeroShards, fits, parameter_share, stage_memory
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
                  share: float):
    """The memory model of a worker holding ``share`` of the sharded state under ragged shards at
    ZeRO ``zero_stage`` (1 or 2) of a single stage over ``workers`` workers."""
    return stage_memory(cost, in_flight, recompute=recompute,
                        zero=ZeroShards(zero_stage, workers, parameter_share(cost), share=share))


def ragged_fractions(cost: StageCost, in_flight: int, recompute: "bool | str", zero_stage: int,
                     capacities: Sequence[float], speeds: Sequence[float], global_batch: int,
                     num_micro_batch: int, most_micro_batches: int) -> RaggedShares | None:
    """The state fractions of a single stage's data-parallel workers (module docstring): devices of
    ``capacities`` bytes and relative ``speeds``, ``global_batch`` samples per step in at least
    ``num_micro_batch`` micro-batches, at most ``most_micro_batches``. None when no fractions fit
    (a worker cannot hold even fraction 0, or all of them together not the state)."""
    if zero_stage not in (1, 2):
        raise ValueError(f"ragged shards run at ZeRO stages 1 and 2, got {zero_stage}")
    n = len(capacities)
    if n < 2 or len(speeds) != n:
        raise ValueError(f"ragged shards need two workers or more, one speed each: {n} capacities, {len(speeds)} speeds")
    none = worker_memory(cost, in_flight, recompute, zero_stage, n, 0.0)
    sharded = worker_memory(cost, in_flight, recompute, zero_stage, n, 1.0).static() - none.static()
    shares = proportional_shares(global_batch, list(speeds), minimum=1)   # the batch fitting's first split

    def attempt(k: int) -> RaggedShares | None:
        samples = tuple(max(math.ceil(x / k), 1) for x in shares)
        free = tuple(c - none.total(b) for c, b in zip(capacities, samples))
        if min(free) < 0 or not fits(sharded, sum(free)):
            return None
        return RaggedShares(proportional_fractions(free), k, samples, free, sharded)

    low = max(num_micro_batch, 1)
    high = max(low, min(max(shares), most_micro_batches))   # beyond max(shares) every micro-batch is one sample
    if attempt(high) is None:
        return None
    while low < high:   # the fewest micro-batches that fit: fitting is monotone in k
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
