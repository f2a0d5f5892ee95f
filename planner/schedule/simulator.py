"""Simulate one training step of a :class:`~planner.plan.Plan`: step time, bubbles, a timeline.

The planner predicts a plan's speed with this simulator, and the CLI draws its timeline, so the
model of execution is the runtime's:

* Every worker runs its stage's program (:mod:`planner.schedule.program`: the schedule's compute
  actions with every send and receive written out, the lists the deadlock proof proves and the
  runtime runs) in order; a single-stage plan is gradient accumulation over each worker's own
  micro-batches.
* The workers of one tensor-parallel group (same replica, stage and ``dp_index``) move in
  lockstep: an action starts when the whole group may start it and ends when its slowest member
  ends (their collectives inside the segment wait for it).
* A receive (``RECV_F m <- p``, ``RECV_B m <- c``) waits until micro-batch ``m``'s activations (or
  gradients) from that stage have arrived, and the compute after it starts no earlier; compute
  takes the slowest member's time (``F``: ``Worker.forward_ms``, ``B``: ``backward_ms``; a split
  backward's ``BI`` its :func:`planner.schedule.program.input_share` of it, ``BW`` the rest). A send
  (``SEND_F``, ``SEND_B``) leaves when the compute before it ended and never blocks
  (``isend``). With ``network`` (what :func:`planner.assemble.predict` and the CLI pass: the
  cluster's network) a boundary is the cross-mesh resharding the runtime runs under
  ``Plan.resharding`` (:mod:`planner.schedule.boundary_traffic`; backward: the same boundary
  reversed): each of its transfers leaves its sender's group at the send (the runtime posts
  a boundary's sends at once then, in the plan's order, unpaced: ``ReshardProgram.post_sends``; the
  plan's start offsets assume every sender ready at once, which a pipeline's senders are not) and
  takes the first gap at or after that in which its devices and the host network interfaces it
  crosses are all free (interfaces are serial, :mod:`planner.devices.network`); a receiving group's
  input is complete when every transfer to one of its members has arrived. Without ``network`` (or
  on a boundary that carries no bytes), a group sends once per boundary and micro-batch, through its
  first member, to every group of the peer stage in its replica; one worker's sends in one direction
  share its link and go one after another, each taking ``BoundaryPlan.transfer_ms`` (free when the
  plan left it empty).
* Split backwards (ZB-H1, or ``Plan.delay_weight_gradients``, on the stages that can split:
  :func:`planner.schedule.program.splits_backward`): the input gradients leave after the input half
  and the weight half runs where the program puts it (right after the sends under delayed weight
  gradients; deferred into the bubbles under ZB-H1); DDP's buckets fill in the last weight half.
* Each data-parallel group of a stage (every worker with that stage and ``tp_index``, over groups
  and replicas) all-reduces its gradients once per step. Without ``buckets`` the all-reduce starts
  when all members have finished their last backward and takes the largest ``Worker.allreduce_ms``
  among them. With ``buckets`` (:class:`~planner.schedule.gradient_buckets.GradientBucket`, built
  from the model by :func:`planner.schedule.gradient_buckets.gradient_buckets`: DDP's buckets in
  reverse layer order), it overlaps with the last backward bucket by bucket, as DDP's does:
  bucket ``k`` is ready when every member has run ``ready_fraction`` of its last backward (its last
  action computing weight gradients: ``B``, or a split backward's ``BW``; the layers it covers), its all-reduce starts once it is ready and bucket ``k - 1``'s has ended (one
  process group runs them in order), and the group's step ends when the last bucket's ends. A
  worker's ``allreduce_ms`` in the result is then the exposed part, after its own compute;
  ``hidden_allreduce_ms`` the rest.
  With ``network`` and no ``buckets``, the buckets are DDP's from ``Worker.gradient_bytes``
  (:func:`planner.schedule.gradient_buckets.plan_buckets`), as the runtime overlaps them.
* The optimizer's update (``Worker.update_ms``: the bytes of parameters the worker updates at its
  device's measured rate, :func:`planner.devices.cost_model.update_ms`; 0 when unmeasured) runs on
  each worker after its last collective, and its next step starts when it ends. The simulated step
  is the steady state: each worker starts with its update of the step before (time 0 is the end of
  the previous step's collectives), so a worker that updates faster computes sooner, and a
  data-parallel step takes ``max(update + compute) + all-reduce`` over its workers, not the slowest
  compute plus the slowest update (a P-Reduce worker updates before its exchange; the sum is the
  same).
* A P-Reduce stage (``StagePlan.replica_sync`` ``"partial"``) all-reduces no gradients: after its
  optimizer step each worker averages its parameters with a group of ``partial_group_size``
  (runtime.replicas.partial_sync). Each worker's exchange starts when its own compute ends (it
  waits for its group only, and the members of a balanced plan end together) and takes its own
  ``Worker.allreduce_ms``, which the planner prices as an all-reduce among the group's members over
  the links between them (``planner.assemble._partial_allreduce_ms``: the message volume of a
  ``g``-member ring, not the whole data-parallel group's); no bucket overlaps the backward.
* A pipeline or tensor-parallel step (``Plan.kind`` not ``"data_parallel"``) ends with the loss's all-reduce
  over every rank (runtime.parallel.pipeline: the step's loss and the Engine's figures riding with it,
  :data:`STEP_LOSS_BYTES` a rank), priced on ``network`` as a ring over the ranks in order after the last
  rank's last action (0 without a network); a data-parallel step's loss rides its gradient buckets.
  Not modeled: the all-reduces of different data-parallel groups (stages, shards) sharing a host's
  network interface, all-reduce traffic slowing concurrent boundary sends, and a broadcast's
  forwarding receivers being busy with compute (the runtime forwards when the rank gets to it).

Processing order does not change the times without a network: every resource (a group's device
time, a worker's link) is used in program order, so each action's start is the maximum of known
finish times. With one, transfers of different groups meet on host interfaces in the order the
simulator reaches them; first-fit placement keeps an early transfer from waiting behind a later
one, but two transfers competing for one gap go in processing order.
A group whose next action lacks an input parks on that input's channel and is woken when every
sender has sent; the work is linear in the number of actions, which keeps 1024-device plans fast.
"""
from __future__ import annotations

import logging
from collections import defaultdict, deque
from bisect import bisect_right
from dataclasses import dataclass, field
from operator import add, attrgetter
from typing import Mapping, NamedTuple, Optional, Sequence

from whalelike.display import format_table

from planner.devices.network import NetworkModel
from planner.groups import group_key, member_order
from planner.plan import Plan, Prediction, Worker
from planner.schedule.actions import Action, gradient_accumulation, max_in_flight
from planner.schedule.boundary_traffic import plan_traffic
from planner.schedule.deadlock import ScheduleError, validate_plan
from planner.schedule.gradient_buckets import GradientBucket, GroupKey, plan_buckets
from planner.schedule.program import input_share

log = logging.getLogger(__name__)
# bytes a rank contributes to a pipeline step's closing all-reduce: the loss, and the straggler monitor's
# figures the Engine lets ride with it (runtime.parallel.pipeline); latency-bound at any such size
STEP_LOSS_BYTES = 16.0


class SimEvent(NamedTuple):
    """One timed slice of the step on worker ``rank``: compute (``F``/``B``), a ``send`` to
    ``peer_stage``, the gradient ``allreduce`` or the optimizer's ``update`` (``micro_batch`` None). A named tuple: a
    1024-device step has ~10^5 of them."""

    rank: int
    stage: int
    kind: str
    micro_batch: Optional[int]
    start_ms: float
    end_ms: float
    peer_stage: Optional[int] = None
    detail: str = ""               # a resharding send's strategy, unit task and receivers
    nics: tuple[str, ...] = ()     # the host interfaces a resharding send holds: "host out", "host in"

    @property
    def duration_ms(self) -> float:
        return self.end_ms - self.start_ms

    @property
    def label(self) -> str:
        if self.kind == "allreduce":
            return "all-reduce"
        if self.kind == "update":
            return "optimizer update"
        if self.kind == "send":
            return f"send {self.micro_batch} -> stage {self.peer_stage}" + (f" ({self.detail})" if self.detail else "")
        return f"{self.kind}{self.micro_batch}"


@dataclass(frozen=True)
class WorkerTime:
    """Where one worker's step went. ``idle_ms`` is waiting: for inputs (pipeline bubbles), for a
    slower tensor-parallel peer, or for slower data-parallel peers before the all-reduce.
    ``allreduce_ms`` is the gradient all-reduce time after the worker's own compute ended (all of
    it without overlap), ``hidden_allreduce_ms`` the part overlapped with its backward; ``update_ms`` the
    optimizer's update after it (``Worker.update_ms``)."""

    rank: int
    device: str
    replica: int
    stage: int
    compute_ms: float
    allreduce_ms: float
    idle_ms: float
    peak_in_flight: int
    hidden_allreduce_ms: float = 0.0
    update_ms: float = 0.0

    @property
    def busy_ms(self) -> float:
        return self.compute_ms + self.allreduce_ms + self.update_ms


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
    # with a network: each boundary's resharding of micro-batch 0, forward and backward
    # (planner.schedule.boundary_traffic.BoundaryTraffic)
    reshardings: tuple = ()

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
    """A tensor-parallel group: the unit that executes actions (its stage's program). ``inputs[(direction,
    peer)]`` lists the channels a receive from ``peer`` waits on, with the number of arrivals that
    complete each per micro-batch; ``outputs[(direction, peer)]`` the channels a send to ``peer``
    uses without a network (per-micro-batch times, number of sending groups), ``traffic[(direction,
    peer)]`` the boundaries ``(index, direction, peer stage)`` whose resharding sends it makes with
    one. ``share``: the input half's share of a split backward (:func:`planner.schedule.program.input_share`)."""

    index: int
    replica: int
    stage: int
    members: list[Worker]          # sorted by tp_index; members[0] sends
    actions: Sequence[Action]
    inputs: dict[tuple[str, int], list[tuple[tuple, Sequence[int]]]]
    outputs: dict[tuple[str, int], list[tuple[tuple, list[float], int]]]
    traffic: dict[tuple[str, int], list[tuple[int, str, int]]] = field(default_factory=dict)
    share: float = 0.5
    pc: int = 0
    free_ms: float = 0.0
    ready_ms: float = 0.0          # the latest arrival the next compute action waits for
    longest: dict[str, list[float]] = field(default_factory=dict)   # kind -> per micro-batch, slowest member
    last_weights: Optional[tuple[str, int, float]] = None           # (B or BW, micro-batch, start) of the last run


class _Resources:
    """Busy intervals of each device and host interface; a send takes the earliest gap, at or after
    its ready time, in which all of its resources are free (first fit: the order in which the
    simulator happens to place sends does not make an early one wait behind a later one). Touching
    intervals are merged into one busy block (a thousand back-to-back sends on one host interface
    are one interval to skip, not a thousand).
    :meth:`slots` resolves a send's resources to their interval lists once (sends repeat every
    micro-batch)."""

    def __init__(self):
        self.busy: dict[tuple, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
        self._slots: dict[tuple, tuple] = {}

    def slots(self, resources: tuple) -> tuple:
        """The (starts, ends) interval lists of ``resources``, in their order."""
        found = self._slots.get(resources)
        if found is None:
            found = self._slots[resources] = tuple(self.busy[r] for r in resources)
        return found

    @staticmethod
    def place_on(slots: tuple, ready: float, duration: float) -> float:
        """Place a send of ``duration`` holding the interval lists ``slots`` (:meth:`slots`) at the
        first gap at or after ``ready``; returns its start."""
        if duration <= 0:
            return ready
        start, moved = ready, True
        while moved:
            moved = False
            for starts, ends in slots:
                if not ends or ends[-1] <= start:   # the common case: free from here on
                    continue
                k = bisect_right(ends, start)
                if starts[k] < start + duration:
                    start, moved = ends[k], True
        end = start + duration
        for starts, ends in slots:
            # intervals that touch are kept as one busy block, so the search above jumps over a run of
            # back-to-back sends in one step (a gap of zero width holds no send: the same placements)
            k = bisect_right(starts, start)
            joins_before = k > 0 and ends[k - 1] >= start
            joins_after = k < len(starts) and starts[k] <= end
            if joins_before and joins_after:
                ends[k - 1] = max(ends[k], end)
                del starts[k], ends[k]
            elif joins_before:
                ends[k - 1] = max(ends[k - 1], end)
            elif joins_after:
                starts[k] = start
                ends[k] = max(ends[k], end)
            else:
                starts.insert(k, start)
                ends.insert(k, end)
        return start


def simulate(plan: Plan, record_events: bool = True,
             buckets: Optional[Mapping[GroupKey, Sequence[GradientBucket]]] = None,
             network=None) -> SimResult:
    """Simulate one step of ``plan``; raises :class:`~planner.schedule.deadlock.ScheduleError` if it cannot run.

    ``record_events=False`` keeps only the times (``SimResult.events`` stays empty): the planner's
    predictions need no timeline, and on thousands of workers the events dominate the cost.
    ``buckets`` maps a data-parallel group ``(stage, tp_index)`` to its gradient buckets in
    all-reduce order; their all-reduces overlap with the last backward (module docstring). A group
    left out all-reduces after its backward, taking ``Worker.allreduce_ms``.
    ``network`` (a :class:`planner.devices.network.NetworkModel` or the :class:`whalelike.cluster.Cluster`
    the plan was made for) prices the step as the runtime runs it on that network: boundary
    transfers are the resharding ``Plan.resharding`` chooses, queued on devices and host
    interfaces, and, unless ``buckets`` says otherwise, every group with ``Worker.gradient_bytes``
    all-reduces in DDP's buckets overlapped with its backward.
    """
    programs = validate_plan(plan)
    _check_buckets(plan, buckets)
    traffic: dict = {}
    if network is not None:
        network = network if isinstance(network, NetworkModel) else NetworkModel.of_cluster(network)
        traffic = plan_traffic(plan, network)
        if buckets is None:
            buckets = plan_buckets(plan, network)
    resources = _Resources()
    place_on = resources.place_on
    groups, routes = _groups(plan, programs, traffic, resources)
    rank_of_device = {w.device: w.rank for w in plan.workers}
    events: list[SimEvent] = []
    # (channel, micro_batch) -> [arrivals, latest arrival ms]
    arrivals: dict[tuple, list] = defaultdict(lambda: [0, 0.0])
    waiting: dict[tuple, list[_Group]] = defaultdict(list)
    link_free: dict[tuple[int, str], float] = defaultdict(float)
    ready = deque(groups)
    for g in groups:   # the steady state: each worker's step starts after its own update of the step before
        g.free_ms = max(w.update_ms for w in g.members)
        if record_events:
            events.extend(SimEvent(w.rank, w.stage, "update", None, 0.0, w.update_ms) for w in g.members
                          if w.update_ms > 0)

    def arrive(channel: tuple, m: int, done: float, expected: int) -> None:
        arrived = arrivals[channel, m]
        arrived[0] += 1
        arrived[1] = max(arrived[1], done)
        if arrived[0] == expected:  # complete: wake the groups waiting for it
            ready.extend(waiting.pop((channel, m), ()))

    def receive(g: _Group, a: Action) -> bool:
        """A receive: done once its channels are complete (their latest arrival is what the next
        compute waits for), else park ``g`` on the first missing one."""
        m = a.micro_batch
        for channel, expected in g.inputs[a.direction, a.peer]:
            arrived = arrivals[channel, m]
            if arrived[0] < expected[m]:
                waiting[channel, m].append(g)
                return False
            if arrived[1] > g.ready_ms:
                g.ready_ms = arrived[1]
        return True

    def compute(g: _Group, a: Action) -> None:
        m, kind = a.micro_batch, a.kind
        start = g.free_ms if g.free_ms > g.ready_ms else g.ready_ms
        g.ready_ms = 0.0
        if record_events:
            end = start
            for w in g.members:
                took = _took(w, kind, m, g.share)
                events.append(SimEvent(w.rank, g.stage, kind, m, start, start + took))
                end = max(end, start + took)
        else:   # the slowest member's time, priced once per group (see _Group.longest)
            end = start + g.longest[kind][m]
        if kind == "B" or kind == "BW":
            g.last_weights = (kind, m, start)
        g.free_ms = end

    def send(g: _Group, a: Action) -> None:
        """A send: its transfers leave when the compute before it ended (the runtime posts them
        then, unpaced) and arrive at the receiving groups' channels."""
        m, direction, key = a.micro_batch, a.direction, (a.direction, a.peer)
        sent = g.free_ms
        outputs = g.outputs.get(key)
        if outputs:
            sender = g.members[0].rank
            for channel, transfer_ms, senders in outputs:
                begin = max(sent, link_free[sender, direction])
                done = begin + (transfer_ms[m] if transfer_ms else 0.0)
                link_free[sender, direction] = done
                if record_events:
                    events.append(SimEvent(sender, g.stage, "send", m, begin, done, a.peer))
                arrive(channel, m, done, senders)
        for index, way, peer in g.traffic.get(key, ()):
            own, counts = routes[index, way, m]
            for transfer, slots, receivers in own.get(g.index, ()):
                begin = place_on(slots, sent, transfer.duration_ms)
                done = begin + transfer.duration_ms
                if record_events:
                    events.append(SimEvent(rank_of_device[transfer.sender], g.stage, "send", m, begin, done, peer,
                                           _send_detail(transfer), _nics(transfer)))
                for receiver in receivers:
                    arrive(("reshard", index, way, receiver), m, done, counts[receiver])

    while ready:
        g = ready.popleft()
        actions = g.actions
        while g.pc < len(actions):
            a = actions[g.pc]
            if a.peer is None:
                compute(g, a)
            elif a.kind[0] == "R":   # RECV_F, RECV_B
                if not receive(g, a):
                    break
            else:
                send(g, a)
            g.pc += 1

    stalled = [g for g in groups if g.pc < len(g.actions)]
    if stalled:  # validate_plan proves this cannot happen; guard against a plan it misjudges
        raise ScheduleError("simulation stalled: " + "; ".join(
            f"replica {g.replica} stage {g.stage} at {g.actions[g.pc]}" for g in stalled))

    finish = {w.rank: g.free_ms for g in groups for w in g.members}
    compute_ms, last_backward = _member_times(groups)
    allreduce = _allreduce(plan, finish, last_backward, buckets or {}, events if record_events else None)
    step_ms = max(finish.values())
    if network is not None and plan.kind != "data_parallel":   # the loss's all-reduce over every rank
        ranks = sorted(plan.workers, key=lambda w: w.rank)
        step_ms += network.ring_allreduce_ms(STEP_LOSS_BYTES * len(ranks), [w.device for w in ranks])
    reshardings = tuple(per_micro_batch[0] for per_micro_batch in traffic.values() if per_micro_batch[0] is not None)
    return _result(plan, groups, events, compute_ms, allreduce, step_ms, reshardings)


def _took(w: Worker, kind: str, m: int, share: float) -> float:
    """Worker ``w``'s time for compute action ``kind`` of micro-batch ``m`` (a split backward's
    halves: ``share`` of its backward time, and the rest), each with the worker's cost outside its
    compute segments per action (``Worker.action_overhead_ms``)."""
    if kind == "F":
        return w.forward_ms[m] + w.action_overhead_ms
    if kind == "B":
        return w.backward_ms[m] + w.action_overhead_ms
    return w.backward_ms[m] * (share if kind == "BI" else 1.0 - share) + w.action_overhead_ms


def _member_times(groups: list[_Group]) -> tuple[dict[int, float], dict[int, tuple[float, float]]]:
    """Per rank, after the run: its compute time (summed in its action order, as it ran) and the
    (start, end) of its last action that computes weight gradients (a whole backward, or a weight
    half), from the group's start of it: DDP's buckets fill while it runs."""
    compute: dict[int, float] = {}
    last_backward: dict[int, tuple[float, float]] = {}
    for g in groups:
        for w in g.members:
            total = 0.0
            for a in g.actions:
                if a.peer is None:
                    total += _took(w, a.kind, a.micro_batch, g.share)
            compute[w.rank] = total
            if g.last_weights is not None:
                kind, m, start = g.last_weights
                last_backward[w.rank] = (start, start + _took(w, kind, m, g.share))
    return compute, last_backward


def _send_detail(send) -> str:
    chunks = f", {send.chunks} chunks" if send.chunks > 1 else ""
    return f"{send.strategy} task {send.task}{chunks} -> {','.join(send.receivers)}"


def _nics(send) -> tuple[str, ...]:
    """``("A out", "B in")``: the host interfaces a send holds, outgoing ones first."""
    return tuple(f"{host} {way}" for way in ("out", "in") for kind, host in send.resources if kind == way)


def _routes(traffic: dict, group_of_device: dict[str, int], resources: _Resources
            ) -> dict[tuple[int, str, int], tuple[dict, dict]]:
    """``(boundary, direction, micro-batch) -> (sending group -> [(send, its resources' interval
    lists, receiving groups)], receiving group -> number of sends it waits for)``.

    Resources that every send holds together (a tensor-parallel group receiving a broadcast: its
    devices appear in the same sends and no other) have the same busy intervals at every moment,
    so one interval list stands for all of them: a send is placed at the same time (the earliest
    start free on all of its resources, whatever their order) on a third of the lists."""
    users: dict[tuple, list[int]] = defaultdict(list)
    seen: set[int] = set()
    for per_micro_batch in traffic.values():
        for boundary in per_micro_batch:
            if boundary is None or id(boundary) in seen:
                continue
            seen.add(id(boundary))
            for send in boundary.sends:
                for resource in send.resources:
                    users[resource].append(id(send))
    standing_for: dict[tuple, tuple] = {}   # the sends that hold a resource -> the resource that stands for it
    stands = {r: standing_for.setdefault(tuple(ids), r) for r, ids in users.items()}
    out = {}
    shared: dict[int, tuple[dict, dict]] = {}   # micro-batches that look alike share one traffic object
    for (index, direction), per_micro_batch in traffic.items():
        for m, boundary in enumerate(per_micro_batch):
            if boundary is None:
                continue
            if id(boundary) not in shared:
                own: dict[int, list] = defaultdict(list)
                counts: dict[int, int] = defaultdict(int)
                for send in boundary.sends:
                    receivers = sorted({group_of_device[d] for d in send.receivers})
                    held = tuple(dict.fromkeys(stands[r] for r in send.resources))
                    own[group_of_device[send.sender]].append((send, resources.slots(held), receivers))
                    for receiver in receivers:
                        counts[receiver] += 1
                shared[id(boundary)] = (dict(own), dict(counts))
            out[index, direction, m] = shared[id(boundary)]
    return out


def _groups(plan: Plan, programs, traffic: dict, resources: _Resources) -> tuple[list[_Group], dict]:
    """The tensor-parallel groups of ``plan`` with their programs (``programs``, the proven ones of
    :func:`planner.schedule.deadlock.validate_plan`; None for a single stage: each worker's gradient
    accumulation) and channels, and the resharding sends between them (:func:`_routes`). Without a
    network (or for a boundary that carries nothing) a channel is one direction of one boundary in
    one replica: the boundary's source stage sends forward on it and its destination receives;
    backward the other way round. With one, a receiving group has a channel per boundary and
    direction, completed by the resharding sends that name one of its members."""
    members = defaultdict(list)
    for w in plan.workers:
        members[group_key("tp", w)].append(w)
    group_of_device = {w.device: index for index, key in enumerate(sorted(members)) for w in members[key]}
    routes = _routes(traffic, group_of_device, resources)

    def expected(boundary: int, direction: str, group: int) -> list[int]:
        """How many resharding sends name one of ``group``'s members, per micro-batch."""
        return [routes[boundary, direction, m][1].get(group, 0) for m in range(num_micro_batch)]

    num_groups = defaultdict(int)
    for replica, stage, _ in members:
        num_groups[replica, stage] += 1
    num_micro_batch = plan.num_micro_batch
    shares = [input_share(plan, s) for s in range(len(plan.stages))]
    shipped_boundaries = {i for (i, direction), per_micro_batch in traffic.items()
                          if direction == "forward" and all(t is not None for t in per_micro_batch)}
    out = []
    for index, ((replica, stage, _), ws) in enumerate(sorted(members.items())):
        ws.sort(key=lambda w: member_order("tp", w))
        actions = programs[stage] if programs is not None else gradient_accumulation(len(ws[0].forward_ms))
        inputs: dict[tuple[str, int], list] = defaultdict(list)
        outputs: dict[tuple[str, int], list] = defaultdict(list)
        sends: dict[tuple[str, int], list] = defaultdict(list)
        for i, b in enumerate(plan.boundaries):
            forward = ("plain", replica, i, "forward")
            backward = ("plain", replica, i, "backward")
            src_groups, dst_groups = num_groups[replica, b.src_stage], num_groups[replica, b.dst_stage]
            shipped = i in shipped_boundaries
            if b.dst_stage == stage:
                if shipped:
                    inputs["F", b.src_stage].append((("reshard", i, "forward", index), expected(i, "forward", index)))
                    sends["B", b.src_stage].append((i, "backward", b.src_stage))
                else:
                    inputs["F", b.src_stage].append((forward, [src_groups] * num_micro_batch))
                    outputs["B", b.src_stage].append((backward, b.transfer_ms, dst_groups))
            if b.src_stage == stage:
                if shipped:
                    inputs["B", b.dst_stage].append((("reshard", i, "backward", index),
                                                     expected(i, "backward", index)))
                    sends["F", b.dst_stage].append((i, "forward", b.dst_stage))
                else:
                    outputs["F", b.dst_stage].append((forward, b.transfer_ms, src_groups))
                    inputs["B", b.dst_stage].append((backward, [dst_groups] * num_micro_batch))
        share = shares[stage]
        over = [w.action_overhead_ms for w in ws]
        backs = list(zip(*(w.backward_ms for w in ws)))
        longest = {"F": [max(map(add, times, over)) for times in zip(*(w.forward_ms for w in ws))],
                   "B": [max(map(add, times, over)) for times in backs],
                   "BI": [max(t * share + o for t, o in zip(times, over)) for times in backs],
                   "BW": [max(t * (1.0 - share) + o for t, o in zip(times, over)) for times in backs]}
        out.append(_Group(index, replica, stage, ws, actions, dict(inputs), dict(outputs), dict(sends), share,
                          longest=longest))
    return out, routes


def _allreduce(plan: Plan, finish: dict[int, float], last_backward: dict[int, tuple[float, float]],
               buckets: Mapping[GroupKey, Sequence[GradientBucket]],
               events: Optional[list[SimEvent]]) -> dict[int, tuple[float, float]]:
    """Run each data-parallel group's gradient all-reduce, bucket by bucket (one bucket after the
    backward when ``buckets`` has none for the group); updates ``finish``, returns per rank the
    (exposed, hidden) all-reduce time."""
    peers = defaultdict(list)
    for w in plan.workers:
        peers[group_key("dp", w)].append(w)
    took = {}
    for key, ws in peers.items():
        if plan.stages[key[0]].replica_sync == "partial":   # P-Reduce: each worker with its own group
            for w in ws:
                start, took[w.rank] = finish[w.rank], (w.allreduce_ms, 0.0)
                finish[w.rank] = start + w.allreduce_ms
                if events is not None and w.allreduce_ms > 0:
                    events.append(SimEvent(w.rank, w.stage, "allreduce", None, start, finish[w.rank]))
            continue
        own = buckets.get(key)
        if own is None:
            own = [GradientBucket(1.0, max(w.allreduce_ms for w in ws))]
        spans = []
        previous_end = 0.0
        backwards = [(start, end - start) for start, end in (last_backward[w.rank] for w in ws)]
        for bucket in own:
            fraction = bucket.ready_fraction
            ready = max(start + fraction * length for start, length in backwards)
            start = max(ready, previous_end)
            previous_end = start + bucket.allreduce_ms
            if bucket.allreduce_ms > 0:
                spans.append((start, previous_end))
        ends = [end for _, end in spans]   # non-decreasing: one process group runs the buckets in order
        total = sum(end - start for start, end in spans)
        for w in ws:
            compute_end = finish[w.rank]
            exposed = sum(end - max(start, compute_end) for start, end in spans[bisect_right(ends, compute_end):])
            took[w.rank] = (exposed, total - exposed)
            if spans:
                if events is not None:
                    events.extend(SimEvent(w.rank, w.stage, "allreduce", None, start, end) for start, end in spans)
                finish[w.rank] = max(compute_end, spans[-1][1])
    return took


def _check_buckets(plan: Plan, buckets: Optional[Mapping[GroupKey, Sequence[GradientBucket]]]) -> None:
    """Every bucket belongs to a data-parallel group of the plan and has usable figures."""
    if not buckets:
        return
    groups = {group_key("dp", w) for w in plan.workers}
    for key, own in buckets.items():
        if key not in groups:
            raise ScheduleError(f"buckets: no data-parallel group (stage, tp_index) = {key!r} in the plan; groups: "
                                f"{sorted(groups)}; build the buckets for this plan (planner.schedule.gradient_buckets)")
        for k, bucket in enumerate(own):
            fraction, ms = bucket.ready_fraction, bucket.allreduce_ms
            if not (isinstance(fraction, (int, float)) and 0.0 <= fraction <= 1.0):
                raise ScheduleError(f"buckets[{key!r}][{k}].ready_fraction must be in [0, 1] (the share of the "
                                    f"last backward run before the bucket is ready), got {fraction!r}")
            if not (isinstance(ms, (int, float)) and 0.0 <= ms < float("inf")):
                raise ScheduleError(f"buckets[{key!r}][{k}].allreduce_ms must be a finite number >= 0, got {ms!r}")


def _result(plan: Plan, groups: list[_Group], events: list[SimEvent], compute: dict[int, float],
            allreduce: dict[int, float], step_ms: float, reshardings: tuple = ()) -> SimResult:
    peaks: dict[int, int] = {}   # groups of one stage share its action list: one count per list
    in_flight: dict[int, int] = {}
    for g in groups:
        if id(g.actions) not in peaks:
            peaks[id(g.actions)] = max_in_flight(g.actions)
        for w in g.members:
            in_flight[w.rank] = peaks[id(g.actions)]
    workers = [
        WorkerTime(w.rank, w.device, w.replica, w.stage, compute[w.rank], allreduce[w.rank][0],
                   max(step_ms - compute[w.rank] - allreduce[w.rank][0] - w.update_ms, 0.0), in_flight[w.rank],
                   allreduce[w.rank][1], w.update_ms)
        for w in plan.workers
    ]
    total = step_ms * len(workers)
    bubble = sum(w.idle_ms for w in workers) / total if total > 0 else 0.0
    events.sort(key=attrgetter("start_ms", "rank"))
    log.debug("simulated %d workers: %.3f ms, bubble %.3f", len(workers), step_ms, bubble)
    schedule = plan.schedule if len(plan.stages) > 1 else "gradient accumulation"
    return SimResult(schedule, plan.num_micro_batch, plan.global_batch_size, step_ms, bubble, workers, events,
                     reshardings)
