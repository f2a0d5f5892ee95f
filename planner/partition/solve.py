"""Pipeline partitioning: contiguous runs of layers onto device groups of unequal speed and memory.

A pipeline of ``S`` stages runs the model's layers in ``S`` contiguous ranges; stage position ``k``
runs on one device group (a :class:`StageSlot`: a data-parallel and/or tensor-parallel group). The
partitioner picks the ranges, and optionally which group takes which position, so that the slowest
stage is as fast as possible (``PartitionProblem.objective`` ``"bottleneck"``, the default), or the
step the schedule's action lists take with these stage times is shortest (``"step"``, what the
planner asks: with few micro-batches the pipeline's fill and drain are most of the step, and with
one micro-batch the stages run one after the other), while every device of every stage holds what
it must. Pure and process-free; torch's ``pipelining`` splits a model where it is told to and never
chooses where.

Model (per micro-batch of ``micro_batch`` samples, SI units: FLOP/s, bytes, seconds)::

    time(k)   = micro_batch * (fwd + bwd FLOPs of its layers) / slot.flops_per_s
              + [k < S-1] (latency_k   + micro_batch * cut_out / bandwidth_k)    # activations forward
              + [k > 0]   (latency_k-1 + micro_batch * cut_in  / bandwidth_k-1)  # gradients backward
    memory(d) = d.weight_fraction * params + d.gradient_fraction * gradients
              + d.optimizer_fraction * optimizer state                        # of its layers
              + d.batch_fraction * micro_batch * in_flight[k] * (activations + cut_in + cut_out)

for every device ``d`` of the slot (``cut_in``/``cut_out``: bytes per sample of the boundary the
stage receives/sends, the buffers :class:`~planner.devices.cost_model.StageCost` also counts): the
planner's one memory model, :class:`~planner.devices.memory.MemoryTerms`, over every layer range
at once. Gradients and optimizer state take the weight fraction unless a device says otherwise. Memory is
checked per device, not per group: the binding device depends on the layers (a small-memory device
with a small batch share binds on weights, a large one with a large share on activations), so a
single "binding device" per slot would be wrong for some ranges. The fractions are the caller's:
:meth:`StageSlot.data_parallel` gives every device the whole stage's weights and a batch share
proportional to its speed, the shares the time model assumes; a ``split`` group gives each device
its shard fraction of both. Data-parallel gradient all-reduce happens once per step, not per
micro-batch, and is left to the plan's simulator.

Early stages keep more micro-batches in flight (1F1B: ``S - k``; GPipe: all), so the position
matters for memory: with ``order="search"`` the partitioner also chooses the group of each
position. Links belong to positions (``links[k]`` joins positions ``k`` and ``k+1``) and do not
change when groups are reordered: true when neighbouring stages never share a host.

Solvers (both return a :class:`Partition`, exact evaluation by the same model):

* ``"greedy"``: for a given group order an exact dynamic program over (stage, last layer) on
  numpy cost matrices, ``O(S L^2)``; the optimum is exact, so its gap is 0. Among the optimal
  partitions it takes the one with the least sum of squared stage times (slack spread evenly rather
  than piled on one stage). Under ``"step"`` the schedule's step of the best of three dynamic
  programs' splits (least bottleneck, least sum, least pipelined bound), improved by one-layer
  boundary moves (:mod:`planner.partition.pricing`); not proven optimal, gap None. With ``order="search"`` the order starts from a rule (the best of
  most-memory-first, fastest-first and the given order) and improves by local moves (swap two
  groups, move one elsewhere) while (memory overflow, bottleneck, sum of squares) drops; the gap is
  then unknown (``None``). On 100 random small instances it matched the ILP on 98, within 0.03 %
  on average (``bench/plan_scale.py``).
* ``"ilp"``: a PuLP/CBC model (:mod:`planner.partition.ilp`), exact over layer ranges *and* group
  order, warm-started with the greedy answer so it is never worse; the dynamic program re-splits
  the layers for the ILP's order (exact, and free of CBC's tolerances). When CBC proves nothing
  beats its warm start, the greedy split is returned as the ILP's (gap 0). When CBC stops on its
  time limit the gap is read from its log; when it finds nothing in time the greedy answer is
  returned (solver ``"greedy"``).
* ``"auto"``: the ILP where it can beat the dynamic program (order search over at least two
  different groups) and the instance is small (``L * S <= ILP_MAX_CELLS`` and
  ``S <= ILP_MAX_STAGES``), the dynamic program otherwise.

Example::

    from planner.partition.solve import LayerCost, PartitionProblem, StageLink, StageSlot, partition

    layer = LayerCost("block", forward_flops=2e9, backward_flops=4e9, param_bytes=5e7,
                      state_bytes=1.5e8, activation_bytes=3e6, cut_bytes=5e5)
    slots = [StageSlot.data_parallel("a100x2", [125e12] * 2, [80 * 2**30] * 2),
             StageSlot.data_parallel("t4", [26e12], [16 * 2**30])]
    problem = PartitionProblem.for_schedule(
        [layer] * 24, slots, [StageLink(12.5e9, 5e-6)], micro_batch=8, num_micro_batch=8,
        schedule="1f1b", order="search")
    result = partition(problem)            # -> Partition
    result.stage_layers()                  # [[0, ..., 21], [22, 23]]: the A100s first
    result.bottleneck_s, result.solver, result.gap  # 0.00455, "ilp", 0.0

Infeasible problems raise :class:`PartitionInfeasible` (a :class:`~planner.plan.PlanError`) naming
the stage, its layers, the device and the shortfall in GiB of the split that comes closest to
fitting.

One concept per module: the data in and out (:mod:`planner.partition.problem`, every name
re-exported here), pricing a split and the dynamic program (:mod:`planner.partition.pricing`),
the group-order search (:mod:`planner.partition.order`), the ILP (:mod:`planner.partition.ilp`),
and here the entry point that chooses between them.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Literal, Optional, Sequence

from planner.devices.cost_model import GIB
from planner.devices.memory import fits
from planner.partition.order import order_is_free, search_order
from planner.partition.pricing import Pricing, Score, assemble, solve_order
from planner.partition.problem import (
    DeviceMemory, LayerCost, Partition, PartitionInfeasible, PartitionProblem, StageAssignment, StageLink, StageSlot,
    layer_costs,
)

log = logging.getLogger(__name__)

ILP_MAX_CELLS = 120      # layers x stages: CBC proves optimality within about a second up to here
ILP_MAX_STAGES = 5       # each searched position adds S assignment binaries; 6 stages can take CBC 10+ s

Solver = Literal["auto", "ilp", "greedy"]

# the data types live in planner.partition.problem; callers import them from here, with partition()
__all__ = ["DeviceMemory", "LayerCost", "Partition", "PartitionInfeasible", "PartitionProblem", "StageAssignment",
           "StageLink", "StageSlot", "Solver", "layer_costs", "partition", "ILP_MAX_CELLS", "ILP_MAX_STAGES"]


# -- entry point -----------------------------------------------------------------------------------
def partition(problem: PartitionProblem, solver: Solver = "auto", time_limit_s: float = 10.0) -> Partition:
    """Split ``problem.layers`` into contiguous pipeline stages (see the module docstring).

    ``solver``: ``"auto"``, ``"ilp"`` or ``"greedy"``; ``time_limit_s`` bounds CBC.
    Raises :class:`PartitionInfeasible` when no split fits in memory.
    """
    if solver not in ("auto", "ilp", "greedy"):
        raise ValueError(f"partition: solver must be 'auto', 'ilp' or 'greedy', got {solver!r}")
    p = problem
    L, S = len(p.layers), len(p.slots)
    pricing = Pricing(p)
    free = order_is_free(p)
    if free:
        order, score, starts = search_order(pricing)
    else:
        order = list(range(S))
        score, starts = solve_order(pricing, order)
    greedy = assemble(p, order, starts, "greedy", 0.0 if score.exact and not free else None) if score.excess == 0 else None
    use_ilp = solver == "ilp" or (solver == "auto" and free and L * S <= ILP_MAX_CELLS and S <= ILP_MAX_STAGES)
    if use_ilp:
        result = _with_ilp(pricing, greedy, score, time_limit_s)
        if result is not None:
            return result
    if greedy is None:
        raise _infeasible(pricing, order)
    log.debug("greedy partition: bottleneck %.6g s, %s %.6g s", greedy.bottleneck_s, p.objective, score.objective)
    return greedy


def _with_ilp(pricing: Pricing, greedy: Optional[Partition], greedy_score: Score,
              time_limit_s: float) -> Optional[Partition]:
    """The ILP's answer, warm-started with (and so never worse than) the greedy one (of
    ``greedy_score``); None when CBC has no verdict in time. The ILP picks the order; the dynamic
    program splits the layers for it, exactly (so CBC's tolerances never let a stage overflow).
    Under the ``"step"`` objective the ILP's order minimises the pipelined bound and the split is
    the greedy search's, so neither is claimed optimal (gap None)."""
    from planner.partition.ilp import solve_ilp  # the ILP module prices with this one's types

    p = pricing.p
    found = solve_ilp(p, warm=greedy, time_limit_s=time_limit_s)
    if found.status == "no solution":
        log.warning("CBC stopped without a partition (time limit %.1f s); using the greedy one", time_limit_s)
        return None
    if found.order is not None:
        score, starts = solve_order(pricing, found.order)
        if score.excess == 0 and (greedy is None or score.objective < greedy_score.objective):
            return assemble(p, found.order, starts, "ilp", found.gap if score.exact else None)
    if greedy is None:  # CBC proved that nothing fits
        return None
    # CBC found nothing better than its warm start: the greedy answer is optimal within the gap
    gap = (found.gap if found.order is not None else 0.0) if greedy_score.exact else None
    return dataclasses.replace(greedy, solver="ilp", gap=gap)


def _infeasible(pricing: Pricing, order: Sequence[int]) -> PartitionInfeasible:
    """Where the split that overflows least (for ``order``, the search's best) overflows."""
    p = pricing.p
    _, starts = solve_order(pricing, order)
    ends = [s - 1 for s in starts[1:]] + [len(p.layers) - 1]
    lines = []
    for k, (g, i, j) in enumerate(zip(order, starts, ends)):
        for d in p.slots[g].memory_classes:
            need = float(pricing.need(k, d)[i, j])
            if not fits(need, d.capacity_bytes):
                lines.append(
                    f"stage {k} (slot {p.slots[g].name!r}, layers {i}-{j} "
                    f"[{p.layers[i].name}..{p.layers[j].name}], {p.in_flight[k]} micro-batch(es) in flight) "
                    f"needs {need / GIB:.2f} GiB on device {d.name!r} of {d.capacity_bytes / GIB:.2f} GiB: "
                    f"short by {(need - d.capacity_bytes) / GIB:.2f} GiB")
                break
    return PartitionInfeasible(
        f"no split of the {len(p.layers)} layers over {len(p.slots)} pipeline stages fits in memory; "
        "the closest one overflows in " + "; ".join(lines)
        + ". Use a smaller micro-batch, fewer micro-batches in flight (1F1B instead of GPipe), "
          "devices with more memory, or shard the layers with split(n)")
