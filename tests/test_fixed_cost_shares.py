"""Data-parallel shares that equalise each device's whole step: a time spent whatever the share (the
optimizer's update of a full replica, the launches per micro-batch) counts with the work, so a device
that updates slower gets fewer samples instead of making the others wait for it.

``proportional_shares(..., fixed=)`` and ``Slot.fixed`` (:mod:`planner.shares.batch_shares`), and the
planner's single-stage shares from a profile's rates (``Device.measured_update_ns_per_byte``,
``Device.measured_action_overhead_us``: :meth:`planner.shares.batch_fit.PricedStage.group_fixed_ms`).
"""
from __future__ import annotations

import dataclasses
import itertools
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import planner
import whalelike as wl
from planner.shares.batch_shares import Slot, balance_memory, balanced_shares, proportional_shares
from whalelike.cluster import Cluster, Device, Network

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import wide_mlp  # noqa: E402


def _makespan(shares, speeds, fixed):
    return max(f + s / v for s, v, f in zip(shares, speeds, fixed))


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_shares_with_fixed_times_sum_exactly_and_minimise_the_slowest_device(data):
    n = data.draw(st.integers(1, 6))
    speeds = data.draw(st.lists(st.floats(0.1, 50.0), min_size=n, max_size=n))
    fixed = data.draw(st.lists(st.floats(0.0, 40.0), min_size=n, max_size=n))
    minimum = data.draw(st.integers(0, 3))
    total = minimum * n + data.draw(st.integers(0, 400))
    shares = proportional_shares(total, speeds, minimum, fixed=fixed)
    assert sum(shares) == total and all(s >= minimum for s in shares)
    makespan = _makespan(shares, speeds, fixed)
    for i, j in itertools.permutations(range(n), 2):   # no single move shortens the step
        if shares[i] > minimum:
            moved = list(shares)
            moved[i] -= 1
            moved[j] += 1
            assert _makespan(moved, speeds, fixed) >= makespan - 1e-9, (shares, moved)


def test_shares_with_fixed_times_are_the_best_split_small_cases():
    """Against every split, exhaustively, on small cases."""
    for speeds, fixed, total, minimum in [([1.0, 1.0], [0.0, 10.0], 30, 0), ([2.0, 1.0, 0.5], [3.0, 0.0, 1.0], 14, 1),
                                          ([1.0, 3.0], [9.0, 0.0], 9, 1), ([1.0, 1.0, 1.0], [5.0, 5.0, 0.0], 12, 2)]:
        shares = proportional_shares(total, speeds, minimum, fixed=fixed)
        best = min(_makespan(split, speeds, fixed) for split in itertools.product(range(minimum, total + 1), repeat=len(speeds))
                   if sum(split) == total)
        assert _makespan(shares, speeds, fixed) == pytest.approx(best), (speeds, fixed, shares)


def test_fixed_time_examples_and_the_rule_without_them():
    assert proportional_shares(100, [1.0, 1.0], fixed=[0.0, 10.0]) == [55, 45]        # both end at 55
    assert proportional_shares(100, [1.0, 1.0], 1, fixed=[0.0, 500.0]) == [99, 1]     # its update alone is longer
    for total, speeds in [(100, [2.0, 1.0, 1.0]), (10, [1.0, 1.0, 1.0]), (7, [4.0, 2.0, 1.0])]:
        assert proportional_shares(total, speeds, fixed=[0.0] * len(speeds)) == proportional_shares(total, speeds)
    with pytest.raises(ValueError, match="fixed"):
        proportional_shares(10, [1.0, 1.0], fixed=[1.0])
    with pytest.raises(ValueError, match="fixed"):
        proportional_shares(10, [1.0, 1.0], fixed=[1.0, -1.0])
    with pytest.raises(ValueError, match="fixed"):
        Slot(1.0, 10, fixed=float("nan"))


def test_memory_balancing_moves_samples_to_the_valley_that_ends_soonest_with_its_fixed_time():
    # device 0 holds 10; of the 30 moved, the valley without a fixed time takes more
    slots = [Slot(1.0, 10), Slot(1.0, 100, fixed=20.0), Slot(1.0, 100)]
    shares = balance_memory([40, 20, 40], slots, lambda i, n: n / slots[i].cap)
    assert shares[0] == 10 and sum(shares) == 100
    assert shares == [10, 35, 55] and _makespan(shares, [1.0] * 3, [0, 20.0, 0]) == 55
    assert balanced_shares(100, slots, lambda i, n: n / slots[i].cap) == [10, 35, 55]


def _cluster(update_ns_per_byte: tuple[float, float]) -> Cluster:
    devices = tuple(Device(f"d{i}", "cpu-test", "localhost", peak_tflops=0.001, memory_gib=1.0,
                           measured_update_ns_per_byte=rate) for i, rate in enumerate(update_ns_per_byte))
    return Cluster("fixed-costs", devices, Network(10.0, 10.0, 50.0))


def test_the_planner_gives_the_slower_updating_device_fewer_samples_and_both_end_together():
    w = wide_mlp.build(width=64, blocks=4)
    graphs = wl.capture(w.model, w.example_args)
    config = wl.Config(global_batch_size=256, num_micro_batch=2, zero_stage=0)
    even = planner.plan(graphs, _cluster((1.0, 1.0)), config)
    assert [x.batch_share for x in even.workers] == [128, 128]
    plan = planner.plan(graphs, _cluster((1.0, 100.0)), config)
    fast, slow = plan.workers
    assert slow.update_ms > fast.update_ms > 0 and slow.batch_share < 128 < fast.batch_share
    per_sample = fast.compute_ms / fast.batch_share
    # each rank's whole step (work and update) within one sample's time of the other's
    assert abs((fast.compute_ms + fast.update_ms) - (slow.compute_ms + slow.update_ms)) <= per_sample * 1.001
    # the simulator's steady state: each worker starts with its update of the step before, so the step is
    # the latest update plus compute, then the all-reduce (not the slowest compute plus the slowest update)
    result = planner.simulate(plan)
    assert result.step_time_ms == pytest.approx(max(x.update_ms + x.compute_ms for x in plan.workers)
                                                + max(x.allreduce_ms for x in plan.workers))
    # and the step predicted is shorter than the speed-proportional shares' with the same updates
    speed_only = dataclasses.replace(even, workers=[dataclasses.replace(e, update_ms=x.update_ms)
                                                    for e, x in zip(even.workers, plan.workers)])
    assert planner.simulate(plan).step_time_ms < planner.simulate(speed_only).step_time_ms
