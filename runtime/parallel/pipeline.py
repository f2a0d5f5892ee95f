"""Pipeline execution of a multi-stage Plan: one stage per rank, the Plan's schedule, exact gradients.

This executor owns the pipeline (the schedule, the micro-batches and their samples, the boundary
exchanges, the step's loss); what this rank runs of its stage (module, sharding, replica sync,
tied weights, BatchNorm sync, compute segments, backward) is a
:class:`runtime.parallel.stage_worker.StageWorker`.

Why not ``torch.distributed.pipelining``: its stages exchange whole micro-batches between exactly
one rank per stage and every micro-batch has the same size. A whalelike Plan gives each worker of
a stage its own, uneven, share of every micro-batch (faster devices take more samples), and stages
sit on device groups of different sizes (stage 0 on two devices feeding stage 1 on one). So each
worker of a stage covers a contiguous sample range of micro-batch ``m``, and what crosses a stage
boundary, forward (values) and back (gradients), is a cross-mesh resharding between the two stage
groups' layouts, planned and run by :mod:`runtime.parallel.boundaries` (seed paper 001: each unique slice
crosses into a host once, by broadcast or all-gather among its receivers, senders balanced;
``Plan.resharding`` picks the strategy). What is reused from torch: stage splitting by
``split_module`` (:mod:`runtime.parallel.stage_split`), the P2P ops (``isend``/``irecv``), DDP for the gradient
sync within a stage group, and pipelining's way of driving DDP: ``no_sync`` for every micro-batch
but the last backward, which first calls ``reducer.prepare_for_backward`` on the stage outputs.

Sample layout of the global batch (every rank holds all of it, so model inputs and targets are
sliced locally and never sent): :class:`planner.shares.layout.SampleLayout`, replica-major, then
micro-batch, then ``dp_index``; the members of a tensor-parallel slot share their samples.

Exactness: the last stage weights ``loss_fn(outputs, targets)`` (a per-slice mean) by
``samples / global_batch_size``, and gradients are *summed* over each stage's data-parallel group
(all its workers in all replicas), so every parameter gradient is the global-batch mean gradient
and the returned loss is the global-mean loss on every rank.

Ordering: each rank runs its stage's *program* exactly (:mod:`planner.schedule.program`: the plan's
schedule, GPipe, 1F1B, eager-1F1B or ZB-H1, lowered onto the stages' crossings, every ``RECV_F``,
``SEND_F``, ``RECV_B`` and ``SEND_B`` an action of its own; a single stage: ``gradient_accumulation``
of its own micro-batches), built and proven deadlock-free in this process before the first action
(:func:`planner.schedule.deadlock.proven_program`); the simulator runs the same lowering on the
plan's boundaries, so what is simulated is what runs. Receives block, sends are posted and waited
at the end of the step; the forwarding a resharding does inside a receiving stage happens at the
same action on each of its workers. Every crossing (value, consumer stage, direction, micro-batch)
has its own tag range and both sides post their messages in one global order
(:mod:`runtime.parallel.boundaries`; a program's send or receive takes the crossings with one peer,
in that order), so gloo (matches by peer and tag) and NCCL (by order) agree. The peers are the
split's: a skip connection's value goes straight to the stage that reads it, where the plan's
boundaries, the chain, price it across every cut.

Emulation: each compute action of a micro-batch (F, B, BI, BW) is one compute segment of the rank's
:class:`~runtime.emulation.compute.Emulator` (stage FLOPs and non-matmul bytes per sample times samples), outside every
send and receive (:class:`runtime.parallel.stage_worker.StageWorker` opens them); the replica
sync's all-reduce of the last backward overlaps it bucket by bucket (:mod:`runtime.replicas.ddp_sync`). On an emulated network, sends and receives carry their modeled
arrival and receives sleep until it, and a tensor-parallel group's collectives take their ring
time (:mod:`runtime.emulation.network`).

Split backwards (ZB-H1, and ``Plan.delay_weight_gradients``, paper 001's eager-1F1B with the weight
half of backward covering the backward's sends): a ``BI`` action computes the received values'
gradients (:mod:`runtime.parallel.split_backward`) and keeps the weight half, the ``SEND_B`` after it
posts them, and a ``BW`` action runs the weight half where the program puts it: right after the
sends under delayed weight gradients, deferred into the drain under ZB-H1 (the autograd graph of a
micro-batch is held until its ``BW``, which the memory model counts). The replica sync is armed
right before the step's last action that computes weight gradients (``B`` or ``BW``), so DDP's
all-reduce fires in it. Emulated as two segments that split the stage's backward FLOPs and bytes
(``_input_share``: half each, none for the input half of a stage receiving no gradient-carrying
value, all of it without parameters). Which stages split is the planner's one rule
(:func:`planner.schedule.program.splits_backward`): not tensor-parallel stages, synchronised
BatchNorm, ZeRO stages (FSDP2's and the ragged sync's hooks gather and reduce in the backward and
sit on the input path, so they would fire in the input half) or recomputing stages; those run
their whole backward where the input half would be.

Tensor parallel stages (``split``, alone or inside ``replicate``): the workers of one slot
(replica, stage, ``dp_index``) form a tensor-parallel group that processes the same samples; the
stage's Linears are swapped for uneven parallel ones (:class:`runtime.tensor.shard_pass.StageSharding`)
and, on the last stage, a class-sharded classifier feeds the sharded cross-entropy. Boundary values
and their gradients are full on every member, so any member may send them (the resharding plan
picks, balancing sender hosts) and every member receives them; only ``tp_index`` 0 adds to the
reported loss, and the replica sync keeps each shard in step over the workers holding the same
shard. Emulation pads such a stage matmul by matmul (segments must not span the
tensor-parallel collectives); its other operators run unpadded.

Tied parameters (one ``nn.Parameter`` used by several stages, GPT-2's embedding and head): after the
backward and DDP's all-reduce, :class:`runtime.parallel.tied_weights.TiedParameters` sums the stages' gradients over
every rank holding a copy, so the copies stay identical (see that module).

BatchNorm: by default each worker normalises with its own samples' statistics (DDP's behaviour,
which the planner warns about); with ``Plan.sync_batchnorm`` the stage's BatchNorms take them over
its data-parallel group (:mod:`runtime.parallel.sync_batchnorm`). Those syncs are collectives inside the forward
and backward, so under emulation they fall inside the stage's compute segments.

Re-planned shares (:meth:`PipelineExecutor.set_plan`): a plan that differs only in micro-batch
sizes and counts (:func:`in_place_differences`, the one rule, a pure function of the two plans so
every rank takes the same path) is adopted in place: the sample ranges, the action list, the
boundary layout (which resharding each crossing runs; programs already compiled for a layout are
kept) and the stage worker's figures are derived again, and the stage module, its sharding,
replica sync, tied groups and the optimizer's parameters stay. Why not a new executor, as for
moved layers: it moves no tensor, yet splitting the graph, analysing and sharding the split stages,
wrapping the sync and planning the boundaries again cost a transformer pipeline seconds
(BENCHMARKS.md, ``pipeline_shares``).

Model outputs computed before the last stage (an encoder-decoder's encoder output): the split
routes them (:func:`whalelike.graphs.output_tree.route_outputs`, the rule the plan checks apply):
sent on to the last stage where the loss reads them, left out (None) where it does not.

Values without a batch dimension (a statistic of the micro-batch) cross whole, once per
micro-batch: the producing stage's owner slot sends its value, the consumers' gradients come back
summed (:mod:`runtime.parallel.boundaries`); values computed from constants, parameters and
shapes alone never cross (capture recomputes them where they are used).

Limits (each a clear error): values crossing stages must be tensors, batched along dimension 0 or
without a batch dimension; model inputs and targets are tensors batched along dimension 0;
``split`` shards projections (``nn.Linear``, GPT-2's ``Conv1D``) and the attention between them,
nothing else (:mod:`runtime.tensor.shard_pass`).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from planner.devices.network import NetworkModel
from planner.plan import Plan, PlanError
from planner.plan_checks import check_same_workers
from planner.schedule.actions import Action, gradient_accumulation
from planner.schedule.deadlock import proven_program
from planner.schedule.program import forward_program, split_flags
from planner.shares.layout import SampleLayout, check_global_batch
from runtime.emulation.compute import Emulator
from runtime.parallel.executor import StepExecutor
from runtime.parallel.boundaries import BoundaryExchange
from runtime.replicas.held_state import NamedState
from runtime.parallel.stage_split import ModelInput, PipelineSplit, ValueId, ValueSpec, split_stages
from runtime.parallel.stage_worker import StageWorker
from runtime.tensor.shard_pass import StageSharding, outputs_leaving_sharded
from runtime.training.precision import PlanLossScaler

log = logging.getLogger(__name__)


class PipelineError(RuntimeError):
    """A pipeline step failed; the message names rank, stage, schedule step and micro-batch."""


# What a pipeline executor is built from, besides its workers (planner.plan_checks.check_same_workers):
# a plan that changes any of these needs a new executor; one that changes only the workers'
# micro-batch sizes, the micro-batch count and what is priced or recorded about them (predictions,
# timings, memory figures, transfer times, the solver, the reasons for a choice) is adopted in place.
FIXED_PLAN_FIELDS = ("model_fingerprint", "global_batch_size", "schedule", "sync_batchnorm", "resharding",
                     "delay_weight_gradients", "precision")
FIXED_STAGE_FIELDS = ("index", "taskgraphs", "layers", "strategy", "shard_sizes", "batchnorm", "replica_sync",
                      "zero_stage", "state_fractions", "recompute", "recompute_unit")
FIXED_BOUNDARY_FIELDS = ("src_stage", "dst_stage", "tensors")


def in_place_differences(old: Plan, new: Plan) -> list[str]:
    """What ``new`` changes, beyond micro-batch sizes and counts, in what an executor of ``old`` was
    built from (each as ``field is X in the new plan, Y in the running one``); empty when ``new``
    can be adopted in place (:meth:`PipelineExecutor.set_plan`). A pure function of the two plans:
    every rank decides alike, so all adopt in place or all build anew."""
    try:
        check_same_workers(old, new, "the workers")
    except PlanError as e:
        return [str(e)]
    out = [f"{name} is {getattr(new, name)!r} in the new plan, {getattr(old, name)!r} in the running one"
           for name in FIXED_PLAN_FIELDS if getattr(old, name) != getattr(new, name)]
    for a, b in zip(old.stages, new.stages):
        out += [f"stages[{a.index}].{name} is {getattr(b, name)!r} in the new plan, {getattr(a, name)!r} in the "
                "running one" for name in FIXED_STAGE_FIELDS if getattr(a, name) != getattr(b, name)]
    before, after = _boundary_structure(old), _boundary_structure(new)
    if before != after:
        out.append(f"the boundaries (source, destination, tensors) are {after} in the new plan, {before} in the "
                   "running one")
    return out


def _boundary_structure(plan: Plan) -> list[tuple]:
    return [tuple(getattr(b, name) for name in FIXED_BOUNDARY_FIELDS) for b in plan.boundaries]


def idle_state_of(graphs, plan: Plan, model: nn.Module) -> dict[int, dict[str, torch.Tensor]]:
    """Stage index -> name -> tensor of ``model``'s parameters and buffers that the captured forward
    never reads and that the stage holds: those of its layers (``Layer.idle_state``), so the stage
    holding the layer they were given to keeps them."""
    state = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}
    out = {}
    for stage in plan.stages:
        names = [n for i in stage.layers for n in graphs.layers[i].idle_state]
        missing = [n for n in names if n not in state]
        if missing:
            raise PipelineError(f"the capture names {missing} as state the forward never reads, but the model has no "
                                "parameter or buffer of that name; capture the model this executor runs")
        out[stage.index] = {n: state[n] for n in names}
    return out


def sample_ranges(plan: Plan) -> dict[int, list[tuple[int, int]]]:
    """Rank -> per micro-batch, the global ``[start, stop)`` of the samples it processes
    (:meth:`planner.shares.layout.SampleLayout.all_ranges`, the one owner of the layout)."""
    return SampleLayout.of(plan).all_ranges()


class PipelineExecutor(StepExecutor):
    """Runs this rank's stage of a multi-stage Plan, a :class:`runtime.parallel.executor.StepExecutor`.

    ``graph_module``/``node_stage``: the captured model and each node's stage (see
    :func:`runtime.parallel.stage_split.node_stages_from_plan`). ``stage_flops``: per stage, forward and
    backward FLOPs per sample, for the emulator (:func:`runtime.parallel.stage_split.stage_flops_from_plan`);
    ``stage_memory_bytes``: the same for the bytes of the stages' non-matmul operators, which the
    emulator prices at the device's memory bandwidth
    (:func:`runtime.parallel.stage_split.stage_memory_bytes_from_plan`; default none).
    ``group``: the processes running the plan (default: the whole world); plan rank ``r`` is rank
    ``r`` of ``group``. ``dp_group``: the process group of every worker of this rank's stage in
    every replica (``runtime.groups.build_groups(...).dp.group``), needed when there are several.
    ``idle_state``: stage index -> the model's name -> tensor of the state the forward never reads
    that the stage holds (:func:`idle_state_of`; default none). ``device``: where this rank computes
    (the stage's replica sync gives its part of the stage storage there; default: where it is).
    ``names``: the module whose parameter and buffer names :meth:`full_state_dict` uses (default
    ``graph_module``; pass the user's model if the capture renamed them). It must share its
    tensors with ``graph_module``, as :func:`whalelike.graphs.capture` does. ``network``: the link
    figures the boundary reshardings are planned with (the Engine passes the cluster's; on an
    emulated network the emulator's; default :func:`runtime.parallel.boundaries.default_network`).
    """

    def __init__(
        self,
        graph_module: fx.GraphModule,
        node_stage: dict[str, int],
        plan: Plan,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
        *,
        emulator: Optional[Emulator] = None,
        stage_flops: Optional[Sequence[tuple[float, float]]] = None,
        stage_memory_bytes: Optional[Sequence[tuple[float, float]]] = None,
        group: Optional[dist.ProcessGroup] = None,
        dp_group: Optional[dist.ProcessGroup] = None,
        names: Optional[nn.Module] = None,
        sharding: Optional[StageSharding] = None,
        network: Optional[NetworkModel] = None,
        scaler: Optional[PlanLossScaler] = None,
        reduce_dtype: Optional[torch.dtype] = None,
        idle_state: Optional[Mapping[int, Mapping[str, torch.Tensor]]] = None,
        device: Optional[torch.device] = None,
    ):
        plan.validate()
        self.plan = plan
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        if plan.world_size != dist.get_world_size(self.group):
            raise PipelineError(f"the plan has {plan.world_size} workers, the process group has "
                                f"{dist.get_world_size(self.group)} ranks; launch one process per plan worker")
        self.worker = plan.worker(self.rank)
        # model outputs of earlier stages: sent on to the last stage, or left out where the loss does not read them
        self.split: PipelineSplit = split_stages(graph_module, node_stage, loss_fn=loss_fn)
        if self.split.num_stages != len(plan.stages):
            raise PipelineError(f"node_stage defines {self.split.num_stages} stages, the plan has {len(plan.stages)}")
        self.stage = self.split.stages[self.worker.stage]
        self.is_last = self.stage.index == self.split.num_stages - 1
        self.emulator = emulator or Emulator.disabled()
        # the program's peers: the stages this one receives values from and sends them to, as the
        # split has them (a skip connection's value goes straight to its consumer; the plan's
        # boundaries are the chain, which the planner prices it across)
        self._edges = tuple(sorted({(v.stage, c) for st in self.split.stages for v in st.outputs
                                    for c in self.split.consumers(v)}))
        self._producers = [src for src, dst in self._edges if dst == self.stage.index]
        self._consumers = [dst for src, dst in self._edges if src == self.stage.index]
        # what depends on the micro-batch sizes (derived again by set_plan)
        self._all_ranges, self.schedule = self._sizes(plan)
        self._ranges = self._all_ranges[self.rank]
        # before sharding (from the unsharded graphs): every rank derives the same boundary layouts
        feature_shards = self._outputs_leaving_sharded(sharding, graph_module)
        # what this rank runs of its stage: module, sharding, replica sync, tied weights, BatchNorm sync
        self.stage_worker = StageWorker(
            self.split, plan, self.rank, self.group, graph_module, names if names is not None else graph_module,
            loss_fn, emulator=self.emulator,
            flops=stage_flops[self.stage.index] if stage_flops is not None else (0.0, 0.0),
            sharding=sharding, dp_group=dp_group, feature_shards=feature_shards,
            micro_batches={r: len(ranges) for r, ranges in self._all_ranges.items()}, scaler=scaler,
            reduce_dtype=reduce_dtype, device=device,
            memory_bytes=stage_memory_bytes[self.stage.index] if stage_memory_bytes is not None else (0.0, 0.0),
            idle=(idle_state or {}).get(self.stage.index))
        # every value and gradient crossing a stage boundary is a planned resharding (runtime.parallel.boundaries)
        self.boundaries = BoundaryExchange(plan, self.split, self.rank, self.group, network, self.emulator.network,
                                           feature_shards=feature_shards)
        self._specs: dict[tuple, dict[ValueId, ValueSpec]] = {}
        # the Engine's runtime.control.exchange.Passenger: summed in this step's loss all-reduce
        self.passenger = None
        log.info("rank %d: pipeline stage %d of %d (replica %d, dp_index %d, tp_index %d of %d), samples per "
                 "micro-batch %s, schedule %s: %s", self.rank, self.stage.index, self.split.num_stages,
                 self.worker.replica, self.worker.dp_index, self.worker.tp_index, self.worker.tp_size,
                 self.worker.micro_batch_sizes, plan.schedule,
                 " ".join(map(str, self.schedule)))

    # -- the step-executor protocol ---------------------------------------------------------------
    def parameters(self) -> Iterator[nn.Parameter]:
        return self.stage_worker.parameters()

    @property
    def module(self) -> nn.Module:
        """What this rank runs: its stage module, sharded as planned."""
        return self.stage.module

    @property
    def micro_batch_sizes(self) -> list[int]:
        """This rank's micro-batch sizes under the plan in force."""
        return self.worker.micro_batch_sizes

    def syncs(self) -> list:
        return [self.stage_worker.sync]

    def takes_in_place(self, plan: Plan) -> bool:
        """Whether :meth:`set_plan` can adopt ``plan``: it differs from the plan in force only in
        micro-batch sizes and counts (:func:`in_place_differences`, a pure function of the two
        plans, so every rank answers alike)."""
        return not in_place_differences(self.plan, plan)

    def set_plan(self, plan: Plan) -> None:
        """Adopt ``plan`` from the next step on, in place: a plan of the same workers, stages,
        layers, shard sizes, replica syncs (ZeRO stages and fractions), schedule and boundary values
        whose micro-batch sizes (and counts) differ, as a shares-only re-plan makes it
        (:func:`planner.balance.replan.rebalance`). The sample ranges, the action list, the stage
        worker's figures (loss weights, the BatchNorm sync's equal counts) and which resharding each
        crossing runs are derived again; the stage module, its sharding, replica sync, tied groups
        and the optimizer's parameters are kept, so nothing moves and no collective runs. Every rank
        must adopt the same plan at the same step boundary. Raises :class:`planner.plan.PlanError`
        naming what else differs (that needs a new executor and moves state: Engine.apply_plan)."""
        differences = in_place_differences(self.plan, plan)
        if differences:
            raise PlanError(f"PipelineExecutor.set_plan: {'; '.join(differences)}; only micro-batch sizes and counts "
                            "change in place: build a new executor for this plan (Engine.apply_plan does it, moving "
                            "the state that changes hands)")
        plan.validate()
        all_ranges, schedule = self._sizes(plan)
        # checked first (the BatchNorm sync's equal counts), so a refused plan leaves this executor as it was
        self.stage_worker.set_plan(plan, {r: len(ranges) for r, ranges in all_ranges.items()})
        self.boundaries.set_plan(plan)
        old = self.worker.micro_batch_sizes
        self.plan, self.worker = plan, plan.worker(self.rank)
        self._all_ranges, self._ranges, self.schedule = all_ranges, all_ranges[self.rank], schedule
        log.info("rank %d: pipeline stage %d samples per micro-batch %s -> %s in place, schedule %s: %s", self.rank,
                 self.stage.index, old, self.worker.micro_batch_sizes, plan.schedule, " ".join(map(str, schedule)))

    def train_step(self, inputs: tuple, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of every micro-batch of the global batch under the plan's schedule;
        adds the global-mean gradient to this stage's ``.grad`` (synchronised over the stage's
        data-parallel group) and returns the global-mean loss, the same on every rank."""
        loss = self._run(self.schedule, inputs, targets, train=True)
        self.stage_worker.finish_step()
        return loss

    @torch.no_grad()
    def eval_step(self, inputs: tuple, targets: torch.Tensor) -> torch.Tensor:
        """The global-mean loss of a global batch: the forwards of the schedule, in order, with the
        stage in eval mode (BatchNorm uses its running statistics, dropout is off)."""
        forwards = forward_program(tuple(self._producers), tuple(self._consumers), len(self._ranges))
        was_training = self.stage.module.training
        self.stage.module.eval()
        try:
            return self._run(forwards, inputs, targets, train=False)
        finally:
            self.stage.module.train(was_training)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters and buffers, on every rank (a collective over the plan's ranks)."""
        return self.stage_worker.full_state_dict()

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy this stage's parameters and buffers (its shards of them) out of a full state dict."""
        self.stage_worker.load_full_state_dict(state)

    def named_state(self) -> NamedState:
        """This stage's state under the model's names, with the part of each this rank holds."""
        return self.stage_worker.named_state()

    def close(self) -> None:
        """Leave no hook behind, so an executor of another plan can take the parameters over; this
        one is not used again."""
        self.stage_worker.close()

    # -- one pass over a program -------------------------------------------------------------------
    def _run(self, actions: Sequence[Action], inputs, targets: torch.Tensor, train: bool) -> torch.Tensor:
        """Run this stage's program (:mod:`planner.schedule.program`): each action as it comes, the
        transfers included; receives block, sends are posted and waited at the end of the step."""
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        for i, x in enumerate((*inputs, targets)):
            check_global_batch(self.plan, x.shape[0], f"rank {self.rank}", "targets" if i == len(inputs) else f"input {i}")
        specs = self._value_specs(inputs)
        state = _StepState(self.stage_worker.device, self.stage_worker.loss_dtype)
        weights_at = max((i for i, a in enumerate(actions) if a.kind in ("B", "BW")), default=-1)
        for step, action in enumerate(actions):
            m, kind = action.micro_batch, action.kind
            try:
                if kind == "RECV_F":
                    self._receive_values(m, action.peer, specs, state, train)
                elif kind == "F":
                    self._forward(m, inputs, targets, specs, state, train)
                elif kind == "SEND_F":
                    self._send_values(m, action.peer, specs, state)
                elif kind == "RECV_B":
                    self._receive_grads(m, action.peer, specs, state)
                elif kind == "B":
                    self._backward(m, specs, state, last=step == weights_at)
                elif kind == "BI":
                    self._backward_input(m, specs, state)
                elif kind == "SEND_B":
                    self._send_input_grads(m, action.peer, specs, state)
                else:   # BW
                    self._backward_weight(m, specs, state, last=step == weights_at)
            except Exception as e:
                raise PipelineError(
                    f"rank {self.rank}, stage {self.stage.index}, schedule step {step} ({action}), "
                    f"micro-batch {m}: {type(e).__name__}: {e}") from e
        for posted in state.sends:
            posted.wait()
        passenger, self.passenger = (self.passenger, None) if train else (None, self.passenger)
        if passenger is None:
            dist.all_reduce(state.loss, group=self.group)
            return state.loss
        # the Engine's passenger (the straggler monitor's figures) rides in the loss all-reduce,
        # written now that every compute segment of the step is done
        carrier, fill = passenger.load(state.loss)
        fill(carrier)
        dist.all_reduce(carrier, group=self.group)
        return passenger.unload(carrier)

    def _receive_values(self, m: int, peer: int, specs, state: "_StepState", train: bool) -> None:
        """``RECV_F m <- peer``: this rank's rows of every value stage ``peer`` sends this stage for
        micro-batch ``m`` (blocks until they are here; forwarding inside the stage group posted)."""
        n = self._samples(m)
        received = state.received.setdefault(m, {})
        for crossing in self.boundaries.crossings(self.stage.index, m, "F", "destination", peer):
            v = crossing.value
            buffer = self._buffer(crossing, specs[v], n)
            state.sends.append(self.boundaries.receive(crossing, buffer, specs))
            received[v] = buffer if specs[v].batched else buffer[0]   # a value without a batch dimension: whole
            received[v].requires_grad_(train and specs[v].requires_grad)

    def _forward(self, m: int, inputs: tuple, targets, specs, state: "_StepState", train: bool) -> None:
        start, stop = self._ranges[m]
        n = stop - start
        received = state.received.pop(m, {})
        args = [inputs[src.index][start:stop] if isinstance(src, ModelInput) else received[src]
                for src in self.stage.inputs]
        outputs, reported = self.stage_worker.forward(args, n, targets[start:stop] if self.is_last else None)
        if reported is not None:
            state.loss += reported
        if train:
            state.saved[m] = (received, outputs)
        if self._consumers:
            state.outgoing[m] = (outputs, len(self._consumers))

    def _send_values(self, m: int, peer: int, specs, state: "_StepState") -> None:
        """``SEND_F m -> peer``: post this rank's sends of the values stage ``peer`` consumes."""
        outputs, left = state.outgoing[m]
        for crossing in self.boundaries.crossings(self.stage.index, m, "F", "source", peer):
            state.sends.append(self.boundaries.send(crossing, outputs[crossing.value], specs))
        if left == 1:
            del state.outgoing[m]
        else:
            state.outgoing[m] = (outputs, left - 1)

    def _roots(self, m: int, state: "_StepState") -> tuple[dict, list, list]:
        """Micro-batch ``m``'s received values, and the roots and gradients of its backward: the
        weighted loss on the last stage, else the outputs that carry a received gradient."""
        received, outputs = state.saved.pop(m)
        if self.is_last:
            return received, [outputs[None]], [None]
        incoming = state.grads.pop(m, {})
        roots = [outputs[v] for v in incoming if outputs[v].requires_grad]
        grads = [incoming[v] for v in incoming if outputs[v].requires_grad]
        return received, roots, grads

    def _backward(self, m: int, specs, state: "_StepState", last: bool) -> None:
        """``B m``: the whole backward; its input gradients wait for ``SEND_B``."""
        received, roots, grads = self._roots(m, state)
        input_grads = self.stage_worker.backward(roots, grads, self._samples(m), last=last, received=received)
        self._keep_input_grads(m, input_grads, received, state)

    def _backward_input(self, m: int, specs, state: "_StepState") -> None:
        """``BI m``: the input half; the weight half waits for ``BW m`` with the micro-batch's roots."""
        received, roots, grads = self._roots(m, state)
        input_grads, weights = self.stage_worker.backward_input(roots, grads, self._samples(m), received=received,
                                                                input_share=self._input_share(specs))
        state.weights[m] = (weights, roots)
        self._keep_input_grads(m, input_grads, received, state)

    def _backward_weight(self, m: int, specs, state: "_StepState", last: bool) -> None:
        """``BW m``: the weight half of micro-batch ``m``'s backward."""
        weights, roots = state.weights.pop(m)
        self.stage_worker.backward_weight(weights, roots, self._samples(m), last=last,
                                          input_share=self._input_share(specs))

    def _keep_input_grads(self, m: int, input_grads: dict, received: dict, state: "_StepState") -> None:
        if self._producers:
            state.input_grads[m] = (input_grads, received, len(self._producers))

    def _input_share(self, specs) -> float:
        """The input half's share of the stage's backward FLOPs: none without received values that
        carry gradients (the first stage), all without parameters, else half: a Linear's dX and dW
        are matmuls of the same size (2 * samples * fan_in * fan_out FLOPs each), and parameter-free
        operators (activations, attention's matmuls) are small or, for attention, only on the input
        side, so half slightly under-states the input half of attention stages."""
        if not any(specs[v].requires_grad for v in self.stage.received):
            return 0.0
        if not self.stage_worker.has_parameters():
            return 1.0
        return 0.5

    def _send_input_grads(self, m: int, peer: int, specs, state: "_StepState") -> None:
        """``SEND_B m -> peer``: post the sends of the gradients of the values received from stage
        ``peer`` (zeros where one got none)."""
        input_grads, received, left = state.input_grads[m]
        for crossing in self.boundaries.crossings(self.stage.index, m, "B", "source", peer):
            if specs[crossing.value].requires_grad:
                grad = input_grads[crossing.value]
                grad = grad if grad is not None else torch.zeros_like(received[crossing.value])
                state.sends.append(self.boundaries.send(crossing, grad, specs))
        if left == 1:
            del state.input_grads[m]
        else:
            state.input_grads[m] = (input_grads, received, left - 1)

    # -- communication ----------------------------------------------------------------------------
    def _receive_grads(self, m: int, peer: int, specs, state: "_StepState") -> None:
        """``RECV_B m <- peer``: the gradient of each sent value that stage ``peer`` consumes and
        that carries one, added to what other consumers sent (each covers all of this rank's
        samples once; ascending consumer order, as the program receives them). A value without a
        batch dimension comes back as one gradient per consuming slot, summed in order (none on a
        slot other than the owner, :func:`planner.resharding.spec.unbatched_rows`: a zero gradient)."""
        n = self._samples(m)
        total = state.grads.setdefault(m, {})
        for crossing in self.boundaries.crossings(self.stage.index, m, "B", "destination", peer):
            v = crossing.value
            if specs[v].requires_grad:
                grad = self._buffer(crossing, specs[v], n)
                state.sends.append(self.boundaries.receive(crossing, grad, specs))
                grad = grad if specs[v].batched else grad.sum(0)
                total[v] = grad if v not in total else total[v] + grad

    def _samples(self, m: int) -> int:
        start, stop = self._ranges[m]
        return stop - start

    def _buffer(self, crossing, spec: ValueSpec, n: int) -> torch.Tensor:
        """Room for this rank's rows of ``crossing`` (``n`` samples of a batched value or its
        gradient; a value without a batch dimension stacked, :meth:`BoundaryExchange.rows`) as this
        rank holds them: whole, or its features of a value that leaves this stage sharded."""
        shape = self.boundaries.local_shape(crossing.value, spec, self.stage.index, self.worker.tp_index)
        rows = self.boundaries.rows(crossing, spec, n)
        return torch.empty((rows, *shape), dtype=spec.dtype, device=self.stage_worker.device)

    # -- set-up -----------------------------------------------------------------------------------
    def _sizes(self, plan: Plan) -> tuple[dict[int, list[tuple[int, int]]], Sequence[Action]]:
        """What ``plan``'s micro-batch sizes decide: every rank's sample ranges and this stage's
        program (:func:`planner.schedule.deadlock.proven_program`: the plan's schedule lowered onto
        the stages' crossings, each stage split as :func:`planner.schedule.program.splits_backward`
        says, proven deadlock-free in this process before any action runs; the simulator runs the
        same lowering on the plan's boundaries; one stage alone accumulates gradients micro-batch by
        micro-batch)."""
        all_ranges = sample_ranges(plan)
        if len(plan.stages) == 1:
            return all_ranges, gradient_accumulation(len(all_ranges[self.rank]))
        programs = proven_program(plan.schedule, len(plan.stages), plan.num_micro_batch, self._edges, split_flags(plan))
        return all_ranges, programs[self.stage.index]

    def _outputs_leaving_sharded(self, sharding: Optional[StageSharding], graph_module: fx.GraphModule) -> dict:
        """Every tensor-parallel stage's outputs that leave as feature shards, without a gather
        (:func:`runtime.tensor.shard_pass.outputs_leaving_sharded`), computed on every rank."""
        tp_stages = [s for s in range(len(self.plan.stages)) if self.plan.stage_workers(s)[0].tp_size > 1]
        if not tp_stages or len(self.plan.stages) == 1:
            return {}
        if sharding is None:
            raise PipelineError(f"rank {self.rank}: stages {tp_stages} are tensor parallel and their boundary layouts "
                                "depend on their sharding; pass sharding=StageSharding.from_graphs(graphs, tp_group)")
        leaving = {}
        for s in tp_stages:
            stage = self.split.stages[s]
            crossing = [v for v in stage.outputs if self.split.consumers(v)]   # not the model's output
            leaving.update(outputs_leaving_sharded(stage.module, crossing, graph_module, sharding.node_taskgraph,
                                                   sharding.split_taskgraphs, self.plan.stages[s].shard_sizes,
                                                   analysis=sharding.analysis(stage.module)))
        return leaving

    def _value_specs(self, inputs: tuple) -> dict[ValueId, ValueSpec]:
        key = tuple((tuple(x.shape[1:]), x.dtype) for x in inputs)
        if key not in self._specs:
            self._specs[key] = self.split.value_specs(inputs)
        return self._specs[key]


class _StepState:
    """What one step keeps between actions, per micro-batch: the values received for its forward,
    its activations until its backward, its outputs until the last of their sends, the gradients
    received for its backward, its input gradients until the last of their sends, the weight half
    of a split backward until it runs; and the posted sends, the loss."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.loss = torch.zeros((), device=device, dtype=dtype)
        self.received: dict[int, dict] = {}
        self.saved: dict[int, tuple] = {}
        self.outgoing: dict[int, tuple] = {}
        self.grads: dict[int, dict] = {}
        self.input_grads: dict[int, tuple] = {}
        self.weights: dict[int, tuple] = {}
        self.sends: list = []   # runtime.parallel.resharding.Posted: sends (and forwarded ranges) to wait for
