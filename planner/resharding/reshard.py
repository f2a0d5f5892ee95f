"""Cross-mesh resharding plans: how a tensor leaving one stage's devices reaches the next stage's.

Why: a stage boundary between differently shaped or differently sharded stage groups (uneven
data-parallel shares, a ``split`` stage's feature shards, replicas on several hosts) is today a
set of plain send/receives. When one sender host feeds many receivers its network interface is
the bottleneck; seed paper 001 (Zhuang et al., sections 2.2-3) cuts the transfer into unit tasks,
sends each with a chunked, pipelined broadcast (the slice crosses each receiving host once), and
balances and orders the tasks over the sender hosts. This module plans that, purely: plain data,
one process, no torch.distributed; the runtime executes the :class:`ReshardPlan`.

Pipeline: :class:`~planner.resharding.spec.ShardingSpec` x2 ->
:func:`~planner.resharding.tasks.unit_tasks` -> per strategy,
:func:`~planner.resharding.cost.transfers` -> :func:`~planner.resharding.order.best_schedule`
-> :class:`ReshardPlan` (the best strategy's schedule, its predicted time and the lower bound).

Invariants (tests/test_resharding_plan.py): every destination device receives exactly its box,
each entry once (its own copy, a local holder's, or one transfer's); under ``allgather`` and
``broadcast`` no slice crosses into one host twice; no device or host interface runs two
transfers at once; the same inputs and seed give the same plan.

Departures from the paper: boxes instead of even GSPMD tiles (uneven shares and shard sizes);
intra-host copies priced; receivers on a host holding the slice fed locally; strategy ``auto``
prices broadcast, all-gather and send/recv (and the cheapest per task) and keeps the fastest
instead of always broadcasting; DFS budget in nodes, not seconds (see resharding_schedule).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from planner.shares.layout import SampleLayout
from planner.devices.network import NetworkError, NetworkModel
from planner.resharding.cost import STRATEGIES, Hop, SliceTransfer, lower_bound_ms, transfers
from planner.resharding.order import Schedule, best_schedule
from planner.resharding.spec import Box, ReshardingError, ShardingSpec, box_text, stage_output_spec, unbatched_rows
from planner.resharding.tasks import UnitTask, unit_tasks

__all__ = ["ReshardPlan", "ScheduledTransfer", "plan_resharding", "boundary_resharding", "unbatched_resharding",
           "ShardingSpec",
           "NetworkModel", "NetworkError", "ReshardingError", "UnitTask", "STRATEGIES"]


@dataclass(frozen=True)
class ScheduledTransfer:
    """One transfer to run: unit task ``task``'s slice ``box`` (``nbytes``) goes from ``sender``
    to ``receivers`` (ring order for a broadcast) by ``strategy``, as the point-to-point ``hops``
    (a broadcast's hops carry the slice in ``chunks`` pipelined pieces; an all-gather's first
    ``len(receivers)`` hops carry one part each, the rest are the intra-host ring), starting at
    ``start_ms`` and ending at ``end_ms`` (predicted)."""

    task: int
    box: Box
    nbytes: float
    strategy: str
    sender: str
    sender_host: str
    receivers: tuple[str, ...]
    hops: tuple[Hop, ...]
    chunks: int
    start_ms: float
    end_ms: float


@dataclass(frozen=True)
class ReshardPlan:
    """The plan of one resharding: unit tasks, transfers in start order, predicted time, bound."""

    shape: tuple[int, ...]
    itemsize: int
    strategy: str                       # the strategy whose plan won ("mixed": cheapest per task)
    algorithm: str                      # the search whose schedule won
    tasks: tuple[UnitTask, ...]
    transfers: tuple[ScheduledTransfer, ...]
    predicted_ms: float
    lower_bound_ms: float
    alternatives_ms: dict               # strategy -> predicted ms of its best schedule
    search_work: int = 0                # the schedule searches' work, summed (planner.resharding.order)

    def deliveries(self) -> dict[str, list[Box]]:
        """Destination device -> the boxes it ends up with (kept, or received), one per transfer."""
        out: dict[str, list[Box]] = {}
        for transfer in self.transfers:
            for device in transfer.receivers:
                out.setdefault(device, []).append(transfer.box)
        return out

    def describe(self) -> str:
        """A header line, then one line per transfer (for ``whalelike plan``'s summary)."""
        total = sum(t.elements for t in self.tasks) * self.itemsize
        others = ", ".join(f"{name} {ms:.3g} ms" for name, ms in self.alternatives_ms.items() if name != self.strategy)
        lines = [f"resharding {self.shape}: {len(self.tasks)} unit task(s), {byte_size(total)}, {self.strategy} "
                 f"({self.algorithm}), predicted {self.predicted_ms:.3g} ms, lower bound "
                 f"{self.lower_bound_ms:.3g} ms" + (f"; {others}" if others else "")]
        for t in self.transfers:
            chunks = f" in {t.chunks} chunks" if t.chunks > 1 else ""
            lines.append(f"  task {t.task} {box_text(t.box)} {byte_size(t.nbytes)} {t.strategy}{chunks}: "
                         f"{t.sender}@{t.sender_host} -> {','.join(t.receivers)} "
                         f"[{t.start_ms:.3g}, {t.end_ms:.3g}] ms")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return asdict(self)


def plan_resharding(src: ShardingSpec, dst: ShardingSpec, network: NetworkModel, itemsize: int = 4,
                    strategy: str = "auto", seed: int = 0, max_nodes: int = 20_000,
                    time_budget_s: Optional[float] = None) -> ReshardPlan:
    """Plan moving a tensor laid out as ``src`` to the layout ``dst`` (``itemsize`` bytes per entry)
    over ``network`` (:meth:`NetworkModel.of_cluster`, or :meth:`NetworkModel.of_hosts` when the
    specs' devices are not a cluster's).

    ``strategy``: one of :data:`STRATEGIES` or ``"auto"`` (the fastest of them and of the cheapest
    strategy per task). ``seed`` drives the randomized search; ``max_nodes`` bounds the DFS."""
    if not isinstance(itemsize, int) or isinstance(itemsize, bool) or itemsize < 1:
        raise ReshardingError(f"resharding: itemsize {itemsize!r} must be the bytes per entry, an integer >= 1 "
                              "(4 for float32)")
    if strategy != "auto" and strategy not in STRATEGIES:
        raise ReshardingError(f"resharding: unknown strategy {strategy!r}; use 'auto' or one of {STRATEGIES}")
    src_hosts, dst_hosts = src.device_hosts, dst.device_hosts
    network.check_placement(src_hosts, "resharding: source")
    network.check_placement(dst_hosts, "resharding: destination")
    for device in set(src_hosts) & set(dst_hosts):
        if src_hosts[device] != dst_hosts[device]:
            raise ReshardingError(f"resharding: device {device!r} is on host {src_hosts[device]!r} in the source "
                                  f"mesh but {dst_hosts[device]!r} in the destination; a device has one host")
    tasks = unit_tasks(src, dst)
    per_strategy = {name: [tr for task in tasks for tr in transfers(task, name, src_hosts, dst_hosts, network, itemsize)]
                    for name in STRATEGIES}
    names = list(STRATEGIES) if strategy == "auto" else [strategy]
    candidates = {name: per_strategy[name] for name in names}
    if strategy == "auto":
        candidates["mixed"] = _cheapest_per_task(tasks, per_strategy)
    results: dict[str, tuple[Schedule, list[SliceTransfer]]] = {}
    searched: dict[tuple, str] = {}   # what the search sees of a candidate's transfers -> its name
    work = 0
    for name, pieces in candidates.items():
        seen = _search_input(pieces)
        if seen in searched:   # e.g. every task has one receiver: the strategies make the same transfers
            results[name] = (results[searched[seen]][0], pieces)
            continue
        searched[seen] = name
        spent: dict = {}
        schedule, _ = best_schedule(pieces, seed=seed, max_nodes=max_nodes, time_budget_s=time_budget_s, work=spent)
        work += sum(spent.values())
        results[name] = (schedule, pieces)
    winner = min(results, key=lambda name: results[name][0].makespan_ms)
    schedule, pieces = results[winner]
    scheduled = []
    for (index, route_index), start in zip(schedule.order, schedule.starts_ms):
        piece, route = pieces[index], pieces[index].routes[route_index]
        scheduled.append(ScheduledTransfer(piece.task, tasks[piece.task].box, piece.nbytes, piece.strategy,
                                           route.sender, route.sender_host, piece.receivers, route.hops,
                                           route.chunks, start, start + route.duration_ms))
    scheduled.sort(key=lambda t: (t.start_ms, t.task, t.receivers))
    return ReshardPlan(src.shape, itemsize, winner, schedule.algorithm, tuple(tasks), tuple(scheduled),
                       schedule.makespan_ms, lower_bound_ms(tasks, src_hosts, dst_hosts, network, itemsize),
                       {name: results[name][0].makespan_ms for name in results}, work)


def _search_input(pieces: list[SliceTransfer]) -> tuple:
    """Everything the schedule search reads of ``pieces``: per transfer, each route's duration
    and resources (the strategy's name and the copies' layout it does not read)."""
    return tuple(tuple((r.duration_ms, r.resources) for r in t.routes) for t in pieces)


BOUNDARY_MAX_NODES = 2_000   # search nodes per strategy at a plan's boundaries: ~15-45 ms each up to 256 devices


def boundary_resharding(plan, cluster, micro_batch: int = 0, max_nodes: int = BOUNDARY_MAX_NODES,
                        strategy: Optional[str] = None) -> list[Optional[ReshardPlan]]:
    """The resharding of micro-batch ``micro_batch`` at each of ``plan.boundaries`` (in order;
    None for a boundary that carries no bytes), over ``cluster``'s network (a
    :class:`whalelike.cluster.Cluster`, or a :class:`NetworkModel` built from one).

    The Plan records a boundary's size only as ``bytes_per_sample``, so its tensors are planned as
    one ``(global_batch_size, bytes_per_sample)`` byte tensor (``itemsize`` 1): each worker of the
    sending stage holds its rows of the micro-batch (:class:`planner.shares.layout.SampleLayout`, every
    replica), each worker of the receiving stage needs its rows, the members of a tensor-parallel
    group hold and need every feature (a ``split`` stage's output as it leaves today, gathered).
    ``strategy`` defaults to the plan's (``Plan.resharding``: ``auto`` or one of :data:`STRATEGIES`).
    Deterministic (seed 0, a DFS budget of ``max_nodes`` nodes per strategy)."""
    strategy = getattr(plan, "resharding", "auto") if strategy is None else strategy
    network = cluster if isinstance(cluster, NetworkModel) else NetworkModel.of_cluster(cluster)
    layout = SampleLayout.of(plan)
    out: list[Optional[ReshardPlan]] = []
    for boundary in plan.boundaries:
        row_bytes = int(round(boundary.bytes_per_sample))
        if row_bytes < 1:
            out.append(None)
            continue
        src = stage_output_spec(plan, layout, boundary.src_stage, micro_batch, (row_bytes,))
        dst = stage_output_spec(plan, layout, boundary.dst_stage, micro_batch, (row_bytes,))
        out.append(_cached_plan(src, dst, network, max_nodes, strategy))
    return out


def unbatched_resharding(plan, cluster, backward: bool = False, max_nodes: int = BOUNDARY_MAX_NODES,
                         strategy: Optional[str] = None) -> list[Optional[ReshardPlan]]:
    """The resharding of the values without a batch dimension at each of ``plan.boundaries`` (in
    order; None for a boundary that carries none, ``BoundaryPlan.unbatched_bytes`` 0), the same for
    every micro-batch: one ``(rows, unbatched_bytes)`` byte tensor stacked by
    :func:`planner.resharding.spec.unbatched_rows` (forward, ``backward`` False: each replica's
    owner slot of the sending stage to every worker of the receiving stage in its replica;
    backward: each receiving slot's gradient to the owner slot), as the runtime's crossings
    (:mod:`runtime.parallel.boundaries`) move them. Other arguments as :func:`boundary_resharding`."""
    strategy = getattr(plan, "resharding", "auto") if strategy is None else strategy
    network = cluster if isinstance(cluster, NetworkModel) else NetworkModel.of_cluster(cluster)
    by_rank = {w.rank: w for w in plan.workers}
    out: list[Optional[ReshardPlan]] = []
    for boundary in plan.boundaries:
        nbytes = int(round(getattr(boundary, "unbatched_bytes", 0.0)))
        if nbytes < 1:
            out.append(None)
            continue
        rows, held, needed = unbatched_rows(plan, boundary.src_stage, boundary.dst_stage, backward)
        src, dst = (ShardingSpec.of_boxes((rows, nbytes), [((by_rank[r].device, by_rank[r].host), (box, (0, nbytes)))
                                                           for r, box in side.items()])
                    for side in (held, needed))
        out.append(_cached_plan(src, dst, network, max_nodes, strategy))
    return out


_CACHE: dict = {}
_CACHE_SIZE = 256


def clear_cache() -> None:
    """Forget every memoised boundary plan of :func:`_cached_plan` (a benchmark times planning from
    nothing: :func:`planner.schedule.boundary_traffic.clear_caches`)."""
    _CACHE.clear()


def _cached_plan(src: ShardingSpec, dst: ShardingSpec, network: NetworkModel, max_nodes: int,
                 strategy: str = "auto") -> ReshardPlan:
    """:func:`plan_resharding` (itemsize 1, seed 0) memoised on its inputs: a summary printed
    twice, or boundaries that look alike, plan once."""
    key = (src, dst, network.key(), max_nodes, strategy)
    if key not in _CACHE:
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = plan_resharding(src, dst, network, itemsize=1, strategy=strategy, max_nodes=max_nodes)
    return _CACHE[key]


def _cheapest_per_task(tasks, per_strategy: dict[str, list[SliceTransfer]]) -> list[SliceTransfer]:
    """Each task under the strategy whose transfers take the least time in total when run alone."""
    by_task: dict[str, dict[int, list[SliceTransfer]]] = {}
    for name in STRATEGIES:
        grouped = by_task[name] = {}
        for piece in per_strategy[name]:
            grouped.setdefault(piece.task, []).append(piece)
    out: list[SliceTransfer] = []
    for task in tasks:
        options = [by_task[name].get(task.index, []) for name in STRATEGIES]
        out += min(options, key=lambda pieces: sum(min(r.duration_ms for r in t.routes) for t in pieces))
    return out


def byte_size(nbytes: float) -> str:
    """``16 MiB``, ``512 B``: a byte count for people."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:g} B"
