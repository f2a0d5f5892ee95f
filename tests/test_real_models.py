"""Real ``transformers`` models end to end: captured with exact costs, planned onto the emulated
4-device cluster, and trained on 4 gloo ranks exactly like a single process.

The models (``tests/hf_models.py``) are the library's own classes from small configs: GPT-2 (tied
input/output embeddings, ``Conv1D``), BERT, ViT and a Llama-style decoder (grouped-query attention,
SwiGLU, rotary embeddings), plus a ResNet with BatchNorm for capture (its training with
synchronised statistics is in ``test_batchnorm.py``). The transformers have two blocks here
(``LAYERS``; the tensor-parallel tests use four), each annotated by module path as one of the two
pipeline regions; everything else (embeddings, final norms, poolers, heads) is un-annotated and
must join a neighbouring region, never form a stage of its own. Each model is built and captured
once per test process (:func:`_captured`), for the capture tests and for the plans alike.

Capture: the forward FLOPs of the default model (fused ``scaled_dot_product_attention``) must equal
``FlopCounterMode`` on the same model switched to explicit matmul attention (``eager``), and the
parameter count must be exact. Training: the plan is made from the *float32* model, as a user
plans once; training runs the same model cast to float64 (item 6: plans survive a dtype cast;
float64 so AdamW's normalised updates compare tightly, see ``test_examples_train.py``).

Values without a batch dimension crossing a stage boundary (issue 30, item 2; the models are in
``tests/unbatched_models.py``, trained in the same spawn of ranks): DeBERTa-v2 annotated by path
(two ``replicate`` layers and a ``split`` classifier) and a fx-traced position table, whose
batch-less values depend on constants, parameters and shapes only and are recomputed in every
layer that reads them; and a statistic of the batch (with a parameter scaled by it) on two workers a
stage, which crosses whole once per micro-batch, priced by the planner's boundary traffic, its
simulator and its memory model. Each rank plans these from its float64 capture, which its Engine
then finds in the capture cache (DeBERTa's ``torch.export`` trace is the costly part; the test
process does not capture it a third time), and trains them with SGD with momentum alone: its
update is the gradient itself, so a missing or doubled share of a batch-less value's gradient
(summed on the owner slot, zero on the others) changes the parameters.

The ranks' warm-up (dist_utils' ``warm``) captures each model once for all ranks, in float64 on its
first training batch: every rank's capture is then a cache hit.
"""
from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
from unittest import mock
import torch
from torch.utils.flop_counter import FlopCounterMode

import planner
import planner.candidates
import whalelike as wl
from dist_utils import run_ranks
import unbatched_models
from hf_models import ALL, TRANSFORMERS, build
from planner.devices.cost_model import StageCost
from planner.devices.memory import stage_memory
from planner.devices.network import NetworkModel
from planner.plan import Plan
from planner.resharding.spec import unbatched_rows
from planner.schedule.boundary_traffic import BACKWARD, FORWARD, plan_traffic
from reference import OPTIMIZERS, assert_engine_trains_like_reference, warm_capture
from whalelike.cluster import Cluster

pytest.importorskip("transformers")  # a pinned test dependency (pyproject [dev]); never skipped in CI

GLOBAL_BATCH, MICRO_BATCHES, STEPS = 8, 2, 3
LAYERS = 2   # transformer blocks: one per pipeline region (depth adds nothing the test checks, and costs capture time)


def _cluster() -> Cluster:
    return Cluster.preset("emulated-4").without_emulation()


def _to(inputs: tuple, dtype: torch.dtype) -> tuple:
    return tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)


def _build(name: str, dtype: torch.dtype = torch.float32):
    """A model of ``hf_models`` (``LAYERS`` blocks) or of ``unbatched_models``, annotated."""
    if name in unbatched_models.MODELS:
        return unbatched_models.build(name, dtype=dtype)
    return build(name, dtype=dtype, layers=LAYERS)


def _config() -> wl.Config:
    return wl.Config(global_batch_size=GLOBAL_BATCH, num_micro_batch=MICRO_BATCHES)


@functools.lru_cache(maxsize=None)
def _captured(name: str):
    """The float32 model, its example batch of 4 and its capture, once per test process (nothing
    here changes the model or the graphs: the eager-attention checks run on copies)."""
    real = _build(name)
    inputs, _ = real.make_batch(4, torch.Generator().manual_seed(0))
    return real, inputs, wl.capture(real.model, inputs)


@functools.lru_cache(maxsize=None)
def _planned(name: str):
    """The plan of :func:`_captured`'s model on the emulated 4-device cluster."""
    return planner.plan(_captured(name)[2], _cluster(), _config())


def _recomputed(graphs, plan, table: str) -> dict:
    """What crosses ``plan``'s boundaries of a model whose batch-less values depend on no input
    value, and where the parameter ``table`` they read is read: every boundary tensor batched,
    nothing sent whole, and one reading node in each of the two blocks' TaskGraphs, on stages 0
    and 1 (the stage of the second block holds the parameter too)."""
    layer_of = {n: layer.index for layer in graphs.layers for n in layer.nodes}
    stage_of = {i: st.index for st in plan.stages for i in st.layers}
    readers = [layer_of[n.name] for n in graphs.graph_module.graph.nodes if n.op == "get_attr" and n.target == table]
    return {"batched": [t.batched for b in graphs.boundaries for t in b.tensors],
            "cut_unbatched": [layer.cut_bytes_unbatched for layer in graphs.layers],
            "unbatched_bytes": [b.unbatched_bytes for b in plan.boundaries],
            "taskgraphs": sorted(graphs.layers[i].taskgraph for i in readers),
            "stages": sorted(stage_of[i] for i in readers)}


def _assert_recomputed(facts: dict, label: str) -> None:
    assert all(facts["batched"]) and not any(facts["cut_unbatched"]), (label, facts)
    assert facts["unbatched_bytes"] == [0.0] * len(facts["unbatched_bytes"]), (label, facts)
    assert facts["taskgraphs"] == facts["stages"] == [0, 1], (label, facts)


@pytest.mark.parametrize("name", sorted(ALL))
def test_capture_costs_match_matmul_attention_and_unannotated_code_joins_a_region(name):
    real, inputs, graphs = _captured(name)
    eager = copy.deepcopy(real.model)
    eager.set_attn_implementation("eager")
    counter = FlopCounterMode(display=False)
    with counter:
        eager(*inputs)
    assert sum(tg.forward_flops for tg in graphs) * 4 == pytest.approx(counter.get_total_flops(), rel=0.01)
    assert sum(tg.param_count for tg in graphs) == sum(p.numel() for p in real.model.parameters())
    # two annotated regions, two TaskGraphs: embeddings, norms, poolers and heads joined them
    assert [str(tg.strategy) for tg in graphs] == ["replicate(auto)", "replicate(auto)"]
    # what crosses between them is the hidden state only (masks, position ids, rotary tables are recomputed)
    (boundary,) = graphs.boundaries
    assert [t.batched for t in boundary.tensors] == [True]


def test_fused_attention_flops_are_counted():
    """FlopCounterMode's own table misses the CPU fused-attention kernels, so counting the default
    model directly comes out low; the capture adds them and matches explicit matmul attention exactly."""
    real, inputs, graphs = _captured("bert")
    fused, matmul = FlopCounterMode(display=False), FlopCounterMode(display=False)
    with fused:
        real.model(*inputs)
    eager = copy.deepcopy(real.model)
    eager.set_attn_implementation("eager")
    with matmul:
        eager(*inputs)
    assert fused.get_total_flops() < matmul.get_total_flops()
    assert sum(tg.forward_flops for tg in graphs) * 4 == pytest.approx(matmul.get_total_flops(), rel=1e-9)


def _data(real) -> list:
    gen = torch.Generator().manual_seed(1)
    return [(_to(inputs, torch.float64), targets)
            for inputs, targets in (real.make_batch(GLOBAL_BATCH, gen) for _ in range(STEPS))]


def _ranks(rank: int, world_size: int, plans: dict, unbatched: tuple = ()) -> dict:
    shapes = {}
    for name, plan in plans.items():
        real = _build(name.split("/")[0], dtype=torch.float64)
        data = _data(real)
        for opt, make_opt in OPTIMIZERS.items():
            engine, _, _ = assert_engine_trains_like_reference(real.model, plan, data, make_opt, real.loss_fn,
                                                               _cluster(), f"{name}/{opt}")
        shapes[name] = engine.worker.stage
        if name.endswith("/zero3"):   # each stage cut into its layers, each an FSDP unit (stage_units)
            shapes[name + " units"] = len(engine.executor.stage_worker.units)
    for name in unbatched:   # planned here (module docstring), on the first batch the Engine captures too
        real = _build(name, dtype=torch.float64)
        data = _data(real)
        graphs = wl.capture(real.model, data[0][0])
        # each block on a stage of its own, so the table is read on two stages (the devices per stage kept
        # as split by work: searched, both blocks run on a first stage of two devices)
        with mock.patch.object(planner.candidates, "count_search", lambda graphs, cluster, config, aware, counts=None: aware):
            plan = planner.plan(graphs, _cluster(), _config())
        engine, _, _ = assert_engine_trains_like_reference(real.model, plan, data, OPTIMIZERS["sgd"], real.loss_fn,
                                                           _cluster(), f"{name}/sgd")
        shapes[name] = {"plan": plan.to_dict(), "stage": engine.worker.stage,
                        "recomputed": _recomputed(graphs, plan, "deberta.encoder.rel_embeddings.weight")
                        if name == "deberta" else None}
    return shapes


def _warm() -> None:
    """Each model's float64 capture on its first training batch, once, before the ranks fork
    (dist_utils' ``warm``): the ranks' own captures (their Engines', their plans') are cache hits."""
    for name in (*sorted(TRANSFORMERS), *unbatched_models.MODELS):
        real = _build(name, dtype=torch.float64)
        warm_capture(real.model, _data(real)[0][0])


def test_transformers_train_exactly_under_their_plans():
    """The transformers, and the models whose boundary values have no batch dimension (issue 30
    item 2: before, every rank of those failed to split the model, StageSplitError "has no batch
    dimension 0"), in one spawn of ranks. DeBERTa's capture, made in the ranks, recomputes its
    relative positions and normalised relative embeddings in both layers: nothing crosses whole."""
    plans = {}
    for name in sorted(TRANSFORMERS):
        plans[name] = _planned(name)   # from the float32 capture: the plan is made once, training casts the model
        assert len(plans[name].stages) >= 2, plans[name].summary()
    # Llama's pipeline at ZeRO 3 recomputing: every stage of two workers cut into its layers, each an FSDP
    # unit gathered one at a time, each layer checkpointed inside its unit
    plans["llama/zero3"] = planner.plan(_captured("llama")[2], _cluster(),
                                        dataclasses.replace(_config(), zero_stage=3))
    plans["llama/zero3"].stages = [dataclasses.replace(st, recompute=True, recompute_reason="fit")
                                   for st in plans["llama/zero3"].stages]
    assert all(st.zero_stage == 3 for st in plans["llama/zero3"].stages if len(plans["llama/zero3"].stage_workers(st.index)) > 1)
    unbatched = tuple(unbatched_models.MODELS)
    stages = run_ranks(_ranks, 4, args=(plans, unbatched), init_process_group=False, timeout_s=600, warm=_warm)
    for name, plan in plans.items():
        assert [s[name] for s in stages] == [w.stage for w in plan.workers]
    assert max(s["llama/zero3 units"] for s in stages) > 1
    for name in unbatched:
        plan = Plan.from_dict(stages[0][name]["plan"])
        assert len(plan.stages) >= 2 and all(s[name]["plan"] == stages[0][name]["plan"] for s in stages), name
        assert [s[name]["stage"] for s in stages] == [w.stage for w in plan.workers], name
    assert [s["statistic"]["plan"]["boundaries"][0]["unbatched_bytes"] for s in stages] == [8 + 32 * 8] * 4   # float64
    _assert_recomputed(stages[0]["deberta"]["recomputed"], "deberta")


def test_a_model_returning_its_key_value_cache_gets_the_fix_named():
    from transformers import GPT2Config, GPT2LMHeadModel
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=16,
                                       bos_token_id=0, eos_token_id=0))   # use_cache defaults to True
    with pytest.raises(wl.CaptureError, match="use_cache=False") as error:
        wl.capture(model, (torch.randint(0, 64, (2, 8)),))
    assert "\n" not in str(error.value)


def test_a_stage_holding_a_tied_copy_counts_its_memory():
    """GPT-2's lm_head owns no parameter (it reads transformer.wte.weight), but the stage that
    holds it holds a copy of that matrix, its gradient and its optimizer state."""
    from planner.devices.cost_model import StageCost

    real, _, graphs = _captured("gpt2")
    head = next(l for l in graphs.layers if l.name == "lm_head")
    wte = real.model.transformer.wte.weight
    assert head.param_bytes == 0
    assert head.borrowed_params == ((0, "transformer.wte.weight", wte.numel() * wte.element_size()),)
    alone, whole = StageCost.of_layers(graphs, [head.index]), StageCost.of_layers(graphs, range(len(graphs.layers)))
    assert alone.param_bytes == wte.numel() * wte.element_size()
    assert alone.static_bytes == 4 * alone.param_bytes          # weights, gradients, AdamW's two moments
    assert whole.param_bytes == sum(p.numel() * p.element_size() for p in real.model.parameters())


def test_batchless_values_of_parameters_and_shapes_are_recomputed_where_read():
    """The position table (a parameter cut to ``x.size(1)`` and normalised, in an fx trace) is
    computed once in the model and read by both blocks: capture copies it into each block (its
    FLOPs are the reading layer's) and drops the table's own layer, left empty, so only batched
    values cross and the plan sends nothing whole. DeBERTa's are checked on the ranks' captures
    (:func:`test_transformers_train_exactly_under_their_plans`)."""
    _, _, graphs = _captured("table")
    assert [layer.name for layer in graphs.layers] == ["block0", "block1", "head"]
    _assert_recomputed(_recomputed(graphs, _planned("table"), "table.weight"), "table")


def test_a_batchless_statistic_crosses_whole_and_is_priced():
    """The statistic model's stem sends the batch's largest absolute value (4 bytes) and a
    parameter scaled by it (32 floats) beside its hidden state: capture records them as boundary
    values without a batch dimension; the plan's boundary carries their 132 bytes whole
    (``unbatched_bytes``), which its traffic sends from the owner slot of stage 0 to every worker
    of stage 1 and back from each of them to the owner, the simulator waits for, and the memory
    model holds whole on every worker, per micro-batch in flight."""
    _, _, graphs = _captured("statistic")
    (boundary,) = graphs.boundaries
    assert sorted((t.shape, t.batched) for t in boundary.tensors) == [((), False), ((16, 32), True), ((32,), False)]
    whole = 4 + 32 * 4
    assert [layer.cut_bytes_unbatched for layer in graphs.layers] == [whole, 0.0]
    plan = _planned("statistic")
    (crossing,) = plan.boundaries
    assert crossing.unbatched_bytes == whole and crossing.bytes_per_sample == 16 * 32 * 4
    stage0, stage1 = ([w for w in plan.workers if w.stage == s] for s in (0, 1))
    assert len(stage0) == len(stage1) == 2, plan.summary()
    owner = min(stage0, key=lambda w: w.dp_index)
    network = NetworkModel.of_cluster(_cluster())
    traffic = plan_traffic(plan, network)
    for m in range(plan.num_micro_batch):
        forward = [s for s in traffic[0, FORWARD][m].sends if s.nbytes == whole]
        backward = [s for s in traffic[0, BACKWARD][m].sends if s.nbytes == whole]
        assert {s.sender for s in forward} == {owner.device}
        assert sorted(d for s in forward for d in s.receivers) == sorted(w.device for w in stage1)
        assert sorted(s.sender for s in backward) == sorted(w.device for w in stage1)
        assert {d for s in backward for d in s.receivers} == {owner.device}
    assert unbatched_rows(plan, 0, 1) == (1, {w.rank: (0, int(w is owner)) for w in stage0},
                                          {w.rank: (0, 1) for w in stage1})
    # priced: the forward transfer time is the batched rows' and the statistic's together
    batched_only = copy.deepcopy(plan)
    batched_only.boundaries[0].unbatched_bytes = 0.0
    for both, rows in zip(traffic[0, FORWARD], plan_traffic(batched_only, network)[0, FORWARD]):
        assert both.predicted_ms > rows.predicted_ms and both.nbytes == rows.nbytes + whole   # one slice, once
    assert crossing.transfer_ms == [t.predicted_ms for t in traffic[0, FORWARD]]
    simulated = planner.simulate(plan, network=network)
    assert {t.describe() for t in simulated.reshardings} >= {traffic[0, FORWARD][0].describe()}
    # memory: every worker of both stages holds the 132 bytes whole per micro-batch in flight
    for s, layers in enumerate(([0], [1])):
        cost = StageCost.of_layers(graphs, layers)
        assert cost.unbatched_boundary_bytes == whole
        without = dataclasses.replace(cost, unbatched_boundary_bytes=0.0)
        for in_flight, shard, samples in ((1, 1.0, 4), (2, 0.5, 1)):
            assert stage_memory(cost, in_flight, shard).total(samples) == pytest.approx(
                stage_memory(without, in_flight, shard).total(samples) + in_flight * whole, rel=1e-12)
