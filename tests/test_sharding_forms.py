"""More block forms under ``split`` (issue 21 items 3 and 4), exact against a single process.

* **A one-output gate** (item 3): Qwen2-MoE's sparse block scales its shared expert by
  ``sigmoid(shared_expert_gate(x))``, a ``Linear(d, 1)``; a written-out block gates both its MLP's
  hidden features and its output with such gates. Before, the gate's one feature capped the whole
  region at one device (``can be cut over at most 1 devices``); now it stays whole on every rank
  of the group (replicated compute, priced as unsharded work) and the rest shards as before:
  Qwen2-MoE under ``split(4)`` (attention by heads, the shared expert by features, the experts by
  speed), the written-out block under ``split(2)`` and ``split(4)``.

Planned by ``planner.plan`` on ``emulated-4`` (speeds 1, 1, 0.5, 0.25; emulation off) from the
float32 model, trained on 4 gloo ranks in float64 (one spawn for every case) and compared with
the single-process reference (each step's loss, every final parameter). Each rank reports its
parallel projections and the projections left whole; the test checks them against the plan.
"""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import planner
import whalelike as wl
from dist_utils import run_ranks
from reference import OPTIMIZERS, assert_engine_trains_like_reference, case_batches, case_model
from runtime.tensor.layers import ParallelLinear
from whalelike.cluster import Cluster
from whalelike.sharding.analysis import analyse_blocks

pytest.importorskip("transformers")  # a pinned test dependency (pyproject [dev]); never skipped in CI

VOCAB, SEQ, BATCH, STEPS = 64, 8, 4, 2


def _cluster() -> Cluster:
    return Cluster.preset("emulated-4").without_emulation()


# -- item 3: one-output gates -------------------------------------------------------------------------
def qwen2_moe() -> nn.Module:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    config = Qwen2MoeConfig(hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                            shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, vocab_size=VOCAB,
                            max_position_embeddings=32, use_cache=False, bos_token_id=0, eos_token_id=0,
                            pad_token_id=0, experts_implementation="batched_mm")
    model = Qwen2MoeForCausalLM(config)
    wl.annotate(model, {"model.layers.1": wl.split(4)})
    return model


class GatedBlock(nn.Module):
    """An MLP whose hidden features are scaled by a one-output gate (a replicated value broadcast
    over the sharded features), and whose output is scaled by another (after the row projection)."""

    def __init__(self, d: int = 16, hidden: int = 32):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, hidden), nn.Linear(hidden, d)
        self.inner_gate, self.outer_gate = nn.Linear(d, 1), nn.Linear(d, 1, bias=False)

    def forward(self, x):
        h = self.norm(x)
        inner = F.gelu(self.fc1(h)) * torch.sigmoid(self.inner_gate(h))
        return x + torch.sigmoid(self.outer_gate(h)) * self.fc2(inner)


class GatedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.block, self.head = nn.Linear(5, 16), GatedBlock(), nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.block(self.embed(x)))


def gated(width: int):
    def make() -> nn.Module:
        model = GatedNet()
        wl.annotate(model, {"block": wl.split(width)})
        return model
    return make


def lm_loss(out, targets):
    return F.cross_entropy(out.logits.reshape(-1, VOCAB), targets.reshape(-1))


def vector_loss(out, targets):
    return F.cross_entropy(out.reshape(-1, 3), targets.reshape(-1))


def _tokens(gen):
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),), torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)


def _vectors(gen):
    return (torch.randn(BATCH, 6, 5, generator=gen),), torch.randint(0, 3, (BATCH, 6), generator=gen)


# name: (builder, batches, loss, optimizer)
CASES = {
    "qwen2-moe-gate": (qwen2_moe, _tokens, lm_loss, "sgd"),
    "gated-split2": (gated(2), _vectors, vector_loss, "adamw"),
    "gated-split4": (gated(4), _vectors, vector_loss, "sgd"),
}


def build(name: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    return case_model(CASES, name, dtype)


def batches(name: str, seed: int, dtype: torch.dtype = torch.float32) -> list:
    return case_batches(CASES, name, seed, STEPS, dtype)


def capture(name: str):
    (example, _), = batches(name, 0)[:1]
    return wl.capture(build(name), example)


def make_plan(name: str):
    return planner.plan(capture(name), _cluster(), wl.Config(global_batch_size=BATCH, num_micro_batch=1))


def _layers(engine) -> dict:
    """This rank's projections of its stage: parallel ones (kind, weight shape) and plain ones."""
    stage = engine.executor.stage.module
    out = {}
    for path, m in stage.named_modules():
        if isinstance(m, ParallelLinear):
            out[path] = (type(m).__name__, tuple(m.weight.shape))
        elif type(m) is nn.Linear:
            out[path] = ("whole", tuple(m.weight.shape))
    return out


def _ranks(rank: int, world_size: int, plans: dict) -> dict:
    out = {}
    for name, (_, _, loss_fn, opt) in CASES.items():
        engine, _, _ = assert_engine_trains_like_reference(build(name, torch.float64), plans[name],
                                                           batches(name, 1, torch.float64), OPTIMIZERS[opt], loss_fn,
                                                           _cluster(), name)
        out[name] = _layers(engine)
    return out


def _one(layers: dict, suffix: str) -> tuple:
    (match,) = [v for k, v in layers.items() if k.endswith(suffix)]
    return match


def test_one_output_gates_stay_whole_and_the_block_shards():
    # capture: the gates are in no shard group, and the analysis names why they stay whole
    graphs = capture("gated-split4")
    (split,) = [tg for tg in graphs if tg.strategy.kind == "split"]
    assert sorted(m.path for g in split.shard_groups for m in g.members) == ["block.fc1", "block.fc2"]
    region = [n.name for n in graphs.graph_module.graph.nodes if graphs.node_taskgraph.get(n.name) == split.index]
    analysis = analyse_blocks(graphs.graph_module, region)
    assert sorted(n.target for n in analysis.replicated_projections) == ["block.inner_gate", "block.outer_gate"]
    assert all("one output feature" in why for why in analysis.whole_reasons.values())


def _expected_column(plan, rank: int, path: str) -> int:
    worker = plan.workers[rank]
    return plan.stages[worker.stage].shard_sizes[path][worker.tp_index]


def test_forms_train_exactly_with_their_projections_sharded():
    plans = {name: make_plan(name) for name in CASES}
    results = run_ranks(_ranks, 4, args=(plans,), init_process_group=False, timeout_s=600)
    for rank, got in enumerate(results):
        # Qwen2-MoE: attention by heads, the shared expert by features, its one-output gate whole
        plan, qwen = plans["qwen2-moe-gate"], got["qwen2-moe-gate"]
        size = lambda path: _expected_column(plan, rank, "model.layers.1." + path)  # noqa: E731
        assert _one(qwen, "layers_1_self_attn_q_proj") == ("ColumnParallelLinear", (size("self_attn.q_proj"), 32))
        assert _one(qwen, "layers_1_self_attn_o_proj") == ("RowParallelLinear", (32, size("self_attn.o_proj")))
        features = size("mlp.shared_expert.gate_proj")
        assert _one(qwen, "layers_1_mlp_shared_expert_up_proj") == ("ColumnParallelLinear", (features, 32))
        assert _one(qwen, "layers_1_mlp_shared_expert_down_proj") == ("RowParallelLinear", (32, features))
        assert _one(qwen, "layers_1_mlp_shared_expert_gate") == ("whole", (1, 32))
        # the written-out block at both widths: fc1/fc2 cut by the plan, both gates whole
        for name in ("gated-split2", "gated-split4"):
            features = _expected_column(plans[name], rank, "block.fc1")
            assert features < 32, (name, rank, features)
            block = got[name]
            assert _one(block, "block_fc1") == ("ColumnParallelLinear", (features, 16))
            assert _one(block, "block_fc2") == ("RowParallelLinear", (16, features))
            assert _one(block, "block_inner_gate") == ("whole", (1, 16))
            assert _one(block, "block_outer_gate") == ("whole", (1, 16))
