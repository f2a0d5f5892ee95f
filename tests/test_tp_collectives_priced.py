"""A split stage's collectives priced as the runtime runs them: per shard group with a row projection one
all-reduce of the layer's output in the forward and one in the backward (two per transformer block, none for a
layer nothing shards), and in the forward the class-sharded cross-entropy's two (the row maxima, then the sums
and target logits: ``runtime.tensor.layers._ShardedCrossEntropy``; its backward runs none).

``StageCost.tp_allreduce_bytes`` and ``loss_allreduce_bytes`` (:mod:`planner.devices.stage_cost`), priced by
:mod:`planner.assemble` on real ``transformers`` GPT-2 and the demo's hybrid classifier.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

import planner
import whalelike as wl
from planner.balance.replan import repriced_plan
from planner.devices.cost_model import CommModel
from planner.devices.stage_cost import SHARDED_LOSS_ALLREDUCE_BYTES, StageCost
from whalelike.cluster import Cluster

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import hf_gpt2  # noqa: E402
import hybrid_classifier  # noqa: E402


def _graphs(module):
    w = module.build()
    return wl.capture(w.model, w.example_args, w.example_kwargs, loss_fn=w.loss_fn)


def test_a_gpt2_split_stage_counts_two_all_reduces_per_block_none_for_its_norm_and_the_loss_two():
    graphs = _graphs(hf_gpt2)
    split = next(tg for tg in graphs.graphs if tg.strategy.kind == "split")
    names = [graphs.layers[i].name for i in split.layers]
    assert names == ["transformer.h.2", "transformer.h.3", "transformer.ln_f", "lm_head"]
    cost = StageCost.of_layers(graphs, list(split.layers))
    block = graphs.layers[split.layers[0]].cut_bytes_per_sample
    assert cost.tp_allreduce_bytes == (block,) * 4            # attention's c_proj and the MLP's, in each block
    assert cost.loss_allreduce_bytes == SHARDED_LOSS_ALLREDUCE_BYTES
    # a replicated stage holds no class-sharded head; a StageCost made by hand prices one per layer, as before
    replicated = StageCost.of_layers(graphs, [0, 1])
    assert replicated.loss_allreduce_bytes == ()
    hand = StageCost(1.0, 2.0, 4.0, 12.0, activation_bytes=1.0, boundary_bytes=1.0, layer_output_bytes=(5.0, 7.0))
    assert hand.tp_allreduce_bytes == (5.0, 7.0)


def test_the_demos_classifier_prices_its_cross_entropys_all_reduces_in_the_forward_only():
    graphs, cluster = _graphs(hybrid_classifier), Cluster.preset("emulated-4")
    plan = planner.plan(graphs, cluster, wl.Config(global_batch_size=64, num_micro_batch=4))
    split = next(st for st in plan.stages if st.strategy.startswith("split"))
    workers = [w for w in plan.workers if w.stage == split.index]
    # the same plan on links of a hundred times the latency: only the collectives' prices move
    slow = dataclasses.replace(cluster, network=dataclasses.replace(cluster.network,
                                                                    latency_us=100 * cluster.network.latency_us))
    repriced = repriced_plan(plan, graphs, slow)
    by_rank = {w.rank: w for w in repriced.workers}
    devices = {d.name: d for d in cluster.devices}
    group = [devices[w.device] for w in workers]
    for w in workers:
        b = w.micro_batch_sizes[0]
        extra = (CommModel(slow.network).allreduce_each_ms(SHARDED_LOSS_ALLREDUCE_BYTES, b, group)
                 - CommModel(cluster.network).allreduce_each_ms(SHARDED_LOSS_ALLREDUCE_BYTES, b, group))
        assert extra > 0
        assert by_rank[w.rank].forward_ms[0] - w.forward_ms[0] == pytest.approx(extra)
        assert by_rank[w.rank].backward_ms[0] == pytest.approx(w.backward_ms[0])   # no collective in its backward
