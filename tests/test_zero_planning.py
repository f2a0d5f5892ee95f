"""The planner's side of ZeRO (issue 19): who asks for which ZeRO stage, what each stage holds, how
batches are cut, and what the plan records.

In process, no spawn: the ``zero`` option of ``replicate`` (its checks, the TaskGraph round trip, the
zero-blind fingerprint, nesting), ``Config.zero_stage`` and ``whalelike plan --zero``; the memory
model's three static fractions per ZeRO stage against the formulas (FSDP units of a real GPT-2 and
of a pipeline stage); Poplar's escalation on a real ``transformers`` GPT-2 whose full replica does not
fit the smallest device (the lowest ZeRO stage that fits, before activation checkpointing; the
naive plan too; a worker of one micro-batch per step priced as such); equal micro-batch counts at ZeRO 2-3 with larger micro-batches on faster devices;
the ZeRO collectives in ``Worker.allreduce_ms``; a pipeline's escalation; a re-plan keeping the
ZeRO stage; plan YAML round trip, old plan files, and the plan checks; the errors (a ZeRO stage on a
stage of one worker, values out of range, a model too big for any ZeRO stage naming the device and
the bytes missing).
"""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn as nn

import planner
import whalelike as wl
from hf_models import gpt2
from planner.assemble import build_plan, predict
from planner.balance.replan import rebalance
from planner.decisions import aware_decisions
from planner.devices.cost_model import GIB, CommModel, StageCost, zero_collectives
from planner.devices.placement import PLACEMENTS, build_layout
from planner.devices.placement_search import aware_plan
from planner.devices.memory import REDUCE_SCATTER_COPIES, ZeroShards, fsdp_unit_share, fsdp_units, stage_memory
from planner.plan import Plan, PlanError
from synthetic import synthetic_cluster, synthetic_model
from whalelike.cluster import Cluster, Device, Network
from whalelike.errors import AnnotationError, SpecError
from whalelike.graphs.capture import capture
from whalelike.graphs.taskgraph import TaskGraphs

# The clusters here are sized to the memory model's prediction itself: plans fill them to the last byte, with
# no reserve between (Config.memory_reserve; tests/test_memory_reserve.py tests the reserve).
Config = functools.partial(wl.Config, memory_reserve=0.0)

SPEEDS = (1.0, 1.0, 0.5, 0.25)   # TFLOPS of the four devices: the benchmark cluster
NETWORK = Network(intra_host_gbps=100.0, inter_host_gbps=10.0, latency_us=5.0)
# links on which re-gathering a tiny model's parameters costs less than recomputing its forward: the ZeRO
# escalation then stands (on NETWORK the planner recomputes at a lower ZeRO stage instead, predicted
# faster: the last test)
FAST_LINKS = Network(intra_host_gbps=10_000.0, inter_host_gbps=10_000.0, latency_us=0.01)


@pytest.fixture(scope="module")
def gpt2_graphs() -> TaskGraphs:
    """A real transformers GPT-2 (4 blocks of 64 features, tied embeddings) captured whole: one
    ``replicate`` stage over every device."""
    torch.manual_seed(0)
    real = gpt2()
    (ids,), _ = real.make_batch(2, torch.Generator().manual_seed(0))
    return capture(real.model, (ids,))


def whole(graphs: TaskGraphs) -> StageCost:
    return StageCost.of_layers(graphs, list(range(len(graphs.layers))))


def need(graphs: TaskGraphs, zero: int, samples: int = 1, workers: int = 4, single: bool = False) -> float:
    """Bytes a worker of the whole model's single stage holds at ZeRO ``zero`` with ``samples`` samples
    (``single``: running one micro-batch per step; else accumulating over several)."""
    cost = whole(graphs)
    return stage_memory(cost, 1, zero=ZeroShards(zero, workers, fsdp_unit_share(cost, True), single=single)).total(samples)


def cluster_of(memories_bytes, speeds=SPEEDS, name: str = "hetero", network: Network = NETWORK) -> Cluster:
    devices = tuple(Device(f"d{i}", f"kind{i}", "h0", peak_tflops=s, memory_gib=m / GIB)
                    for i, (m, s) in enumerate(zip(memories_bytes, speeds)))
    return Cluster(name, devices, network)


def small_last(graphs: TaskGraphs, zero: int, network: Network = NETWORK) -> Cluster:
    """Three roomy devices and a last one that holds one sample at ZeRO ``zero`` but not at ``zero - 1``."""
    big = 8 * need(graphs, 0)
    return cluster_of([big, big, big / 2, (need(graphs, zero) + need(graphs, zero - 1)) / 2], network=network)


# -- the request ------------------------------------------------------------------------------------
def test_replicate_zero_option_is_checked_recorded_and_not_structure():
    assert str(wl.replicate(4, zero=3)) == "replicate(4,zero=3)" and wl.replicate(4, zero=3).structure == "replicate(4)"
    assert wl.replicate(4, zero=2) != wl.replicate(4) and wl.replicate(zero=0).zero == 0
    for bad in (4, -1, True, "2", 1.0):
        with pytest.raises(AnnotationError, match=r"zero must be one of 0, 1, 2, 3 or None, got .*replicate\(n, zero=1\)"):
            wl.replicate(2, zero=bad)
    from whalelike.strategy import Strategy
    with pytest.raises(AnnotationError, match=r"split\(zero=2\): zero is an option of replicate only.*"
                                              r"write replicate\(n, zero=2\) around the split"):
        Strategy("split", 2, zero=2)
    # nesting keeps it on the top level (tensor parallel inside, ZeRO across the replicas)
    with wl.replicate(2, zero=2) as outer:
        with wl.split(2) as nested:
            pass
    assert outer.zero == 2 and nested.zero == 2 and nested.inner.zero is None
    # TaskGraphs carry it through their dict form; the fingerprint ignores it
    plain, asked = (synthetic_model(num_layers=2, strategies=[s], hidden=64, seq=8, heads=4)
                    for s in (wl.replicate(4), wl.replicate(4, zero=3)))
    assert plain.fingerprint == asked.fingerprint
    assert TaskGraphs.from_dict(asked.to_dict()).graphs[0].strategy.zero == 3
    # annotate and capture record it per region
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    wl.annotate(model, {"0": wl.replicate(zero=1), "2": wl.replicate(zero=3)})
    graphs = capture(model, (torch.randn(2, 4),))
    assert [tg.strategy.zero for tg in graphs] == [1, 3]


def test_config_zero_stage_is_checked():
    assert Config(global_batch_size=8).zero_stage is None and Config(global_batch_size=8, zero_stage=0).zero_stage == 0
    for bad in (4, -1, True, "1"):
        with pytest.raises(SpecError, match=r"Config.zero_stage must be None \(the planner chooses\) or one of 0, 1, 2, 3"):
            Config(global_batch_size=8, zero_stage=bad)


# -- the memory model -------------------------------------------------------------------------------
def test_memory_terms_per_zero_stage_equal_the_formulas(gpt2_graphs):
    cost = whole(gpt2_graphs)
    # the FSDP units of a single-stage plan: one per module Layer with parameters (the four blocks the
    # largest) but the tie's: lm_head's weight is wte's, which the root unit holds across both uses
    by_name = {l.name: l.param_bytes for l in gpt2_graphs.layers}
    assert by_name["lm_head"] == 0 and "<root>" not in by_name
    # (GPT-2's position embedding, read by constants alone, is recomputed in its first block, whose
    # module does not hold wpe: its bytes are the root unit's too, Layer.outside_param_bytes)
    tied = ("transformer.wte", "lm_head")
    inside = {l.name: l.param_bytes - l.outside_param_bytes for l in gpt2_graphs.layers}
    outside = sum(l.outside_param_bytes for l in gpt2_graphs.layers)
    assert fsdp_units(cost, True) == tuple(float(b) for n, b in inside.items() if b and n not in tied) + \
        (float(by_name["transformer.wte"] + outside),)
    u = max(inside.values()) / sum(by_name.values())
    assert inside["transformer.h.3"] == max(inside.values()) and fsdp_unit_share(cost, True) == pytest.approx(u)
    # as the runtime picks them (runtime.training.recompute.layer_module_paths): code layers and a
    # module around other layers go to the root unit, a module without parameter bytes is no unit
    from types import SimpleNamespace
    from planner.devices.cost_model import fsdp_unit_bytes
    layers = [SimpleNamespace(name=n, param_bytes=b, index=i, borrowed_params=()) for i, (n, b) in enumerate(
              [("<root>", 100), ("transformer", 50), ("transformer.h.0", 300), ("transformer.h.1", 300),
               ("transformer.h.0", 20), ("lm_head", 0)])]
    assert fsdp_unit_bytes(layers, 770) == (320.0, 300.0, 150.0)
    assert fsdp_unit_bytes(layers[:1], 100) == (100.0,)   # no module layers: the model is one unit
    # a pipeline stage is one unit, the stage module
    assert fsdp_units(cost, False) == (cost.param_bytes,) and fsdp_unit_share(cost, False) == 1.0
    W, G, O = cost.param_bytes + cost.param_copy_bytes, cost.param_bytes, cost.optimizer_bytes
    c = REDUCE_SCATTER_COPIES
    assert c == 1   # gloo copies a reduce-scatter's input (planner.devices.memory, "ZeRO")
    for n, single in ((2, False), (4, False), (4, True)):
        f = 1 / n
        # accumulating over micro-batches: stage 1 holds the whole gradients, stage 2 the sharded one
        # through the later backwards; one micro-batch per step: only a unit's buffers beyond the rest
        formulas = {0: (1, 1, 1), 1: (1 + f, (1 + c) * u if single else 1 + c * u, f),
                    2: (1 + f, (1 + c) * u if single else f + (1 + c) * u, f), 3: (f + 2 * u, f + (1 + c) * u, f)}
        assert 2 * u < 1   # so stage 3's gathered units are the two largest blocks
        for z, (w, g, o) in formulas.items():
            for shard in (1.0, 0.5):   # times the tensor-parallel shard, as every term
                memory = stage_memory(cost, 1, shard, zero=ZeroShards(z, n, u, single=single))
                terms = memory.term_bytes(3)
                assert terms["weight"] == pytest.approx(shard * w * W, rel=1e-12)
                assert terms["gradient"] == pytest.approx(shard * g * G, rel=1e-12)
                assert terms["optimizer"] == pytest.approx(shard * o * O, rel=1e-12)
                assert terms["activation"] == stage_memory(cost, 1, shard).term_bytes(3)["activation"]
                # the update's temporaries come after the backward: the larger of them and the activations
                assert memory.total(3) == pytest.approx(terms["weight"] + terms["gradient"] + terms["optimizer"]
                                                        + max(terms["activation"], terms["update"]), rel=1e-12)
                assert memory.max_samples(memory.total(3)) == 3   # max_samples stays the inverse
    # one unit gathered at stage 3 is the whole stage once, never twice
    assert ZeroShards(3, 4, 1.0).fractions() == (0.25 + 1.0, 0.25 + 1.0 + c, 0.25)
    assert ZeroShards(0, 4, 0.3).fractions() == (1.0, 1.0, 1.0)
    for bad in (dict(stage=4), dict(group=0), dict(unit=0.0), dict(unit=1.5), dict(single=1)):
        with pytest.raises(ValueError):
            ZeroShards(**bad)


# -- Poplar's escalation ----------------------------------------------------------------------------
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_escalation_picks_the_lowest_zero_stage_that_fits(gpt2_graphs, zero):
    cluster = small_last(gpt2_graphs, zero, FAST_LINKS)
    smallest = cluster.devices[-1].memory_gib * GIB
    assert need(gpt2_graphs, 0) > smallest   # not even a full replica's state and one sample fits it
    # FSDP2's even shards only (ragged ones fit a stage lower: tests/test_zero_ragged_planning.py), two
    # micro-batches per step (a worker of one holds less at ZeRO 1-2: the next test)
    plan = planner.plan(gpt2_graphs, cluster, Config(global_batch_size=32, num_micro_batch=2, ragged_shards=False))
    (st,) = plan.stages
    assert (st.zero_stage, st.zero_reason, st.replica_sync) == (zero, "fit", "fsdp")
    assert not st.recompute   # ZeRO first, activation checkpointing only as the last resort
    for w in plan.workers:
        assert 0 < w.memory_gib <= w.capacity_gib
        assert w.memory_gib == pytest.approx(w.weights_gib + w.gradients_gib + w.optimizer_gib + w.activations_gib)
    # the worker's figures are the memory model's under that stage, term by term
    cost, u = whole(gpt2_graphs), fsdp_unit_share(whole(gpt2_graphs), True)
    last = plan.workers[-1]
    assert len(last.micro_batch_sizes) == 2
    terms = stage_memory(cost, 1, zero=ZeroShards(zero, 4, u)).term_bytes(max(last.micro_batch_sizes))
    assert last.weights_gib * GIB == pytest.approx(terms["weight"], rel=1e-12)
    assert last.gradients_gib * GIB == pytest.approx(terms["gradient"], rel=1e-12)
    assert last.optimizer_gib * GIB == pytest.approx(terms["optimizer"], rel=1e-12)
    assert last.activations_gib * GIB == pytest.approx(terms["activation"], rel=1e-12)
    summary = plan.summary()
    assert f"ZeRO stage {zero} (FSDP2, chosen to fit)" in summary
    assert "memory per device at its peak (GiB):" in summary and "optimizer" in summary and "activations" in summary
    if zero >= 2:   # every device runs the same number of micro-batches
        assert len({len(w.micro_batch_sizes) for w in plan.workers}) == 1


def test_one_micro_batch_per_step_holds_less_at_zero_1_and_is_priced_so(gpt2_graphs):
    # the last device holds one micro-batch per step at ZeRO 1 (each unit's gradients reduce-scattered
    # and freed as the backward goes), not the whole gradients an accumulating worker holds
    single, accumulating = need(gpt2_graphs, 1, single=True), need(gpt2_graphs, 1)
    assert single < need(gpt2_graphs, 2) < accumulating
    big = 8 * need(gpt2_graphs, 0)
    cluster = cluster_of([big, big, big / 2, (single + need(gpt2_graphs, 2)) / 2], network=FAST_LINKS)
    plan = planner.plan(gpt2_graphs, cluster, Config(global_batch_size=4, ragged_shards=False))
    (st,) = plan.stages
    assert (st.zero_stage, plan.num_micro_batch) == (1, 1)
    assert [len(w.micro_batch_sizes) for w in plan.workers] == [1] * 4
    cost, u = whole(gpt2_graphs), fsdp_unit_share(whole(gpt2_graphs), True)
    for w in plan.workers:
        terms = stage_memory(cost, 1, zero=ZeroShards(1, 4, u, single=True)).term_bytes(w.micro_batch_sizes[0])
        assert w.gradients_gib * GIB == pytest.approx(terms["gradient"], rel=1e-12)
        assert w.gradients_gib * GIB == pytest.approx((1 + REDUCE_SCATTER_COPIES) * u * cost.param_bytes, rel=1e-12)
        assert w.memory_gib <= w.capacity_gib
    # accumulating over two micro-batches it fits neither ZeRO 1 (the whole gradients) nor ZeRO 2 (the
    # sharded gradient held through the second backward) there: ZeRO 3
    two = planner.plan(gpt2_graphs, cluster, Config(global_batch_size=8, num_micro_batch=2, ragged_shards=False))
    assert two.stages[0].zero_stage == 3 and all(len(w.micro_batch_sizes) == 2 for w in two.workers)


def test_a_roomy_cluster_keeps_ddp_and_the_naive_plan_escalates_under_its_equal_shares(gpt2_graphs):
    big = 8 * need(gpt2_graphs, 0, samples=32)
    plan = planner.plan(gpt2_graphs, cluster_of([big] * 4), Config(global_batch_size=32))
    assert [(st.zero_stage, st.zero_reason, st.replica_sync) for st in plan.stages] == [(0, "none", "ddp")]
    assert "ZeRO stage 0 (DDP)" in plan.summary()
    # equal shares: 8 samples each; the last device holds them at ZeRO 2 but not at ZeRO 1
    last = (need(gpt2_graphs, 2, samples=8) + need(gpt2_graphs, 1, samples=8)) / 2
    naive = planner.naive_plan(gpt2_graphs, cluster_of([big, big, big, last]), Config(global_batch_size=32))
    assert [w.micro_batch_sizes for w in naive.workers] == [[8]] * 4
    assert (naive.stages[0].zero_stage, naive.stages[0].zero_reason) == (2, "fit")
    assert all(w.memory_gib <= w.capacity_gib for w in naive.workers)


def test_zero_2_and_3_give_every_device_the_same_count_larger_micro_batches_on_faster_ones(gpt2_graphs):
    cost, u = whole(gpt2_graphs), fsdp_unit_share(whole(gpt2_graphs), True)
    caps = (16, 16, 4, 2)   # samples per micro-batch each device holds at ZeRO 3
    memory = stage_memory(cost, 1, zero=ZeroShards(3, 4, u))
    cluster = cluster_of([memory.total(c) + memory.activations(1) / 2 for c in caps])
    for zero in (2, 3):
        config = Config(global_batch_size=64, zero_stage=zero)
        try:
            plan = planner.plan(gpt2_graphs, cluster, config)
        except PlanError:
            assert zero == 2   # the small devices may not hold a sample at ZeRO 2
            continue
        assert (plan.stages[0].zero_stage, plan.stages[0].zero_reason) == (zero, "asked")
        counts = {len(w.micro_batch_sizes) for w in plan.workers}
        assert len(counts) == 1 and plan.num_micro_batch == counts.pop() >= 2   # 64 samples need 2+ of them
        assert sum(w.batch_share for w in plan.workers) == 64
        largest = [max(w.micro_batch_sizes) for w in plan.workers]
        assert largest == sorted(largest, reverse=True)   # devices in falling speed order
        for w in plan.workers:
            assert w.memory_gib <= w.capacity_gib
        # the plan check refuses a worker of another count
        data = plan.to_dict()
        w = next(w for w in data["workers"] if len(w["micro_batch_sizes"]) > 1)
        w["micro_batch_sizes"] = [sum(w["micro_batch_sizes"])]
        w["forward_ms"], w["backward_ms"] = w["forward_ms"][:1], w["backward_ms"][:1]
        with pytest.raises(PlanError, match=rf"micro-batch counts .* differ .* ZeRO stage {zero} needs the same count"):
            Plan.from_dict(data).validate()


def test_zero_collectives_are_priced_on_the_network_model(gpt2_graphs):
    cluster = small_last(gpt2_graphs, 1)
    cost = whole(gpt2_graphs)
    units = len(fsdp_units(cost, True))
    comm = CommModel(cluster.network)
    assert zero_collectives(1, 5) == (1, 1) and zero_collectives(2, 5) == (1, 5) and zero_collectives(3, 5) == (10, 5)
    for zero in (1, 2, 3):
        plan = planner.plan(gpt2_graphs, cluster, Config(global_batch_size=32, zero_stage=zero))
        k = max(len(w.micro_batch_sizes) for w in plan.workers)
        ring = list(cluster.devices)
        gathers, scatters = zero_collectives(zero, k)
        ag, rs = comm.allgather_ms(cost.param_bytes, ring), comm._ring(ring).reduce_scatter_ms(cost.param_bytes)
        latency = (units - 1) * 3 * comm._ring(ring).latency_ms
        expected = gathers * (ag + latency) + scatters * (rs + latency)
        for w in plan.workers:
            assert w.gradient_bytes == 0.0   # no DDP buckets: the collectives come after the backward
            assert w.allreduce_ms == pytest.approx(expected, rel=1e-12) and w.allreduce_ms > 0
        assert plan.prediction.step_time_ms >= max(w.compute_ms for w in plan.workers) + expected * (1 - 1e-9)


def test_a_pipeline_stage_escalates_too_and_zero_3_shards_it_layer_by_layer():
    graphs = synthetic_model(num_layers=8, strategies=[wl.replicate(4), wl.replicate(4)], hidden=256, seq=16, heads=4)
    cost = StageCost.of_layers(graphs, list(range(4)))
    # a stage sharded evenly runs cut into its layers (runtime.parallel.stage_units): its units are
    # the layers' parameters, and u is the largest layer's share, not the whole stage
    assert fsdp_unit_share(cost, False) == 1.0                    # one unit (ragged, tensor-parallel)
    assert sum(cost.stage_unit_bytes) == pytest.approx(cost.param_bytes)
    u = fsdp_unit_share(cost, False, cut=True)
    assert u == pytest.approx(max(cost.stage_unit_bytes) / cost.param_bytes) and u < 0.5
    z0 = stage_memory(cost, 2, zero=ZeroShards(0, 4, u))
    z1 = stage_memory(cost, 2, zero=ZeroShards(1, 4, u))
    z3 = stage_memory(cost, 2, zero=ZeroShards(3, 4, u))
    # stage 3 holds its rows plus two layers (the one computing, the one prefetched), far below stage 1
    assert z3.static() < z1.static() < z0.static()
    assert z3.static_terms() == pytest.approx((0.25 + 2 * u) * cost.param_bytes + (0.25 + 2 * u) * cost.param_bytes
                                        + 0.25 * cost.optimizer_bytes, rel=1e-9)
    # between ZeRO 1 with one sample per micro-batch and ZeRO 0's state alone: no micro-batch count
    # makes ZeRO 0 fit, ZeRO 1 fits with small micro-batches
    assert z1.total(1) < z0.static()
    capacity = (z1.total(1) + z0.static()) / 2 / GIB
    cluster = synthetic_cluster([(8, 10.0, capacity)])
    config = Config(global_batch_size=16, num_micro_batch=2)
    plan = planner.plan(graphs, cluster, config)
    assert [(st.zero_stage, st.zero_reason, st.replica_sync) for st in plan.stages] == [(1, "fit", "fsdp")] * 2
    assert all(w.memory_gib <= w.capacity_gib for w in plan.workers)
    # a re-plan from measured speeds keeps the ZeRO stages
    again = rebalance(plan, graphs, cluster, [1.0] * 7 + [0.5])
    assert [(st.zero_stage, st.zero_reason) for st in again.stages] == [(1, "fit")] * 2
    # too small for ZeRO 1 and 2 (which keep every layer gathered through the step): ZeRO 3, which
    # gathers one layer at a time, fits
    z2 = stage_memory(cost, 2, zero=ZeroShards(2, 4, u))
    assert z3.total(1) < z2.static() < z1.static()
    small = synthetic_cluster([(8, 10.0, (z3.total(1) + z2.static()) / 2 / GIB)])
    plan = planner.plan(graphs, small, config)
    assert [st.zero_stage for st in plan.stages] == [3, 3] and all(st.zero_reason == "fit" for st in plan.stages)
    assert all(w.memory_gib <= w.capacity_gib for w in plan.workers)
    # too small for ZeRO 3: the error says which stages were tried
    tiny = synthetic_cluster([(8, 10.0, z3.static() * 0.9 / GIB)])
    with pytest.raises(PlanError, match=r"short by .* bytes\).*ZeRO stages up to 3 were tried over its 4 data-parallel "
                                        r"workers"):
        planner.plan(graphs, tiny, config)


def test_a_split_nothing_holds_whole_is_priced_under_zero_3(caplog):
    # every split of the 8 layers over the two stages leaves one stage at least 4 layers; the devices
    # hold 4 layers' state only sharded four ways (ZeRO 3, layer by layer), so the partitioner prices
    # the split that way (not the TaskGraph boundaries as a last resort) and the ZeRO escalation
    # then picks, on the split found, the lowest stage that fits
    graphs = synthetic_model(num_layers=8, strategies=[wl.replicate(4), wl.replicate(4)], hidden=256, seq=16, heads=4)
    cost = StageCost.of_layers(graphs, list(range(4)))
    u = fsdp_unit_share(cost, False, cut=True)
    z0 = stage_memory(cost, 2, zero=ZeroShards(0, 4, u))
    z3 = stage_memory(cost, 2, zero=ZeroShards(3, 4, u))
    capacity = z0.static() * 0.6   # no stage of 4 layers holds its state whole; sharded it does
    assert z3.total(2) < capacity
    config = Config(global_batch_size=16, num_micro_batch=2)
    with caplog.at_level("INFO", logger="planner"):
        plan = planner.plan(graphs, synthetic_cluster([(8, 10.0, capacity / GIB)]), config)
    assert "the split is priced with each stage's state sharded over its data-parallel workers" in caplog.text
    assert "keeping the TaskGraph boundaries" not in caplog.text
    assert all(st.zero_stage >= 1 and st.zero_reason == "fit" for st in plan.stages)
    assert all(w.memory_gib <= w.capacity_gib for w in plan.workers)
    # with the state fixed whole (ZeRO 0 asked), no such split exists: the boundaries stand and it fails
    with pytest.raises(PlanError):
        planner.plan(graphs, synthetic_cluster([(8, 10.0, capacity / GIB)]),
                     dataclasses.replace(config, zero_stage=0))


# -- fixed by the user ------------------------------------------------------------------------------
def test_config_and_region_fix_the_zero_stage(gpt2_graphs):
    roomy = cluster_of([8 * need(gpt2_graphs, 0, samples=32)] * 4)
    for zero in (0, 1, 2, 3):
        plan = planner.plan(gpt2_graphs, roomy, Config(global_batch_size=32, zero_stage=zero))
        st = plan.stages[0]
        assert (st.zero_stage, st.zero_reason, st.replica_sync) == \
            (zero, "asked" if zero else "none", "fsdp" if zero else "ddp")
        assert f"ZeRO stage {zero} ({'FSDP2, asked' if zero else 'DDP'})" in plan.summary()
    # a region's zero= fixes its stages (over Config's), and plan_checks holds a plan to it
    graphs = synthetic_model(num_layers=4, strategies=[wl.replicate(2, zero=3), wl.replicate(2)], hidden=64, seq=8,
                             heads=4)
    cluster = synthetic_cluster([(4, 10.0, 16)])
    plan = planner.plan(graphs, cluster, Config(global_batch_size=8, num_micro_batch=2, zero_stage=1))
    assert [(st.zero_stage, st.zero_reason) for st in plan.stages] == [(3, "asked"), (1, "asked")]
    wrong = dataclasses.replace(plan, stages=[dataclasses.replace(plan.stages[0], zero_stage=2), plan.stages[1]])
    with pytest.raises(PlanError, match=r"plan.stages\[0\].zero_stage is 2 but TaskGraph\(s\) \[0\] of this stage ask "
                                        r"for zero=3"):
        wrong.validate(graphs=graphs)
    # tensor parallel inside, ZeRO across the replicas: each tp_index's group of two shards
    with wl.replicate(2, zero=2):
        with wl.split(2) as hybrid:
            pass
    nested = synthetic_model(num_layers=2, strategies=[hybrid], hidden=64, seq=8, heads=4)
    plan = planner.plan(nested, cluster, Config(global_batch_size=8))
    assert (plan.stages[0].strategy, plan.stages[0].zero_stage) == ("replicate(2)+split(2)", 2)


def test_cli_zero_flag(capsys, gpt2_graphs, monkeypatch, tmp_path):
    from whalelike.cli import main

    monkeypatch.setattr("whalelike.cli.capture_workload", lambda args: gpt2_graphs)
    out_yaml = tmp_path / "plan.yaml"
    code = main(["plan", "model.py:build", "--cluster", "emulated-4", "--global-batch", "16", "--zero", "2",
                 "-o", str(out_yaml)])
    out, _ = capsys.readouterr()
    assert code == 0 and "ZeRO stage 2 (FSDP2, asked)" in out and "memory per device at its peak" in out
    plan = Plan.from_yaml(out_yaml, graphs=gpt2_graphs, cluster=Cluster.preset("emulated-4"))
    assert (plan.stages[0].zero_stage, plan.stages[0].replica_sync) == (2, "fsdp")
    with pytest.raises(SystemExit):
        main(["plan", "model.py:build", "--cluster", "emulated-4", "--global-batch", "16", "--zero", "4",
              "-o", str(tmp_path / "bad.yaml")])
    assert "argument --zero: invalid choice: 4 (choose from 0, 1, 2, 3)" in capsys.readouterr().err


# -- bad input --------------------------------------------------------------------------------------
def test_zero_on_a_stage_of_one_worker_is_an_error():
    one = synthetic_cluster([(1, 10.0, 16)])
    graphs = synthetic_model(num_layers=2, strategies=[wl.replicate(1, zero=2)], hidden=64, seq=8, heads=4)
    with pytest.raises(PlanError, match=r"TaskGraph 0 \(replicate\(1,zero=2\)\) asks for ZeRO stage 2, but stage 0 "
                                        r"\(replicate\(1\)\) has one data-parallel worker: .*nothing to shard; give the "
                                        r"region more devices \(replicate\(n, zero=2\) with n >= 2\) or drop zero="):
        planner.plan(graphs, one, Config(global_batch_size=4))
    plain = synthetic_model(num_layers=2, strategies=[wl.replicate()], hidden=64, seq=8, heads=4)
    with pytest.raises(PlanError, match=r"Config.zero_stage is 3, but no stage of the plan has more than one "
                                        r"data-parallel worker \(replicate\(1\)\).*use zero_stage=None or 0"):
        planner.plan(plain, one, Config(global_batch_size=4, zero_stage=3))
    assert planner.plan(plain, one, Config(global_batch_size=4, zero_stage=0)).stages[0].zero_stage == 0
    # Config's stage applies where the group has more than one worker; a pipeline stage of one keeps DDP
    graphs = synthetic_model(num_layers=4, strategies=[wl.replicate(2), wl.replicate(1)], hidden=64, seq=8, heads=4)
    plan = planner.plan(graphs, synthetic_cluster([(3, 10.0, 16)]), Config(global_batch_size=4, zero_stage=2))
    assert [st.zero_stage for st in plan.stages] == [2, 0]


def test_a_model_too_big_for_every_zero_stage_names_the_device_and_the_bytes_missing(gpt2_graphs):
    static3 = stage_memory(whole(gpt2_graphs), 1,
                           zero=ZeroShards(3, 4, fsdp_unit_share(whole(gpt2_graphs), True))).static()
    big = 8 * need(gpt2_graphs, 0)
    cluster = cluster_of([big, big, big, static3 * 0.8])
    with pytest.raises(PlanError) as info:   # even shards (ragged ZeRO 2 fits it: test_zero_ragged_planning.py)
        planner.plan(gpt2_graphs, cluster, Config(global_batch_size=32, ragged_shards=False))
    text = str(info.value)
    missing = static3 - cluster.devices[-1].memory_gib * GIB
    assert "does not fit on device 'd3'" in text and "under ZeRO stage 3 over 4 workers" in text
    assert f"({missing:,.0f} bytes)" in text
    assert "ZeRO stages up to 3 were tried over its 4 data-parallel workers" in text


# -- the plan file ----------------------------------------------------------------------------------
def test_plan_yaml_round_trip_old_files_and_checks(gpt2_graphs, tmp_path):
    cluster = small_last(gpt2_graphs, 2)
    plan = planner.plan(gpt2_graphs, cluster, Config(global_batch_size=32, num_micro_batch=2, ragged_shards=False))
    assert plan.stages[0].zero_stage == 2
    path = tmp_path / "plan.yaml"
    plan.to_yaml(path)
    assert Plan.from_yaml(path, graphs=gpt2_graphs, cluster=cluster) == plan
    # a plan file from before ZeRO: no zero_stage, zero_reason, replica_sync or memory terms
    old = planner.plan(gpt2_graphs, cluster_of([8 * need(gpt2_graphs, 0, samples=32)] * 4),
                       Config(global_batch_size=32)).to_dict()
    for stage in old["stages"]:
        del stage["zero_stage"], stage["zero_reason"], stage["replica_sync"]
    for w in old["workers"]:
        for key in ("weights_gib", "gradients_gib", "optimizer_gib", "activations_gib"):
            del w[key]
    loaded = Plan.from_dict(old)
    loaded.validate(graphs=gpt2_graphs)
    assert (loaded.stages[0].zero_stage, loaded.stages[0].zero_reason, loaded.stages[0].replica_sync) == (0, "none", "ddp")
    assert "memory per device" not in loaded.summary() and "ZeRO stage 0 (DDP)" in loaded.summary()
    # the checks: the sync follows the stage, a reason only with a ZeRO stage, someone to shard with
    cases = [
        (dict(replica_sync="ddp"), r"plan.stages\[0\].replica_sync is 'ddp' with zero_stage 2; it must be 'fsdp'"),
        (dict(zero_stage=0), r"replica_sync is 'fsdp' with zero_stage 0; it must be 'ddp'"),
        (dict(zero_stage=0, replica_sync="ddp"), r"zero_reason is 'fit' with zero_stage 0; it must be 'none'"),
        (dict(zero_stage=7), r"plan.stages\[0\].zero_stage must be <= 3"),
        (dict(zero_reason="because"), r"plan.stages\[0\].zero_reason must be one of"),
    ]
    for change, message in cases:
        data = plan.to_dict()
        data["stages"][0].update(change)
        with pytest.raises(PlanError, match=message):
            Plan.from_dict(data).validate()
    hand = plan.to_dict()   # a plan written by hand may leave the reason out
    hand["stages"][0]["zero_reason"] = "none"
    Plan.from_dict(hand).validate()
    alone = planner.plan(synthetic_model(num_layers=2, hidden=64, seq=8, heads=4), synthetic_cluster([(1, 10.0, 16)]),
                         Config(global_batch_size=4)).to_dict()
    alone["stages"][0].update(zero_stage=1, replica_sync="fsdp", zero_reason="asked")
    with pytest.raises(PlanError, match=r"zero_stage is 1 but the stage has one data-parallel worker per shard"):
        Plan.from_dict(alone).validate()


def test_a_stage_raised_to_a_higher_zero_stage_is_simulated_recomputing_instead_and_the_faster_kept(tmp_path):
    # a pipeline stage whose activations do not fit under ZeRO 0: ZeRO 2 (the gradients sharded, a
    # reduce-scatter every micro-batch) or recomputing at ZeRO 0 both make it fit; which is faster
    # depends on the links, so the planner simulates both (placement_search._recompute_instead)
    graphs = synthetic_model(num_layers=8, strategies=[wl.replicate(4), wl.replicate(4)], hidden=256, seq=1024, heads=4)
    config = Config(global_batch_size=16, num_micro_batch=2)
    roomy = planner.plan(graphs, synthetic_cluster([(8, 10.0, 100.0)]), config)
    capacity = 0.22 * max(w.memory_gib for w in roomy.workers)

    def linked(gbps: float) -> Cluster:
        devices = synthetic_cluster([(8, 10.0, capacity)]).devices
        return Cluster(f"links-{gbps}", devices, Network(intra_host_gbps=gbps, inter_host_gbps=gbps, latency_us=5.0))

    fast, slow = linked(100.0), linked(0.2)
    for cluster, kept in ((fast, (2, "none")), (slow, (0, "faster"))):
        plan = planner.plan(graphs, cluster, config)
        assert (plan.stages[1].zero_stage, plan.stages[1].recompute_reason) == kept
        assert all(w.memory_gib <= w.capacity_gib for w in plan.workers)
        # on one layout, the decisions' own choice (ZeRO first; on the TaskGraph boundaries, which
        # aware_plan keeps on both networks) and the same split recomputing first are both plans that
        # fit, and aware_plan keeps the one the simulator predicts faster
        layout = build_layout(graphs, cluster, PLACEMENTS[0], config.precision)
        zero_first = aware_decisions(graphs, config, layout, cluster.network, resplit=False)
        assert zero_first.zero_stage(1) >= 2 and not zero_first.recomputes(1)
        recompute_first = aware_decisions(graphs, config, layout, cluster.network,
                                          stage_layers=zero_first.stage_layers, recompute_first=[1])
        assert recompute_first.recompute[1] == "faster" and recompute_first.zero_stage(1) < zero_first.zero_stage(1)
        times = [predict(build_plan(graphs, cluster, config, d), cluster).step_time_ms
                 for d in (zero_first, recompute_first)]
        prediction, chosen, _ = aware_plan(graphs, cluster, config, layout)
        assert prediction.step_time_ms == pytest.approx(min(times))
        assert chosen.stages[1].recompute == (times[1] < times[0]) == (cluster is slow)
    kept = planner.plan(graphs, slow, config)
    assert "recomputes activations layer by layer (chosen to fit, predicted faster than a higher ZeRO stage)" in \
        kept.summary()
    # the reason is plan data: written, read back and checked like the others
    kept.to_yaml(tmp_path / "plan.yaml")
    assert Plan.from_yaml(tmp_path / "plan.yaml", graphs=graphs, cluster=slow) == kept
