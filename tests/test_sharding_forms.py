"""More block forms under ``split`` (issue 21 items 3 and 4), exact against a single process.

* **A one-output gate** (item 3): Qwen2-MoE's sparse block scales its shared expert by
  ``sigmoid(shared_expert_gate(x))``, a ``Linear(d, 1)``; a written-out block gates both its MLP's
  hidden features and its output with such gates. Before, the gate's one feature capped the whole
  region at one device (``can be cut over at most 1 devices``); now it stays whole on every rank
  of the group (replicated compute, priced as unsharded work) and the rest shards as before:
  Qwen2-MoE under ``split(4)`` (attention by heads, the shared expert by features, the experts by
  speed), the written-out block under ``split(2)`` and ``split(4)``.
* **Per-head biases, fused slices, roll** (item 4): Phi-3's ``qkv_proj`` cut by index slicing
  (``qkv[..., :d]``) shards by heads, each slice narrowed to the rank's piece; T5's relative
  position bias and Swin's bias table with its shifted-window mask (``[.., heads, q, k]``, added
  to the attention scores) are cut with the heads; Swin's window shift and a token shift
  (``torch.roll`` along a dimension other than the sharded one) keep their groups, a roll along
  the sharded features does not. Only operands added to attention scores are cut: a residual of
  a lone projection's full size is not (:func:`test_only_operands_added_to_attention_scores_are_cut`).

Planned by ``planner.plan`` on ``emulated-4`` (speeds 1, 1, 0.5, 0.25; emulation off), trained on 4
gloo ranks in float64 (one spawn for every case) and compared with the single-process reference
(each step's loss, every final parameter). Each rank reports its parallel projections and the
projections left whole; the test checks them against the plan. Where every rank trains on the
whole batch (one ``split(4)`` group), each rank plans from its own capture of the float64 model,
the capture its Engine then finds in whalelike's capture cache (planning from the float32 model in
the test process cost one more capture of the model; the two give the same stages and workers,
only the predicted bytes differ), and every rank must have made the same plan. The ``split(2)``
cases (two replicas) are planned from the float32 model in the test process. A warm-up
(``run_ranks(warm=)``) captures each float64 model once for all 4 ranks before they fork, so
every rank's captures are capture-cache hits.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.fx as fx
import torch.nn.functional as F

import planner
import whalelike as wl
from dist_utils import LogLines, run_ranks
from reference import OPTIMIZERS, assert_engine_trains_like_reference, case_batches, case_model
from runtime.tensor.layers import ParallelLinear
from whalelike.cluster import Cluster
from whalelike.sharding.analysis import analyse_blocks
from whalelike.sharding.propagation import full_shapes

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


class BlockNet(nn.Module):
    """``embed``, a written-out ``block`` of width 16, ``head``: the block is the split region."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.embed, self.block, self.head = nn.Linear(5, 16), block, nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.block(self.embed(x)))


def gated(width: int):
    def make() -> nn.Module:
        model = BlockNet(GatedBlock())
        wl.annotate(model, {"block": wl.split(width)})
        return model
    return make


# -- item 4: fused slices, per-head biases, roll -----------------------------------------------------
def phi3() -> nn.Module:
    """Phi-3: one ``qkv_proj`` cut by index slicing (``qkv[..., :d]``), one ``gate_up_proj`` chunked."""
    from transformers import Phi3Config, Phi3ForCausalLM
    config = Phi3Config(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=32, use_cache=False,
                        bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = Phi3ForCausalLM(config)
    wl.annotate(model, {"model.layers.1": wl.split(4)})
    return model


def t5_encoder() -> nn.Module:
    """T5's relative position bias ``[1, heads, q, k]``, made by block 0 and added to every block's scores."""
    from transformers import T5Config, T5EncoderModel
    config = T5Config(d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
                      vocab_size=VOCAB, dropout_rate=0.0, feed_forward_proj="relu")
    model = T5EncoderModel(config)
    wl.annotate(model, {"encoder.block.0-1": wl.split(4)})
    return model


def swin() -> nn.Module:
    """Swin: a learned per-head bias table in every window attention, the second block's window
    shift (``torch.roll``) and its shifted-window mask."""
    from transformers import SwinConfig, SwinForImageClassification
    config = SwinConfig(image_size=16, patch_size=2, num_channels=3, embed_dim=16, depths=[2], num_heads=[2],
                        window_size=4, mlp_ratio=2.0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                        drop_path_rate=0.0, num_labels=3)
    model = SwinForImageClassification(config)
    wl.annotate(model, {"swin.encoder.layers.0.blocks.1": wl.split(2)})
    return model


class ShiftBlock(nn.Module):
    """A token shift inside an MLP (``torch.roll`` of the hidden features along the sequence), and a
    second MLP that rolls its hidden features along themselves, which stays unrecognised."""

    def __init__(self, d: int = 16, hidden: int = 32):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d)
        self.up, self.down = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        x = x + self.fc2(h + torch.roll(h, 1, dims=1))
        return x + self.down(torch.roll(F.gelu(self.up(x)), 3, dims=-1))


def shifted() -> nn.Module:
    model = BlockNet(ShiftBlock())
    wl.annotate(model, {"block": wl.split(4)})
    return model


def lm_loss(out, targets):
    return F.cross_entropy(out.logits.reshape(-1, VOCAB), targets.reshape(-1))


def vector_loss(out, targets):
    return F.cross_entropy(out.reshape(-1, 3), targets.reshape(-1))


def hidden_loss(out, targets):
    return F.mse_loss(out.last_hidden_state, targets)


def logits_loss(out, targets):
    return F.cross_entropy(out.logits, targets)


def _hidden(gen):
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),), torch.randn(BATCH, SEQ, 32, generator=gen)


def _images(gen):
    return (torch.randn(BATCH, 3, 16, 16, generator=gen),), torch.randint(0, 3, (BATCH,), generator=gen)


def _tokens(gen):
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),), torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)


def _vectors(gen):
    return (torch.randn(BATCH, 6, 5, generator=gen),), torch.randint(0, 3, (BATCH, 6), generator=gen)


# name: (builder, batches, loss, optimizer)
CASES = {
    "qwen2-moe-gate": (qwen2_moe, _tokens, lm_loss, "sgd"),
    "gated-split2": (gated(2), _vectors, vector_loss, "adamw"),
    "gated-split4": (gated(4), _vectors, vector_loss, "sgd"),
    "phi3-fused-slices": (phi3, _tokens, lm_loss, "sgd"),
    "t5-relative-bias": (t5_encoder, _hidden, hidden_loss, "sgd"),
    "swin-window-bias": (swin, _images, logits_loss, "sgd"),
    "token-shift": (shifted, _vectors, vector_loss, "sgd"),
}


def build(name: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    return case_model(CASES, name, dtype)


def batches(name: str, seed: int, dtype: torch.dtype = torch.float32) -> list:
    return case_batches(CASES, name, seed, STEPS, dtype)


def capture(name: str):
    (example, _), = batches(name, 0)[:1]
    return wl.capture(build(name), example)


def make_plan(name: str, dtype: torch.dtype = torch.float32):
    (example, _), = batches(name, 0, dtype)[:1]
    return planner.plan(wl.capture(build(name, dtype), example), _cluster(),
                        wl.Config(global_batch_size=BATCH, num_micro_batch=1))


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


def _cuts(engine) -> list:
    """This rank's cuts of per-head operands: ``(dim, start, length)`` of each ``narrow`` of a
    replicated operand entering the region (``block_sharding._cut_operands``)."""
    out = []
    for _, m in engine.executor.stage.module.named_modules():
        if isinstance(m, fx.GraphModule):
            out += [tuple(n.args[1:]) for n in m.graph.nodes if n.target is torch.narrow
                    and isinstance(n.args[0], fx.Node) and n.args[0].target == "_wl_enter_region"]
    return out


# planned in the test process: split(2) on 4 ranks, two replicas, each rank's Engine captures its share
PLANNED_BY_THE_TEST = ("gated-split2", "swin-window-bias")


def _warm() -> None:
    """Each case's float64 capture, once, before the ranks fork (dist_utils' ``warm``): the ranks' are cache hits."""
    for name in CASES:
        (example, _), = batches(name, 0, torch.float64)[:1]
        wl.capture(build(name, torch.float64), example)


def _ranks(rank: int, world_size: int, plans: dict) -> dict:
    lines = LogLines.attach("runtime.tensor.shard_pass")
    out = {}
    for name, (_, _, loss_fn, opt) in CASES.items():
        # the others: planned here, from the capture the Engine's then hits (the whole batch on every rank)
        out[name + "/plan"] = plan = plans[name] if name in plans else make_plan(name, torch.float64)
        engine, _, _ = assert_engine_trains_like_reference(build(name, torch.float64), plan,
                                                           batches(name, 1, torch.float64), OPTIMIZERS[opt], loss_fn,
                                                           _cluster(), name)
        out[name] = _layers(engine)
        out[name + "/cuts"] = _cuts(engine)
        out[name + "/log"] = [line for line in lines.lines if "is not sharded with a group" in line]
        lines.lines.clear()
    return out


def _one(layers: dict, suffix: str) -> tuple:
    (match,) = [v for k, v in layers.items() if k.endswith(suffix)]
    return match


def _split_analysis(graphs):
    (split,) = [tg for tg in graphs if tg.strategy.kind == "split"]
    region = [n.name for n in graphs.graph_module.graph.nodes if graphs.node_taskgraph.get(n.name) == split.index]
    return split, analyse_blocks(graphs.graph_module, region)


def test_one_output_gates_stay_whole_and_the_block_shards():
    # capture: the gates are in no shard group, and the analysis names why they stay whole
    split, analysis = _split_analysis(capture("gated-split4"))
    assert sorted(m.path for g in split.shard_groups for m in g.members) == ["block.fc1", "block.fc2"]
    assert sorted(n.target for n in analysis.replicated_projections) == ["block.inner_gate", "block.outer_gate"]
    assert all("one output feature" in why for why in analysis.whole_reasons.values())


def _expected_column(plan, rank: int, path: str) -> int:
    worker = plan.workers[rank]
    return plan.stages[worker.stage].shard_sizes[path][worker.tp_index]


def test_forms_train_exactly_with_their_projections_sharded():
    results = run_ranks(_ranks, 4, args=({name: make_plan(name) for name in PLANNED_BY_THE_TEST},),
                        init_process_group=False, timeout_s=600, warm=_warm)
    plans = {name: results[0][name + "/plan"] for name in CASES}
    for rank, got in enumerate(results):
        assert all(got[name + "/plan"] == plans[name] for name in CASES), rank   # every rank planned alike
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

        # Phi-3: qkv_proj cut by index slices holds its head of q, k and v (8 features each; 4 heads, 4 ranks)
        plan, phi = plans["phi3-fused-slices"], got["phi3-fused-slices"]
        size = lambda path: _expected_column(plan, rank, "model.layers.1." + path)  # noqa: E731
        assert size("self_attn.qkv_proj") == 3 * 8
        assert _one(phi, "layers_1_self_attn_qkv_proj") == ("ColumnParallelLinear", (3 * 8, 32))
        assert _one(phi, "layers_1_self_attn_o_proj") == ("RowParallelLinear", (32, 8))
        assert _one(phi, "layers_1_mlp_gate_up_proj") == ("ColumnParallelLinear", (size("mlp.gate_up_proj"), 32))
        assert got["phi3-fused-slices/cuts"] == []
        # T5: both blocks' attention by heads (head `rank` of 4), the relative position bias
        # [1, heads, q, k] cut to that head where each block adds it to its scores
        plan, t5 = plans["t5-relative-bias"], got["t5-relative-bias"]
        for block in (0, 1):
            prefix = f"encoder.block.{block}.layer."
            assert _one(t5, f"block_{block}_layer_0_SelfAttention_q") == ("ColumnParallelLinear", (8, 32))
            assert _one(t5, f"block_{block}_layer_0_SelfAttention_o") == ("RowParallelLinear", (32, 8))
            wi = _expected_column(plan, rank, prefix + "1.DenseReluDense.wi")
            assert _one(t5, f"block_{block}_layer_1_DenseReluDense_wi") == ("ColumnParallelLinear", (wi, 32))
        assert got["t5-relative-bias/cuts"] == [(1, rank, 1)] * 2
        # Swin: the shifted block's window attention by heads under split(2) (head `tp_index` of 2),
        # its bias table plus shifted-window mask [windows, heads, q, k] cut to that head
        swin_layers = got["swin-window-bias"]
        assert _one(swin_layers, "blocks_1_attention_q_proj") == ("ColumnParallelLinear", (8, 16))
        assert _one(swin_layers, "blocks_1_attention_o_proj") == ("RowParallelLinear", (16, 8))
        assert _one(swin_layers, "blocks_1_mlp_fc2") == ("RowParallelLinear", (16, 16))
        tp_index = plans["swin-window-bias"].workers[rank].tp_index
        assert got["swin-window-bias/cuts"] == [(1, tp_index, 1)]
        # token shift: the roll along the sequence keeps fc1/fc2 a group; a roll along the features does not
        shift = got["token-shift"]
        assert _one(shift, "block_fc1") == ("ColumnParallelLinear", (8, 16))
        assert _one(shift, "block_fc2") == ("RowParallelLinear", (16, 8))
        assert _one(shift, "block_up")[0] == "ColumnParallelLinear"   # lone, its output gathered
        (line,) = [line for line in got["token-shift/log"] if "block.up" in line]
        assert "rolls along the sharded dimension" in line, line
        for name in ("qwen2-moe-gate", "gated-split2", "gated-split4", "phi3-fused-slices", "t5-relative-bias",
                     "swin-window-bias"):
            assert got[name + "/log"] == [] or all("lm_head" in line or "classifier" in line
                                                   for line in got[name + "/log"]), (name, got[name + "/log"])


def test_unequal_fused_slices_fall_back_with_their_reason():
    # Phi-3 with 2 key/value heads for 4 query heads: qkv_proj's slices are 32, 16 and 16 features,
    # which a parallel projection (equal pieces) cannot hold; the projection falls back, saying why
    from transformers import Phi3Config, Phi3ForCausalLM
    torch.manual_seed(0)
    config = Phi3Config(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32, use_cache=False,
                        bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = Phi3ForCausalLM(config)
    wl.annotate(model, {"model.layers.0": wl.split(2)})
    split, analysis = _split_analysis(wl.capture(model, (torch.randint(0, VOCAB, (BATCH, SEQ)),)))
    kinds = {m.path: g.kind for g in split.shard_groups for m in g.members}
    assert kinds["model.layers.0.self_attn.qkv_proj"] == "lone"
    assert kinds["model.layers.0.mlp.gate_up_proj"] == kinds["model.layers.0.mlp.down_proj"] == "mlp"
    reason = analysis.fallbacks["model_layers_0_self_attn_qkv_proj"]
    assert "unequal pieces [32, 16, 16]" in reason, reason


class ResidualBlock(nn.Module):
    """A lone projection plus the replicated input it projects (both 16 features), then another
    projection: cutting the residual would make ``out`` a row projection of ``proj``'s group."""

    def __init__(self):
        super().__init__()
        self.proj, self.out = nn.Linear(16, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.out(x + self.proj(x))


def test_only_operands_added_to_attention_scores_are_cut():
    # the rule (whalelike/sharding/propagation.py): T5's position bias is cut where it is added to
    # each block's scores ([batch, heads, q, k], then softmax); a residual of a lone projection's full
    # size is not cut, so the projection stays lone and the next one whole
    _, t5 = _split_analysis(capture("t5-relative-bias"))
    assert len(t5.cut_operands) == 2
    for node, operand, dim in t5.cut_operands:
        assert dim == 1 and t5.state[node].dim == 1 and t5.state[node].size == 4, (node, operand, dim)
        assert full_shapes(operand) == [(BATCH, 4, SEQ, SEQ)]   # the bias plus the padding mask
    model = nn.Sequential(nn.Linear(5, 16), ResidualBlock())
    wl.annotate(model, {"1": wl.split(2)})
    split, residual = _split_analysis(wl.capture(model, (torch.randn(BATCH, 5),)))
    assert residual.cut_operands == []
    assert {m.path: g.kind for g in split.shard_groups for m in g.members}["1.proj"] == "lone"
    assert "only a per-head bias added to attention scores" in residual.fallbacks["_1_proj"], residual.fallbacks
