"""whalelike's planner: maps TaskGraphs onto a heterogeneous Cluster and returns a Plan."""
from .api import naive_plan, plan
from .plan import BoundaryPlan, Plan, PlanError, Prediction, StagePlan, Worker
from .simulator import SimResult, simulate

__all__ = [
    "plan", "naive_plan", "simulate", "SimResult",
    "Plan", "PlanError", "Prediction", "StagePlan", "Worker", "BoundaryPlan",
]
