"""Tied weights across pipeline stages (``runtime.parallel.tied_weights``) against a single-process reference.

One 4-rank gloo spawn. A small language model whose output projection *is* its input embedding
(``lm_head.weight = wte.weight``, as GPT-2 ties them) is planned by ``planner.plan`` onto
``emulated-4`` (emulation off) in three layouts, plus Hugging Face's GPT-2 (tied by default):

* ``2-stages``: the embedding on a stage of two devices with uneven shares 6:2 per micro-batch,
  the head on a stage of two devices;
* ``3-stages``: the tie spans stages 0 and 2; stage 1's rank holds no copy;
* ``split-head``: the head is a class-sharded ``split`` Linear (shards 75%/25%), whose weight
  rows are slices of the embedding matrix held whole by stage 0;
* ``split-one-stage``: one stage, ``split`` inside ``replicate`` (shares 13:3): each rank holds
  the embedding whole and the head's rows sharded, two copies of one parameter on one rank;
* ``gpt2``: a two-block ``GPT2LMHeadModel`` annotated ``transformer.h.0`` / ``transformer.h.1``.

Tied weights inside one ZeRO-sharded data-parallel stage (the whole model one ``replicate`` region,
each layer module a unit of its own but the tie's, which the root unit holds across both uses): a
``MistralForCausalLM`` with ``tie_word_embeddings=True`` at ZeRO 1, 2 and 3 on FSDP2 and at ZeRO 3 with
ragged shards, and GPT-2 (tied by default) at ZeRO 3 and ragged ZeRO 1; the runtime's units are the
planner's (``fsdp_unit_names``), which priced the tie in the root unit.

Each trains 3 steps with SGD (momentum) and AdamW in float64 from the same initial weights on the
same batches as the reference; the losses, every entry of the full state dict (which holds the
tied matrix under both of the model's names) and, bit for bit, every rank's copy of the tied
parameter are compared. Bad input: a plan on a subgroup of the world cannot create the tie's
process group, and says so. The ranks' warm-up (dist_utils' ``warm``) captures each model once
for all ranks and works out its pipeline's fake node values: every rank's capture, and its
pipeline's first-step fake runs, are then cache hits.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import planner
import whalelike as wl
from dist_utils import run_ranks
from planner.devices.cost_model import fsdp_unit_names
from planner.plan import Plan, StagePlan
from plans import make_plan, worker
from reference import OPTIMIZERS, assert_engine_trains_like_reference, warm_capture
from runtime import Engine
from runtime.parallel.pipeline import PipelineExecutor
from runtime.parallel.stage_split import node_stages_from_plan
from runtime.parallel.tied_weights import TiedParameterError
from whalelike.cluster import Cluster

VOCAB, DIM, POSITIONS = 32, 16, 6
GLOBAL_BATCH, MICRO_BATCHES, STEPS = 16, 2, 3


class _Nested:
    """``with _Nested(a, b)`` is ``with a, b``: the scope of ``split`` inside ``replicate``."""

    def __init__(self, outer, inner):
        self.outer, self.inner = outer, inner

    def __enter__(self):
        self.outer.__enter__()
        self.inner.__enter__()

    def __exit__(self, *exc):
        self.inner.__exit__(*exc)
        self.outer.__exit__(*exc)


LAYOUTS = {  # scopes of (wte, h0), h1, lm_head; None joins the scope before it
    "2-stages": (wl.replicate(2), wl.replicate(2), None),
    "3-stages": (wl.replicate(2), wl.replicate(1), wl.replicate(1)),
    "split-head": (wl.replicate(2), None, wl.split(2)),
    "split-one-stage": (_Nested(wl.replicate(2), wl.split(2)), None, None),
}
GPT2 = "gpt2"
GPT2_WHOLE, MISTRAL = "gpt2-one-stage", "mistral"
# tied weights in one ZeRO data-parallel stage: case -> (model, ZeRO stage, ragged state fractions or None)
ZERO_CASES = {
    "mistral-zero1": (MISTRAL, 1, None), "mistral-zero2": (MISTRAL, 2, None), "mistral-zero3": (MISTRAL, 3, None),
    "mistral-ragged3": (MISTRAL, 3, [0.4, 0.3, 0.2, 0.1]),
    "gpt2-zero3": (GPT2_WHOLE, 3, None), "gpt2-ragged1": (GPT2_WHOLE, 1, [0.1, 0.2, 0.3, 0.4]),
}


class TiedLM(nn.Module):
    def __init__(self, layout: str):
        super().__init__()
        first, middle, last = LAYOUTS[layout]
        with first:
            self.wte = nn.Embedding(VOCAB, DIM)
            self.h0 = nn.Linear(DIM, DIM)
            if middle is None:
                self.h1 = nn.Linear(DIM, DIM)
            if middle is None and last is None:
                self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        if middle is not None:
            with middle:
                self.h1 = nn.Linear(DIM, DIM)
                if last is None:
                    self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        if last is not None:
            with last:
                self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids):
        x = torch.tanh(self.h0(self.wte(ids)))
        return self.lm_head(torch.tanh(self.h1(x)))


def _gpt2_loss(outputs, targets):
    return wl.token_cross_entropy(outputs["logits"], targets)


def _model(name: str) -> tuple[nn.Module, callable]:
    torch.manual_seed(0)
    if name in (GPT2, GPT2_WHOLE):
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64,
                                           use_cache=False, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                                           embd_pdrop=0.0, attn_pdrop=0.0))
        if name == GPT2:
            wl.annotate(model, {"transformer.h.0": wl.replicate(), "transformer.h.1": wl.replicate()})
        else:                       # the whole model one data-parallel region
            region = wl.replicate()
            wl.annotate(model, {"transformer": region, "lm_head": region})
        return model.double(), _gpt2_loss
    if name == MISTRAL:
        from transformers import MistralConfig, MistralForCausalLM

        model = MistralForCausalLM(MistralConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                 num_key_value_heads=2, intermediate_size=64, vocab_size=VOCAB,
                                                 tie_word_embeddings=True, use_cache=False,
                                                 max_position_embeddings=32, bos_token_id=0, eos_token_id=0))
        region = wl.replicate()
        wl.annotate(model, {"model": region, "lm_head": region})
        return model.double(), _gpt2_loss
    return TiedLM(name).double(), wl.token_cross_entropy


def _batches(n: int) -> list[tuple[tuple, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [((torch.randint(0, VOCAB, (n, POSITIONS), generator=g),), torch.randint(0, VOCAB, (n, POSITIONS), generator=g))
            for _ in range(STEPS)]


def _cluster() -> Cluster:
    return Cluster.preset("emulated-4").without_emulation()


def _check_copies_identical(engine: Engine, label: str) -> None:
    """Every rank's copy (whole or a slice) of every tied parameter has the same bits."""
    mine = {tie.name: [(index, p.detach().clone()) for index, p in copies]
            for tie, copies in engine.executor.stage_worker.tied.held()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    names = {name for part in gathered for name in part}
    assert names, f"{label}: no rank holds a tied parameter"
    for name in names:
        copies = [c for part in gathered for c in part.get(name, [])]
        full = next(t for index, t in copies if index is None)
        assert len(copies) >= 2, f"{label}: {name} has {len(copies)} copy"
        for index, t in copies:
            expected = full if index is None else full.reshape(-1)[index]
            assert torch.equal(t, expected), f"{label}: a copy of {name} differs from the others"


def _check_subgroup_plan_is_refused(rank: int) -> None:
    """A 2-rank plan run on ranks {0, 1} of the 4-rank world: the tie's group cannot be made."""
    sub = dist.new_group([0, 1])
    if rank > 1:
        return
    model, loss_fn = _model("2-stages")
    graphs = wl.capture(model, _batches(2)[0][0])
    layers = [layer.index for layer in graphs.layers]
    half = len(layers) // 2
    plan = make_plan([StagePlan(0, [0], layers[:half], "replicate"), StagePlan(1, [1], layers[half:], "replicate")],
                     [worker(r, r, sizes=[4]) for r in range(2)], model_fingerprint=graphs.fingerprint)
    with pytest.raises(TiedParameterError, match=r"parameter 'wte.weight, lm_head.weight' is used by stages \[0, 1\]"
                                                 r".*run it on the whole world \(group=None\), or untie"):
        PipelineExecutor(graphs.graph_module, node_stages_from_plan(graphs, plan), plan, loss_fn, group=sub)


def _check_zero_units(engine: Engine, graphs_units: tuple[str, ...], label: str) -> None:
    """The ZeRO sync wraps the planner's units (the tie in none of them: the root unit holds it)."""
    sync = engine.executor.sync
    modules = {id(m): n for n, m in engine.executor.module.named_modules()}
    if sync.name == "fsdp":
        wrapped = tuple(modules[id(unit)] for unit in sync.units if unit is not engine.executor.module)
    else:
        units = [sync.unit_modules[b] for b in sorted(sync.unit_modules)]   # reverse forward order, then the root
        wrapped = tuple(reversed([modules[id(m)] for m in units if m is not engine.executor.module]))
    if sync.name == "fsdp" or sync.stage == 3:
        assert wrapped == graphs_units, f"{label}: the sync wraps {wrapped}, the planner priced units {graphs_units}"


def _ranks(rank: int, world_size: int, plans: dict[str, Plan], zero_plans: dict[str, tuple[Plan, tuple]]) -> dict:
    losses_seen = {}
    for name, plan in plans.items():
        model, loss_fn = _model(name)
        data = _batches(GLOBAL_BATCH)
        for opt, make_opt in OPTIMIZERS.items():
            label = f"{name}/{opt}"
            engine, got, _ = assert_engine_trains_like_reference(model, plan, data, make_opt, loss_fn, _cluster(),
                                                                 label)
            _check_copies_identical(engine, label)
            losses_seen[label] = [float(v) for v in got]
    for case, (plan, units) in zero_plans.items():
        model, loss_fn = _model(ZERO_CASES[case][0])
        opt = "sgd" if case.endswith("1") else "adamw"
        engine, got, _ = assert_engine_trains_like_reference(model, plan, _batches(GLOBAL_BATCH), OPTIMIZERS[opt],
                                                             loss_fn, _cluster(), case)
        _check_zero_units(engine, units, case)
        losses_seen[f"{case}/{opt}"] = [float(v) for v in got]
    _check_subgroup_plan_is_refused(rank)
    return losses_seen


def _warm() -> None:
    """Each model's capture on the ranks' first batch, once, before the ranks fork (dist_utils'
    ``warm``): the ranks' own captures (their Engines', the subgroup check's) are cache hits, and so
    are their pipelines' fake node values (``reference.warm_capture``; the one-stage models have none)."""
    for name in (*LAYOUTS, GPT2, GPT2_WHOLE, MISTRAL):
        one_stage = name in ("split-one-stage", GPT2_WHOLE, MISTRAL)
        (wl.capture if one_stage else warm_capture)(_model(name)[0], _batches(GLOBAL_BATCH)[0][0])
    wl.capture(_model("2-stages")[0], _batches(2)[0][0])   # _check_subgroup_plan_is_refused's


def test_tied_weights_across_stages_match_single_process_reference():
    plans = {}
    for name in (*LAYOUTS, GPT2):
        model, _ = _model(name)
        graphs = wl.capture(model, _batches(4)[0][0])
        plans[name] = planner.plan(graphs, _cluster(), wl.Config(global_batch_size=GLOBAL_BATCH,
                                                                 num_micro_batch=MICRO_BATCHES))
    # the layouts the docstring promises: uneven shares on a stage holding the tie, a sharded head
    stage0 = [w.batch_share for w in plans["2-stages"].stage_workers(0)]
    assert len(set(stage0)) > 1, stage0
    assert len(plans["3-stages"].stages) == 3
    assert any(w.tp_size == 2 for w in plans["split-head"].workers)
    assert len(plans["split-one-stage"].stages) == 1 and plans["split-one-stage"].workers[0].tp_size == 2
    zero_plans = {}
    for case, (name, zero, fractions) in ZERO_CASES.items():
        model, _ = _model(name)
        graphs = wl.capture(model, _batches(4)[0][0])
        plan = planner.plan(graphs, _cluster(), wl.Config(global_batch_size=GLOBAL_BATCH,
                                                          num_micro_batch=MICRO_BATCHES, zero_stage=zero))
        assert len(plan.stages) == 1 and plan.stages[0].zero_stage == zero, (case, plan.stages)
        if fractions is not None:
            plan.stages[0] = dataclasses.replace(plan.stages[0], replica_sync="ragged", state_fractions=fractions)
        units = fsdp_unit_names(graphs.layers)
        tied = {"transformer.wte", "lm_head"} if name == GPT2_WHOLE else {"model.embed_tokens", "lm_head"}
        assert units and not tied & set(units), (case, units)    # the tie's layers are in the root unit
        zero_plans[case] = (plan, units)
    results = run_ranks(_ranks, 4, args=(plans, zero_plans), init_process_group=False, timeout_s=600, warm=_warm)
    for label, losses in results[0].items():
        assert len(losses) == STEPS
        assert all(r[label] == losses for r in results), label
