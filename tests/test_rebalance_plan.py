"""Re-planning from measured speeds (planner.balance.replan): shares, layer moves and shard sizes follow
the speeds, the device mapping never changes, bad input is a clear error, memory limits keep the
plan in force's values. Single process, pure."""
import dataclasses
import math

import pytest

import planner
import planner.balance.replan as rebalance_module
from planner import PlanError
from planner.devices.cost_model import GIB, StageCost
from planner.shares.batch_shares import proportional_shares
from planner.balance.replan import (
    MAPPING, LayerMove, PlanChanges, measured_cluster, plan_changes, plan_layout, rebalance, replan,
)
from whalelike import Config, replicate, split
from whalelike.strategy import Strategy
from whalelike.sharding.groups import ShardGroup, ShardMember
from whalelike.graphs.taskgraph import TaskGraphs

from synthetic import bert_large, synthetic_cluster, synthetic_model


def assert_same_mapping(old, new):
    assert [[getattr(w, f) for f in MAPPING] for w in old.workers] == \
        [[getattr(w, f) for f in MAPPING] for w in new.workers]
    new.validate()


def dp_case():
    graphs = synthetic_model(4, [replicate()], hidden=256, seq=32)
    cluster = synthetic_cluster([(4, 10.0, 16)])
    return graphs, cluster, planner.plan(graphs, cluster, Config(64, 2))


def pp_case():
    graphs = synthetic_model(8, [replicate(), replicate()], hidden=256, seq=32)
    cluster = synthetic_cluster([(2, 10.0, 16)])
    return graphs, cluster, planner.plan(graphs, cluster, Config(16, 4))


def heads_case():
    """One split(2) TaskGraph whose layers shard attention by heads (4 heads of 64) as one group of
    q, k, v (column) and o (row) each."""
    base = synthetic_model(2, [split(2)], hidden=256, seq=32, shard_split_graphs=False)
    tg = base.graphs[0]
    groups, shardable = [], {}
    for layer in base.layers:
        members = tuple(ShardMember(f"{layer.name}.attn.{p}", "row" if p == "o" else "column", 64) for p in "qkvo")
        attention_flops = 0.5 * (layer.forward_flops + layer.backward_flops)   # the rest runs whole on each rank
        groups.append(ShardGroup(4, members, "attention", attention_flops))
        shardable.update({m.path: 256 for m in members})
    graphs = TaskGraphs([dataclasses.replace(tg, shardable=shardable, shard_groups=tuple(groups))], base.layers,
                        base.boundaries, base.optimizer, base.example_batch_size, base.method)
    cluster = synthetic_cluster([(2, 10.0, 16)])
    return graphs, cluster, planner.plan(graphs, cluster, Config(8, 1))


# -- data parallel ---------------------------------------------------------------------------------
def test_slow_rank_gives_its_share_to_the_others_proportionally():
    graphs, cluster, plan = dp_case()
    assert [w.micro_batch_sizes for w in plan.workers] == [[8, 8]] * 4
    speeds = [2e9, 0.5e9, 2e9, 2e9]   # rank 1 four times slower
    result = replan(plan, graphs, cluster, speeds)
    new = result.plan
    assert_same_mapping(plan, new)
    expected = proportional_shares(32, speeds, minimum=1)
    assert [w.micro_batch_sizes for w in new.workers] == [[n, n] for n in expected]
    assert new.workers[1].batch_share < plan.workers[1].batch_share
    assert len({new.workers[r].batch_share for r in (0, 2, 3)}) == 1
    assert new.global_batch_size == plan.global_batch_size and new.num_micro_batch == plan.num_micro_batch
    assert result.kept == ()
    # the prediction is at the measured speeds: better than leaving the plan in force
    assert new.prediction.step_time_ms < result.in_force.step_time_ms
    changes = plan_changes(plan, new)
    assert changes.kinds == {"shares"} and not changes.empty
    assert [c.rank for c in changes.shares] == [0, 1, 2, 3]
    assert changes.shares[1].old == (8, 8) and changes.shares[1].new == (expected[1],) * 2
    lines = changes.describe().splitlines()
    assert len(lines) == 4 and lines[1].startswith(f"rank 1: batch share 16 -> {2 * expected[1]}")


def test_equal_speeds_reproduce_the_plan_at_any_scale():
    for graphs, cluster, plan in (dp_case(), pp_case(), heads_case()):
        for scale in (1.0, 3e12):
            again = rebalance(plan, graphs, cluster, [scale] * plan.world_size)
            assert again == plan
            changes = plan_changes(plan, again)
            assert changes.empty and changes.kinds == set() and changes.describe() == "no changes"


def test_speeds_in_the_spec_ratio_keep_the_shares_of_a_heterogeneous_plan():
    graphs = synthetic_model(4, [replicate()], hidden=256, seq=32)
    cluster = synthetic_cluster([(2, 30.0, 16), (2, 10.0, 16)])
    plan = planner.plan(graphs, cluster, Config(64, 1))
    new = rebalance(plan, graphs, cluster, [3.0, 3.0, 1.0, 1.0])
    assert [w.micro_batch_sizes for w in new.workers] == [w.micro_batch_sizes for w in plan.workers]
    # sum of measured TFLOPS == sum of the spec's: compute keeps its scale against the network
    measured = measured_cluster(plan, cluster, [3.0, 3.0, 1.0, 1.0])
    assert math.isclose(sum(d.measured_tflops for d in measured.devices),
                        sum(d.peak_tflops * 0.4 for d in cluster.devices))
    assert math.isclose(new.prediction.step_time_ms, plan.prediction.step_time_ms, rel_tol=1e-9)
    # the same speeds on another scale give the same plan, bit for bit
    assert rebalance(plan, graphs, cluster, [3e12, 3e12, 1e12, 1e12]) == new


def test_shares_stay_within_memory():
    """Rank 0 would take 13 of 16 samples at 4x the speed of rank 1 but holds only 10: Whale's
    Algorithm 1 gives the rest to rank 1."""
    graphs = synthetic_model(4, [replicate()], hidden=256, seq=32)
    cost = StageCost.of_layers(graphs, range(4))
    memory = (cost.static_bytes + 10.5 * cost.bytes_per_sample(1)) / GIB
    cluster = synthetic_cluster([(2, 10.0, memory)])
    plan = planner.plan(graphs, cluster, Config(16, 1, memory_reserve=0.0))   # the memory is the edge itself
    assert [w.micro_batch_sizes for w in plan.workers] == [[8], [8]]
    new = rebalance(plan, graphs, cluster, [4.0, 1.0])
    assert [w.micro_batch_sizes for w in new.workers] == [[10], [6]]
    assert all(w.memory_gib <= w.capacity_gib for w in new.workers)


def test_accumulating_plan_accumulates_again_at_the_measured_speeds():
    """A single stage under Poplar's accumulation (own micro-batch sizes per device): the re-plan
    accumulates again, samples move off the slowed rank, and each device keeps micro-batches as
    large as its memory allows (not the old plan's longest list cut into equal micro-batches, which
    gave a slowed device micro-batches of one sample). The result equals planning from scratch at
    the measured speeds (the mapping of a single stage is the same either way)."""
    graphs = bert_large([replicate()])
    cluster = synthetic_cluster([(2, 15.7, 32), (2, 9.3, 16)])
    plan = planner.plan(graphs, cluster, Config(global_batch_size=1000, num_micro_batch=1, memory_reserve=0.0))
    assert plan.num_micro_batch > 1 and len({len(w.micro_batch_sizes) for w in plan.workers}) > 1
    speeds = [15.7, 15.7 / 4, 9.3, 9.3]
    new = rebalance(plan, graphs, cluster, speeds)
    assert_same_mapping(plan, new)
    assert sum(w.batch_share for w in new.workers) == 1000
    assert new.workers[1].batch_share < new.workers[2].batch_share < new.workers[0].batch_share
    assert all(w.memory_gib <= w.capacity_gib for w in new.workers)
    caps = {w.rank: max(w.micro_batch_sizes) for w in plan.workers}
    for w in new.workers:   # as few micro-batches as memory allows
        assert len(w.micro_batch_sizes) == -(-w.batch_share // caps[w.rank]), (w.rank, w.micro_batch_sizes)
    scratch = planner.plan(graphs, measured_cluster(plan, cluster, speeds),
                           Config(global_batch_size=1000, memory_reserve=0.0))
    assert [w.micro_batch_sizes for w in new.workers] == [w.micro_batch_sizes for w in scratch.workers]
    (line,) = [l for l in plan_changes(plan, new).describe().splitlines() if l.startswith("rank 1:")]
    assert line.startswith("rank 1: batch share 314 -> ") and "(micro-batches [104, 104, 104, 2] -> [" in line


# -- pipeline --------------------------------------------------------------------------------------
def test_slow_stage_gives_layers_to_its_neighbour():
    graphs, cluster, plan = pp_case()
    assert [st.layers for st in plan.stages] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    new = rebalance(plan, graphs, cluster, [1.0, 0.5])   # stage 1's device twice as slow
    assert_same_mapping(plan, new)
    assert len(new.stages[0].layers) > 4 and new.stages[0].layers + new.stages[1].layers == list(range(8))
    changes = plan_changes(plan, new)
    assert changes.kinds == {"layers"}
    moved = [i for m in changes.layers for i in m.layers]
    assert changes.layers == (LayerMove(tuple(moved), 1, 0),) and moved == list(range(4, len(new.stages[0].layers)))
    assert changes.describe() == f"layers 4-{moved[-1]}: stage 1 -> stage 0"
    # and back when stage 0 slows instead
    back = rebalance(new, graphs, cluster, [0.5, 1.0])
    assert len(back.stages[0].layers) < 4
    assert {(m.src, m.dst) for m in plan_changes(new, back).layers} == {(0, 1)}


def test_move_layers_off_keeps_the_layers():
    graphs, cluster, plan = pp_case()
    new = rebalance(plan, graphs, cluster, [1.0, 0.5], move_layers=False)
    assert [st.layers for st in new.stages] == [st.layers for st in plan.stages]
    assert plan_changes(plan, new).empty
    assert new.prediction.step_time_ms > plan.prediction.step_time_ms   # priced at the measured speeds


def test_replicated_pipeline_shares_follow_the_slow_replica():
    graphs = synthetic_model(8, [replicate(2), replicate(2)], hidden=256, seq=32)
    cluster = synthetic_cluster([(8, 10.0, 16)], per_host=4)
    plan = planner.plan(graphs, cluster, Config(32, 2))
    assert plan.num_replicas == 2
    slow = next(w.rank for w in plan.workers if w.replica == 1 and w.stage == 0)
    speeds = [0.25 if r == slow else 1.0 for r in range(plan.world_size)]
    new = rebalance(plan, graphs, cluster, speeds, move_layers=False)
    assert_same_mapping(plan, new)
    assert new.workers[slow].batch_share < plan.workers[slow].batch_share
    replica_share = lambda p, r: sum(w.batch_share for w in p.workers if w.replica == r and w.stage == 1)  # noqa: E731
    assert replica_share(new, 1) < replica_share(plan, 1) and replica_share(new, 0) > replica_share(plan, 0)
    assert replica_share(new, 0) + replica_share(new, 1) == 32


# -- tensor parallel -------------------------------------------------------------------------------
def test_split_stage_shards_follow_speeds_in_whole_feature_granules():
    graphs = synthetic_model(4, [split(2)], hidden=256, seq=32)
    cluster = synthetic_cluster([(2, 10.0, 16)])
    plan = planner.plan(graphs, cluster, Config(16, 1))
    assert set(map(tuple, plan.stages[0].shard_sizes.values())) == {(512, 512)}
    new = rebalance(plan, graphs, cluster, [3.0, 1.0])
    assert_same_mapping(plan, new)
    assert set(map(tuple, new.stages[0].shard_sizes.values())) == {(768, 256)}
    changes = plan_changes(plan, new)
    assert changes.kinds == {"shards"} and len(changes.shards) == 4
    assert changes.shards[0].describe() == "stage 0 layers.0.mlp.fc1: shards [512, 512] -> [768, 256]"


def test_split_stage_shards_move_whole_heads():
    graphs, cluster, plan = heads_case()
    assert plan.stages[0].shard_sizes["layers.0.attn.q"] == [128, 128]
    new = rebalance(plan, graphs, cluster, [3.0, 1.0])
    assert_same_mapping(plan, new)
    assert {tuple(v) for v in new.stages[0].shard_sizes.values()} == {(192, 64)}   # 3 heads and 1 head of 64
    assert plan_changes(plan, new).kinds == {"shards"}
    kept = rebalance(plan, graphs, cluster, [3.0, 1.0], reshard=False)
    assert kept.stages[0].shard_sizes == plan.stages[0].shard_sizes
    assert plan_changes(plan, kept).empty
    assert kept.prediction.step_time_ms > new.prediction.step_time_ms


def test_hybrid_replicated_split_reshards_and_reshares():
    graphs = synthetic_model(4, [Strategy("replicate", 2, Strategy("split", 2))], hidden=256, seq=32)
    cluster = synthetic_cluster([(4, 10.0, 16)], per_host=4)
    plan = planner.plan(graphs, cluster, Config(16, 1))
    new = rebalance(plan, graphs, cluster, [1.0, 0.5, 1.0, 1.0])
    assert_same_mapping(plan, new)
    assert plan_changes(plan, new).kinds == {"shares", "shards"}
    slow_group = {w.dp_index for w in new.workers if w.rank == 1}
    shares = {w.dp_index: w.batch_share for w in new.workers}
    assert shares[slow_group.pop()] < 8


# -- memory fallback -------------------------------------------------------------------------------
def test_an_infeasible_partition_keeps_the_layers_in_force(monkeypatch):
    """Each stage's data-parallel pair loses one device to a 50x slowdown: the partitioner would put
    nearly the whole micro-batch on the other device, and no split of the layers fits that in
    memory. The layers stay, and the shares still move within memory (Whale's Algorithm 1). The plan
    in force is one whose layers are the TaskGraph boundaries at the micro-batches they need (the
    planner's search of the count with the cut points, issue 36, turned off to make it)."""
    import planner.api
    import planner.decisions

    graphs = synthetic_model(8, [replicate(2), replicate(2)], hidden=256, seq=32)
    cost = StageCost.of_layers(graphs, range(4))
    cluster = synthetic_cluster([(4, 10.0, (cost.static_bytes + 6 * cost.bytes_per_sample(2)) / GIB)])
    with monkeypatch.context() as patch:
        patch.setattr(planner.decisions, "_repartitioned", lambda *args, **kwargs: None)
        patch.setattr(planner.api, "fastest_count", lambda graphs, cluster, config, aware: aware)
        plan = planner.plan(graphs, cluster, Config(32, 2, memory_reserve=0.0))   # sized to the edge
    assert [w.stage for w in plan.workers] == [0, 0, 1, 1]
    result = replan(plan, graphs, cluster, [1.0, 0.02, 1.0, 0.02])
    assert result.kept == ("stage layers: the pipeline partition for the measured speeds does not fit in memory",)
    new = result.plan
    assert_same_mapping(plan, new)
    assert [st.layers for st in new.stages] == [st.layers for st in plan.stages]
    assert new.num_micro_batch == plan.num_micro_batch
    assert new.workers[0].batch_share > new.workers[1].batch_share
    assert all(w.memory_gib <= w.capacity_gib for w in new.workers)
    assert plan_changes(plan, new).kinds == {"shares"}


def test_parts_that_do_not_fit_keep_the_plan_in_force(monkeypatch):
    """When moved layers (or any new shares) do not fit, the plan in force's value stays and the
    result says so; aware_decisions is made to refuse them here."""
    graphs, cluster, plan = pp_case()
    real = rebalance_module.aware_decisions
    old_layers = [st.layers for st in plan.stages]

    def refuse_moved_layers(*args, stage_layers=None, **kw):
        if stage_layers != old_layers:
            raise PlanError("stage 0 does not fit (test)")
        return real(*args, stage_layers=stage_layers, **kw)

    monkeypatch.setattr(rebalance_module, "aware_decisions", refuse_moved_layers)
    result = replan(plan, graphs, cluster, [1.0, 0.5])
    assert [st.layers for st in result.plan.stages] == old_layers
    assert len(result.kept) == 1 and result.kept[0].startswith("stage layers") and "(test)" in result.kept[0]
    assert_same_mapping(plan, result.plan)

    def refuse_new_shares(*args, sizes=None, **kw):
        if sizes is None:
            raise PlanError("no new shares fit (test)")
        return real(*args, sizes=sizes, **kw)

    monkeypatch.setattr(rebalance_module, "aware_decisions", refuse_new_shares)
    graphs, cluster, plan = dp_case()
    result = replan(plan, graphs, cluster, [1.0, 0.25, 1.0, 1.0])
    assert [w.micro_batch_sizes for w in result.plan.workers] == [w.micro_batch_sizes for w in plan.workers]
    assert result.kept[-1].startswith("batch shares") and plan_changes(plan, result.plan).empty
    assert result.plan.prediction == result.in_force


# -- bad input -------------------------------------------------------------------------------------
@pytest.mark.parametrize("speeds, message", [
    ([1.0, 1.0, 1.0], r"speeds has 3 entries but the plan has 4 ranks"),
    ([1.0, 0.0, 1.0, 1.0], r"speeds\[1\] \(device 'd1'\) is 0\.0"),
    ([1.0, 1.0, -2.0, 1.0], r"speeds\[2\] .* is -2\.0; every speed must be a finite FLOP/s > 0"),
    ([1.0, 1.0, 1.0, float("nan")], r"speeds\[3\] .* is nan"),
    ([float("inf"), 1.0, 1.0, 1.0], r"speeds\[0\] .* is inf"),
    ([True, 1.0, 1.0, 1.0], r"speeds\[0\] .* is True"),
    ("fast", r"speeds must be a list of measured FLOP/s"),
])
def test_bad_speeds_are_named(speeds, message):
    graphs, cluster, plan = dp_case()
    with pytest.raises(PlanError, match=message):
        rebalance(plan, graphs, cluster, speeds)


def test_a_cluster_without_the_plans_devices_is_named():
    graphs, cluster, plan = dp_case()
    other = synthetic_cluster([(2, 10.0, 16)], name="small")
    with pytest.raises(PlanError, match=r"cluster 'small' has no device\(s\) \['d2', 'd3'\].*pass the cluster the plan"):
        rebalance(plan, graphs, other, [1.0] * 4)


def test_plan_changes_needs_one_mapping():
    graphs, cluster, plan = dp_case()
    _, _, other = pp_case()
    with pytest.raises(PlanError, match="plan_changes compares re-plans of one job"):
        plan_changes(plan, other)
    assert PlanChanges().empty and PlanChanges().describe() == "no changes"


def test_layout_maps_back_to_the_same_ranks():
    graphs = synthetic_model(4, [Strategy("replicate", 2, Strategy("split", 2))], hidden=256, seq=32)
    cluster = synthetic_cluster([(8, 10.0, 16)], per_host=4)
    plan = planner.plan(graphs, cluster, Config(16, 1))
    layout = plan_layout(plan, graphs, cluster)
    for w in plan.workers:
        assert layout.groups[w.replica][w.stage][w.dp_index][w.tp_index].name == w.device
    assert rebalance(plan, graphs, cluster, [1.0] * plan.world_size) == plan


def test_a_re_plan_keeps_p_reduce():
    """A plan made with Config(dp_sync='partial') stays P-Reduce, with its generator's settings, after a
    re-plan for measured speeds (it used to come back as DDP)."""
    from synthetic import synthetic_cluster, synthetic_model

    graphs = synthetic_model(num_layers=2, strategies=[replicate(4)], hidden=64, seq=8, heads=4)
    cluster = synthetic_cluster([(4, 10.0, 16)])
    plan = planner.plan(graphs, cluster, Config(global_batch_size=16, dp_sync="partial", partial_group_size=3,
                                                   partial_generator="static"))
    assert plan.stages[0].replica_sync == "partial"
    new = rebalance(plan, graphs, cluster, [3.0, 1.0, 1.0, 1.0])
    st = new.stages[0]
    assert (st.replica_sync, st.partial_generator, st.partial_group_size) == ("partial", "static", 3)
    assert new.workers[0].batch_share > new.workers[1].batch_share
