"""``planner.plan()`` end to end: invariants of every returned plan, placement, bad input."""
import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import planner
from planner import PlanError
from whalelike import Cluster, Config, replicate, split
from whalelike.strategy import Strategy

from synthetic import bert_large, synthetic_cluster, synthetic_model


def _check_invariants(plan, graphs, cluster):
    plan.validate(graphs=graphs, cluster=cluster)   # shares sum to the batch, every stage covered
    for w in plan.workers:
        assert w.memory_gib <= w.capacity_gib, w
    for s in range(len(plan.stages)):
        heads = [w for w in plan.stage_workers(s) if w.tp_index == 0]
        assert sum(w.batch_share for w in heads) == plan.global_batch_size
    # a faster device never gets less work than a slower one with equal memory (same stage)
    speed = {d.name: d.peak_tflops for d in cluster.devices}
    memory = {d.name: d.memory_gib for d in cluster.devices}
    for a in plan.workers:
        for b in plan.workers:
            if (a.stage, a.tp_size) == (b.stage, b.tp_size) == (a.stage, 1) and memory[a.device] == memory[b.device] \
                    and speed[a.device] > speed[b.device]:
                assert a.batch_share >= b.batch_share, (a, b)
    assert plan.prediction.step_time_ms > 0 and plan.naive_prediction.step_time_ms > 0


kinds_st = st.lists(st.tuples(st.integers(1, 4), st.sampled_from([5.0, 10.0, 20.0, 40.0]),
                              st.sampled_from([8.0, 16.0, 32.0])), min_size=1, max_size=3)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kinds=kinds_st, stages=st.integers(1, 3), batch_per_device=st.integers(1, 64), micro=st.sampled_from([1, 2, 4]))
def test_every_plan_fits_and_balances(kinds, stages, batch_per_device, micro):
    cluster = synthetic_cluster(kinds, per_host=4)
    n = len(cluster.devices)
    if stages > n:
        stages = n
    graphs = synthetic_model(6, [replicate() for _ in range(stages)], hidden=512, seq=64, vocab=8000)
    gbs = max(n, batch_per_device * n) * micro
    config = Config(global_batch_size=gbs, num_micro_batch=micro)
    try:
        plan = planner.plan(graphs, cluster, config)
    except PlanError as e:
        assert "does not fit" in str(e)
        return
    _check_invariants(plan, graphs, cluster)


def test_data_parallel_shares_follow_speed():
    graphs = synthetic_model(4, [replicate()], hidden=256, seq=32)
    cluster = synthetic_cluster([(2, 30.0, 16), (2, 10.0, 16)])
    plan = planner.plan(graphs, cluster, Config(global_batch_size=80, num_micro_batch=2))
    assert [w.micro_batch_sizes for w in plan.workers] == [[15, 15], [15, 15], [5, 5], [5, 5]]
    assert plan.prediction.step_time_ms < plan.naive_prediction.step_time_ms
    naive = planner.naive_plan(graphs, cluster, Config(global_batch_size=80, num_micro_batch=2))
    assert [w.micro_batch_sizes for w in naive.workers] == [[10, 10]] * 4


def test_gradient_accumulation_when_the_batch_does_not_fit():
    """Poplar: each device runs micro-batches as large as its memory allows, plus a last batch."""
    graphs = bert_large([replicate()])
    cluster = synthetic_cluster([(2, 15.7, 32), (2, 9.3, 16)])
    plan = planner.plan(graphs, cluster, Config(global_batch_size=1000, num_micro_batch=1))
    _check_invariants(plan, graphs, cluster)
    assert plan.num_micro_batch == max(len(w.micro_batch_sizes) for w in plan.workers) > 1
    for w in plan.workers:
        full, last = w.micro_batch_sizes[:-1], w.micro_batch_sizes[-1]
        assert all(b == w.micro_batch_sizes[0] for b in full) and last <= w.micro_batch_sizes[0]
    fast, slow = plan.workers[0], plan.workers[2]
    assert fast.batch_share > slow.batch_share and fast.micro_batch_sizes[0] > slow.micro_batch_sizes[0]


def test_pipeline_gets_more_micro_batches_when_they_do_not_fit():
    graphs = bert_large([replicate(2), replicate(2)])
    cluster = synthetic_cluster([(4, 10.0, 8)])
    plan = planner.plan(graphs, cluster, Config(global_batch_size=512, num_micro_batch=2))
    _check_invariants(plan, graphs, cluster)
    assert plan.num_micro_batch > 2 and 512 % plan.num_micro_batch == 0


def test_tensor_parallel_shards_follow_speed():
    graphs = synthetic_model(4, [split(2)], hidden=256, seq=32)
    cluster = synthetic_cluster([(1, 30.0, 16), (1, 10.0, 16)])
    plan = planner.plan(graphs, cluster, Config(global_batch_size=8))
    _check_invariants(plan, graphs, cluster)
    assert plan.stages[0].shard_sizes == {f"layers.{i}.mlp.fc1": [768, 256] for i in range(4)}
    assert [w.micro_batch_sizes for w in plan.workers] == [[8], [8]]
    assert plan.workers[0].compute_ms == pytest.approx(plan.workers[1].compute_ms, rel=0.05)


def test_pipeline_replicas_and_placement():
    """Two copies of a 2-stage pipeline: large-memory devices on stage 0, neighbours share hosts."""
    graphs = synthetic_model(8, [replicate(2), replicate(2)], hidden=256, seq=32)
    cluster = synthetic_cluster([(4, 10.0, 32), (4, 10.0, 16)], per_host=4)
    plan = planner.plan(graphs, cluster, Config(global_batch_size=64, num_micro_batch=4))
    _check_invariants(plan, graphs, cluster)
    assert plan.num_replicas == 2 and plan.world_size == 8
    assert all(w.capacity_gib == pytest.approx(32 * (1 - plan.memory_reserve)) for w in plan.workers if w.stage == 0)
    homogeneous = synthetic_cluster([(8, 10.0, 16)], per_host=4)
    plan = planner.plan(graphs, homogeneous, Config(global_batch_size=64, num_micro_batch=4))
    for r in range(2):
        assert len({w.host for w in plan.workers if w.replica == r}) == 1


def test_split_groups_stay_on_one_host():
    graphs = synthetic_model(4, [Strategy("replicate", 2, Strategy("split", 4))], hidden=256, seq=32)
    cluster = synthetic_cluster([(8, 10.0, 16)], per_host=4)
    plan = planner.plan(graphs, cluster, Config(global_batch_size=16))
    for dp in range(2):
        assert len({w.host for w in plan.workers if w.dp_index == dp}) == 1


@pytest.mark.parametrize(
    "graphs, kinds, config, message",
    [
        (synthetic_model(4, [replicate()], hidden=8192), [(4, 10.0, 4)], Config(16),
         "short by"),
        (synthetic_model(4, [replicate()]), [(8, 10.0, 16)], Config(4),
         "global_batch_size 4 is smaller than the 8 data-parallel groups"),
        (synthetic_model(4, [replicate(2), replicate(2)]), [(4, 10.0, 16)], Config(10, 4),
         "num_micro_batch 4 does not divide global_batch_size 10"),
        (synthetic_model(4, [replicate()]), [(8, 10.0, 16)], Config(16, 4),
         "use num_micro_batch <= 2"),
    ],
)
def test_bad_input_is_a_clear_error(graphs, kinds, config, message):
    with pytest.raises(PlanError, match=None) as e:
        planner.plan(graphs, synthetic_cluster(kinds), config)
    assert message in str(e.value)


def test_memory_shortfall_says_what_would_fit():
    graphs = bert_large([replicate(2), replicate(2)])
    cluster = synthetic_cluster([(4, 10.0, 4)])
    with pytest.raises(PlanError) as e:
        # 4096 fits since the planner may recompute activations; 65536 does not even then
        planner.plan(graphs, cluster, Config(global_batch_size=65536, num_micro_batch=2, schedule="gpipe"))
    text = str(e.value)
    assert "TaskGraph 0 (stage 0) does not fit" in text and "short by" in text
    assert "even with activation checkpointing" in text
    assert "samples per micro-batch fit" in text and "more kind0-4GB device(s)" in text


def test_whale_setting_first_taskgraph_on_the_32gb_devices():
    """8 V100-32GB + 8 P100-16GB, BERT-Large-like with the embedding in TaskGraph 0."""
    cluster = Cluster.preset("whale-v100-p100")
    graphs = bert_large([replicate(8), replicate(8)])
    plan = planner.plan(graphs, cluster, Config(global_batch_size=96, num_micro_batch=4))
    _check_invariants(plan, graphs, cluster)
    assert {w.capacity_gib for w in plan.workers if w.stage == 0} == {32.0 * (1 - plan.memory_reserve)}
    dp = planner.plan(bert_large([replicate(16)]), cluster, Config(global_batch_size=256))
    speedup = dp.naive_prediction.step_time_ms / dp.prediction.step_time_ms
    print(f"\nWhale setting, hardware-aware DP predicted speed-up over naive: {speedup:.2f}x")
    assert speedup > 1.0


def test_stages_exchange_devices_when_that_is_faster():
    """GPT-like: two movable replicate stages and a fixed ``split(1)`` head. Both placement rules
    leave the head on the slowest device once the partitioner has moved the middle stage's layers
    forward; the swap search gives it a faster one, and never predicts worse than either rule."""
    from planner.devices.placement_search import aware_plan as _aware_plan
    from planner.devices.placement import PLACEMENTS, build_layout

    graphs = synthetic_model(7, [replicate(), replicate(), split(1)], layers_per_graph=[3, 3, 1], hidden=256, seq=32)
    cluster = synthetic_cluster([(2, 10.0, 16), (1, 5.0, 16), (1, 2.5, 16)], per_host=4)
    config = Config(global_batch_size=32, num_micro_batch=4)
    plan = planner.plan(graphs, cluster, config)
    _check_invariants(plan, graphs, cluster)
    by_rule = [_aware_plan(graphs, cluster, config, build_layout(graphs, cluster, p))[0].step_time_ms
              for p in PLACEMENTS]
    assert plan.prediction.step_time_ms <= min(by_rule)
    head = plan.stage_workers(2)[0]
    assert cluster.device(head.device).peak_tflops > 2.5, plan.summary()


def test_summary_shows_the_resharding_of_each_boundary():
    """Given the cluster, the summary prints each boundary's resharding (strategy, unit tasks,
    predicted time, lower bound, send/recv) as planner.resharding.reshard.boundary_resharding plans it."""
    import re

    from planner.resharding.reshard import boundary_resharding
    from planner.summary import plan_summary

    graphs = synthetic_model(6, [replicate(), split(), replicate()], hidden=256, seq=32)
    cluster = synthetic_cluster([(4, 20.0, 32), (4, 10.0, 32)], per_host=4)
    plan = planner.plan(graphs, cluster, Config(global_batch_size=32, num_micro_batch=4))
    text = plan_summary(plan, cluster)
    assert plan_summary(plan) == plan.summary() and "resharding" not in plan.summary()
    lines = [line for line in text.splitlines() if line.startswith("  boundary stage ")]
    reshards = boundary_resharding(plan, cluster)
    assert len(lines) == len(plan.boundaries) == len(reshards) == 2
    for line, boundary, reshard in zip(lines, plan.boundaries, reshards):
        match = re.fullmatch(rf"  boundary stage {boundary.src_stage} -> {boundary.dst_stage}: [\d.]+ (KiB|MiB|B), "
                             rf"strategy (\w+), (\d+) unit task\(s\), \d+ transfer\(s\), predicted ([\d.e+-]+) ms "
                             rf"\(lower bound ([\d.e+-]+) ms\), send/recv would take ([\d.e+-]+) ms; "
                             rf"the plan's transfer_ms ([\d.e+-]+) ms", line)
        assert match, line
        strategy, tasks, predicted, bound, send_recv, transfer = match.groups()[1:]
        assert (strategy, int(tasks)) == (reshard.strategy, len(reshard.tasks))
        assert float(bound) <= float(predicted) <= float(send_recv)
        # the plan prices its boundaries with the resharding the summary shows
        assert transfer == predicted and boundary.transfer_ms[0] == pytest.approx(reshard.predicted_ms)
    assert plan_summary(plan, cluster) == text


@pytest.mark.parametrize("strategy", ["send_recv", "broadcast"])
def test_the_plans_resharding_strategy_prices_its_boundaries(strategy):
    """Config.resharding reaches the plan, its summary and its boundary times: the boundary is
    planned under that strategy only."""
    from planner.resharding.reshard import boundary_resharding

    graphs = synthetic_model(6, [replicate(), split(), replicate()], hidden=256, seq=32)
    cluster = synthetic_cluster([(4, 20.0, 32), (4, 10.0, 32)], per_host=4)
    plan = planner.plan(graphs, cluster, Config(global_batch_size=32, num_micro_batch=4, resharding=strategy))
    assert plan.resharding == strategy
    for boundary, reshard in zip(plan.boundaries, boundary_resharding(plan, cluster)):
        assert reshard.strategy == strategy and list(reshard.alternatives_ms) == [strategy]
        assert boundary.transfer_ms == pytest.approx([reshard.predicted_ms] * plan.num_micro_batch)
    assert f"strategy {strategy}" in plan.summary(cluster)


def _four_stages():
    graphs = synthetic_model(12, [replicate() for _ in range(4)], hidden=256, seq=32)
    return graphs, synthetic_cluster([(2, 20.0, 32), (2, 10.0, 32)], per_host=4)


def test_auto_schedule_plans_1f1b_and_zb_h1_and_keeps_the_faster():
    graphs, cluster = _four_stages()
    config = Config(global_batch_size=32, num_micro_batch=8, schedule="auto")
    plan = planner.plan(graphs, cluster, config)
    each = {s: planner.plan(graphs, cluster, dataclasses.replace(config, schedule=s)) for s in ("1f1b", "zb-h1")}
    assert plan.schedule == "zb-h1"
    assert plan.schedule_steps_ms == {s: p.prediction.step_time_ms for s, p in each.items()}
    assert plan.prediction == each["zb-h1"].prediction and plan.stages == each["zb-h1"].stages
    assert each["zb-h1"].prediction.bubble_fraction < each["1f1b"].prediction.bubble_fraction
    assert "schedule zb-h1 (auto, the fastest of 1f1b " in plan.summary().splitlines()[0]
    _check_invariants(plan, graphs, cluster)
    # a schedule asked by name is pinned: planned alone, nothing recorded
    assert [each[s].schedule for s in each] == ["1f1b", "zb-h1"] and each["1f1b"].schedule_steps_ms == {}
    # the capacity-blind plan prices no schedule: 1F1B
    assert planner.naive_plan(graphs, cluster, config).schedule == "1f1b"
    # ZB-H1 holds S micro-batches on every stage, more than 1F1B on the later ones, and the plan prices it
    assert [w.activations_gib > v.activations_gib for w, v in zip(each["zb-h1"].workers, each["1f1b"].workers)] == \
        [False, True, True, True]


def test_auto_schedule_keeps_1f1b_on_a_tie_and_a_record_that_lies_is_refused():
    graphs = synthetic_model(4, [replicate()], hidden=256, seq=32)
    cluster = synthetic_cluster([(2, 20.0, 16), (2, 10.0, 16)])
    plan = planner.plan(graphs, cluster, Config(global_batch_size=32, num_micro_batch=2, schedule="auto"))
    # one stage: both schedules are gradient accumulation, the same step, 1F1B kept
    assert plan.schedule == "1f1b" and plan.schedule_steps_ms["1f1b"] == plan.schedule_steps_ms["zb-h1"]
    graphs, cluster = _four_stages()
    plan = planner.plan(graphs, cluster, Config(global_batch_size=32, num_micro_batch=8, schedule="auto"))
    faster = dict(plan.schedule_steps_ms, **{"1f1b": plan.prediction.step_time_ms / 2})
    with pytest.raises(PlanError, match=r"plan\.schedule_steps_ms\['1f1b'\] \(.* ms\) is predicted faster than the "
                                        r"schedule kept \('zb-h1', .* ms\): the planner keeps the fastest"):
        dataclasses.replace(plan, schedule_steps_ms=faster).validate()
    with pytest.raises(PlanError, match=r"plan\.schedule is 'zb-h1', not one of the schedules planned"):
        dataclasses.replace(plan, schedule_steps_ms={"1f1b": plan.prediction.step_time_ms}).validate()
