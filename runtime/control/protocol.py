"""The controller protocol: what reacts at a step boundary reads a view of the step and returns a
plan change as a value; the Engine applies it.

A controller (subclass :class:`Controller`) may, at each step:

1. ask for a share of the step-end exchange (:meth:`Controller.exchange`: a
   :class:`runtime.control.exchange.Part`, summed over the ranks in the collective that ends the
   step, so what it wants to know of the other ranks costs no collective of its own);
2. publish figures other controllers may read this step (:meth:`Controller.publish`: the
   rebalancer's measured speeds, which the slowness rule reads);
3. react (:meth:`Controller.react`) to a read-only :class:`StepView`, returning a
   :class:`PlanChange` or None; it may run collectives there (every rank reacts alike);
4. hear what happened: :meth:`Controller.applied` when its own change was applied (with the state
   transfer's report), :meth:`Controller.changed` after any applied change (the executor may have
   been rebuilt), :meth:`Controller.resumed` when another controller stops holding it inert.

And, outside the boundary: :meth:`Controller.on_batch` sees each whole global training batch;
:meth:`Controller.after_update` runs after each optimizer step that happened; :attr:`Controller.approximate`
says whether it makes the next step approximate.

A controller may hold others inert (:meth:`Controller.suppresses`: P-Reduce's policy holds the exact
re-planner while the plan runs P-Reduce, whose exchanges would synchronise every step); an inert
controller gets no share of the exchange and does not react. The order of the board is fixed by
:attr:`Controller.order` (lower first, then the order of adding); the first change returned in a step
is applied and later controllers do not react that step:

=====  ====================================  =================================================
order  controller                            changes
=====  ====================================  =================================================
0      leaving (runtime.elastic.departure)   ``stop`` (every rank gave notice), ``leave``
10     P-Reduce's policy (sync_policy)       ``apply`` (a plan with another replica sync)
20     the re-planner (balance.rebalance)    ``apply``, ``migrate``, ``end_migration``
100    others (e.g. runtime.control.step_log) any
=====  ====================================  =================================================

Invariant: :meth:`Controller.react` is a function of the view, the controller's own state and
values every rank shares, so every rank returns the same change; a controller never applies a
change itself and never touches another controller's state.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

import torch.nn as nn

from planner.plan import Plan
from whalelike.errors import WhaleError

if TYPE_CHECKING:
    from runtime.control.exchange import Part
    from runtime.rank import RankRuntime

CHANGES = ("apply", "migrate", "end_migration", "leave", "stop")


@dataclass(frozen=True)
class PlanChange:
    """A change a controller asks for at a step boundary.

    ``kind``: ``"apply"`` (run ``plan``, of the same workers: shares in place or state moved),
    ``"migrate"`` (``plan``'s layout computes while the plan in force keeps the state),
    ``"end_migration"``, ``"leave"`` (``leavers`` leave the job for ``reasons``; the others go on
    under a plan for their devices) or ``"stop"`` (every rank gave notice: the step ends the run).
    ``reason``: one line for the log; ``exact``: False when steps from here on are approximate.
    """

    kind: str
    plan: Optional[Plan] = None
    reason: str = ""
    exact: bool = True
    leavers: tuple[int, ...] = ()
    reasons: tuple[str, ...] = ()

    def __post_init__(self):
        if self.kind not in CHANGES:
            raise WhaleError(f"PlanChange.kind must be one of {', '.join(CHANGES)}, got {self.kind!r}")
        if self.kind in ("apply", "migrate") and self.plan is None:
            raise WhaleError(f"PlanChange({self.kind!r}) needs the plan to run")
        if self.kind == "leave" and (not self.leavers or len(self.leavers) != len(self.reasons)):
            raise WhaleError(f"PlanChange('leave') needs the leaving ranks and a reason each, got {self.leavers} "
                             f"and {self.reasons}")


@dataclass(frozen=True)
class StepView:
    """What a controller reads at a step boundary (every rank's view holds the same values, but for
    ``runtime.rank`` and this rank's ``stats``).

    ``loss``: the step's global-mean loss; ``stats``: this rank's :class:`runtime.engine.StepStats`
    of the step; ``history``: every step's, oldest first; ``runtime``: the rank under the plan in
    force (:class:`runtime.rank.RankRuntime`); ``compute_plan``: the layout computing while a
    migration runs; ``module``: the module this rank computes with; ``evaluate(batch)``: the
    global-mean loss of a whole global batch under the plan in force, nothing updated (collective);
    ``figures``: what the controllers published this step (:meth:`Controller.publish`), by
    controller name; ``graphs``: the capture; ``profile``: the measured cluster, if any.
    """

    step: int
    loss: float
    stats: Any
    history: Sequence[Any]
    runtime: "RankRuntime"
    compute_plan: Optional[Plan]
    module: nn.Module
    evaluate: Callable[[Any], Any]
    graphs: Any
    profile: Any = None
    figures: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    @property
    def plan(self) -> Plan:
        return self.runtime.plan


class Controller:
    """Something that reacts at step boundaries (see the module docstring). Every method has a
    default that does nothing, so a controller defines only what it uses."""

    name: str = "controller"
    order: int = 100

    @property
    def approximate(self) -> bool:
        """Whether the next step is approximate because of this controller (e.g. ZERO-resizing)."""
        return False

    def suppresses(self, plan: Plan) -> frozenset[str]:
        """The names of the controllers this one holds inert while ``plan`` is in force."""
        return frozenset()

    def exchange(self, step: int, runtime: "RankRuntime",
                 so_far: Callable[[], Any]) -> Optional["Part"]:
        """Its share of ``step``'s exchange, or None. ``so_far()`` gives this rank's emulation
        figures of the step up to the moment the part is filled (after the step's compute)."""
        return None

    def publish(self) -> Mapping[str, Any]:
        """Figures of this step other controllers may read (``StepView.figures[self.name]``)."""
        return {}

    def on_batch(self, inputs: tuple, targets) -> None:
        """A whole global training batch this step trains on (before the step)."""

    def after_update(self, module: nn.Module, plan: Plan) -> None:
        """After an optimizer step that happened (not after a skipped one)."""

    def react(self, view: StepView) -> Optional[PlanChange]:
        """The change this controller asks for at this boundary, or None (collective allowed)."""
        return None

    def applied(self, view: StepView, change: PlanChange, report: Any) -> None:
        """This controller's ``change`` was applied (``report``: the state transfer's, or None)."""

    def changed(self, view: StepView, change: PlanChange) -> None:
        """Another controller's ``change`` was applied at this boundary (the executor may be new)."""

    def resumed(self, view: StepView) -> None:
        """The controller that held this one inert no longer does (from the next step)."""
