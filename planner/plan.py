"""The Plan: what every device does in one optimizer step, as plain data, with its checks and its printout.

:class:`Plan` is the record of :mod:`planner.plan_record` (every field, the YAML form, what the
fields alone answer: :attr:`~planner.plan_record.PlanRecord.tensor_parallel`,
:attr:`~planner.plan_record.PlanRecord.kind`, ...) plus what needs the planner above it:
:meth:`Plan.validate` (:func:`whalelike.spec.validate` with the consistency rules of
:mod:`planner.plan_checks`, and, given them, the match with a model's TaskGraphs and a cluster),
:meth:`Plan.from_yaml` (load, then validate) and :meth:`Plan.summary` (:mod:`planner.summary`). The
record's parts (``Worker``, ``StagePlan``, ``BoundaryPlan``, ``Prediction``, ``CandidatePlan``) are
re-exported here, so ``from planner.plan import Plan, Worker`` is the one import a user needs.

A Plan is saved as YAML (:meth:`~planner.plan_record.PlanRecord.to_yaml`) and loaded back exactly,
floats included; every field carries a :class:`whalelike.spec.Rule` (type, bounds: no negative, NaN
or infinite time or size), checked while reading, so a hand-edited file fails on load with the path
of the bad field. Validating again costs a digest of the plan.

Why a façade over the record: the checks and the printout read modules (the sample layout, the
resharding planner, BatchNorm statistics) that read plans themselves; with the methods on the record
they would import each other. Invariant: no module that :mod:`planner.plan_checks` or
:mod:`planner.summary` imports, directly or not, imports this one (they name
:class:`~planner.plan_record.PlanRecord`); every plan the planner makes or loads is a :class:`Plan`
(the record's :meth:`~planner.plan_record.PlanRecord.from_dict` and ``dataclasses.replace`` keep the
class they are given).
"""
from __future__ import annotations

import os

from whalelike.spec import load_yaml, validate

from planner import plan_checks
from planner.errors import PlanError
from planner.plan_identity import fingerprint_of  # noqa: F401 (re-exported)
from planner.plan_record import (  # noqa: F401 (the record's parts: re-exported)
    BoundaryPlan, CandidatePlan, PlanRecord, Prediction, StagePlan, Worker,
)
from planner.summary import plan_summary

# A plan takes about 570 bytes per worker with 8 micro-batches: 16 MiB holds 16,384 workers (the most a
# cluster spec may list) with room to spare. Larger files are refused before parsing (see whalelike.cluster).
MAX_FILE_BYTES = 16 << 20
MAX_FILE_WHY = "room for 16,384 workers; YAML this large takes minutes and GiBs to parse"


class Plan(PlanRecord):
    """A plan: the record (:class:`~planner.plan_record.PlanRecord`, its fields and their rules) with
    its checks and its printout."""

    # whalelike.spec.validate: field rules under "plan", then planner.plan_checks (looked up at each
    # call, so the checks may be wrapped)
    spec_path = "plan"
    spec_error = PlanError
    spec_checks = {
        "self": lambda plan: plan_checks.check_alone(plan),
        "graphs": lambda plan, graphs: plan_checks.check_model(plan, graphs),
        "cluster": lambda plan, cluster: plan_checks.check_cluster(plan, cluster),
    }

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, graphs=None, cluster=None) -> "Plan":
        """Load and validate a plan file (against ``graphs`` and ``cluster`` when given); errors
        start with the file's path."""
        origin = os.fspath(path)
        data = load_yaml(origin, what="plan", limit=MAX_FILE_BYTES, limit_why=MAX_FILE_WHY, error=PlanError,
                         missing=f"make one with `whalelike plan ... -o {origin}`")
        plan = cls.from_dict(data, origin=origin)
        try:
            plan.validate(graphs=graphs, cluster=cluster)
        except PlanError as e:
            raise PlanError(f"{origin}: {e}") from None
        return plan

    def validate(self, graphs=None, cluster=None) -> None:
        """Raise :class:`PlanError` naming the first broken rule or inconsistent field (see
        :func:`whalelike.spec.validate` and :mod:`planner.plan_checks`); cheap when repeated."""
        validate(self, graphs=graphs, cluster=cluster)

    def summary(self, cluster=None) -> str:
        """Aligned per-device table plus the predicted step time against the naive plan; with the
        ``cluster`` (its link figures), also the resharding chosen for each stage boundary
        (:func:`planner.summary.plan_summary`). A stage that runs Prague's partial all-reduce
        (``replica_sync`` ``"partial"``) is named APPROXIMATE on a line of its own."""
        return plan_summary(self, cluster)
