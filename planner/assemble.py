"""Turn the planner's decisions into a :class:`~planner.plan.Plan` with predicted timings.

The decisions (which devices run which stage, each stage's layers and shard layout, each
tensor-parallel group's micro-batch sizes: :class:`planner.decisions.Decisions`) come from
:mod:`planner.decisions`, for the hardware-aware plan and for the naive one alike; this module
prices them with :mod:`planner.devices.cost_model`, fills in every timing field the simulator
reads, and asks the simulator for the step-time prediction.

Timing conventions (per micro-batch, per worker): ``forward_ms``/``backward_ms`` are the compute of
the worker's shard of its samples plus, under ``split``, the all-reduces Megatron-style sharding
costs, in each direction one per shard group with a row projection (an attention block's output
projection, an MLP's down projection: ``StageCost.tp_allreduce_bytes``), and in the forward the two of a
class-sharded head's cross-entropy (``StageCost.loss_allreduce_bytes``): they run inside the segment, so
they are part of it; a stage that
recomputes its activations (``StagePlan.recompute``) runs its forward again inside its backward
(:func:`planner.devices.cost_model.backward_flops`), and its ``memory_gib`` is priced so
(:func:`planner.devices.memory.stage_memory` with ``recompute``);
``allreduce_ms`` is the ring all-reduce of the worker's gradient shard (``gradient_bytes``) over
every worker holding the same shard, in one bucket; under ZeRO (``StagePlan.zero_stage`` >= 1) the
step's all-gathers and reduce-scatters of that shard instead
(:meth:`planner.devices.cost_model.CommModel.zero_ms`), ``gradient_bytes`` 0, so the simulator runs
them after the backward, not overlapped (FSDP2's prefetch is not modeled: an upper bound); under
ragged shards (``StagePlan.replica_sync`` ``"ragged"``, ``StagePlan.state_fractions`` in rank order)
one collective per bucket (:func:`~planner.devices.cost_model.ragged_collectives`), padded to the largest
rank's rows;
``weights_gib`` ... ``activations_gib`` the memory model's terms at the worker's peak; ``BoundaryPlan.transfer_ms`` is the predicted
time of the boundary's forward resharding of that micro-batch, every sender ready at once
(:mod:`planner.schedule.boundary_traffic`: the plan :func:`planner.resharding.reshard.boundary_resharding` makes
under ``Plan.resharding``, whose transfers share the host network interfaces).

Predictions: :func:`predict` simulates on the cluster's network (:func:`planner.simulate` with
``network``), as the runtime runs: DDP's buckets overlapped with the backward, the boundary
transfers queued on devices and host interfaces. All links are priced by
:class:`planner.devices.network.NetworkModel`.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from whalelike.cluster import Cluster, Device
from whalelike.config import Config
from whalelike.graphs.taskgraph import TaskGraphs

from planner.decisions import Decisions, cut_into_units, stage_syncs, zero_shards
from planner.groups import groups_of
from planner.devices.cost_model import GIB, CommModel, backward_flops, compute_ms, ragged_collectives, update_ms
from planner.devices.memory import ZeroShards, fsdp_units, recompute_unit, runs_foreach, stage_memory
from planner.devices.stage_cost import ACTIVATION_BYTES, CAPTURED_BYTES
from planner.shares.batchnorm_statistics import stage_batchnorms
from planner.shares.state_fractions import in_rank_order, padded_scale
from planner.schedule.boundary_traffic import FORWARD, plan_traffic
from planner.devices.network import NetworkModel
from planner.plan import BoundaryPlan, Plan, Prediction, StagePlan, Worker, fingerprint_of
from planner.schedule.simulator import simulate
from planner.devices.placement import Layout


def build_plan(graphs: TaskGraphs, cluster: Cluster, config: Config, dec: Decisions) -> Plan:
    """A Plan from ``dec`` with timings and memory filled in; predictions are left at zero."""
    comm = CommModel(cluster.network)
    layout = dec.layout
    syncs = stage_syncs(graphs, config, dec)   # replica_sync (P-Reduce's settings with it), planner.decisions
    stages = [
        StagePlan(
            index=s,
            taskgraphs=sorted({graphs.layers[i].taskgraph for i in layers}),
            layers=list(layers),
            strategy=layout.shapes[s].label,
            shard_sizes={p: list(v) for p, v in dec.shards[s].shard_sizes.items()},
            batchnorm=stage_batchnorms(graphs, layers),
            recompute=dec.recomputes(s),
            recompute_reason=(dec.recompute[s] if dec.recompute else "") or "none",
            recompute_unit=recompute_unit(dec.costs[s], dec.in_flight[s]) if dec.recomputes(s) else "layer",
            **syncs[s],
            zero_stage=dec.zero_stage(s),
            zero_reason=dec.zero_reason[s] if dec.zero_reason else "none",
            folded=list(layout.shapes[s].folded),
            kept_work=dict(dec.kept_work).get(s),
        )
        for s, layers in enumerate(dec.stage_layers)
    ]
    # Rank r runs the r-th used device in cluster order, as torchrun numbers processes host by host
    # and a process uses its local device LOCAL_RANK.
    placed = sorted(((device, r, s, d, t, group) for r, replica in enumerate(layout.groups)
                     for s, groups in enumerate(replica) for d, group in enumerate(groups)
                     for t, device in enumerate(group)), key=lambda item: cluster.positions[item[0].name])
    workers = [_worker(rank, *item, dec, comm) for rank, item in enumerate(placed)]
    ranks = {w.device: w.rank for w in workers}
    for s, st in enumerate(stages):   # ragged shards: the group's fractions in rank order (the runtime's order)
        if dec.fractions(s):
            st.state_fractions = in_rank_order(dec.fractions(s), [g[0].name for g in layout.stage_groups(s)], ranks)
    _fill_allreduce(workers, layout, dec, comm, {s: st.partial_group_size for s, st in enumerate(stages)
                                                 if st.replica_sync == "partial"})
    zero = Prediction(0.0, 0.0, 0.0)
    plan = Plan(
        model_fingerprint=fingerprint_of(graphs),
        cluster=cluster.name,
        global_batch_size=config.global_batch_size,
        num_micro_batch=dec.num_micro_batch,
        schedule=config.schedule,
        solver=dec.solver,
        stages=stages,
        workers=workers,
        boundaries=_boundaries(graphs, dec),
        prediction=zero,
        naive_prediction=zero,
        optimality_gap=dec.optimality_gap,
        sync_batchnorm=config.sync_batchnorm,
        resharding=config.resharding,
        delay_weight_gradients=config.delay_weight_gradients,
        precision=config.precision,
        # Worker.capacity_gib is the memory of the cluster's view: the devices' less this reserve
        memory_reserve=cluster.memory_reserved,
    )
    _fill_transfers(plan, cluster)
    return plan


def predict(plan: Plan, cluster: Optional[Cluster] = None) -> Prediction:
    """Simulate one step of ``plan`` (see :mod:`planner.schedule.simulator`) on ``cluster``'s network, the
    cluster it was made for; without it, the plan's own timing fields alone (no DDP buckets, one
    ``transfer_ms`` per sending group)."""
    return simulate(plan, record_events=False, network=cluster).prediction


def with_predictions(plan: Plan, naive: Plan, cluster: Optional[Cluster] = None) -> Plan:
    return dataclasses.replace(plan, prediction=predict(plan, cluster), naive_prediction=predict(naive, cluster))


def _worker(rank, device: Device, r, s, d, t, group, dec: Decisions, comm: CommModel) -> Worker:
    cost, fraction, again = dec.costs[s], dec.shards[s].fractions[t], dec.recomputes(s)
    sizes = dec.sizes[r][s][d]
    # priced once per distinct micro-batch size (a 1024-device plan has ~10^5 micro-batch slots)
    tp_comm = {b: comm.allreduce_each_ms(cost.tp_allreduce_bytes, b, group) for b in set(sizes)}
    # a class-sharded head's cross-entropy: its all-reduces in the forward only (StageCost.loss_allreduce_bytes)
    loss_comm = {b: comm.allreduce_each_ms(cost.loss_allreduce_bytes, b, group) for b in set(sizes)}
    forward_of = {b: compute_ms(cost.forward_flops * b * fraction, device, cost.precision) + c + loss_comm[b]
                  for b, c in tp_comm.items()}
    # a recomputing stage also re-runs the forward's tensor-parallel all-reduces in its backward
    backward_of = {b: compute_ms(backward_flops(cost, again) * b * fraction, device, cost.precision) + c * (2 if again else 1)
                   for b, c in tp_comm.items()}
    forward, backward = [forward_of[b] for b in sizes], [backward_of[b] for b in sizes]
    # a worker of one micro-batch per step holds less under ZeRO 1-2 (planner.devices.memory, "ZeRO")
    zero = dataclasses.replace(zero_of(dec, s, group), single=len(sizes) == 1)
    memory = stage_memory(cost, dec.in_flight[s], fraction, recompute=again, unit_share=dec.shards[s].unit_share(t),
                          zero=zero, foreach=runs_foreach(device))
    terms = memory.term_bytes(max(sizes))
    return Worker(
        rank=rank, device=device.name, host=device.host, replica=r, stage=s, dp_index=d,
        tp_index=t, tp_size=len(group), micro_batch_sizes=list(sizes),
        memory_gib=memory.total(max(sizes)) / GIB,
        weights_gib=terms["weight"] / GIB, gradients_gib=terms["gradient"] / GIB,
        optimizer_gib=terms["optimizer"] / GIB, activations_gib=terms["activation"] / GIB,
        update_gib=terms["update"] / GIB,
        capacity_gib=device.memory_gib,
        compute_ms=sum(forward) + sum(backward), forward_ms=forward, backward_ms=backward,
        update_ms=update_ms(cost, fraction, zero, device),
        action_overhead_ms=(device.measured_action_overhead_us or 0.0) * 1e-3,
    )


def zero_of(dec: Decisions, s: int, group: tuple[Device, ...] | None = None) -> ZeroShards:
    """What stage ``s``'s data-parallel group shards under its ZeRO stage (:class:`ZeroShards`); under
    ragged shards, with ``group``'s own fraction of the state (``Decisions.state_fractions``)."""
    fractions = dec.fractions(s)
    zero = zero_shards(dec.layout, s, dec.costs[s], dec.zero_stage(s), fractions)
    if not fractions or group is None:
        return zero
    return dataclasses.replace(zero, share=fractions[dec.layout.stage_groups(s).index(group)])


def _fill_allreduce(workers: list[Worker], layout: Layout, dec: Decisions, comm: CommModel,
                    partial: Optional[dict[int, int]] = None) -> None:
    """Workers holding the same shard of a stage (over data-parallel groups and replicas) all-reduce
    their gradients once per step (``gradient_bytes``: the simulator's DDP buckets); under ZeRO they
    run its all-gathers and reduce-scatters instead (:meth:`CommModel.zero_ms`, each FSDP unit one
    collective, the most micro-batches of the group), priced as communication at the end of the
    step (``allreduce_ms``, ``gradient_bytes`` 0: the simulator overlaps none of it). A P-Reduce
    stage (``partial``: stage -> group size) averages its parameters within a group after the
    optimizer step instead: :func:`_partial_allreduce_ms`, ``gradient_bytes`` 0 (nothing overlaps
    the backward)."""
    peers = groups_of(workers, "dp")
    by_name = {d.name: d for r in layout.groups for s in r for g in s for d in g}
    for (s, t), ws in peers.items():
        nbytes = dec.costs[s].param_bytes * dec.shards[s].fractions[t]
        ring = [by_name[w.device] for w in sorted(ws, key=lambda w: w.rank)]
        z = dec.zero_stage(s)
        if z:
            units = len(fsdp_units(dec.costs[s], layout.num_stages == 1, cut_into_units(layout, s)))
            if dec.fractions(s):   # ragged: one collective per bucket, padded to the largest rank's rows
                nbytes *= padded_scale(dec.fractions(s))
                units = ragged_collectives(dec.costs[s], z, layout.num_stages == 1)
            ms = comm.zero_ms(z, nbytes, max(len(w.micro_batch_sizes) for w in ws), ring, units)
        elif partial and s in partial:
            own = _partial_allreduce_ms(sorted(ws, key=lambda w: w.rank), nbytes, partial[s], by_name, comm)
            for w in ws:
                w.allreduce_ms, w.gradient_bytes = own[w.rank], 0.0
            continue
        else:
            ms = comm.allreduce_ms(nbytes, ring)
        for w in ws:
            w.allreduce_ms = ms
            w.gradient_bytes = 0.0 if z else float(nbytes)


def _partial_allreduce_ms(ws: list[Worker], nbytes: float, group_size: int, by_name: dict,
                          comm: CommModel) -> dict[int, float]:
    """P-Reduce's price per worker: an all-reduce of ``nbytes`` among the ``group_size`` members of
    its group (a ring over the group's devices, so over the links between them: the message volume
    ``2 (g - 1) / g * nbytes`` per member at the slowest of those links), averaged over the two kinds
    of iteration both generators alternate (runtime.replicas.group_generator): a group across hosts
    (the hosts' members interleaved, cut into groups of ``g``) and one within the worker's host (its
    host's members cut into groups of ``g``; one host: every iteration). The groups are the static
    schedule's first inter- and intra-host division, ranks in order; the smart generator's random
    divisions have the same sizes and kinds of links. ``g`` >= the group: everyone, one ring. The
    runtime's exchange (``PartialSync.average``) sends each member's vector to every peer, the
    volume of this ring at ``g = 2`` (the default), ``g / 2`` times it above."""
    by_host: dict[str, list[Worker]] = {}
    for w in ws:
        by_host.setdefault(w.host, []).append(w)
    divisions = [list(by_host.values())]                                   # within hosts
    if len(by_host) > 1:                                                   # across: the hosts interleaved
        longest = max(len(v) for v in by_host.values())
        divisions.append([[v[j] for j in range(longest) for v in by_host.values() if j < len(v)]])
    if group_size >= len(ws):
        divisions = [[ws]]
    out = {w.rank: 0.0 for w in ws}
    for division in divisions:
        for members in division:
            for i in range(0, len(members), group_size):
                group = members[i:i + group_size]
                ms = comm.allreduce_ms(nbytes, [by_name[w.device] for w in group])
                for w in group:
                    out[w.rank] += ms / len(divisions)
    return out


def _boundaries(graphs: TaskGraphs, dec: Decisions) -> list[BoundaryPlan]:
    """The boundaries with their tensors and sizes; :func:`_fill_transfers` prices them."""
    out = []
    for s in range(dec.layout.num_stages - 1):
        cut = dec.stage_layers[s][-1]
        # at the training precision's bytes per element, as StageCost counts the boundary buffers
        scale = ACTIVATION_BYTES[dec.costs[s].precision] / CAPTURED_BYTES
        per_sample = graphs.layers[cut].cut_bytes_per_sample * scale
        # values without a batch dimension (a statistic of the micro-batch) cross whole, once per micro-batch
        whole = graphs.layers[cut].cut_bytes_unbatched * scale
        out.append(BoundaryPlan(s, s + 1, _crossing_tensors(graphs, cut), float(per_sample), [], float(whole)))
    return out


def _fill_transfers(plan: Plan, cluster: Cluster) -> None:
    """``transfer_ms[m]``: the predicted time of boundary's forward resharding of micro-batch ``m``."""
    if not plan.boundaries:
        return
    traffic = plan_traffic(plan, NetworkModel.of_cluster(cluster))
    for index, boundary in enumerate(plan.boundaries):
        boundary.transfer_ms = [t.predicted_ms if t is not None else 0.0 for t in traffic[index, FORWARD]]


def _crossing_tensors(graphs: TaskGraphs, cut: int) -> list[str]:
    """Names of the tensors a stage boundary right after layer ``cut`` carries: TaskGraph boundary
    tensors produced at or before it and consumed after it, or the layer's output when the cut
    falls inside a TaskGraph."""
    last_layer = {tg.index: max(tg.layers) for tg in graphs}
    first_layer = {tg.index: min(tg.layers) for tg in graphs}
    names = [
        t.name
        for b in graphs.boundaries
        if last_layer[b.src] <= cut < first_layer[b.dst]
        for t in b.tensors
    ]
    inside = graphs.layers[cut].taskgraph
    if last_layer[inside] != cut:
        names.append(f"{graphs.layers[cut].name}:output")
    return names
