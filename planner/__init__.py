"""whalelike's planner: maps TaskGraphs onto a heterogeneous Cluster and returns a Plan."""
from .plan import Plan, Prediction, StagePlan, Worker, BoundaryPlan

__all__ = ["Plan", "Prediction", "StagePlan", "Worker", "BoundaryPlan"]
