"""Leaving without a restart: a rank that gives notice hands its state over at a step boundary and
the others go on with a new plan, in the same processes, with no checkpoint read.

Two reasons to leave (:class:`LeaveConfig`, ``runtime.Engine(departures=...)``):

* **a notice**: SIGTERM (a spot or preemptible VM's preemption notice, a scheduler's drain). The
  handler only sets a flag: a signal arrives between any two bytecodes, possibly inside a
  collective, and anything more (a collective, an allocation, a log line under the logging lock)
  could deadlock or tear the step apart;
* **persistent slowness** (:class:`SlownessRule`, off by default): a rank whose measured speed stays
  far below what its device is worth after a re-plan already cut its share.

The protocol, identical on every rank (every decision a function of values every rank holds):

1. **Agreement.** Each rank puts its flag in its slot of a vector that rides in the all-reduce
   that ends every step anyway (the straggler monitor's passenger, :class:`Boarding`: DDP's last
   gradient bucket, the pipeline's loss), so every rank learns who leaves in the same step at no
   collective of its own. The slowness rule is a pure function of the straggler monitor's gathered
   speeds, the same on every rank.
   Asynchronous checkpoints still being written (:func:`runtime.checkpoint.save_async`) are
   finished first, on every rank: they write through a process group of the old world.
2. **The new plan.** :func:`planner.plan` on the captured TaskGraphs and the cluster spec
   restricted to the staying devices (:meth:`whalelike.cluster.Cluster.present`, in the stayers'
   old rank order; emulated stragglers follow their devices), under the old plan's :class:`~whalelike.config.Config` (:func:`runtime.elastic.membership.config_of`). One
   stayer plans and broadcasts (the planner's solver may stop at a time limit; one solve makes the
   agreement certain). New rank ``i`` is the stayer running the plan's worker ``i``; a stayer
   whose device the plan leaves idle (the planner's choice) leaves as well. When no plan holds the
   model on the stayers, every stayer raises :class:`LeaveError` with one line, and the leaver
   still leaves (a preemption does not wait).
3. **Hand-over, in the old world.** Every rank snapshots what it holds and lets go of its executor
   (:func:`runtime.state.transfer.snapshot`); the ranks share their
   :class:`~planner.balance.state_moves.Slab` descriptions, and the leaver sends each tensor no
   stayer holds all of (a pipeline stage it ran alone, its tensor-parallel shard) to an heir, the
   next stayer after it, which *parks* it. What a data-parallel peer also holds does not move.
4. **A new world.** The stayers re-initialise the default process group among themselves:
   ranks renumbered in their old order, a store hosted by the first stayer (its port advertised
   through the old store, which the leaver keeps alive until every stayer has connected), a key
   prefix per leave. Then the Engine rebuilds its groups (:func:`runtime.groups.build_groups`),
   progress record, emulator and straggler monitor for the new plan and lands the state:
   :func:`runtime.state.transfer.land`, the switch re-plans already use, with the parked
   pieces described as held by a rank of their own that their heir sends for. The next step runs
   the new plan.
5. The leaver destroys its process group and raises :class:`Departed`, a ``SystemExit`` with code
   0: uncaught, the process exits 0 (torchrun's agent sees a worker that succeeded).

A notice the exchange carries for some ranks only is read once more, in a small all-reduce after the
step's update, before anyone leaves (:meth:`Departures._confirmed`): the agent's SIGTERMs reach its
workers one after another and may straddle the exchange.

When *every* rank gives notice in the same step, nobody can stay: the whole job is being stopped
(torchrun's agent stops its workers with SIGTERM to restart them when a node joins or a peer
failed; a scheduler drains the job). No leave runs; every rank raises :class:`Stopping` at the
step boundary with the step complete, so the caller can write a checkpoint of exactly that step
inside the notice: the restart that follows resumes there and loses no step.

Why re-initialise the default group and not ``dist.new_group(ranks=stayers)`` under a rank mapping:
the runtime speaks to the default group in many places (the batch check, the replica syncs'
``dist.get_rank()``, tied weights' groups, boundary reshardings, the straggler exchange, the
stand-alone passenger sum) and takes plan rank = global rank throughout; a subgroup world would
need a mapping threaded through all of them, every later ``new_group`` would still be collective
over a world with a dead member, and when rank 0 leaves the store every ``new_group`` and the
progress record use dies with it. A fresh default group keeps every invariant of the runtime
(plan rank = global rank, the world = the plan) and moves the store to a stayer. Its cost is one
group initialisation (milliseconds on gloo, about a second on NCCL), paid once per leave.

Why the hand-over happens before the new world and not inside one transfer: the new executor's
groups belong to the new world, which the leaver is not part of, and two default groups cannot
coexist; parking the leaver's unique pieces costs one extra hop for those pieces only (none for
data parallelism), where a transitional world holding the leaver would cost a second group
initialisation and a second executor build.

Why not torch's ``torchelastic`` / ``torchrun --nnodes MIN:MAX``: the agent reacts to a lost
worker by stopping every worker and starting a new rendezvous, so the job pays process start,
capture, planning, a checkpoint read and the steps since the last checkpoint
(:mod:`runtime.elastic.membership` does that path). Why not ``torchft``: it keeps data-parallel
replicas going with a quorum per step, but it does not move a pipeline stage or a tensor-parallel
shard, nor re-plan uneven shares; here the whole state moves exactly, so training continues bit
for bit as on the old plan (the exactness invariant of :mod:`runtime.state.transfer`).

The slowness rule (:class:`SlownessRule`), with hysteresis and never on noise: a rank's *worth*
is its share of the measured total speed over its share of the cluster's nominal speed (the spec's
peak at the plan's precision): 1.0 runs as its spec says relative to the others, 0.2 does a fifth
of what its device should. Its exchanges below ``leave_below`` are counted, the count resets when
its worth climbs back above ``recover_above`` (> ``leave_below``: the band between holds the
count), and it leaves after ``exchanges`` counted exchanges, and only once the plan in force was
already made for its slowness (the rebalancer's reference speeds put it below ``leave_below`` too):
a re-plan that moves work off it comes first. The speeds are the straggler monitor's medians over
its window, so a single slow step never counts; at most one rank leaves per step, never below
``min_ranks``. Off by default: leaving is one-way within a run (a device that recovers only comes
back at the next rendezvous), an exact re-plan already gives a slow device a share it can carry,
so it still adds throughput unless its communication costs more than its compute adds, which
the rule cannot see; turn it on for spot or shared machines that stay slow.

SIGTERM handling is off by default too (``LeaveConfig(sigterm=True)`` or ``departures=True`` turns it
on): torchrun's agent also stops workers with SIGTERM (a peer failed, a membership change), and a
flag that waits for a step boundary that never comes would delay that stop until the agent's kill.

Invariant: every rank leaves or stays at the same step boundary, and the stayers' state after the
leave is exactly the old plan's state redistributed: the next step's loss and update are the ones
the old plan would have computed.
"""
from __future__ import annotations

import datetime
import logging
import math
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence, Union

import torch
import torch.distributed as dist

from runtime.control.exchange import Part
from runtime.control.protocol import Controller, PlanChange, StepView
from whalelike.errors import SpecError, WhaleError

if TYPE_CHECKING:
    from planner.plan import Plan
    from runtime.state.transfer import Snapshot
    from whalelike.cluster import Cluster

log = logging.getLogger(__name__)


class LeaveError(WhaleError):
    """The ranks staying cannot go on without the leaver (no plan holds the model on them)."""


class Stopping(WhaleError):
    """Every rank gave notice in the same step: the whole job is being stopped (a scheduler's drain,
    torchrun's agent stopping its workers to restart them), so nobody stays to take the state.
    Raised on every rank at the step boundary once the step is complete: ``step`` steps are done
    (``Engine.step``) and ``loss`` is the last one's, so the caller can save a checkpoint within
    the notice and exit (``examples/train.py`` does) and a restart loses no step."""

    def __init__(self, step: int, loss: torch.Tensor):
        super().__init__(f"every rank gave notice (SIGTERM) during step {step - 1}: the job stops at its boundary, "
                         f"{step} steps done")
        self.step, self.loss = step, loss


class Departed(SystemExit):
    """Raised on a rank that has left the job after handing over its state: a ``SystemExit`` with
    code 0, so an uncaught one ends the process successfully. ``step`` is the last step it ran."""

    def __init__(self, step: int, reason: str):
        super().__init__(0)
        self.step, self.reason = step, reason

    def __str__(self) -> str:
        return f"left the job after step {self.step} ({self.reason}); its state went to the ranks that stay"


# -- the slowness rule (pure) ----------------------------------------------------------------------
@dataclass(frozen=True)
class SlownessRule:
    """When a persistently slow rank leaves (the module docstring): worth below ``leave_below`` for
    ``exchanges`` counted speed exchanges, the count reset above ``recover_above``."""

    leave_below: float = 0.25
    recover_above: float = 0.5
    exchanges: int = 10
    min_ranks: int = 1

    def __post_init__(self):
        for name in ("leave_below", "recover_above"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < 1.0:
                raise SpecError(f"SlownessRule.{name} must be a fraction in (0, 1) of what the device is worth, "
                                f"got {value!r}")
        if self.recover_above <= self.leave_below:
            raise SpecError(f"SlownessRule: recover_above ({self.recover_above}) must exceed leave_below "
                            f"({self.leave_below}); the band between them is the hysteresis")
        for name, minimum in (("exchanges", 1), ("min_ranks", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise SpecError(f"SlownessRule.{name} must be an integer >= {minimum}, got {value!r}")


def worth(speeds: Sequence[float], nominal: Sequence[float]) -> list[float]:
    """Each rank's share of the measured total speed over its share of the nominal total (NaN where
    a speed is unknown)."""
    if any(math.isnan(s) for s in speeds):
        return [math.nan] * len(speeds)
    measured, spec = sum(speeds), sum(nominal)
    return [(s / measured) / (n / spec) for s, n in zip(speeds, nominal)]


@dataclass
class SlownessWatch:
    """The counts of :class:`SlownessRule` across exchanges (pure: no torch, no communication)."""

    rule: SlownessRule
    counts: dict[int, int] = field(default_factory=dict)

    def observe(self, speeds: Sequence[float], reference: Optional[Sequence[float]],
                nominal: Sequence[float]) -> Optional[int]:
        """One exchange: ``speeds`` measured (the monitor's medians), ``reference`` the speeds the
        plan in force was made for (None: none yet), ``nominal`` the devices' spec speeds. The rank
        that leaves now (the least worth among those due), or None."""
        now = worth(speeds, nominal)
        if any(math.isnan(w) for w in now):
            return None
        for rank, value in enumerate(now):
            if value < self.rule.leave_below:
                self.counts[rank] = self.counts.get(rank, 0) + 1
            elif value > self.rule.recover_above:
                self.counts.pop(rank, None)
        if reference is None or len(speeds) <= self.rule.min_ranks:
            return None
        planned = worth(reference, nominal)
        due = [r for r, n in self.counts.items() if n >= self.rule.exchanges and planned[r] < self.rule.leave_below]
        return min(due, key=lambda r: (now[r], r)) if due else None


# -- configuration -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class LeaveConfig:
    """``Engine(departures=...)``: ``sigterm`` (a SIGTERM is a notice to leave at the next step
    boundary) and ``slowness`` (a :class:`SlownessRule`, or None: never for slowness)."""

    sigterm: bool = True
    slowness: Optional[SlownessRule] = None

    @classmethod
    def of(cls, value: Union["LeaveConfig", bool, None]) -> Optional["LeaveConfig"]:
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        raise SpecError(f"Engine(departures=...) takes True, False, None or a runtime.elastic.departure.LeaveConfig, "
                        f"got {type(value).__name__}")


@dataclass(frozen=True)
class LeaveEvent:
    """One leave, as the stayers record it (``Engine.departures.history``): the old ranks that left
    and why, the worlds before and after, seconds from the agreement to the new plan in force on
    this rank, bytes parked by leavers and moved by the landing transfer."""

    step: int
    leavers: tuple[int, ...]
    reasons: tuple[str, ...]
    old_world: int
    new_world: int
    seconds: float
    parked_bytes: int
    moved_bytes: int

    def line(self) -> str:
        who = ", ".join(f"rank {r} ({why})" for r, why in zip(self.leavers, self.reasons))
        return (f"step {self.step}: {who} left; {self.old_world} -> {self.new_world} ranks in {self.seconds * 1e3:.0f} ms, "
                f"{self.parked_bytes / 2**20:.2f} MiB handed over, {self.moved_bytes / 2**20:.2f} MiB moved; no restart")


# -- agreement: a controller of the step boundary ------------------------------------------------
class Departures(Controller):
    """Leaving's controller (:mod:`runtime.control.protocol`, name ``"leave"``, order 0: a leave comes
    before any re-plan): the SIGTERM flag, the slowness counts, the history. Its share of every
    step's exchange is one leave flag per rank; it reacts with ``stop`` when every rank gave notice,
    ``leave`` when some did or the slowness rule sends one away."""

    name = "leave"
    order = 0

    def __init__(self, config: LeaveConfig):
        self.config = config
        self.notice_at: Optional[float] = None      # time.time() of the notice on this rank
        self.history: list[LeaveEvent] = []
        self.watch = SlownessWatch(config.slowness) if config.slowness is not None else None
        self._previous = None
        self._leaving: list[int] = []
        self._step: Optional[int] = None
        self.leaves = 0
        if config.sigterm:
            try:
                self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
            except ValueError:   # signal handlers belong to the main thread
                raise WhaleError("runtime.Engine(departures=...) with sigterm=True installs a SIGTERM handler, "
                                 "which Python allows only in the main thread; build the Engine there, or pass "
                                 "LeaveConfig(sigterm=False) and call engine.departures.notice()") from None

    def _on_sigterm(self, signum, frame) -> None:   # only a flag: see the module docstring
        if self.notice_at is None:
            self.notice_at = time.time()

    def notice(self) -> None:
        """Give notice from code (as a SIGTERM would): this rank leaves at the next step boundary."""
        self._on_sigterm(signal.SIGTERM, None)

    # -- the controller protocol ---------------------------------------------------------------------
    def exchange(self, step: int, runtime, so_far) -> Part:
        """This rank's leave flag in its slot of one value per rank (read at send time)."""
        world, rank = runtime.world_size, runtime.rank

        def fill() -> torch.Tensor:
            flags = torch.zeros(world, dtype=torch.float64)
            flags[rank] = 1.0 if self.notice_at is not None else 0.0
            return flags

        def arrived(values: torch.Tensor) -> None:
            self._step, self._leaving = step, [r for r, v in enumerate(values.tolist()) if v > 0.5]

        return Part(world, fill, arrived)

    def leaving(self) -> list[int]:
        """The ranks whose flag the last exchange carried (the ranks that gave notice)."""
        return list(self._leaving)

    def react(self, view: StepView) -> Optional[PlanChange]:
        notices = self._leaving if self._step == view.step else []
        if notices and len(notices) < view.runtime.world_size:
            notices = self._leaving = self._confirmed(view.runtime)
        if len(notices) == view.runtime.world_size:   # the whole job is being stopped: nobody can stay
            return PlanChange("stop", reason="every rank gave notice (SIGTERM)")
        slow = self.slow(view) if not notices else None
        if not notices and slow is None:
            return None
        leavers, reasons = reasons_of(notices, slow)
        return PlanChange("leave", reason="; ".join(reasons), leavers=tuple(leavers), reasons=tuple(reasons))

    def _confirmed(self, runtime) -> list[int]:
        """The ranks that have given notice by now, read again in a collective of its own (every rank
        reaches it alike: the exchange's notices are the same everywhere) before anyone leaves.
        torchrun's agent stops its workers by sending each SIGTERM, one after another: a signal can
        land on one rank before its flag was sent and on another just after, and the exchange then
        reads a stop as a leave. The step's backward and update lie between the two reads, far longer
        than the agent's loop over its workers; a lone notice costs this one small all-reduce."""
        flags = torch.zeros(runtime.world_size, dtype=torch.float64)
        flags[runtime.rank] = 1.0 if self.notice_at is not None else 0.0
        runtime.sum_alone(flags)
        return [r for r, v in enumerate(flags.tolist()) if v > 0.5]

    def slow(self, view: StepView) -> Optional[int]:
        """The rank the slowness rule sends away after this step's exchange, or None (it reads the
        re-planner's measured speeds and the speeds the plan was made for, ``view.figures``)."""
        figures = view.figures.get("rebalance", {})
        measured = figures.get("measured")
        if self.watch is None or measured is None or measured.step != view.step:
            return None
        plan = view.plan
        nominal = [view.runtime.cluster.device(w.device).tflops(plan.precision) for w in plan.workers]
        return self.watch.observe(measured.speeds, figures.get("reference"), nominal)

    def release(self) -> None:
        """Put back the SIGTERM handler this replaced."""
        if self.config.sigterm and self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


# -- the leave ----------------------------------------------------------------------------------------
def new_plan(runtime, graphs, stayers: Sequence[int]) -> tuple[Optional["Plan"], "Cluster", Optional[str]]:
    """The plan for the stayers' devices, made on ``stayers[0]`` and broadcast (collective, old
    world): the plan and the cluster it was made on, or (None, that cluster, the one-line reason no
    plan holds the model)."""
    from planner.api import plan as make_plan
    from planner.plan import Plan
    from runtime.elastic.membership import cannot_plan_message, config_of

    old = runtime.plan
    present = runtime.cluster.present([old.worker(r).device for r in stayers])
    payload: list = [None]
    if runtime.rank == stayers[0]:
        try:
            payload[0] = ("plan", make_plan(graphs, present, config_of(old)).to_dict())
        except Exception as e:  # noqa: BLE001 - every rank must learn of it, or the others would wait
            payload[0] = ("error", cannot_plan_message(present, runtime.cluster, [w.device for w in old.workers], e))
    runtime.collective(lambda: dist.broadcast_object_list(payload, src=stayers[0]))
    kind, value = payload[0]
    if kind == "error":
        return None, present, value
    plan = Plan.from_dict(value)
    plan.validate(graphs=graphs, cluster=present)
    return plan, present, None


def _stayers_hold(kept: dict, wanted: dict) -> bool:
    """Whether the stayers' pieces (``kept``) cover ``wanted`` whole: ``plan_moves`` finds every
    element a source among them, or raises."""
    from planner.balance.state_moves import StateMoveError, plan_moves

    try:
        plan_moves(kept, wanted)
    except StateMoveError:
        return False
    return True


def hand_over(held: "Snapshot", rank: int, leavers: Sequence[int], stayers: Sequence[int]) -> int:
    """Old world, collective: each leaver sends every tensor of ``held`` that no stayer holds all of
    to its heir (the next stayer after it, cyclically), which parks it in ``held.parked``. Returns
    the bytes handed over in all (the same on every rank)."""
    mine = {"old": {n: s for n, (_, s) in held.sources.items()}, "state": held.state,
            "dtype": held.dtypes(held.sources)}
    described: list[dict] = [None] * dist.get_world_size()
    dist.all_gather_object(described, mine)
    kept = {r: described[r]["old"] for r in stayers}
    ops, total = [], 0
    for leaver in leavers:
        heir = next((s for s in sorted(stayers) if s > leaver), min(stayers))
        theirs = described[leaver]
        for tag, (name, slab) in enumerate(sorted(theirs["old"].items())):
            if _stayers_hold(kept, {leaver: {name: slab}}):
                continue
            total += math.prod(slab.local_shape) * getattr(torch, theirs["dtype"][name]).itemsize
            if rank == leaver:
                ops.append(dist.P2POp(dist.isend, _on_wire(held.sources[name][0].contiguous()), heir, tag=tag))
            elif rank == heir:
                buffer = torch.empty(slab.local_shape, dtype=getattr(torch, theirs["dtype"][name]), device=_wire())
                ops.append(dist.P2POp(dist.irecv, buffer, leaver, tag=tag))
                held.parked[name] = (buffer, slab)
                parameter = name.split("[", 1)[0]
                if parameter in theirs["state"]:
                    held.parked_state.setdefault(parameter, {}).update(theirs["state"][parameter])
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    return total


def _wire() -> Optional[torch.device]:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None


def _on_wire(tensor: torch.Tensor) -> torch.Tensor:
    wire = _wire()
    return tensor.to(wire) if wire is not None else tensor


def new_world(rank: int, stayers: Sequence[int], leave: int, timeout_s: float) -> Optional[int]:
    """Re-initialise the default process group as the stayers' (collective on the old world first;
    ``stayers`` in their new rank order):
    the first stayer hosts a store and advertises it in the old store; every rank waits at a barrier
    until the stayers have connected, then the old group is destroyed. Returns this rank's new rank,
    or None on a leaver (whose process group is gone)."""
    from runtime.distributed import backend

    old_store = dist.distributed_c10d._get_default_store()
    key = f"whalelike/leave{leave}/store"
    timeout = datetime.timedelta(seconds=timeout_s)
    store = None
    if rank == stayers[0]:
        host = _address()
        store = dist.TCPStore(host, 0, len(stayers), is_master=True, timeout=timeout, wait_for_workers=False)
        old_store.set(key, f"{host} {store.port}")
    elif rank in stayers:
        old_store.wait([key], timeout)
        host, port = old_store.get(key).decode().split()
        store = dist.TCPStore(host, int(port), len(stayers), is_master=False, timeout=timeout)
    dist.barrier()          # every stayer holds the new store: the old one (maybe a leaver's) may go
    dist.destroy_process_group()
    if store is None:
        return None
    new_rank = list(stayers).index(rank)
    dist.init_process_group(backend(), store=dist.PrefixStore(f"whalelike/world{leave}", store), rank=new_rank,
                            world_size=len(stayers), timeout=timeout)
    os.environ.update(RANK=str(new_rank), WORLD_SIZE=str(len(stayers)))
    return new_rank


def _address() -> str:
    """Where the other stayers reach a store this rank hosts: ``MASTER_ADDR`` when it is this
    machine's loopback (every rank on one machine), else this machine's host name."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    if master in ("127.0.0.1", "localhost", "::1"):
        return master
    return socket.getfqdn()


def leave(runtime, slot, checkpointer, graphs, departures: Departures, leavers: Sequence[int],
          reasons: Sequence[str]):
    """The step-boundary leave (collective on the old world): the protocol of the module docstring,
    on this rank's ``runtime`` (:class:`runtime.rank.RankRuntime`), its held state ``slot``
    (:class:`runtime.state.slot.ExecutorSlot`) and ``checkpointer``. Raises :class:`Departed` on a
    leaver; on a stayer returns ``(the new world's runtime, the landing's transfer report)``. A
    stayer whose device the new plan leaves idle (the planner's choice) leaves too."""
    start = time.perf_counter()
    rank, old, step = runtime.rank, runtime.plan, runtime.step
    leavers, reasons = list(leavers), list(reasons)
    stayers = [r for r in range(old.world_size) if r not in leavers]
    if not stayers:
        raise LeaveError(f"step {step}: every rank gave notice ({', '.join(reasons)}); nobody is left to train")
    # the checkpoints being written in the background go through a group of the old world: finished first
    runtime.collective(checkpointer.finish)
    plan, _, reason = new_plan(runtime, graphs, stayers)
    if plan is None:   # nobody can take the state: the stayers stop with one line, the leaver goes
        if rank in stayers:
            raise LeaveError(f"step {step}: rank(s) {leavers} leave ({', '.join(reasons)}) and {reason}")
        departures.release()
        raise Departed(step, reasons[leavers.index(rank)])
    # new rank i runs the plan's worker i; a stayer the plan leaves idle leaves as well
    rank_of = {old.worker(r).device: r for r in stayers}
    members = [rank_of[w.device] for w in plan.workers]
    for r in stayers:
        if r not in members:
            leavers.append(r)
            reasons.append("idle under the plan for the devices left")
    held = runtime.collective(slot.snapshot)
    parked = runtime.collective(lambda: hand_over(held, rank, leavers, members))
    departures.leaves += 1
    new_rank = runtime.collective(lambda: new_world(rank, members, departures.leaves, runtime.timeout_s))
    if new_rank is None:
        departures.release()
        why = reasons[leavers.index(rank)]
        log.info("rank %d: left after step %d (%s); handed over %.2f MiB", rank, step, why, parked / 2**20)
        raise Departed(step, why)
    # the cluster in the new ranks' order (emulated stragglers follow their devices)
    present = runtime.cluster.present([w.device for w in plan.workers])
    plan.validate(graphs=graphs, cluster=present)
    runtime = runtime.rewired(plan, present, new_rank)
    report = runtime.collective(lambda: slot.land(runtime, held))
    order = sorted(range(len(leavers)), key=lambda i: leavers[i])
    event = LeaveEvent(step, tuple(leavers[i] for i in order), tuple(reasons[i] for i in order), old.world_size,
                       len(members), time.perf_counter() - start, parked, report.moved_bytes)
    departures.history.append(event)
    if new_rank == 0:
        log.info("leave %s", event.line())
    return runtime, report


def reasons_of(notices: Sequence[int], slow: Optional[int]) -> tuple[list[int], list[str]]:
    """The ranks leaving and why: notices first, then the slow rank (if not already leaving)."""
    leavers = list(notices)
    reasons = ["SIGTERM: a preemption notice"] * len(leavers)
    if slow is not None and slow not in leavers:
        leavers.append(slow)
        reasons.append("persistently too slow to be worth keeping (SlownessRule)")
    order = sorted(range(len(leavers)), key=lambda i: leavers[i])
    return [leavers[i] for i in order], [reasons[i] for i in order]
