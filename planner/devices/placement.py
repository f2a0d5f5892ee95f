"""Virtual devices (Whale): which physical devices run which pipeline stage.

Each TaskGraph is one pipeline stage; its strategy fixes how many devices one copy of the
pipeline gives it: ``replicate(n)`` -> ``n`` data-parallel workers, ``split(m)`` -> one
tensor-parallel group of ``m``, ``replicate(n)+split(m)`` -> ``n`` groups of ``m`` (``n*m``
devices). A ``None`` count takes an even share of the devices the fixed counts leave over. When
every count is fixed and the cluster has room for several copies of the pipeline, the pipeline is
replicated (data parallel across pipelines), as Whale does.

Placement follows Whale's rules:

* Larger-memory devices take the early stages: under 1F1B stage ``s`` of ``S`` keeps ``S - s``
  micro-batches of activations alive, so memory demand falls along the pipeline. Devices are
  ranked by (memory, speed) and dealt out stage by stage, which fixes the *class* of device
  (kind, memory, speed) every worker gets.
* Then physical devices of that class are chosen for locality: a tensor-parallel group (which
  all-reduces every layer) on one host whenever one host has room for it, preferably the host of
  the same replica's previous stage (pipeline neighbours exchange activations every micro-batch),
  else the host that fits it most tightly, to keep whole hosts free for later groups.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from collections import Counter, defaultdict
from dataclasses import dataclass

from whalelike.cluster import Cluster, Device
from whalelike.strategy import Strategy
from whalelike.graphs.taskgraph import TaskGraphs

from planner.devices.cost_model import device_tflops
from planner.plan import PlanError
from planner.shares.batch_shares import LARGEST_REMAINDER, proportional_shares

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageShape:
    """How one copy of the pipeline runs a stage: ``dp`` groups of ``tp`` devices. ``folded``: the
    TaskGraphs of a stage that stands for two or more adjacent regions (:func:`fold_layout`; empty:
    the stage of TaskGraph ``taskgraph`` alone)."""

    taskgraph: int
    strategy: Strategy
    dp: int
    tp: int
    folded: tuple[int, ...] = ()

    @property
    def devices(self) -> int:
        return self.dp * self.tp

    @property
    def taskgraphs(self) -> tuple[int, ...]:
        """The TaskGraphs this stage stands for, whose layers it starts from."""
        return self.folded or (self.taskgraph,)

    @property
    def label(self) -> str:
        if self.tp == 1:
            return f"replicate({self.dp})"
        if self.strategy.kind == "split":
            return f"split({self.tp})"
        return f"replicate({self.dp})+split({self.tp})"


@dataclass(frozen=True)
class Layout:
    """``groups[r][s][d]`` is the tensor-parallel group (a tuple of ``tp`` devices) of
    data-parallel index ``d`` of stage ``s`` in pipeline replica ``r``."""

    shapes: tuple[StageShape, ...]
    groups: tuple[tuple[tuple[tuple[Device, ...], ...], ...], ...]
    unused: tuple[Device, ...]

    @property
    def num_replicas(self) -> int:
        return len(self.groups)

    @property
    def num_stages(self) -> int:
        return len(self.shapes)

    def stage_groups(self, stage: int) -> list[tuple[Device, ...]]:
        """Every tensor-parallel group of ``stage``, over all replicas (replica-major)."""
        return [g for replica in self.groups for g in replica[stage]]

    def can_swap(self, a: int, b: int) -> bool:
        """Whether stages ``a`` and ``b`` can exchange devices and would run on different ones:
        equal shapes, different device classes."""
        same_shape = (self.shapes[a].dp, self.shapes[a].tp) == (self.shapes[b].dp, self.shapes[b].tp)
        classes = [sorted(_device_class(d) for g in self.stage_groups(s) for d in g) for s in (a, b)]
        return same_shape and classes[0] != classes[1]

    def swapped(self, a: int, b: int) -> "Layout":
        """The layout with the device groups of stages ``a`` and ``b`` exchanged in every replica."""
        def swap(replica):
            stages = list(replica)
            stages[a], stages[b] = stages[b], stages[a]
            return tuple(stages)

        return dataclasses.replace(self, groups=tuple(swap(r) for r in self.groups))


def stage_shapes(graphs: TaskGraphs, num_devices: int,
                 counts: dict[int, int] | None = None) -> tuple[list[StageShape], int]:
    """Each stage's (dp, tp) and the number of pipeline replicas. Devices the fixed counts leave
    over go to the automatic stages, at least one each and the rest in proportion to their FLOPs
    (largest remainder), so no device idles because the counts did not divide. A cluster too small
    for the counts asked is :func:`shared_device_groups`' case (:func:`squeezed_shapes`)."""
    fixed = [tg.strategy.fixed_degrees for tg in graphs]
    auto = [i for i, f in enumerate(fixed) if f is None]
    requested = sum(dp * tp for f in fixed if f is not None for dp, tp in [f])
    what = ", ".join(f"TaskGraph {tg.index}: {tg.strategy}" for tg in graphs)
    if requested + len(auto) > num_devices:
        raise PlanError(
            f"the TaskGraphs request {requested} devices"
            + (f" plus at least {len(auto)} for automatic counts" if auto else "")
            + f" ({what}) but the cluster has {num_devices}; lower the device_count of a scope "
            "or use a larger cluster"
        )
    budgets = _auto_budgets([graphs[i] for i in auto], num_devices - requested)
    if counts is not None:   # a count search's (planner.candidates.count_search): devices per automatic stage
        if sorted(counts) != auto or sum(counts.values()) != num_devices - requested or min(counts.values()) < 1:
            raise PlanError(f"counts {counts} must give each automatic stage {auto} at least one of the "
                            f"{num_devices - requested} devices the fixed counts leave, all of them")
        budgets = dict(counts)
    shapes: list[StageShape] = []
    for tg, f in zip(graphs, fixed):
        dp, tp = f if f is not None else _auto_degrees(tg.strategy, budgets[tg.index], tg.index)
        shapes.append(StageShape(tg.index, tg.strategy, dp, tp))
    replicas = 1 if auto else num_devices // requested
    return shapes, replicas


# -- fewer devices than the regions ask ------------------------------------------------------------
MAX_SHARED_GROUPINGS = 8   # groupings of the regions planned when they share devices


def shared_device_groups(graphs: TaskGraphs, num_devices: int) -> list[list[list[int]]]:
    """How the regions run on a cluster smaller than they ask (``TaskGraphs.devices_asked``), as candidate
    groupings of TaskGraph indices into stages (runs of adjacent regions, in order); empty when the
    cluster has what they ask.

    The counts written in the regions cannot be kept, so they become automatic (each stage gets
    devices in proportion to its work). With at least as many devices as regions, the first grouping
    keeps one stage per region. With fewer, adjacent regions fold into one data-parallel stage: for
    each stage count ``G`` from ``min(regions, devices)`` down to 1, the cut into ``G`` runs of
    adjacent regions whose largest FLOPs per sample is smallest (ties: the earliest cut); a folded
    stage, and any stage on one device, runs its layers as plain modules (a ``split`` region of one
    device is its module unsplit). At most :data:`MAX_SHARED_GROUPINGS` groupings; the planner plans
    each and keeps the fastest that fits."""
    regions = len(graphs)
    if graphs.devices_asked <= num_devices:
        return []
    work = [max(tg.forward_flops + tg.backward_flops, 1.0) for tg in graphs]
    out = []
    for count in range(min(regions, num_devices), 0, -1):
        grouping = balanced_runs(work, count)
        if grouping not in out:
            out.append(grouping)
        if len(out) >= MAX_SHARED_GROUPINGS:
            break
    return out


def balanced_runs(work: list[float], count: int) -> list[list[int]]:
    """``range(len(work))`` cut into ``count`` runs of adjacent indices minimising the largest run's
    total work (dynamic program over cut points; ties: the earliest cut)."""
    n = len(work)
    prefix = [0.0]
    for w in work:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: the smallest largest run cutting the first i items into k runs; cut[k][i]: where the last starts
    best = [[inf] * (n + 1) for _ in range(count + 1)]
    cut = [[0] * (n + 1) for _ in range(count + 1)]
    best[0][0] = 0.0
    for k in range(1, count + 1):
        for i in range(k, n - (count - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i] * (1 - 1e-12):
                    best[k][i], cut[k][i] = value, j
    runs, i = [], n
    for k in range(count, 0, -1):
        j = cut[k][i]
        runs.append(list(range(j, i)))
        i = j
    return runs[::-1]


def squeezed_shapes(graphs: TaskGraphs, grouping: list[list[int]], num_devices: int) -> list[StageShape]:
    """The stages of ``grouping`` (a :func:`shared_device_groups` answer) on ``num_devices``: one
    device each and the rest in proportion to their FLOPs per sample (largest remainder); a stage of
    one region keeps its kind with automatic counts (a ``split`` region's group is all its devices), a
    stage of several is a plain data-parallel stage of all of theirs (``StageShape.folded``)."""
    if len(grouping) > num_devices:
        raise PlanError(f"{len(grouping)} stages cannot share {num_devices} device(s): each stage needs one")
    shapes = []
    for run, budget in zip(grouping, _one_each_by_work(grouping, graphs, num_devices)):
        first = graphs[run[0]]
        if len(run) == 1:
            strategy = dataclasses.replace(first.strategy, device_count=None,
                                           inner=dataclasses.replace(first.strategy.inner, device_count=None)
                                           if first.strategy.inner is not None else None)
            dp, tp = _auto_degrees(strategy, budget, first.index)
            shapes.append(StageShape(first.index, first.strategy, dp, tp))
        else:
            shapes.append(StageShape(first.index, Strategy("replicate"), budget, 1, tuple(run)))
    return shapes


def regrouped_shapes(graphs: TaskGraphs, grouping: list[list[int]], num_devices: int) -> tuple[list[StageShape], int]:
    """The stages of ``grouping`` (runs of adjacent TaskGraph indices, in order) on a cluster with the
    devices the regions ask, and the number of pipeline replicas: a stage of one region keeps its
    counts (fixed, or automatic: a share of the spare devices by work, as :func:`stage_shapes`), a
    stage of several is one data-parallel stage of all their layers (``StageShape.folded``) with the
    sum of their fixed counts when every one is fixed, else an automatic count. The layout of a
    candidate that folds a stage the partitioner left with nothing to compute into its neighbour
    (:func:`planner.candidates.idle_folds`): the devices that stage held are dealt out again, to
    whichever stages the work asks for. On a cluster smaller than the regions ask:
    :func:`squeezed_shapes`."""
    if graphs.devices_asked > num_devices:
        return squeezed_shapes(graphs, grouping, num_devices), 1
    fixed: list[tuple[int, int] | None] = []
    for run in grouping:
        degrees = [graphs[t].strategy.fixed_degrees for t in run]
        if len(run) == 1:
            fixed.append(degrees[0])
        else:
            fixed.append((sum(d[0] * d[1] for d in degrees), 1) if all(degrees) else None)
    requested = sum(dp * tp for f in fixed if f is not None for dp, tp in [f])
    auto = [k for k, f in enumerate(fixed) if f is None]
    if requested + len(auto) > num_devices:
        raise PlanError(f"the stages {grouping} ask {requested} devices plus at least {len(auto)} for automatic counts "
                        f"but the cluster has {num_devices}")
    budgets = _one_each_by_work([grouping[k] for k in auto], graphs, num_devices - requested) if auto else []
    budget = dict(zip(auto, budgets))
    shapes = []
    for k, (run, f) in enumerate(zip(grouping, fixed)):
        first = graphs[run[0]]
        if len(run) > 1:
            shapes.append(StageShape(first.index, first.strategy, f[0] if f else budget[k], 1, tuple(run)))
            continue
        dp, tp = f if f is not None else _auto_degrees(first.strategy, budget[k], first.index)
        shapes.append(StageShape(first.index, first.strategy, dp, tp))
    return shapes, (1 if auto else num_devices // requested)


def _auto_budgets(auto_graphs, spare: int) -> dict[int, int]:
    """Devices per automatic stage: one each, the rest proportional to FLOPs per sample (largest
    remainder, ties to the stage with more work)."""
    if not auto_graphs:
        return {}
    counts = _one_each_by_work([[tg.index] for tg in auto_graphs], {tg.index: tg for tg in auto_graphs}, spare)
    return {tg.index: c for tg, c in zip(auto_graphs, counts)}


def _one_each_by_work(runs: list[list[int]], graphs, devices: int) -> list[int]:
    """Devices per run of TaskGraphs (``graphs[t]``): one each, the rest proportional to the run's
    FLOPs per sample (largest remainder, ties to the run with more work)."""
    work = [max(sum(graphs[t].forward_flops + graphs[t].backward_flops for t in run), 1.0) for run in runs]
    extra = proportional_shares(devices - len(runs), work, leftover=LARGEST_REMAINDER,
                                ties=[(-w, i) for i, w in enumerate(work)])
    return [1 + c for c in extra]


def _auto_degrees(strategy: Strategy, budget: int, index: int) -> tuple[int, int]:
    if strategy.kind == "split":
        return 1, budget
    if strategy.inner is None:
        return budget, 1
    dp, tp = strategy.device_count, strategy.inner.device_count
    if dp is None and tp is None:
        return 1, budget
    if dp is None:
        dp = budget // tp
    else:
        tp = budget // dp
    if dp < 1 or tp < 1:
        raise PlanError(
            f"TaskGraph {index} ({strategy}) gets {budget} devices, too few for its fixed degree; "
            "lower its device_count or add devices"
        )
    return dp, tp


def fold_layout(layout: Layout, stages: list[list[int]]) -> Layout:
    """``layout`` with each run of adjacent stages in ``stages`` (stage indices, in order, covering
    every stage once) run as one data-parallel stage on the union of their devices, every replica
    alike: the fold of adjacent plain ``replicate`` regions (:mod:`planner.candidates`). A stage of a
    run of one is kept as it is. Raises ValueError for runs that are not adjacent, in order and
    complete, or that take in a ``split`` stage (its devices are tensor-parallel groups)."""
    if [s for run in stages for s in run] != list(range(layout.num_stages)) or not all(stages):
        raise ValueError(f"fold_layout: stages {stages} must list stages 0..{layout.num_stages - 1} once each, in "
                         "order, as runs of adjacent stages")
    shapes = []
    for run in stages:
        if len(run) == 1:
            shapes.append(layout.shapes[run[0]])
            continue
        split = [s for s in run if layout.shapes[s].tp != 1]
        if split:
            raise ValueError(f"fold_layout: stage {split[0]} ({layout.shapes[split[0]].label}) runs tensor-parallel "
                             "groups; only data-parallel stages fold")
        first = layout.shapes[run[0]]
        shapes.append(StageShape(first.taskgraph, first.strategy, sum(layout.shapes[s].dp for s in run), 1,
                                 tuple(t for s in run for t in layout.shapes[s].taskgraphs)))
    groups = tuple(tuple(tuple(g for s in run for g in replica[s]) for run in stages) for replica in layout.groups)
    return Layout(tuple(shapes), groups, layout.unused)


PLACEMENTS = ("memory", "speed")


def build_layout(graphs: TaskGraphs, cluster: Cluster, placement: str = "memory", precision: str = "fp32",
                 shared: list[list[int]] | None = None, counts: dict[int, int] | None = None) -> Layout:
    """Place every stage of every pipeline replica on physical devices (see module docstring).

    ``placement="memory"`` is Whale's rule: devices ranked by memory (then speed) are dealt out in
    stage order. ``"speed"`` deals devices ranked by speed (then memory) to the stages with the
    most FLOPs per device first: better when a late stage (a wide classifier) dominates compute.
    The planner tries both and keeps the faster plan that fits. Speed is each device's at the
    training ``precision`` (``Config.precision``). ``shared``: runs of adjacent TaskGraphs, one
    stage each (:func:`regrouped_shapes`): a grouping of :func:`shared_device_groups` (a cluster
    smaller than the regions ask: :func:`squeezed_shapes`, one pipeline), or a fold of a stage
    with nothing to compute (:func:`planner.candidates.idle_folds`). ``counts``: the devices of each
    automatic stage (TaskGraph index -> count) instead of the split by work
    (:func:`planner.candidates.count_search`).
    """
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if shared is not None:
        shapes, replicas = regrouped_shapes(graphs, shared, len(cluster.devices))
    else:
        shapes, replicas = stage_shapes(graphs, len(cluster.devices), counts)
    if placement == "memory":
        key = lambda p: (-p[1].memory_gib, -device_tflops(p[1], precision), p[0])  # noqa: E731
        stage_order = list(range(len(shapes)))
    else:
        key = lambda p: (-device_tflops(p[1], precision), -p[1].memory_gib, p[0])  # noqa: E731
        work = [sum(graphs[t].forward_flops + graphs[t].backward_flops for t in sh.taskgraphs) / sh.devices
                for sh in shapes]
        stage_order = sorted(range(len(shapes)), key=lambda s: (-work[s], s))
    ranked = sorted(enumerate(cluster.devices), key=key)
    wanted: list[list[list[tuple]]] = [[[] for _ in shapes] for _ in range(replicas)]
    pos = 0
    for s in stage_order:
        shape = shapes[s]
        for r in range(replicas):
            chunk = ranked[pos:pos + shape.devices]
            pos += shape.devices
            wanted[r][s] = [
                [_device_class(d) for _, d in chunk[g * shape.tp:(g + 1) * shape.tp]] for g in range(shape.dp)
            ]
    pool = _Pool(cluster)
    groups = []
    for r in range(replicas):
        stages, previous_hosts = [], []
        for s in range(len(shapes)):
            stage_groups = []
            for classes in wanted[r][s]:
                group = pool.take(classes, previous_hosts)
                stage_groups.append(group)
            previous_hosts = list(dict.fromkeys(d.host for g in stage_groups for d in g))
            stages.append(tuple(stage_groups))
        groups.append(tuple(stages))
    unused = tuple(d for _, d in ranked[pos:])
    if unused:
        log.warning(
            "%d of %d devices stay idle: %d pipeline replica(s) of %d devices fill the rest (%s)",
            len(unused), len(cluster.devices), replicas, pos // replicas, ", ".join(d.name for d in unused),
        )
    return Layout(tuple(shapes), tuple(groups), unused)


@functools.lru_cache(maxsize=8192)
def _device_class(device: Device) -> tuple:
    """Devices of one class are interchangeable for the planner: same kind, memory and speed at
    every precision they run. Memoised on the device's value (a frozen record: equal devices, equal
    class; a re-plan's measured speeds make new records): a 1024-device placement asks ~10^4 times."""
    return (device.kind, device.memory_gib, device_tflops(device),
            tuple((p, device_tflops(device, p)) for p in device.precisions))


class _Pool:
    """Free devices by host and class; hands out groups with host locality."""

    def __init__(self, cluster: Cluster):
        self.host_order = {h: i for i, h in enumerate(cluster.hosts)}
        self.position = cluster.positions
        self.last: str | None = None
        self.free: dict[str, dict[tuple, list[Device]]] = defaultdict(lambda: defaultdict(list))
        # class -> the hosts with a free device of it: a group's fitting hosts are looked for among
        # those with its first class, not among all hosts (a 1024-device cluster has 128)
        self.holding: dict[tuple, dict[str, None]] = defaultdict(dict)
        for d in cluster.devices:
            self.free[d.host][_device_class(d)].append(d)
            self.holding[_device_class(d)][d.host] = None

    def _room(self, host: str, need: Counter) -> bool:
        return all(len(self.free[host][c]) >= n for c, n in need.items())

    def _size(self, host: str) -> int:
        return sum(len(v) for v in self.free[host].values())

    def take(self, classes: list[tuple], preferred_hosts: list[str]) -> tuple[Device, ...]:
        need = Counter(classes)
        # the previous stage's hosts, then the host the last group came from (consecutive groups
        # fill one host), then the tightest host that fits, then several hosts
        candidates = [h for h in (*preferred_hosts, self.last) if h is not None and self._room(h, need)]
        if candidates:
            hosts = candidates[:1]
        else:
            fitting = [h for h in self.holding[classes[0]] if self._room(h, need)]
            if fitting:
                hosts = [min(fitting, key=lambda h: (self._size(h), self.host_order[h]))]
            else:
                hosts = preferred_hosts + sorted(self.free, key=lambda h: (-self._size(h), self.host_order[h]))
        group = []
        for c in classes:
            host = next(h for h in hosts if self.free[h][c])
            group.append(self.free[host][c].pop(0))
            if not self.free[host][c]:
                self.holding[c].pop(host, None)
        self.last = group[-1].host
        # in cluster order: tensor-parallel ranks grow with the global rank (see planner.assemble)
        return tuple(sorted(group, key=lambda d: self.position[d.name]))
