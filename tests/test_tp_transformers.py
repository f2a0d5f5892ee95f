"""``split`` over whole transformer blocks of real Hugging Face models, exact against a single process.

GPT-2 (fused ``c_attn`` Conv1D), BERT, ViT and a Llama-style decoder (grouped-query attention with 8
query and 4 key/value heads, SwiGLU, rotary embeddings) each get ``split(2)`` over two of their
blocks, and a block captured with torch.fx (not torch.export) over one, planned for devices of
speeds 3 and 1: attention 3 heads to 1 (Llama: 3 key/value heads with their 6 query heads to 1 with
2), MLP features 3 to 1. Multi-query attention (a Llama with one key/value head, and an fx block
whose ``scaled_dot_product_attention(enable_gqa=True)`` broadcasts it) shards q/o 3 query heads to 1
and keeps k/v whole on both ranks: their weights must still end exactly as the reference's, so their
gradient is summed over the ranks' query heads once, never doubled. Two gloo ranks (one spawn for
all models) train the model under ``runtime.Engine`` for 3 steps with SGD and AdamW in float64, and
the losses and the gathered final parameters must match the single-process reference.

Each rank makes the plans itself: the capture that plans a model is the one its two Engines (SGD,
AdamW) then find in whalelike's capture cache, so a plan costs no capture of its own (made in the
test process, it cost a third capture of every model, serially before the ranks started). One
spawn for all models, not one per model: a fresh rank's first captures pay torch's one-off costs
(imports, dispatch caches), measured at about a fifth more CPU for the test over seven spawns.

The plan has one stage holding every TaskGraph: the replicated embeddings and outer blocks run
whole on both ranks (same samples), the split blocks sharded between them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import plans
import whalelike as wl
from dist_utils import run_ranks
from hf_models import TRANSFORMERS, RealModel, lm_loss
from planner.plan import Plan, StagePlan
from planner.shares.shard_sizes import shard_layout
from reference import OPTIMIZERS, assert_engine_trains_like_reference
from runtime.tensor.layers import ParallelLinear
from whalelike.cluster import Cluster, Device, Network

SPEEDS = [3.0, 1.0]
BATCH, STEPS = 4, 3


def llama_gqa() -> RealModel:
    """Llama-style with 8 query / 4 key-value heads (head_dim 8), so the heads split unevenly (3:1 kv heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                         intermediate_size=128, vocab_size=256, use_cache=False, max_position_embeddings=64,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
    real = TRANSFORMERS["llama"]()
    return RealModel("llama-gqa", LlamaForCausalLM(config), real.make_batch, lm_loss, {}, real.blocks)


def llama_mqa() -> RealModel:
    """Multi-query Llama: 4 query heads, one key/value head (head_dim 16). q/o shard by query heads
    (3:1), k/v stay whole on both ranks and their repeat_kv expand is cut to each rank's heads."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
                         intermediate_size=128, vocab_size=256, use_cache=False, max_position_embeddings=64,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
    real = TRANSFORMERS["llama"]()
    return RealModel("llama-mqa", LlamaForCausalLM(config), real.make_batch, lm_loss, {}, real.blocks)


def fx_block(net: str = "FxNet") -> RealModel:
    """A block torch.fx traces (call_method views with literal head counts, matmul attention, SwiGLU;
    ``FxMultiQueryNet``: multi-query attention through ``scaled_dot_product_attention(enable_gqa=True)``)."""
    import test_tp_blocks

    def make_batch(batch: int, gen: torch.Generator):
        return (torch.randn(batch, 6, 5, generator=gen),), torch.randint(0, 3, (batch, 6), generator=gen)

    def loss_fn(out, targets):
        return F.cross_entropy(out.reshape(-1, 3), targets.reshape(-1))

    return RealModel(f"fx-{net}", getattr(test_tp_blocks, net)(), make_batch, loss_fn, {}, "block")


MODELS = {"gpt2": TRANSFORMERS["gpt2"], "bert": TRANSFORMERS["bert"], "vit": TRANSFORMERS["vit"], "llama": llama_gqa,
          "llama-mqa": llama_mqa, "fx-block": fx_block, "fx-mqa": lambda: fx_block("FxMultiQueryNet")}


def build(name: str) -> RealModel:
    torch.manual_seed(0)
    real = MODELS[name]()
    real.model.to(torch.float64)
    wl.annotate(real.model, {real.blocks: wl.split(2)})
    return real


def batches(real: RealModel, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        inputs, targets = real.make_batch(BATCH, g)
        out.append((tuple(x.to(torch.float64) if x.is_floating_point() else x for x in inputs), targets))
    return out


def make_plan(real: RealModel) -> Plan:
    (example, _), = batches(real, 0)[:1]
    graphs = wl.capture(real.model, example)
    split = next(tg for tg in graphs if tg.strategy.kind == "split")
    layout = shard_layout(split.shardable, SPEEDS, [1.0, 1.0], split.shard_groups)
    stage = StagePlan(0, [tg.index for tg in graphs], [layer.index for layer in graphs.layers], "split(2)",
                      layout.shard_sizes)
    plan = plans.make_plan([stage], [plans.worker(r, 0, 0, r, 2, sizes=[BATCH]) for r in range(2)],
                           model_fingerprint=graphs.fingerprint, cluster="test-2", global_batch_size=BATCH)
    return plan


CLUSTER = Cluster("test-2", tuple(Device(f"emu-{i}", "emu", "localhost", peak_tflops=1.0, memory_gib=4) for i in range(2)),
                  Network(2.0, 2.0, 50.0), None)


def _check(name: str, opt: str, plan: Plan) -> dict:
    real = build(name)
    data = batches(real, 1)
    engine, _, _ = assert_engine_trains_like_reference(real.model, plan, data, OPTIMIZERS[opt], real.loss_fn, CLUSTER,
                                                       f"{name}/{opt}")
    stage = engine.executor.stage.module
    layers = {path: (type(m).__name__, tuple(m.weight.shape), m.pieces)
              for path, m in stage.named_modules() if isinstance(m, ParallelLinear)}
    # projections left whole in the split blocks (multi-query attention's k/v), as plain (or padded) Linears
    layers.update({path: ("whole", tuple(m.weight.shape), 1) for path, m in stage.named_modules()
                   if isinstance(m, torch.nn.Linear) and any(f"layers_{i}_self_attn" in path for i in (1, 2))})
    return layers


def _ranks(rank: int, world_size: int) -> dict:
    out = {}
    for name in MODELS:
        plan = make_plan(build(name))   # the capture both Engines' captures then hit (capture_cache)
        out.update({(name, opt): _check(name, opt, plan) for opt in OPTIMIZERS})
    return out


def _layers(result: dict, suffix: str) -> tuple:
    (match,) = [v for k, v in result.items() if k.endswith(suffix)]
    return match


def _warm() -> None:
    """Each model's capture, once, before the ranks fork (dist_utils' ``warm``): their own are cache hits."""
    for name in MODELS:
        make_plan(build(name))


def test_transformer_blocks_split_unevenly_match_single_process():
    results = run_ranks(_ranks, 2, init_process_group=False, timeout_s=600, warm=_warm)
    for opt in OPTIMIZERS:
        for rank, heads, features in ((0, 3, 96), (1, 1, 32)):
            got = results[rank]
            # BERT: q/k/v column, output dense row, by 16-wide heads; MLP by features
            bert = got["bert", opt]
            assert _layers(bert, "layer_1_attention_self_query") == ("ColumnParallelLinear", (16 * heads, 64), 1)
            assert _layers(bert, "layer_1_attention_output_dense") == ("RowParallelLinear", (64, 16 * heads), 1)
            assert _layers(bert, "layer_2_intermediate_dense") == ("ColumnParallelLinear", (features, 64), 1)
            assert _layers(bert, "layer_2_output_dense") == ("RowParallelLinear", (64, features), 1)
            vit = got["vit", opt]
            assert _layers(vit, "layers_1_attention_v_proj") == ("ColumnParallelLinear", (16 * heads, 64), 1)
            assert _layers(vit, "layers_2_mlp_fc2") == ("RowParallelLinear", (64, features), 1)
            # GPT-2: Conv1D weights are [in, out]; c_attn holds its heads of q, k and v (3 pieces)
            gpt2 = got["gpt2", opt]
            assert _layers(gpt2, "h_1_attn_c_attn") == ("ColumnParallelLinear", (64, 3 * 16 * heads), 3)
            assert _layers(gpt2, "h_1_attn_c_proj") == ("RowParallelLinear", (16 * heads, 64), 1)
            assert _layers(gpt2, "h_2_mlp_c_fc") == ("ColumnParallelLinear", (64, 2 * features), 1)
            # Llama: key/value heads 3:1 with their query heads 6:2 (head_dim 8), SwiGLU by features
            llama = got["llama", opt]
            assert _layers(llama, "layers_1_self_attn_q_proj") == ("ColumnParallelLinear", (2 * 8 * heads, 64), 1)
            assert _layers(llama, "layers_1_self_attn_k_proj") == ("ColumnParallelLinear", (8 * heads, 64), 1)
            assert _layers(llama, "layers_1_self_attn_o_proj") == ("RowParallelLinear", (64, 2 * 8 * heads), 1)
            assert _layers(llama, "layers_2_mlp_gate_proj") == ("ColumnParallelLinear", (features, 64), 1)
            assert _layers(llama, "layers_2_mlp_down_proj") == ("RowParallelLinear", (64, features), 1)
            # multi-query Llama: q/o by query heads 3:1 (head_dim 16), k/v whole on both ranks
            mqa = got["llama-mqa", opt]
            assert _layers(mqa, "layers_1_self_attn_q_proj") == ("ColumnParallelLinear", (16 * heads, 64), 1)
            assert _layers(mqa, "layers_2_self_attn_o_proj") == ("RowParallelLinear", (64, 16 * heads), 1)
            assert _layers(mqa, "layers_1_self_attn_k_proj") == ("whole", (16, 64), 1)
            assert _layers(mqa, "layers_2_self_attn_v_proj") == ("whole", (16, 64), 1)
            assert _layers(mqa, "layers_2_mlp_down_proj") == ("RowParallelLinear", (64, features), 1)
            # torch.fx graph: literal head counts in call_method views, explicit matmul attention
            fx = got["fx-block", opt]
            assert _layers(fx, "block_q") == ("ColumnParallelLinear", (8 * heads, 32), 1)
            assert _layers(fx, "block_o") == ("RowParallelLinear", (32, 8 * heads), 1)
            assert _layers(fx, "block_down") == ("RowParallelLinear", (32, features // 2), 1)
            fx_mqa = got["fx-mqa", opt]
            assert _layers(fx_mqa, "block_q") == ("ColumnParallelLinear", (8 * heads, 32), 1)
            assert _layers(fx_mqa, "block_o") == ("RowParallelLinear", (32, 8 * heads), 1)
            assert set(fx_mqa) == {"block_q", "block_o"}   # k/v whole
            # nothing outside the split blocks is sharded
            assert not any("layer_0" in k or "layers_0" in k or "h_0" in k or "layer_3" in k or "layers_3" in k
                           for model in got.values() for k in model)
