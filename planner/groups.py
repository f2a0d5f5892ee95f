"""Which workers of a plan form a group of each kind, and in what order: the one derivation.

A plan's workers carry coordinates (``replica``, ``stage``, ``dp_index``, ``tp_index``); every part
of whalelike that groups them (the runtime's process groups, :mod:`runtime.groups`; the planner's
all-reduce pricing, the simulator, the deadlock proof, DDP's buckets, the sample layout, re-plans)
asks this module, so a group means the same workers in the same order everywhere. Kinds:

* ``dp``      key ``(stage, tp_index)``, members by ``(replica, dp_index)``: the workers that hold
              the same parameters and sum their gradients (DDP's group, over every replica).
* ``tp``      key ``(replica, stage, dp_index)``, members by ``tp_index``: one tensor-parallel group
              (a slot: the workers that process the same samples).
* ``stage``   key ``(replica, stage)``, members by ``(dp_index, tp_index)``: one pipeline stage of
              one replica.
* ``replica`` key ``(replica,)``, members by ``(stage, dp_index, tp_index)``: one pipeline replica.

Why here: nine modules used to spell these tuples out, and two of them in a different order for the
same group; a plan is the planner's, so its groups are too, and the runtime reads them.

Invariant: keys and orders are pure functions of a worker's coordinates (tuples of ints), so every
rank derives the same groups from the same plan without communicating; :func:`groups_of` lists the
keys ascending and each group's members in its kind's order (the plan order).
"""
from __future__ import annotations

from typing import Callable, Iterable

from planner.plan_record import PlanRecord, Worker

KINDS = ("dp", "tp", "stage", "replica")

_KEYS: dict[str, Callable[[Worker], tuple[int, ...]]] = {
    "dp": lambda w: (w.stage, w.tp_index),
    "tp": lambda w: (w.replica, w.stage, w.dp_index),
    "stage": lambda w: (w.replica, w.stage),
    "replica": lambda w: (w.replica,),
}
_ORDERS: dict[str, Callable[[Worker], tuple[int, ...]]] = {
    "dp": lambda w: (w.replica, w.dp_index),
    "tp": lambda w: (w.tp_index,),
    "stage": lambda w: (w.dp_index, w.tp_index),
    "replica": lambda w: (w.stage, w.dp_index, w.tp_index),
}


def _check(kind: str) -> None:
    if kind not in _KEYS:
        raise ValueError(f"group kind must be one of {', '.join(KINDS)}, got {kind!r}")


def group_key(kind: str, worker: Worker) -> tuple[int, ...]:
    """The key of ``worker``'s group of ``kind`` (module docstring): equal for exactly the workers of
    one group."""
    _check(kind)
    return _KEYS[kind](worker)


def member_order(kind: str, worker: Worker) -> tuple[int, ...]:
    """Where ``worker`` sorts within its group of ``kind``: the plan order of the group's members."""
    _check(kind)
    return _ORDERS[kind](worker)


def groups_of(workers: Iterable[Worker], kind: str) -> dict[tuple[int, ...], list[Worker]]:
    """Every group of ``kind`` among ``workers``: key -> its members in plan order, keys ascending."""
    _check(kind)
    key, order = _KEYS[kind], _ORDERS[kind]
    members: dict[tuple[int, ...], list[Worker]] = {}
    for w in workers:
        members.setdefault(key(w), []).append(w)
    return {k: sorted(ws, key=order) for k, ws in sorted(members.items())}


def group_ranks(plan: PlanRecord, kind: str) -> dict[tuple[int, ...], tuple[int, ...]]:
    """Every group of ``kind`` in ``plan``: key -> member ranks in plan order (pure, no torch calls)."""
    return {k: tuple(w.rank for w in ws) for k, ws in groups_of(plan.workers, kind).items()}
