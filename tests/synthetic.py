"""Synthetic TaskGraphs and clusters for planner tests, built directly from the data types.

Costs follow a transformer encoder (per sample, fp32): a layer of hidden size ``h`` over ``seq``
tokens has ``12 h^2`` parameters, ``2 * params * seq + 4 seq^2 h`` forward FLOPs (matmuls and
attention), twice that backward, and saves about ``seq * h * (34 + 5 heads seq / h) * 2`` bytes of
activations (Megatron-LM's estimate, doubled for fp32). AdamW keeps two fp32 moments per parameter.
"""
from __future__ import annotations

from typing import Optional, Sequence

from whalelike.cluster import Cluster, Device, Network
from whalelike.strategy import Strategy, replicate
from whalelike.graphs.taskgraph import Boundary, Layer, TaskGraph, TaskGraphs, TensorSpec

FP32 = 4


def synthetic_model(
    num_layers: int = 8,
    strategies: Sequence[Strategy] = (replicate(),),
    layers_per_graph: Optional[Sequence[int]] = None,
    hidden: int = 1024,
    seq: int = 128,
    heads: int = 16,
    vocab: int = 0,
    shard_split_graphs: bool = True,
) -> TaskGraphs:
    """A stack of ``num_layers`` transformer layers in one TaskGraph per strategy.

    ``layers_per_graph`` defaults to an even split (extras to the first TaskGraphs). ``vocab > 0``
    makes layer 0 a token embedding (``vocab * hidden`` parameters, negligible FLOPs), which gives
    the first TaskGraph the larger peak memory, as in BERT. TaskGraphs under ``split`` list each
    layer's MLP input Linear (``4 h`` output features) as shardable.
    """
    n = len(strategies)
    if layers_per_graph is None:
        base, extra = divmod(num_layers, n)
        layers_per_graph = [base + (1 if i < extra else 0) for i in range(n)]
    assert sum(layers_per_graph) == num_layers and all(k > 0 for k in layers_per_graph)
    block_params = 12 * hidden * hidden
    block_fwd = 2.0 * block_params * seq + 4.0 * seq * seq * hidden
    block_act = seq * hidden * (34 + 5 * heads * seq / hidden) * 2.0
    out_bytes = float(seq * hidden * FP32)

    layers: list[Layer] = []
    owner = [g for g, k in enumerate(layers_per_graph) for _ in range(k)]
    for i in range(num_layers):
        embed = vocab > 0 and i == 0
        params = vocab * hidden if embed else block_params
        fwd = 2.0 * seq * hidden if embed else block_fwd
        layers.append(Layer(
            index=i, name="embed" if embed else f"layers.{i}", taskgraph=owner[i],
            forward_flops=fwd, backward_flops=2 * fwd, param_bytes=params * FP32, param_count=params,
            activation_bytes_per_sample=out_bytes if embed else block_act,
            cut_bytes_per_sample=out_bytes,
        ))
    graphs = []
    for g, strategy in enumerate(strategies):
        mine = [l for l in layers if l.taskgraph == g]
        split = strategy.kind == "split" or strategy.inner is not None
        shardable = {f"{l.name}.mlp.fc1": 4 * hidden for l in mine if l.name != "embed"} if split and shard_split_graphs else {}
        param_bytes = sum(l.param_bytes for l in mine)
        graphs.append(TaskGraph(
            index=g, strategy=strategy, module_paths=tuple(l.name for l in mine),
            layers=tuple(l.index for l in mine),
            forward_flops=sum(l.forward_flops for l in mine), backward_flops=sum(l.backward_flops for l in mine),
            param_bytes=param_bytes, param_count=sum(l.param_count for l in mine),
            optimizer_state_bytes=2 * param_bytes,
            activation_bytes_per_sample=sum(l.activation_bytes_per_sample for l in mine),
            shardable=shardable,
        ))
    boundaries = [
        Boundary(g, g + 1, (TensorSpec(f"hidden_{g}", (seq, hidden), "float32"),)) for g in range(n - 1)
    ]
    return TaskGraphs(graphs, layers, boundaries, optimizer="adamw", example_batch_size=1, method="fx")


def bert_large(strategies: Sequence[Strategy] = (replicate(),), **kw) -> TaskGraphs:
    """BERT-Large-like: 24 layers of hidden 1024 after a 30522-token embedding (25 layers)."""
    return synthetic_model(num_layers=25, strategies=strategies, hidden=1024, seq=128, heads=16, vocab=30522, **kw)


def synthetic_cluster(kinds: Sequence[tuple[int, float, float]], per_host: int = 8, name: str = "synthetic",
                      measured: bool = False) -> Cluster:
    """``kinds``: (count, tflops, memory GiB) per device kind; devices fill hosts of ``per_host`` in order.
    ``measured`` puts the figure in ``measured_tflops`` instead of ``peak_tflops``."""
    devices = []
    for k, (count, tflops, mem) in enumerate(kinds):
        for _ in range(count):
            i = len(devices)
            devices.append(Device(
                name=f"d{i}", kind=f"kind{k}-{mem:g}GB", host=f"host{i // per_host}",
                peak_tflops=tflops, memory_gib=mem, measured_tflops=tflops if measured else None,
            ))
    return Cluster(name, tuple(devices), Network(intra_host_gbps=100.0, inter_host_gbps=10.0, latency_us=5.0))
