"""The process groups a Plan needs, created identically on every rank.

``torch.distributed.new_group`` is itself a collective over the whole world: every rank must call
it for every group, in the same order, even for groups it is not a member of. :func:`build_groups`
therefore enumerates every group of every kind from the Plan alone (no rank-dependent branching),
in one fixed order, and hands each rank the ones it belongs to. Identical rank sets of different
kinds (in pure data parallel the data-parallel group *is* the stage group *is* the replica) share
one communicator.

Kinds (``dp``, ``tp``, ``stage``, ``replica``), their keys and their members' order are the
planner's (:mod:`planner.groups`, the one derivation the simulator and the planner use too); rank
lists are in that plan order, not by global rank.
"""
from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from planner.groups import KINDS, group_ranks
from planner.plan import Plan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankGroup:
    """A process group and its members in Plan order. ``group`` is ``None`` on non-members."""

    kind: str
    ranks: tuple[int, ...]
    group: Optional[dist.ProcessGroup]

    @property
    def size(self) -> int:
        return len(self.ranks)

    def index(self, rank: int) -> int:
        """Position of global ``rank`` in Plan order (its dp_index/tp_index-like coordinate)."""
        return self.ranks.index(rank)


@dataclass(frozen=True)
class PlanGroups:
    """This rank's groups of every kind (see the module docstring)."""

    rank: int
    dp: RankGroup
    tp: RankGroup
    stage: RankGroup
    replica: RankGroup


def build_groups(plan: Plan, rank: int, timeout_s: Optional[float] = None) -> PlanGroups:
    """Create every group of every kind on this rank (a collective: all ranks must call it).

    ``timeout_s`` bounds every collective on these groups, so a dead peer surfaces as an error
    instead of a hang.
    """
    if not dist.is_initialized():
        raise RuntimeError("build_groups needs an initialised default process group (runtime.distributed.init)")
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else None
    created: dict[tuple[int, ...], dist.ProcessGroup] = {}
    mine: dict[str, RankGroup] = {}
    for kind in KINDS:
        for ranks in group_ranks(plan, kind).values():
            members = tuple(sorted(ranks))
            if members not in created:
                created[members] = dist.new_group(list(members), timeout=timeout)
            if rank in ranks:
                mine[kind] = RankGroup(kind, ranks, created[members])
    log.debug("rank %d: %d process groups for the plan; mine: %s", rank, len(created),
              {k: g.ranks for k, g in mine.items()})
    return PlanGroups(rank=rank, **mine)
