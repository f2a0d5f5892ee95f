"""whalelike's planner: maps TaskGraphs onto a heterogeneous Cluster and returns a Plan."""
from .api import naive_plan, plan
from .network import NetworkError, NetworkModel
from .plan import BoundaryPlan, Plan, PlanError, Prediction, StagePlan, Worker
from .resharding import (ReshardingError, ReshardPlan, ScheduledTransfer, ShardingSpec, UnitTask, boundary_resharding,
                         plan_resharding)
from .resharding_spec import stage_output_spec
from .simulator import SimResult, simulate

__all__ = [
    "plan", "naive_plan", "simulate", "SimResult",
    "Plan", "PlanError", "Prediction", "StagePlan", "Worker", "BoundaryPlan",
    "NetworkModel", "NetworkError",
    "plan_resharding", "boundary_resharding", "ReshardPlan", "ScheduledTransfer", "ShardingSpec", "UnitTask",
    "ReshardingError", "stage_output_spec",
]
