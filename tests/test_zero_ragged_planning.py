"""The planner's side of ragged ZeRO state shards (issue 19, item 3; Cephalo): each data-parallel worker
of a single stage holds a fraction of the sharded state in proportion to the memory it has left.

In process, no spawn: the fractions against the rule (free memory after the activations at the
worker's speed-proportional micro-batch, the full weights and, at ZeRO 1, the full gradients, on
examples/wide_mlp.py and a real ``transformers`` GPT-2); every memory term of a ragged worker against
the formulas (``u`` the largest single parameter's share, measured on the torch module); a model that
fits with ragged shards but not with even ones at the same ZeRO stage, and the largest WideMLP each
trains on ``examples/clusters/emulated-4-small-memory.yaml``; the escalation's choices (even where
even fits, ragged before a higher stage, even fractions kept as FSDP2); ``Config.ragged_shards`` and
``whalelike plan --even-shards``; the collectives' pricing; a re-plan keeping the fractions; the plan
file's round trip, old files and the checks (fractions not summing, wrong length, ragged on a
pipeline or under split, at ZeRO 3, without fractions).
"""
from __future__ import annotations

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
from planner.devices.cost_model import GIB, CommModel, StageCost
from planner.devices.memory import ZeroShards, fsdp_unit_share, parameter_share, stage_memory
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


def cluster_of(memories_bytes, speeds=SPEEDS) -> Cluster:
    devices = tuple(Device(f"d{i}", f"kind{i}", "h0", peak_tflops=s, memory_gib=m / GIB)
                    for i, (m, s) in enumerate(zip(memories_bytes, speeds)))
    return Cluster("hetero", devices, NETWORK)


def even_need(graphs: TaskGraphs, zero: int, samples: int = 1, workers: int = 4) -> float:
    cost = whole(graphs)
    return stage_memory(cost, 1, zero=ZeroShards(zero, workers, fsdp_unit_share(cost, True))).total(samples)


# -- the rule ---------------------------------------------------------------------------------------
def test_fractions_are_proportional_to_the_memory_left_and_every_term_is_the_formula(small):
    graphs, model = mlp(16)
    plan = planner.plan(graphs, small, wl.Config(global_batch_size=32))
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
    # what does not shrink with the fraction at ZeRO 2: the full weights, the largest parameter's gradient,
    # the activations; the rest (W + G + O) is divided
    free = [d.memory_gib * GIB - (W + u * G + stage_memory(cost, 1).term_bytes(b)["activation"])
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
        assert w.gradients_gib * GIB == pytest.approx((f + u) * G, rel=1e-12)
        assert w.optimizer_gib * GIB == pytest.approx(f * O, rel=1e-12)
        assert w.activations_gib * GIB == pytest.approx(acts, rel=1e-12)
        assert w.memory_gib == pytest.approx(w.weights_gib + w.gradients_gib + w.optimizer_gib + w.activations_gib)
        assert w.memory_gib <= w.capacity_gib
    # the function the planner asks gives the same
    found = ragged_fractions(cost, 1, False, 2, [d.memory_gib * GIB for d in small.devices], SPEEDS, 32, 1, 8)
    assert found.fractions == pytest.approx(fractions, rel=1e-12) and found.samples == tuple(samples)
    assert found.slack == pytest.approx(1 - used[0], rel=1e-9)
    summary = plan.summary()
    assert "ZeRO stage 2 (ragged shards by free memory, chosen to fit)" in summary and "state" in summary
    for f in fractions:
        assert f"{f:.1%}" in summary


def test_zero_1_terms_and_the_formula_with_a_real_gpt2(gpt2_model):
    graphs, model = gpt2_model
    cost = whole(graphs)
    W, G, O = cost.param_bytes, cost.param_bytes, cost.optimizer_bytes
    for z, fixed in ((1, (1, 1, 0)), (2, (1, largest_parameter_share(model), 0))):
        for f in (0.0, 0.1, 0.7):
            memory = stage_memory(cost, 1, zero=ZeroShards(z, 4, parameter_share(cost), share=f))
            terms = memory.term_bytes(3)
            assert terms["weight"] == pytest.approx((fixed[0] + f) * W, rel=1e-12)
            assert terms["gradient"] == pytest.approx((fixed[1] + f) * G, rel=1e-12)
            assert terms["optimizer"] == pytest.approx(f * O, rel=1e-12)
            assert memory.max_samples(memory.total(3)) == 3
    # at ZeRO 1 what does not shrink is the full weights and gradients: the fractions follow
    big = 8 * even_need(graphs, 0)
    capacities = [big, big, big / 2, 0.0]
    capacities[3] = (2 * W + stage_memory(cost, 1).term_bytes(1)["activation"]) * 1.05
    found = ragged_fractions(cost, 1, False, 1, capacities, SPEEDS, 32, 1, 32)
    free = [c - 2 * W - stage_memory(cost, 1).term_bytes(b)["activation"] for c, b in zip(capacities, found.samples)]
    assert found.fractions == pytest.approx([x / sum(free) for x in free], rel=1e-9)
    # no fractions fit when a device cannot hold even fraction 0
    assert ragged_fractions(cost, 1, False, 1, capacities[:3] + [W], SPEEDS, 32, 1, 32) is None


def test_helpers():
    assert proportional_fractions([3.0, 1.0, -2.0]) == (0.75, 0.25, 0.0)
    assert is_even([0.25] * 4) and not is_even([0.3, 0.2, 0.25, 0.25])
    assert padded_scale([0.5, 0.25, 0.25]) == 1.5 and padded_scale([0.25] * 4) == 1.0
    ranks = {"a": 2, "b": 0, "c": 1}
    assert in_rank_order([0.5, 0.3, 0.2], ["a", "b", "c"], ranks) == [0.3, 0.2, 0.5]
    assert in_group_order([0.3, 0.2, 0.5], ["a", "b", "c"], ranks) == (0.5, 0.3, 0.2)
    assert ZeroShards(2, 4, 0.1, share=0.0).fractions() == (1.0, 0.1, 0.0)
    for bad in (dict(stage=3, share=0.5), dict(stage=0, share=0.5), dict(stage=1, share=1.5), dict(stage=1, share=True)):
        with pytest.raises(ValueError, match="ZeroShards.share"):
            ZeroShards(group=4, **bad)


# -- the escalation ---------------------------------------------------------------------------------
def test_ragged_fits_where_even_shards_do_not_at_the_same_zero_stage(gpt2_model):
    graphs, _ = gpt2_model
    big = 8 * even_need(graphs, 0)
    # the last device holds a ZeRO 2 worker's even share, not a ZeRO 1 one's
    cluster = cluster_of([big, big, big / 2, (even_need(graphs, 2) + even_need(graphs, 1)) / 2])
    even = planner.plan(graphs, cluster, wl.Config(global_batch_size=32, ragged_shards=False))
    assert (even.stages[0].zero_stage, even.stages[0].replica_sync, even.stages[0].state_fractions) == (2, "fsdp", [])
    ragged = planner.plan(graphs, cluster, wl.Config(global_batch_size=32))
    st = ragged.stages[0]
    assert (st.zero_stage, st.zero_reason, st.replica_sync) == (1, "fit", "ragged")   # one ZeRO stage lower
    assert st.state_fractions[3] < 0.25 < st.state_fractions[0]
    assert all(w.memory_gib <= w.capacity_gib for w in ragged.workers)
    # asked for ZeRO 1: even shards do not fit it, ragged ones do
    with pytest.raises(PlanError, match=r"under ZeRO stage 1, as asked; a higher ZeRO stage may fit"):
        planner.plan(graphs, cluster, wl.Config(global_batch_size=32, zero_stage=1, ragged_shards=False))
    asked = planner.plan(graphs, cluster, wl.Config(global_batch_size=32, zero_stage=1))
    assert (asked.stages[0].zero_stage, asked.stages[0].zero_reason, asked.stages[0].replica_sync) == \
        (1, "asked", "ragged")
    # a model even ZeRO 3 cannot fit: ragged ZeRO 2 holds the weights whole and little of the rest there
    cost = whole(graphs)
    static3 = stage_memory(cost, 1, zero=ZeroShards(3, 4, fsdp_unit_share(cost, True))).static()
    tight = cluster_of([big, big, big, static3 * 0.8])
    with pytest.raises(PlanError, match=r"under ZeRO stage 3 over 4 workers"):
        planner.plan(graphs, tight, wl.Config(global_batch_size=32, ragged_shards=False))
    beyond = planner.plan(graphs, tight, wl.Config(global_batch_size=32))
    assert (beyond.stages[0].zero_stage, beyond.stages[0].replica_sync) == (2, "ragged")
    assert all(w.memory_gib <= w.capacity_gib for w in beyond.workers)


def test_largest_wide_mlp_each_trains_on_the_small_memory_cluster(small):
    def largest(ragged: bool) -> tuple[int, str]:
        fits = (0, "")
        for blocks in range(16, 21):
            try:
                plan = planner.plan(mlp(blocks)[0], small, wl.Config(global_batch_size=32, ragged_shards=ragged))
            except PlanError:
                break
            fits = (blocks, f"{plan.stages[0].zero_stage} {plan.stages[0].replica_sync}")
        return fits

    # even shards: ZeRO 3 up to 16 blocks (4.2M parameters); ragged ZeRO 2 up to 19 (5.0M): the 20 MiB
    # device holds the whole weights (4 bytes per parameter) and ever less of the rest
    assert largest(False) == (16, "3 fsdp")
    assert largest(True) == (19, "2 ragged")
    with pytest.raises(PlanError, match=r"ZeRO stages up to 3 were tried .*with even and with ragged state shards "
                                        r"at ZeRO 1-2"):
        planner.plan(mlp(20)[0], small, wl.Config(global_batch_size=32))


def test_even_shards_where_they_fit_and_when_the_fractions_come_out_even(gpt2_model, small):
    graphs, _ = gpt2_model
    roomy = cluster_of([8 * even_need(graphs, 0, samples=32)] * 4)
    plan = planner.plan(graphs, roomy, wl.Config(global_batch_size=32))
    assert [(st.zero_stage, st.replica_sync, st.state_fractions) for st in plan.stages] == [(0, "ddp", [])]
    # even shards fit ZeRO 2 on the small-memory cluster for 8 blocks: kept, although ragged ones would too
    plan = planner.plan(mlp(8)[0], small, wl.Config(global_batch_size=32, zero_stage=2))
    assert (plan.stages[0].replica_sync, plan.stages[0].state_fractions) == ("fsdp", [])
    # equal devices: equal free memory, equal fractions, so FSDP2's even shards (here ZeRO 2)
    equal = cluster_of([(even_need(graphs, 2) + even_need(graphs, 1)) / 2] * 4, [1.0] * 4)
    plan = planner.plan(graphs, equal, wl.Config(global_batch_size=32))
    assert (plan.stages[0].zero_stage, plan.stages[0].replica_sync, plan.stages[0].state_fractions) == (2, "fsdp", [])
    # a pipeline never runs ragged shards
    piped = synthetic_model(num_layers=8, strategies=[wl.replicate(4), wl.replicate(4)], hidden=256, seq=16, heads=4)
    cost = StageCost.of_layers(piped, list(range(4)))
    z0, z1 = (stage_memory(cost, 2, zero=ZeroShards(z, 4, 1.0)) for z in (0, 1))
    cluster = synthetic_cluster([(8, 10.0, (z1.total(2) + z0.total(2)) / 2 / GIB)])
    plan = planner.plan(piped, cluster, wl.Config(global_batch_size=16, num_micro_batch=2))
    assert [(st.zero_stage, st.replica_sync) for st in plan.stages] == [(1, "fsdp")] * 2


# -- the switches -----------------------------------------------------------------------------------
def test_config_and_cli_switch(capsys, monkeypatch, small, tmp_path):
    assert wl.Config(global_batch_size=8).ragged_shards is True
    with pytest.raises(SpecError, match="Config.ragged_shards"):
        wl.Config(global_batch_size=8, ragged_shards="no")
    from whalelike.cli import main

    graphs, _ = mlp(16)
    monkeypatch.setattr("whalelike.cli.capture_workload", lambda args: graphs)
    for flags, sync, zero in (([], "ragged", 2), (["--even-shards"], "fsdp", 3)):
        out_yaml = tmp_path / f"plan{len(flags)}.yaml"
        code = main(["plan", "wide_mlp.py:build", "--cluster", str(SMALL), "--global-batch", "32", *flags,
                     "-o", str(out_yaml)])
        out, _ = capsys.readouterr()
        assert code == 0 and "memory per device at its peak" in out
        plan = Plan.from_yaml(out_yaml, graphs=graphs, cluster=small)
        assert (plan.stages[0].replica_sync, plan.stages[0].zero_stage) == (sync, zero)
        assert ("ragged shards by free memory" in out) == (sync == "ragged")


# -- pricing and re-plans ---------------------------------------------------------------------------
def test_collectives_one_per_parameter_padded_to_the_largest_share(small):
    graphs, model = mlp(16)
    plan = planner.plan(graphs, small, wl.Config(global_batch_size=32))
    fractions = plan.stages[0].state_fractions
    cost = whole(graphs)
    assert cost.param_tensors == len(list(model.parameters()))
    k = max(len(w.micro_batch_sizes) for w in plan.workers)
    expected = CommModel(small.network).zero_ms(2, cost.param_bytes * 4 * max(fractions), k, list(small.devices),
                                                cost.param_tensors)
    for w in plan.workers:
        assert w.gradient_bytes == 0.0 and w.allreduce_ms == pytest.approx(expected, rel=1e-12) and expected > 0


def test_a_replan_keeps_the_fractions(small):
    graphs, _ = mlp(16)
    plan = planner.plan(graphs, small, wl.Config(global_batch_size=32))
    again = rebalance(plan, graphs, small, [1.0, 0.5, 0.5, 0.25])
    st, old = again.stages[0], plan.stages[0]
    assert (st.replica_sync, st.zero_stage, st.state_fractions) == (old.replica_sync, old.zero_stage, old.state_fractions)
    assert [w.batch_share for w in again.workers] != [w.batch_share for w in plan.workers]
    assert all(w.memory_gib <= w.capacity_gib for w in again.workers)


# -- the plan file ----------------------------------------------------------------------------------
def test_plan_yaml_round_trip_old_files_and_checks(gpt2_model, small, tmp_path):
    graphs, _ = mlp(16)
    plan = planner.plan(graphs, small, wl.Config(global_batch_size=32))
    path = tmp_path / "plan.yaml"
    plan.to_yaml(path)
    loaded = Plan.from_yaml(path, graphs=graphs, cluster=small)
    assert loaded == plan and loaded.stages[0].state_fractions == plan.stages[0].state_fractions
    # a plan file from before ragged shards: no state_fractions, even shards
    old = planner.plan(graphs, small, wl.Config(global_batch_size=32, ragged_shards=False)).to_dict()
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
                        wl.Config(global_batch_size=8, num_micro_batch=2, zero_stage=1)).to_dict()
    data["stages"][0].update(replica_sync="ragged", state_fractions=[0.75, 0.25])
    Plan.from_dict(data).validate()
    data["stages"][0].update(state_fractions=[0.75, 0.2])
    with pytest.raises(PlanError, match=r"plan.stages\[0\].state_fractions 0.75, 0.2 sum to"):
        Plan.from_dict(data).validate()
    with wl.replicate(2, zero=1):
        with wl.split(2) as hybrid:
            pass
    nested = synthetic_model(num_layers=2, strategies=[hybrid], hidden=64, seq=8, heads=4)
    data = planner.plan(nested, synthetic_cluster([(4, 10.0, 16)]), wl.Config(global_batch_size=8)).to_dict()
    data["stages"][0].update(replica_sync="ragged", state_fractions=[0.75, 0.25])
    with pytest.raises(PlanError, match=r"replica_sync is 'ragged' on a stage under split\(2\)"):
        Plan.from_dict(data).validate()
