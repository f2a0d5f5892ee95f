"""The executor slot: the step executor of the plan in force, the optimizer over its parameters, the
LR scheduler and the global-norm clipper, and every way they change at a step boundary.

The Engine's step loop reads ``slot.executor`` and ``slot.optimizer`` for a step and hands the
slot plan changes as values (:mod:`runtime.control.protocol`); the slot applies them:

* :meth:`ExecutorSlot.build`: the first executor, from the capture, and its optimizer and schedule;
* :meth:`ExecutorSlot.apply`: a plan of the same workers; in place when the executor takes it so
  (:meth:`runtime.parallel.executor.StepExecutor.takes_in_place`: other shares, nothing moves),
  else the new plan's executor is built and the state that changes hands moves point to point
  (:func:`runtime.state.transfer.switch_executor`);
* :meth:`ExecutorSlot.start_migration` / :meth:`ExecutorSlot.stop_migration`: another layout
  computes while the plan in force keeps the state (:mod:`runtime.state.migration`);
* :meth:`ExecutorSlot.snapshot` / :meth:`ExecutorSlot.land`: let go of the executor keeping a copy of
  what it held, then build the executor of a new world's plan and move the copy onto it (a leave,
  :mod:`runtime.elastic.departure`).

Why a slot and not attributes of the Engine: the executor, its optimizer (whose parameters are
the executor's), the scheduler (which holds the optimizer) and the clipper (built for one
executor's holdings) change together; kept apart, every module that changed one (re-plans,
leaves, checkpoints) reached into the Engine to change the others.

Invariant: ``optimizer`` always steps ``executor.parameters()``; the optimizer object survives every
change (schedulers and checkpoints hold it), its state moved to the new parameters.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import torch
import torch.nn as nn

from planner.plan import Plan
from runtime.parallel.builders import build_executor
from runtime.parallel.executor import ExecutorContext, StepExecutor
from runtime.replicas.held_state import held_part, local
from runtime.state.transfer import Snapshot, TransferReport, land, snapshot, switch_executor
from runtime.training.clipping import GlobalGradNorm
from runtime.training.schedules import build_scheduler
from whalelike.errors import WhaleError

log = logging.getLogger(__name__)


class ExecutorSlot:
    """This rank's held state (see the module docstring). ``make_optimizer``: ``params ->
    torch.optim.Optimizer``; ``make_scheduler``: ``optimizer -> LR scheduler`` or None."""

    def __init__(self, make_optimizer: Callable, make_scheduler: Optional[Callable] = None):
        self.make_optimizer = make_optimizer
        self.make_scheduler = make_scheduler
        self.executor: Optional[StepExecutor] = None
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.scheduler = None
        self.context: Optional[ExecutorContext] = None
        self.compute_plan: Optional[Plan] = None      # the layout computing while a migration runs
        self._clipper: Optional[tuple[StepExecutor, GlobalGradNorm]] = None

    @property
    def built(self) -> bool:
        return self.executor is not None

    @property
    def module(self) -> nn.Module:
        """The module this rank computes with (its stage, sharded as planned)."""
        return self.executor.module

    # -- changes ------------------------------------------------------------------------------------
    def build(self, context: ExecutorContext) -> StepExecutor:
        """The executor of ``context.plan`` and a new optimizer and schedule over it (collective)."""
        self.context = context
        self.executor = build_executor(context)
        self.optimizer = self.make_optimizer(list(self.executor.parameters()))
        if self.make_scheduler is not None:
            self.scheduler = build_scheduler(self.make_scheduler, self.optimizer)
        return self.executor

    def apply(self, runtime, in_place: bool = True) -> Optional[TransferReport]:
        """Run ``runtime.plan`` (same workers as the plan in force, other amounts of work), ending a
        migration if one runs; collective. ``in_place`` False builds the plan's executor even where
        the executor in force would take the plan in place. Returns the transfer report, or None
        when nothing moved."""
        plan = runtime.plan
        context = self.context.under(runtime)
        report = None
        self.stop_migration()
        if in_place and self.executor.takes_in_place(plan):
            self.executor.set_plan(plan)
        else:
            self.executor, report = switch_executor(self.executor, lambda: build_executor(context), self.optimizer,
                                                    self.make_optimizer, None)
        self.context, self.compute_plan = context, None
        return report

    def start_migration(self, compute_plan: Plan) -> None:
        """Compute with ``compute_plan``'s layout while the plan in force keeps the parameters and
        optimizer state (replacing a migration already running); collective."""
        from runtime.state.migration import MigratingExecutor

        self.stop_migration()
        compute = build_executor(self.context.with_plan(compute_plan))
        self.executor = MigratingExecutor(self.executor, compute)
        self.compute_plan = compute_plan

    def stop_migration(self) -> bool:
        """End a migration (the owner's parameters are current; nothing moves). False if none ran."""
        from runtime.state.migration import MigratingExecutor

        if not isinstance(self.executor, MigratingExecutor):
            return False
        self.executor = self.executor.release_compute()
        self.compute_plan = None
        return True

    def snapshot(self) -> Snapshot:
        """Let go of the executor, keeping a copy of what it held (its parameters, buffers and
        optimizer state), for :meth:`land` in a new world; collective only as its ``close`` is."""
        self.stop_migration()
        held = snapshot(self.executor, self.optimizer)
        self.executor = None
        return held

    def land(self, runtime, held: Snapshot) -> TransferReport:
        """Build the executor of ``runtime``'s plan (a new world's) and move ``held`` onto it;
        collective on the new world."""
        self.context = self.context.under(runtime)
        self.executor, report = land(held, build_executor(self.context), self.optimizer, self.make_optimizer)
        self.compute_plan = None
        return report

    @torch.no_grad()
    def fill(self, values: Callable[[str, tuple, torch.dtype], torch.Tensor]) -> int:
        """Write every tensor this rank holds from ``values(name, full_shape, dtype)``, the whole
        tensor of the model's ``name`` (deterministic: every holder of a piece computes the same),
        of which each rank copies the part it holds, as a checkpoint load writes it: into the pieces
        ``named_state`` gives (a ragged sync's shards, FSDP2's local rows), which the syncs take as the
        state of record (collective only as ``named_state`` is: P-Reduce averages first). Returns the
        number of tensors written."""
        written = 0
        for name, (tensor, slab) in self.executor.named_state().items():
            canonical = name.split("@", 1)[0]      # a second copy of a tied tensor on one rank
            full = values(canonical, tuple(slab.shape), tensor.dtype)
            if not isinstance(full, torch.Tensor) or tuple(full.shape) != tuple(slab.shape):
                raise WhaleError(f"the weights' init for {canonical!r} gave "
                                 f"{tuple(full.shape) if isinstance(full, torch.Tensor) else type(full).__name__}; "
                                 f"it must return the whole tensor, of shape {tuple(slab.shape)}")
            local(tensor).copy_(held_part(full.to(tensor.dtype), slab))
            written += 1
        return written

    # -- what a step reads --------------------------------------------------------------------------
    def clipper(self) -> GlobalGradNorm:
        """The global-norm clipper of the executor in force (rebuilt, collectively, after a change)."""
        if self._clipper is None or self._clipper[0] is not self.executor:
            self._clipper = (self.executor, GlobalGradNorm(self.executor.named_state()))
        return self._clipper[1]
