"""Every example captures into the TaskGraphs its annotations describe, with exact costs."""
from __future__ import annotations

import copy
import importlib.util
import pathlib
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import whalelike as wl

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"

# example -> (capture method, strategies of its TaskGraphs in order)
EXPECTED = {
    "gpt": ("fx", ["replicate(auto)", "replicate(auto)", "split(auto)"]),
    "hf_gpt2": ("export", ["replicate(auto)", "split(auto)"]),
    "hf_llama": ("export", ["replicate(auto)", "split(auto)"]),
    "hybrid_classifier": ("fx", ["replicate(auto)", "split(auto)"]),
    "third_party": ("export", ["replicate(auto)"] * 3 + ["split(auto)"]),
}


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module", params=sorted(EXPECTED))
def captured(request):
    workload = load(request.param).build()
    return request.param, workload, wl.capture(workload.model, workload.example_args)


def test_structure(captured):
    name, workload, graphs = captured
    method, strategies = EXPECTED[name]
    assert graphs.method == method
    assert [str(t.strategy) for t in graphs] == strategies
    assert sorted(graphs.node_taskgraph) == sorted(n for l in graphs.layers for n in l.nodes)
    assert [l.index for t in graphs for l in map(graphs.layers.__getitem__, t.layers)] == list(range(len(graphs.layers)))
    split = graphs[len(graphs) - 1]
    assert split.shardable and all(size > 0 for size in split.shardable.values())


def test_forward_flops_and_parameters_match(captured):
    name, workload, graphs = captured
    batch = workload.example_args[0].shape[0]
    # FlopCounterMode on the whole model with matmul attention: on a CPU, FlopCounterMode counts 0
    # for the fused attention kernel (F.scaled_dot_product_attention). Our own examples run on meta
    # tensors (where it sees the matmuls), transformers models are switched to "eager" attention.
    model = copy.deepcopy(workload.model)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("eager")
        args = workload.example_args
    else:
        model = model.to("meta")
        args = [torch.empty_like(a, device="meta") for a in workload.example_args]
    with FlopCounterMode(display=False) as counter:
        model(*args)
    total = counter.get_total_flops() / batch
    assert sum(t.forward_flops for t in graphs) == pytest.approx(total, rel=0.01)
    unique = {id(p): p for p in workload.model.parameters()}.values()
    assert sum(t.param_bytes for t in graphs) == sum(p.numel() * p.element_size() for p in unique)
    assert sum(t.backward_flops for t in graphs) > sum(t.forward_flops for t in graphs)
    assert all(t.activation_bytes_per_sample > 0 for t in graphs)


def test_graph_module_computes_the_model(captured):
    name, workload, graphs = captured
    inputs, targets = workload.make_batch(3, torch.Generator().manual_seed(1))
    workload.model.eval()
    try:
        torch.testing.assert_close(graphs.graph_module(*inputs), workload.model(*inputs))
    finally:
        workload.model.train()
    loss = workload.loss_fn(graphs.graph_module(*inputs), targets)
    assert loss.dim() == 0 and torch.isfinite(loss)


def test_pipeline_boundaries(captured):
    name, workload, graphs = captured
    dep = graphs.dependency_graph
    assert all(dep.has_edge(i, i + 1) for i in range(len(graphs) - 1))
    assert all(b.bytes_per_sample > 0 for b in graphs.boundaries)


def test_wide_classifier_captures_on_meta():
    """Whale's 100k-class setting: the capture itself needs no real memory for the costs."""
    workload = load("hybrid_classifier").build(num_classes=100_000, batch_size=2)
    graphs = wl.capture(workload.model, workload.example_args)
    assert graphs[1].shardable == {"classifier": 100_000}
    assert graphs[1].param_count == 256 * 100_000 + 100_000


def test_examples_train_on_cpu():
    """A few optimizer steps on each example reduce its loss (sizes stay CPU-friendly)."""
    for name in EXPECTED:
        workload = load(name).build()
        opt = torch.optim.AdamW(workload.model.parameters(), lr=3e-3)
        inputs, targets = workload.make_batch(16, torch.Generator().manual_seed(0))
        losses = []
        for _ in range(5):
            loss = workload.loss_fn(workload.model(*inputs), targets)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[-1] < losses[0], (name, losses)
