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
"""
from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import planner
import whalelike as wl
from dist_utils import run_ranks
from hf_models import ALL, TRANSFORMERS, build
from reference import OPTIMIZERS, assert_engine_trains_like_reference
from whalelike.cluster import Cluster

pytest.importorskip("transformers")  # a pinned test dependency (pyproject [dev]); never skipped in CI

GLOBAL_BATCH, MICRO_BATCHES, STEPS = 8, 2, 3
LAYERS = 2   # transformer blocks: one per pipeline region (depth adds nothing the test checks, and costs capture time)


def _cluster() -> Cluster:
    return Cluster.preset("emulated-4").without_emulation()


def _to(inputs: tuple, dtype: torch.dtype) -> tuple:
    return tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)


@functools.lru_cache(maxsize=None)
def _captured(name: str):
    """The float32 model, its example batch of 4 and its capture, once per test process (nothing
    here changes the model or the graphs: the eager-attention checks run on copies)."""
    real = build(name, layers=LAYERS)
    inputs, _ = real.make_batch(4, torch.Generator().manual_seed(0))
    return real, inputs, wl.capture(real.model, inputs)


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


def _ranks(rank: int, world_size: int, plans: dict) -> dict:
    shapes = {}
    for name, plan in plans.items():
        real = build(name, dtype=torch.float64, layers=LAYERS)
        gen = torch.Generator().manual_seed(1)
        data = [(_to(inputs, torch.float64), targets)
                for inputs, targets in (real.make_batch(GLOBAL_BATCH, gen) for _ in range(STEPS))]
        for opt, make_opt in OPTIMIZERS.items():
            engine, _, _ = assert_engine_trains_like_reference(real.model, plan, data, make_opt, real.loss_fn,
                                                               _cluster(), f"{name}/{opt}")
        shapes[name] = engine.worker.stage
    return shapes


def test_transformers_train_exactly_under_their_plans():
    plans = {}
    for name in sorted(TRANSFORMERS):
        _, _, graphs = _captured(name)   # float32: the plan is made once, training casts the model
        plans[name] = planner.plan(graphs, _cluster(), wl.Config(global_batch_size=GLOBAL_BATCH,
                                                                 num_micro_batch=MICRO_BATCHES))
        assert len(plans[name].stages) >= 2, plans[name].summary()
    stages = run_ranks(_ranks, 4, args=(plans,), init_process_group=False, timeout_s=600)
    for name, plan in plans.items():
        assert [s[name] for s in stages] == [w.stage for w in plan.workers]


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
