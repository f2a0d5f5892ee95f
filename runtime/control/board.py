"""The board of an Engine's controllers: their fixed order, who holds whom inert, the step's exchange,
and the one change a step applies.

The Engine's step loop asks the board for the step-end exchange before the step
(:meth:`Board.exchange`), tells it of the step's batch and optimizer update, and at the boundary
asks it for the step's change (:meth:`Board.decide`), applies the change itself, and reports back
(:meth:`Board.settle`). See :mod:`runtime.control.protocol` for the order and the rules.

Invariant: the controllers run in ``(order, adding order)`` on every rank; an inert controller (one a
controller of the plan in force suppresses) neither exchanges nor reacts; the first change returned
is the step's only change.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch.nn as nn

from planner.plan import Plan
from runtime.control.exchange import Passenger, compose
from runtime.control.protocol import Controller, PlanChange, StepView
from whalelike.errors import WhaleError

log = logging.getLogger(__name__)


class Board:
    """An Engine's controllers (see the module docstring)."""

    def __init__(self):
        self.controllers: list[Controller] = []
        self._inert: frozenset[str] = frozenset()

    def add(self, controller: Controller) -> Controller:
        """Run ``controller`` from the next step (every rank must add the same controllers in the
        same order)."""
        if not isinstance(controller, Controller):
            raise WhaleError(f"Engine.add_controller takes a runtime.control.protocol.Controller, got "
                             f"{type(controller).__name__}")
        if any(c.name == controller.name for c in self.controllers):
            raise WhaleError(f"a controller named {controller.name!r} already runs on this Engine; give each a name "
                             "of its own (Controller.name)")
        self.controllers.append(controller)
        self.controllers.sort(key=lambda c: c.order)      # stable: adding order within an order
        return controller

    def get(self, name: str) -> Optional[Controller]:
        return next((c for c in self.controllers if c.name == name), None)

    def inert(self, plan: Plan) -> frozenset[str]:
        """The names of the controllers held inert while ``plan`` is in force."""
        held: set[str] = set()
        for c in self.controllers:
            held |= c.suppresses(plan)
        return frozenset(held)

    def active(self, plan: Plan) -> list[Controller]:
        inert = self.inert(plan)
        return [c for c in self.controllers if c.name not in inert]

    # -- during the step --------------------------------------------------------------------------
    def exchange(self, step: int, runtime, so_far: Callable[[], Any]) -> Optional[Passenger]:
        """The step's exchange: every active controller's share, composed (None: nobody asked)."""
        self._inert = self.inert(runtime.plan)
        parts = [c.exchange(step, runtime, so_far) for c in self.controllers if c.name not in self._inert]
        return compose([p for p in parts if p is not None])

    def on_batch(self, plan: Plan, inputs: tuple, targets) -> None:
        for c in self.active(plan):
            c.on_batch(inputs, targets)

    def after_update(self, module: nn.Module, plan: Plan) -> None:
        for c in self.active(plan):
            c.after_update(module, plan)

    @property
    def approximate(self) -> bool:
        return any(c.approximate for c in self.controllers)

    # -- at the boundary --------------------------------------------------------------------------
    def decide(self, view: Callable[[dict], StepView]) -> tuple[Optional[Controller], Optional[PlanChange], StepView]:
        """The step's change and its controller, or ``(None, None, view)``: the controllers publish,
        then the active ones react in order until one returns a change. ``view(figures)`` builds the
        step's view from what they published."""
        figures = {c.name: c.publish() for c in self.controllers}
        seen = view(figures)
        for c in self.controllers:
            if c.name in self._inert:
                continue
            change = c.react(seen)
            if change is not None:
                return c, change, seen
        return None, None, seen

    def settle(self, view: StepView, proposer: Controller, change: PlanChange, report: Any) -> None:
        """Tell ``proposer`` its change was applied, every other controller that a change was, and
        those no longer held inert under the plan now in force that they are active again. ``view``
        is the boundary's view after the change (its runtime and module are the ones in force)."""
        proposer.applied(view, change, report)
        self.told(view, change, but=proposer)

    def told(self, view: StepView, change: PlanChange, but: Optional[Controller] = None) -> None:
        """Tell every controller (``but`` the one that asked for it) that ``change`` was applied, and
        those no longer held inert under the plan now in force that they are active again: a change
        no controller asked for (the user's ``Engine.apply_plan``) is told as another's is."""
        for c in self.controllers:
            if c is not but:
                c.changed(view, change)
        now = self.inert(view.plan)
        for c in self.controllers:
            if c.name in self._inert and c.name not in now:
                c.resumed(view)
        self._inert = now
