"""Shard groups of ``split`` regions, single process: the analysis on export graphs (GPT-2, BERT,
ViT, Llama with grouped-query attention and with multi-query attention, whose k/v projections stay
whole) and fx graphs, the planner's uneven
layouts (whole heads, every member alike, unsharded work priced whole), plan checks of hand-edited
sizes, serialisation, and the planning error of a ``split`` region with nothing to shard.
Multi-rank exactness is in ``test_tp_transformers.py``.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import planner
import whalelike as wl
from blocks import FxBlock
from hf_models import TRANSFORMERS
from planner.plan import PlanError
from planner.plan_checks import check_plan
from planner.shares.shard_sizes import shard_layout
from whalelike.graphs.regions import ATTACHED_META
from whalelike.sharding.groups import ShardGroup, ShardMember
from whalelike.graphs.taskgraph import TaskGraphs


def _split_graph(model: nn.Module, pattern: str, example):
    wl.annotate(model, {pattern: wl.split(2)})
    graphs = wl.capture(model, example)
    (split,) = [tg for tg in graphs if tg.strategy.kind == "split"]
    return graphs, split


def _groups(split) -> dict[str, tuple]:
    """``kind units: members`` -> ((path suffix, role, per_unit, pieces), ...)."""
    return {f"{g.kind} {g.units}": tuple((m.path.rsplit(".", 2)[-2] + "." + m.path.rsplit(".", 1)[-1], m.role,
                                          m.per_unit, m.pieces) for m in g.members)
            for g in split.shard_groups if ".1." in g.members[0].path}


def _region(graphs, split) -> list[str]:
    """The nodes ``split`` shards (un-annotated code attached to it is never sharded), as capture analyses them."""
    attached = {n.name for n in graphs.graph_module.graph.nodes if n.meta.get(ATTACHED_META)}
    return [name for name, t in graphs.node_taskgraph.items() if t == split.index and name not in attached]


@pytest.fixture(scope="module")
def hf_splits():
    out = {}
    for name, make in TRANSFORMERS.items():
        torch.manual_seed(0)
        real = make()
        gen = torch.Generator().manual_seed(0)
        example, _ = real.make_batch(2, gen)
        out[name] = _split_graph(real.model, real.blocks, example)
    return out


def test_export_graphs_shard_attention_by_heads_and_mlps_by_features(hf_splits):
    assert {name: graphs.method for name, (graphs, _) in hf_splits.items()} == dict.fromkeys(TRANSFORMERS, "export")
    assert _groups(hf_splits["bert"][1]) == {
        "attention 4": (("self.query", "column", 16, 1), ("self.key", "column", 16, 1),
                        ("self.value", "column", 16, 1), ("output.dense", "row", 16, 1)),
        "mlp 128": (("intermediate.dense", "column", 1, 1), ("output.dense", "row", 1, 1)),
    }
    assert _groups(hf_splits["vit"][1]) == {
        "attention 4": (("attention.q_proj", "column", 16, 1), ("attention.k_proj", "column", 16, 1),
                        ("attention.v_proj", "column", 16, 1), ("attention.o_proj", "row", 16, 1)),
        "mlp 128": (("mlp.fc1", "column", 1, 1), ("mlp.fc2", "row", 1, 1)),
    }
    # GPT-2's fused c_attn: one unit is one head of q, k and v (3 x 16 columns)
    assert _groups(hf_splits["gpt2"][1]) == {
        "attention 4": (("attn.c_attn", "column", 48, 3), ("attn.c_proj", "row", 16, 1)),
        "mlp 256": (("mlp.c_fc", "column", 1, 1), ("mlp.c_proj", "row", 1, 1)),
    }
    # grouped-query attention (4 query, 2 key/value heads): a unit is a key/value head and its 2 query heads
    assert _groups(hf_splits["llama"][1]) == {
        "attention 2": (("self_attn.q_proj", "column", 32, 1), ("self_attn.k_proj", "column", 16, 1),
                        ("self_attn.v_proj", "column", 16, 1), ("self_attn.o_proj", "row", 32, 1)),
        "mlp 128": (("mlp.gate_proj", "column", 1, 1), ("mlp.up_proj", "column", 1, 1),
                    ("mlp.down_proj", "row", 1, 1)),
    }
    # the groups carry the work they shard (forward and backward): nearly all counted FLOPs of the
    # split blocks, none of the un-annotated code that joined their region
    for name, (graphs, split) in hf_splits.items():
        sharded = sum(g.flops_per_sample for g in split.shard_groups)
        blocks = [layer for layer in graphs.layers if layer.taskgraph == split.index
                  and any(layer.name.endswith(f".{i}") or f".{i}." in layer.name for i in (1, 2))]
        work = sum(layer.forward_flops + layer.backward_flops for layer in blocks)
        assert 0.6 * work < sharded <= work * (1 + 1e-9), (name, [layer.name for layer in blocks])


def test_multi_query_attention_shards_query_heads_and_keeps_key_value_whole():
    from transformers import LlamaConfig, LlamaForCausalLM
    from whalelike.sharding.analysis import analyse_blocks, shard_groups_of
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                         num_key_value_heads=1, intermediate_size=128, vocab_size=256,
                                         use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0))
    graphs, split = _split_graph(model, "model.layers.1", (torch.randint(0, 256, (2, 8)),))
    # one key/value head cannot be cut: a unit is one query head (q and o by head_dim 16), k/v are no members
    assert _groups(split) == {
        "attention 4": (("self_attn.q_proj", "column", 16, 1), ("self_attn.o_proj", "row", 16, 1)),
        "mlp 128": (("mlp.gate_proj", "column", 1, 1), ("mlp.up_proj", "column", 1, 1),
                    ("mlp.down_proj", "row", 1, 1)),
    }
    assert not any(p.endswith(("k_proj", "v_proj")) for p in split.shardable)
    gm = graphs.graph_module
    analysis = analyse_blocks(gm, _region(graphs, split))
    whole = sorted(n.target for n in analysis.replicated_projections)
    assert whole == ["model.layers.1.self_attn.k_proj", "model.layers.1.self_attn.v_proj"]
    assert not any(n.target.endswith(("k_proj", "v_proj")) for n in analysis.lone)
    # repeat_kv: the expand of the one key/value head and its reshape are cut to the rank's query heads,
    # and k/v enter the sharded attention there (gradient summed over the tensor-parallel group)
    repeats = {n.name: (s.dim, s.size) for n, s in analysis.reshapes.items()
               if n.target == torch.ops.aten.expand.default}
    assert sorted(repeats.values()) == [(2, 4), (2, 4)]
    assert {n.name for n, _ in analysis.replicated_operands} >= set(repeats)
    # the k/v projections are priced as unsharded work: no group's FLOPs include them
    groups = shard_groups_of(gm, analysis, lambda n: n.target,
                             lambda n: 1.0 if str(n.target).endswith(("k_proj", "v_proj")) else 0.0)
    assert [g.flops_per_sample for g in groups] == [0.0] * len(groups)


def test_grouped_query_attention_with_cuttable_key_value_heads_replicates_nothing(hf_splits):
    from whalelike.sharding.analysis import analyse_blocks
    graphs, split = hf_splits["llama"]
    assert analyse_blocks(graphs.graph_module, _region(graphs, split)).replicated_projections == []


class FxNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(5, 32)
        self.block = FxBlock()
        self.head = nn.Linear(32, 3)

    def forward(self, x):
        return self.head(self.block(self.embed(x)))


class FxMultiQuery(nn.Module):
    """An fx-traceable multi-query attention block: 4 query heads and one key/value head that
    ``scaled_dot_product_attention(enable_gqa=True)`` broadcasts (no repeat_kv)."""

    def __init__(self, hidden=32, heads=4):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.q, self.o = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.k, self.v = nn.Linear(hidden, hidden // heads), nn.Linear(hidden, hidden // heads)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, s, 1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, s, 1, self.head_dim).transpose(1, 2)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return x + self.o(attn.transpose(1, 2).reshape(b, s, -1))


class FxMultiQueryNet(FxNet):
    def __init__(self):
        super().__init__()
        self.block = FxMultiQuery()


def test_fx_graphs_shard_explicit_attention_and_swiglu():
    torch.manual_seed(0)
    graphs, split = _split_graph(FxNet(), "block", (torch.randn(2, 6, 5),))
    assert graphs.method == "fx"
    got = {(g.kind, g.units): [(m.path, m.role, m.per_unit) for m in g.members] for g in split.shard_groups}
    assert got == {
        ("attention", 4): [("block.q", "column", 8), ("block.k", "column", 8), ("block.v", "column", 8),
                           ("block.o", "row", 8)],
        ("mlp", 64): [("block.gate", "column", 1), ("block.up", "column", 1), ("block.down", "row", 1)],
    }
    # multi-query attention through enable_gqa: q/o by query heads, the one key/value head whole
    torch.manual_seed(0)
    graphs, split = _split_graph(FxMultiQueryNet(), "block", (torch.randn(2, 6, 5),))
    assert graphs.method == "fx"
    assert [(g.kind, g.units, [(m.path, m.role, m.per_unit) for m in g.members]) for g in split.shard_groups] == [
        ("attention", 4, [("block.q", "column", 8), ("block.o", "row", 8)])]


def test_planner_cuts_whole_heads_alike_and_prices_unsharded_work_whole():
    attention = ShardGroup(4, (ShardMember("q", "column", 16), ShardMember("kv", "column", 96, 3),
                               ShardMember("o", "row", 16)), "attention", flops_per_sample=60.0)
    mlp = ShardGroup(128, (ShardMember("up", "column", 1), ShardMember("down", "row", 1)), "mlp",
                     flops_per_sample=20.0)
    layout = shard_layout({}, [3.0, 1.0], [1.0, 1.0], (attention, mlp), stage_flops=100.0)
    assert layout.shard_sizes == {"q": [48, 16], "kv": [288, 96], "o": [48, 16], "up": [96, 32], "down": [96, 32]}
    # 80% of the stage is sharded 3:1, the other 20% runs whole on both devices
    assert layout.fractions == pytest.approx([0.2 + 0.8 * 0.75, 0.2 + 0.8 * 0.25])
    # heads are never cut into granules: 4 heads over 3 devices of speeds 2:1:1
    assert shard_layout({}, [2.0, 1.0, 1.0], [1.0] * 3, (attention,)).shard_sizes["q"] == [32, 16, 16]
    with pytest.raises(PlanError, match=r"cannot give every device a unit; use split\(4\)"):
        shard_layout({}, [1.0] * 5, [1.0] * 5, (attention,))


def test_plan_checks_reject_sizes_that_are_not_whole_heads(hf_splits):
    graphs, split = hf_splits["bert"]
    plan = planner.plan(graphs, wl.Cluster.preset("emulated-4"), wl.Config(global_batch_size=8))
    stage = next(st for st in plan.stages if split.index in st.taskgraphs)
    query = next(p for p in stage.shard_sizes if p.endswith("1.attention.self.query"))
    key = query.replace("query", "key")
    assert sum(stage.shard_sizes[query]) == 64 and all(n % 16 == 0 for n in stage.shard_sizes[query])
    assert stage.shard_sizes[query] == stage.shard_sizes[key]
    check_plan(plan, graphs)
    edited = copy.deepcopy(plan)
    st = next(s for s in edited.stages if split.index in s.taskgraphs)
    st.shard_sizes[query] = [40, 24]
    with pytest.raises(PlanError, match="are not whole heads .* multiple of 16"):
        check_plan(edited, graphs)
    st.shard_sizes[query] = [32, 32] if stage.shard_sizes[query] != [32, 32] else [48, 16]
    with pytest.raises(PlanError, match="needs the same units per rank"):
        check_plan(edited, graphs)


def test_shard_groups_survive_serialisation(hf_splits):
    graphs, split = hf_splits["gpt2"]
    again = TaskGraphs.from_dict(graphs.to_dict())
    assert again[split.index].shard_groups == split.shard_groups
    assert again.fingerprint == graphs.fingerprint


class NothingToShard(nn.Module):
    def __init__(self):
        super().__init__()
        with wl.split(2):
            self.embed = nn.Embedding(16, 8)
            self.norm = nn.LayerNorm(8)

    def forward(self, tokens):
        return self.norm(self.embed(tokens))


def test_split_over_nothing_shardable_is_a_planning_error():
    graphs = wl.capture(NothingToShard(), (torch.randint(0, 16, (4, 3)),))
    assert graphs[0].shardable == {} and graphs[0].shard_groups == ()
    with pytest.raises(PlanError) as error:
        planner.plan(graphs, wl.Cluster.preset("emulated-2"), wl.Config(global_batch_size=8))
    message = str(error.value)
    assert "split(2) over embed, norm: nothing in this region can be sharded" in message
    assert "nn.Linear" in message and "attention blocks by heads" in message and "classifier" in message
