"""Bad input to capture, annotate and the planner (issue 10, item 5), each found by trying it: the
error it now raises, with its text, or the correct result where there is one.

Each test names the input; a regression of the first two would hang the planner rather than fail.
"""
from __future__ import annotations

import heapq
import os
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import planner
import whalelike as wl
from planner.shares.batch_fit import MAX_MICRO_BATCHES, divisors
from planner.devices.cost_model import UNBOUNDED_SAMPLES, StageCost
from planner.devices.memory import stage_memory
from planner.shares.batch_shares import DoesNotFit, Slot, balance_memory, balanced_shares, proportional_shares
from planner.partition.solve import PartitionProblem, StageSlot, partition
from planner.partition.ilp import cbc_path
from planner.plan import PlanError
from planner.shares.shard_sizes import split_dimension
from whalelike import AnnotationError, CaptureError, Cluster, Config, Device, Network
from whalelike.cli import main

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import hybrid_classifier  # noqa: E402


@pytest.fixture(scope="module")
def hybrid():
    workload = hybrid_classifier.build()
    return wl.capture(workload.model, workload.example_args)


def cluster_of(count: int, memory_gib: float, per_host: int = 8) -> Cluster:
    devices = [Device(f"d{i}", "X", f"h{i // per_host}", 10.0 + i % 3, memory_gib) for i in range(count)]
    return Cluster(name="built-in-code", devices=tuple(devices), network=Network(100.0, 10.0, 5.0))


class TwoLinears(nn.Module):
    """replicate over a Linear, then split over a Linear of ``out`` features (a lone group of ``out`` units)."""

    def __init__(self, out: int = 8):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, out)

    def forward(self, x):
        with wl.replicate():
            x = self.a(x)
        with wl.split():
            return self.b(x)


# -- 1. a global batch of 10**12 -------------------------------------------------------------------
def test_divisors_are_found_within_the_bound_only():
    for n in (1, 12, 360, 1001, 4096):
        assert divisors(n, 1, n) == [d for d in range(1, n + 1) if n % d == 0]
    assert divisors(360, 7, 40) == [8, 9, 10, 12, 15, 18, 20, 24, 30, 36, 40]
    huge = divisors(10**12, 1, MAX_MICRO_BATCHES)
    assert huge[:6] == [1, 2, 4, 5, 8, 10] and huge[-1] == 16000 and all(10**12 % d == 0 for d in huge)


def test_global_batch_of_10_to_the_12_is_a_clear_error_not_a_hang(hybrid):
    with pytest.raises(PlanError) as error:
        planner.plan(hybrid, Cluster.preset("emulated-4"), Config(global_batch_size=10**12))
    message = str(error.value)
    assert "does not fit: a micro-batch of 1000000000000 samples" in message
    assert f"more than the {MAX_MICRO_BATCHES} the planner schedules per step" in message
    assert "global_batch_size <=" in message


def test_global_batch_of_10_to_the_12_fits_devices_with_room_for_it(hybrid):
    plan = planner.plan(hybrid, cluster_of(4, 1048576.0), Config(global_batch_size=10**12))
    assert plan.global_batch_size == 10**12 and plan.num_micro_batch <= MAX_MICRO_BATCHES
    heads = [w for w in plan.stage_workers(0)]
    assert sum(w.batch_share for w in heads) == 10**12


def test_too_many_micro_batches_is_a_clear_error(hybrid):
    with pytest.raises(PlanError, match=f"num_micro_batch {2 * MAX_MICRO_BATCHES} exceeds the {MAX_MICRO_BATCHES}"):
        planner.plan(hybrid, Cluster.preset("emulated-4"),
                     Config(global_batch_size=4 * MAX_MICRO_BATCHES, num_micro_batch=2 * MAX_MICRO_BATCHES))


def test_indivisible_micro_batches_of_a_huge_batch_suggest_divisors(hybrid):
    with pytest.raises(PlanError, match=r"num_micro_batch 3 does not divide global_batch_size 1000000000000: .* "
                                        r"use num_micro_batch in \[1, 2, 4\]"):
        planner.plan(hybrid, Cluster.preset("emulated-4"), Config(global_batch_size=10**12, num_micro_batch=3))


def test_gradient_accumulation_beyond_the_limit_is_a_clear_error():
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    graphs = wl.capture(model, (torch.randn(4, 256),))
    with pytest.raises(PlanError, match=f"would accumulate gradients over [0-9]+ micro-batches, more than the "
                                        f"{MAX_MICRO_BATCHES} the planner schedules per step"):
        planner.plan(graphs, Cluster.preset("emulated-4"), Config(global_batch_size=10**12))
    plan = planner.plan(graphs, Cluster.preset("emulated-4"), Config(global_batch_size=10**9))
    assert sum(w.batch_share for w in plan.workers) == 10**9 and plan.num_micro_batch > 1


def test_cli_global_batch_of_10_to_the_12_is_one_line_and_writes_nothing(capsys, tmp_path):
    target = tmp_path / "plan.yaml"
    code = main(["plan", str(ROOT / "examples/hybrid_classifier.py") + ":build", "--cluster", "emulated-4",
                 "--global-batch", str(10**12), "-o", str(target)])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.endswith(" ...")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("whalelike: error: "), err
    assert f"more than the {MAX_MICRO_BATCHES} the planner schedules per step" in lines[0]
    assert os.listdir(tmp_path) == []


def test_shares_of_huge_totals_are_exact():
    for total in (10, 10**12, 10**30, 10**60):
        shares = proportional_shares(total, [1.0, 2.0, 3.5])
        assert sum(shares) == total and shares[0] <= shares[1] <= shares[2]


def _one_sample_at_a_time(shares, slots, memory_util):
    """Whale's Algorithm 1 moving one sample per step: the oracle for the bulk version."""
    shares, peaks = list(shares), {i for i, s in enumerate(slots) if shares[i] > s.cap}
    valleys = [((shares[i] + 1) / s.speed, memory_util(i, shares[i] + 1), i)
               for i, s in enumerate(slots) if shares[i] < s.cap]
    heapq.heapify(valleys)
    while peaks and valleys:
        peak = max(peaks, key=lambda i: (memory_util(i, shares[i]), -i))
        _, _, valley = heapq.heappop(valleys)
        shares[peak] -= 1
        shares[valley] += 1
        if shares[peak] <= slots[peak].cap:
            peaks.discard(peak)
        if shares[valley] < slots[valley].cap:
            n = shares[valley]
            heapq.heappush(valleys, ((n + 1) / slots[valley].speed, memory_util(valley, n + 1), valley))
    if peaks:
        return ("does not fit", sum(shares[i] - slots[i].cap for i in peaks), sum(s.cap for s in slots))
    return shares


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0.5, 1.0, 1.7, 2.0, 3.0]), st.integers(0, 60), st.integers(0, 90)),
                min_size=1, max_size=6))
def test_bulk_memory_balancing_equals_one_sample_at_a_time(devices):
    slots = [Slot(speed, cap) for speed, cap, _ in devices]
    shares = [share for _, _, share in devices]

    def util(i, n):
        return n / max(slots[i].cap, 1)

    try:
        bulk = balance_memory(shares, slots, util)
    except DoesNotFit as e:
        bulk = ("does not fit", e.shortfall, e.capacity)
    assert bulk == _one_sample_at_a_time(shares, slots, util)


def test_memory_balancing_moves_10_to_the_14_samples_in_bulk():
    slots = [Slot(1.0, 5), Slot(2.0, 10**15), Slot(3.0, 10**13)]
    assert balanced_shares(10**14, slots, lambda i, n: n / slots[i].cap) == [5, 89999999999995, 10**13]


# -- 2. an empty example batch, a parameterless model ----------------------------------------------
def test_empty_example_batch_is_a_capture_error():
    with pytest.raises(CaptureError, match=r"the example batch is empty \(an input of shape \(0, 16\)\).*"
                                           r"at least one"):
        wl.capture(TwoLinears(), (torch.randn(0, 16),))


class Parameterless(nn.Module):
    def forward(self, x):
        with wl.replicate():
            x = torch.relu(x)
        with wl.replicate():
            return x * 2


def test_parameterless_model_is_a_planning_error():
    graphs = wl.capture(Parameterless(), (torch.randn(4, 16),))
    for make in (planner.plan, planner.naive_plan):
        with pytest.raises(PlanError, match=r"the model has no parameters \(2 TaskGraph\(s\).*nothing to train"):
            make(graphs, Cluster.preset("emulated-4"), Config(global_batch_size=16, num_micro_batch=2))


# -- 3. huge memory, many devices ------------------------------------------------------------------
def test_huge_memory_does_not_overflow_the_planner():
    graphs = wl.capture(TwoLinears(), (torch.randn(4, 16),))
    plan = planner.plan(graphs, cluster_of(4, 1048576.0), Config(global_batch_size=1024))
    assert sum(w.batch_share for w in plan.stage_workers(0)) == 1024
    cost = StageCost(1.0, 2.0, 4.0, 12.0, 1.0, 0.0, ())
    assert stage_memory(cost, 1).max_samples(float("inf")) == UNBOUNDED_SAMPLES
    assert stage_memory(cost, 1).max_samples(1e300 * 2**30) == UNBOUNDED_SAMPLES
    assert split_dimension(64, [1.0, 3.0], [float("inf"), 1e300]) == [16, 48]


def test_automatic_split_wider_than_its_layer_names_the_width_to_use():
    graphs = wl.capture(TwoLinears(out=8), (torch.randn(4, 16),))
    with pytest.raises(PlanError) as error:
        planner.plan(graphs, cluster_of(64, 16.0), Config(global_batch_size=1024))
    message = str(error.value)
    assert re.search(r"TaskGraph 1 \(split\(auto\)\), stage 1: the automatic width gives it [0-9]+ of the "
                     r"cluster's devices", message)
    assert "lone group of 8 units: b (column) can be cut over at most 8 devices" in message
    assert "use split(8) or narrower" in message


def test_many_devices_plan_when_the_layer_is_wide_enough():
    graphs = wl.capture(TwoLinears(out=512), (torch.randn(4, 16),))
    plan = planner.plan(graphs, cluster_of(512, 16.0), Config(global_batch_size=4096))
    assert plan.world_size == 512
    assert all(sum(sizes) == 512 for stage in plan.stages for sizes in stage.shard_sizes.values())


# -- 4. split around a module it cannot shard ------------------------------------------------------
class SplitConv(nn.Module):
    def __init__(self, width=None):
        super().__init__()
        self.a, self.conv = nn.Linear(16, 16), nn.Conv1d(1, 4, 3, padding=1)
        self.width = width

    def forward(self, x):
        with wl.replicate():
            x = self.a(x)
        with wl.split(self.width):
            return self.conv(x.unsqueeze(1)).flatten(1)


@pytest.mark.parametrize("width", [1, 2])
def test_split_around_an_unshardable_module_is_an_error_at_any_width(width):
    graphs = wl.capture(SplitConv(width), (torch.randn(4, 16),))
    with pytest.raises(PlanError) as error:
        planner.plan(graphs, Cluster.preset("emulated-4"), Config(global_batch_size=16, num_micro_batch=2))
    message = str(error.value)
    assert f"split({width}) over conv: nothing in this region can be sharded" in message
    assert "none of these modules is a projection split can cut" in message
    assert "Use replicate for this region, or put split around (or annotate with split) a shardable module" in message


# -- 5. annotate twice -----------------------------------------------------------------------------
def test_annotating_a_module_twice_names_both_strategies():
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    wl.annotate(model, {"0": wl.replicate(2), "1": wl.split(2)})
    with pytest.raises(AnnotationError, match=r"module '1' is already annotated with split\(2\) \(pattern '1' of an "
                                              r"earlier annotate call\); this call would silently replace it with "
                                              r"replicate\(2\)"):
        wl.annotate(model, {"1": wl.replicate(2)})
    with pytest.raises(AnnotationError, match=r"module '1.0' is already annotated with split\(2\).*split\(4\) "
                                              r"\(pattern '1.0'\).*replace=True"):
        wl.annotate(model, {"1.0": wl.split(4)})
    assert model[1][0]._wl_scope.device_count == 2   # the failed calls tagged nothing


def test_annotate_replace_is_the_explicit_override():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    wl.annotate(model, {"0": wl.replicate(2), "1": wl.split(2)})
    wl.annotate(model, {"1": wl.replicate(4)}, replace=True)
    assert str(model[1]._wl_scope) == "replicate(4)"
    graphs = wl.capture(model, (torch.randn(2, 4),))
    assert [str(tg.strategy) for tg in graphs] == ["replicate(2)", "replicate(4)"]


# -- 6. PuLP's deprecated PULP_CBC_CMD -------------------------------------------------------------
def test_ilp_partitioner_raises_no_deprecation_warning():
    from planner.partition.solve import LayerCost, StageLink

    layers = [LayerCost(f"l{i}", 1e9 * (1 + i % 3), 2e9, 1e8, 3e8, 1e6, 1e5) for i in range(8)]
    slots = [StageSlot.data_parallel("fast", [100e12], [16 * 2**30]),
             StageSlot.data_parallel("slow", [25e12], [32 * 2**30])]
    problem = PartitionProblem.for_schedule(layers, slots, [StageLink(10e9, 5e-6)], micro_batch=4, num_micro_batch=4,
                                            schedule="1f1b", order="search")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        result = partition(problem, solver="ilp")
    assert result.solver == "ilp" and result.gap == 0.0
    assert os.access(cbc_path(), os.X_OK)


def test_ilp_without_any_cbc_binary_is_a_clear_error(monkeypatch):
    import pulp

    monkeypatch.setitem(sys.modules, "cbcbox", None)   # `import cbcbox` raises ImportError
    monkeypatch.setattr("planner.partition.ilp.shutil.which", lambda name: None)
    monkeypatch.setattr(pulp.apis.coin_api, "pulp_cbc_path", "/nonexistent/cbc", raising=False)
    with pytest.raises(PlanError, match=r"the ILP partitioner needs the CBC solver .*`pip install 'pulp\[cbc\]'` "
                                        r"\(its cbc extra installs the solver\)"):
        cbc_path()
