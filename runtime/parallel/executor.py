"""The step-executor protocol, whole: what may be asked of the object that runs one rank's part of a
plan, the context its builder gets, and the builders by plan kind.

An executor runs one optimizer step's forward and backward of this rank's part of the plan; the
held state (:mod:`runtime.state.slot`) owns it with its optimizer, and the Engine's step loop asks
it for a step. Everything either may ask is declared here, on :class:`StepExecutor`; the optional
capabilities carry defaults that say "not offered", so nothing is probed with ``hasattr``:

=============================  ======================================================================
required                       meaning
=============================  ======================================================================
``plan``                       the plan it runs
``train_step(inputs, targets)`` forward and backward of this rank's part of the *whole* global batch:
                               ``.grad`` of :meth:`parameters` holds the gradient of the global-mean
                               loss, synchronised; returns that loss (detached, equal on every rank)
``eval_step(inputs, targets)`` the global-mean loss, nothing updated
``parameters()``               what the optimizer steps on this rank
``module``                     the module this rank computes with (its stage, sharded as planned)
``syncs()``                    the replica syncs it runs (:mod:`runtime.replicas.replica_sync`)
``named_state()``              what this rank holds of every parameter and buffer (checkpoints, state moves)
``full_state_dict()``          the whole model, unsharded, on every rank (collective)
``load_full_state_dict(s)``    take this rank's part of a whole state dict
``close()``                    take every hook off the model; not used again
``passenger``                  a slot: the Engine puts a step-end exchange there
                               (:class:`runtime.control.exchange.Passenger`); the executor fills it
                               just before the collective that ends the step and sums it there; an
                               executor that leaves it alone costs one small all-reduce of its own
=============================  ======================================================================

=============================  ======================================================================
optional (default)             meaning
=============================  ======================================================================
``takes_shares`` (False)       ``train_share(share)`` takes a batch of this rank's samples only
                               (:class:`runtime.data.Share`, from :class:`runtime.data.UnevenLoader`)
``takes_in_place(plan)``       (False) a new plan of the same workers is adopted by ``set_plan``
                               without moving state; a pure function of the two plans, so every
                               rank answers alike; otherwise the held state builds the new plan's
                               executor and moves what changes hands
=============================  ======================================================================

Builders: a plan's kind (:attr:`planner.plan.Plan.kind`) names the builder ``ExecutorContext ->
StepExecutor`` that makes its executor (:mod:`runtime.parallel.builders`).

Invariant: every rank of a plan builds its executor from the same plan with the same builder, and
every collective an executor runs is over the groups of :mod:`runtime.groups`, entered in the same
order on every rank.
"""
from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn as nn

from planner.plan import Plan, Worker
from runtime.emulation.compute import Emulator
from runtime.groups import PlanGroups
from runtime.replicas.held_state import NamedState
from runtime.training.precision import PlanLossScaler
from whalelike.cluster import Cluster
from whalelike.errors import WhaleError
from whalelike.graphs.taskgraph import TaskGraphs

class StepExecutor(abc.ABC):
    """The protocol of the module docstring: subclass it and define the abstract methods (a subclass
    missing one cannot be instantiated: Python's ``abc`` names it)."""

    plan: Plan
    passenger: Any = None             # the Engine's step-end exchange (see the module docstring)
    takes_shares: bool = False        # train_share offered

    @abc.abstractmethod
    def train_step(self, inputs: tuple, targets: torch.Tensor) -> torch.Tensor: ...

    @abc.abstractmethod
    def eval_step(self, inputs: tuple, targets: torch.Tensor) -> torch.Tensor: ...

    @abc.abstractmethod
    def parameters(self) -> Iterator[nn.Parameter]: ...

    @property
    @abc.abstractmethod
    def module(self) -> nn.Module: ...

    @abc.abstractmethod
    def syncs(self) -> list: ...

    @property
    def gradients_in_place(self) -> bool:
        """Whether the optimizer zeroes the gradients in place between steps: a sync whose gradients
        are views of its buffers says so (:attr:`runtime.replicas.replica_sync.ReplicaSync.gradients_in_place`);
        one whose gradients become such views (``gradients_as_views``: DDP, once it has rebuilt its
        buckets) gets them zeroed in place from the first step when this rank accumulates over
        micro-batches (:attr:`accumulates`), so that no accumulated gradient is a tensor of its own
        beside the buffers (``runtime.replicas.ddp_sync`` measures both ways)."""
        accumulates = self.accumulates
        return any(sync.gradients_in_place or (accumulates and sync.gradients_as_views) for sync in self.syncs())

    @property
    @abc.abstractmethod
    def micro_batch_sizes(self) -> list[int]: ...

    @property
    def accumulates(self) -> bool:
        """Whether this rank's step runs more than one micro-batch with samples (gradient accumulation)."""
        return sum(1 for n in self.micro_batch_sizes if n) > 1

    @abc.abstractmethod
    def named_state(self) -> NamedState: ...

    @abc.abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor]: ...

    @abc.abstractmethod
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    # -- optional capabilities: the defaults say "not offered" -------------------------------------------
    def train_share(self, share) -> torch.Tensor:
        raise WhaleError(f"{type(self).__name__} takes whole global batches, not runtime.data.Share; pass (inputs, "
                         f"targets) of {self.plan.global_batch_size} samples on every rank")

    def takes_in_place(self, plan: Plan) -> bool:
        return False

    def set_plan(self, plan: Plan) -> None:
        raise WhaleError(f"{type(self).__name__} adopts no plan in place; build the plan's executor "
                         "(runtime.state.slot.ExecutorSlot.apply does)")


@dataclass(frozen=True, kw_only=True)
class ExecutorContext:
    """Everything a builder needs to make this rank's executor (built by keyword:
    :meth:`of` from a :class:`runtime.rank.RankRuntime`)."""

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
    precision: str = "fp32"     # what runs: which captured non-matmul bytes the emulator prices

    @classmethod
    def of(cls, runtime, *, model: nn.Module, graphs: TaskGraphs, loss_fn: Callable,
           scaler: Optional[PlanLossScaler] = None, reduce_dtype: Optional[torch.dtype] = None) -> "ExecutorContext":
        """The context of ``runtime`` (a :class:`runtime.rank.RankRuntime`) under its plan in force."""
        return cls(model=model, plan=runtime.plan, rank=runtime.rank, worker=runtime.worker, graphs=graphs,
                   groups=runtime.groups, loss_fn=loss_fn, emulator=runtime.emulator, device=runtime.device,
                   cluster=runtime.cluster, scaler=scaler, reduce_dtype=reduce_dtype, precision=runtime.precision)

    def under(self, runtime) -> "ExecutorContext":
        """This context for ``runtime``'s plan, rank, groups and emulator (a re-plan, a leave)."""
        return ExecutorContext.of(runtime, model=self.model, graphs=self.graphs, loss_fn=self.loss_fn,
                                  scaler=self.scaler, reduce_dtype=self.reduce_dtype)

    def with_plan(self, plan: Plan) -> "ExecutorContext":
        """This context for ``plan``, a plan of the same workers (a migration's computing layout)."""
        return dataclasses.replace(self, plan=plan, worker=plan.worker(self.rank))
