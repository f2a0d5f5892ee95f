"""whalelike's planner: maps TaskGraphs onto a heterogeneous Cluster and returns a Plan.

``api`` is the façade (``plan``, ``naive_plan``) over the floors that own each decision: ``devices/``
(cost, memory and network models, placement), ``partition/`` (stage layers), ``shares/`` (batch
shares, shard sizes, the sample layout), ``schedule/`` (action lists, their proof, the simulator),
``resharding/`` (boundary transfers) and ``balance/`` (re-plans and state moves); ``decisions``,
``assemble``, ``plan`` and ``plan_checks`` turn them into a checked, printable Plan, whose fields
(``plan_record``) every floor reads, with the rules derived from them once: its groups (``groups``)
and where P-Reduce runs (``partial_reduce``). Invariant: pure and process-free, no import of
``runtime``, no import cycle, function-local and type-only imports counted (tests/test_import_graph.py).
"""
from planner.api import naive_plan, plan
from planner.devices.network import NetworkError, NetworkModel
from planner.plan import BoundaryPlan, Plan, PlanError, Prediction, StagePlan, Worker
from planner.resharding.reshard import (ReshardingError, ReshardPlan, ScheduledTransfer, ShardingSpec, UnitTask, boundary_resharding,
                         plan_resharding)
from planner.resharding.spec import stage_output_spec
from planner.schedule.simulator import SimResult, simulate

__all__ = [
    "plan", "naive_plan", "simulate", "SimResult",
    "Plan", "PlanError", "Prediction", "StagePlan", "Worker", "BoundaryPlan",
    "NetworkModel", "NetworkError",
    "plan_resharding", "boundary_resharding", "ReshardPlan", "ScheduledTransfer", "ShardingSpec", "UnitTask",
    "ReshardingError", "stage_output_spec",
]
