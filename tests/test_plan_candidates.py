"""The planner never returns a plan its own simulator prices slower than a plan it knows (issue 30,
item 4; :mod:`planner.candidates`), folded layouts included when ``Config.fold_stages`` asks.

A ``transformers`` ResNet of bottleneck blocks annotated as three ``replicate`` regions, one
micro-batch, on ``emulated-4``: the hardware-aware plan was predicted 0.81x the naive one, because the
partitioner shaved the slowest stage by moving a layer from the two fast devices onto a slow one,
which one micro-batch (the stages run one after another) pays in full. The regression test checks
the decision itself (the first stage keeps the layer, the plan beats the naive plan, and the middle
stage the best split leaves only a pooling layer is folded away, issue 36), the rule test checks
that a decision slower than the naive plan is not kept whatever the decision rule did, and the
property test checks the rule over random models and clusters against the naive plan computed on
its own (``planner.naive_plan``) and against every candidate the plan records.
"""
from __future__ import annotations

import dataclasses
import functools

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import planner
import planner.candidates
import planner.decisions
from planner import Plan, PlanError
from dist_utils import run_ranks
from planner.balance.replan import rebalance
from planner.candidates import fold_patterns, idle_stages, plan_fits
from planner.devices.cost_model import GIB, StageCost, device_tflops
from planner.devices.placement_search import best_aware_plan
from planner.partition.stage_layers import StageLayers, foldable_runs
from planner.plan_checks import stage_regions
from synthetic import synthetic_cluster, synthetic_model
from whalelike import Cluster, Config, replicate, split
from whalelike.config import SCHEDULES
from whalelike.graphs.taskgraph import TaskGraphs
from whalelike.strategy import Strategy

TIE = 1 + 1e-9


# -- the ResNet of the issue ------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _resnet_graphs() -> TaskGraphs:
    """ResNetForImageClassification with bottleneck blocks, three stages of one block each, annotated
    as three replicate regions: the embedder with the first stage, the second, the third with the
    classifier (one strategy object per region)."""
    import torch
    from transformers import ResNetConfig, ResNetForImageClassification

    import whalelike as wl

    torch.manual_seed(0)
    model = ResNetForImageClassification(ResNetConfig(layer_type="bottleneck", embedding_size=16,
                                                      hidden_sizes=[16, 32, 64], depths=[1, 1, 1], num_labels=10))
    first, second, third = wl.replicate(), wl.replicate(), wl.replicate()
    wl.annotate(model, {"resnet.embedder": first, "resnet.encoder.stages.0": first,
                        "resnet.encoder.stages.1": second, "resnet.encoder.stages.2": third, "classifier": third})
    return wl.capture(model, (torch.randn(2, 3, 16, 16),))


def test_resnet_of_three_replicate_stages_with_one_micro_batch_beats_the_naive_plan():
    graphs = _resnet_graphs()
    cluster = Cluster.preset("emulated-4")
    config = Config(global_batch_size=16, num_micro_batch=1, sync_batchnorm=True)
    plan = planner.plan(graphs, cluster, config)
    naive = planner.naive_plan(graphs, cluster, config)
    assert plan.naive_prediction == naive.prediction
    # the decision itself: the first stage (the two fastest devices) keeps the first region's layers
    assert plan.stages[0].layers[:2] == list(graphs[0].layers[:2])
    assert plan.prediction.step_time_ms < naive.prediction.step_time_ms / 1.2
    # the best split leaves the middle region's stage only the pooling layer (no FLOPs): the aware plan keeps
    # that region's block on it (issue 36), and the plan with the stage folded into the first is faster
    aware = best_aware_plan(graphs, cluster, config)[1]
    assert [st.kept_work for st in aware.stages] == [None, graphs[1].layers[0], None]
    assert [(c.name, c.fits, c.stages) for c in plan.candidates] == [
        ("aware", True, []), ("naive", True, []), ("folded", True, [[0, 1], [2]])]
    assert plan.chosen == "folded" and plan.stages[0].folded == [0, 1]
    summary = plan.summary()
    assert "predicted speed-up over naive: 1." in summary
    assert f"folded [TaskGraphs 0+1 | 2] {plan.prediction.step_time_ms:.2f} ms (kept)" in summary


# -- the rule, whatever the decisions --------------------------------------------------------------
def _piled_on_the_last_stage(graphs, layout, config, network, in_force=None, quiet=False) -> StageLayers:
    """A decision rule that ignores what the simulator prices: every layer but one per stage on the
    last stage."""
    n, S = len(graphs.layers), layout.num_stages
    return StageLayers([[i] for i in range(S - 1)] + [list(range(S - 1, n))], "greedy", None, True)


def test_a_decision_predicted_slower_than_the_naive_plan_is_not_kept(monkeypatch, tmp_path):
    graphs = synthetic_model(8, [replicate(), replicate()], hidden=256, seq=64, heads=4)
    cluster = synthetic_cluster([(2, 60.0, 40), (2, 20.0, 16)], per_host=4)
    config = Config(global_batch_size=16, num_micro_batch=2)
    monkeypatch.setattr(planner.decisions, "partition_stage_layers", _piled_on_the_last_stage)
    # the rule alone: no search of the devices per stage to make up for the decision rule
    monkeypatch.setattr(planner.candidates, "count_search", lambda graphs, cluster, config, aware, counts=None: aware)
    plan = planner.plan(graphs, cluster, config)
    naive = planner.naive_plan(graphs, cluster, config)
    aware = best_aware_plan(graphs, cluster, config)[0]
    assert aware.step_time_ms > naive.prediction.step_time_ms
    assert plan.chosen == "naive" and plan.prediction == naive.prediction == plan.naive_prediction
    assert [w.micro_batch_sizes for w in plan.workers] == [w.micro_batch_sizes for w in naive.workers]
    assert [(c.name, c.step_time_ms, c.fits) for c in plan.candidates] == [
        ("aware", aware.step_time_ms, True), ("naive", naive.prediction.step_time_ms, True)]
    assert (f"kept the naive plan (capacity-blind decisions): predicted faster than the hardware-aware decisions "
            f"({naive.prediction.step_time_ms:.2f} ms against {aware.step_time_ms:.2f} ms per step)") in plan.summary()
    path = tmp_path / "plan.yaml"
    plan.to_yaml(path)
    assert Plan.from_yaml(path, graphs=graphs, cluster=cluster) == plan


def test_a_plan_that_is_not_the_fastest_candidate_is_refused(tmp_path):
    graphs = synthetic_model(8, [replicate(), replicate()], hidden=256, seq=64, heads=4)
    cluster = synthetic_cluster([(2, 60.0, 40), (2, 20.0, 16)], per_host=4)
    plan = planner.plan(graphs, cluster, Config(global_batch_size=16, num_micro_batch=2))
    assert plan.chosen == "aware" and plan.candidates[1].step_time_ms > plan.prediction.step_time_ms

    def refused(change, says):
        data = plan.to_dict()
        change(data)
        path = tmp_path / "edited.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        with pytest.raises(PlanError, match=says):
            Plan.from_yaml(path, graphs=graphs, cluster=cluster)

    faster = plan.prediction.step_time_ms / 2
    refused(lambda d: d["candidates"][1].update(step_time_ms=faster),
            r"plan.candidates\[1\] \('naive'\) fits and is predicted faster")
    refused(lambda d: d.update(chosen="naive"), r"plan.candidates\[1\].step_time_ms is .* but the plan \('naive'\)")
    refused(lambda d: d["candidates"][0].update(fits=False), r"plan.candidates\[0\] \('aware', the plan chosen\)")
    refused(lambda d: d["candidates"].pop(0), "plan.chosen is 'aware', not one of plan.candidates")
    refused(lambda d: d.update(chosen="best"), "plan.chosen")
    # a naive candidate that does not fit may be faster
    data = plan.to_dict()
    data["candidates"][1].update(step_time_ms=faster, fits=False)
    assert Plan.from_dict(data) == dataclasses.replace(
        plan, candidates=[plan.candidates[0], dataclasses.replace(plan.candidates[1], step_time_ms=faster, fits=False)])
    # a plan file from before the candidates: the hardware-aware plan, nothing recorded
    data = plan.to_dict()
    del data["chosen"], data["candidates"]
    old = Plan.from_dict(data)
    old.validate(graphs=graphs, cluster=cluster)
    assert old.chosen == "aware" and old.candidates == [] and "candidates (" not in old.summary()


# -- the property ----------------------------------------------------------------------------------
@st.composite
def models(draw) -> TaskGraphs:
    """Small models: 2-7 layers of random weight (a heavy stem, a light head, anything between) in
    1-3 regions, mostly plain ``replicate``, sometimes a ``split`` one after the first (which may hold
    the embedding alone, nothing split can cut)."""
    n = draw(st.integers(2, 7))
    regions = draw(st.integers(1, min(3, n)))
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), min_size=regions - 1, max_size=regions - 1)))
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, n])]
    strategies = [replicate()] + [draw(st.sampled_from([replicate(), replicate(), split()])) for _ in range(regions - 1)]
    base = synthetic_model(n, strategies, layers_per_graph=sizes, hidden=draw(st.sampled_from([64, 128, 256])),
                           seq=draw(st.sampled_from([16, 64])), heads=4, vocab=draw(st.sampled_from([0, 3000])))
    work = [draw(st.floats(0.05, 20.0)) for _ in range(n)]
    kept = [draw(st.floats(0.1, 10.0)) for _ in range(n)]
    layers = [dataclasses.replace(l, forward_flops=l.forward_flops * w, backward_flops=l.backward_flops * w,
                                  activation_bytes_per_sample=l.activation_bytes_per_sample * k)
              for l, w, k in zip(base.layers, work, kept)]
    graphs = [dataclasses.replace(
        tg, forward_flops=sum(layers[i].forward_flops for i in tg.layers),
        backward_flops=sum(layers[i].backward_flops for i in tg.layers),
        activation_bytes_per_sample=sum(layers[i].activation_bytes_per_sample for i in tg.layers))
        for tg in base.graphs]
    return dataclasses.replace(base, graphs=graphs, layers=layers)


@st.composite
def clusters(draw) -> Cluster:
    """A preset, or 1-3 kinds of 1-4 devices with random speeds and memories on hosts of 2 or 4."""
    if draw(st.booleans()):
        return Cluster.preset(draw(st.sampled_from(["emulated-4", "emulated-2", "emulated-4-equal"])))
    kinds = [(draw(st.integers(1, 4)), draw(st.sampled_from([5.0, 20.0, 60.0, 125.0])),
              draw(st.sampled_from([1.0, 4.0, 16.0, 40.0]))) for _ in range(draw(st.integers(1, 3)))]
    return synthetic_cluster(kinds, per_host=draw(st.sampled_from([2, 4])))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graphs=models(), cluster=clusters(), micro=st.sampled_from([1, 2, 4]), per_device=st.integers(1, 4),
       schedule=st.sampled_from(SCHEDULES), fold=st.booleans())
def test_the_plan_is_never_predicted_slower_than_a_plan_the_planner_knows(graphs, cluster, micro, per_device, schedule,
                                                                          fold):
    config = Config(global_batch_size=micro * per_device * len(cluster.devices), num_micro_batch=micro,
                    schedule=schedule, fold_stages=fold)
    try:
        plan = planner.plan(graphs, cluster, config)
    except PlanError as e:   # the model does not fit these devices, or the batch is not one they can share
        assert "fit" in str(e) or "batch" in str(e) or "devices" in str(e)
        event("refused")
        return
    event(f"kept {plan.chosen}")
    naive = planner.naive_plan(graphs, cluster, config)
    assert plan.naive_prediction == naive.prediction
    if plan_fits(naive):
        assert plan.prediction.step_time_ms <= naive.prediction.step_time_ms * TIE
    names = [c.name for c in plan.candidates]
    assert names in (["aware", "naive"], ["aware", "naive", "folded"])
    if names[-1] == "folded" and not (fold and fold_patterns(graphs)):
        # folds are planned for a stage the partitioner would leave with nothing to compute (issue 36)
        aware = best_aware_plan(graphs, cluster, config)[1]
        assert idle_stages(aware, graphs) or any(st.kept_work is not None for st in aware.stages)
    # a cluster smaller than the regions ask (issue 35): any candidate may fold, and the plan says so
    assert plan.shared_devices or any(st.folded for st in plan.stages) == (plan.chosen == "folded")
    assert bool(plan.shared_devices) == (graphs.devices_asked > len(cluster.devices))
    assert plan.candidates[1].step_time_ms == naive.prediction.step_time_ms
    assert plan.candidates[1].fits == plan_fits(naive)
    kept = next(c for c in plan.candidates if c.name == plan.chosen)
    for c in plan.candidates:
        if c.fits and not (c.idle_stages and not kept.idle_stages):   # a stage computing nothing loses (issue 36)
            assert plan.prediction.step_time_ms <= c.step_time_ms * TIE
    assert not kept.idle_stages or all(c.idle_stages or not c.fits for c in plan.candidates)
    assert kept.fits and kept.step_time_ms == plan.prediction.step_time_ms
    plan.validate(graphs=graphs, cluster=cluster)


# -- fewer stages: folded replicate regions (Config.fold_stages) -----------------------------------
def test_which_regions_fold_and_how():
    graphs = synthetic_model(6, [replicate(), replicate(), split(), replicate(), replicate(), replicate()])
    assert foldable_runs(graphs) == [[0, 1], [3, 4, 5]]
    assert fold_patterns(graphs) == [[[0, 1], [2], [3, 4, 5]], [[0, 1], [2], [3, 4], [5]], [[0, 1], [2], [3], [4, 5]],
                                     [[0, 1], [2], [3], [4], [5]], [[0], [1], [2], [3, 4, 5]],
                                     [[0], [1], [2], [3, 4], [5]], [[0], [1], [2], [3], [4, 5]]]
    # a fixed device count, other options or a split inside keep a region apart
    apart = synthetic_model(5, [replicate(), replicate(2), replicate(recompute=True), replicate(),
                                Strategy("replicate", None, Strategy("split", 2))])
    assert foldable_runs(apart) == [] and fold_patterns(apart) == []
    # past MAX_FOLDS ways (2 * 2 * 2 * 2 * 2 - 1 = 31 here): each run whole alone, all runs whole, each
    # adjacent pair alone
    many = synthetic_model(8, [replicate()] * 3 + [split()] + [replicate()] * 4)
    ways = fold_patterns(many)
    assert len(ways) == 2 + 1 + 2 + 3 and [[0, 1, 2], [3], [4, 5, 6, 7]] in ways
    assert [[0, 1], [2], [3], [4], [5], [6], [7]] in ways and [[0], [1], [2], [3], [4], [5], [6, 7]] in ways


def test_the_resnet_folded_into_one_stage_is_kept_when_faster(tmp_path):
    graphs = _resnet_graphs()
    cluster = Cluster.preset("emulated-4")
    config = Config(global_batch_size=16, num_micro_batch=1, sync_batchnorm=True, fold_stages=True)
    plan = planner.plan(graphs, cluster, config)
    unfolded = planner.plan(graphs, cluster, dataclasses.replace(config, fold_stages=False))
    assert plan.chosen == "folded" and len(plan.stages) == 1 and plan.stages[0].folded == [0, 1, 2]
    assert plan.stages[0].strategy == "replicate(4)" and plan.naive_prediction == unfolded.naive_prediction
    # without fold_stages only the fold of the stage left with nothing to compute is priced (issue 36)
    assert plan.prediction.step_time_ms < unfolded.prediction.step_time_ms and unfolded.stages[0].folded == [0, 1]
    assert [(c.name, c.stages) for c in plan.candidates] == [("aware", []), ("naive", []), ("folded", [[0, 1, 2]])]
    assert plan.candidates[0].step_time_ms == unfolded.candidates[0].step_time_ms
    summary = plan.summary()
    assert "folded from regions 0+1+2 (one stage on their devices)" in summary
    assert (f"folded [TaskGraphs 0+1+2] {plan.prediction.step_time_ms:.2f} ms (kept)" in summary
            and "kept the plan with replicate regions folded into fewer stages: predicted faster than the "
                "hardware-aware decisions" in summary)
    path = tmp_path / "plan.yaml"
    plan.to_yaml(path)
    assert Plan.from_yaml(path, graphs=graphs, cluster=cluster) == plan
    # a re-plan keeps the fold: the speeds planned with give the same decisions back, a slowed device fewer samples
    speeds = [device_tflops(cluster.device(w.device)) for w in plan.workers]
    again = rebalance(plan, graphs, cluster, speeds)
    assert (again.stages, again.workers, again.prediction) == (plan.stages, plan.workers, plan.prediction)
    assert again.chosen == "folded" and [(c.name, c.stages) for c in again.candidates] == [
        ("folded", [[0, 1, 2]]), ("naive", [[0, 1, 2]])]
    slowed = rebalance(plan, graphs, cluster, [v / 4 if w.rank == 1 else v for w, v in zip(plan.workers, speeds)])
    assert slowed.stages[0].folded == [0, 1, 2] and slowed.workers[1].batch_share < plan.workers[1].batch_share
    slowed.validate(graphs=graphs, cluster=cluster)


def test_a_folded_plan_file_is_checked(tmp_path):
    graphs = synthetic_model(6, [replicate(), replicate(), split()], hidden=256, seq=32, heads=4)
    cluster = synthetic_cluster([(2, 60.0, 40), (4, 20.0, 16)], per_host=4)
    config = Config(global_batch_size=24, num_micro_batch=2)
    prediction, plan = best_aware_plan(graphs, cluster, config, fold=[[0, 1], [2]])
    plan = dataclasses.replace(plan, prediction=prediction)
    assert [st.folded for st in plan.stages] == [[0, 1], []] and stage_regions(plan) == [[0, 1], [2]]
    plan.validate(graphs=graphs, cluster=cluster)

    def refused(change, says):
        data = plan.to_dict()
        change(data)
        with pytest.raises(PlanError, match=says):
            Plan.from_dict(data).validate(graphs=graphs, cluster=cluster)

    refused(lambda d: d["stages"][0].update(folded=[0]), r"plan.stages\[0\].folded is \[0\]: a folded stage stands for two")
    refused(lambda d: d["stages"][1].update(folded=[1, 2]), r"plan.stages\[1\].folded is \[1, 2\]")
    other = synthetic_model(6, [replicate(), replicate(2), split()], hidden=256, seq=32, heads=4)
    with pytest.raises(PlanError, match=r"TaskGraph 1 \(replicate\(2\)\) cannot fold with TaskGraph 0"):
        dataclasses.replace(plan, model_fingerprint=other.fingerprint).validate(graphs=other)
    # a model of four regions whose last two the second stage runs: the folds stand for three
    four = synthetic_model(6, [replicate(), replicate(), split(), split()], layers_per_graph=[2, 2, 1, 1],
                           hidden=256, seq=32, heads=4)
    short = dataclasses.replace(plan, model_fingerprint=four.fingerprint,
                                stages=[plan.stages[0], dataclasses.replace(plan.stages[1], taskgraphs=[2, 3])])
    with pytest.raises(PlanError, match=r"plan.stages stand for TaskGraphs 0..2 \(StagePlan.folded\), the model has 0..3"):
        short.validate(graphs=four)
    # the candidates say which plan this is
    refused(lambda d: d.update(candidates=[{"name": "aware", "step_time_ms": prediction.step_time_ms}]),
            r"plan.chosen is 'aware' but stage\(s\) \[0\] are folded")
    refused(lambda d: d.update(chosen="naive", candidates=[{"name": "naive", "step_time_ms": prediction.step_time_ms}]),
            r"plan.candidates\[0\].stages is \[\] but the plan's stages stand for TaskGraphs \[\[0, 1\], \[2\]\]")
    refused(lambda d: d.update(chosen="folded", candidates=[{"name": "folded", "step_time_ms": prediction.step_time_ms,
                                                              "stages": [[0], [1, 2]]}]),
            r"plan.candidates\[0\].stages is \[\[0\], \[1, 2\]\] but the plan's stages stand for TaskGraphs")


def _folded_rank(rank: int, world_size: int, plans: dict[str, Plan]) -> dict:
    """Each folded plan trains like one process (each step's loss and the final state), with AdamW
    (normalised updates: a wrong gradient scale shows in the parameters too)."""
    import torch.nn.functional as F

    from reference import OPTIMIZERS, assert_engine_trains_like_reference

    out = {}
    for label, plan in plans.items():
        _, got, _ = assert_engine_trains_like_reference(_mlp(), plan, _mlp_batches(), OPTIMIZERS["adamw"],
                                                        F.cross_entropy, Cluster.preset("emulated-4").without_emulation(),
                                                        label)
        out[label] = [float(v) for v in got]
    return out


def _mlp():
    """Three replicate regions of an MLP (float64), seeded."""
    import torch
    import torch.nn as nn

    import whalelike as wl

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 8))
    wl.annotate(model, {"0-1": wl.replicate(), "2-3": wl.replicate(), "4-6": wl.replicate()})
    return model.double()


def _mlp_batches(steps: int = 2):
    import torch

    g = torch.Generator().manual_seed(1)
    return [((torch.randn(12, 16, generator=g, dtype=torch.float64),), torch.randint(0, 8, (12,), generator=g))
            for _ in range(steps)]


def test_folded_plans_train_like_one_process():
    """The runtime runs a folded plan as any plan: one data-parallel stage of the three regions (with
    uneven shares), and two stages of which the first folds two regions (layers moved across the
    fold's boundary), on four ranks. The planner keeps a fold here with one micro-batch."""
    import whalelike as wl

    graphs = wl.capture(_mlp(), _mlp_batches(1)[0][0])
    cluster = Cluster.preset("emulated-4").without_emulation()
    kept = planner.plan(graphs, cluster, Config(global_batch_size=12, num_micro_batch=1, fold_stages=True))
    assert kept.chosen == "folded" and any(st.folded for st in kept.stages)
    prediction, one = best_aware_plan(graphs, cluster, Config(global_batch_size=12, num_micro_batch=1),
                                      fold=[[0, 1, 2]])
    assert [st.folded for st in one.stages] == [[0, 1, 2]] and len({w.batch_share for w in one.workers}) > 1
    one = dataclasses.replace(one, prediction=prediction)
    prediction, two = best_aware_plan(graphs, cluster, Config(global_batch_size=12, num_micro_batch=2),
                                      fold=[[0, 1], [2]])
    assert [st.folded for st in two.stages] == [[0, 1], []] and two.stages[0].layers != list(graphs[0].layers)
    plans = {"one stage": one, "two stages": dataclasses.replace(two, prediction=prediction)}
    results = run_ranks(_folded_rank, 4, args=(plans,), init_process_group=False, timeout_s=300)
    assert all(r == results[0] for r in results) and len(results[0]) == 2


def test_planning_from_a_profile_keeps_the_rule_with_folds():
    from test_plan_from_profile import emulated_profile

    graphs = synthetic_model(6, [replicate(), replicate(), replicate()], hidden=64, seq=8, heads=4)
    cluster = Cluster.preset("emulated-equal-peak")
    config = Config(global_batch_size=32, num_micro_batch=2, fold_stages=True)
    plan = planner.plan(graphs, cluster, config, profile=emulated_profile(graphs, cluster))
    assert plan.speeds == "profile" and [c.name for c in plan.candidates] == ["aware", "naive", "folded"]
    kept = next(c for c in plan.candidates if c.name == plan.chosen)
    assert all(plan.prediction.step_time_ms <= c.step_time_ms * TIE for c in plan.candidates if c.fits)
    assert kept.step_time_ms == plan.prediction.step_time_ms
    plan.validate(graphs=graphs, cluster=cluster)


# -- no stage with nothing to compute (issue 36, item 2) ---------------------------------------------
@functools.lru_cache(maxsize=1)
def _llama_two_replicate_regions() -> TaskGraphs:
    """A ``transformers`` Llama annotated by path as the issue's user did: the blocks in two
    ``replicate()`` regions, ``lm_head`` under ``split()``; the final norm joins the second region."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import whalelike as wl

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         use_cache=False, tie_word_embeddings=False))
    wl.annotate(model, {"model.layers.0-1": wl.replicate(), "model.layers.2-3": wl.replicate(), "lm_head": wl.split()})
    return wl.capture(model, (torch.randint(0, 4096, (2, 64)),))


def _stage_flops(graphs: TaskGraphs, plan: Plan) -> list[float]:
    return [sum(graphs.layers[i].forward_flops + graphs.layers[i].backward_flops for i in st.layers) for st in plan.stages]


def test_a_stage_the_best_split_leaves_without_compute_keeps_a_layer_and_its_fold_is_priced(tmp_path):
    """On lab-mixed at 16 micro-batches the best split runs both block regions on the A100s and
    leaves the second stage (three V100s and the 3090) only the final norm. The stage keeps one of its
    blocks (every device computes), the plan says so, and the plan with that stage folded into its
    neighbour is priced next to it."""
    graphs = _llama_two_replicate_regions()
    cluster = Cluster.load("examples/clusters/lab-mixed.yaml")
    config = Config(global_batch_size=64, num_micro_batch=16, precision="fp16")
    plan = planner.plan(graphs, cluster, config)
    assert all(f > 0 for f in _stage_flops(graphs, plan)), [st.layers for st in plan.stages]
    kept = [st for st in plan.stages if st.kept_work is not None]
    assert [st.index for st in kept] == [1]
    assert kept[0].kept_work in kept[0].layers and kept[0].kept_work in graphs[1].layers
    # without the kept layer the split is the one that leaves the stage nothing: the layer was the only one moved back
    assert plan.stages[0].layers == sorted([*graphs[0].layers, *(i for i in graphs[1].layers if i < kept[0].kept_work)])
    assert [c.name for c in plan.candidates] == ["aware", "naive", "folded"]
    assert plan.candidates[2].stages == [[0, 1], [2]] and not any(c.idle_stages for c in plan.candidates)
    assert "keeps layer" in plan.summary(cluster)
    path = tmp_path / "plan.yaml"
    plan.to_yaml(path)
    again = Plan.from_yaml(path)
    assert [st.kept_work for st in again.stages] == [st.kept_work for st in plan.stages]
    again.validate(graphs=graphs, cluster=cluster)


def test_a_candidate_with_an_idle_stage_loses_to_one_that_fits_without_one():
    """``keep_fastest``'s rule, and the checker's: a faster candidate whose stage computes nothing is
    not kept while another fits, and a plan file that kept the slower one is valid; one that kept
    a slower candidate with no idle stage over a faster one with none is refused."""
    from planner.candidates import Priced, keep_fastest
    from planner.plan_record import CandidatePlan

    graphs = _llama_two_replicate_regions()
    cluster = Cluster.load("examples/clusters/lab-mixed.yaml")
    plan = planner.plan(graphs, cluster, Config(global_batch_size=64, num_micro_batch=16, precision="fp16"))
    stages = [dataclasses.replace(st, layers=list(st.layers)) for st in plan.stages]
    # the idle variant: stage 1 holds the final norm alone, stage 0 every block
    norm = stages[1].layers[-1]
    stages[0].layers = sorted(stages[0].layers + stages[1].layers[:-1])
    stages[1].layers = [norm]
    idle = dataclasses.replace(plan, stages=stages, prediction=dataclasses.replace(
        plan.prediction, step_time_ms=plan.prediction.step_time_ms / 2))
    assert idle_stages(idle, graphs) == [1] and idle_stages(plan, graphs) == []
    kept = keep_fastest([Priced("aware", idle), Priced("naive", plan)], plan.prediction, graphs)
    assert kept.chosen == "naive" and kept.candidates[0].idle_stages == [1] and kept.candidates[1].idle_stages == []
    assert keep_fastest([Priced("aware", idle), Priced("naive", plan)], plan.prediction).chosen == "aware"
    with_candidates = dataclasses.replace(plan, chosen="naive", candidates=[
        CandidatePlan("aware", plan.prediction.step_time_ms / 2, True, [], [1]),
        CandidatePlan("naive", plan.prediction.step_time_ms, True)])
    with_candidates.validate(graphs=graphs, cluster=cluster)
    refused = dataclasses.replace(with_candidates, candidates=[
        CandidatePlan("aware", plan.prediction.step_time_ms / 2, True),
        CandidatePlan("naive", plan.prediction.step_time_ms, True)])
    with pytest.raises(PlanError, match="predicted faster"):
        refused.validate(graphs=graphs, cluster=cluster)


def test_regrouped_stages_keep_fixed_counts_and_deal_the_rest_by_work():
    """``regrouped_shapes``: a region of one keeps its counts, a run of several is one data-parallel
    stage (the sum of fixed counts, or an automatic count); the spare devices go by work."""
    from planner.devices.placement import regrouped_shapes

    graphs = synthetic_model(5, [replicate(), replicate(), split()], layers_per_graph=[2, 2, 1])
    shapes, replicas = regrouped_shapes(graphs, [[0, 1], [2]], 9)
    assert replicas == 1 and [s.folded for s in shapes] == [(0, 1), ()]
    assert sum(s.devices for s in shapes) == 9 and shapes[1].tp == shapes[1].devices
    fixed = synthetic_model(5, [replicate(2), replicate(3), split(2)], layers_per_graph=[2, 2, 1])
    shapes, replicas = regrouped_shapes(fixed, [[0, 1], [2]], 7)
    assert [(s.dp, s.tp) for s in shapes] == [(5, 1), (1, 2)] and replicas == 1


# -- devices per stage and micro-batches searched (issue 36, items 4 and 5) ------------------------------
def test_devices_per_automatic_stage_are_searched_on_unequal_devices():
    """Four fast and eight slow devices, three automatic regions: the split by work (4, 6, 2) puts slow
    devices beside fast ones and starves the split head; the count search moves devices between the
    stages while the simulator says the step gets shorter, and every stage still computes."""
    from planner.candidates import count_search
    from planner.devices.placement import stage_shapes

    graphs = synthetic_model(12, [replicate(), replicate(), split()], layers_per_graph=[5, 6, 1], hidden=1024, seq=128,
                             heads=8, vocab=8000)
    cluster = synthetic_cluster([(4, 125.0, 40), (8, 20.0, 16)], per_host=4)
    config = Config(global_batch_size=64, num_micro_batch=8)
    by_work = [sh.devices for sh in stage_shapes(graphs, 12)[0]]
    prediction, split_by_work = best_aware_plan(graphs, cluster, config)
    plan = planner.plan(graphs, cluster, config)
    counts = [len(plan.stage_workers(st.index)) for st in plan.stages]
    assert by_work == [4, 6, 2] and counts != by_work and sum(counts) == 12
    assert plan.chosen == "aware" and plan.prediction.step_time_ms < prediction.step_time_ms / 1.2
    assert all(f > 0 for f in _stage_flops(graphs, plan))
    plan.validate(graphs=graphs, cluster=cluster)
    # one device kind: the split by work is the split by time, nothing is searched
    equal = synthetic_cluster([(12, 125.0, 40)], per_host=4)
    aware = dataclasses.replace(best_aware_plan(graphs, equal, config)[1], prediction=prediction)
    assert count_search(graphs, equal, config, aware) is aware


def test_a_split_by_work_that_fits_nowhere_starts_the_count_search_where_it_fits(caplog):
    """Four large fast devices and eight small slow ones, three automatic regions: the split by work
    (4, 6, 2) puts half the layers on six small devices, which fits no placement, at any ZeRO stage or
    recompute (before, the plan was refused). The nearest device counts that fit start the count
    search, and the plan fits with every stage computing (issue 36: 7B Llama on 4 A100s and 8 T4s)."""
    graphs = synthetic_model(12, [replicate(), replicate(), split()], layers_per_graph=[5, 6, 1], hidden=1024, seq=128,
                             heads=8, vocab=8000)
    cluster = synthetic_cluster([(4, 125.0, 40), (8, 20.0, 0.2)], per_host=4)
    config = Config(global_batch_size=64, num_micro_batch=8)
    with pytest.raises(PlanError, match="does not fit"):
        best_aware_plan(graphs, cluster, config)
    with caplog.at_level("INFO", logger="planner.candidates"):
        plan = planner.plan(graphs, cluster, config)
    assert "the split by work (devices per automatic stage {0: 4, 1: 6, 2: 2}) fits no placement" in caplog.text
    counts = [len(plan.stage_workers(st.index)) for st in plan.stages]
    assert counts != [4, 6, 2] and sum(counts) == 12 and plan.chosen == "aware" and plan_fits(plan)
    assert all(f > 0 for f in _stage_flops(graphs, plan))
    plan.validate(graphs=graphs, cluster=cluster)
    # the counts tried: every other way of dealing the devices, nearest first, bounded
    from planner.candidates import MAX_FIT_TRIALS, nearest_counts
    ways = nearest_counts({0: 4, 1: 6, 2: 2})
    assert ways[0] in ({0: 3, 1: 7, 2: 2}, {0: 3, 1: 6, 2: 3}, {0: 4, 1: 5, 2: 3}, {0: 4, 1: 7, 2: 1},
                       {0: 5, 1: 5, 2: 2}, {0: 5, 1: 6, 2: 1})
    assert len(ways) == min(MAX_FIT_TRIALS, 55 - 1) and {0: 4, 1: 6, 2: 2} not in ways
    assert all(sum(w.values()) == 12 and min(w.values()) >= 1 for w in ways)


def test_no_split_at_the_asked_micro_batches_searches_more_of_them(caplog):
    """Two regions on four small-memory devices: at two micro-batches no split of the layers fits, and
    the TaskGraph boundaries need four. The planner partitions the layers for the count the stages need
    (the cut points searched with the count, instead of the boundaries kept), then plans that count and
    larger ones in full and keeps the fastest: no slower than the plan asked at the count it kept."""
    graphs = synthetic_model(8, [replicate(), replicate()], hidden=256, seq=32)
    cost = StageCost.of_layers(graphs, range(4))
    cluster = synthetic_cluster([(4, 10.0, (cost.static_bytes + 6 * cost.bytes_per_sample(2)) / GIB)])
    with caplog.at_level("WARNING", logger="planner.decisions"):
        plan = planner.plan(graphs, cluster, Config(global_batch_size=32, num_micro_batch=2))
    assert "no split of the layers fits the micro-batches asked; at 4 micro-batches" in caplog.text
    assert plan.num_micro_batch >= 4
    asked = planner.plan(graphs, cluster, Config(global_batch_size=32, num_micro_batch=plan.num_micro_batch))
    assert plan.prediction.step_time_ms <= asked.prediction.step_time_ms * TIE
    plan.validate(graphs=graphs, cluster=cluster)
