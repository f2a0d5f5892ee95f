"""Which devices of the cluster spec a start of the workers has, and a new plan when they changed.

Under ``torchrun --nnodes MIN:MAX --rdzv-backend c10d`` the elastic agent starts the workers again
after a node is lost (its peers' collectives fail and they exit) and when a node joins (the agent
restarts its workers for the next rendezvous). Each start calls :func:`start` before building its
Engine:

1. every rank names its device by the membership rule of :mod:`whalelike.cluster` (the spec host its
   node stands for, ``WHALELIKE_HOST`` or the host name, and its local rank) and the names are
   gathered: the devices present, in torchrun's rank order (:meth:`whalelike.cluster.Cluster.present`);
2. if they are the plan's devices rank by rank, the plan runs as it is;
3. otherwise a plan the user gave for exactly these devices runs (``--plan``: the whole cluster's,
   once every node is back), or rank 0 plans the model onto the devices present (:func:`planner.plan` on the captured
   TaskGraphs, under the old plan's :class:`~whalelike.config.Config`: global batch, micro-batches,
   schedule, precision, ZeRO stage asked for, replica sync, resharding) and broadcasts the plan; the
   caller resumes the newest checkpoint onto it (:func:`runtime.checkpoint.load` reshards onto any
   plan). The change (devices lost and gained, both plans, the predicted step times and the ideal for
   the devices left) is :class:`MembershipChange`, for the caller to log once;
4. when no plan holds the model on the devices present, every rank raises the same
   :class:`MembershipError`: one line naming the memory missing and the devices present.

Why rank 0 plans and broadcasts rather than every rank planning: the planner is deterministic, but a
re-plan costs a capture and a solve, and the machines are busy restarting; one solve also makes the
agreement certain. The process group this needs is the run's own (:func:`runtime.distributed.init`),
which the Engine then finds initialised.
"""
from __future__ import annotations

import dataclasses
import os
import socket
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch.distributed as dist

from planner.api import plan as make_plan
from planner.balance.replan import config_of as replan_config
from planner.plan import Plan
from runtime import distributed
from whalelike.cluster import HOST_ENV, Cluster, member_host
from whalelike.config import Config
from whalelike.display import human_bytes
from whalelike.errors import WhaleError, one_line
from whalelike.graphs.taskgraph import TaskGraphs


class MembershipError(WhaleError):
    """The devices present cannot run the model (or cannot be told apart); the same on every rank."""


@dataclass(frozen=True)
class MembershipChange:
    """The devices present differ from the old plan's: ``lost`` and ``gained`` device names,
    ``renumbered`` when the same devices came back under other ranks, and the two plans."""

    old: Plan
    new: Plan
    lost: tuple[str, ...]
    gained: tuple[str, ...]
    renumbered: bool
    present: Cluster
    spec: Cluster

    @property
    def ideal_ms(self) -> float:
        """The old plan's predicted step time scaled by the compute the devices left have against
        the compute it had (the spec's TFLOPS at the plan's precision): a perfect re-plan's step."""
        def tflops(plan: Plan) -> float:
            return sum(self.spec.device(w.device).tflops(plan.precision) for w in plan.workers)

        return self.old.prediction.step_time_ms * tflops(self.old) / tflops(self.new)

    def lines(self) -> list[str]:
        """The change as rank 0 logs it, once per start that makes it."""
        def devices(names) -> str:
            return ", ".join(f"{n} ({self.spec.device(n).host})" for n in names) or "none"

        def summary(plan: Plan) -> str:
            stages = "; ".join(f"stage {st.index}: {st.strategy}" for st in plan.stages)
            return (f"{plan.world_size} workers ({stages}), predicted {plan.prediction.step_time_ms:.2f} ms/step, "
                    f"{plan.prediction.throughput:.1f} samples/s")

        lines = [f"membership changed: devices lost: {devices(self.lost)}; gained: {devices(self.gained)}"
                 + ("; the same devices under other ranks" if self.renumbered else ""),
                 f"  old plan: {summary(self.old)}",
                 f"  new plan: {summary(self.new)} on {self.present.name}",
                 f"  predicted step {self.new.prediction.step_time_ms:.2f} ms against the ideal "
                 f"{self.ideal_ms:.2f} ms for these devices (the old plan's step scaled by their compute)"]
        return lines


@dataclass(frozen=True)
class Start:
    """What a start of the workers runs: the ``plan`` (the one given, or a new one), the
    ``cluster`` of the devices present in rank order (the Engine's), and the ``change`` if any."""

    plan: Plan
    cluster: Cluster
    change: Optional[MembershipChange]


def config_of(plan: Plan) -> Config:
    """The Config ``plan`` was made under, as far as the plan says: its batch, micro-batches,
    schedule, recipe and replica sync (:func:`planner.balance.replan.config_of`), and the ZeRO
    stage when every stage that runs one was asked for it (``zero_reason`` 'asked'); a stage the
    planner chose to shard to fit ('fit') leaves the choice to the planner again."""
    asked = {st.zero_stage for st in plan.stages if st.zero_reason == "asked"}
    chosen = asked.pop() if len(asked) == 1 and not any(st.zero_reason == "fit" for st in plan.stages) else None
    ragged = any(st.replica_sync == "ragged" for st in plan.stages) or \
        not any(st.replica_sync == "fsdp" for st in plan.stages)
    return dataclasses.replace(replan_config(plan), zero_stage=chosen, ragged_shards=ragged)


def device_names(spec: Cluster) -> list[str]:
    """Every rank's device by the membership rule, in rank order (a collective of the default
    group). Rules that fail on one rank (a host with too few devices) fail on every rank alike."""
    host = member_host(spec, os.environ.get(HOST_ENV), socket.gethostname())
    mine = (host, int(os.environ.get("LOCAL_RANK", "0")), dist.get_rank(), socket.gethostname())
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    try:
        return [spec.device_of(h, local, rank).name for h, local, rank, _ in everyone]
    except WhaleError as e:
        raise MembershipError(f"membership: {one_line(e)}") from None


def start(spec: Cluster, plan: Plan, graphs: Callable[[], TaskGraphs], timeout_s: float,
          given: Sequence[Plan] = ()) -> Start:
    """Initialise the process group, find the devices present, and return the plan to run on them
    (see the module docstring). ``plan`` is the plan in force (the checkpoint's when resuming);
    ``given``, plans the user gave (``--plan``), each used as it is when its devices are the ones
    present rank by rank (a resume onto another plan of the same devices; the hand-made plan of the
    whole cluster once every node is back), else ``plan`` when its devices are. Else a new plan
    under ``plan``'s Config: ``graphs`` captures the model (called on rank 0 only, and only
    then). Raises :class:`MembershipError` on every rank when the devices present cannot hold the
    model under any plan, or when they cannot be told apart."""
    distributed.init(timeout_s)
    names = device_names(spec)
    try:
        present = spec.present(names)
    except WhaleError as e:
        raise MembershipError(f"membership: {one_line(e)}") from None
    old = [w.device for w in plan.workers]
    chosen = next((p for p in given if [w.device for w in p.workers] == names), None)
    if old == names:   # the devices of the plan in force: the user's plan for them if given (resumed onto it)
        chosen = chosen if chosen is not None else plan
        chosen.validate(cluster=present)
        return Start(chosen, present, None)
    new = chosen if chosen is not None else _planned(spec, present, plan, graphs)
    new.validate(cluster=present)
    change = MembershipChange(old=plan, new=new, lost=tuple(n for n in old if n not in names),
                              gained=tuple(n for n in names if n not in old),
                              renumbered=sorted(old) == sorted(names), present=present, spec=spec)
    return Start(new, present, change)


def _planned(spec: Cluster, present: Cluster, plan: Plan, graphs: Callable[[], TaskGraphs]) -> Plan:
    """A plan onto ``present`` under ``plan``'s Config, made on rank 0 and broadcast (a collective):
    the same plan, or the same :class:`MembershipError`, on every rank."""
    payload: list = [None]
    if dist.get_rank() == 0:
        try:
            payload[0] = ("plan", make_plan(graphs(), present, config_of(plan)).to_dict())
        except Exception as e:  # noqa: BLE001 - every rank must learn of it, or the others would wait
            payload[0] = ("error", cannot_plan_message(present, spec, [w.device for w in plan.workers], e))
    dist.broadcast_object_list(payload, src=0)
    kind, value = payload[0]
    if kind == "error":
        raise MembershipError(value)
    return Plan.from_dict(value)


def cannot_plan_message(present: Cluster, spec: Cluster, old: list[str], error: BaseException) -> str:
    """One line: the devices present, those lost, and why no plan holds the model on them (the
    planner's reason, which names the memory missing: 'short by ...')."""
    devices = ", ".join(f"{d.name} ({human_bytes(d.memory_gib * 2**30)}, {d.host})" for d in present.devices)
    lost = [n for n in old if n not in present.positions]
    total = human_bytes(sum(d.memory_gib for d in present.devices) * 2**30)
    what = "cannot hold the model under any plan" if "short by" in str(error) or "fit" in str(error) else \
        "cannot run the model under any plan"
    return (f"the {len(present.devices)} device(s) present {what}: {devices}, {total} in all"
            + (f" (lost since the plan: {', '.join(lost)})" if lost else "")
            + f"; {one_line(error)}; bring devices back or add devices with more memory to the job")
