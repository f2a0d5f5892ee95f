"""The exact pipeline partitioner: a mixed-integer program solved by CBC through PuLP.

Same model as :mod:`planner.partition` (read its docstring first), written as linear constraints:

* ``b[l, k]`` (binary, ``k = 1..S-1``): layer ``l`` runs in stage ``k`` or later. Non-increasing
  in ``k`` and non-decreasing in ``l``, it makes every stage a contiguous range; stage ``k`` runs
  ``x[l, k] = b[l, k] - b[l, k+1]`` (with ``b[l, 0] = 1``, ``b[l, S] = 0``) and is non-empty.
* Stage ``k`` ends at layer ``l`` iff ``b[l+1, k+1] - b[l, k+1] = 1``, so the bytes it sends,
  ``sum_l cut_l (b[l+1, k+1] - b[l, k+1])``, and receives are linear too: no product terms.
* ``p[g, k]`` (binary, only when the order is searched): slot ``g`` runs position ``k``; a
  permutation. Speed and memory depend on the slot, so the rows ``T >= time(k, g)`` and
  ``memory(k, g, device) <= capacity`` hold only where ``p[g, k] = 1`` (big-M, with ``M`` the
  largest value the row can take). Interchangeable slots keep their given relative order, which
  removes symmetric copies of every solution.
* Objective: minimise ``T``. Times are scaled by the warm start's bottleneck and memory rows by
  the device capacity, so CBC works on numbers near 1.

CBC starts from the greedy partition (``warmStart``), so it never returns anything worse; when it
stops on ``time_limit_s`` with a solution, the relative gap comes from the lower bound in its log.
"""
from __future__ import annotations

import logging
import os
import re
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import pulp

if TYPE_CHECKING:
    from .partition import Partition, PartitionProblem

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IlpSolution:
    order: tuple[int, ...]   # slot of each position
    starts: tuple[int, ...]  # first layer of each stage
    gap: Optional[float]     # relative optimality gap: 0 when proven optimal, None when unknown


def solve_ilp(p: "PartitionProblem", warm: Optional["Partition"], time_limit_s: float) -> Optional[IlpSolution]:
    """Solve ``p`` exactly; None when CBC finds no solution in time (raises nothing itself: the
    caller reports infeasibility with its own diagnosis)."""
    L, S = len(p.layers), len(p.slots)
    mb = p.micro_batch
    scale = warm.bottleneck_s if warm is not None else mb * sum(l.flops for l in p.layers) / max(s.flops_per_s for s in p.slots)
    prob = pulp.LpProblem("pipeline_partition", pulp.LpMinimize)
    T = prob.add_variable("T", lowBound=0)
    prob += T

    b = {(l, k): prob.add_variable(f"b_{l}_{k}", cat="Binary") for l in range(L) for k in range(1, S)}

    def B(l: int, k: int):
        return 1 if k == 0 else 0 if k == S else b[l, k]

    for l in range(L):
        for k in range(1, S - 1):
            prob += b[l, k] >= b[l, k + 1]
        if l + 1 < L:
            for k in range(1, S):
                prob += b[l + 1, k] >= b[l, k]
    x = {(l, k): B(l, k) - B(l, k + 1) for l in range(L) for k in range(S)}
    for k in range(S):
        prob += pulp.lpSum(x[l, k] for l in range(L)) >= 1
    for layer, stage in p.pinned.items():
        prob += x[layer, stage] == 1
    sent = [pulp.lpSum(p.layers[l].cut_bytes * (B(l + 1, k + 1) - B(l, k + 1)) for l in range(L - 1))
            if k < S - 1 else 0 for k in range(S)]
    received = [sent[k - 1] if k > 0 else 0 for k in range(S)]
    flops = [pulp.lpSum(p.layers[l].flops * x[l, k] for l in range(L)) for k in range(S)]
    static = [pulp.lpSum(p.layers[l].static_bytes * x[l, k] for l in range(L)) for k in range(S)]
    act = [pulp.lpSum(p.layers[l].activation_bytes * x[l, k] for l in range(L)) for k in range(S)]

    comm = []
    for k in range(S):
        c = 0
        if k < S - 1:
            c += p.links[k].latency_s + mb * sent[k] / p.links[k].bandwidth_bytes_per_s
        if k > 0:
            c += p.links[k - 1].latency_s + mb * received[k] / p.links[k - 1].bandwidth_bytes_per_s
        comm.append(c)
    max_cut = max(l.cut_bytes for l in p.layers)
    max_comm = max((2 * (lk.latency_s + mb * max_cut / lk.bandwidth_bytes_per_s) for lk in p.links), default=0.0)
    total = {"flops": sum(l.flops for l in p.layers), "static": sum(l.static_bytes for l in p.layers),
             "act": sum(l.activation_bytes for l in p.layers) + 2 * max_cut}

    search = p.order == "search" and len(p.movable_slots) > 1
    movable = set(p.movable_slots) if search else set()
    if search:
        pv = {(g, k): prob.add_variable(f"p_{g}_{k}", cat="Binary") for g in movable for k in range(S)}
        for g in range(S):
            if g not in movable:
                continue
            prob += pulp.lpSum(pv[g, k] for k in range(S)) == 1
        fixed_positions = {g for g in range(S) if g not in movable}
        for k in range(S):
            if k in fixed_positions:
                for g in movable:
                    prob += pv[g, k] == 0
            else:
                prob += pulp.lpSum(pv[g, k] for g in movable) == 1
        by_signature: dict = {}
        for g in sorted(movable):
            by_signature.setdefault(p.slots[g].signature, []).append(g)
        for same in by_signature.values():
            for g0, g1 in zip(same, same[1:]):
                prob += pulp.lpSum(k * pv[g0, k] for k in range(S)) <= pulp.lpSum(k * pv[g1, k] for k in range(S))

    def placed(g: int, k: int):
        """(1 - p[g, k]) when the order is searched: 0 where slot g runs position k."""
        if g in movable:
            return 1 - pv[g, k]
        return None if g == k else False  # fixed slot: only its own position

    for k in range(S):
        for g in range(S):
            off = placed(g, k)
            if off is False:
                continue
            slot = p.slots[g]
            t = (mb * flops[k] / slot.flops_per_s + comm[k]) / scale
            if off is None:
                prob += T >= t
            else:
                big_t = (mb * total["flops"] / slot.flops_per_s + max_comm) / scale
                prob += T >= t - big_t * off
            for d in slot.memory_classes:
                worst = d.weight_fraction * total["static"] + d.batch_fraction * mb * p.in_flight[k] * total["act"]
                if worst <= d.capacity_bytes:
                    continue  # fits whatever the stage holds
                per_sample = act[k] + received[k] + sent[k]
                need = (d.weight_fraction * static[k] + d.batch_fraction * mb * p.in_flight[k] * per_sample) / d.capacity_bytes
                if off is None:
                    prob += need <= 1
                else:
                    prob += need <= 1 + (worst / d.capacity_bytes - 1) * off

    if warm is not None:
        _set_warm_start(warm, b, pv if search else {}, T, S)
    with tempfile.TemporaryDirectory() as tmp:
        log_path = os.path.join(tmp, "cbc.log")
        cmd = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, warmStart=warm is not None, logPath=log_path,
                                threads=1)
        prob.solve(cmd)
        log_text = open(log_path).read() if os.path.exists(log_path) else ""
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        log.info("CBC found no partition (%s)", pulp.LpStatus[prob.status])
        return None
    stage_of = [sum(round(b[l, k].value()) for k in range(1, S)) for l in range(L)]
    starts = tuple(stage_of.index(k) for k in range(S))
    order = tuple(
        next((g for g in movable if round(pv[g, k].value()) == 1), k) if search else k for k in range(S)
    )
    gap = 0.0 if prob.sol_status == pulp.LpSolutionOptimal else _gap_from_log(log_text)
    return IlpSolution(order, starts, gap)


def _set_warm_start(warm: "Partition", b, pv, T, S: int) -> None:
    for (l, k), var in b.items():
        var.setInitialValue(1 if l >= warm.stages[k].first else 0)
    for (g, k), var in pv.items():
        var.setInitialValue(1 if warm.stages[k].slot == g else 0)
    T.setInitialValue(1.0)


def _gap_from_log(text: str) -> Optional[float]:
    """CBC prints 'Objective value: X' and 'Lower bound: Y' when it stops on a limit."""
    obj = re.search(r"Objective value:\s*([-\d.eE+]+)", text)
    bound = re.search(r"Lower bound:\s*([-\d.eE+]+)", text)
    if not obj or not bound:
        return None
    o, lb = float(obj.group(1)), float(bound.group(1))
    return max(0.0, (o - lb) / o) if o > 0 else 0.0
