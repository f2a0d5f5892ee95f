"""Capture: costs against FlopCounterMode, parameters, boundaries, the export path, errors, output."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

import whalelike as wl
from whalelike.errors import CaptureError


class UNet(nn.Module):
    """down -> middle -> up, with a skip from down to up (a non-adjacent TaskGraph edge)."""

    def __init__(self, d: int = 8):
        super().__init__()
        with wl.replicate():
            self.down = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU())
        with wl.replicate():
            self.middle = nn.Linear(2 * d, 2 * d)
        with wl.replicate():
            self.up = nn.Linear(2 * d, d)

    def forward(self, x):
        skip = self.down(x)
        return self.up(torch.relu(self.middle(skip)) + skip)


class Tied(nn.Module):
    """An embedding whose weight is reused by the output projection (counted once)."""

    def __init__(self, vocab: int = 20, d: int = 8):
        super().__init__()
        with wl.replicate():
            self.embed = nn.Embedding(vocab, d)
            self.body = nn.Linear(d, d)
        with wl.split():
            self.out = nn.Linear(d, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, idx):
        return self.out(self.body(self.embed(idx)))


def reference(model, args):
    """FlopCounterMode on the real model: (forward, backward) per sample."""
    batch = args[0].shape[0]
    with FlopCounterMode(display=False) as fwd:
        out = model(*args)
    with FlopCounterMode(display=False) as bwd:
        out.sum().backward()
    model.zero_grad(set_to_none=True)
    return fwd.get_total_flops() / batch, bwd.get_total_flops() / batch


def unique_param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_flops_and_params_match_flop_counter_exactly():
    model, x = UNet(), torch.randn(4, 8)
    g = wl.capture(model, (x,))
    fwd, bwd = reference(model, (x,))
    assert sum(t.forward_flops for t in g) == pytest.approx(fwd, rel=1e-9)
    assert sum(t.backward_flops for t in g) == pytest.approx(bwd, rel=1e-9)
    assert sum(l.forward_flops for l in g.layers) == pytest.approx(fwd, rel=1e-9)
    assert sum(t.param_bytes for t in g) == unique_param_bytes(model)
    # per TaskGraph: a Linear (in, out) costs 2*in*out forward; backward also computes the input
    # gradient except for the first one, whose input needs none
    assert [t.forward_flops for t in g] == [2 * 8 * 16, 2 * 16 * 16, 2 * 16 * 8]
    assert [t.backward_flops for t in g] == [2 * 8 * 16, 4 * 16 * 16, 4 * 16 * 8]


def test_skip_connection_gives_non_adjacent_edge():
    g = wl.capture(UNet(), (torch.randn(4, 8),))
    dep = g.dependency_graph
    assert set(dep.edges) == {(0, 1), (0, 2), (1, 2)}
    (skip,) = [b for b in g.boundaries if (b.src, b.dst) == (0, 2)]
    assert [(t.shape, t.dtype, t.batched) for t in skip.tensors] == [((16,), "float32", True)]
    assert dep.edges[0, 2]["bytes_per_sample"] == 16 * 4


def test_cut_bytes_count_every_live_value():
    g = wl.capture(UNet(), (torch.randn(4, 8),))
    # after `down.0` its output is live, after `down.1` the skip tensor (16 floats); after `middle`,
    # its output and the skip (the relu and the add of the model's own forward join their consumer)
    assert [l.name for l in g.layers] == ["down.0", "down.1", "middle", "up"]
    assert [l.cut_bytes_per_sample for l in g.layers[:3]] == [16 * 4, 16 * 4, 2 * 16 * 4]


def test_shared_parameters_counted_once_and_optimizer_state():
    model = Tied()
    idx = torch.randint(0, 20, (3, 5))
    for optimizer, factor in [("sgd", 0), ("sgd_momentum", 1), ("adam", 2), ("adamw", 2)]:
        g = wl.capture(model, (idx,), optimizer=optimizer)
        assert sum(t.param_bytes for t in g) == unique_param_bytes(model)
        assert g[0].param_count == 20 * 8 + 8 * 8 + 8 and g[1].param_count == 0  # tied weight lives in TG 0
        assert [t.optimizer_state_bytes for t in g] == [factor * t.param_bytes for t in g]
    with pytest.raises(CaptureError, match="optimizer must be one of"):
        wl.capture(model, (idx,), optimizer="lion")


def test_activation_bytes_are_saved_tensors_without_parameters():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    g = wl.capture(model, (torch.randn(4, 8),))
    # Linear 0 saves its input (8 floats/sample), ReLU its output (16), Linear 2 reuses that one
    assert g[0].activation_bytes_per_sample == (8 + 16) * 4


def test_graph_module_matches_model_and_model_untouched():
    model, x = UNet(), torch.randn(4, 8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    g = wl.capture(model, (x,))
    assert all(p.device.type == "cpu" for p in model.parameters())
    torch.testing.assert_close(model.state_dict(), before)
    torch.testing.assert_close(g.graph_module(x), model(x))
    assert g.graph_module.get_submodule("down.0").weight is model.down[0].weight  # shared, not copied
    names = [name for l in g.layers for name in l.nodes]
    assert sorted(names) == sorted(g.node_taskgraph)


class ShapeBranch(nn.Module):
    """fx cannot trace a Python ``if`` on ``x.dim()``; torch.export can."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        with wl.split(2):
            self.b = nn.Linear(4, 6)

    def forward(self, x):
        if x.dim() == 3:
            x = x.mean(1)
        return self.b(torch.relu(self.a(x)))


def test_model_fx_cannot_trace_goes_through_export():
    model, x = ShapeBranch(), torch.randn(4, 5, 4)
    with pytest.raises(Exception):
        torch.fx.symbolic_trace(model)
    g = wl.capture(model, (x,))
    assert g.method == "export"
    assert [str(t.strategy) for t in g] == ["split(2)"]   # the un-annotated ``a`` joins the split, unsharded
    fwd, bwd = reference(model, (x,))
    assert sum(t.forward_flops for t in g) == pytest.approx(fwd, rel=1e-9)
    assert sum(t.backward_flops for t in g) == pytest.approx(bwd, rel=1e-9)
    # Linear leaves are restored, so the runtime can shard them; the batch dimension stays dynamic
    assert [n.target for n in g.graph_module.graph.nodes if n.op == "call_module"] == ["a", "b"]
    assert g[0].shardable == {"b": 6}
    torch.testing.assert_close(g.graph_module(torch.randn(7, 5, 4) * 0 + x[:1]), model(x[:1]).expand(7, 6))


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(4, 4)

    def forward(self, x):
        if self.gate(x).sum() > 0:  # a branch on tensor values: neither fx nor export can capture it
            return x * 2
        return x


class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = DataDependent()

    def forward(self, x):
        return self.inner(x)


def test_uncapturable_model_names_module_and_remedy(capfd):
    with pytest.raises(CaptureError) as e:
        wl.capture(Wrapper(), (torch.randn(2, 4),))
    # the error is the one line: torch.export's partial graph, which it prints on failure, is kept out of stderr
    assert "def forward" not in capfd.readouterr().err
    message = str(e.value)
    assert "\n" not in message
    assert "'inner'" in message and "DataDependent" in message
    assert "torch.where" in message and "smaller part" in message


def test_table_json_round_trip_and_fingerprint():
    g = wl.capture(UNet(), (torch.randn(4, 8),))
    text = str(g)
    assert text == g.table()
    assert "KiB" in text and "FLOP" in text and "->2" in text
    lines = text.splitlines()
    assert lines[1].index("strategy") == lines[3].index("replicate") == lines[4].index("replicate")  # aligned
    data = json.loads(json.dumps(g.to_dict()))
    back = wl.TaskGraphs.from_dict(data)
    assert back == g and back.fingerprint == g.fingerprint and back.node_taskgraph == g.node_taskgraph
    assert wl.capture(UNet(d=8), (torch.randn(2, 8),)).fingerprint == g.fingerprint  # batch size is not structure
    assert wl.capture(UNet(d=4), (torch.randn(2, 4),)).fingerprint != g.fingerprint
    data["graphs"][0]["param_count"] += 1
    with pytest.raises(wl.SpecError, match="fingerprint"):
        wl.TaskGraphs.from_dict(data)


def test_fingerprint_stable_across_processes():
    code = ("import torch, whalelike as wl, sys; sys.path.insert(0, 'examples'); import gpt; w = gpt.build(); "
            "print(wl.capture(w.model, w.example_args).fingerprint)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    sys.path.insert(0, "examples")
    import gpt

    w = gpt.build()
    assert out.stdout.strip() == wl.capture(w.model, w.example_args).fingerprint


class ForwardScopesUntraceable(nn.Module):
    """Forward-time scopes in a model that only torch.export can capture."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 6)

    def forward(self, x):
        if x.dim() == 3:
            x = x.mean(1)
        with wl.replicate(2):
            x = torch.relu(self.a(x))
        with wl.split(2):
            return self.b(x)


def test_forward_time_scopes_survive_the_export_path():
    g = wl.capture(ForwardScopesUntraceable(), (torch.randn(4, 5, 4),))
    assert g.method == "export"
    assert [str(t.strategy) for t in g] == ["replicate(2)", "split(2)"]
    calls = {n.target: g.node_taskgraph[n.name] for n in g.graph_module.graph.nodes if n.op == "call_module"}
    assert calls == {"a": 0, "b": 1}


def test_deferred_graph_modules_make_their_code_when_run_and_run_their_hooks_once():
    """Capture's graph modules defer their code (whalelike.graphs.tracing.DeferredGraphModule): a
    recompile only marks the code stale, the first call makes it, and that call runs the module's
    hooks once (torch's own deferred module runs them twice); split_module_deferred's modules are
    such modules too."""
    import torch.fx as fx
    from whalelike.graphs.tracing import DeferredGraphModule, graph_module, split_module_deferred

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    traced = fx.symbolic_trace(model)
    x = torch.randn(3, 4)
    gm = graph_module(model, traced.graph)
    calls = []
    gm.register_forward_pre_hook(lambda module, args: calls.append("pre"))
    gm.register_forward_hook(lambda module, args, out: calls.append("post"))
    assert gm._needs_recompile()
    torch.testing.assert_close(gm(x), model(x))
    assert calls == ["pre", "post"] and not gm._needs_recompile()
    assert "def forward" in gm.code
    gm.recompile()
    assert gm._needs_recompile()                       # marked, not made
    torch.testing.assert_close(gm(x), model(x))
    assert calls == ["pre", "post"] * 2

    root = split_module_deferred(traced, lambda node: 0 if node.target in ("0", "1") else 1)
    stages = [m for name, m in root.named_children() if name.startswith("submod_")]
    assert len(stages) == 2
    assert all(type(m).__mro__[1] is DeferredGraphModule for m in [root, *stages])
    hooked = []
    stages[0].register_forward_pre_hook(lambda module, args: hooked.append(1))
    torch.testing.assert_close(root(x), model(x))
    assert hooked == [1]
