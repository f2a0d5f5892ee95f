"""The group-order search of the pipeline partitioner (``order="search"``, see :mod:`planner.partition.solve`).

Early positions keep more micro-batches in flight, so which device group runs which position
matters. The search starts from rule orders (most memory first, fastest first, the given order)
and improves by best-improvement local moves (swap two groups that differ; for up to
:data:`PAIR_SWAP_MAX_STAGES` stages also move one elsewhere), each order priced exactly by
:func:`~planner.partition.pricing.solve_order`, until no move lowers (memory overflow, the
problem's objective: bottleneck or step estimate, sum of squares). Groups kept in place (``keep_position``) never move.
"""
from __future__ import annotations

import itertools

from planner.partition.pricing import Pricing, Score, solve_order
from planner.partition.problem import PartitionProblem

PAIR_SWAP_MAX_STAGES = 16  # any two positions (swap, move) up to here, neighbours beyond


def _rule_orders(p: PartitionProblem) -> list[list[int]]:
    """Starting orders: most memory first (early stages keep the most micro-batches in flight,
    faster first on ties), fastest first, and the given order; kept slots stay put."""
    def arranged(key) -> list[int]:
        it = iter(sorted(p.movable_slots, key=key))
        return [next(it) if g in p.movable_slots else g for g in range(len(p.slots))]
    memory_first = arranged(lambda g: (-sum(d.capacity_bytes for d in p.slots[g].devices), -p.slots[g].flops_per_s, g))
    fastest_first = arranged(lambda g: (-p.slots[g].flops_per_s, -sum(d.capacity_bytes for d in p.slots[g].devices), g))
    return [memory_first, fastest_first, list(range(len(p.slots)))]


def _moves(order: list[int], p: PartitionProblem):
    """Neighbouring orders: swap two movable slots that differ; for up to
    ``PAIR_SWAP_MAX_STAGES`` stages any two and also move one slot elsewhere among the movable
    positions, beyond that neighbours only (the search stays O(S) evaluations per round)."""
    positions = [k for k in range(len(order)) if order[k] in p.movable_slots]
    small = len(order) <= PAIR_SWAP_MAX_STAGES
    pairs = itertools.combinations(range(len(positions)), 2) if small else zip(range(len(positions) - 1), range(1, len(positions)))
    for a, b in pairs:
        ka, kb = positions[a], positions[b]
        if p.slots[order[ka]].signature != p.slots[order[kb]].signature:
            trial = list(order)
            trial[ka], trial[kb] = trial[kb], trial[ka]
            yield trial
    if small:
        sequence = [order[k] for k in positions]
        for a, b in itertools.permutations(range(len(sequence)), 2):
            if abs(a - b) > 1:  # neighbours were swapped above
                moved = list(sequence)
                moved.insert(b, moved.pop(a))
                trial = list(order)
                for k, g in zip(positions, moved):
                    trial[k] = g
                yield trial


def search_order(pricing: Pricing) -> tuple[list[int], Score, list[int]]:
    """The best of the rule's starting orders, then best-improvement moves until none helps."""
    p = pricing.p
    scored = [(*solve_order(pricing, o), o) for o in _rule_orders(p)]
    score, starts, order = min(scored, key=lambda t: (t[0].excess, t[0].objective, t[0].squares))
    while True:
        improvement = None
        for trial in _moves(order, p):
            trial_score, trial_starts = solve_order(pricing, trial)
            if trial_score.better_than(score if improvement is None else improvement[0]):
                improvement = (trial_score, trial_starts, trial)
        if improvement is None:
            return order, score, starts
        score, starts, order = improvement


def order_is_free(p: PartitionProblem) -> bool:
    """Whether reordering can matter: two movable slots that differ."""
    return len({p.slots[g].signature for g in p.movable_slots}) > 1

