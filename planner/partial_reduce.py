"""Where Prague's P-Reduce (the partial all-reduce) may run, and which group generator it must use.

P-Reduce (``StagePlan.replica_sync`` ``"partial"``, run by :mod:`runtime.replicas.partial_sync`)
lets each data-parallel replica step on its own gradient and then average its parameters with a
small group. Two rules decide where and how, and this module states each once:

* **Which stages can run it** (:func:`blocker`, :func:`eligible_stages`): a stage of two or more
  data-parallel workers (there must be replicas to average), without ``split`` (a tensor-parallel
  slice's replicas would average apart from the other slices of their model) and at ZeRO stage 0
  (P-Reduce averages whole parameters; a ZeRO stage shards them).
* **When the static generator is pinned** (:func:`static_only`, :func:`generator`): in a pipeline
  (its loss all-reduce) and in an fp16 plan (its overflow vote) every rank meets every other in
  every step; the smart generator's groups may span steps and would wait across that collective,
  the static generator's never do (:mod:`runtime.replicas.group_generator`).

The planner decides with them (:func:`planner.decisions.partial_stages`,
:func:`planner.decisions.stage_syncs`), the plan checks enforce them (:mod:`planner.plan_checks`)
and the runtime's sync policy reads them when it switches a running plan to P-Reduce
(:mod:`runtime.balance.sync_policy`). Invariant: pure functions of a stage's shape and the plan's
stage count and precision, so a plan the planner makes or the policy switches to always passes the
plan checks.
"""
from __future__ import annotations

from typing import Optional

from planner.plan_record import PlanRecord

# blocker()'s answers, and why each keeps P-Reduce off a stage
WHY = {
    "split": "P-Reduce runs on stages without split",
    "one worker": "P-Reduce averages replicas and there is none to average with",
    "zero": "P-Reduce averages whole parameters, which a ZeRO stage shards",
}


def blocker(workers: int, tp: int, zero_stage: int = 0) -> Optional[str]:
    """What keeps a stage of ``workers`` data-parallel workers (over every replica), under
    ``split(tp)`` (1: none) at ZeRO stage ``zero_stage`` from running P-Reduce: ``"split"``,
    ``"one worker"`` or ``"zero"`` (the keys of :data:`WHY`, checked in that order), or None when
    it can."""
    if tp > 1:
        return "split"
    if workers < 2:
        return "one worker"
    if zero_stage:
        return "zero"
    return None


def eligible_stages(plan: PlanRecord) -> list[int]:
    """The stages of ``plan`` P-Reduce can run on (:func:`blocker`, at each stage's ZeRO stage)."""
    out = []
    for st in plan.stages:
        members = plan.stage_workers(st.index)
        if blocker(len(members), max(w.tp_size for w in members), st.zero_stage) is None:
            out.append(st.index)
    return out


def static_only(num_stages: int, precision: str) -> Optional[str]:
    """Why a plan of ``num_stages`` stages at ``precision`` pins P-Reduce to the static generator,
    as a phrase (``"in a pipeline of 2 stages (...)"``), or None when the smart one may run."""
    if num_stages > 1:
        return (f"in a pipeline of {num_stages} stages (the pipeline's loss all-reduce meets every rank in every "
                "step)")
    if precision == "fp16":
        return ("in an fp16 plan (fp16's overflow decision is an all-reduce of every rank in every step; bf16 has "
                "no loss scaling)")
    return None


def generator(asked: str, num_stages: int, precision: str) -> str:
    """The group generator a P-Reduce stage runs: ``"static"`` where :func:`static_only` pins it,
    else ``asked``."""
    return "static" if static_only(num_stages, precision) else asked
