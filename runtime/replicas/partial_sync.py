"""The ``partial`` replica sync: Prague's partial all-reduce (P-Reduce), approximate by design.

Prague (Luo et al., ASPLOS'20): every worker of a data-parallel group computes and applies its own
update, then averages its parameters with a small group that a group generator forms
(:mod:`runtime.replicas.group_generator`), instead of summing gradients over everyone. A slow worker
then holds back only its group, so stragglers that come and go faster than a re-plan (a noisy
neighbour, a garbage-collection pause) cost little; the price is exactness: this is decentralized
SGD, not the synchronous SGD of one device, and every step it runs is marked approximate
(``StepStats.approximate``, the plan summary, ``examples/train.py``).

What a step does here, against the seam (:mod:`runtime.replicas.replica_sync`):

* the backward syncs nothing (``no_sync`` and ``arm`` have nothing to hold back or arm); a hook on
  every parameter scales its gradient by the group size ``N``, so with the executors' loss weight
  ``n_i / B`` each worker's gradient has the weight ``N n_i / B``: the plan's speed-proportional
  shares weigh the updates (a worker with more samples takes a larger step), and with equal shares
  each worker steps on the mean loss of its own samples;
* the optimizer steps the module's own parameters (:meth:`parameters`);
* :meth:`after_step`, the seam's hook after the optimizer step (the Engine calls it every step,
  skipped or not, so every member keeps its count, with the optimizer), asks the generator for this rank's group and
  averages the parameters over it (:meth:`average`): point-to-point sends and receives of the
  flattened parameters among the group's members only (``batch_isend_irecv`` on the data-parallel
  process group: no process group per subset), each member summing the members' vectors in rank
  order, so the members end bit-identical. The smart generator answers a group only once all its
  members are at their request, and leaves out a member not due within its arrival window
  (:mod:`runtime.replicas.group_generator`), so the exchange waits for no worker that computes;
  before a collective of everyone the rank parks (:meth:`drain`), so no group waits for a rank in
  it. On an emulated network every message is stamped and padded as the pipeline's transfers are
  (:meth:`runtime.emulation.network.NetworkEmulator.stamp_sends`).

When it equals the exact run: a group of every worker every step (the static generator with
``partial_group_size`` the group's size), SGD (momentum, Nesterov and weight decay included), and
replicas that start equal (the constructor broadcasts the group's first rank's parameters and
buffers, as DDP does). Then every step starts from one ``θ`` on every replica, SGD's update is linear
in the gradient, its momentum buffer and ``θ``, so by induction the mean of the replicas' buffers is
the synchronous buffer and the averaged parameters ``θ - lr mean_i(b_i)`` are exactly the
synchronous step of one device, with each worker's gradient ``N (n_i/B) g_i`` (the mean over the
group of ``N (n_i/B) g_i`` is ``Σ_i (n_i/B) g_i``, the gradient of the global-batch mean loss). Only
the parameters agree: each replica keeps its own buffer. Adam is not linear (``mean(m_i/sqrt(v_i))``
is not the step of the mean gradient), nor is any smaller group. ``tests/test_partial_reduce.py``
checks the exact case in float64 against the single-process reference.

The passenger (the step's loss, the straggler monitor's figures): summing it over the whole group
every step would be a global synchronisation, the very thing P-Reduce avoids. So the loss is this
rank's own, at its update's weight (``N n_i/B`` times the mean loss of its samples; its mean over the
group is the global-batch mean loss), and only a passenger carrying the monitor's figures (the
Engine's exchange steps, the same steps on every rank) is summed over the group, one all-reduce at
those steps. Run P-Reduce with exchanges far apart (``BalanceConfig(exchange_every=...)``), as the
policy of :mod:`runtime.balance.sync_policy` does.

Reading the whole model (``named_state``: checkpoints and state moves; ``current``: a full state
dict) first averages the replicas over the whole group, one all-reduce (:meth:`consensus`): the
replicas differ between averages, a checkpoint stores one model in full-tensor coordinates, and the
average is the model P-Reduce's analysis is about (decentralized SGD converges in the mean of the
replicas). Training goes on from that average on every replica, so a run resumed from the
checkpoint continues from what the uninterrupted run continues from. Storing every replica instead
would tie a checkpoint to this plan's replicas and could not load onto another plan.

Invariant: every worker of the group builds this sync from the same plan and calls
:meth:`after_step` once per step; each member's ``k``-th average is with the group the generator gave
every member of it for that iteration, so sends and receives always match.
"""
from __future__ import annotations

import itertools
import logging
import time
import weakref
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from runtime.emulation.compute import Emulator
from runtime.replicas.group_generator import (
    SILENCE_S, GeneratorService, GroupGenerator, SmartGenerator, SmartGroups, StaticGenerator, check_settings,
)
from runtime.replicas.held_state import NamedState, module_state
from runtime.replicas.sync_parts import WholeParameters

log = logging.getLogger(__name__)

TAG = 71   # P-Reduce's point-to-point tag (below the emulated network's stamp offset)
_INSTANCES: dict[tuple[int, ...], itertools.count] = {}   # per group: syncs built so far (the same on every member)


@dataclass
class PartialStats:
    """What this rank's P-Reduces did: ``rounds`` averages asked for, ``alone`` of them with no
    other member (nothing sent), ``sizes`` how many had each group size, ``bytes_sent``, ``seconds``
    spent averaging (waiting for the group's members included), ``generator_s`` of it waiting for
    the generator's answers, ``consensus`` whole-group averages (checkpoints, state reads)."""

    rounds: int = 0
    alone: int = 0
    sizes: dict = field(default_factory=dict)
    bytes_sent: int = 0
    seconds: float = 0.0
    generator_s: float = 0.0
    consensus: int = 0


class PartialSync(WholeParameters):
    """:class:`runtime.replicas.replica_sync.ReplicaSync` running P-Reduce (see the module docstring).

    ``module``: this rank's stage module; ``group``: the data-parallel process group (the stage's
    workers of this ``tp_index`` in every replica; None: the world); ``devices``: their devices in
    group rank order (the emulated network prices the messages between them); ``emulator``: this
    rank's. The generator is built at the first :meth:`after_step` from the plan's
    ``StagePlan.partial_generator``, ``partial_group_size`` and ``partial_delta_c``.
    ``generator_silence_s``: how old the smart generator's heartbeat may get before a waiting rank
    calls it dead.
    """

    name = "partial"
    gradients_in_place = gradients_as_views = False
    syncs = True
    exact = False            # its steps are approximate (StepStats.approximate)
    generator_silence_s = SILENCE_S

    def __init__(self, module: nn.Module, group: Optional[dist.ProcessGroup], *, emulator: Optional[Emulator] = None,
                 devices: Optional[Sequence[str]] = None):
        self.inner = module
        self.group = group if group is not None else dist.group.WORLD
        self.ranks = tuple(dist.get_process_group_ranks(self.group))   # global ranks in group rank order
        self.rank = dist.get_rank()
        self.size = len(self.ranks)
        self.emulator = emulator or Emulator.disabled()
        self.devices = dict(zip(self.ranks, devices)) if devices is not None else {}
        self.instance = next(_INSTANCES.setdefault(self.ranks, itertools.count()))
        self.generator: Optional[GroupGenerator] = None
        self.iteration = 0
        self.stats = PartialStats()
        self._parked = False   # parked at a barrier since its last request: given no group until the next
        self._optimizer: Optional[Callable[[], Optional[torch.optim.Optimizer]]] = None   # a weak reference
        self._passenger: Optional[tuple[torch.Tensor, Optional[Callable[[torch.Tensor], None]]]] = None
        # the replicas start equal (DDP does the same at construction): a collective of the group
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t.data, src=self.ranks[0], group=self.group)
        size = self.size   # the hooks must not keep this sync alive
        self._hooks = [p.register_hook(lambda g: g * size) for p in module.parameters() if p.requires_grad]

    # -- the seam ---------------------------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        return self.inner

    def no_sync(self) -> AbstractContextManager:
        """Nothing to hold back: the backward never syncs."""
        return nullcontext()

    def arm(self, roots: Sequence[torch.Tensor]) -> None:
        """Nothing to arm: the backward never syncs."""

    def carry(self, tensor: torch.Tensor, fill: Optional[Callable[[torch.Tensor], None]] = None) -> None:
        self._passenger = (tensor, fill)

    def flush(self) -> None:
        """The passenger (see the module docstring): with the monitor's figures (``fill`` given),
        summed over the group; the loss alone, scaled to this rank's update weight, locally."""
        if self._passenger is None:
            return
        (tensor, fill), self._passenger = self._passenger, None
        if fill is None:
            tensor.mul_(self.size)
            return
        fill(tensor)
        self.drain()   # a barrier of the whole group (runtime.replicas.group_generator: parking)
        dist.all_reduce(tensor, group=self.group)

    def after_step(self, plan, step: int, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """After this step's optimizer step (or its skip): average with this iteration's group (the
        generator's answer comes when every member is there). ``optimizer``: the one stepping
        :meth:`parameters`, whose state :meth:`consensus` averages too."""
        if optimizer is not None:
            self._optimizer = weakref.ref(optimizer)
        if self.generator is None:
            self.generator = self._build_generator(plan)
        start = time.perf_counter()
        group = self.generator.group(self.iteration)
        self._parked = False
        self.stats.generator_s += time.perf_counter() - start
        self.iteration += 1
        self.average(group)
        self.stats.seconds += time.perf_counter() - start

    def drain(self) -> None:
        """Park before a collective of the whole group (the monitor's exchange, a consensus: checkpoints,
        state reads, the end of a run; :meth:`runtime.replicas.group_generator.SmartGroups.park`):
        average now in a group a member named this rank in, if any, and be given none until this
        rank's next request, so no group waits for a rank in the collective. Nothing to do before the
        generator exists, when parked since the last request, or with the static generator (its
        groups never span steps)."""
        if self.generator is None or self._parked:
            return
        group = self.generator.park(self.iteration)
        self._parked = True
        if group is not None:
            self.iteration += 1
            self.average(group)

    def named_state(self, names: Optional[Mapping[str, Sequence[str]]] = None) -> NamedState:
        """Every replica holds the stage's state whole; first averaged over the whole group (collective)."""
        self.consensus()
        return module_state(self.inner, names)

    def current(self) -> None:
        """Before the whole parameters are read (a full state dict): the whole group's average (collective)."""
        self.consensus()

    def release(self) -> nn.Module:
        """Take the gradient hooks off and stop the generator; this sync is not used again."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self.generator is not None:
            self.generator.close()
            self.generator = None
        return self.inner

    # -- averaging --------------------------------------------------------------------------------------
    def _params(self) -> list[nn.Parameter]:
        return [p for p in self.inner.parameters() if p.requires_grad]

    def _flat(self) -> list[torch.Tensor]:
        """The parameters flattened, one vector per dtype (in parameter order)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in self._params():
            by_dtype.setdefault(p.dtype, []).append(p.detach().reshape(-1))
        return [torch.cat(parts) for parts in by_dtype.values()]

    @torch.no_grad()
    def _write(self, flats: list[torch.Tensor]) -> None:
        offsets: dict[torch.dtype, int] = {}
        vectors = dict(zip({p.dtype: None for p in self._params()}, flats))
        for p in self._params():
            at = offsets.get(p.dtype, 0)
            p.copy_(vectors[p.dtype][at:at + p.numel()].view_as(p))
            offsets[p.dtype] = at + p.numel()

    @torch.no_grad()
    def average(self, group: Sequence[int]) -> None:
        """Average the parameters over ``group`` (global ranks, this one included): each member
        sends its vectors to every other member and receives theirs (one batch of point-to-point
        operations), then sums them in rank order and divides by the group's size."""
        group = tuple(sorted(group))
        self.stats.rounds += 1
        self.stats.sizes[len(group)] = self.stats.sizes.get(len(group), 0) + 1
        if len(group) == 1:
            self.stats.alone += 1
            return
        peers = [r for r in group if r != self.rank]
        mine = self._flat()
        received = {r: [torch.empty_like(v) for v in mine] for r in peers}
        sends = [dist.P2POp(dist.isend, v, r, self.group, TAG) for r in peers for v in mine]
        recvs = [dist.P2POp(dist.irecv, t, r, self.group, TAG) for r in peers for t in received[r]]
        network = self.emulator.network if self.emulator.enabled else None
        arrival = None
        if network is not None and self.devices:
            sends = network.stamp_sends(sends, [self.devices[op.peer] for op in sends])
            recvs, arrival = network.stamp_receives(recvs)
        for work in dist.batch_isend_irecv(sends + recvs):
            work.wait()
        if arrival is not None:
            arrival.wait()
        self.stats.bytes_sent += sum(v.numel() * v.element_size() for v in mine) * len(peers)
        vectors = [mine if r == self.rank else received[r] for r in group]
        self._write([torch.stack([v[i] for v in vectors]).sum(dim=0) / len(group) for i in range(len(mine))])

    @torch.no_grad()
    def consensus(self) -> None:
        """Average the parameters over the whole group (one all-reduce, a collective of every member;
        on an emulated network padded to its ring time), and the optimizer's state of them (each
        floating-point tensor of a parameter's shape: momentum, Adam's moments; counts are equal on
        every rank), so that an exact sync taking over (a re-plan, the policy of
        :mod:`runtime.balance.sync_policy`) starts from identical replicas, optimizer included."""
        self.drain()
        flats = self._flat()
        for v in flats:
            dist.all_reduce(v, group=self.group)
            v.div_(self.size)
        self._write(flats)
        optimizer = self._optimizer() if self._optimizer is not None else None
        if optimizer is not None:
            for p in self._params():
                for value in optimizer.state.get(p, {}).values():
                    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.shape == p.shape:
                        dist.all_reduce(value, group=self.group)
                        value.div_(self.size)
        self.stats.consensus += 1
        network = self.emulator.network if self.emulator.enabled else None
        if network is not None and self.devices:
            nbytes = sum(v.numel() * v.element_size() for v in flats)
            seconds = network.ring([self.devices[r] for r in self.ranks]).allreduce_ms(nbytes) * 1e-3
            if seconds > 0:
                time.sleep(seconds)

    # -- the generator ----------------------------------------------------------------------------------
    def _build_generator(self, plan) -> GroupGenerator:
        """This group's generator, from the plan's settings of this rank's stage."""
        from runtime.distributed import heartbeat_key

        st = plan.stages[plan.worker(self.rank).stage]
        members = sorted(self.ranks)
        hosts = [plan.worker(r).host for r in members]
        check_settings(members, st.partial_group_size, st.partial_delta_c)
        if st.partial_generator == "static":
            return StaticGenerator(self.rank, members, hosts, st.partial_group_size)
        store = dist.distributed_c10d._get_default_store()
        prefix = f"whalelike/preduce/{'-'.join(map(str, members))}/{self.instance}"
        host = members[0]
        service = None
        if self.rank == host:
            groups = SmartGroups(members, hosts, st.partial_group_size, st.partial_delta_c, seed=self.instance)
            service = GeneratorService(store, prefix, groups, host_rank=host, heartbeat_key=heartbeat_key,
                                       silent_after=self.generator_silence_s)
        return SmartGenerator(store, prefix, self.rank, members, host_rank=host, service=service,
                              silence_s=self.generator_silence_s, timeout_s=max(60.0, 6 * self.generator_silence_s))
