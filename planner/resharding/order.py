"""Load balancing and ordering of the transfers of one resharding (seed paper 001, section 3.2).

Each transfer has candidate routes (one per sender device that holds its slice), each with a
duration and the resources it holds (devices, host interfaces: :mod:`planner.resharding.cost`).
A *schedule* is an order of (transfer, route) pairs; its times follow by list scheduling: a
transfer starts when every resource it needs is free after the transfers before it (the paper:
"the earliest time at which all preceding tasks have finished on the sender host and the receiver
hosts"), so no device or interface runs two transfers at once. The goal is the earliest finish of
the last transfer (the paper's Eq. 1-3).

Four searches, the best kept (ties to the earlier, in this order; a search is skipped once greedy
or first fit meets :func:`resource_floor`, and the DFS starts from the best of the other three):

* ``greedy``: longest transfer first, each on the route that finishes it earliest (then the
  least-loaded sender host): the paper's "load balance only" plus its order.
* ``randomized``: the paper's "greedy search with randomization": repeatedly pick, among a few
  seeded random orders, the largest set of transfers that share no resource (most devices), each
  on its least-loaded free route, and append it; restarted with several seeds.
* ``firstfit``: each transfer at the earliest time one of its routes finds all of its resources
  free for its whole duration, *gaps left by earlier placements included*, on the route that
  finishes first; passes in several orders (longest first and busiest resources first, ties in
  seeded random order), and most-work-remaining dispatches (:func:`dispatch`), within a work
  budget (:func:`first_fit_search`). Greedy and randomized append each transfer after the last one
  on its resources, so on a large plan one early misplacement idles an interface for good: an
  all-to-all over 8 hosts (64 devices batch-split to feature-split, 4096 transfers) came out at
  8x its lower bound; first fit lands at 1.03x. Each resource's free time is a sorted list of
  gaps, so a transfer costs a few probes (~40k for those 4096). Every schedule is list-scheduled
  from its order (:func:`evaluate`): a first-fit schedule is its placements in start order, which
  starts nothing later than first fit placed it.
* ``dfs``: depth-first search over (next transfer, route), pruned when the partial schedule's
  bound (a resource's free time plus the remaining transfers that need it on every route) reaches
  the best makespan found, and symmetric siblings (same routes, same durations) skipped.

Work, not seconds, bounds the searches, so a plan is the same on every machine for a given seed
(the paper budgets the DFS in seconds; an optional wall-clock cap on the DFS is the caller's choice
and makes the result machine-dependent when it bites). ``max_nodes`` bounds the DFS (nodes; nodes x
transfers also within :data:`DFS_WORK`) and the randomized search (transfers looked at: it stops
restarting past it); past :data:`LARGE_PLAN` transfers both shrink so that nodes x transfers stays
within :data:`LARGE_PLAN_WORK`. First fit counts probes (one look at one resource's gap list, one
route tried) and the dispatch transfers looked at: its first two passes always complete (a few
probes per route and resource: linear in the plan), the rest stop once
:data:`FIRST_FIT_WORK_PER_NODE` x ``max_nodes`` are spent. :func:`best_schedule` reports each
search's work.
"""
from __future__ import annotations

import heapq
import random
import time
from bisect import bisect_right
from dataclasses import dataclass
from typing import Optional, Sequence

from planner.resharding.cost import SliceTransfer

Step = tuple[int, int]   # (transfer index, route index)


LARGE_PLAN = 128            # transfers past which the searches' budgets count work, not nodes
LARGE_PLAN_WORK = 100_000   # nodes x transfers for such a plan: ~0.1 s per search
DFS_WORK = 400_000          # DFS nodes x transfers at most, at any size (~0.25 s; a 64-transfer all-to-all spent 1.1M)
FIRST_FIT_WORK_PER_NODE = 10   # first fit's work after its first two passes, per search node
FIRST_FIT_WORK = FIRST_FIT_WORK_PER_NODE * 20_000   # at plan_resharding's default budget (~0.1 s)
FIRST_FIT_PASSES = 16       # first fit's passes at most (the dispatch counts as one)


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
               max_nodes: Optional[int] = None, work: Optional[dict] = None) -> Schedule:
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
    if work is not None:
        work["randomized"] = spent
    return best


MAX_DFS_DEPTH = 400   # transfers the recursive DFS descends through: well inside Python's recursion limit


def dfs(transfers: Sequence[SliceTransfer], incumbent: Schedule, max_nodes: int = 20_000,
        time_budget_s: Optional[float] = None, work: Optional[dict] = None) -> Schedule:
    """Depth-first search started from ``incumbent``'s makespan; returns a better schedule or it.
    Past :data:`MAX_DFS_DEPTH` transfers it returns ``incumbent`` (one level per transfer would
    exhaust the recursion limit, and a node budget cannot reach far into such a tree anyway)."""
    count = len(transfers)
    if work is not None:
        work["dfs"] = 0
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
        if work is not None:
            work["dfs"] += len(remaining)
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


def first_fit(transfers: Sequence[SliceTransfer], sequence: Sequence[int]) -> tuple[list[tuple[float, int, int]], int]:
    """Place the transfers in ``sequence`` order, each at the earliest time at which every resource
    of one of its routes is free for the route's whole duration (gaps between earlier placements
    count), on the route that ends first (ties: the lower route index). Returns ``(start, transfer,
    route)`` per transfer and the probes spent. Each resource's free time is a sorted list of gaps
    ``[lo, hi)`` (the last one endless), so a placement looks at a few gaps, not at every transfer
    already placed on its resources."""
    gaps: dict = {}   # resource -> (gap starts, gap ends), sorted
    placed = []
    probes = 0
    for index in sequence:
        best = None
        for route_index, route in enumerate(transfers[index].routes):
            duration = route.duration_ms
            lists = [gaps.get(r) or gaps.setdefault(r, ([0.0], [_ENDLESS])) for r in route.resources]
            start, moved = 0.0, bool(lists) and duration > 0
            while moved:   # until one start fits every resource's gaps
                moved = False
                for los, his in lists:
                    k = bisect_right(his, start)   # the first gap ending after start
                    while True:
                        probes += 1
                        fits = start if start > los[k] else los[k]
                        if fits + duration <= his[k]:
                            break
                        k += 1
                    if fits > start:
                        start, moved = fits, True
            probes += 1
            if best is None or start + duration < best[0]:
                best = (start + duration, start, route_index, lists)
        end, start, route_index, lists = best
        if end > start:
            for los, his in lists:   # cut [start, end) out of the gap holding it
                k = bisect_right(his, start)
                lo, hi = los[k], his[k]
                keep = [(a, b) for a, b in ((lo, start), (end, hi)) if b > a]
                los[k:k + 1] = [a for a, _ in keep]
                his[k:k + 1] = [b for _, b in keep]
        placed.append((start, index, route_index))
    return placed, probes


_ENDLESS = float("inf")


def dispatch(transfers: Sequence[SliceTransfer], max_work: int, rule: str = "busiest"
             ) -> tuple[Optional[list[tuple[float, int, int]]], int]:
    """Non-delay list scheduling by most work remaining: whenever transfers end, every transfer
    one of whose routes finds all of its resources free starts, those with the most work left on
    their fixed resources first (``rule`` ``"busiest"``: on the busiest one; ``"interfaces"``: on
    their host interfaces together), then longest, each on its shortest free route. Returns
    ``(start, transfer, route)`` per transfer and the work spent (transfers looked at), or None
    for the placements once ``max_work`` is spent (each time only the transfers that use a resource
    just freed are looked at, but on a large plan there are many). Open-shop practice: serving
    the busiest interface first keeps the bottlenecks busy where first fit's fixed order may not."""
    count = len(transfers)
    shortest = [_shortest(t) for t in transfers]
    fixed = [tuple(frozenset.intersection(*(r.resources for r in t.routes))) for t in transfers]
    left_work: dict = {}
    users: dict = {}
    for index, transfer in enumerate(transfers):
        for resource in fixed[index]:
            left_work[resource] = left_work.get(resource, 0.0) + shortest[index]
        for resource in frozenset().union(*(r.resources for r in transfer.routes)):
            users.setdefault(resource, []).append(index)
    free_at: dict = {}
    waiting = set(range(count))
    placed: list[tuple[float, int, int]] = []
    ends: list[float] = []   # a heap of end times
    now, candidates, spent = 0.0, list(range(count)), 0
    while True:
        spent += len(candidates)
        if spent > max_work:
            return None, spent
        if rule == "busiest":
            candidates.sort(key=lambda i: (-max((left_work[r] for r in fixed[i]), default=0.0), -shortest[i], i))
        else:
            candidates.sort(key=lambda i: (-sum(left_work[r] for r in fixed[i] if r[0] != "dev"), -shortest[i], i))
        for index in candidates:
            routes = transfers[index].routes
            free = [k for k, route in enumerate(routes) if all(free_at.get(r, 0.0) <= now for r in route.resources)]
            if not free:
                continue
            route_index = min(free, key=lambda k: (routes[k].duration_ms, k))
            route = routes[route_index]
            for resource in route.resources:
                free_at[resource] = now + route.duration_ms
            for resource in fixed[index]:
                left_work[resource] -= shortest[index]
            waiting.discard(index)
            placed.append((now, index, route_index))
            if route.duration_ms > 0:
                heapq.heappush(ends, now + route.duration_ms)
        if not waiting:
            return placed, spent
        if not ends:   # cannot happen: a transfer with no resource busy always starts
            return None, spent
        now = heapq.heappop(ends)
        while ends and ends[0] <= now:
            heapq.heappop(ends)
        freed = [r for r, at in free_at.items() if at == now]
        candidates = sorted({i for r in freed for i in users.get(r, ()) if i in waiting})


def resource_floor(transfers: Sequence[SliceTransfer]) -> float:
    """No schedule of ``transfers`` ends sooner than its busiest resource is busy: each transfer's
    shortest route on the resources every route holds. A schedule that meets it is optimal."""
    load: dict = {}
    for transfer in transfers:
        shortest = _shortest(transfer)
        for resource in frozenset.intersection(*(r.resources for r in transfer.routes)):
            load[resource] = load.get(resource, 0.0) + shortest
    return max(load.values(), default=0.0)


def first_fit_search(transfers: Sequence[SliceTransfer], seed: int, max_work: int = FIRST_FIT_WORK
                     ) -> tuple[Schedule, int]:
    """The best of several first-fit passes and two :func:`dispatch` runs, and the work spent
    (probes, transfers looked at). Passes: longest first; the transfers on the busiest resources
    first (a transfer's fixed resources, those of every route, by total shortest duration; then
    longest), both with ties in seeded random order (index order, sender by sender, idles the
    receivers' interfaces: 1.5x the bound on a batch-to-feature layout where random ties give
    1.01x); then, while fewer than ``max_work`` are spent, :data:`FIRST_FIT_PASSES` passes at most
    and the best schedule still above the resource bound (no resource can be busier than the
    transfers that need it on every route; a schedule that meets it is optimal): the dispatch by
    busiest resource, the dispatch by busiest interfaces, then longest first with other seeds. No
    one order wins everywhere: on tight all-to-all-like layouts (every interface and some devices
    near the bound) the dispatch does best, on others a first-fit pass."""
    count = len(transfers)
    shortest = [_shortest(t) for t in transfers]
    fixed = [frozenset.intersection(*(r.resources for r in t.routes)) for t in transfers]
    load: dict = {}
    for index in range(count):
        for resource in fixed[index]:
            load[resource] = load.get(resource, 0.0) + shortest[index]
    floor = resource_floor(transfers)
    pressure = [max((load[r] for r in fixed[i]), default=0.0) for i in range(count)]
    best: Optional[Schedule] = None
    spent, attempt = 0, 0
    rules = ["busiest", "interfaces"]   # the dispatches, after the first two passes
    while attempt < FIRST_FIT_PASSES:
        if attempt >= 2 and (spent >= max_work or best.makespan_ms <= floor * (1 + 1e-9) or count <= 1):
            break
        rng = random.Random(seed * 1_000_003 + attempt)
        noise = [rng.random() for _ in range(count)]   # ties in seeded random order, not index order:
        # unit tasks come sender by sender, so index order queues a sender's transfers back to back
        if attempt == 0:
            sequence = sorted(range(count), key=lambda i: (-shortest[i], noise[i]))
        elif attempt == 1:
            sequence = sorted(range(count), key=lambda i: (-pressure[i], -shortest[i], noise[i]))
        elif rules:
            found, used = dispatch(transfers, max_work - spent, rules.pop(0))
            spent += used
            attempt += 1
            if found is not None:
                best = _better(transfers, found, best, "dispatch")
            continue
        else:
            sequence = sorted(range(count), key=lambda i: (-shortest[i], noise[i]))
        placed, probes = first_fit(transfers, sequence)
        spent += probes
        best = _better(transfers, placed, best, "firstfit")
        attempt += 1
    return best, spent


def _better(transfers: Sequence[SliceTransfer], placed: list[tuple[float, int, int]], best: Optional[Schedule],
            algorithm: str) -> Schedule:
    """The placements list-scheduled in start order (:func:`evaluate`), if better than ``best``."""
    schedule = evaluate(transfers, [(index, route) for _, index, route in sorted(placed)], algorithm)
    return schedule if best is None or schedule.makespan_ms < best.makespan_ms else best


def best_schedule(transfers: Sequence[SliceTransfer], seed: int = 0, max_nodes: int = 20_000,
                  time_budget_s: Optional[float] = None, work: Optional[dict] = None
                  ) -> tuple[Schedule, dict[str, float]]:
    """The best of greedy, randomized greedy, first fit and DFS (ties to the earlier; the randomized
    search runs only when neither greedy nor first fit meets :func:`resource_floor`, the DFS only
    when none of them does, starting from the best), and every makespan (a skipped search's is the
    best schedule's before it). ``max_nodes`` bounds the DFS and the randomized search's restarts
    alike; past :data:`LARGE_PLAN` transfers it shrinks so that nodes x transfers stays within
    :data:`LARGE_PLAN_WORK` (each node costs one pass over the transfers: a 512-device boundary
    planned at plan time took seconds otherwise), and the DFS's nodes x transfers stay within
    :data:`DFS_WORK` at any size. First fit's passes after its first two stop at
    :data:`FIRST_FIT_WORK_PER_NODE` x ``max_nodes`` probes (:data:`FIRST_FIT_WORK` by default).
    ``work``, when given, receives each search's work (greedy: routes tried; randomized: transfers
    looked at; dfs: nodes x transfers left; firstfit: probes)."""
    fit_work = FIRST_FIT_WORK_PER_NODE * max_nodes
    if len(transfers) > LARGE_PLAN:
        max_nodes = max(1, min(max_nodes, LARGE_PLAN_WORK // len(transfers)))
    spent: dict = {} if work is None else work
    floor = resource_floor(transfers) * (1 + 1e-9)
    first = greedy(transfers)
    spent["greedy"] = sum(len(t.routes) for t in transfers)
    fitted, spent["firstfit"] = first_fit_search(transfers, seed, fit_work)
    if min(first.makespan_ms, fitted.makespan_ms) <= floor:   # optimal already: the randomized search is skipped
        spent["randomized"] = 0
        candidates = [first, first if first.makespan_ms <= floor else fitted, fitted]
    else:
        candidates = [first, randomized(transfers, seed, max_nodes=max_nodes, work=spent), fitted]
    incumbent = min(candidates, key=lambda s: s.makespan_ms)
    if incumbent.makespan_ms <= floor:   # optimal: nothing left to search
        spent["dfs"] = 0
        candidates.append(incumbent)
    else:
        candidates.append(dfs(transfers, incumbent, max(1, min(max_nodes, DFS_WORK // max(1, len(transfers)))),
                              time_budget_s, work=spent))
    makespans = {name: candidates[k].makespan_ms for k, name in enumerate(("greedy", "randomized", "firstfit", "dfs"))}
    best = min(candidates, key=lambda s: s.makespan_ms)
    return best, makespans


def _shortest(transfer: SliceTransfer) -> float:
    return min(route.duration_ms for route in transfer.routes)
