"""Pipeline partitioner: ILP vs dynamic program, contiguity, memory, speed-awareness, errors, and the
``"step"`` objective (the schedule's makespan: issue 30, item 4)."""
from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.devices.cost_model import StageCost
from planner.partition.pricing import Pricing
from planner.partition.solve import (
    DeviceMemory, LayerCost, Partition, PartitionInfeasible, PartitionProblem, StageLink, StageSlot, layer_costs,
    partition,
)
from planner.plan import PlanError

from synthetic import synthetic_model

GIB = 2**30


def uniform_layers(n: int, static_gib: float = 1.0, act_gib: float = 0.05, cut_gib: float = 0.0) -> list[LayerCost]:
    return [LayerCost(f"l{i}", 1e9, 2e9, static_gib * GIB / 4, static_gib * GIB * 3 / 4, act_gib * GIB, cut_gib * GIB)
            for i in range(n)]


def links(n: int, gbps: float = 10.0) -> list[StageLink]:
    return [StageLink(gbps * 1e9, 5e-6)] * n


# -- independent checks (recomputed from the definitions, not through the partitioner) -------------
def stage_memory(p: PartitionProblem, k: int, slot: int, first: int, last: int, d: DeviceMemory) -> float:
    S = len(p.slots)
    chosen = p.layers[first:last + 1]
    per_sample = sum(l.activation_bytes for l in chosen)
    per_sample += p.layers[first - 1].cut_bytes if k > 0 else 0.0
    per_sample += p.layers[last].cut_bytes if k < S - 1 else 0.0
    static = sum(l.param_bytes + l.state_bytes for l in chosen)
    return d.weight_fraction * static + d.batch_fraction * p.micro_batch * p.in_flight[k] * per_sample


def stage_time(p: PartitionProblem, k: int, slot: int, first: int, last: int) -> float:
    S = len(p.slots)
    t = p.micro_batch * sum(l.forward_flops + l.backward_flops for l in p.layers[first:last + 1]) / p.slots[slot].flops_per_s
    if k < S - 1:
        t += p.links[k].latency_s + p.micro_batch * p.layers[last].cut_bytes / p.links[k].bandwidth_bytes_per_s
    if k > 0:
        t += p.links[k - 1].latency_s + p.micro_batch * p.layers[first - 1].cut_bytes / p.links[k - 1].bandwidth_bytes_per_s
    return t


def check_valid(p: PartitionProblem, result: Partition) -> None:
    """Contiguous, every layer exactly once, a permutation of slots, in memory, times as modelled."""
    flat = [i for layers in result.stage_layers() for i in layers]
    assert flat == list(range(len(p.layers)))
    assert all(s.layers for s in result.stages)
    assert sorted(result.order) == list(range(len(p.slots)))
    if p.order == "fixed":
        assert result.order == tuple(range(len(p.slots)))
    for k in p.keep_position:
        assert result.order[k] == k
    for layer, stage in p.pinned.items():
        assert layer in result.stages[stage].layers
    for s in result.stages:
        for d in p.slots[s.slot].devices:
            assert stage_memory(p, s.position, s.slot, s.first, s.last, d) <= d.capacity_bytes * (1 + 1e-9)
        assert s.time_s == pytest.approx(stage_time(p, s.position, s.slot, s.first, s.last), rel=1e-9)
    assert result.bottleneck_s == pytest.approx(max(s.time_s for s in result.stages), rel=1e-12)


# -- random small instances ------------------------------------------------------------------------
@st.composite
def small_problems(draw, order=st.sampled_from(["fixed", "search"])):
    L = draw(st.integers(2, 9))
    S = draw(st.integers(1, min(4, L)))
    fl = st.floats(0.5, 8.0)
    layers = [LayerCost(f"l{i}", draw(fl) * 1e9, draw(fl) * 2e9, draw(st.floats(0.05, 1.0)) * GIB,
                        draw(st.floats(0.1, 2.0)) * GIB, draw(st.floats(0.0, 0.3)) * GIB,
                        draw(st.floats(0.0, 0.05)) * GIB) for i in range(L)]
    slots = []
    for g in range(S):
        n = draw(st.integers(1, 3))
        speeds = [draw(st.sampled_from([8e12, 15e12, 30e12, 60e12])) for _ in range(n)]
        mems = [draw(st.sampled_from([8, 16, 32, 80])) * GIB for _ in range(n)]
        slots.append(StageSlot.data_parallel(f"g{g}", speeds, mems))
    m = draw(st.integers(1, 6))
    return PartitionProblem.for_schedule(
        layers, slots, [StageLink(draw(st.sampled_from([1e9, 10e9, 100e9])), 1e-5) for _ in range(S - 1)],
        micro_batch=draw(st.integers(1, 8)), num_micro_batch=m, schedule=draw(st.sampled_from(["1f1b", "gpipe"])),
        order=draw(order))


def solve_both(p: PartitionProblem):
    try:
        greedy = partition(p, solver="greedy")
    except PartitionInfeasible:
        greedy = None
    try:
        ilp = partition(p, solver="ilp", time_limit_s=20)
    except PartitionInfeasible:
        ilp = None
    return greedy, ilp


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_problems())
def test_ilp_and_greedy_agree_on_small_instances(p):
    greedy, ilp = solve_both(p)
    if ilp is None:  # the ILP is exact: no split fits, so the greedy cannot have found one
        assert greedy is None
        return
    check_valid(p, ilp)
    assert ilp.solver == "ilp"
    if greedy is None:  # only a searched order can make the greedy miss a feasible split
        assert p.order == "search"
        return
    check_valid(p, greedy)
    assert greedy.solver == "greedy"
    assert ilp.bottleneck_s <= greedy.bottleneck_s * (1 + 1e-7)
    if ilp.gap == 0.0 and greedy.gap == 0.0:  # both proven optimal: the same bottleneck
        assert ilp.bottleneck_s == pytest.approx(greedy.bottleneck_s, rel=1e-7)
    if p.order == "fixed":  # the dynamic program is exact for a given order
        assert greedy.gap == 0.0
        assert ilp.bottleneck_s == pytest.approx(greedy.bottleneck_s, rel=1e-7)


def test_dynamic_program_matches_brute_force():
    """Every split of 7 layers over 3 stages, priced by the independent model: the DP finds the minimum."""
    import itertools
    layers = [LayerCost(f"l{i}", (i % 3 + 1) * 1e9, (i % 2 + 1) * 2e9, 0.1 * GIB, 0.3 * GIB, 0.02 * GIB, (7 - i) * 1e6)
              for i in range(7)]
    slots = [StageSlot.data_parallel("a", [20e12], [16 * GIB]), StageSlot.data_parallel("b", [10e12, 10e12], [8 * GIB] * 2),
             StageSlot.data_parallel("c", [5e12], [4 * GIB])]
    p = PartitionProblem.for_schedule(layers, slots, links(2, 1.0), micro_batch=4, num_micro_batch=4)
    best = math.inf
    for a, b in itertools.combinations(range(1, 7), 2):
        ranges = [(0, a - 1), (a, b - 1), (b, 6)]
        fits = all(stage_memory(p, k, k, i, j, d) <= d.capacity_bytes
                   for k, (i, j) in enumerate(ranges) for d in slots[k].devices)
        if fits:
            best = min(best, max(stage_time(p, k, k, i, j) for k, (i, j) in enumerate(ranges)))
    result = partition(p, solver="greedy")
    check_valid(p, result)
    assert result.bottleneck_s == pytest.approx(best, rel=1e-12)


# -- speed and memory awareness --------------------------------------------------------------------
@pytest.mark.parametrize("solver", ["greedy", "ilp"])
def test_faster_groups_get_more_uniform_layers(solver):
    speeds = [40e12, 10e12, 20e12, 10e12]
    slots = [StageSlot.data_parallel(f"g{g}", [s], [80 * GIB]) for g, s in enumerate(speeds)]
    p = PartitionProblem.for_schedule(uniform_layers(16), slots, links(3, 100.0), micro_batch=2, num_micro_batch=8)
    result = partition(p, solver=solver)
    check_valid(p, result)
    counts = [len(s.layers) for s in result.stages]
    assert counts == [8, 2, 4, 2]
    for a in range(4):
        for b in range(4):
            if speeds[a] > speeds[b]:
                assert counts[a] > counts[b]


def test_memory_limits_a_fast_small_device():
    """A fast device with little memory takes fewer layers than its speed alone would give it."""
    slots = [StageSlot.data_parallel("big-slow", [10e12], [80 * GIB]), StageSlot.data_parallel("small-fast", [40e12], [4 * GIB])]
    p = PartitionProblem.for_schedule(uniform_layers(10), slots, links(1), micro_batch=1, num_micro_batch=4)
    result = partition(p)
    check_valid(p, result)
    assert len(result.stages[1].layers) == 3  # 3 x 1 GiB of weights + activations fits in 4 GiB; 4 do not
    assert result.stages[1].memory_utilization <= 1.0


@pytest.mark.parametrize("solver", ["greedy", "ilp"])
def test_order_search_puts_large_memory_first(solver):
    """Equal speeds: the activation-heavy first stage (4 micro-batches in flight) needs the 80 GB group."""
    slots = [StageSlot.data_parallel("small", [20e12], [8 * GIB]), StageSlot.data_parallel("large", [20e12], [80 * GIB])]
    layers = uniform_layers(8, static_gib=0.5, act_gib=0.5)
    fixed = PartitionProblem.for_schedule(layers, slots, links(1), micro_batch=2, num_micro_batch=8, schedule="gpipe")
    searched = PartitionProblem.for_schedule(layers, slots, links(1), micro_batch=2, num_micro_batch=8,
                                             schedule="1f1b", order="search")
    result = partition(searched, solver=solver)
    check_valid(searched, result)
    assert result.order == (1, 0)
    assert searched.in_flight == (2, 1)
    with pytest.raises(PartitionInfeasible):
        partition(fixed, solver=solver)


def test_auto_uses_ilp_only_where_it_can_improve():
    slots = [StageSlot.data_parallel("a", [20e12], [16 * GIB]), StageSlot.data_parallel("b", [10e12], [16 * GIB])]
    layers = uniform_layers(6)
    fixed = PartitionProblem.for_schedule(layers, slots, links(1), micro_batch=1, num_micro_batch=2)
    searched = PartitionProblem.for_schedule(layers, slots, links(1), micro_batch=1, num_micro_batch=2, order="search")
    assert (partition(fixed).solver, partition(fixed).gap) == ("greedy", 0.0)
    result = partition(searched)
    assert (result.solver, result.gap) == ("ilp", 0.0)


def test_pins_and_kept_positions_hold():
    speeds = [10e12, 40e12, 20e12]
    slots = [StageSlot.data_parallel(f"g{g}", [s], [80 * GIB]) for g, s in enumerate(speeds)]
    p = PartitionProblem.for_schedule(uniform_layers(12), slots, links(2), micro_batch=1, num_micro_batch=4,
                                      pinned={0: 0, 1: 0, 2: 0, 3: 0, 11: 2}, order="search", keep_position={2})
    for solver in ("greedy", "ilp"):
        result = partition(p, solver=solver)
        check_valid(p, result)
        assert result.order[2] == 2


def test_tensor_parallel_slot_shards_weights():
    """A split(2) slot holds half the weights per device, so it takes twice the layers memory-wise."""
    halves = StageSlot("tp2", 20e12, (DeviceMemory(4 * GIB, 0.5, 0.5, "t0"), DeviceMemory(4 * GIB, 0.5, 0.5, "t1")))
    whole = StageSlot.data_parallel("dp1", [1000e12], [4 * GIB])
    p = PartitionProblem.for_schedule(uniform_layers(12, act_gib=0.0), [whole, halves], links(1), micro_batch=1,
                                      num_micro_batch=1)
    result = partition(p)
    check_valid(p, result)
    assert [len(s.layers) for s in result.stages] == [4, 8]


def test_layer_costs_price_like_stage_cost():
    graphs = synthetic_model(num_layers=6, vocab=1000)
    costs = layer_costs(graphs)
    whole = StageCost.of_layers(graphs, range(6))
    assert sum(c.flops for c in costs) == pytest.approx(whole.flops_per_sample)
    assert sum(c.static_bytes for c in costs) == pytest.approx(whole.static_bytes)
    assert sum(c.activation_bytes for c in costs) == pytest.approx(whole.activation_bytes)
    assert [c.cut_bytes for c in costs] == [l.cut_bytes_per_sample for l in graphs.layers]


# -- errors ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("solver", ["greedy", "ilp"])
def test_infeasible_names_stage_layers_and_shortfall(solver):
    slots = [StageSlot.data_parallel("v100", [15e12], [32 * GIB], ["v100-0"]),
             StageSlot.data_parallel("t4", [8e12], [16 * GIB], ["t4-0"])]
    p = PartitionProblem.for_schedule(uniform_layers(50), slots, links(1), micro_batch=1, num_micro_batch=2)
    with pytest.raises(PartitionInfeasible) as err:
        partition(p, solver=solver)
    text = str(err.value)
    assert isinstance(err.value, PlanError)
    # 50 x 1.1 GiB on stage 0 (2 micro-batches in flight), 1.05 GiB on stage 1: the split that
    # overflows least relative to capacity is 33 / 17 layers
    assert "stage 0 (slot 'v100', layers 0-32" in text and "'v100-0' of 32.00 GiB: short by 4.30 GiB" in text
    assert "stage 1 (slot 't4', layers 33-49" in text and "'t4-0' of 16.00 GiB: short by 1.85 GiB" in text


def test_bad_inputs_name_the_field():
    slot = StageSlot.data_parallel("a", [1e12], [GIB])
    with pytest.raises(ValueError, match="forward_flops"):
        LayerCost("x", -1.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="links"):
        PartitionProblem(tuple(uniform_layers(3)), (slot, slot), (), 1, (2, 1))
    with pytest.raises(PartitionInfeasible, match="3 layers cannot fill 4"):
        PartitionProblem(tuple(uniform_layers(3)), (slot,) * 4, tuple(links(3)), 1, (4, 3, 2, 1))
    with pytest.raises(PartitionInfeasible, match="contradict"):
        PartitionProblem(tuple(uniform_layers(4)), (slot, slot), tuple(links(1)), 1, (2, 1), pinned={1: 1, 2: 0})
    with pytest.raises(ValueError, match="solver"):
        partition(PartitionProblem(tuple(uniform_layers(2)), (slot,), (), 1, (1,)), solver="cplex")


# -- the "step" objective (issue 30, item 4) -------------------------------------------------------
def all_splits(p: PartitionProblem):
    """Every contiguous split of ``p``'s layers over its stages (in the given order) that fits: each
    stage's first layer."""
    import itertools
    L, S = len(p.layers), len(p.slots)
    pricing = Pricing(p)
    mats = [pricing.cost(k, k) for k in range(S)]
    for cuts in itertools.combinations(range(1, L), S - 1):
        starts = [0, *cuts]
        ends = [s - 1 for s in starts[1:]] + [L - 1]
        if all(math.isfinite(m[i, j]) for m, i, j in zip(mats, starts, ends)):
            yield starts


def test_the_step_is_the_schedules_makespan():
    """Equal stages of forward f and backward b, links free: 1F1B and GPipe take (m + S - 1)(f + b);
    one micro-batch runs the stages one after another."""
    layers = [LayerCost(f"l{i}", 1e9, 2e9, 0.1 * GIB, 0.3 * GIB, 0.0, 0.0) for i in range(6)]
    slots = [StageSlot.data_parallel(f"g{g}", [1e12], [80 * GIB]) for g in range(3)]
    free = [StageLink(1e18, 0.0)] * 2
    for schedule in ("1f1b", "gpipe", "eager-1f1b"):
        for m in (1, 2, 5):
            p = PartitionProblem.for_schedule(layers, slots, free, micro_batch=1, num_micro_batch=m,
                                              schedule=schedule, objective="step")
            assert Pricing(p).step_s([0, 1, 2], [0, 2, 4]) == pytest.approx((m + 2) * 6e-3, rel=1e-12)
    # a send counts in its sender's time: one micro-batch crosses each link twice, one stage after another
    p = PartitionProblem.for_schedule(layers, slots, [StageLink(1e18, 1e-3)] * 2, micro_batch=1, num_micro_batch=1,
                                      objective="step")
    assert Pricing(p).step_s([0, 1, 2], [0, 2, 4]) == pytest.approx(18e-3 + 4e-3, rel=1e-12)


def test_one_micro_batch_keeps_the_heavy_layer_on_the_fast_stage():
    """The ResNet of issue 30 in small: a heavy first layer on a fast stage of two devices, a slow
    stage after it. The least bottleneck moves the light second layer to the slow stage (shaving the
    first stage), which one micro-batch pays in full; the step objective keeps it on the fast one."""
    layers = [LayerCost("stem", 10e9, 20e9, 0.01 * GIB, 0.03 * GIB, 0.0, 0.0),
              LayerCost("block", 0.5e9, 1e9, 0.01 * GIB, 0.03 * GIB, 0.0, 0.0),
              LayerCost("head", 0.5e9, 1e9, 0.01 * GIB, 0.03 * GIB, 0.0, 0.0)]
    slots = [StageSlot.data_parallel("fast", [2e12, 2e12], [4 * GIB] * 2),
             StageSlot.data_parallel("half", [1e12], [2 * GIB])]
    bottleneck = PartitionProblem.for_schedule(layers, slots, links(1), micro_batch=16, num_micro_batch=1)
    step = dataclasses.replace(bottleneck, objective="step")
    assert partition(bottleneck).stage_layers() == [[0], [1, 2]]
    result = partition(step)
    check_valid(step, result)
    assert result.stage_layers() == [[0, 1], [2]] and result.gap is None
    pricing = Pricing(step)
    assert pricing.step_s([0, 1], [0, 2]) < pricing.step_s([0, 1], [0, 1])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_problems(order=st.just("fixed")))
def test_the_step_objective_is_never_slower_than_the_least_bottleneck(p):
    """Under ``"step"`` the split's step is no longer than the least-bottleneck split's (the search
    starts there), and with one micro-batch (the step: the stages' sum) it is the shortest of all
    splits, checked against every split."""
    step = dataclasses.replace(p, objective="step")
    try:
        least_bottleneck = partition(p, solver="greedy")
    except PartitionInfeasible:
        with pytest.raises(PartitionInfeasible):
            partition(step, solver="greedy")
        return
    result = partition(step, solver="greedy")
    check_valid(step, result)
    pricing = Pricing(step)
    order = list(range(len(p.slots)))
    found = pricing.step_s(order, [s.first for s in result.stages])
    assert found <= pricing.step_s(order, [s.first for s in least_bottleneck.stages]) * (1 + 1e-12)
    if p.num_micro_batch == 1:
        assert found == pytest.approx(min(pricing.step_s(order, s) for s in all_splits(step)), rel=1e-9)


def test_the_ilp_searches_the_order_under_the_step_objective():
    """With the order searched, the ILP (its order by the pipelined bound, the split by the greedy
    search) returns a valid split no slower than the greedy one."""
    slots = [StageSlot.data_parallel("slow", [10e12], [80 * GIB]), StageSlot.data_parallel("fast", [40e12], [80 * GIB])]
    p = PartitionProblem.for_schedule(uniform_layers(8), slots, links(1), micro_batch=2, num_micro_batch=2,
                                      order="search", objective="step")
    greedy, ilp = partition(p, solver="greedy"), partition(p, solver="ilp")
    check_valid(p, greedy)
    check_valid(p, ilp)
    pricing = Pricing(p)
    steps = [pricing.step_s(list(r.order), [s.first for s in r.stages]) for r in (greedy, ilp)]
    assert steps[1] <= steps[0] * (1 + 1e-9) and ilp.gap is None
