"""Simulate one training step of a :class:`~planner.plan.Plan`: step time, bubbles, a timeline.

The planner predicts a plan's speed with this simulator, and the CLI draws its timeline, so the
model of execution is the runtime's:

* Every worker runs its stage's action list (:mod:`planner.schedule`) in order; a single-stage
  plan is gradient accumulation over each worker's own micro-batches.
* The workers of one tensor-parallel group (same replica, stage and ``dp_index``) move in
  lockstep: an action starts when the whole group may start it and ends when its slowest member
  ends (their collectives inside the segment wait for it).
* Forward ``m`` of a stage needs micro-batch ``m``'s activations from every tensor-parallel group
  of each stage feeding it in the same replica; backward ``m`` needs the gradients from every
  group of each stage it feeds. A group sends once per boundary and micro-batch, through its first
  member, when the action ends; sends do not block compute (``isend``), but one worker's sends in
  one direction share its link and go one after another, each taking ``BoundaryPlan.transfer_ms``
  (free when the plan left it empty).
* Each data-parallel group of a stage (every worker with that stage and ``tp_index``, over groups
  and replicas) all-reduces its gradients once per step. Without ``buckets`` the all-reduce starts
  when all members have finished their last backward and takes the largest ``Worker.allreduce_ms``
  among them. With ``buckets`` (:class:`GradientBucket`, built from the model by
  :func:`planner.gradient_buckets.gradient_buckets`: DDP's buckets in reverse layer order), it
  overlaps with the last backward bucket by bucket, as DDP's does: bucket ``k`` is ready when
  every member has run ``ready_fraction`` of its last backward (the layers it covers), its
  all-reduce starts once it is ready and bucket ``k - 1``'s has ended (one process group runs them
  in order), and the group's step ends when the last bucket's ends. A worker's ``allreduce_ms`` in
  the result is then the exposed part, after its own compute; ``hidden_allreduce_ms`` the rest.
  Not modeled: the all-reduces of different data-parallel groups (stages, shards) sharing a host's
  network interface, and all-reduce traffic slowing concurrent boundary sends.

Processing order does not change the times: every resource (a group's device time, a worker's
link) is used in program order, so each action's start is the maximum of known finish times.
A group whose next action lacks an input parks on that input's channel and is woken when every
sender has sent; the work is linear in the number of actions, which keeps 1024-device plans fast.
"""
from __future__ import annotations

import logging
from collections import defaultdict, deque
from dataclasses import dataclass
from operator import attrgetter
from typing import Mapping, NamedTuple, Optional, Sequence

from whalelike.display import format_table

from .plan import Plan, Prediction, Worker
from .schedule import Action, build_schedule, gradient_accumulation, max_in_flight
from .validate import ScheduleError, validate_plan

GroupKey = tuple[int, int]   # (stage, tp_index): one data-parallel group of gradient all-reduces

log = logging.getLogger(__name__)


class SimEvent(NamedTuple):
    """One timed slice of the step on worker ``rank``: compute (``F``/``B``), a ``send`` to
    ``peer_stage``, or the gradient ``allreduce`` (``micro_batch`` is None). A named tuple: a
    1024-device step has ~10^5 of them."""

    rank: int
    stage: int
    kind: str
    micro_batch: Optional[int]
    start_ms: float
    end_ms: float
    peer_stage: Optional[int] = None

    @property
    def duration_ms(self) -> float:
        return self.end_ms - self.start_ms

    @property
    def label(self) -> str:
        if self.kind == "allreduce":
            return "all-reduce"
        if self.kind == "send":
            return f"send {self.micro_batch} -> stage {self.peer_stage}"
        return f"{self.kind}{self.micro_batch}"


class GradientBucket(NamedTuple):
    """One gradient bucket of a data-parallel group: ready once every member has run
    ``ready_fraction`` (0..1) of its last backward; its all-reduce takes ``allreduce_ms``;
    ``nbytes`` is what it carries (for display)."""

    ready_fraction: float
    allreduce_ms: float
    nbytes: float = 0.0


@dataclass(frozen=True)
class WorkerTime:
    """Where one worker's step went. ``idle_ms`` is waiting: for inputs (pipeline bubbles), for a
    slower tensor-parallel peer, or for slower data-parallel peers before the all-reduce.
    ``allreduce_ms`` is the gradient all-reduce time after the worker's own compute ended (all of
    it without overlap), ``hidden_allreduce_ms`` the part overlapped with its backward."""

    rank: int
    device: str
    replica: int
    stage: int
    compute_ms: float
    allreduce_ms: float
    idle_ms: float
    peak_in_flight: int
    hidden_allreduce_ms: float = 0.0

    @property
    def busy_ms(self) -> float:
        return self.compute_ms + self.allreduce_ms


@dataclass(frozen=True)
class SimResult:
    """One simulated step: its time, where each worker's time went, and every timed slice."""

    schedule: str                  # the plan's, or "gradient accumulation" for a single stage
    num_micro_batch: int
    global_batch_size: int
    step_time_ms: float
    bubble_fraction: float         # idle share of all workers' device time during the step
    workers: list[WorkerTime]
    events: list[SimEvent]

    @property
    def throughput(self) -> float:
        """Samples per second."""
        return self.global_batch_size / self.step_time_ms * 1e3 if self.step_time_ms > 0 else 0.0

    @property
    def prediction(self) -> Prediction:
        return Prediction(self.step_time_ms, self.bubble_fraction, self.throughput)

    def summary(self) -> str:
        rows = [
            [w.rank, w.device, w.replica, w.stage, f"{w.compute_ms:.2f}", f"{w.allreduce_ms:.2f}",
             f"{w.idle_ms:.2f}", f"{100 * w.idle_ms / self.step_time_ms if self.step_time_ms else 0:.1f}%",
             w.peak_in_flight]
            for w in self.workers
        ]
        return format_table(
            ["rank", "device", "replica", "stage", "compute ms", "all-reduce ms", "idle ms", "idle", "in flight"],
            rows,
            title=(f"simulated step ({self.schedule}, {self.num_micro_batch} micro-batch(es)): "
                   f"{self.step_time_ms:.2f} ms, bubble {100 * self.bubble_fraction:.1f}%, "
                   f"{self.throughput:.1f} samples/s"),
        )


@dataclass
class _Group:
    """A tensor-parallel group: the unit that executes actions. ``inputs[kind]`` lists the
    channels an action of that kind receives on, with their number of sending groups;
    ``outputs[kind]`` the channels it sends on, with the peer stage, per-micro-batch times and
    number of sending groups (its own stage's)."""

    replica: int
    stage: int
    members: list[Worker]          # sorted by tp_index; members[0] sends
    actions: list[Action]
    inputs: dict[str, list[tuple[int, int]]]
    outputs: dict[str, list[tuple[int, int, list[float], int]]]
    pc: int = 0
    free_ms: float = 0.0


def simulate(plan: Plan, record_events: bool = True,
             buckets: Optional[Mapping[GroupKey, Sequence[GradientBucket]]] = None) -> SimResult:
    """Simulate one step of ``plan``; raises :class:`~planner.validate.ScheduleError` if it cannot run.

    ``record_events=False`` keeps only the times (``SimResult.events`` stays empty): the planner's
    predictions need no timeline, and on thousands of workers the events dominate the cost.
    ``buckets`` maps a data-parallel group ``(stage, tp_index)`` to its gradient buckets in
    all-reduce order; their all-reduces overlap with the last backward (module docstring). A group
    left out all-reduces after its backward, taking ``Worker.allreduce_ms``.
    """
    validate_plan(plan)
    _check_buckets(plan, buckets)
    groups = _groups(plan)
    events: list[SimEvent] = []
    compute: dict[int, float] = defaultdict(float)
    # (channel, micro_batch) -> [sends arrived, latest arrival ms]
    arrivals: dict[tuple[int, int], list] = defaultdict(lambda: [0, 0.0])
    waiting: dict[tuple[int, int], list[_Group]] = defaultdict(list)
    link_free: dict[tuple[int, str], float] = defaultdict(float)
    last_backward: dict[int, tuple[float, float]] = {}
    ready = deque(groups)

    def run(g: _Group, a: Action) -> bool:
        """Run ``a`` on ``g`` if its inputs have all arrived, else park ``g`` on the first missing one."""
        m = a.micro_batch
        start = g.free_ms
        for channel, senders in g.inputs[a.kind]:
            arrived = arrivals[channel, m]
            if arrived[0] < senders:
                waiting[channel, m].append(g)
                return False
            start = max(start, arrived[1])
        end = start
        for w in g.members:
            took = (w.forward_ms if a.kind == "F" else w.backward_ms)[m]
            compute[w.rank] += took
            if a.kind == "B":
                last_backward[w.rank] = (start, start + took)
            if record_events:
                events.append(SimEvent(w.rank, g.stage, a.kind, m, start, start + took))
            end = max(end, start + took)
        g.free_ms = end
        sender = g.members[0].rank
        for channel, peer, transfer_ms, senders in g.outputs[a.kind]:
            begin = max(end, link_free[sender, a.kind])
            done = begin + (transfer_ms[m] if transfer_ms else 0.0)
            link_free[sender, a.kind] = done
            if record_events:
                events.append(SimEvent(sender, g.stage, "send", m, begin, done, peer))
            arrived = arrivals[channel, m]
            arrived[0] += 1
            arrived[1] = max(arrived[1], done)
            if arrived[0] == senders:  # complete: wake the groups waiting for it
                ready.extend(waiting.pop((channel, m), ()))
        return True

    while ready:
        g = ready.popleft()
        while g.pc < len(g.actions) and run(g, g.actions[g.pc]):
            g.pc += 1

    stalled = [g for g in groups if g.pc < len(g.actions)]
    if stalled:  # validate_plan proves this cannot happen; guard against a plan it misjudges
        raise ScheduleError("simulation stalled: " + "; ".join(
            f"replica {g.replica} stage {g.stage} at {g.actions[g.pc]}" for g in stalled))

    finish = {w.rank: g.free_ms for g in groups for w in g.members}
    allreduce = _allreduce(plan, finish, last_backward, buckets or {}, events if record_events else None)
    step_ms = max(finish.values())
    return _result(plan, groups, events, compute, allreduce, step_ms)


def _groups(plan: Plan) -> list[_Group]:
    """The tensor-parallel groups of ``plan`` with their action lists and channels. A channel is
    one direction of one boundary in one replica: forwards of the boundary's source stage send
    on it, forwards of its destination receive; backwards the other way round."""
    members = defaultdict(list)
    for w in plan.workers:
        members[w.replica, w.stage, w.dp_index].append(w)
    num_groups = defaultdict(int)
    for replica, stage, _ in members:
        num_groups[replica, stage] += 1
    num_stages = len(plan.stages)
    stage_lists = (build_schedule(plan.schedule, num_stages, plan.num_micro_batch) if num_stages > 1 else None)
    out = []
    for (replica, stage, _), ws in sorted(members.items()):
        ws.sort(key=lambda w: w.tp_index)
        actions = stage_lists[stage] if stage_lists else gradient_accumulation(len(ws[0].forward_ms))
        inputs: dict[str, list] = {"F": [], "B": []}
        outputs: dict[str, list] = {"F": [], "B": []}
        for i, b in enumerate(plan.boundaries):
            forward = 2 * (replica * len(plan.boundaries) + i)
            backward = forward + 1
            src_groups, dst_groups = num_groups[replica, b.src_stage], num_groups[replica, b.dst_stage]
            if b.dst_stage == stage:
                inputs["F"].append((forward, src_groups))
                outputs["B"].append((backward, b.src_stage, b.transfer_ms, dst_groups))
            if b.src_stage == stage:
                outputs["F"].append((forward, b.dst_stage, b.transfer_ms, src_groups))
                inputs["B"].append((backward, dst_groups))
        out.append(_Group(replica, stage, ws, actions, inputs, outputs))
    return out


def _allreduce(plan: Plan, finish: dict[int, float], last_backward: dict[int, tuple[float, float]],
               buckets: Mapping[GroupKey, Sequence[GradientBucket]],
               events: Optional[list[SimEvent]]) -> dict[int, tuple[float, float]]:
    """Run each data-parallel group's gradient all-reduce, bucket by bucket (one bucket after the
    backward when ``buckets`` has none for the group); updates ``finish``, returns per rank the
    (exposed, hidden) all-reduce time."""
    peers = defaultdict(list)
    for w in plan.workers:
        peers[w.stage, w.tp_index].append(w)
    took = {}
    for key, ws in peers.items():
        own = buckets.get(key)
        if own is None:
            own = [GradientBucket(1.0, max(w.allreduce_ms for w in ws))]
        spans = []
        previous_end = 0.0
        for bucket in own:
            ready = max(start + bucket.ready_fraction * (end - start)
                        for start, end in (last_backward[w.rank] for w in ws))
            start = max(ready, previous_end)
            previous_end = start + bucket.allreduce_ms
            if bucket.allreduce_ms > 0:
                spans.append((start, previous_end))
        for w in ws:
            compute_end = finish[w.rank]
            exposed = sum(end - max(start, compute_end) for start, end in spans if end > compute_end)
            took[w.rank] = (exposed, sum(end - start for start, end in spans) - exposed)
            if spans:
                if events is not None:
                    events.extend(SimEvent(w.rank, w.stage, "allreduce", None, start, end) for start, end in spans)
                finish[w.rank] = max(compute_end, spans[-1][1])
    return took


def _check_buckets(plan: Plan, buckets: Optional[Mapping[GroupKey, Sequence[GradientBucket]]]) -> None:
    """Every bucket belongs to a data-parallel group of the plan and has usable figures."""
    if not buckets:
        return
    groups = {(w.stage, w.tp_index) for w in plan.workers}
    for key, own in buckets.items():
        if key not in groups:
            raise ScheduleError(f"buckets: no data-parallel group (stage, tp_index) = {key!r} in the plan; groups: "
                                f"{sorted(groups)}; build the buckets for this plan (planner.gradient_buckets)")
        for k, bucket in enumerate(own):
            fraction, ms = bucket.ready_fraction, bucket.allreduce_ms
            if not (isinstance(fraction, (int, float)) and 0.0 <= fraction <= 1.0):
                raise ScheduleError(f"buckets[{key!r}][{k}].ready_fraction must be in [0, 1] (the share of the "
                                    f"last backward run before the bucket is ready), got {fraction!r}")
            if not (isinstance(ms, (int, float)) and 0.0 <= ms < float("inf")):
                raise ScheduleError(f"buckets[{key!r}][{k}].allreduce_ms must be a finite number >= 0, got {ms!r}")


def _result(plan: Plan, groups: list[_Group], events: list[SimEvent], compute: dict[int, float],
            allreduce: dict[int, float], step_ms: float) -> SimResult:
    in_flight = {w.rank: max_in_flight(g.actions) for g in groups for w in g.members}
    workers = [
        WorkerTime(w.rank, w.device, w.replica, w.stage, compute[w.rank], allreduce[w.rank][0],
                   max(step_ms - compute[w.rank] - allreduce[w.rank][0], 0.0), in_flight[w.rank],
                   allreduce[w.rank][1])
        for w in plan.workers
    ]
    total = step_ms * len(workers)
    bubble = sum(w.idle_ms for w in workers) / total if total > 0 else 0.0
    events.sort(key=attrgetter("start_ms", "rank"))
    log.debug("simulated %d workers: %.3f ms, bubble %.3f", len(workers), step_ms, bubble)
    schedule = plan.schedule if len(plan.stages) > 1 else "gradient accumulation"
    return SimResult(schedule, plan.num_micro_batch, plan.global_batch_size, step_ms, bubble, workers, events)
