"""The exact pipeline partitioner: a mixed-integer program solved by CBC through PuLP.

Same model as :mod:`planner.partition.solve` (read its docstring first), written as linear constraints:

* ``b[l, k]`` (binary, ``k = 1..S-1``): layer ``l`` runs in stage ``k`` or later. Non-increasing
  in ``k`` and non-decreasing in ``l``, it makes every stage a contiguous range; stage ``k`` runs
  ``x[l, k] = b[l, k] - b[l, k+1]`` (with ``b[l, 0] = 1``, ``b[l, S] = 0``) and is non-empty.
* Stage ``k`` ends at layer ``l`` iff ``b[l+1, k+1] - b[l, k+1] = 1``, so the bytes it sends,
  ``sum_l cut_l (b[l+1, k+1] - b[l, k+1])``, and receives are linear too: no product terms.
* ``p[g, k]`` (binary, only for slots whose position is searched): slot ``g`` runs position
  ``k``; a permutation. A stage's time and memory are products of what it holds (a function of
  ``b``) and which slot holds it (``p``). Each such quantity ``Q_k`` (FLOPs, bytes of weights,
  gradients and optimizer state, bytes per sample) is *disaggregated* over slots:
  ``Q_k = sum_g q[g, k]`` with ``0 <= q[g, k] <= max(Q) p[g, k]`` (in units of ``max(Q)``), so
  ``q[g, k]`` is ``Q_k`` on the chosen slot and 0 elsewhere, and
  ``T >= micro_batch * sum_g flops[g, k] / speed_g + comm_k`` and
  ``memory(g, k, device) <= capacity * p[g, k]`` are linear (the memory model,
  :class:`~planner.devices.memory.MemoryTerms`, is linear in its bytes). Its LP relaxation mixes
  slot speeds per position instead of dropping the rows as a big-M form would, which keeps CBC's bound useful.
  Interchangeable slots keep their given relative order, which removes symmetric copies.
* Objective: minimise ``T`` (``PartitionProblem.objective`` ``"bottleneck"``), bounded above by
  the warm start; under ``"step"`` (whose schedule makespan is no linear program) the pipelined
  bound ``E >= time_0 + ... + time_(k-1) + m time_k`` for every ``k``
  (:meth:`~planner.partition.problem.PartitionProblem.pipelined_bound`), bounded above by the warm
  start's; only its order is used. Times are scaled by the warm start's bottleneck and memory rows
  by the device capacity, so CBC works on numbers near 1.

CBC starts from the greedy partition (``warmStart``) and the objective is bounded by it, so "infeasible"
then means nothing beats the greedy answer; when CBC stops on ``time_limit_s``, the relative gap
comes from the lower bound it prints in its log.

CBC runs through ``pulp.COIN_CMD``, PuLP's supported interface to it. ``PULP_CBC_CMD`` (the CBC
binary bundled inside PuLP) is deprecated and goes away in PuLP 4.0, whose CBC comes from the
``cbcbox`` package (``pip install pulp[cbc]``). :func:`cbc_path` takes that one when installed,
else a ``cbc`` on ``PATH``, else the copy PuLP 3 still bundles; the model and the answers are the
same whichever binary runs. PuLP waits on CBC without a bound, and CBC can ignore its ``-sec``
limit, so CBC runs under a bound of its own (:func:`_bounded_cbc`); killed, it leaves the greedy
partition.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import pulp

from planner.plan import PlanError

if TYPE_CHECKING:
    from planner.partition.problem import Partition, PartitionProblem

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IlpOutcome:
    """What CBC concluded. ``status``: ``"optimal"``; ``"stopped"`` (time limit, with a solution);
    ``"infeasible"`` (nothing fits, or, with a warm start, nothing beats it); ``"no solution"``
    (time limit before any solution)."""

    status: str
    order: Optional[tuple[int, ...]] = None  # slot of each position, when CBC has a solution
    gap: Optional[float] = None              # relative optimality gap: 0 when proven optimal


def solve_ilp(p: "PartitionProblem", warm: Optional["Partition"], time_limit_s: float) -> IlpOutcome:
    """Solve ``p`` exactly. Only the group order is returned: the caller re-splits the layers for
    that order with its exact dynamic program, which also removes any overshoot within CBC's
    feasibility tolerance (1e-7 of a device's memory)."""
    L, S = len(p.layers), len(p.slots)
    mb = p.micro_batch
    scale = warm.bottleneck_s if warm is not None else mb * sum(l.flops for l in p.layers) / max(s.flops_per_s for s in p.slots)
    prob = pulp.LpProblem("pipeline_partition", pulp.LpMinimize)
    step = p.objective == "step"
    T = prob.add_variable("T", lowBound=0, upBound=1 + 1e-6 if warm is not None and not step else None)
    times = []   # each stage's time per micro-batch, scaled (the "step" objective sums them)

    # contiguous stages
    b = {(l, k): prob.add_variable(f"b_{l}_{k}", cat="Binary") for l in range(L) for k in range(1, S)}

    def B(l: int, k: int):
        return 1 if k == 0 else 0 if k == S else b[l, k]

    for l in range(L):
        for k in range(1, S - 1):
            prob += b[l, k] >= b[l, k + 1]
        for k in range(1, S) if l + 1 < L else ():
            prob += b[l + 1, k] >= b[l, k]
    x = {(l, k): B(l, k) - B(l, k + 1) for l in range(L) for k in range(S)}
    for k in range(S):
        prob += pulp.lpSum(x[l, k] for l in range(L)) >= 1
    for layer, stage in p.pinned.items():
        prob += x[layer, stage] == 1

    # what each position holds and sends; FLOPs and bytes as fractions of their largest possible
    # value, so that no row mixes coefficients of 1e12 and 1e-12 (CBC's tolerances are absolute)
    max_cut = max(l.cut_bytes for l in p.layers)
    held = {"weights": "param_bytes", "gradients": "gradient_bytes", "optimizer": "optimizer_bytes",
            "foreach_update": "foreach_update_bytes"}
    # stepping parameter by parameter a stage holds its largest layer's update temporaries: no linear term, so
    # every stage is priced at the largest layer's (an upper bound; Pricing, which judges the split, is exact)
    loop_update = max(l.update_bytes for l in p.layers)
    bounds = {"flops": sum(l.flops for l in p.layers),
              **{name: sum(getattr(l, field) for l in p.layers) for name, field in held.items()},
              "per_sample": sum(l.activation_bytes for l in p.layers) + 2 * max_cut}
    bounds = {name: value if value > 0 else 1.0 for name, value in bounds.items()}
    sent = [pulp.lpSum(p.layers[l].cut_bytes * (B(l + 1, k + 1) - B(l, k + 1)) for l in range(L - 1))
            if k < S - 1 else 0 for k in range(S)]
    received = [sent[k - 1] if k > 0 else 0 for k in range(S)]
    totals = {
        "flops": [pulp.lpSum(p.layers[l].flops / bounds["flops"] * x[l, k] for l in range(L)) for k in range(S)],
        **{name: [pulp.lpSum(getattr(p.layers[l], field) / bounds[name] * x[l, k] for l in range(L)) for k in range(S)]
           for name, field in held.items()},
        "per_sample": [(pulp.lpSum(p.layers[l].activation_bytes * x[l, k] for l in range(L)) + received[k] + sent[k])
                       / bounds["per_sample"] for k in range(S)],
    }
    comm = []
    for k in range(S):
        c = 0
        if k < S - 1:
            c += p.links[k].latency_s + mb * sent[k] / p.links[k].bandwidth_bytes_per_s
        if k > 0:
            c += p.links[k - 1].latency_s + mb * received[k] / p.links[k - 1].bandwidth_bytes_per_s
        comm.append(c)

    # which slot runs which position
    movable = set(p.movable_slots) if len(p.movable_slots) > 1 else set()
    open_positions = sorted(movable)  # a kept slot keeps its own position
    pv = {(g, k): prob.add_variable(f"p_{g}_{k}", cat="Binary") for g in movable for k in open_positions}
    for g in movable:
        prob += pulp.lpSum(pv[g, k] for k in open_positions) == 1
    for k in open_positions:
        prob += pulp.lpSum(pv[g, k] for g in movable) == 1
    by_signature: dict = {}
    for g in sorted(movable):
        by_signature.setdefault(p.slots[g].signature, []).append(g)
    for same in by_signature.values():
        for g0, g1 in zip(same, same[1:]):
            prob += pulp.lpSum(k * pv[g0, k] for k in open_positions) <= pulp.lpSum(k * pv[g1, k] for k in open_positions)

    def candidates(k: int) -> list[int]:
        return sorted(movable) if k in movable else [k]

    for k in range(S):
        slots = candidates(k)
        if len(slots) == 1:
            parts = {slots[0]: {name: totals[name][k] for name in totals}}
        else:
            parts = {g: {} for g in slots}
            for name in totals:
                for g in slots:
                    parts[g][name] = q = prob.add_variable(f"{name}_{g}_{k}", lowBound=0)
                    prob += q <= pv[g, k]
                prob += pulp.lpSum(parts[g][name] for g in slots) == totals[name][k]
        compute = pulp.lpSum(parts[g]["flops"] * (mb * bounds["flops"] / p.slots[g].flops_per_s) for g in slots)
        times.append((compute + comm[k]) / scale)
        prob += T >= times[-1]
        for g in slots:
            on = pv[g, k] if len(slots) > 1 else 1
            for d in p.slots[g].memory_classes:
                most = d.terms(bounds["weights"], bounds["gradients"], bounds["optimizer"], bounds["per_sample"],
                               p.in_flight[k], bounds["foreach_update"] if d.foreach else loop_update)
                if most.total(mb) <= d.capacity_bytes:
                    continue  # fits whatever the stage holds
                update = (parts[g]["foreach_update"] * bounds["foreach_update"] if d.foreach
                          else loop_update * on if loop_update else 0.0)
                held_here = d.terms(*(parts[g][name] * bounds[name] for name in ("weights", "gradients", "optimizer",
                                                                                 "per_sample")), p.in_flight[k], update)
                for peak in held_here.peaks(mb):   # while the micro-batches run, and at the update after them
                    prob += peak / d.capacity_bytes <= on

    if step:
        E = prob.add_variable("E", lowBound=0)
        for k in range(S):
            prob += E >= pulp.lpSum(times[:k]) + p.num_micro_batch * times[k]
        prob += E
        if warm is not None:   # nothing worse than the warm start
            prob += E <= p.pipelined_bound([st.time_s for st in warm.stages]) / scale * (1 + 1e-6)
    else:
        prob += T
    if warm is not None:
        for (l, k), var in b.items():
            var.setInitialValue(1 if l >= warm.stages[k].first else 0)
        for (g, k), var in pv.items():
            var.setInitialValue(1 if warm.stages[k].slot == g else 0)
    with tempfile.TemporaryDirectory() as tmp:
        log_path = os.path.join(tmp, "cbc.log")
        cmd = pulp.COIN_CMD(path=_bounded_cbc(tmp, cbc_path(), time_limit_s), msg=False, timeLimit=time_limit_s,
                            warmStart=warm is not None, logPath=log_path, threads=1)
        try:
            prob.solve(cmd)
        except pulp.PulpSolverError as e:   # CBC killed past its limit (_bounded_cbc), or crashed
            log.warning("CBC did not finish (%s); the greedy partition stands", e)
            return IlpOutcome("no solution")
        log_text = open(log_path).read() if os.path.exists(log_path) else ""
    if prob.status == pulp.LpStatusInfeasible:
        return IlpOutcome("infeasible")
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        log.info("CBC stopped without a partition (%s)", pulp.LpStatus[prob.status])
        return IlpOutcome("no solution")
    order = tuple(next((g for g in movable if round(pv[g, k].value()) == 1), k) if k in movable else k
                  for k in range(S))
    if prob.sol_status == pulp.LpSolutionOptimal:
        return IlpOutcome("optimal", order, 0.0)
    return IlpOutcome("stopped", order, _gap_from_log(log_text))


# CBC past this many times its own -sec limit (plus a margin) is killed
_CBC_GRACE = 2.0


def _bounded_cbc(folder: str, cbc: str, time_limit_s: float) -> str:
    """An executable in ``folder`` that runs ``cbc`` with the same arguments and kills it past
    ``_CBC_GRACE * time_limit_s + 10`` seconds. Why: the ``cbcbox`` CBC (2.935) can spin forever on a
    small model whose preprocessing it reports infeasible "- possible tolerance issue", ignoring its
    ``-sec`` limit (seen in the suite: an 8-row partition ILP with a warm start, minutes of CPU);
    PuLP waits on the process with no bound of its own."""
    import stat
    import sys

    deadline = _CBC_GRACE * time_limit_s + 10.0
    path = os.path.join(folder, "bounded-cbc")
    with open(path, "w") as f:
        f.write(f"#!{sys.executable}\n"
                "import subprocess, sys\n"
                "try:\n"
                f"    sys.exit(subprocess.run([{cbc!r}, *sys.argv[1:]], timeout={deadline!r}).returncode)\n"
                "except subprocess.TimeoutExpired:\n"
                f"    print('cbc killed after {deadline:g} s', file=sys.stderr)\n"
                "    sys.exit(124)\n")
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
    return path


def cbc_path() -> str:
    """The CBC binary to run: cbcbox's (PuLP's ``cbc`` extra, the supported source from PuLP 4.0),
    else a ``cbc`` on ``PATH``, else the one bundled in PuLP 3. Raises
    :class:`~planner.plan.PlanError` when there is none."""
    try:
        import cbcbox
    except ImportError:
        cbcbox = None
    candidates = [cbcbox.cbc_bin_path() if cbcbox is not None else None, shutil.which("cbc"),
                  getattr(pulp.apis.coin_api, "pulp_cbc_path", None)]   # bundled: PuLP 3 only
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise PlanError(
        f"the ILP partitioner needs the CBC solver and PuLP {pulp.__version__} has none installed; run "
        "`pip install 'pulp[cbc]'` (its cbc extra installs the solver)"
    )


def _gap_from_log(text: str) -> Optional[float]:
    """CBC prints 'Objective value: X' and 'Lower bound: Y' when it stops on a limit."""
    obj = re.search(r"Objective value:\s*([-\d.eE+]+)", text)
    bound = re.search(r"Lower bound:\s*([-\d.eE+]+)", text)
    if not obj or not bound:
        return None
    o, lb = float(obj.group(1)), float(bound.group(1))
    return max(0.0, (o - lb) / o) if o > 0 else 0.0
