"""Re-plan a running job from measured device speeds, keeping every rank where it is.

Why: a plan is made once from the cluster spec's nominal speeds, but devices slow down while a job
runs (thermal throttling, a noisy neighbour, a shared machine), and one slow rank sets the pace of
all. :func:`rebalance` takes the speeds the ranks measured (:mod:`runtime.balance.straggler_monitor`) and
re-runs the hardware-aware planner's own decisions on them, at a step boundary.

Invariants:

* **The device mapping is kept.** Every :class:`~planner.plan.Worker` keeps its rank, device,
  host, replica, stage, data-parallel index, tensor-parallel index and group size (checked by
  :func:`planner.plan_checks.check_same_workers`, as the runtime checks a plan it is given), so every
  process group of the plan in force stays valid. New process groups would cost seconds on NCCL (and a
  collective agreement of every rank on them); what moves instead are amounts of work: batch
  shares (no data moves), layers between adjacent movable stages (their parameters and optimizer
  state move point to point, :mod:`runtime.state.transfer`) and the shard sizes of ``split``
  stages (whole heads or feature granules, with their state). The device placement and the stage
  shapes are what :func:`planner.plan` chose; only :func:`planner.plan` changes them.
* **Exact re-plans only.** The new plan does the same work as the old one, split differently, so
  training computes the same losses and gradients. Approximate remedies (ZERO-resizing,
  SEMI-migration) are decided in :mod:`planner.balance.semi_migration`.
* **The planner's own decisions.** The plan's :class:`~planner.devices.placement.Layout` is rebuilt
  from its workers (same order, checked: rank ``r`` maps back to worker ``r``) on Devices whose
  ``measured_tflops`` are the measured speeds, and :func:`planner.decisions.aware_decisions` and
  :func:`planner.assemble.build_plan` run on it: the pipeline partitioner moves layers
  (``move_layers``), speed-proportional shards within memory (``reshard``), batch shares within
  memory (Whale's Algorithm 1; Poplar's accumulation for a single stage), timings, memory and
  predictions. ``global_batch_size``, ``num_micro_batch``, ``schedule``, the solver family and
  ``sync_batchnorm`` stay.
* **Speed scale.** Measurements come in any absolute scale (an emulator's FLOP/s at its base rate,
  real GPUs' achieved FLOP/s). Only their ratios are taken from the measurement; the total is the
  plan's: ``measured_tflops[r] = speeds[r] / sum(speeds) * sum(assumed TFLOPS of the plan's
  devices)``. So compute keeps the spec's scale against communication, which is priced from the
  spec's network: an emulator running a thousand times slower than the spec would otherwise make
  every all-reduce look free and every layer move look worthwhile.
* **Deterministic.** A pure function of its inputs: every rank, given the same (all-gathered)
  speeds, computes the same plan without communicating.
* **Never fails the run over memory.** A part whose new value does not fit keeps the plan's value
  (layers, then shard sizes, then batch shares); :attr:`Replan.kept` says which and why.
* **Never slower than the naive decisions it knows** (:mod:`planner.candidates`, as
  :func:`planner.plan`): the naive decisions on the same mapping, with the running ZeRO stages,
  recompute choices and state fractions (so the runtime adopts them like any re-plan), are priced
  beside the re-plan, and kept when predicted faster and they fit; ``Plan.candidates`` records both
  (the re-plan of a plan with folded stages, ``StagePlan.folded``, is the ``"folded"`` candidate: the
  fold stays, as every stage does).

:func:`plan_changes` says what differs between two plans of one mapping (shares, layers, shards):
what the runtime must move, and what the events log.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Optional, Sequence

from whalelike.cluster import Cluster, Device
from whalelike.config import Config
from whalelike.graphs.capture import with_autocast
from whalelike.graphs.taskgraph import TaskGraphs

from planner.assemble import build_plan, predict
from planner.candidates import Priced, keep_fastest
from planner.decisions import Decisions, aware_decisions, naive_decisions
from planner.devices.cost_model import StageCost, device_tflops
from planner.devices.memory import derated, with_reserve
from planner.groups import group_key
from planner.plan import Plan, PlanError, Prediction
from planner.plan_checks import WORKER_MAPPING, check_same_workers, stage_regions
from planner.partition.stage_layers import movable_runs, partition_stage_layers
from planner.shares.shard_sizes import ShardLayout, layout_of_sizes
from planner.shares.stage_shards import stage_shardable
from planner.shares.state_fractions import in_group_order
from planner.devices.placement import Layout, StageShape

log = logging.getLogger(__name__)

MAPPING = WORKER_MAPPING   # what a re-plan keeps of every worker (planner.plan_checks.check_same_workers)
KINDS = ("shares", "layers", "shards")


@dataclass(frozen=True)
class Replan:
    """A re-plan: the new ``plan``; ``in_force``, the plan in force's prediction at the measured
    speeds (what not re-planning costs); ``kept``, one line per part that kept the plan in force's
    value because its new value did not fit in memory."""

    plan: Plan
    in_force: Prediction
    kept: tuple[str, ...] = ()


def rebalance(plan: Plan, graphs: TaskGraphs, cluster: Cluster, speeds: Sequence[float], *,
              move_layers: bool = True, reshard: bool = True,
              memory_scale: Optional[dict[str, float]] = None) -> Plan:
    """The plan for measured ``speeds`` (FLOP/s per rank, any scale) on the mapping of ``plan``.

    See the module docstring; :func:`replan` also returns what was kept and the plan in force's
    prediction. Parts kept because they do not fit are logged as warnings.
    Raises :class:`PlanError` for speeds of the wrong length, non-positive or non-finite speeds, or
    a ``cluster`` / ``graphs`` the plan was not made for.
    ``memory_scale``: devices (by name) whose memory the plan may fill only this share of, on top
    of the reserve (:func:`planner.devices.memory.derated`; the memory check while training,
    :mod:`runtime.balance.memory_check`, sets it where a device's peak ran above its prediction).
    """
    result = replan(plan, graphs, cluster, speeds, move_layers=move_layers, reshard=reshard,
                    memory_scale=memory_scale)
    for line in result.kept:
        log.warning("rebalance: %s", line)
    return result.plan


def replan(plan: Plan, graphs: TaskGraphs, cluster: Cluster, speeds: Sequence[float], *,
           move_layers: bool = True, reshard: bool = True,
           memory_scale: Optional[dict[str, float]] = None) -> Replan:
    """:func:`rebalance` with its :class:`Replan` record."""
    _check_inputs(plan, cluster, speeds)
    plan.validate(graphs=graphs, cluster=cluster)
    if plan.precision != "fp32":   # a low-precision plan's memory is priced with the autocast figures
        graphs = with_autocast(graphs)
    # the re-plan keeps the plan's memory reserve (it fits into what the plan may fill) and any
    # device de-rated by the memory check
    usable = derated(with_reserve(cluster, plan.memory_reserve), memory_scale or {})
    measured = measured_cluster(plan, usable, speeds)
    layout = plan_layout(plan, graphs, measured)
    config = config_of(plan)
    network = measured.network
    old_layers = [list(st.layers) for st in plan.stages]
    old_shards = _plan_shards(plan, graphs)
    kept: list[str] = []

    new_layers, solver, gap = old_layers, plan.solver, plan.optimality_gap
    if move_layers and layout.num_stages > 1 and movable_runs(graphs, layout):
        found = partition_stage_layers(graphs, layout, config, network, in_force=old_layers)
        if not found.partitioned:   # infeasible: the layers in force stay (see partition_stage_layers)
            kept.append("stage layers: the pipeline partition for the measured speeds does not fit in memory")
        else:
            new_layers, solver, gap = found.layers, found.solver, found.gap
    layers_moved = new_layers != old_layers
    reshard = reshard and plan.tensor_parallel   # a single device's shard is the whole

    decisions, first_error = None, None
    for use_layers, use_shards in _candidates(layers_moved, reshard):
        try:
            decisions = aware_decisions(
                graphs, config, layout, network,
                stage_layers=new_layers if use_layers else old_layers,
                shards=None if use_shards else old_shards, counts=[config.num_micro_batch],
                **_choices_in_force(plan, layout))
        except PlanError as e:
            first_error = first_error or e
            continue
        if layers_moved and not use_layers:
            kept.append(f"stage layers: the moved layers do not fit in memory ({first_error})")
        if reshard and not use_shards:
            kept.append(f"shard sizes: the new shard sizes do not fit in memory ({first_error})")
        break
    if decisions is None:
        kept.append(f"batch shares: the new shares do not fit in memory ({first_error})")
        decisions = aware_decisions(graphs, config, layout, network, stage_layers=old_layers,
                                    shards=old_shards, sizes=_plan_sizes(plan, layout),
                                    **_choices_in_force(plan, layout))
    if decisions.stage_layers == old_layers:
        solver, gap = plan.solver, plan.optimality_gap
    new = _priced(graphs, measured, config, dataclasses.replace(decisions, solver=solver, optimality_gap=gap))
    try:
        check_same_workers(plan, new, "rebalance")
    except PlanError as e:
        raise PlanError(f"{e}; here the plan's ranks do not follow cluster {cluster.name!r}'s device order: re-plan "
                        "with planner.plan on this cluster") from None
    in_force = _in_force(plan, graphs, measured, config, layout, old_layers, old_shards)
    own = naive_decisions(graphs, config, layout)
    naive = _priced(graphs, measured, config, own)
    # the naive candidate keeps the running replica syncs, so the runtime adopts it as it adopts a re-plan
    same_syncs = naive_decisions(graphs, config, layout, **_choices_in_force(plan, layout))
    candidate = naive if _same_choices(same_syncs, own) else _priced(graphs, measured, config, same_syncs)
    mine = "folded" if any(shape.folded for shape in layout.shapes) else "aware"   # the decisions on a folded plan
    new = keep_fastest([Priced(mine, new), Priced("naive", candidate)], naive.prediction)
    return Replan(new, in_force, tuple(kept))


def _same_choices(one: Decisions, other: Decisions) -> bool:
    """Whether two naive decisions of one layout choose the same ZeRO stages, recompute and state
    fractions (all the rest of them is the same: equal layers, shards and shares)."""
    return ([one.zero_stage(s) for s in range(one.layout.num_stages)] ==
            [other.zero_stage(s) for s in range(other.layout.num_stages)]
            and [one.recomputes(s) for s in range(one.layout.num_stages)] ==
            [other.recomputes(s) for s in range(other.layout.num_stages)]
            and [one.fractions(s) for s in range(one.layout.num_stages)] ==
            [other.fractions(s) for s in range(other.layout.num_stages)])


def repriced(plan: Plan, graphs: TaskGraphs, cluster: Cluster) -> Prediction:
    """The prediction of ``plan`` as it stands (its stage layers, shards, micro-batch sizes, ZeRO and
    recompute choices) on ``cluster``'s device rates and network: what it would take on devices
    whose speeds differ from those it was planned with (a spec-sheet plan on measured devices)."""
    return repriced_plan(plan, graphs, cluster).prediction


def repriced_plan(plan: Plan, graphs: TaskGraphs, cluster: Cluster) -> Plan:
    """``plan`` as it stands rebuilt on ``cluster``'s device rates and network: every worker's
    timing fields and the prediction at those rates (:func:`repriced`)."""
    if plan.precision != "fp32":
        graphs = with_autocast(graphs)
    cluster = with_reserve(cluster, plan.memory_reserve)
    layout = plan_layout(plan, graphs, cluster)
    config = config_of(plan)
    rebuilt = _rebuilt(plan, graphs, cluster, config, layout, [list(st.layers) for st in plan.stages],
                       _plan_shards(plan, graphs))
    return dataclasses.replace(rebuilt, solver=plan.solver, optimality_gap=plan.optimality_gap,
                               naive_prediction=plan.naive_prediction, speeds=plan.speeds)


def config_of(plan: Plan) -> Config:
    """The Config a re-plan of ``plan`` plans under: its batch, schedule and recipe, and its
    replicas' sync (P-Reduce with its generator's settings when a stage runs it, so a re-plan keeps it).
    Public: a re-plan on a changed world (:mod:`runtime.elastic.membership`) plans under it too."""
    partial = [st for st in plan.stages if st.replica_sync == "partial"]
    settings = {}
    if partial:
        first = partial[0]
        settings = dict(dp_sync="partial", partial_generator=first.partial_generator,
                        partial_group_size=first.partial_group_size, partial_delta_c=first.partial_delta_c)
    return Config(plan.global_batch_size, _micro_batch_count(plan), plan.schedule,
                  sync_batchnorm=plan.sync_batchnorm, resharding=plan.resharding,
                  delay_weight_gradients=plan.delay_weight_gradients, precision=plan.precision,
                  memory_reserve=plan.memory_reserve, **settings)


def measured_cluster(plan: Plan, cluster: Cluster, speeds: Sequence[float]) -> Cluster:
    """``cluster`` with each plan device's measured TFLOPS at the plan's precision set from ``speeds``
    (per rank; :meth:`whalelike.cluster.Device.with_measured`), normalised so that they sum to the
    TFLOPS the plan assumed for those devices at that precision (see the module docstring). Devices
    the plan does not use are unchanged."""
    _check_inputs(plan, cluster, speeds)
    by_name = {d.name: d for d in cluster.devices}
    assumed = math.fsum(device_tflops(by_name[w.device], plan.precision) for w in plan.workers)
    total = math.fsum(float(v) for v in speeds)
    tflops = {w.device: float(v) / total * assumed for w, v in zip(plan.workers, speeds)}
    devices = tuple(d.with_measured(plan.precision, tflops[d.name]) if d.name in tflops else d
                    for d in cluster.devices)
    return dataclasses.replace(cluster, devices=devices)


def plan_layout(plan: Plan, graphs: TaskGraphs, cluster: Cluster) -> Layout:
    """The :class:`Layout` the plan's workers form, on ``cluster``'s Devices: ``groups[r][s][d]``
    holds the devices of replica ``r``, stage ``s``, data-parallel index ``d`` in tensor-parallel order;
    a stage folded from several regions (``StagePlan.folded``) stands for them again."""
    by_name = {d.name: d for d in cluster.devices}
    slots: dict[tuple[int, int, int], dict[int, Device]] = defaultdict(dict)
    for w in plan.workers:
        slots[group_key("tp", w)][w.tp_index] = by_name[w.device]
    shapes = []
    for s, (st, tgs) in enumerate(zip(plan.stages, stage_regions(plan))):   # a folded stage stands for several
        first = plan.stage_workers(s, replica=0)
        t = tgs[0]
        shape = StageShape(t, graphs[t].strategy, 1 + max(w.dp_index for w in first), first[0].tp_size,
                           tuple(tgs) if len(tgs) > 1 else ())
        if shape.label != st.strategy:
            raise PlanError(f"plan.stages[{s}].strategy is {st.strategy!r} but TaskGraph {t} ({graphs[t].strategy}) "
                            f"on its workers makes {shape.label!r}; re-plan with planner.plan for this model")
        shapes.append(shape)
    groups = tuple(
        tuple(tuple(tuple(slots[(r, s, d)][t] for t in range(sh.tp)) for d in range(sh.dp))
              for s, sh in enumerate(shapes))
        for r in range(plan.num_replicas))
    used = {w.device for w in plan.workers}
    return Layout(tuple(shapes), groups, tuple(d for d in cluster.devices if d.name not in used))


# -- plan changes ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ShareChange:
    """Rank ``rank``'s micro-batch sizes went from ``old`` to ``new``."""

    rank: int
    old: tuple[int, ...]
    new: tuple[int, ...]

    def describe(self) -> str:
        line = f"rank {self.rank}: batch share {sum(self.old)} -> {sum(self.new)}"
        if len(self.old) == len(self.new) and len(set(self.old)) == len(set(self.new)) == 1:
            return line + f" ({self.old[0]} -> {self.new[0]} per micro-batch)"
        return line + f" (micro-batches {list(self.old)} -> {list(self.new)})"


@dataclass(frozen=True)
class LayerMove:
    """``layers`` (contiguous indices) moved from stage ``src`` to stage ``dst``."""

    layers: tuple[int, ...]
    src: int
    dst: int

    def describe(self) -> str:
        span = f"{self.layers[0]}" if len(self.layers) == 1 else f"{self.layers[0]}-{self.layers[-1]}"
        return f"layer{'s' if len(self.layers) > 1 else ''} {span}: stage {self.src} -> stage {self.dst}"


@dataclass(frozen=True)
class ShardChange:
    """Module ``path`` of stage ``stage`` is cut into ``new`` instead of ``old`` (size per tp_index)."""

    stage: int
    path: str
    old: tuple[int, ...]
    new: tuple[int, ...]

    def describe(self) -> str:
        return f"stage {self.stage} {self.path}: shards {list(self.old)} -> {list(self.new)}"


@dataclass(frozen=True)
class PlanChanges:
    """What differs between two plans of one mapping (see :func:`plan_changes`)."""

    shares: tuple[ShareChange, ...] = ()
    layers: tuple[LayerMove, ...] = ()
    shards: tuple[ShardChange, ...] = ()
    num_micro_batch: tuple[int, int] | None = None   # (old, new) when it changed

    @property
    def kinds(self) -> set[str]:
        return {kind for kind in KINDS if getattr(self, kind)}

    @property
    def empty(self) -> bool:
        return not self.kinds

    def describe(self) -> str:
        """One readable line per change ("no changes" when there is none)."""
        lines = [] if self.num_micro_batch is None else [
            f"num_micro_batch: {self.num_micro_batch[0]} -> {self.num_micro_batch[1]}"]
        lines += [c.describe() for c in (*self.layers, *self.shards, *self.shares)]
        return "\n".join(lines) or "no changes"


def plan_changes(old: Plan, new: Plan) -> PlanChanges:
    """Shares, layer moves and shard sizes that differ from ``old`` to ``new``, two plans of one
    job with the same workers (as :func:`rebalance` makes them). Raises PlanError otherwise."""
    check_same_workers(old, new, "plan_changes compares re-plans of one job (compare a plan with rebalance() of it)")
    shares = tuple(ShareChange(a.rank, tuple(a.micro_batch_sizes), tuple(b.micro_batch_sizes))
                   for a, b in zip(old.workers, new.workers) if a.micro_batch_sizes != b.micro_batch_sizes)
    owner_old = {i: st.index for st in old.stages for i in st.layers}
    owner_new = {i: st.index for st in new.stages for i in st.layers}
    moves: list[LayerMove] = []
    for i in sorted(owner_old):
        src, dst = owner_old[i], owner_new.get(i, owner_old[i])
        if src == dst:
            continue
        if moves and (moves[-1].src, moves[-1].dst) == (src, dst) and moves[-1].layers[-1] == i - 1:
            moves[-1] = LayerMove(moves[-1].layers + (i,), src, dst)
        else:
            moves.append(LayerMove((i,), src, dst))
    shards = tuple(
        ShardChange(a.index, path, tuple(a.shard_sizes.get(path, ())), tuple(b.shard_sizes.get(path, ())))
        for a, b in zip(old.stages, new.stages)
        for path in sorted(set(a.shard_sizes) | set(b.shard_sizes))
        if a.shard_sizes.get(path) != b.shard_sizes.get(path))
    counts = None if old.num_micro_batch == new.num_micro_batch else (old.num_micro_batch, new.num_micro_batch)
    return PlanChanges(shares, tuple(moves), shards, counts)


# -- helpers ---------------------------------------------------------------------------------------
def _micro_batch_count(plan: Plan) -> int:
    """The micro-batch count to re-plan with. A pipeline keeps its count (the schedule depends on
    it). A single stage on Poplar's per-device accumulation (lists of different lengths) gets 1:
    the planner then accumulates again, each device in as few micro-batches as its memory allows,
    instead of cutting the batch into the old plan's longest list of equal micro-batches (which
    gives a slowed device micro-batches of one sample)."""
    lengths = {len(w.micro_batch_sizes) for w in plan.workers}
    if len(plan.stages) == 1 and len(lengths) > 1:
        return 1
    return plan.num_micro_batch


def _check_inputs(plan: Plan, cluster: Cluster, speeds: Sequence[float]) -> None:
    if isinstance(speeds, (str, bytes)) or not hasattr(speeds, "__len__"):
        raise PlanError(f"rebalance: speeds must be a list of measured FLOP/s, one per rank, got {speeds!r}")
    if len(speeds) != plan.world_size:
        raise PlanError(f"rebalance: speeds has {len(speeds)} entries but the plan has {plan.world_size} ranks; "
                        "pass one measured FLOP/s per rank, in rank order")
    for w, v in zip(plan.workers, speeds):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise PlanError(f"rebalance: speeds[{w.rank}] (device {w.device!r}) is {v!r}; every speed must be a "
                            "finite FLOP/s > 0: wait for a full measurement window before re-planning")
    missing = [w.device for w in plan.workers if w.device not in cluster.positions]
    if missing:
        raise PlanError(f"rebalance: cluster {cluster.name!r} has no device(s) {missing} that the plan runs on; "
                        f"pass the cluster the plan was made for (plan.cluster is {plan.cluster!r})")


def _candidates(layers_moved: bool, reshard: bool) -> list[tuple[bool, bool]]:
    """(new layers?, new shards?) to try in order: everything new first, then keeping the shards,
    then keeping the layers, then both (each only when it differs from an earlier candidate)."""
    return [(layers, shards) for layers in (True, False) for shards in (True, False)
            if (layers or layers_moved) and (reshard or not shards)]


def _plan_shards(plan: Plan, graphs: TaskGraphs) -> list[ShardLayout]:
    """The plan's shard layout of each stage, priced as the planner prices its own."""
    out = []
    for st in plan.stages:
        _, shardable, groups = stage_shardable(graphs, st.layers)
        flops = StageCost.of_layers(graphs, st.layers, plan.precision).flops_per_sample
        out.append(layout_of_sizes(shardable, st.shard_sizes, plan.stage_workers(st.index)[0].tp_size, groups, flops))
    return out


def _plan_sizes(plan: Plan, layout: Layout) -> list:
    """``Decisions.sizes`` of the plan in force: ``[r][s][d]`` micro-batch sizes."""
    sizes = [[[None] * sh.dp for sh in layout.shapes] for _ in range(layout.num_replicas)]
    for w in plan.workers:
        if w.tp_index == 0:
            sizes[w.replica][w.stage][w.dp_index] = list(w.micro_batch_sizes)
    return sizes


def _choices_in_force(plan: Plan, layout: Layout) -> dict:
    """What a re-plan keeps of the plan in force besides its workers: each stage's recompute choice,
    ZeRO stage and their reasons, and its ragged state fractions (:func:`planner.decisions.aware_decisions`'s
    ``recompute``, ``zero``, ``zero_reason`` and ``state_fractions``, those from rank order to
    ``layout``'s group order): the runtime keeps a replica sync only for the same ones."""
    ranks = {w.device: w.rank for w in plan.workers}
    fractions = [in_group_order(st.state_fractions, [g[0].name for g in layout.stage_groups(st.index)], ranks)
                 if st.state_fractions else () for st in plan.stages]
    return {"recompute": [st.recompute_reason if st.recompute else "" for st in plan.stages],
            "zero": [st.zero_stage for st in plan.stages], "zero_reason": [st.zero_reason for st in plan.stages],
            "state_fractions": fractions}


def _priced(graphs: TaskGraphs, cluster: Cluster, config: Config, decisions: Decisions) -> Plan:
    plan = build_plan(graphs, cluster, config, decisions)
    return dataclasses.replace(plan, prediction=predict(plan, cluster))


def _in_force(plan, graphs, measured, config, layout, old_layers, old_shards) -> Prediction:
    """The plan in force re-priced at the measured speeds."""
    return _rebuilt(plan, graphs, measured, config, layout, old_layers, old_shards).prediction


def _rebuilt(plan, graphs, measured, config, layout, old_layers, old_shards) -> Plan:
    """The plan in force rebuilt (every worker's timing fields) and predicted at the measured speeds."""
    kept = aware_decisions(graphs, config, layout, measured.network, stage_layers=old_layers,
                           shards=old_shards, sizes=_plan_sizes(plan, layout),
                           **_choices_in_force(plan, layout))
    rebuilt = build_plan(graphs, measured, config, kept)
    return dataclasses.replace(rebuilt, prediction=predict(rebuilt, measured))
