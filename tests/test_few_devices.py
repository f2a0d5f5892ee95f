"""Fewer devices than the regions ask (issue 35, item 1): an annotated model plans and trains on one
device, and on any cluster smaller than its regions' counts, unchanged.

Everyone's first run is on one device; a model annotated for a cluster must run there as written.
The planner (:func:`planner.devices.placement.shared_device_groups`) makes the regions' counts
automatic and folds adjacent regions into one stage when there are fewer devices than regions (a
``split`` region on one device is its module unsplit); ``Plan.shared_devices`` and the summary say
so. Checked here: the groupings (the balanced cut against every cut), every example and a
``transformers`` model (``examples/hf_llama.py``) planned onto one device as one stage of all their
regions and trained by the Engine on one rank exactly like the plain loop (float64, AdamW, the
same losses and parameters), the Llama on two devices as a pipeline whose ``split`` region is
planned unsplit on one of them, fixed counts larger than the cluster, and the plan file's checks.
"""
from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import planner
import whalelike as wl
from dist_utils import run_ranks
from planner import Plan, PlanError
from planner.devices.placement import balanced_runs, shared_device_groups
from planner.devices.placement_search import best_aware_plan
from reference import OPTIMIZERS, assert_engine_trains_like_reference, warm_capture
from synthetic import synthetic_model
from whalelike.cluster import Cluster
from whalelike.workload import load_workload

EXAMPLES = ("examples/hybrid_classifier.py:build", "examples/gpt.py:build", "examples/third_party.py:build",
            "examples/hf_gpt2.py:build", "examples/hf_llama.py:build", "examples/wide_mlp.py:build")
LLAMA = "examples/hf_llama.py:build"
BATCH, STEPS = 8, 3


def _cluster(devices: int) -> Cluster:
    """``devices`` equal devices on one host, no emulation: only real work."""
    return Cluster.from_dict({"name": f"{devices}-device", "network": {"intra_host_gbps": 100, "inter_host_gbps": 10,
                                                                      "latency_us": 5},
                              "hosts": [{"name": "localhost", "devices": [{"kind": "gpu", "count": devices,
                                                                          "peak_tflops": 10, "memory_gib": 16}]}]})


def _workload(spec: str):
    """The example in float64 (AdamW's normalised updates stay far above float64's summation noise)."""
    torch.manual_seed(0)
    workload = load_workload(spec)
    workload.model.double()
    return workload


def _batches(workload) -> list:
    g = torch.Generator().manual_seed(1)
    return [(tuple(x.double() if x.is_floating_point() else x for x in inputs), targets)
            for inputs, targets in (workload.make_batch(BATCH, g) for _ in range(STEPS))]


def _warm() -> None:
    """Each example's float64 capture on its first batch, once before the ranks fork."""
    for spec in EXAMPLES:
        workload = _workload(spec)
        warm_capture(workload.model, _batches(workload)[0][0])


def _one_device(rank: int, world_size: int) -> dict:
    """Every example planned on one device from its own capture (a cache hit), then trained by the
    Engine like the plain loop; the plans come back for the checks."""
    out = {}
    for spec in EXAMPLES:
        workload = _workload(spec)
        batches = _batches(workload)
        graphs = wl.capture(workload.model, batches[0][0])
        plan = planner.plan(graphs, _cluster(1), wl.Config(global_batch_size=BATCH))
        assert_engine_trains_like_reference(workload.model, plan, batches, OPTIMIZERS["adamw"], workload.loss_fn,
                                            _cluster(1), f"{spec} on one device")
        out[spec] = (plan.to_dict(), len(graphs.graphs), plan.summary())
        if spec == LLAMA:   # and on two devices, what its two regions ask
            out["llama on two devices"] = planner.plan(graphs, _cluster(2), wl.Config(global_batch_size=BATCH,
                                                                                      num_micro_batch=2)).to_dict()
    return out


def test_every_example_trains_on_one_device_like_the_plain_loop():
    (plans,) = run_ranks(_one_device, 1, init_process_group=True, timeout_s=300, warm=_warm)
    # hf_llama's two regions (replicate, split) on two devices, what they ask: a two-stage pipeline whose
    # split stage is one device, its modules whole (one shard of each, tp 1)
    two = Plan.from_dict(plans.pop("llama on two devices"))
    assert [st.taskgraphs for st in two.stages] == [[0], [1]] and not two.shared_devices, two.summary()
    assert [w.tp_size for w in two.workers] == [1, 1] and two.stages[1].strategy == "replicate(1)"
    assert all(len(sizes) == 1 for sizes in two.stages[1].shard_sizes.values()) and two.kind == "pipeline"
    for spec, (data, regions, summary) in plans.items():
        plan = Plan.from_dict(data)
        assert plan.world_size == 1 and len(plan.stages) == 1, summary
        if regions > 1:
            assert plan.stages[0].folded == list(range(regions)), summary
            assert plan.shared_devices.startswith(f"the regions ask {regions} device(s)"), summary
            assert f"and the cluster has 1: their counts are automatic; folded into one stage: TaskGraphs " \
                   f"{'+'.join(map(str, range(regions)))}" in plan.shared_devices
            assert "regions share devices: the regions ask" in summary
        else:   # one region of an automatic count: one device is what it asks
            assert not plan.shared_devices and not plan.stages[0].folded, summary


def test_fixed_counts_larger_than_the_cluster_become_automatic():
    graphs = synthetic_model(6, [wl.replicate(4), wl.split(4)], hidden=256, seq=32, heads=4)
    assert graphs.devices_asked == 8
    assert shared_device_groups(graphs, 3) == [[[0], [1]], [[0, 1]]]   # one stage per region first, then folded
    plan = planner.plan(graphs, _cluster(3), wl.Config(global_batch_size=12))
    assert plan.world_size == 3, plan.summary()
    assert plan.shared_devices.startswith("the regions ask 8 device(s) (TaskGraph 0: replicate(4), TaskGraph 1: "
                                          "split(4)) and the cluster has 3: their counts are automatic")
    # each grouping was planned; the one kept is predicted no slower than the other
    for grouping in shared_device_groups(graphs, 3):
        prediction, _ = best_aware_plan(graphs, _cluster(3), wl.Config(global_batch_size=12), shared=grouping)
        assert plan.prediction.step_time_ms <= prediction.step_time_ms * (1 + 1e-9)
    # the same model on the eight devices it asks: nothing shared, the counts kept
    asked = planner.plan(graphs, _cluster(8), wl.Config(global_batch_size=12))
    assert not asked.shared_devices and [st.strategy for st in asked.stages] == ["replicate(4)", "split(4)"]


def test_which_regions_share_a_stage():
    four = synthetic_model(8, [wl.replicate(), wl.replicate(), wl.split(), wl.replicate()], hidden=256, seq=32,
                           heads=4)
    assert shared_device_groups(four, 4) == []                       # one device per automatic region: enough
    assert shared_device_groups(four, 1) == [[[0, 1, 2, 3]]]
    groupings = shared_device_groups(four, 3)
    assert [len(g) for g in groupings] == [3, 2, 1]
    assert all([t for run in g for t in run] == [0, 1, 2, 3] for g in groupings)
    # counts too large for the devices but as many devices as regions: one stage per region first
    fixed = synthetic_model(6, [wl.replicate(2), wl.replicate(2), wl.split(2)], hidden=256, seq=32, heads=4)
    assert shared_device_groups(fixed, 3)[0] == [[0], [1], [2]]
    plan = planner.plan(four, _cluster(2), wl.Config(global_batch_size=8))
    assert plan.world_size == 2 and "folded into one stage" in plan.shared_devices, plan.summary()


@settings(max_examples=60, deadline=None)
@given(work=st.lists(st.floats(0.1, 100.0), min_size=1, max_size=7), data=st.data())
def test_the_balanced_cut_is_the_best_cut(work, data):
    count = data.draw(st.integers(1, len(work)))
    runs = balanced_runs(work, count)
    assert len(runs) == count and [i for r in runs for i in r] == list(range(len(work))) and all(runs)
    best = min(max(sum(work[a:b]) for a, b in zip((0, *cuts), (*cuts, len(work))))
               for cuts in itertools.combinations(range(1, len(work)), count - 1))
    assert max(sum(work[i] for i in r) for r in runs) == pytest.approx(best, rel=1e-9)


def test_a_shared_plan_file_is_checked():
    graphs = synthetic_model(6, [wl.replicate(), wl.replicate(), wl.split()], hidden=256, seq=32, heads=4)
    plan = planner.plan(graphs, _cluster(1), wl.Config(global_batch_size=8))
    assert plan.stages[0].folded == [0, 1, 2]
    again = Plan.from_dict(plan.to_dict())
    assert again.shared_devices == plan.shared_devices
    again.validate(graphs=graphs, cluster=_cluster(1))
    # the note on a plan whose cluster has what the regions ask: a fold of two replicate regions, two devices
    two = synthetic_model(4, [wl.replicate(), wl.replicate()], hidden=256, seq=32, heads=4)
    prediction, folded = best_aware_plan(two, _cluster(2), wl.Config(global_batch_size=8), fold=[[0, 1]])
    folded = dataclasses.replace(folded, prediction=prediction)
    folded.validate(graphs=two, cluster=_cluster(2))
    with pytest.raises(PlanError, match=r"plan.shared_devices says the regions share devices, but they ask 2 and the "
                                        r"plan has 2 workers"):
        dataclasses.replace(folded, shared_devices="made up").validate(graphs=two, cluster=_cluster(2))
    # the one-device fold without the note: the plan's candidates say it folds nothing
    with pytest.raises(PlanError, match=r"plan.chosen is 'aware' but stage\(s\) \[0\] are folded"):
        dataclasses.replace(plan, shared_devices="").validate(graphs=graphs, cluster=_cluster(1))
