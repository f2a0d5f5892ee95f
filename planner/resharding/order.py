"""Load balancing and ordering of the transfers of one resharding (seed paper 001, section 3.2).

Each transfer has candidate routes (one per sender device that holds its slice), each with a
duration and the resources it holds (devices, host interfaces: :mod:`planner.resharding.cost`).
A *schedule* is an order of (transfer, route) pairs; its times follow by list scheduling: a
transfer starts when every resource it needs is free after the transfers before it (the paper:
"the earliest time at which all preceding tasks have finished on the sender host and the receiver
hosts"), so no device or interface runs two transfers at once. The goal is the earliest finish of
the last transfer (the paper's Eq. 1-3).

Three searches, the best kept (ties to the earlier):

* ``greedy``: longest transfer first, each on the route that finishes it earliest (then the
  least-loaded sender host): the paper's "load balance only" plus its order.
* ``randomized``: the paper's "greedy search with randomization": repeatedly pick, among a few
  seeded random orders, the largest set of transfers that share no resource (most devices), each
  on its least-loaded free route, and append it; restarted with several seeds.
* ``dfs``: depth-first search over (next transfer, route), pruned when the partial schedule's
  bound (a resource's free time plus the remaining transfers that need it on every route) reaches
  the best makespan found, and symmetric siblings (same routes, same durations) skipped.

Departure: the paper budgets the DFS in seconds; here the budget is a count of search nodes (DFS
nodes; for the randomized search, transfers looked at: it stops restarting past it), so a
plan is the same on every machine for a given seed (an optional wall-clock cap is the caller's
choice and makes the result machine-dependent when it bites).
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from planner.resharding.cost import SliceTransfer

Step = tuple[int, int]   # (transfer index, route index)


LARGE_PLAN = 128            # transfers past which the searches' budgets count work, not nodes
LARGE_PLAN_WORK = 100_000   # nodes x transfers for such a plan: ~0.1 s per search


@dataclass(frozen=True)
class Schedule:
    """``order``: (transfer, route) in start order; ``starts_ms``: each one's start; the makespan."""

    algorithm: str
    order: tuple[Step, ...]
    starts_ms: tuple[float, ...]
    makespan_ms: float


def evaluate(transfers: Sequence[SliceTransfer], order: Sequence[Step], algorithm: str) -> Schedule:
    """List-schedule ``order``: each transfer starts when all of its route's resources are free."""
    free: dict = {}
    starts, makespan = [], 0.0
    for index, route_index in order:
        route = transfers[index].routes[route_index]
        start = max((free.get(r, 0.0) for r in route.resources), default=0.0)
        end = start + route.duration_ms
        for resource in route.resources:
            free[resource] = end
        starts.append(start)
        makespan = max(makespan, end)
    return Schedule(algorithm, tuple(order), tuple(starts), makespan)


def greedy(transfers: Sequence[SliceTransfer]) -> Schedule:
    free: dict = {}
    load: dict = {}
    order = []
    for index in sorted(range(len(transfers)), key=lambda i: (-_shortest(transfers[i]), i)):
        def finish(route_index, routes=transfers[index].routes):
            route = routes[route_index]
            start = max((free.get(r, 0.0) for r in route.resources), default=0.0)
            return start + route.duration_ms, load.get(route.sender_host, 0.0), route_index

        best = min(range(len(transfers[index].routes)), key=finish)
        route = transfers[index].routes[best]
        end = finish(best)[0]
        for resource in route.resources:
            free[resource] = end
        load[route.sender_host] = load.get(route.sender_host, 0.0) + route.duration_ms
        order.append((index, best))
    return evaluate(transfers, order, "greedy")


def randomized(transfers: Sequence[SliceTransfer], seed: int, restarts: int = 4, tries: int = 8,
               max_nodes: Optional[int] = None) -> Schedule:
    """Up to ``restarts`` seeded restarts of ``tries`` random orders per round. With ``max_nodes``,
    once the transfers looked at (``tries`` per remaining transfer per round) reach it, rounds
    try one order and no new restart begins (the first always finishes; past
    :data:`LARGE_PLAN` transfers it finishes in greedy's order instead, as a round costs one look
    per remaining transfer and there are as many rounds as transfers)."""
    best: Optional[Schedule] = None
    spent = 0
    large = max_nodes is not None and len(transfers) > LARGE_PLAN
    for restart in range(restarts):
        if max_nodes is not None and restart > 0 and spent >= max_nodes:
            break
        rng = random.Random(seed * 1_000_003 + restart)
        remaining = list(range(len(transfers)))
        load: dict = {}
        order: list[Step] = []
        while remaining:
            if large and spent >= max_nodes:   # a large plan out of budget: the rest in greedy's order
                order.extend((i, min(range(len(transfers[i].routes)), key=lambda r, i=i: transfers[i].routes[r].duration_ms))
                             for i in sorted(remaining, key=lambda i: (-_shortest(transfers[i]), i)))
                break
            chosen_best, key_best = None, None
            round_tries = 1 if max_nodes is not None and spent >= max_nodes else tries
            spent += round_tries * len(remaining)
            for _ in range(round_tries):
                permutation = remaining[:]
                rng.shuffle(permutation)
                used: set = set()
                chosen = []
                for index in permutation:
                    routes = transfers[index].routes
                    options = [r for r in range(len(routes)) if not routes[r].resources & used]
                    if not options:
                        continue
                    pick = min(options, key=lambda r: (load.get(routes[r].sender_host, 0.0), routes[r].duration_ms, r))
                    chosen.append((index, pick))
                    used |= routes[pick].resources
                key = (sum(1 for kind, _ in used if kind == "dev"), sum(transfers[i].routes[r].duration_ms
                                                                          for i, r in chosen))
                if key_best is None or key > key_best:
                    chosen_best, key_best = chosen, key
            chosen_best.sort(key=lambda step: (-transfers[step[0]].routes[step[1]].duration_ms, step[0]))
            for index, pick in chosen_best:
                route = transfers[index].routes[pick]
                load[route.sender_host] = load.get(route.sender_host, 0.0) + route.duration_ms
            order.extend(chosen_best)
            taken = {index for index, _ in chosen_best}
            remaining = [i for i in remaining if i not in taken]
        schedule = evaluate(transfers, order, "randomized")
        if best is None or schedule.makespan_ms < best.makespan_ms:
            best = schedule
    return best


MAX_DFS_DEPTH = 400   # transfers the recursive DFS descends through: well inside Python's recursion limit


def dfs(transfers: Sequence[SliceTransfer], incumbent: Schedule, max_nodes: int = 20_000,
        time_budget_s: Optional[float] = None) -> Schedule:
    """Depth-first search started from ``incumbent``'s makespan; returns a better schedule or it.
    Past :data:`MAX_DFS_DEPTH` transfers it returns ``incumbent`` (one level per transfer would
    exhaust the recursion limit, and a node budget cannot reach far into such a tree anyway)."""
    count = len(transfers)
    if count > MAX_DFS_DEPTH:
        return incumbent
    # resources a transfer holds on every route, and its shortest duration: for the bound
    fixed = [frozenset.intersection(*(r.resources for r in t.routes)) for t in transfers]
    shortest = [_shortest(t) for t in transfers]
    signature = [tuple(sorted((tuple(sorted(r.resources)), r.duration_ms) for r in t.routes)) for t in transfers]
    deadline = None if time_budget_s is None else time.monotonic() + time_budget_s
    best_order: list[Optional[list[Step]]] = [None]
    best_makespan = [incumbent.makespan_ms]
    nodes = [0]

    def bound(free: dict, remaining: list[int], makespan: float) -> float:
        pending: dict = {}
        for index in remaining:
            for resource in fixed[index]:
                pending[resource] = pending.get(resource, 0.0) + shortest[index]
        return max([makespan] + [free.get(r, 0.0) + amount for r, amount in pending.items()])

    def search(free: dict, remaining: list[int], order: list[Step], makespan: float) -> None:
        if not remaining:
            if makespan < best_makespan[0] - 1e-12:
                best_makespan[0], best_order[0] = makespan, list(order)
            return
        nodes[0] += 1
        if nodes[0] > max_nodes or (deadline is not None and time.monotonic() > deadline):
            return
        if bound(free, remaining, makespan) >= best_makespan[0] - 1e-12:
            return
        tried: set = set()
        for index in sorted(remaining, key=lambda i: (-shortest[i], i)):
            if signature[index] in tried:
                continue
            tried.add(signature[index])
            rest = [i for i in remaining if i != index]
            routes = transfers[index].routes
            starts = [max((free.get(r, 0.0) for r in route.resources), default=0.0) for route in routes]
            for route_index in sorted(range(len(routes)), key=lambda r: (starts[r] + routes[r].duration_ms, r)):
                route = routes[route_index]
                end = starts[route_index] + route.duration_ms
                if end >= best_makespan[0] - 1e-12:
                    continue
                saved = {r: free.get(r) for r in route.resources}
                for resource in route.resources:
                    free[resource] = end
                order.append((index, route_index))
                search(free, rest, order, max(makespan, end))
                order.pop()
                for resource, value in saved.items():
                    if value is None:
                        del free[resource]
                    else:
                        free[resource] = value

    if count:
        search({}, list(range(count)), [], 0.0)
    if best_order[0] is None:
        return incumbent
    return evaluate(transfers, best_order[0], "dfs")


def best_schedule(transfers: Sequence[SliceTransfer], seed: int = 0, max_nodes: int = 20_000,
                  time_budget_s: Optional[float] = None) -> tuple[Schedule, dict[str, float]]:
    """The best of greedy, randomized greedy and DFS (ties to the earlier), and every makespan.
    ``max_nodes`` bounds the DFS and the randomized search's restarts alike; past
    :data:`LARGE_PLAN` transfers it shrinks so that nodes x transfers stays within
    :data:`LARGE_PLAN_WORK` (each node costs one pass over the transfers: a 512-device boundary
    planned at plan time took seconds otherwise)."""
    if len(transfers) > LARGE_PLAN:
        max_nodes = max(1, min(max_nodes, LARGE_PLAN_WORK // len(transfers)))
    candidates = [greedy(transfers), randomized(transfers, seed, max_nodes=max_nodes)]
    incumbent = min(candidates, key=lambda s: s.makespan_ms)
    candidates.append(dfs(transfers, incumbent, max_nodes, time_budget_s))
    makespans = {s.algorithm: s.makespan_ms for s in candidates[:2]}
    makespans["dfs"] = candidates[2].makespan_ms
    best = min(candidates, key=lambda s: s.makespan_ms)
    return best, makespans


def _shortest(transfer: SliceTransfer) -> float:
    return min(route.duration_ms for route in transfer.routes)
