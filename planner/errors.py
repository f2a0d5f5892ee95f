"""The planner's error types: every module of planner/ raises them, so they live below all of them.

:class:`PlanError` is a :class:`whalelike.errors.SpecError` (a user-facing error the CLI prints as
one line): a plan cannot be made, or a plan (file) is inconsistent or made for another model or
cluster. ``planner.PlanError`` and ``planner.plan.PlanError`` are this class.
"""
from __future__ import annotations

from whalelike.errors import SpecError


class PlanError(SpecError):
    """A plan cannot be made, or a plan (file) is inconsistent or made for another model/cluster."""
