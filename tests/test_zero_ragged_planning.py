"""The planner's side of ragged ZeRO state shards (issue 19, items 2-3; Cephalo): each data-parallel
worker holds a fraction of the sharded state in proportion to the memory it has left.

In process, no spawn: the fractions against the rule (free memory after the activations at the
worker's speed-proportional micro-batch, the full weights and, at ZeRO 1, the full gradients, and the
padded collective buffers every rank holds, ``n * max(f)`` times a bucket, on examples/wide_mlp.py and
a real ``transformers`` GPT-2); every memory term of a ragged worker against the formulas at ZeRO 1, 2
and 3 (the buckets' share bounded from the layers, ``u`` the largest single parameter's share at ZeRO 2,
the largest layer unit at ZeRO 3, measured on the torch module); a model that fits with ragged shards
but not with even ones at the same ZeRO stage, one that only ragged ZeRO 3 fits, and the largest
WideMLP each trains on ``examples/clusters/emulated-4-small-memory.yaml``; the escalation's choices
(even where even fits, ragged before a higher stage, even fractions kept as FSDP2, 3 ragged after 3
even); ``Config.ragged_shards`` and ``whalelike plan --even-shards``; the collectives' pricing; a
re-plan keeping the fractions, of a pipeline too; the plan file's round trip, old files and the checks
(fractions not summing, wrong length, under split, without fractions; ragged at ZeRO 3 and in a
pipeline accepted). The measured peaks against these figures: tests/test_zero_memory.py.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import sys
from functools import lru_cache
from pathlib import Path

import pytest
import torch

import planner
import whalelike as wl
from hf_models import gpt2
from planner.balance.replan import rebalance
from planner.devices.cost_model import GIB, CommModel, StageCost, ragged_collectives
from planner.devices.memory import (
    RAGGED_BUCKET_BYTES, REDUCE_SCATTER_COPIES, ZeroShards, fsdp_unit_share, parameter_share, ragged_bucket_bytes,
    ragged_unit, stage_memory, update_bytes,
)
from planner.plan import Plan, PlanError
from planner.shares.batch_shares import proportional_shares
from planner.shares.state_fractions import (
    in_group_order, in_rank_order, is_even, padded_scale, proportional_fractions, ragged_fractions,
)
from synthetic import synthetic_cluster, synthetic_model
from whalelike.cluster import Cluster, Device, Network
from whalelike.errors import SpecError
from whalelike.graphs.capture import capture
from whalelike.graphs.taskgraph import TaskGraphs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import wide_mlp  # noqa: E402

# The clusters here are sized to the memory model's prediction itself: plans fill them to the last byte, with
# no reserve between (Config.memory_reserve; tests/test_memory_reserve.py tests the reserve).
Config = functools.partial(wl.Config, memory_reserve=0.0)

SMALL = ROOT / "examples" / "clusters" / "emulated-4-small-memory.yaml"
SPEEDS = (1.0, 1.0, 0.5, 0.25)
NETWORK = Network(intra_host_gbps=100.0, inter_host_gbps=10.0, latency_us=5.0)


@lru_cache(maxsize=None)
def mlp(blocks: int) -> tuple[TaskGraphs, torch.nn.Module]:
    """examples/wide_mlp.py with ``blocks`` residual blocks, captured (cached per process)."""
    w = wide_mlp.build(blocks=blocks)
    return wl.capture(w.model, w.example_args), w.model


@pytest.fixture(scope="module")
def small() -> Cluster:
    return Cluster.load(SMALL)


@pytest.fixture(scope="module")
def gpt2_model():
    torch.manual_seed(0)
    real = gpt2()
    (ids,), _ = real.make_batch(2, torch.Generator().manual_seed(0))
    return capture(real.model, (ids,)), real.model


def whole(graphs: TaskGraphs) -> StageCost:
    return StageCost.of_layers(graphs, list(range(len(graphs.layers))))


def largest_parameter_share(model: torch.nn.Module) -> float:
    """``u`` of ragged shards measured on the module: its largest parameter's share of its parameter bytes."""
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    return max(sizes) / sum(sizes)


def cluster_of(memories_bytes, speeds=SPEEDS, network: Network = NETWORK) -> Cluster:
    devices = tuple(Device(f"d{i}", f"kind{i}", "h0", peak_tflops=s, memory_gib=m / GIB)
                    for i, (m, s) in enumerate(zip(memories_bytes, speeds)))
    return Cluster("hetero", devices, network)


def even_need(graphs: TaskGraphs, zero: int, samples: int = 1, workers: int = 4) -> float:
    """A worker's bytes under FSDP2's even shards, accumulating over micro-batches (the planner's figure
    before the counts are known)."""
    cost = whole(graphs)
    return stage_memory(cost, 1, zero=ZeroShards(zero, workers, fsdp_unit_share(cost, True))).total(samples)


def buffers(fractions) -> float:
    """``T``: a ragged rank's reduce-scatter buffers per byte of its bucket (planner.devices.memory):
    the input padded to ``n * max(f)``, gloo's copy of it, the rank's segment of the output."""
    n = len(fractions)
    p = n * max(fractions)
    return (1 + REDUCE_SCATTER_COPIES) * p + p / n


# -- the rule ---------------------------------------------------------------------------------------
def test_fractions_are_proportional_to_the_memory_left_and_every_term_is_the_formula(small):
    graphs, model = mlp(16)
    plan = planner.plan(graphs, small, Config(global_batch_size=32))
    (st,) = plan.stages
    assert (st.zero_stage, st.zero_reason, st.replica_sync) == (2, "fit", "ragged")
    fractions = st.state_fractions
    assert len(fractions) == 4 and math.fsum(fractions) == pytest.approx(1.0, abs=1e-12) and min(fractions) >= 0
    # the activations at each worker's speed-proportional micro-batch (one micro-batch fits: 12, 12, 6, 2)
    assert plan.num_micro_batch == 1
    samples = proportional_shares(32, list(SPEEDS), minimum=1)
    assert samples == [12, 12, 6, 2] == [w.batch_share for w in plan.workers]
    cost = whole(graphs)
    u = largest_parameter_share(model)
    assert parameter_share(cost) == pytest.approx(u, rel=1e-12) and u < fsdp_unit_share(cost, True)
    W, G, O = cost.param_bytes, cost.param_bytes, cost.optimizer_bytes
    # what does not shrink with the fraction at ZeRO 2: the full weights, the largest parameter's gradient
    # and its padded buffers (on every rank: n * max(f) times the parameter), the activations; the rest
    # (W + G + O) is divided
    T = buffers(fractions)
    free = [d.memory_gib * GIB - (W + (1 + T) * u * G + stage_memory(cost, 1).term_bytes(b)["activation"])
            for d, b in zip(small.devices, samples)]
    assert fractions == pytest.approx([x / sum(free) for x in free], rel=1e-9)
    assert fractions[0] == fractions[1] > fractions[2] > fractions[3] > 0   # the small devices hold less
    # every device fills the same share of its free memory (the largest uniform slack)
    used = [f * (W + G + O) / x for f, x in zip(fractions, free)]
    assert used == pytest.approx([(W + G + O) / sum(free)] * 4, rel=1e-9) and used[0] < 1
    # each worker's recorded terms are the formulas with its own f
    for w, f in zip(plan.workers, fractions):
        acts = stage_memory(cost, 1).term_bytes(max(w.micro_batch_sizes))["activation"]
        assert w.weights_gib * GIB == pytest.approx((1 + f) * W, rel=1e-12)
        assert w.gradients_gib * GIB == pytest.approx((f + (1 + T) * u) * G, rel=1e-12)
        assert w.optimizer_gib * GIB == pytest.approx(f * O, rel=1e-12)
        assert w.activations_gib * GIB == pytest.approx(acts, rel=1e-12)
        assert w.memory_gib == pytest.approx(w.weights_gib + w.gradients_gib + w.optimizer_gib + w.activations_gib)
        assert w.memory_gib <= w.capacity_gib
    # the function the planner asks gives the same
    found = ragged_fractions(cost, 1, False, 2, [d.memory_gib * GIB for d in small.devices], SPEEDS, 32, 1, 8)
    assert found.fractions == pytest.approx(fractions, rel=1e-12) and found.samples == tuple(samples)
    # the slack also leaves room for the optimizer update's temporaries, priced with what the fractions divide
    # (an upper bound: they come after the backward, when the activations are freed)
    assert found.slack == pytest.approx(1 - (W + G + O + update_bytes(cost)) / sum(free), rel=1e-9)
    summary = plan.summary()
    assert "ZeRO stage 2 (ragged shards by free memory, chosen to fit)" in summary and "state" in summary
    for f in fractions:
        assert f"{f:.1%}" in summary


def test_zero_1_to_3_terms_and_the_formula_with_a_real_gpt2(gpt2_model):
    graphs, model = gpt2_model
    cost = whole(graphs)
    W, G, O = cost.param_bytes, cost.param_bytes, cost.optimizer_bytes
    bucket = ragged_bucket_bytes(cost) / W
    unit, root = ragged_unit(cost, 3, True)
    # ZeRO 3's units are FSDP2's (a block the largest); lm_head's weight is wte's, a tie, which the
    # root unit holds across both uses (planner.devices.cost_model.fsdp_unit_names)
    # (and the position embedding, recomputed in the first block, whose module does not hold it)
    wte = next(l.param_bytes for l in graphs.layers if l.name == "transformer.wte")
    outside = sum(l.outside_param_bytes for l in graphs.layers)
    assert unit == pytest.approx(fsdp_unit_share(cost, True), rel=1e-12)
    assert root == pytest.approx((wte + outside) / W, rel=1e-12) and 0 < root < unit
    for padding in (1.0, 1.6):
        T = (1 + REDUCE_SCATTER_COPIES) * padding + padding / 4
        for f in (0.0, 0.1, 0.7):
            formulas = {   # (weights, gradients, optimizer state) over W, G, O
                (1, False): (1 + f, 1 + T * bucket, f),                          # accumulating: whole gradients
                (1, True): (1 + f, f * (1 - bucket) + (1 + T) * bucket, f),     # one micro-batch per step
                (2, False): (1 + f, f + (1 + T) * largest_parameter_share(model), f),
                (3, False): (f + root + unit, f + root + unit + T * max(unit, root), f),
            }
            for (z, single), (w, g, o) in formulas.items():
                zero = ZeroShards(z, 4, ragged_unit(cost, z, True)[0], share=f, padding=padding, root=root,
                                  single=single)
                memory = stage_memory(cost, 1, zero=zero)
                terms = memory.term_bytes(3)
                assert terms["weight"] == pytest.approx(w * W, rel=1e-12)
                assert terms["gradient"] == pytest.approx(g * G, rel=1e-12)
                assert terms["optimizer"] == pytest.approx(o * O, rel=1e-12)
                assert memory.max_samples(memory.total(3)) == 3
    # at ZeRO 1, accumulating over two micro-batches, what does not shrink is the full weights and
    # gradients and the padded buffers of a bucket: the fractions follow, with T from their own largest
    big = 8 * even_need(graphs, 0)
    capacities = [big, big, big / 2, 0.0]
    capacities[3] = (2 * W + (1 + 3 * 4) * bucket * G + stage_memory(cost, 1).term_bytes(1)["activation"]) * 1.05
    found = ragged_fractions(cost, 1, False, 1, capacities, SPEEDS, 32, 2, 32)
    assert found.micro_batches >= 2
    T = buffers(found.fractions)
    free = [c - 2 * W - T * bucket * G - stage_memory(cost, 1).term_bytes(b)["activation"]
            for c, b in zip(capacities, found.samples)]
    assert found.fractions == pytest.approx([x / sum(free) for x in free], rel=1e-9)
    assert found.free == pytest.approx(free, rel=1e-9)
    # one micro-batch per step holds less (no whole gradients): the same devices fit it at k = 1
    one = ragged_fractions(cost, 1, False, 1, capacities, SPEEDS, 32, 1, 32)
    assert one.micro_batches == 1 and one.samples == tuple(proportional_shares(32, list(SPEEDS), minimum=1))
    T = buffers(one.fractions)
    free = [c - W - (1 + T) * bucket * G - stage_memory(cost, 1).term_bytes(b)["activation"]
            for c, b in zip(capacities, one.samples)]
    assert one.fractions == pytest.approx([x / sum(free) for x in free], rel=1e-9)
    # no fractions fit when a device cannot hold even fraction 0 and the buffers
    assert ragged_fractions(cost, 1, False, 1, capacities[:3] + [W], SPEEDS, 32, 2, 32) is None


def test_the_largest_bucket_is_bounded_from_the_layers():
    # layers in the order they run, as (parameter bytes, largest parameter): buckets of 100 bytes or more
    # in reverse, as runtime.replicas.ragged_sync cuts them
    def cost_of(layers):
        return StageCost(0, 0, float(sum(b for b, _ in layers)), 0, 0, 0, (), param_layers=tuple(layers),
                         max_param_bytes=float(max(t for _, t in layers)))
    # every layer ends a bucket (one parameter each): exact
    assert ragged_bucket_bytes(cost_of([(60, 60), (70, 70), (50, 50)]), cap=100) == 120   # [50 + 70], [60]
    # a layer of 120 bytes (largest parameter 40) after an open 30: the bucket closes inside it, below
    # the cap plus the parameter that closed it (140), though all of it would be 150
    assert ragged_bucket_bytes(cost_of([(120, 40), (30, 30)]), cap=100) == 140
    # without the layers: the cap plus the largest parameter, at most the whole stage
    bare = StageCost(0, 0, 500.0, 0, 0, 0, (), max_param_bytes=80.0)
    assert ragged_bucket_bytes(bare, cap=100) == 180 and ragged_bucket_bytes(bare, cap=1000) == 500
    # the runtime's bucket size is the planner's (the planner does not import the runtime)
    from runtime.replicas.ragged_sync import BUCKET_BYTES
    assert RAGGED_BUCKET_BYTES == BUCKET_BYTES


def test_helpers():
    assert proportional_fractions([3.0, 1.0, -2.0]) == (0.75, 0.25, 0.0)
    assert is_even([0.25] * 4) and not is_even([0.3, 0.2, 0.25, 0.25])
    assert padded_scale([0.5, 0.25, 0.25]) == 1.5 and padded_scale([0.25] * 4) == 1.0
    ranks = {"a": 2, "b": 0, "c": 1}
    assert in_rank_order([0.5, 0.3, 0.2], ["a", "b", "c"], ranks) == [0.3, 0.2, 0.5]
    assert in_group_order([0.3, 0.2, 0.5], ["a", "b", "c"], ranks) == (0.5, 0.3, 0.2)
    T = (1 + REDUCE_SCATTER_COPIES) * 1.0 + 0.25   # even fractions: padding 1
    assert ZeroShards(2, 4, 0.1, share=0.0).fractions() == pytest.approx((1.0, 0.1 * (1 + T), 0.0))
    assert ZeroShards(3, 4, 0.1, share=0.5, root=0.2).fractions() == pytest.approx((0.8, 0.8 + T * 0.2, 0.5))
    for bad in (dict(stage=0, share=0.5), dict(stage=1, share=1.5), dict(stage=1, share=True)):
        with pytest.raises(ValueError, match="ZeroShards.share"):
            ZeroShards(group=4, **bad)
    for bad in (dict(padding=4.5), dict(padding=-1.0), dict(root=1.5)):
        with pytest.raises(ValueError, match=r"ZeroShards.(padding|root) must be in"):
            ZeroShards(1, 4, 0.1, share=0.5, **bad)


# -- the escalation ---------------------------------------------------------------------------------
def test_ragged_fits_where_even_shards_do_not_at_the_same_zero_stage(gpt2_model):
    graphs, _ = mlp(8)   # 8 MiB of parameters: many 1 MiB buckets (the tiny GPT-2 is one: its padded buffer
    big = 8 * even_need(graphs, 0)   # is n * max(f) times the whole model, so ragged ZeRO 1 does not pay there)
    # the last device holds a ZeRO 2 worker's even share, not a ZeRO 1 one's (two micro-batches per step)
    cluster = cluster_of([big, big, big / 2, (even_need(graphs, 2) + even_need(graphs, 1)) / 2])
    two = dict(global_batch_size=32, num_micro_batch=2)
    even = planner.plan(graphs, cluster, Config(**two, ragged_shards=False))
    assert (even.stages[0].zero_stage, even.stages[0].replica_sync, even.stages[0].state_fractions) == (2, "fsdp", [])
    ragged = planner.plan(graphs, cluster, Config(**two))
    st = ragged.stages[0]
    assert (st.zero_stage, st.zero_reason, st.replica_sync) == (1, "fit", "ragged")   # one ZeRO stage lower
    assert st.state_fractions[3] < 0.25 < st.state_fractions[0]
    assert all(w.memory_gib <= w.capacity_gib for w in ragged.workers)
    # asked for ZeRO 1: even shards do not fit it, ragged ones do
    with pytest.raises(PlanError, match=r"under ZeRO stage 1, as asked; a higher ZeRO stage may fit"):
        planner.plan(graphs, cluster, Config(**two, zero_stage=1, ragged_shards=False))
    asked = planner.plan(graphs, cluster, Config(**two, zero_stage=1))
    assert (asked.stages[0].zero_stage, asked.stages[0].zero_reason, asked.stages[0].replica_sync) == \
        (1, "asked", "ragged")
    # a model even ZeRO 3 cannot fit, nor ragged ZeRO 2 (the whole weights): ragged ZeRO 3 holds its rows of
    # everything but the unit it computes (and that unit's padded buffers)
    cost = whole(graphs)
    static3 = stage_memory(cost, 1, zero=ZeroShards(3, 4, fsdp_unit_share(cost, True))).static()
    assert static3 * 0.8 < cost.param_bytes * 1.25
    tight = cluster_of([big, big, big, static3 * 0.8])
    with pytest.raises(PlanError, match=r"under ZeRO stage 3 over 4 workers"):
        planner.plan(graphs, tight, Config(global_batch_size=32, ragged_shards=False))
    beyond = planner.plan(graphs, tight, Config(global_batch_size=32))
    st = beyond.stages[0]
    assert (st.zero_stage, st.zero_reason, st.replica_sync) == (3, "fit", "ragged")
    assert all(w.memory_gib <= w.capacity_gib for w in beyond.workers)
    # each worker's terms are ZeRO 3's formulas with its own f: the unit gathered (u), the root none
    unit, root = ragged_unit(cost, 3, True)
    assert root == 0.0 and unit == pytest.approx(fsdp_unit_share(cost, True))
    T = buffers(st.state_fractions)
    W, G, O = cost.param_bytes, cost.param_bytes, cost.optimizer_bytes
    for w, f in zip(beyond.workers, st.state_fractions):
        assert w.weights_gib * GIB == pytest.approx((f + unit) * W, rel=1e-12)
        assert w.gradients_gib * GIB == pytest.approx((f + unit + T * unit) * G, rel=1e-12)
        assert w.optimizer_gib * GIB == pytest.approx(f * O, rel=1e-12)


def test_largest_wide_mlp_each_trains_on_the_small_memory_cluster(small):
    def planned(blocks: int, ragged: bool) -> str:
        try:
            plan = planner.plan(mlp(blocks)[0], small, Config(global_batch_size=32, ragged_shards=ragged))
        except PlanError:
            return ""
        return f"{plan.stages[0].zero_stage} {plan.stages[0].replica_sync}"

    # even shards: ZeRO 3 up to 15 blocks (3.9M parameters), the 20 MiB device's quarter of everything
    # bounding all four; ragged ZeRO 2 up to 17 blocks (the whole weights on every device), ragged ZeRO 3
    # up to 49 (12.9M parameters, 197 MiB of state with AdamW on 220 MiB of devices: each device its
    # share by its free memory, beyond one gathered block and its padded buffers)
    assert (planned(15, False), planned(16, False)) == ("3 fsdp", "")
    assert (planned(17, True), planned(18, True)) == ("2 ragged", "3 ragged")
    assert (planned(49, True), planned(50, True)) == ("3 ragged", "")
    with pytest.raises(PlanError, match=r"ZeRO stages up to 3 were tried .*with even and with ragged state shards "
                                        r"at ZeRO 1-3"):
        planner.plan(mlp(50)[0], small, Config(global_batch_size=32))


def test_even_shards_where_they_fit_and_when_the_fractions_come_out_even(gpt2_model, small):
    graphs, _ = gpt2_model
    roomy = cluster_of([8 * even_need(graphs, 0, samples=32)] * 4)
    plan = planner.plan(graphs, roomy, Config(global_batch_size=32))
    assert [(st.zero_stage, st.replica_sync, st.state_fractions) for st in plan.stages] == [(0, "ddp", [])]
    # even shards fit ZeRO 2 on the small-memory cluster for 8 blocks: kept, although ragged ones would too
    plan = planner.plan(mlp(8)[0], small, Config(global_batch_size=32, zero_stage=2))
    assert (plan.stages[0].replica_sync, plan.stages[0].state_fractions) == ("fsdp", [])
    # equal devices: equal free memory, equal fractions, so FSDP2's even shards (here ZeRO 2, on links fast
    # enough that recomputing at ZeRO 1 is not predicted faster: tests/test_zero_planning.py's last test)
    fast = Network(intra_host_gbps=10_000.0, inter_host_gbps=10_000.0, latency_us=0.01)
    equal = cluster_of([(even_need(graphs, 2) + even_need(graphs, 1)) / 2] * 4, [1.0] * 4, fast)
    plan = planner.plan(graphs, equal, Config(global_batch_size=32, num_micro_batch=2))
    assert (plan.stages[0].zero_stage, plan.stages[0].replica_sync, plan.stages[0].state_fractions) == (2, "fsdp", [])
    # the planner's pipeline escalation keeps FSDP2's even shards (a plan may say ragged: the last test)
    piped = synthetic_model(num_layers=8, strategies=[wl.replicate(4), wl.replicate(4)], hidden=256, seq=16, heads=4)
    cost = StageCost.of_layers(piped, list(range(4)))
    z0, z1 = (stage_memory(cost, 2, zero=ZeroShards(z, 4, 1.0)) for z in (0, 1))
    cluster = synthetic_cluster([(8, 10.0, (z1.total(1) + z0.static()) / 2 / GIB)])
    plan = planner.plan(piped, cluster, Config(global_batch_size=16, num_micro_batch=2))
    assert [(st.zero_stage, st.replica_sync) for st in plan.stages] == [(1, "fsdp")] * 2


# -- the switches -----------------------------------------------------------------------------------
def test_config_and_cli_switch(capsys, monkeypatch, small, tmp_path):
    assert Config(global_batch_size=8).ragged_shards is True
    with pytest.raises(SpecError, match="Config.ragged_shards"):
        Config(global_batch_size=8, ragged_shards="no")
    from whalelike.cli import main

    graphs, _ = mlp(15)
    monkeypatch.setattr("whalelike.cli.capture_workload", lambda args: graphs)
    for flags, sync, zero in (([], "ragged", 2), (["--even-shards"], "fsdp", 3)):
        out_yaml = tmp_path / f"plan{len(flags)}.yaml"
        code = main(["plan", "wide_mlp.py:build", "--cluster", str(SMALL), "--global-batch", "32",
                     "--memory-reserve", "0", *flags, "-o", str(out_yaml)])
        out, _ = capsys.readouterr()
        assert code == 0 and "memory per device at its peak" in out
        plan = Plan.from_yaml(out_yaml, graphs=graphs, cluster=small)
        assert (plan.stages[0].replica_sync, plan.stages[0].zero_stage) == (sync, zero)
        assert ("ragged shards by free memory" in out) == (sync == "ragged")


# -- pricing and re-plans ---------------------------------------------------------------------------
def test_collectives_one_per_bucket_padded_to_the_largest_share(small):
    # ragged ZeRO 1 (14 blocks): buckets of 1 MiB; ZeRO 2 (16): one per parameter; ZeRO 3 (18): one per unit
    for blocks, zero in ((14, 1), (16, 2), (18, 3)):
        graphs, model = mlp(blocks)
        plan = planner.plan(graphs, small, Config(global_batch_size=32))
        st = plan.stages[0]
        assert (st.zero_stage, st.replica_sync) == (zero, "ragged")
        cost = whole(graphs)
        assert cost.param_tensors == len(list(model.parameters()))
        units = {1: math.ceil(cost.param_bytes / RAGGED_BUCKET_BYTES), 2: cost.param_tensors,
                 3: blocks + 1}[zero]   # ZeRO 3: each block and the head are units
        assert ragged_collectives(cost, zero, True) == units
        k = max(len(w.micro_batch_sizes) for w in plan.workers)
        expected = CommModel(small.network).zero_ms(zero, cost.param_bytes * 4 * max(st.state_fractions), k,
                                                    list(small.devices), units)
        for w in plan.workers:
            assert w.gradient_bytes == 0.0 and w.allreduce_ms == pytest.approx(expected, rel=1e-12) and expected > 0


def test_a_replan_keeps_the_fractions(small):
    graphs, _ = mlp(16)
    plan = planner.plan(graphs, small, Config(global_batch_size=32))
    again = rebalance(plan, graphs, small, [1.0, 0.5, 0.5, 0.25])
    st, old = again.stages[0], plan.stages[0]
    assert (st.replica_sync, st.zero_stage, st.state_fractions) == (old.replica_sync, old.zero_stage, old.state_fractions)
    assert [w.batch_share for w in again.workers] != [w.batch_share for w in plan.workers]
    assert all(w.memory_gib <= w.capacity_gib for w in again.workers)


def test_a_pipeline_with_ragged_stages_is_priced_per_stage_and_kept_by_a_replan():
    # each stage's data-parallel group its own fractions (runtime.replicas.ragged_sync in a pipeline): a
    # plan written so, priced by a re-plan that keeps everything, each worker with its stage's fraction
    # and the stage module as the one unit (ZeRO 3 gathers it whole)
    piped = synthetic_model(num_layers=4, strategies=[wl.replicate(2), wl.replicate(2)], hidden=64, seq=8, heads=4)
    cluster = synthetic_cluster([(4, 10.0, 16)])
    for zero in (1, 2, 3):
        plan = planner.plan(piped, cluster, Config(global_batch_size=8, num_micro_batch=2, zero_stage=zero))
        fractions = [[0.75, 0.25], [0.4, 0.6]]
        plan.stages = [dataclasses.replace(st, replica_sync="ragged", state_fractions=f)
                       for st, f in zip(plan.stages, fractions)]
        plan.validate(graphs=piped, cluster=cluster)
        again = rebalance(plan, piped, cluster, [1.0] * 4)
        assert [(st.zero_stage, st.replica_sync, st.state_fractions) for st in again.stages] == \
            [(zero, "ragged", f) for f in fractions]
        for w in again.workers:
            st = again.stages[w.stage]
            cost = StageCost.of_layers(piped, st.layers)
            group = sorted(v.rank for v in again.stage_workers(w.stage))
            f = st.state_fractions[group.index(w.rank)]
            unit, root = ragged_unit(cost, zero, False)
            assert (unit, root) == ((1.0, 0.0) if zero == 3 else (unit, 0.0))
            zero_shards = ZeroShards(zero, 2, unit, share=f, padding=2 * max(st.state_fractions),
                                     single=len(w.micro_batch_sizes) == 1)
            terms = stage_memory(cost, 2 - w.stage, zero=zero_shards).term_bytes(max(w.micro_batch_sizes))
            assert w.weights_gib * GIB == pytest.approx(terms["weight"], rel=1e-9)
            assert w.gradients_gib * GIB == pytest.approx(terms["gradient"], rel=1e-9)
            assert w.optimizer_gib * GIB == pytest.approx(terms["optimizer"], rel=1e-9)


# -- the plan file ----------------------------------------------------------------------------------
def test_plan_yaml_round_trip_old_files_and_checks(gpt2_model, small, tmp_path):
    graphs, _ = mlp(15)
    plan = planner.plan(graphs, small, Config(global_batch_size=32))
    path = tmp_path / "plan.yaml"
    plan.to_yaml(path)
    loaded = Plan.from_yaml(path, graphs=graphs, cluster=small)
    assert loaded == plan and loaded.stages[0].state_fractions == plan.stages[0].state_fractions
    # a plan file from before ragged shards: no state_fractions, even shards
    old = planner.plan(graphs, small, Config(global_batch_size=32, ragged_shards=False)).to_dict()
    del old["stages"][0]["state_fractions"]
    assert Plan.from_dict(old).stages[0].state_fractions == []
    Plan.from_dict(old).validate(graphs=graphs, cluster=small)
    f = plan.stages[0].state_fractions
    cases = [
        (dict(state_fractions=[0.5, 0.3, 0.1, 0.05]), r"plan.stages\[0\].state_fractions 0.5, 0.3, 0.1, 0.05 sum to "
                                                      r"0.95.*must sum to 1 \(within 1e-09\).*divide each by 0.95"),
        (dict(state_fractions=f[:3]), r"plan.stages\[0\].state_fractions has 3 entries .*; the stage's data-parallel "
                                      r"group has 4 workers \(ranks 0, 1, 2, 3\): give one fraction per worker"),
        (dict(state_fractions=[]), r"plan.stages\[0\].state_fractions is empty with replica_sync 'ragged'"),
        (dict(state_fractions=[1.1, -0.1, 0.0, 0.0]), r"plan.stages\[0\].state_fractions\[1\] must be >= 0"),
        (dict(replica_sync="fsdp"), r"plan.stages\[0\].state_fractions is .* with replica_sync 'fsdp'; state "
                                    r"fractions are ragged shards'.*set state_fractions to \[\]"),
        (dict(zero_stage=0), r"plan.stages\[0\].replica_sync is 'ragged' with zero_stage 0; it must be 'ddp'"),
    ]
    for change, message in cases:
        data = plan.to_dict()
        data["stages"][0].update(change)
        with pytest.raises(PlanError, match=message):
            Plan.from_dict(data).validate()
    even = plan.to_dict()   # even shards by hand: consistent
    even["stages"][0].update(replica_sync="fsdp", state_fractions=[])
    Plan.from_dict(even).validate()
    data = plan.to_dict()
    data["stages"][0].update(replica_sync="ddp", zero_stage=0, zero_reason="none")
    with pytest.raises(PlanError, match=r"replica_sync is 'ddp' with zero_stage 0.*state_fractions"
                                        r"|state_fractions is .* with replica_sync 'ddp'"):
        Plan.from_dict(data).validate()
    ragged3 = plan.to_dict()   # ragged at ZeRO 3 (runtime.replicas.ragged_sync gathers layer by layer)
    ragged3["stages"][0].update(zero_stage=3)
    Plan.from_dict(ragged3).validate()
    # ragged on a pipeline (each stage's group its own fractions) and under split (refused)
    piped = synthetic_model(num_layers=4, strategies=[wl.replicate(2), wl.replicate(2)], hidden=64, seq=8, heads=4)
    data = planner.plan(piped, synthetic_cluster([(4, 10.0, 16)]),
                        Config(global_batch_size=8, num_micro_batch=2, zero_stage=1)).to_dict()
    data["stages"][0].update(replica_sync="ragged", state_fractions=[0.75, 0.25])
    Plan.from_dict(data).validate()
    data["stages"][0].update(state_fractions=[0.75, 0.2])
    with pytest.raises(PlanError, match=r"plan.stages\[0\].state_fractions 0.75, 0.2 sum to"):
        Plan.from_dict(data).validate()
    with wl.replicate(2, zero=1):
        with wl.split(2) as hybrid:
            pass
    nested = synthetic_model(num_layers=2, strategies=[hybrid], hidden=64, seq=8, heads=4)
    data = planner.plan(nested, synthetic_cluster([(4, 10.0, 16)]), Config(global_batch_size=8)).to_dict()
    data["stages"][0].update(replica_sync="ragged", state_fractions=[0.75, 0.25])
    with pytest.raises(PlanError, match=r"replica_sync is 'ragged' on a stage under split\(2\)"):
        Plan.from_dict(data).validate()
