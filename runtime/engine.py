"""``runtime.Engine``: one object per rank that executes a Plan, one optimizer step per call.

The Engine is a thin dispatcher. It owns what every kind of plan shares: the process groups,
checking the plan against the run (world size) and the model (fingerprint, from a capture of the
first batch), the emulated device, the optimizer, batch checks, per-step statistics, and turning a
failed collective into an error that names the rank, the step and the missing peers. The
parallelism itself lives in a *step executor*, chosen by the plan's shape:

===================  =========================================  ==================================
plan                 executor                                   module
===================  =========================================  ==================================
1 stage, no split    :class:`DataParallelExecutor`              :mod:`runtime.parallel.data_parallel`
several stages       ``PipelineExecutor``                       :mod:`runtime.parallel.pipeline`
any ``split``        ``PipelineExecutor`` with sharded stages   :mod:`runtime.tensor.shard_pass`
===================  =========================================  ==================================

A plan with ``split`` runs as a pipeline (of one stage or more) whose tensor-parallel stages have
their Linears swapped for uneven parallel ones; ``split`` inside ``replicate`` is such a stage on
several data-parallel slots, each a tensor-parallel group.

The step-executor protocol (:class:`StepExecutor`), all collective on the ranks of the plan:

* ``train_step(inputs: tuple, targets) -> loss``: forward and backward of this rank's part of the
  *global* batch, leaving in ``.grad`` of :meth:`parameters` the gradient of the global-mean loss
  (already synchronised); returns that loss (detached, equal on every rank). No optimizer step.
* ``parameters()``: the parameters this rank updates (handed to the optimizer factory).
* ``full_state_dict() -> dict``: the whole model's state, unsharded, on every rank.
* optional ``eval_step(inputs, targets) -> loss``, ``load_full_state_dict(state)`` and
  ``train_share(share: runtime.data.Share) -> loss`` (a rank-local batch from ``UnevenLoader``);
* for dynamic balancing (:mod:`runtime.balance.rebalance`): ``set_plan(plan)`` when a new plan of the same
  workers needs no state moved (other shares: data parallel, or a pipeline's micro-batch sizes), which
  the executor's ``takes_in_place(plan)`` (or ``keeps_sync(plan)``) answers, else ``named_state()`` and ``close()`` so
  :func:`runtime.balance.state_transfer.switch_executor` can build the new plan's executor and move the
  parameters and optimizer state that change hands; and a ``passenger`` slot: when the Engine puts
  a :class:`runtime.balance.straggler_monitor.Passenger` there, the executor fills it right before the
  collective that ends the step, sums it in that collective and calls ``arrived`` (an executor
  without the slot costs the Engine one small all-reduce per exchange).

Guards (:mod:`runtime.guards`): a NaN or inf loss raises :class:`runtime.guards.NonFiniteLossError`
before the optimizer step, or skips the step on every rank (``on_nonfinite="skip"``); the same
decision everywhere without a collective, because the loss every executor returns is the global
mean, equal on every rank. Every ``batch_check_every`` steps (and the first) the ranks compare
fingerprints of their whole-global batches (:class:`runtime.guards.BatchMismatchError`). A hung or
stopped rank is named by its peers' :class:`DistributedStepError` (:class:`runtime.distributed.Progress`).

Leaving without a restart (``Engine(departures=True)``, :mod:`runtime.elastic.departure`): a
SIGTERM only sets a flag; the flags ride in the step's last all-reduce with the monitor's figures,
and at that step's boundary a leaver hands its state over and the others go on under a new plan in
a new default process group (:meth:`Engine._rewire`), with no restart.

Dynamic balancing (``Engine(balance=...)``, default policy ``"exact"``): after every step the
rank's measured compute speed is recorded and shared; a sustained change re-plans at the step
boundary (:mod:`runtime.balance.rebalance`). ``Engine.plan`` is always the plan in force and
``Engine.replans`` the history of re-plans.

After the optimizer step (or its skip) the Engine calls the replica syncs' optional
``after_step(plan, step, optimizer)`` (:func:`runtime.replicas.replica_sync.after_step`): Prague's
partial all-reduce averages each replica with its group there, and its steps are marked
``StepStats.approximate``. ``Engine.step_hooks`` are callables ``engine -> None`` run on every rank at
each step boundary after the re-plan check (:class:`runtime.balance.sync_policy.SyncPolicy` attaches
itself there).

A builder ``(ExecutorContext) -> StepExecutor`` makes one; :func:`register_executor` adds or
replaces the builder of a plan kind (``"data_parallel"``, ``"pipeline"``, ``"tensor_parallel"``).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Protocol, runtime_checkable

import torch
import torch.nn as nn

from planner.devices.cost_model import fsdp_unit_names
from planner.devices.profile import Profile
from planner.plan import Plan, PlanError, Worker
from planner.plan_checks import check_same_workers
from planner.shares.layout import check_global_batch
from runtime import distributed, guards
from runtime.data import Share
from runtime.parallel.data_parallel import DataParallelExecutor
from runtime.emulation.compute import EmulatedOutOfMemoryError, EmulationStats, Emulator, check_capacity  # noqa: F401
from runtime.groups import PlanGroups, build_groups
from runtime.balance.rebalance import BalanceConfig, Rebalancer, ReplanEvent
from runtime.elastic.departure import Boarding, Departures, LeaveConfig, Stopping, leave, reasons_of
from runtime.replicas.replica_sync import after_step, runs_exact
from runtime.training.clipping import GlobalGradNorm, check_max_norm
from runtime.training.memory_meter import MemoryMeter
from runtime.training.precision import PlanLossScaler, Precision
from runtime.training.schedules import build_scheduler
from whalelike.cluster import Cluster
from whalelike.errors import WhaleError
from whalelike.graphs.taskgraph import TaskGraphs

log = logging.getLogger(__name__)


@runtime_checkable
class StepExecutor(Protocol):
    def train_step(self, inputs: tuple, targets: torch.Tensor) -> torch.Tensor: ...

    def parameters(self) -> Iterator[nn.Parameter]: ...

    def full_state_dict(self) -> dict[str, torch.Tensor]: ...


@dataclass(frozen=True)
class ExecutorContext:
    """Everything a builder needs to make this rank's executor."""

    model: nn.Module
    plan: Plan
    rank: int
    worker: Worker
    graphs: TaskGraphs          # the capture of the model (graph_module, node_taskgraph, costs)
    groups: PlanGroups
    loss_fn: Callable
    emulator: Emulator
    device: torch.device
    cluster: Optional[Cluster] = None   # its link figures price the boundary reshardings (runtime.parallel.boundaries)
    scaler: Optional[PlanLossScaler] = None   # fp16's loss scale, applied where the executors weight the loss
    reduce_dtype: Optional[torch.dtype] = None   # the dtype replicas reduce gradients in (None: their own)
    precision: str = "fp32"     # what runs (Engine.precision): which captured non-matmul bytes the emulator prices


def plan_kind(plan: Plan) -> str:
    if any(w.tp_size > 1 for w in plan.workers):
        return "tensor_parallel"
    return "pipeline" if len(plan.stages) > 1 else "data_parallel"


def _stage_memory_bytes(ctx: ExecutorContext) -> list[tuple[float, float]]:
    """Per stage of ``ctx.plan``: (forward, backward) non-matmul bytes per sample, which the
    emulator prices at the device's memory bandwidth beside the FLOPs
    (:func:`runtime.parallel.stage_split.stage_memory_bytes_from_plan`). At bf16/fp16 on a device
    whose bandwidth is emulated, the bytes measured under autocast (the capture's graph run again
    on fake tensors once, :func:`whalelike.graphs.capture.with_autocast`); elsewhere no bytes are
    priced and the float32 figures serve."""
    from runtime.parallel.stage_split import stage_memory_bytes_from_plan
    from whalelike.graphs.capture import with_autocast

    graphs = ctx.graphs
    if ctx.precision != "fp32" and ctx.emulator.enabled and ctx.emulator.memory_gbps is not None:
        graphs = with_autocast(graphs)
    return stage_memory_bytes_from_plan(graphs, ctx.plan, ctx.precision)


def _build_data_parallel(ctx: ExecutorContext) -> StepExecutor:
    flops = (sum(g.forward_flops for g in ctx.graphs), sum(g.backward_flops for g in ctx.graphs))
    idle = [n for layer in ctx.graphs.layers for n in layer.idle_state]
    return DataParallelExecutor(ctx.model, ctx.plan, ctx.rank, ctx.groups.dp, ctx.loss_fn, ctx.emulator, flops,
                                recompute_layers=[layer.name for layer in ctx.graphs.layers],
                                zero_layers=fsdp_unit_names(ctx.graphs.layers), idle=idle,
                                memory_bytes_per_sample=_stage_memory_bytes(ctx)[0],
                                scaler=ctx.scaler, reduce_dtype=ctx.reduce_dtype)


def _build_pipeline(ctx: ExecutorContext) -> StepExecutor:
    from planner.devices.network import NetworkModel
    from runtime.parallel.pipeline import PipelineExecutor, idle_state_of
    from runtime.parallel.stage_split import node_stages_from_plan, stage_flops_from_plan
    from runtime.tensor.shard_pass import StageSharding

    return PipelineExecutor(ctx.graphs.graph_module, node_stages_from_plan(ctx.graphs, ctx.plan), ctx.plan,
                            ctx.loss_fn, emulator=ctx.emulator, stage_flops=stage_flops_from_plan(ctx.graphs, ctx.plan),
                            stage_memory_bytes=_stage_memory_bytes(ctx),
                            dp_group=ctx.groups.dp.group, sharding=StageSharding.from_graphs(ctx.graphs, ctx.groups.tp.group),
                            network=NetworkModel.of_cluster(ctx.cluster) if ctx.cluster is not None else None,
                            scaler=ctx.scaler, reduce_dtype=ctx.reduce_dtype,
                            idle_state=idle_state_of(ctx.graphs, ctx.plan, ctx.model))


def takes_in_place(executor, plan: Plan) -> bool:
    """The one rule of :meth:`Engine.apply_plan`: ``executor`` adopts ``plan`` in place (its
    ``set_plan``) when it says it can: ``takes_in_place(plan)`` (the pipeline executor: only
    micro-batch sizes and counts differ, :func:`runtime.parallel.pipeline.in_place_differences`),
    or, for an executor that answers with ``keeps_sync(plan)`` instead (the data-parallel one: the
    same replica sync, ZeRO stage and fractions), that. An executor with no ``set_plan``, or that
    answers neither, is rebuilt. Each answer is a pure function of the two plans, so every rank
    takes the same path."""
    if not hasattr(executor, "set_plan"):
        return False
    ask = getattr(executor, "takes_in_place", None) or getattr(executor, "keeps_sync", None)
    return ask is not None and bool(ask(plan))


_BUILDERS: dict[str, Callable[[ExecutorContext], StepExecutor]] = {
    "data_parallel": _build_data_parallel,
    "pipeline": _build_pipeline,
    "tensor_parallel": _build_pipeline,
}


def register_executor(kind: str, builder: Callable[[ExecutorContext], StepExecutor]) -> None:
    """Make ``builder`` the executor of plans of ``kind`` (see :func:`plan_kind`)."""
    if kind not in ("data_parallel", "pipeline", "tensor_parallel"):
        raise ValueError(f"register_executor: kind must be data_parallel, pipeline or tensor_parallel, got {kind!r}")
    _BUILDERS[kind] = builder


@dataclass(frozen=True)
class StepStats:
    """One training step on this rank. ``compute_s`` is real compute inside emulated segments,
    ``padded_s`` the time those segments took (``max(real, modeled)`` each), ``wait_s`` the rest of
    the step: communication, waiting for peers, loss and optimizer work."""

    step: int
    wall_s: float
    compute_s: float
    modeled_s: float
    padded_s: float
    wait_s: float
    segments: int
    overruns: int
    flops: float = 0.0              # FLOPs of the step's compute segments (what the monitor divides by time)
    approximate: bool = False       # the step ran with ZERO-resizing (runtime.balance.rebalance policies semi/resize)
    #                                 or Prague's partial all-reduce (replica_sync 'partial', runtime.replicas.partial_sync)
    plan_version: int = 0           # how many re-plans were in force before this step
    skipped: bool = False           # no update: a NaN or inf loss or gradient norm (on_nonfinite="skip"), or an fp16 overflow
    overflow: bool = False          # fp16: some rank's gradients overflowed; every rank skipped and halved the scale
    grad_norm: Optional[float] = None   # the whole model's gradient norm before clipping (with clip_grad_norm)
    loss_scale: Optional[float] = None  # fp16: the scale the step's backward used
    lr: Optional[float] = None      # the first param group's learning rate the step used
    peak_memory_bytes: Optional[int] = None   # this rank's measured peak (runtime.training.memory_meter)


class Engine:
    """Trains ``model`` according to ``plan`` on this rank (see the module docstring).

    ``optimizer``: a factory ``params -> torch.optim.Optimizer`` (default AdamW, lr 1e-3), applied
    to this rank's parameters. ``loss_fn(outputs, targets)`` must return the *mean* loss over the
    samples it is given. ``cluster``: the cluster spec (default ``Cluster.preset(plan.cluster)``);
    its emulation block, if any, turns on emulated devices. ``example_args``: inputs to capture the
    model with now; without them the first batch is used. ``timeout_s`` (seconds, positive and
    finite) bounds every collective of the groups the Engine builds, and of the default group when
    the Engine initialises it. ``balance``: dynamic balancing, a policy name (``"exact"``, the
    default; ``"semi"``, ``"resize"``, ``"off"``) or a :class:`runtime.balance.rebalance.BalanceConfig`.

    ``on_nonfinite``: ``"raise"`` (default) stops at a NaN or inf loss with
    :class:`runtime.guards.NonFiniteLossError` naming the step and the rank, before the optimizer
    step; ``"skip"`` drops that step's update on every rank (gradients discarded, a warning naming
    the step, ``StepStats.skipped`` and :attr:`skipped_steps`). ``batch_check_every``: compare the
    ranks' whole-global batches at the first step and every that many steps (0: never), raising
    :class:`runtime.guards.BatchMismatchError` when a rank's batch differs from rank 0's.

    The training recipe (:mod:`runtime.training`): ``precision`` ``"fp32"``, ``"bf16"`` or
    ``"fp16"`` (default: the plan's; autocast with float32 master state, fp16 with a loss scaler
    whose overflow decision is one for every rank, :mod:`runtime.training.precision`), and
    ``grad_reduce_dtype`` ``"fp32"`` (exact, the default) or ``"bf16"`` (replicas sum gradients in
    half the bytes);
    ``clip_grad_norm``: clip the whole model's gradient to this global norm before each optimizer
    step (:mod:`runtime.training.clipping`; the norm is in ``StepStats.grad_norm``); ``scheduler``:
    a factory ``optimizer -> LR scheduler``, stepped after every optimizer step that happened and
    saved in checkpoints (:mod:`runtime.training.schedules`); ``measure_memory``: record each
    step's peak memory in ``StepStats.peak_memory_bytes`` (default: on GPUs; on CPU it costs a
    dispatch-mode tracker, :mod:`runtime.training.memory_meter`); ``profile``: the cluster as
    ``whalelike profile`` measured it for this model (:class:`planner.devices.profile.Profile`):
    re-plans for measured speeds start from its rates and links instead of the spec sheet's.

    ``departures``: leaving without a restart (:mod:`runtime.elastic.departure`), off by default:
    ``True`` (or a :class:`runtime.elastic.departure.LeaveConfig`) makes a SIGTERM a notice: the rank
    leaves at the end of the step it is in, handing its state to the ranks that stay, which go on
    under a plan for their devices (``Engine.plan``, ``Engine.rank`` and the default process group
    change; ``Engine.departures.history`` records each leave); on the leaver ``train_step`` raises
    :class:`runtime.elastic.departure.Departed`, a ``SystemExit`` with code 0. When every rank gives
    notice in the same step, nobody leaves: ``train_step`` raises
    :class:`runtime.elastic.departure.Stopping` on every rank with the step complete (save a
    checkpoint of it and exit).
    """

    def __init__(self, model: nn.Module, plan: Plan, optimizer: Optional[Callable] = None,
                 loss_fn: Optional[Callable] = None, cluster: Optional[Cluster] = None,
                 example_args: Any = None, timeout_s: float = 300.0,
                 balance: "BalanceConfig | str | None" = None, on_nonfinite: str = "raise",
                 batch_check_every: int = guards.DEFAULT_BATCH_CHECK_EVERY, precision: Optional[str] = None,
                 clip_grad_norm: Optional[float] = None, scheduler: Optional[Callable] = None,
                 measure_memory: Optional[bool] = None, grad_reduce_dtype: str = "fp32",
                 profile: Optional[Profile] = None, departures: "LeaveConfig | bool | None" = None):
        if loss_fn is None:
            raise WhaleError("runtime.Engine needs loss_fn(outputs, targets) -> mean loss over the batch")
        # Every check before the rendezvous is local and identical on all ranks: all fail alike, none hangs.
        timeout_s = guards.check_timeout(timeout_s)
        guards.check_options(on_nonfinite, batch_check_every)
        planned = plan.precision
        self.precision = Precision(planned if precision is None else precision, grad_reduce_dtype)
        if self.precision.name != planned:
            log.warning("runtime.Engine(precision=%r) runs a plan made for %s: its shares and memory were priced "
                        "at %s rates (plan with --precision %s to price it for what runs)", self.precision.name,
                        planned, planned, self.precision.name)
        self.clip_grad_norm = check_max_norm(clip_grad_norm)
        if scheduler is not None and not callable(scheduler):
            raise WhaleError(f"runtime.Engine(scheduler=...) must be a factory optimizer -> LR scheduler, got "
                             f"{scheduler!r}")
        self._make_scheduler = scheduler
        self.on_nonfinite, self.batch_check_every = on_nonfinite, batch_check_every
        self.skipped_steps: list[int] = []     # steps whose update on_nonfinite="skip" dropped
        balance = BalanceConfig.of(balance)
        leaving = LeaveConfig.of(departures)
        rank, world_size = distributed.launched()
        distributed.check_world_size(plan, world_size, rank)
        self.cluster = cluster if cluster is not None else _preset(plan)
        plan.validate(cluster=self.cluster)
        # the measured speeds re-plans start from (planner.devices.measured_speeds); checked against
        # the model once it is captured
        self.profile = profile
        if profile is not None:
            profile.validate(cluster=self.cluster)
            profile.check_precision(self.precision.name)
        elif plan.speeds == "profile":
            log.warning("runtime.Engine runs a plan made from a profile without it (Engine(profile=...), train.py "
                        "--profile): a re-plan prices the devices from the cluster spec")
        # a precision some device of the plan cannot run (bf16 on a V100): every rank refuses alike
        self.cluster.check_precision(self.precision.name, [w.device for w in plan.workers])
        self.rank = distributed.init(timeout_s)
        self.plan, self.model, self.loss_fn, self.timeout_s = plan, model, loss_fn, timeout_s
        self.worker = plan.worker(self.rank)
        # an emulated device runs at its rate for the precision that runs (whalelike.cluster per-dtype rates)
        self.emulator = Emulator.for_device(self.cluster, self.worker.device, self.rank, precision=self.precision.name)
        self.device = distributed.device()
        self.precision.check_device(self.device)
        self.model.to(self.device)
        if self.emulator.capacity_bytes is not None:      # an emulated device enforcing its memory measures it
            if measure_memory is False:
                raise WhaleError("Engine(measure_memory=False) with a cluster whose emulation enforces memory "
                                 "(emulation.enforce_memory): the capacity is checked against the measured peak; "
                                 "leave measure_memory unset or set enforce_memory: false")
            measure_memory = True
        self.meter = MemoryMeter(self.device, measure_memory)
        self.scaler = PlanLossScaler(self.device) if self.precision.scales_loss else None
        self.scheduler = None
        self._clipper: Optional[tuple[Any, GlobalGradNorm]] = None   # (the executor it was built for, it)
        self.groups = build_groups(plan, self.rank, timeout_s)
        self.progress = distributed.Progress(self.rank, plan.world_size, timeout_s, self.emulator.busy_for)
        self._make_optimizer = optimizer or (lambda params: torch.optim.AdamW(params, lr=1e-3))
        self.executor: Optional[StepExecutor] = None
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.stats: list[StepStats] = []
        self.step = 0
        self._warned_overrun = False
        self.graphs: Optional[TaskGraphs] = None
        self.compute_plan: Optional[Plan] = None    # the layout that computes while a migration runs
        self._context: Optional[ExecutorContext] = None
        self.rebalancer = Rebalancer(self, balance)
        # leaving without a restart (runtime.elastic.departure): None when off (the default)
        self.departures = Departures(leaving) if leaving is not None else None
        # callables engine -> None run on every rank at each step boundary, after the re-plan check
        # (collective: every rank holds the same hooks); runtime.balance.sync_policy attaches itself here
        self.step_hooks: list[Callable[["Engine"], None]] = []
        if example_args is not None:
            self._build(example_args if isinstance(example_args, tuple) else (example_args,))

    # -- public API -------------------------------------------------------------------------------
    def train_step(self, batch) -> torch.Tensor:
        """One optimizer step on ``batch``: ``(inputs, targets)`` holding the whole global batch
        (every rank passes the same), or a :class:`runtime.data.Share` holding this rank's samples.
        Returns the global-mean loss, the same on every rank (also when the step was skipped for a
        non-finite loss: see ``on_nonfinite``)."""
        share = batch if isinstance(batch, Share) else None
        inputs, targets = self._unpack(batch)
        self._build(inputs)
        if share is None:
            self._check_batch(targets)
            self.rebalancer.observe_batch(inputs, targets)   # SEMI's pre-test evaluates the last few
            if guards.batch_check_due(self.step, self.batch_check_every):
                self._collective(lambda: guards.check_same_batch(inputs, targets, self.step, self.rank,
                                                                 self.batch_check_every))
        elif not hasattr(self.executor, "train_share"):
            raise WhaleError(f"{type(self.executor).__name__} takes whole global batches, not runtime.data.Share; "
                             f"pass (inputs, targets) of {self.plan.global_batch_size} samples on every rank")
        self.emulator.step = self.step
        before = self.emulator.stats.snapshot()
        start = time.perf_counter()
        with self.meter.step([self.executor_module()], self.optimizer):
            self.optimizer.zero_grad(set_to_none=True)
            # the straggler monitor's figures ride in the all-reduce that ends the step (executors with
            # a ``passenger`` slot sum it there); a step without one sums it on its own
            inner = self.rebalancer.passenger(self.step, lambda: self.emulator.stats.since(before))
            # with departures on, every step carries the ranks' leave flags too (Boarding)
            passenger = inner if self.departures is None else \
                self.departures.board(inner, self.plan.world_size, self.rank)
            carries = hasattr(self.executor, "passenger")
            if carries:
                self.executor.passenger = passenger
            scale = self.scaler.current() if self.scaler is not None else None
            with self.precision.autocast(self.device):
                loss = self._collective(
                    lambda: self.executor.train_share(Share(inputs, targets, share.global_size)) if share is not None
                    else self.executor.train_step(inputs, targets))
            if carries:
                self.executor.passenger = None
            if passenger is not None and not passenger.carried:
                passenger.fill()
                self._collective(lambda: _sum_alone(passenger.vector))
                passenger.arrived(passenger.vector)
            outcome = self._optimizer_step(loss)
            # the replica sync's hook after the optimizer step (or its skip): P-Reduce averages with its group
            self._collective(lambda: after_step(self.executor, self.plan, self.step, self.optimizer))
        em = self.emulator.stats.since(before)
        self._record(time.perf_counter() - start, em, outcome, scale)
        check_capacity(self.emulator, self.meter.peak_bytes, self.step)   # an emulated device's memory, if enforced
        # the step boundary: the plan may change (collective, part of this step: a rank that never
        # starts the next one must not be reported as having begun it)
        carried = inner.vector if inner is not None else None
        notices = passenger.leaving() if isinstance(passenger, Boarding) else []
        if not notices:
            self._collective(lambda: self.rebalancer.after_step(self.step, em.flops, em.padded_s, em.matmul_s, carried))
        if len(notices) == self.plan.world_size:   # the whole job is being stopped: nobody can stay
            self.step += 1
            raise Stopping(self.step, loss)
        slow = self.departures.slow(self) if self.departures is not None and not notices else None
        if notices or slow is not None:   # a leave: this rank raises Departed if it is one of them
            leave(self, *reasons_of(notices, slow))
        for hook in list(self.step_hooks):   # e.g. runtime.balance.sync_policy.SyncPolicy (collective)
            self._collective(lambda: hook(self))
        self.step += 1
        return loss

    def _optimizer_step(self, loss: torch.Tensor) -> "_Outcome":
        """Unscale (fp16), clip, step the optimizer and the schedule, or skip the update on every rank
        alike: the loss is the global mean and the overflow flag and gradient norm come from one
        collective each, so every rank takes the same decision."""
        lr = float(self.optimizer.param_groups[0]["lr"])
        if not guards.is_finite(loss):
            return self._skip(guards.nonfinite_error(loss, self.step, self.rank), f"the loss is {guards.loss_text(loss)}",
                              lr=lr)
        if self.scaler is not None:
            self._collective(lambda: self.scaler.unscale_(self.optimizer))
            if self.scaler.overflowed:
                before = self.scaler.current()
                self.scaler.step(self.optimizer)      # skips the step: the overflow was found
                self.scaler.update()
                self.optimizer.zero_grad(set_to_none=True)
                log.info("rank %d, step %d: fp16 gradients overflowed on some rank; every rank skipped the step, "
                         "loss scale %g -> %g", self.rank, self.step, before, self.scaler.current())
                return _Outcome(skipped=True, overflow=True, lr=lr)
        norm = None
        if self.clip_grad_norm is not None:
            total = self._collective(lambda: self._clipping().clip_(self.clip_grad_norm))
            norm = float(total)
            if not math.isfinite(norm):
                return self._skip(guards.NonFiniteLossError(
                    f"rank {self.rank}, step {self.step}: the global gradient norm is {norm:g} (the loss is finite); "
                    f"the optimizer did not step. Lower the learning rate, or pass runtime.Engine(on_nonfinite='skip') "
                    f"to drop such steps on every rank"), f"the gradient norm is {norm:g}", norm=norm, lr=lr)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.rebalancer.after_optimizer_step()
        return _Outcome(norm=norm, lr=lr)

    def _skip(self, error: Exception, why: str, norm: Optional[float] = None, lr: Optional[float] = None) -> "_Outcome":
        if self.on_nonfinite == "raise":
            raise error
        self.optimizer.zero_grad(set_to_none=True)
        self.skipped_steps.append(self.step)
        log.warning("rank %d, step %d: %s; skipped the step on every rank (no optimizer step, gradients dropped; "
                    "on_nonfinite='skip'), %d skipped so far", self.rank, self.step, why, len(self.skipped_steps))
        return _Outcome(skipped=True, norm=norm, lr=lr)

    def _clipping(self) -> GlobalGradNorm:
        """The global-norm clipper of the executor in force (rebuilt, collectively, after a re-plan)."""
        if self._clipper is None or self._clipper[0] is not self.executor:
            if not hasattr(self.executor, "named_state"):
                raise WhaleError(f"{type(self.executor).__name__} does not describe what it holds (named_state), so "
                                 "clip_grad_norm cannot count the model's gradient once; run without clipping")
            self._clipper = (self.executor, GlobalGradNorm(self.executor.named_state()))
        return self._clipper[1]

    @property
    def replans(self) -> list[ReplanEvent]:
        """Every re-plan so far (:class:`runtime.balance.rebalance.ReplanEvent`), oldest first."""
        return self.rebalancer.history

    def apply_plan(self, plan: Plan):
        """Switch to ``plan``, a plan of the same workers (rank, device, stage, groups) with other
        amounts of work, at a step boundary (collective: every rank calls it with the same plan).
        Shares change in place when the executor takes the plan so (:func:`takes_in_place`: the
        executor object, its modules, syncs and optimizer stay); moved layers, re-sized shards or
        another replica sync build the new plan's executor and move their parameters and
        optimizer state P2P (:mod:`runtime.balance.state_transfer`). Returns the transfer report, or
        None when nothing had to move."""
        from runtime.balance.state_transfer import switch_executor

        check_same_workers(self.plan, plan, "Engine.apply_plan")
        plan.validate(graphs=self.graphs, cluster=self.cluster)
        if self.executor is None:
            self.plan, self.worker = plan, plan.worker(self.rank)
            return None
        report = None
        context = dataclasses.replace(self._context, plan=plan, worker=plan.worker(self.rank))
        if takes_in_place(self.executor, plan):
            self._collective(lambda: self.executor.set_plan(plan))
        else:
            kind = plan_kind(plan)
            self.executor, report = self._collective(lambda: switch_executor(
                self.executor, lambda: _BUILDERS[kind](context), self.optimizer, self._make_optimizer,
                None))
        self._context = context
        self.plan, self.worker, self.compute_plan = plan, plan.worker(self.rank), None
        return report

    def _rewire(self, plan: Plan, cluster: Cluster, rank: int, held):
        """After a leave (:func:`runtime.elastic.departure.leave`, in the stayers' new default group):
        run ``plan`` on ``cluster`` as ``rank``: new groups, progress record, emulator, straggler
        monitor, and the executor built for the plan with ``held`` (the old executor's snapshot and
        any pieces parked here) landed on it. Returns the transfer report."""
        from runtime.balance.state_transfer import land

        plan.validate(graphs=self.graphs, cluster=cluster)
        self.rank, self.plan, self.cluster, self.worker = rank, plan, cluster, plan.worker(rank)
        self.emulator = Emulator.for_device(cluster, self.worker.device, rank, precision=self.precision.name)
        self.groups = build_groups(plan, rank, self.timeout_s)
        self.progress = distributed.Progress(rank, plan.world_size, self.timeout_s, self.emulator.busy_for)
        self._context = context = dataclasses.replace(self._context, plan=plan, rank=rank, worker=self.worker,
                                                      groups=self.groups, emulator=self.emulator, cluster=cluster)
        self.executor, report = self._collective(lambda: land(held, _BUILDERS[plan_kind(plan)](context),
                                                              self.optimizer, self._make_optimizer))
        self.compute_plan = None
        history, version = self.rebalancer.history, self.rebalancer.plan_version
        self.rebalancer = Rebalancer(self, self.rebalancer.config)
        self.rebalancer.history, self.rebalancer.plan_version = history, version + 1
        self.rebalancer._fresh = True   # the new executor's first step pays one-time costs
        if self.step_hooks:
            log.warning("rank %d: the step hooks %s were built for the old world; a hook holding process groups "
                        "must rebuild them (the default group is new)", rank, [type(h).__name__ for h in self.step_hooks])
        return report

    def start_migration(self, compute_plan: Plan) -> None:
        """Run the next steps with ``compute_plan``'s layout (same workers, other shard sizes or
        shares) while the plan in force keeps the parameters and optimizer state
        (:mod:`runtime.balance.migration`); collective. Replaces a migration already running."""
        from runtime.balance.migration import MigratingExecutor

        check_same_workers(self.plan, compute_plan, "Engine.start_migration")
        compute_plan.validate(graphs=self.graphs, cluster=self.cluster)
        self.stop_migration()
        context = dataclasses.replace(self._context, plan=compute_plan, worker=compute_plan.worker(self.rank))
        compute = self._collective(lambda: _BUILDERS[plan_kind(compute_plan)](context))
        self.executor = self._collective(lambda: MigratingExecutor(self.executor, compute))
        self.compute_plan = compute_plan

    def stop_migration(self) -> bool:
        """End a migration (the owners' parameters are current; nothing moves). False if none ran."""
        from runtime.balance.migration import MigratingExecutor

        if not isinstance(self.executor, MigratingExecutor):
            return False
        self.executor = self.executor.release_compute()
        self.compute_plan = None
        return True

    def executor_module(self) -> nn.Module:
        """The module this rank runs (its stage, sharded where the plan says so)."""
        stage = getattr(self.executor, "stage", None)
        return stage.module if stage is not None else self.model

    def eval_step(self, batch) -> torch.Tensor:
        """The global-mean loss of ``(inputs, targets)`` without updating anything."""
        inputs, targets = self._unpack(batch)
        self._build(inputs)
        if not hasattr(self.executor, "eval_step"):
            raise WhaleError(f"{type(self.executor).__name__} has no eval_step")
        with self.precision.autocast(self.device):
            return self._collective(lambda: self.executor.eval_step(inputs, targets))

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.executor.parameters() if self.executor is not None else self.model.parameters()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full, unsharded model state (a collective: every rank calls it and gets all of it)."""
        if self.executor is None:
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        return self._collective(self.executor.full_state_dict)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a full, unsharded model state (each rank keeps its part)."""
        if self.executor is None:
            self.model.load_state_dict(state)
        elif hasattr(self.executor, "load_full_state_dict"):
            self.executor.load_full_state_dict(state)
        else:
            raise WhaleError(f"{type(self.executor).__name__} cannot load a full state dict; load it into the "
                             "model before the first step")

    # -- internals --------------------------------------------------------------------------------
    def _build(self, example_inputs: tuple) -> None:
        """Capture the model, check the plan was made for it, and build the executor (once)."""
        if self.executor is not None:
            return
        from whalelike.graphs.capture import capture

        graphs = capture(self.model, example_inputs)
        self.plan.validate(graphs=graphs, cluster=self.cluster)
        if self.profile is not None:
            self.profile.validate(graphs=graphs)
        kind = plan_kind(self.plan)
        if kind not in _BUILDERS:
            raise WhaleError(f"rank {self.rank}: no step executor for {kind.replace('_', ' ')} plans is registered "
                             f"(runtime.engine.register_executor); this plan has strategies "
                             f"{[s.strategy for s in self.plan.stages]}")
        ctx = ExecutorContext(self.model, self.plan, self.rank, self.worker, graphs, self.groups, self.loss_fn,
                              self.emulator, self.device, self.cluster, self.scaler, self.precision.reduce_dtype,
                              self.precision.name)
        self.graphs, self._context = graphs, ctx
        self.executor = self._collective(lambda: _BUILDERS[kind](ctx))
        self.optimizer = self._make_optimizer(list(self.executor.parameters()))
        if self._make_scheduler is not None:
            self.scheduler = build_scheduler(self._make_scheduler, self.optimizer)
        log.info("rank %d: %s executor, device %s, share %d samples in micro-batches %s", self.rank, kind,
                 self.worker.device, self.worker.batch_share, self.worker.micro_batch_sizes)

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

    def _collective(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` after recording that this rank entered one more collective of this step
        (:meth:`runtime.distributed.Progress.enter`); a failed collective becomes a DistributedStepError."""
        try:
            self.progress.enter(self.step)
            return fn()
        except RuntimeError as e:
            if distributed.is_communication_failure(e):
                raise self.progress.failure(self.step, self.timeout_s, e) from e
            raise

    def _record(self, wall: float, em: EmulationStats, outcome: "_Outcome", scale: Optional[float]) -> StepStats:
        stats = StepStats(step=self.step, wall_s=wall, compute_s=em.real_s, modeled_s=em.modeled_s,
                          padded_s=em.padded_s, wait_s=max(0.0, wall - em.padded_s), segments=em.segments,
                          overruns=em.overruns, flops=em.flops,
                          approximate=self.rebalancer.approximate or not runs_exact(self.executor),
                          plan_version=self.rebalancer.plan_version, skipped=outcome.skipped,
                          overflow=outcome.overflow, grad_norm=outcome.norm, loss_scale=scale, lr=outcome.lr,
                          peak_memory_bytes=self.meter.peak_bytes)
        self.stats.append(stats)
        # from the second step on: the first pays one-time costs (allocations, DDP's bucket set-up)
        if stats.overruns and self.emulator.enabled and self.step > 0 and not self._warned_overrun:
            self._warned_overrun = True
            log.warning("rank %d, step %d: %d of %d compute segments took longer than modeled (worst %.1fx); "
                        "the emulated speeds are distorted: lower emulation.base_gflops by at least that "
                        "factor (runtime.emulation.compute.calibrate)", self.rank, self.step, stats.overruns,
                        stats.segments, em.worst_overrun)
        return stats


@dataclass(frozen=True)
class _Outcome:
    """What the optimizer step of one step did (for StepStats)."""

    skipped: bool = False
    overflow: bool = False
    norm: Optional[float] = None
    lr: Optional[float] = None


def _sum_alone(vector: torch.Tensor) -> None:
    """All-reduce ``vector`` in place on the device the backend needs (nccl: the current GPU)."""
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        moved = vector.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(moved)
        vector.copy_(moved.cpu())
    else:
        dist.all_reduce(vector)


def _preset(plan: Plan) -> Cluster:
    try:
        return Cluster.preset(plan.cluster)
    except WhaleError as e:
        raise PlanError(f"the plan names cluster {plan.cluster!r}, which is not a preset ({e}); pass "
                        "cluster=Cluster.from_yaml(<the spec the plan was made for>) to runtime.Engine") from None
