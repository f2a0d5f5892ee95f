"""The planner's error types: every module of planner/ raises them, so they live below all of them.

:class:`PlanError` is a :class:`whalelike.errors.SpecError` (a user-facing error the CLI prints as
one line): a plan cannot be made, or a plan (file) is inconsistent or made for another model or
cluster. ``planner.PlanError`` and ``planner.plan.PlanError`` are this class.
:class:`ModelMismatchError`, a :class:`PlanError`, is a plan made for another model.
:class:`GlobalBatchError` is a batch handed to a whole-global-batch step that is not a global batch
of the plan (:func:`planner.shares.layout.check_global_batch`).
"""
from __future__ import annotations

from whalelike.errors import SpecError, WhaleError


class PlanError(SpecError):
    """A plan cannot be made, or a plan (file) is inconsistent or made for another model/cluster."""


class ModelMismatchError(PlanError):
    """The plan was made for another model (its fingerprint differs from the model's). The same on
    every rank of a job, which the trainer uses to say it once. ``planned`` and ``actual``: the two
    fingerprints' first 12 digits (empty when not given)."""

    def __init__(self, message: str, planned: str = "", actual: str = ""):
        super().__init__(message)
        self.planned, self.actual = planned, actual


class GlobalBatchError(WhaleError, ValueError):
    """A batch's sample count is not the plan's ``global_batch_size`` (a user-facing error, and a
    ValueError: the batch is a bad argument)."""
