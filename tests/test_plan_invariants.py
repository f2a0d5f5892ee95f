"""The plan's derived invariants have one owner each, and every reader agrees with it.

* Group keys (:mod:`planner.groups`): each kind's groups are the workers with equal coordinates,
  in the documented member order; the runtime's process groups, the sample layout and DDP's bucket
  keys are exactly those groups.
* The tensor-parallel predicate (``Plan.tensor_parallel``, ``Plan.tensor_parallel_stages``).
* P-Reduce's rules (:mod:`planner.partial_reduce`): which stages can run it and when the static
  generator is pinned; the runtime's sync policy switches a plan by them, and what it makes passes
  the plan checks.
"""
from __future__ import annotations

import itertools
import re
import sys
from pathlib import Path

import pytest

from planner.groups import KINDS, group_key, group_ranks, groups_of, member_order
from planner.partial_reduce import WHY, blocker, eligible_stages, generator, static_only
from planner.plan import PlanError, StagePlan
from planner.shares.layout import SampleLayout
from runtime.balance.sync_policy import SyncPolicy
from runtime.groups import group_ranks as runtime_group_ranks

sys.path.insert(0, str(Path(__file__).parent))
from plans import make_plan, worker  # noqa: E402

# (replica, stage, dp_index, tp_index) of 2 replicas x 2 stages x 2 data-parallel slots x split(2),
# ranks handed out stage-major so that rank order is not the plan order of any kind
COORDS = sorted(itertools.product(range(2), range(2), range(2), range(2)), key=lambda c: (c[1], c[3], c[0], c[2]))


def _hybrid_plan():
    workers = [worker(rank, stage, dp, tp, 2, replica=replica, sizes=[2, 2])
               for rank, (replica, stage, dp, tp) in enumerate(COORDS)]
    stages = [StagePlan(s, [s], [s], "replicate(2)+split(2)") for s in range(2)]
    return make_plan(stages, workers, global_batch_size=16)


def _expected(plan, kind):
    """The groups of ``kind`` written out from the module docstring's table, independently."""
    same = {"dp": ("stage", "tp_index"), "tp": ("replica", "stage", "dp_index"), "stage": ("replica", "stage"),
            "replica": ("replica",)}[kind]
    order = {"dp": ("replica", "dp_index"), "tp": ("tp_index",), "stage": ("dp_index", "tp_index"),
             "replica": ("stage", "dp_index", "tp_index")}[kind]
    out = {}
    for key in sorted({tuple(getattr(w, f) for f in same) for w in plan.workers}):
        members = [w for w in plan.workers if tuple(getattr(w, f) for f in same) == key]
        out[key] = tuple(w.rank for w in sorted(members, key=lambda w: tuple(getattr(w, f) for f in order)))
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_groups_equal_coordinates_in_the_documented_order(kind):
    plan = _hybrid_plan()
    assert group_ranks(plan, kind) == _expected(plan, kind)
    assert runtime_group_ranks(plan, kind) == group_ranks(plan, kind)   # the runtime's process groups
    members = [r for ranks in group_ranks(plan, kind).values() for r in ranks]
    assert sorted(members) == list(range(plan.world_size))   # every worker in exactly one group
    for key, ws in groups_of(plan.workers, kind).items():
        assert all(group_key(kind, w) == key for w in ws)
        assert [member_order(kind, w) for w in ws] == sorted(member_order(kind, w) for w in ws)


def test_the_sample_layout_and_the_buckets_read_the_same_groups():
    plan = _hybrid_plan()
    assert SampleLayout.of(plan).dp_groups == tuple(group_ranks(plan, "dp").values())
    with pytest.raises(ValueError, match=r"group kind must be one of dp, tp, stage, replica, got 'pp'"):
        group_ranks(plan, "pp")


def test_the_tensor_parallel_predicate():
    plan = _hybrid_plan()
    assert plan.tensor_parallel and plan.tensor_parallel_stages == {0, 1} and plan.kind == "tensor_parallel"
    plain = make_plan(2, [worker(r, r // 2, r % 2, sizes=[2]) for r in range(4)])
    assert not plain.tensor_parallel and plain.tensor_parallel_stages == frozenset() and plain.kind == "pipeline"


def test_which_stages_can_run_p_reduce():
    assert blocker(4, 1) is None and blocker(4, 1, zero_stage=0) is None
    assert (blocker(4, 2), blocker(1, 1), blocker(4, 1, zero_stage=2)) == ("split", "one worker", "zero")
    assert blocker(1, 2) == "split" and set(WHY) == {"split", "one worker", "zero"}
    stages = [StagePlan(0, [0], [0], "replicate(2)"), StagePlan(1, [1], [1], "replicate(2)+split(2)"),
              StagePlan(2, [2], [2], "replicate(2)", zero_stage=1, replica_sync="fsdp", zero_reason="asked"),
              StagePlan(3, [3], [3], "replicate(1)")]
    workers = [worker(0, 0, 0, sizes=[2]), worker(1, 0, 1, sizes=[2]),
               worker(2, 1, 0, 0, 2, sizes=[4]), worker(3, 1, 0, 1, 2, sizes=[4]),
               worker(4, 2, 0, sizes=[2]), worker(5, 2, 1, sizes=[2]), worker(6, 3, 0, sizes=[4])]
    assert eligible_stages(make_plan(stages, workers)) == [0]


def test_the_static_generator_is_pinned_in_a_pipeline_and_at_fp16():
    assert static_only(1, "fp32") is None and static_only(1, "bf16") is None
    assert static_only(2, "fp32").startswith("in a pipeline of 2 stages")
    assert static_only(1, "fp16").startswith("in an fp16 plan")
    assert generator("smart", 1, "bf16") == "smart" and generator("smart", 3, "fp32") == "static"
    assert generator("smart", 1, "fp16") == "static" and generator("static", 1, "fp32") == "static"


@pytest.mark.parametrize("num_stages, precision, want", [(1, "fp32", "smart"), (1, "fp16", "static"),
                                                         (2, "fp32", "static")])
def test_the_sync_policy_switches_by_the_planners_rules(num_stages, precision, want):
    """What the policy makes of an exact plan runs P-Reduce where the planner allows it, with the
    generator it pins, and passes the plan checks; the same plan with the smart generator forced
    where it is pinned is refused, naming why."""
    workers = [worker(r, r // 2, r % 2, sizes=[2] * 2) for r in range(2 * num_stages)]
    plan = make_plan(num_stages, workers, precision=precision)
    plan.validate()
    switched = SyncPolicy(generator="smart")._partial_plan(plan)
    assert [st.replica_sync for st in switched.stages] == ["partial"] * num_stages
    assert [st.partial_generator for st in switched.stages] == [want] * num_stages
    switched.validate()
    if want == "static":
        forced = make_plan([StagePlan(st.index, st.taskgraphs, st.layers, st.strategy, replica_sync="partial",
                                      partial_generator="smart") for st in switched.stages],
                           workers, precision=precision)
        with pytest.raises(PlanError, match="partial_generator is 'smart' " + re.escape(static_only(num_stages, precision))):
            forced.validate()
