"""One rank's part of one pipeline stage: its module and everything that keeps it in step with its peers.

The pipeline executor (:mod:`runtime.parallel.pipeline`) owns what is about the *pipeline*: the
schedule, the micro-batches and their samples, the boundaries between stage groups, the step's
loss. A :class:`StageWorker` owns what is about *this stage on this rank*, so each concern has one
room and each analysis runs once, here, at construction:

* its module, cut from the captured graph (:mod:`runtime.parallel.stage_split`), with the model's
  names of its state (taken before sharding, which keeps keys but replaces tensors), and the
  state the forward never reads that its layers hold (``Layer.idle_state``: attached to the
  stage module, so it is held, named, checkpointed and moved like the rest, never trained or synced);
* its tensor-parallel sharding (:mod:`runtime.tensor.shard_pass`; the group's collectives are
  priced there when the network is emulated) and, on the last stage, the sharded loss;
* its replica sync over the workers holding the same parameters
  (:mod:`runtime.replicas.replica_sync`: DDP, FSDP2's ZeRO 1-3 with the stage cut into one unit per
  layer by :mod:`runtime.parallel.stage_units`, ragged shards, P-Reduce), tied parameters shared with other stages
  (:mod:`runtime.parallel.tied_weights`) and BatchNorm statistics over its data-parallel group
  (:mod:`runtime.parallel.sync_batchnorm`);
* its compute segments for the emulator: one per forward and backward of a micro-batch, with the
  stage's FLOPs and non-matmul bytes per sample times its samples, or, on a tensor-parallel stage,
  none here (its layers pad matmul by matmul, since a stage-wide segment would span their
  collectives; those matmul segments move no non-matmul bytes);
* its backward, whole or in its two halves, the input gradients and the weight gradients, as two
  actions of the stage's program (ZB-H1, delayed weight gradients; :mod:`runtime.parallel.split_backward`,
  :mod:`planner.schedule.program`).

Invariant: every collective a stage worker runs (the sync, the tensor-parallel ones, tied sums,
BatchNorm syncs) is over groups built from the plan in one order on every rank
(:mod:`runtime.groups`), and each worker of a group calls them in the same order because every
worker of a stage runs the same action list.
"""
from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from planner.plan import Plan
from runtime.emulation.compute import Emulator
from runtime.replicas.held_state import NamedState
from runtime.replicas.replica_sync import ReplicaSync, build_replica_sync
from planner.schedule.program import splits_backward
from runtime.parallel.split_backward import WeightGradients, backward_inputs
from runtime.parallel import stage_units
from runtime.parallel.stage_split import PipelineSplit
from runtime.parallel.sync_batchnorm import check_equal_micro_batches, synchronise_batchnorm
from runtime.parallel.tied_weights import TiedParameters
from runtime.training import recompute
from runtime.replicas.held_state import full_tensor, is_sharded, load_rows
from runtime.tensor.shard_pass import (StageSharding, full_state_dict, keep_outputs_sharded, load_full_state_dict,
                                      tensor_parallel_slices)
from runtime.tensor.sharded_loss import OutputLayout
from runtime.training.precision import PlanLossScaler, weighted_loss

log = logging.getLogger(__name__)


class StageError(RuntimeError):
    """A stage cannot be set up on this rank; the message names the rank, the stage and the fix."""


IDLE_PREFIX = "idle__"    # the stage module's attribute of a tensor the forward never reads: idle__<its path, __ for .>


def attach_idle_state(stage: nn.Module, idle: Mapping[str, torch.Tensor]) -> list[nn.Parameter]:
    """Register on ``stage`` each tensor of ``idle`` (the model's name -> a parameter or buffer the
    captured forward never reads, ``Layer.idle_state``), the same tensor, so this stage holds it and
    its state dict, checkpoints and state moves carry it under the model's name. Returns the
    parameters among them (no sync reduces them)."""
    params = []
    for name, tensor in idle.items():
        attr = IDLE_PREFIX + name.replace(".", "__")
        if hasattr(stage, attr):
            continue
        if isinstance(tensor, nn.Parameter):
            stage.register_parameter(attr, tensor)
            params.append(tensor)
        else:
            stage.register_buffer(attr, tensor)
    return params


class StageWorker:
    """This rank's worker of stage ``plan.worker(rank).stage`` (see the module docstring).

    ``split``: the captured model cut into stages; ``names``: the module whose parameter and buffer
    names the state uses (shares its tensors with ``graph_module``); ``feature_shards``: the
    boundary values that leave their (tensor-parallel) stage as feature shards, from the unsharded
    graphs; ``dp_group``: every worker of this stage in every replica; ``micro_batches``: rank ->
    its number of micro-batches (the BatchNorm sync needs equal counts). ``flops`` and
    ``memory_bytes``: the stage's (forward, backward) FLOPs and non-matmul bytes per sample, for
    the emulator (:func:`runtime.parallel.stage_split.stage_flops_from_plan`,
    :func:`~runtime.parallel.stage_split.stage_memory_bytes_from_plan`). ``idle``: the model's
    name -> tensor of each parameter and buffer the forward never reads that this stage holds
    (``Layer.idle_state`` of its layers; the user's model's tensors: the graph module may not
    hold them).
    """

    def __init__(self, split: PipelineSplit, plan: Plan, rank: int, group: dist.ProcessGroup,
                 graph_module: fx.GraphModule, names: nn.Module, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
                 *, emulator: Emulator, flops: tuple[float, float], sharding: Optional[StageSharding],
                 dp_group: Optional[dist.ProcessGroup], feature_shards: dict, micro_batches: dict[int, int],
                 scaler: Optional[PlanLossScaler] = None, reduce_dtype: Optional[torch.dtype] = None,
                 memory_bytes: tuple[float, float] = (0.0, 0.0), idle: Optional[Mapping[str, torch.Tensor]] = None,
                 device: Optional[torch.device] = None):
        self.plan, self.rank, self.group, self.split = plan, rank, group, split
        self._device = device
        self.scaler = scaler   # fp16's loss scale (runtime.training.precision), None otherwise
        self.reduce_dtype = reduce_dtype   # the dtype the replica sync reduces gradients in (None: their own)
        self.worker = plan.worker(rank)
        self.stage = split.stages[self.worker.stage]
        self.is_last = self.stage.index == split.num_stages - 1
        self.emulator, self.flops, self.memory_bytes = emulator, flops, memory_bytes
        self.idle = dict(idle or {})
        self.idle_params = attach_idle_state(self.stage.module, self.idle)
        self._state_names = self._model_names(names)
        # before sharding: creates the tied parameters' groups and makes their copies equal
        self.tied = TiedParameters(split, plan, rank, group, names)
        # the reported loss has the model's dtype; every rank must agree on it for the all-reduce
        self.loss_dtype = next((p.dtype for p in graph_module.parameters() if p.is_floating_point()),
                               torch.get_default_dtype())
        # a tensor-parallel stage is emulated per parallel Linear (runtime.tensor.layers)
        self.segments_per_stage = self.worker.tp_size == 1
        self.loss_fn = loss_fn if self.segments_per_stage else self._shard(sharding, graph_module, loss_fn)
        keep_outputs_sharded(self.stage.module, [v for v in feature_shards if v.stage == self.stage.index])
        self.tied.attach(self.stage.module)
        # under ZeRO, weights tied to another stage stay whole (the tied sum adds whole gradients
        # across stages, whose ZeRO layouts differ): this worker sums their gradients over its
        # data-parallel group itself, before the tied sum (finish_step)
        self.zero = plan.stages[self.stage.index].zero_stage
        self.kept_whole = ([p for tie, copies in self.tied.held() if len(tie.stages) > 1
                            for _, p in copies] if self.zero else [])
        peers = [w for w in plan.stage_workers(self.stage.index) if w.tp_index == self.worker.tp_index]
        self._peers = [w.rank for w in peers]
        if plan.sync_batchnorm:
            self._synchronise_batchnorm(peers, dp_group, micro_batches)
        # under even ZeRO shards (FSDP2) the stage is cut into one module per layer, each an FSDP
        # unit of its own (runtime.parallel.stage_units: one layer gathered at a time); the tensors
        # stay, the stage's own keys change, so the names are derived again
        self.units = self._cut_into_units(peers, names)
        # activation checkpointing (runtime.training.recompute) of the stage module as sharded and
        # rewritten above, one layer at a time (or whole, as the plan says), inside the replica
        # sync's wrapper (and inside each ZeRO unit); the emulated backward runs the forward again
        self.recomputes = plan.stages[self.stage.index].recompute
        if self.recomputes:
            recompute.wrap_stage(self.stage.module, plan.stages[self.stage.index].recompute_unit,
                                 layer_names=self.units or None)
            self.flops = (flops[0], flops[1] + flops[0])
            self.memory_bytes = (memory_bytes[0], memory_bytes[1] + memory_bytes[0])
        self.sync: ReplicaSync = self._replica_sync(peers, dp_group)

    # -- compute ----------------------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        """What forwards run through (the replica sync's wrapper, if it has one)."""
        return self.sync.module

    def forward(self, args: list, n: int, targets: Optional[torch.Tensor]) -> tuple[dict, Optional[torch.Tensor]]:
        """The stage's outputs on ``n`` samples (one compute segment); on the last stage, the loss
        weighted by ``n / global_batch_size`` under the key ``None``, and what this worker adds to
        the reported loss (the members of a tensor-parallel group share one)."""
        with self._segment(self.flops[0] * n, n, self.memory_bytes[0] * n):
            with self.sync.no_sync():
                outputs = self.stage.unpack(self.module(*args))
            if not self.is_last:
                return outputs, None
            prediction = self.split.model_output(outputs)
            loss = weighted_loss(self.loss_fn(prediction, targets), n, self.plan.global_batch_size, self.scaler)
        return {None: loss}, loss.detach() if self.worker.tp_index == 0 else None

    def backward(self, roots: list, grads: list, n: int, *, last: bool, received: dict) -> dict:
        """The whole backward of one micro-batch (one compute segment) from ``roots`` (outputs) with
        ``grads``; returns the ``received`` values' gradients (``{value: gradient or None}``).
        ``last``: the step's last action computing weight gradients, which the replica sync arms
        (forwards ran under ``no_sync``)."""
        arm = self.sync.syncs and last
        if arm:
            self.sync.arm(roots)
        if self.segments_per_stage:
            self.emulator.begin(self.flops[1] * n, n, memory_bytes=self.memory_bytes[1] * n)
        if arm:
            torch.autograd.backward(roots, grads)
        elif roots:
            with self.sync.no_sync():
                torch.autograd.backward(roots, grads)
        self.emulator.wait_deadline()   # no-op if the sync's hook already waited
        self.emulator.wait_communication()   # the overlapped gradient sync's modeled end, if any
        return {v: t.grad for v, t in received.items()}

    def backward_input(self, roots: list, grads: list, n: int, *, received: dict,
                       input_share: float) -> tuple[dict, WeightGradients]:
        """The input half of one micro-batch's backward (:func:`runtime.parallel.split_backward.backward_inputs`):
        the ``received`` values' gradients, and the weight half still to run (:meth:`backward_weight`).
        No parameter's gradient is touched, so no sync fires. One compute segment of ``input_share``
        of the backward's FLOPs and non-matmul bytes (:meth:`PipelineExecutor._input_share`)."""
        values = list(received)
        with self.sync.no_sync():
            self.emulator.begin(self.flops[1] * n * input_share, n, memory_bytes=self.memory_bytes[1] * n * input_share)
            input_grads, weights = backward_inputs(roots, grads, [received[v] for v in values],
                                                   self.stage.module.parameters())
            self.emulator.wait_deadline()
        return dict(zip(values, input_grads)), weights

    def backward_weight(self, weights: WeightGradients, roots: list, n: int, *, last: bool,
                        input_share: float) -> None:
        """The weight half of one micro-batch's backward: its parameters' gradients into ``.grad``
        (one compute segment of the rest of the backward's FLOPs and bytes). ``last``: the step's last
        action computing weight gradients; the replica sync is armed with the micro-batch's
        ``roots`` right before it, so DDP's all-reduce fires in it (its input half ran under
        ``no_sync`` like every other)."""
        arm = self.sync.syncs and last
        if arm:
            self.sync.arm(roots)
        with self.sync.no_sync() if not arm else nullcontext():
            self.emulator.begin(self.flops[1] * n * (1.0 - input_share), n,
                                memory_bytes=self.memory_bytes[1] * n * (1.0 - input_share))
            weights.run()
            self.emulator.wait_deadline()   # no-op if the sync's hook already waited
        self.emulator.wait_communication()

    def splits_backward(self) -> bool:
        """Whether this stage's backwards are split (:mod:`runtime.parallel.split_backward`), by the
        plan's one rule (:func:`planner.schedule.program.splits_backward`: the plan asks, through
        ZB-H1 or delayed weight gradients, and the stage has no tensor-parallel group, synchronised
        BatchNorm, ZeRO sync or recompute). The executor runs the program built from it."""
        return splits_backward(self.plan, self.stage.index)

    def has_parameters(self) -> bool:
        """Whether the stage trains any parameter (state the forward never reads does not count)."""
        idle = {id(p) for p in self.idle_params}
        return any(p.requires_grad and id(p) not in idle for p in self.stage.module.parameters())

    def finish_step(self) -> None:
        """After the step's last backward: sum tied parameters' gradients over their holders (under
        ZeRO first over this worker's data-parallel group, whose sync left them whole)."""
        if self.kept_whole and self.sync.syncs:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.kept_whole]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self._dp_group)
            offset = 0
            for p in self.kept_whole:
                p.grad = flat[offset: offset + p.numel()].view_as(p).clone()
                offset += p.numel()
        self.tied.sum_gradients()

    def set_plan(self, plan: Plan, micro_batches: dict[int, int]) -> None:
        """Take ``plan``, whose micro-batch sizes (and counts) differ from the plan in force and
        nothing else this worker was built from (its stage's layers, shards, replica sync, ZeRO
        stage and fractions, recompute; :meth:`runtime.parallel.pipeline.PipelineExecutor.set_plan`
        checks it): the module, its sharding, the sync, the tied groups and the optimizer's
        parameters stay. What reads the sizes is this worker's plan (the loss weights
        ``samples / global_batch_size`` per micro-batch as it comes) and the synchronised
        BatchNorm's rule, checked again here: every worker of the group runs the same number of
        micro-batches (``micro_batches``: rank -> its count)."""
        if plan.sync_batchnorm and len(self._peers) > 1:
            check_equal_micro_batches([micro_batches[r] for r in self._peers], self._peers)
        self.plan, self.worker = plan, plan.worker(self.rank)

    # -- state ------------------------------------------------------------------------------------
    def parameters(self) -> Iterator[nn.Parameter]:
        """What the optimizer steps: the replica sync's (the stage module's, or this rank's shards of them)."""
        return iter(self.sync.parameters())

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters and buffers, on every rank (a collective over the plan's
        ranks: the first slot of each stage gathers its tensor-parallel shards, its ``tp_index`` 0
        contributes the stage)."""
        mine = {}
        self.sync.current()       # a ragged sync gathers its shards (every worker of the group takes part)
        sharded = is_sharded(self.stage.module)
        if sharded:   # ZeRO: every worker of the data-parallel group takes part in the gathers
            gathered = {k: full_tensor(v).detach().clone() for k, v in self.stage.module.state_dict().items()}
        if self.worker.replica == 0 and self.worker.dp_index == 0:
            local = full_state_dict(self.stage.module, gathered if sharded else None)
            if self.worker.tp_index == 0:
                mine = {name: v.cpu() for k, v in local.items() for name in self._state_names[k]}
        gathered: list[dict] = [None] * self.plan.world_size
        dist.all_gather_object(gathered, mine, group=self.group)
        return {k: v for part in gathered for k, v in part.items()}

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy this stage's parameters and buffers (its shards of them) out of a full state dict."""
        missing = sorted(ns[0] for ns in self._state_names.values() if not any(n in state for n in ns))
        if missing:
            raise KeyError(f"rank {self.rank}, stage {self.stage.index}: {missing} missing from the state dict")
        mine = {k: state[next(n for n in ns if n in state)] for k, ns in self._state_names.items()}
        if is_sharded(self.stage.module):     # ZeRO: this worker's rows of its tensor-parallel slice
            load_rows(self.stage.module, tensor_parallel_slices(self.stage.module, mine))
        else:
            self.sync.current()       # a sync that frees its whole parameters gives them storage
            load_full_state_dict(self.stage.module, mine)
            self.sync.loaded()

    def named_state(self) -> NamedState:
        """This stage's parameters and buffers under the model's names, with the part of each it
        holds, as the replica sync keeps them; for :func:`runtime.state.transfer.switch_executor`
        and checkpoints."""
        return self.sync.named_state(self._state_names)

    def close(self) -> None:
        """Leave no hook behind (the replica sync's on this stage's parameters, which the model
        shares) and no recompute wrapper on the stage module, so an executor of another plan can
        take them over."""
        self.sync.release()
        recompute.unwrap_stage(self.stage.module)

    @property
    def device(self) -> torch.device:
        if self._device is not None:
            return torch.device(self._device)
        p = next((p for p in self.stage.module.parameters() if not p.is_meta), None)
        return p.device if p is not None else torch.device("cpu")

    # -- set-up -----------------------------------------------------------------------------------
    def _shard(self, sharding: Optional[StageSharding], graph_module: fx.GraphModule, loss_fn: Callable) -> Callable:
        """Shard this stage's ``split`` regions over its tensor-parallel group; returns the loss to
        use (the sharded cross-entropy when the last stage keeps its logits class-sharded)."""
        if sharding is None:
            raise StageError(f"rank {self.rank}: stage {self.stage.index} is tensor parallel (tp_size "
                             f"{self.worker.tp_size}); pass sharding=StageSharding.from_graphs(graphs, tp_group)")
        slot = [w for w in self.plan.stage_workers(self.stage.index, self.worker.replica)
                if w.dp_index == self.worker.dp_index]
        layout = OutputLayout.of_stage(self.split, self.stage) if self.is_last else None
        sharded = sharding.apply(self.stage.module, graph_module, self.plan.stages[self.stage.index].shard_sizes,
                                 self.worker.tp_index, loss_fn if self.is_last else None, self.emulator, layout,
                                 devices=[w.device for w in sorted(slot, key=lambda w: w.tp_index)])
        return sharded.sharded_loss or loss_fn

    def _replica_sync(self, peers: Sequence, dp_group: Optional[dist.ProcessGroup]) -> ReplicaSync:
        """The plan's replica sync over the workers holding the same parameters as this one: the
        stage's workers of the same ``tp_index`` in every replica (SUM: losses carry the global weights)."""
        kind = self.plan.stages[self.stage.index].replica_sync
        alone = len(peers) == 1 or not self.has_parameters()
        if not alone and dp_group is None:
            raise StageError(f"rank {self.rank}: stage {self.stage.index} runs on {len(peers)} workers; pass their "
                             f"process group as dp_group (runtime.groups.build_groups(plan, rank).dp.group)")
        devices = [w.device for w in sorted(peers, key=lambda w: w.rank)]
        self._dp_group = dp_group
        return build_replica_sync(kind, self.stage.module, dp_group, emulator=self.emulator, devices=devices,
                                  alone=alone, reduce_dtype=self.reduce_dtype, layers=self.units,
                                  zero_stage=self.plan.stages[self.stage.index].zero_stage,
                                  fractions=self.plan.stages[self.stage.index].state_fractions,
                                  keep_whole=self.kept_whole, idle=self.idle_params, device=self._device)

    def _cut_into_units(self, peers: Sequence, names: nn.Module) -> list[str]:
        """Cut the stage into layer units when it is sharded evenly under ZeRO (``replica_sync``
        'fsdp' over more than one worker, no tensor-parallel slice: a parallel Linear's slice stays
        in one unit with the stage) and return their paths; ``[]`` otherwise (the stage is one unit)."""
        st = self.plan.stages[self.stage.index]
        if (st.replica_sync != "fsdp" or not st.zero_stage or len(peers) < 2 or not self.segments_per_stage
                or not self.has_parameters()):
            return []
        paths = stage_units.cut(self.stage.module)
        if paths:
            self._state_names = self._model_names(names)
        return paths

    def _synchronise_batchnorm(self, peers: Sequence, dp_group: Optional[dist.ProcessGroup],
                               micro_batches: dict[int, int]) -> None:
        """BatchNorm statistics over the workers holding this stage's parameters (runtime.parallel.sync_batchnorm)."""
        if len(peers) == 1:
            return
        if dp_group is None:
            raise StageError(f"rank {self.rank}: sync_batchnorm on stage {self.stage.index} needs its workers' "
                             f"process group as dp_group (runtime.groups.build_groups(plan, rank).dp.group)")
        check_equal_micro_batches([micro_batches[w.rank] for w in peers], [w.rank for w in peers])
        synchronise_batchnorm(self.stage.module, dp_group)

    def _model_names(self, source: nn.Module) -> dict[str, tuple[str, ...]]:
        """This stage's state-dict keys -> the model's names for the same tensors (taken before
        sharding, which keeps the keys but replaces the tensors). A tied parameter has several, and
        the model's state dict holds it under each, so the full state dict does too."""
        names: dict[int, tuple[str, ...]] = {}
        for n, t in source.state_dict(keep_vars=True).items():
            names[id(t)] = names.get(id(t), ()) + (n,)
        for n, t in self.idle.items():          # the names module may not hold them (an fx graph module)
            names.setdefault(id(t), (n,))
        for n, t in [*source.named_parameters(remove_duplicate=False), *source.named_buffers(remove_duplicate=False)]:
            names.setdefault(id(t), (n,))
        out = {}
        for key, t in self.stage.module.state_dict(keep_vars=True).items():
            if id(t) not in names:
                raise StageError(f"rank {self.rank}: stage {self.stage.index}'s {key!r} has no name in the "
                                 f"names module; pass the module the graph was captured from")
            out[key] = names[id(t)]
        return out

    def _segment(self, flops: float, samples: int, memory_bytes: float = 0.0):
        return (self.emulator.segment(flops, samples, memory_bytes=memory_bytes) if self.segments_per_stage
                else nullcontext())
