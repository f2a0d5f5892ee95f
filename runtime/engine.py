"""``runtime.Engine``: one object per rank that executes a Plan, one optimizer step per call.

The Engine is a step loop over three seams:

* **what the rank is**, :class:`runtime.rank.RankRuntime`: rank, plan in force, cluster, groups,
  emulated device, progress record and the one way into a collective (failures named by rank,
  step and missing peers), one value, replaced as a whole on a leave;
* **what it holds**, :class:`runtime.state.slot.ExecutorSlot`: the step executor of the plan
  (:mod:`runtime.parallel.executor`: data parallel, pipeline, tensor parallel), its optimizer, LR
  schedule and clipper, and every way they change (apply a plan, migrate, land after a leave); and
  :class:`runtime.state.checkpointer.Checkpointer`, the background saves;
* **what reacts at a step boundary**, :class:`runtime.control.board.Board`: controllers that read the
  step and return plan changes as values (:mod:`runtime.control.protocol`), applied here, at most
  one a step: leaving (:mod:`runtime.elastic.departure`), P-Reduce's policy
  (:mod:`runtime.balance.sync_policy`), the exact re-planner (:mod:`runtime.balance.rebalance`), and
  any added with :meth:`Engine.add_controller`.

One step (:meth:`Engine.train_step`): build the executor on the first batch (capture, the plan's
fingerprint checked); the guards (the global batch's size, its fingerprint across ranks every
``batch_check_every`` steps); the board's step-end exchange put in the executor's passenger slot;
the executor's forward and backward under the precision's autocast; the optimizer update with its
recipe (:mod:`runtime.training.update`: non-finite loss raised or skipped on every rank, fp16's
overflow skip, clipping, schedule); the replica syncs' ``after_step`` (P-Reduce averages there);
the step's statistics (:mod:`runtime.step_stats`); then the boundary: the board's one change.

Options are one typed record, :class:`runtime.config.EngineConfig` (recipe, guards, balance,
leave), given as ``config=`` or as keywords of the same names.

Invariant: every check before the rendezvous is local and identical on every rank, so all fail
alike and none hangs; every collective goes through the rank's runtime; the plan in force is
``Engine.plan`` and every plan change goes through :meth:`_apply`.
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import os
import time
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn as nn

from planner.devices.profile import Profile
from planner.plan import Plan, PlanError
from planner.plan_checks import check_same_workers
from planner.shares.layout import check_global_batch
from runtime import distributed, guards
from runtime.balance.memory_check import MemoryCheck
from runtime.balance.rebalance import Rebalancer, ReplanEvent
from runtime.config import EngineConfig
from runtime.control.board import Board
from runtime.control.protocol import Controller, PlanChange, StepView
from runtime.data import Share
from runtime.elastic.departure import Departures, Stopping, leave
from runtime.emulation.compute import check_capacity
from runtime.parallel.executor import ExecutorContext
from runtime.rank import RankRuntime
from runtime.state.pretrained import load_pretrained
from runtime.replicas.replica_sync import after_step, runs_exact
from runtime.state.checkpointer import Checkpointer
from runtime.state.slot import ExecutorSlot
from runtime.step_stats import OverrunWarning, StepStats
from runtime.training.memory_meter import MemoryMeter
from runtime.training.precision import PlanLossScaler, Precision
from runtime.training.update import OptimizerUpdate
from whalelike.cluster import Cluster
from whalelike.errors import WhaleError
from whalelike.graphs.taskgraph import TaskGraphs

log = logging.getLogger(__name__)


class Engine:
    """Trains ``model`` according to ``plan`` on this rank (see the module docstring).

    ``optimizer``: a factory ``params -> torch.optim.Optimizer`` (default AdamW, lr 1e-3), applied
    to this rank's parameters. ``loss_fn(outputs, targets)`` must return the *mean* loss over the
    samples it is given. ``cluster``: the cluster spec (default ``Cluster.preset(plan.cluster)``);
    its emulation block, if any, turns on emulated devices. ``example_args``: inputs to capture the
    model with now; without them the first batch is used. ``scheduler``: a factory ``optimizer ->
    LR scheduler``, stepped after every optimizer step that happened and saved in checkpoints
    (:mod:`runtime.training.schedules`). ``profile``: the cluster as ``whalelike profile`` measured it
    for this model (:class:`planner.devices.profile.Profile`): re-plans for measured speeds start
    from its rates and links instead of the spec sheet's.

    ``model`` may be built on the meta device (``with torch.device("meta"): model = ...``, or
    :func:`whalelike.empty_weights`, which keeps buffers real): each rank then gives storage only to
    what its part of the plan holds (its stage, its tensor-parallel slice, its ZeRO shard; the
    whole model nowhere but where a rank keeps it whole), on its device, when the executor is built.
    ``weights`` fills it: a local ``save_pretrained`` directory (each rank reads the slices it holds,
    :mod:`runtime.state.pretrained`) or a function ``(name, full_shape, dtype) -> tensor`` giving the
    whole initial value of each parameter and buffer by the model's name (deterministic, so every
    holder of a piece writes the same); or, given neither, a checkpoint loaded before the first step
    (:func:`runtime.checkpoint.load`). A model built normally moves to the rank's device the same
    way: only what the rank holds. ``Engine.setup_peak_bytes``: the peak bytes of building the
    executor and filling it, measured as steps are (``measure_memory``).

    ``config`` (:class:`runtime.config.EngineConfig`) or the same options as keywords:

    * the recipe: ``precision`` ``"fp32"``, ``"bf16"`` or ``"fp16"`` (default: the plan's; autocast
      with float32 master state, fp16 with a loss scaler whose overflow decision is one for every
      rank, :mod:`runtime.training.precision`), ``grad_reduce_dtype`` ``"fp32"`` (exact) or
      ``"bf16"``, ``clip_grad_norm`` (the whole model's gradient clipped to this global norm;
      ``StepStats.grad_norm``), ``measure_memory`` (each step's peak in
      ``StepStats.peak_memory_bytes``; default: on GPUs, :mod:`runtime.training.memory_meter`);
    * the guards: ``timeout_s`` (seconds, positive and finite) bounds every collective;
      ``on_nonfinite`` ``"raise"`` (default: :class:`runtime.guards.NonFiniteLossError` naming the
      step and the rank, before the optimizer step) or ``"skip"`` (the update dropped on every rank,
      ``StepStats.skipped``, :attr:`skipped_steps`); ``batch_check_every`` (compare the ranks'
      whole-global batches at the first step and every that many steps; 0: never);
    * ``balance``: dynamic balancing, a policy name (``"exact"``, the default; ``"semi"``,
      ``"resize"``, ``"off"``) or a :class:`runtime.balance.rebalance.BalanceConfig`;
    * ``departures``: leaving without a restart (:mod:`runtime.elastic.departure`), off by default:
      ``True`` (or a :class:`runtime.elastic.departure.LeaveConfig`) makes a SIGTERM a notice: the
      rank leaves at the end of the step it is in, handing its state to the ranks that stay, which go
      on under a plan for their devices; on the leaver ``train_step`` raises
      :class:`runtime.elastic.departure.Departed` (a ``SystemExit`` with code 0). When every rank
      gives notice in the same step, ``train_step`` raises
      :class:`runtime.elastic.departure.Stopping` on every rank with the step complete.
    """

    def __init__(self, model: nn.Module, plan: Plan, optimizer: Optional[Callable] = None,
                 loss_fn: Optional[Callable] = None, cluster: Optional[Cluster] = None,
                 example_args: Any = None, scheduler: Optional[Callable] = None,
                 profile: Optional[Profile] = None, weights: Any = None, config: Optional[EngineConfig] = None,
                 **options: Any):
        if loss_fn is None:
            raise WhaleError("runtime.Engine needs loss_fn(outputs, targets) -> mean loss over the batch")
        if scheduler is not None and not callable(scheduler):
            raise WhaleError(f"runtime.Engine(scheduler=...) must be a factory optimizer -> LR scheduler, got "
                             f"{scheduler!r}")
        # Every check before the rendezvous is local and identical on all ranks: all fail alike, none hangs.
        self.config = config = EngineConfig.of(config, **options)
        recipe = config.recipe
        self.precision = Precision(plan.precision if recipe.precision is None else recipe.precision,
                                   recipe.grad_reduce_dtype)
        if self.precision.name != plan.precision:
            log.warning("runtime.Engine(precision=%r) runs a plan made for %s: its shares and memory were priced "
                        "at %s rates (plan with --precision %s to price it for what runs)", self.precision.name,
                        plan.precision, plan.precision, self.precision.name)
        rank, world_size = distributed.launched()
        distributed.check_world_size(plan, world_size, rank)
        cluster = cluster if cluster is not None else _preset(plan)
        plan.validate(cluster=cluster)
        self.profile = profile      # the measured speeds re-plans start from; checked against the capture
        if profile is not None:
            profile.validate(cluster=cluster)
            profile.check_precision(self.precision.name)
        elif plan.speeds == "profile":
            log.warning("runtime.Engine runs a plan made from a profile without it (Engine(profile=...), train.py "
                        "--profile): a re-plan prices the devices from the cluster spec")
        # a precision some device of the plan cannot run (bf16 on a V100): every rank refuses alike
        cluster.check_precision(self.precision.name, [w.device for w in plan.workers])
        self.empty = check_weights(model, weights)    # built on meta: filled by `weights` or a checkpoint
        self.weights = weights
        self.load_report = None   # what filling from a save_pretrained directory read (runtime.state.pretrained.LoadReport)
        self.runtime = RankRuntime.start(plan, cluster, config.guards.timeout_s, self.precision.name)
        self.precision.check_device(self.device)
        self.model, self.loss_fn = model, loss_fn
        self.setup_peak_bytes: Optional[int] = None
        self.meter = MemoryMeter(self.device, _measure_memory(recipe.measure_memory, self.emulator))
        self.scaler = PlanLossScaler(self.device) if self.precision.scales_loss else None
        self.update = OptimizerUpdate(config.guards.on_nonfinite, recipe.clip_grad_norm, self.scaler)
        self.slot = ExecutorSlot(optimizer or (lambda params: torch.optim.AdamW(params, lr=1e-3)), scheduler)
        self.checkpointer = Checkpointer()
        self.graphs: Optional[TaskGraphs] = None
        self.stats: list[StepStats] = []
        self._overruns = OverrunWarning()
        self.board = Board()
        if config.leave is not None:
            self.board.add(Departures(config.leave))
        if config.guards.memory_check:
            self.board.add(MemoryCheck(self.rank))
        self.board.add(Rebalancer(config.balance, self.rank, plan.world_size))
        if example_args is not None:
            self._build(example_args if isinstance(example_args, tuple) else (example_args,))

    # -- the step loop ----------------------------------------------------------------------------
    def train_step(self, batch) -> torch.Tensor:
        """One optimizer step on ``batch``: ``(inputs, targets)`` holding the whole global batch
        (every rank passes the same), or a :class:`runtime.data.Share` holding this rank's samples.
        Returns the global-mean loss, the same on every rank (also when the step was skipped for a
        non-finite loss: see ``on_nonfinite``)."""
        share = batch if isinstance(batch, Share) else None
        inputs, targets = self._unpack(batch)
        self._build(inputs)
        if self.empty:
            raise WhaleError("runtime.Engine: the model was built on the meta device and nothing filled it: pass "
                             "Engine(weights=<a save_pretrained directory, or an init (name, shape, dtype) -> tensor>), "
                             "or runtime.checkpoint.load(engine, ...) before the first step")
        runtime, executor = self.runtime, self.slot.executor
        if share is None:
            self._check_batch(targets)
            self.board.on_batch(self.plan, inputs, targets)
            guard = self.config.guards
            if runtime.world_size > 1 and guards.batch_check_due(self.step, guard.batch_check_every):
                runtime.collective(lambda: guards.check_same_batch(inputs, targets, self.step, self.rank,
                                                                   guard.batch_check_every))
        elif not executor.takes_shares:
            raise WhaleError(f"{type(executor).__name__} takes whole global batches, not runtime.data.Share; pass "
                             f"(inputs, targets) of {self.plan.global_batch_size} samples on every rank")
        emulator = runtime.emulator
        emulator.step = self.step
        before = emulator.stats.snapshot()
        start = time.perf_counter()
        with self.meter.step([executor.module], self.slot.optimizer):
            self.slot.optimizer.zero_grad(set_to_none=not executor.gradients_in_place)
            # the controllers' figures ride in the collective that ends the step (the executor's
            # passenger slot); an executor that has none sums them on their own
            exchange = self.board.exchange(self.step, runtime, lambda: emulator.stats.since(before))
            executor.passenger = exchange
            scale = self.scaler.current() if self.scaler is not None else None
            with self.precision.autocast(self.device):
                loss = runtime.collective(
                    lambda: executor.train_share(Share(inputs, targets, share.global_size)) if share is not None
                    else executor.train_step(inputs, targets))
            executor.passenger = None
            if exchange is not None and not exchange.carried:
                exchange.fill()
                runtime.sum_alone(exchange.vector)
                exchange.arrived(exchange.vector)
            outcome = self.update.run(loss, self.slot, self.step, self.rank, runtime.collective)
            if not outcome.skipped:
                self.board.after_update(executor.module, self.plan)
            # the replica syncs' hook after the optimizer step (or its skip): P-Reduce averages with its group
            runtime.collective(lambda: after_step(executor, self.plan, self.step, self.slot.optimizer))
        stats = self._record(time.perf_counter() - start, emulator.stats.since(before), outcome, scale)
        check_capacity(emulator, self.meter.peak_bytes, self.step)   # an emulated device's memory, if enforced
        # the step boundary: at most one plan change (collective, part of this step: a rank that
        # never starts the next one must not be reported as having begun it)
        proposer, change, view = self.board.decide(lambda figures: self._view(loss, stats, figures))
        if change is not None:
            report = self._apply(change, loss)
            self.board.settle(self._view(loss, stats, view.figures), proposer, change, report)
        self.runtime.clock.step += 1
        return loss

    def _apply(self, change: PlanChange, loss: torch.Tensor):
        """Carry out ``change`` (collective): the one place the plan in force changes."""
        if change.kind == "stop":
            self.runtime.clock.step += 1
            raise Stopping(self.step, loss)
        if change.kind == "leave":
            self.runtime, report = leave(self.runtime, self.slot, self.checkpointer, self.graphs,
                                         self.board.get(Departures.name), list(change.leavers), list(change.reasons))
            return report
        if change.kind == "migrate":
            self.start_migration(change.plan)
            return None
        if change.kind == "end_migration":
            self.stop_migration()
            return None
        return self._switch(change.plan, "Engine.apply_plan")

    def _view(self, loss: "torch.Tensor | float", stats: StepStats, figures: dict) -> StepView:
        return StepView(step=self.step, loss=float(loss), stats=stats, history=self.stats, runtime=self.runtime,
                        compute_plan=self.slot.compute_plan, module=self.slot.module, evaluate=self.eval_step,
                        graphs=self.graphs, profile=self.profile, figures=figures)

    def _record(self, wall: float, em, outcome, scale: Optional[float]) -> StepStats:
        stats = StepStats(step=self.step, wall_s=wall, compute_s=em.real_s, modeled_s=em.modeled_s,
                          padded_s=em.padded_s, wait_s=max(0.0, wall - em.padded_s), segments=em.segments,
                          overruns=em.overruns, flops=em.flops, matmul_s=em.matmul_s,
                          approximate=self.board.approximate or not runs_exact(self.slot.executor),
                          plan_version=self.rebalancer.plan_version, skipped=outcome.skipped,
                          overflow=outcome.overflow, grad_norm=outcome.norm, loss_scale=scale, lr=outcome.lr,
                          peak_memory_bytes=self.meter.peak_bytes)
        self.stats.append(stats)
        self._overruns.check(stats, self.rank, self.emulator.enabled, em.worst_overrun)
        return stats

    # -- plan changes (collective: every rank calls them with the same plan) ------------------------
    def apply_plan(self, plan: Plan):
        """Switch to ``plan``, a plan of the same workers (rank, device, stage, groups) with other
        amounts of work, at a step boundary. Shares change in place when the executor takes the
        plan so (the executor, its modules, syncs and optimizer stay); moved layers, re-sized shards
        or another replica sync build the new plan's executor and move their parameters and
        optimizer state point to point (:mod:`runtime.state.transfer`). Returns the transfer report,
        or None when nothing had to move. The controllers are told as of a change one of them asked
        for (the memory check counts the new plan's steps afresh, the re-planner expects its first
        step's one-time costs, the metrics record it)."""
        report = self._switch(plan, "Engine.apply_plan")
        if self.stats:   # between steps: the boundary after the last step, as the controllers saw it
            last = self.stats[-1]
            view = dataclasses.replace(self._view(float("nan"), last, {}), step=last.step)
            self.board.told(view, PlanChange("apply", plan, reason="Engine.apply_plan by the caller"))
        return report

    def _switch(self, plan: Plan, caller: str):
        """Put ``plan`` in force (collective): :meth:`apply_plan` without telling the controllers
        (a controller's own change is told by the board)."""
        check_same_workers(self.plan, plan, caller)
        plan.validate(graphs=self.graphs, cluster=self.cluster)
        runtime = self.runtime.with_plan(plan)
        report = self.runtime.collective(lambda: self.slot.apply(runtime)) if self.slot.built else None
        self.runtime = runtime
        return report

    def start_migration(self, compute_plan: Plan) -> None:
        """Run the next steps with ``compute_plan``'s layout (same workers, other shard sizes or
        shares) while the plan in force keeps the parameters and optimizer state
        (:mod:`runtime.state.migration`). Replaces a migration already running."""
        check_same_workers(self.plan, compute_plan, "Engine.start_migration")
        compute_plan.validate(graphs=self.graphs, cluster=self.cluster)
        self.runtime.collective(lambda: self.slot.start_migration(compute_plan))

    def stop_migration(self) -> bool:
        """End a migration (the owners' parameters are current; nothing moves). False if none ran."""
        return self.slot.stop_migration()

    def add_controller(self, controller: Controller) -> Controller:
        """Run ``controller`` at every step boundary from the next step (:mod:`runtime.control.protocol`;
        every rank must add the same controllers in the same order)."""
        return self.board.add(controller)

    # -- evaluation and state ----------------------------------------------------------------------
    def eval_step(self, batch) -> torch.Tensor:
        """The global-mean loss of ``(inputs, targets)`` (a whole global batch) without updating
        anything, under any plan (collective)."""
        inputs, targets = self._unpack(batch)
        self._build(inputs)
        with self.precision.autocast(self.device):
            return self.runtime.collective(lambda: self.slot.executor.eval_step(inputs, targets))

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.slot.executor.parameters() if self.slot.built else self.model.parameters()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full, unsharded model state (a collective: every rank calls it and gets all of it)."""
        if not self.slot.built:
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        return self.runtime.collective(self.slot.executor.full_state_dict)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a full, unsharded model state (each rank keeps its part)."""
        if not self.slot.built:
            self.model.load_state_dict(state)
        else:
            self.slot.executor.load_full_state_dict(state)

    def executor_module(self) -> nn.Module:
        """The module this rank runs (its stage, sharded where the plan says so)."""
        return self.slot.module if self.slot.built else self.model

    # -- read-only views of the seams ---------------------------------------------------------------
    plan = property(lambda self: self.runtime.plan, doc="The plan in force.")
    rank = property(lambda self: self.runtime.rank, doc="This process's rank under the plan in force.")
    worker = property(lambda self: self.runtime.worker, doc="This rank's worker of the plan in force.")
    cluster = property(lambda self: self.runtime.cluster, doc="The cluster spec the plan runs on.")
    groups = property(lambda self: self.runtime.groups, doc="This rank's process groups of the plan.")
    emulator = property(lambda self: self.runtime.emulator, doc="This rank's emulated device.")
    device = property(lambda self: self.runtime.device, doc="The device this rank computes on.")
    timeout_s = property(lambda self: self.runtime.timeout_s, doc="The bound on every collective.")
    step = property(lambda self: self.runtime.clock.step, doc="Steps completed (the next step's index).")
    executor = property(lambda self: self.slot.executor, doc="The step executor of the plan in force.")
    optimizer = property(lambda self: self.slot.optimizer, doc="The optimizer over this rank's parameters.")
    scheduler = property(lambda self: self.slot.scheduler, doc="The LR schedule, if one was given.")
    compute_plan = property(lambda self: self.slot.compute_plan, doc="The layout computing while a migration runs.")
    clip_grad_norm = property(lambda self: self.config.recipe.clip_grad_norm, doc="The clipping norm, or None.")
    skipped_steps = property(lambda self: self.update.skipped_steps, doc="Steps whose update was skipped.")
    rebalancer = property(lambda self: self.board.get(Rebalancer.name), doc="The exact re-planner (a controller).")
    departures = property(lambda self: self.board.get(Departures.name),
                          doc="Leaving's controller (None when departures are off).")

    @property
    def replans(self) -> list[ReplanEvent]:
        """Every re-plan so far (:class:`runtime.balance.rebalance.ReplanEvent`), oldest first."""
        return self.rebalancer.history

    # -- internals --------------------------------------------------------------------------------
    def _build(self, example_inputs: tuple) -> None:
        """Capture the model, check the plan was made for it, and build the executor (once)."""
        if self.slot.built:
            return
        from whalelike.graphs.capture import capture

        with self.runtime.measured_once() as share:   # rank 0 measures for all (runtime.distributed.MeasuredOnce)
            graphs = capture(self.model, example_inputs, share=share)
        self.plan.validate(graphs=graphs, cluster=self.cluster)
        if self.profile is not None:
            self.profile.validate(graphs=graphs)
        self.graphs = graphs
        context = ExecutorContext.of(self.runtime, model=self.model, graphs=graphs, loss_fn=self.loss_fn,
                                     scaler=self.scaler, reduce_dtype=self.precision.reduce_dtype)
        # what this rank holds gets storage on its device while the executor is built, then its values
        with self.meter.setup(self._held_tensors):
            self.runtime.collective(lambda: self.slot.build(context))
            if self.meter.enabled:
                # building leaves cycles (fx graphs, FSDP's hooks) holding tensors no longer used: the
                # set-up peak measures what the rank holds, not what the cyclic collector has not yet
                # freed (a full collection costs most of a second with transformers loaded: only then)
                gc.collect()
            if self.weights is not None:
                self._fill(self.weights)
        self.setup_peak_bytes = self.meter.setup_peak_bytes
        check_capacity(self.emulator, self.setup_peak_bytes, None)
        log.info("rank %d: %s executor, device %s, share %d samples in micro-batches %s", self.rank,
                 self.plan.kind, self.worker.device, self.worker.batch_share, self.worker.micro_batch_sizes)

    def _fill(self, weights: Any) -> None:
        """Write the held tensors from ``weights`` (see the class docstring); collective where reading
        a checkpoint is."""
        if callable(weights):
            self.slot.fill(weights)
        else:
            self.load_report = load_pretrained(self, weights)
        self.empty = False

    def _held_tensors(self) -> list[torch.Tensor]:
        """The tensors this rank keeps: its executor's parameters (a ragged sync's shards included)
        and its modules' parameters and buffers."""
        executor = self.slot.executor
        module = executor.module
        return [*executor.parameters(), *module.parameters(), *module.buffers()]

    def filled(self) -> None:
        """Say the held tensors have their values (:func:`runtime.checkpoint.load` calls it)."""
        self.empty = False

    def _unpack(self, batch) -> tuple[tuple, torch.Tensor]:
        if isinstance(batch, Share):
            inputs, targets = batch.inputs, batch.targets
        else:
            try:
                inputs, targets = batch
            except (TypeError, ValueError):
                raise WhaleError(f"a batch must be (inputs, targets) or a runtime.data.Share, "
                                 f"got {type(batch).__name__}") from None
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        move = lambda t: t.to(self.device) if isinstance(t, torch.Tensor) else t  # noqa: E731
        return tuple(move(x) for x in inputs), move(targets)

    def _check_batch(self, targets: torch.Tensor) -> None:
        check_global_batch(self.plan, targets.shape[0] if targets.dim() > 0 else 0, f"rank {self.rank}, step {self.step}")


def check_weights(model: nn.Module, weights: Any) -> bool:
    """Whether ``model`` is built (at least in part) on the meta device, refusing what cannot be
    filled: a buffer on meta that no checkpoint holds (a non-persistent one: build the model under
    :func:`whalelike.empty_weights`, which keeps buffers real), or ``weights`` of the wrong kind."""
    if weights is not None and not callable(weights) and not isinstance(weights, (str, os.PathLike)):
        raise WhaleError(f"runtime.Engine(weights=...) takes a save_pretrained directory or a function "
                         f"(name, full_shape, dtype) -> tensor, got {type(weights).__name__}")
    empty = any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    if empty:
        saved = set(model.state_dict().keys())
        lost = sorted(name for name, buf in model.named_buffers() if buf.is_meta and name not in saved)
        if lost:
            raise WhaleError(f"runtime.Engine: the model's buffers {lost} are on the meta device and in no checkpoint "
                             "or state dict (non-persistent), so nothing can give them values: build the model under "
                             "whalelike.empty_weights() (parameters on meta, buffers real)")
    return empty


def _measure_memory(asked: Optional[bool], emulator) -> Optional[bool]:
    """Whether to measure each step's peak: as asked, and always where the emulated device enforces
    its memory (the capacity is checked against the measured peak)."""
    if emulator.capacity_bytes is None:
        return asked
    if asked is False:
        raise WhaleError("Engine(measure_memory=False) with a cluster whose emulation enforces memory "
                         "(emulation.enforce_memory): the capacity is checked against the measured peak; "
                         "leave measure_memory unset or set enforce_memory: false")
    return True


def _preset(plan: Plan) -> Cluster:
    try:
        return Cluster.preset(plan.cluster)
    except WhaleError as e:
        raise PlanError(f"the plan names cluster {plan.cluster!r}, which is not a preset ({e}); pass "
                        "cluster=Cluster.from_yaml(<the spec the plan was made for>) to runtime.Engine") from None
