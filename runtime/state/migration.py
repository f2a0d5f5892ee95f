"""Lightweight workload migration for tensor parallelism (FlexTP section IV-A): exact, and cheap to undo.

A transient straggler in a tensor-parallel group should hand part of its columns (heads, MLP
features) to the others *for as long as it is slow*, without the cost of a permanent re-shard
(moving the optimizer state, twice: there and back) and without approximation. So there are two
layouts of the same parameters:

* the **owner** layout: the plan in force; these parameters and their optimizer state are the
  training state (what the optimizer steps, what checkpoints and ``full_state_dict`` see);
* the **compute** layout: a plan of the same workers whose shard sizes follow the measured speeds;
  an executor of it runs forward and backward.

Each step: (1) the owners send the *current* values of the migrated slices to the ranks that
compute them (FlexTP's broadcast of the weight; here point to point and only the piece each
receiver computes, which is less volume than a broadcast of the whole migrated block); (2) the
compute executor runs the step: a receiver computes the migrated columns as part of its own
matmul, so their partial results ride in the row-parallel all-reduce that happens anyway (the
paper's *reduce merging*: no separate reduce of the migrated results); (3) the migrated slices'
weight gradients go back to their owners (the paper's reduce of the weight gradient), and the
optimizer steps the owner parameters. Nothing else moves: the optimizer state never leaves its
owner, and ending the migration is free (drop the compute executor; the owner parameters are
current).

What moves is decided once, by :func:`planner.balance.state_moves.plan_moves` between the two layouts'
:class:`~planner.balance.state_moves.Slab` descriptions (shared by one ``all_gather_object``), and executed
every step with one ``batch_isend_irecv`` each way (:func:`runtime.state.transfer.execute_moves`).
Parameters the two executors share (layer norms, embeddings, unsharded projections are the
captured model's own tensors in both) are neither sent nor copied: their moves are local, from a
tensor to itself.

Invariant: after each step the owner parameters' gradients equal what the owner executor would
have computed (the same sums, in another place), so the optimizer update is exact; when migration
ends, or becomes a permanent re-shard (:func:`runtime.state.transfer.switch_executor` from this
executor), training continues bit for bit.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from planner.balance.state_moves import Move, plan_moves
from runtime.parallel.executor import StepExecutor
from runtime.state.transfer import NamedState, execute_moves

log = logging.getLogger(__name__)


@dataclass
class MigrationStats:
    """What the migration has cost so far, summed over its steps: elements that crossed ranks out
    (values) and back (gradients), over all ranks' moves (the same on every rank), and this rank's
    seconds in migrated steps."""

    steps: int = 0
    sent_elements: int = 0
    returned_elements: int = 0
    seconds: float = 0.0


class MigratingExecutor(StepExecutor):
    """A step executor (:class:`runtime.parallel.executor.StepExecutor`) that trains the ``owner`` executor's parameters
    with the ``compute`` executor's layout (see the module docstring). ``group``: the plan's ranks
    (default the world); a collective to build, at a step boundary."""

    def __init__(self, owner, compute, group: Optional[dist.ProcessGroup] = None):
        self.owner, self.compute = owner, compute
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self._owned = _params(owner.named_state())
        self._computed = _params(compute.named_state())
        mine = {"owner": {n: s for n, (_, s) in self._owned.items()},
                "compute": {n: s for n, (_, s) in self._computed.items()}}
        described: list[dict] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(described, mine, group=self.group)
        owners = {r: d["owner"] for r, d in enumerate(described)}
        computers = {r: d["compute"] for r, d in enumerate(described)}
        # values out: every compute slab from an owner; gradients back: every owner slab from a
        # computer. Every rank keeps the whole lists (a move's index is its message tag on both
        # ends); a local move between a tensor and itself (shared parameters) copies nothing.
        self._out = plan_moves(owners, computers)
        self._back = plan_moves(computers, owners)
        self.stats = MigrationStats()
        crossing = [m for m in self._out if not m.local]
        log.info("rank %d: migrating %d slices of %d tensors (%d elements per step each way)", self.rank,
                 len(crossing), len({m.name for m in crossing}), migrated_elements(self._out))

    # -- what the Engine sees: the owner's parameters and state, the compute layout's work ------------
    @property
    def plan(self):
        return self.owner.plan

    @property
    def module(self) -> nn.Module:
        """The module that computes (ZERO-resizing and the memory meter attach to the computing layout's)."""
        return self.compute.module

    @property
    def micro_batch_sizes(self) -> list[int]:
        """The computing layout's micro-batch sizes on this rank (its backward accumulates the gradients)."""
        return self.compute.micro_batch_sizes

    def syncs(self) -> list:
        """The owner's replica syncs and the computing layout's, each once."""
        found = list(self.owner.syncs())
        return found + [s for s in self.compute.syncs() if not any(s is f for f in found)]

    @property
    def passenger(self):
        """The Engine's passenger to sum in this step's last collective: the computing executor's."""
        return self.compute.passenger

    @passenger.setter
    def passenger(self, value) -> None:
        self.compute.passenger = value

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.owner.parameters()

    def named_state(self) -> NamedState:
        return self.owner.named_state()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.owner.full_state_dict()

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.owner.load_full_state_dict(state)

    def close(self) -> None:
        self.compute.close()
        self.owner.close()

    def release_compute(self):
        """End the migration: close the compute executor and return the owner executor (current)."""
        self.compute.close()
        return self.owner

    # -- a step ------------------------------------------------------------------------------------
    def train_step(self, inputs: tuple, targets: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        self._send_values()
        for tensor, _ in self._computed.values():
            tensor.grad = None
        loss = self.compute.train_step(inputs, targets)
        self._return_gradients()
        self.stats.steps += 1
        self.stats.seconds += time.perf_counter() - start
        return loss

    @torch.no_grad()
    def eval_step(self, inputs: tuple, targets: torch.Tensor) -> torch.Tensor:
        self._send_values()
        return self.compute.eval_step(inputs, targets)

    @torch.no_grad()
    def _send_values(self) -> None:
        sources, destinations = dict(self._owned), dict(self._computed)
        execute_moves(self._out, self.rank, self.group, sources, destinations)
        self.stats.sent_elements += migrated_elements(self._out)

    @torch.no_grad()
    def _return_gradients(self) -> None:
        sources = {}
        for name, (tensor, slab) in self._computed.items():
            grad = tensor.grad if tensor.grad is not None else torch.zeros_like(tensor)
            sources[name] = (grad, slab)
        destinations = {}
        for name, (tensor, slab) in self._owned.items():
            if tensor.grad is None:
                tensor.grad = torch.zeros_like(tensor)
            destinations[name] = (tensor.grad, slab)
        execute_moves(self._back, self.rank, self.group, sources, destinations)
        self.stats.returned_elements += migrated_elements(self._back)


def _params(state: NamedState) -> NamedState:
    """Only trainable parameters travel each step (buffers are recomputed, not learned)."""
    return {n: (t, s) for n, (t, s) in state.items() if isinstance(t, nn.Parameter) and t.requires_grad}


def migrated_elements(moves: list[Move]) -> int:
    """Elements that cross ranks in one direction of one step."""
    return sum(m.elements for m in moves if not m.local)
