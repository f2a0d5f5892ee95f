"""The capture cache (``whalelike/graphs/capture_cache.py``): a second capture of the same
architecture in one process is a hit, and a hit is indistinguishable from a fresh capture.

Each case captures a fresh instance twice (the second a hit) and once more with the cache off,
and compares the hit with the fresh capture: the TaskGraphs (``to_dict``), the graph module's
code, state-dict keys and order, parameters and buffers (persistent or not), their identity with
the new model's (never the first model's), and the outputs on the same inputs. Models: GPT-2 and
Llama from ``transformers`` (torch.export; tied embeddings, non-persistent buffers, an autocast
region's body), an fx-traced model under ``split`` with a plain tensor constant and a
forward-time scope. At another batch size the trace serves (torch.fx's always, torch.export's when
it kept the batch dimension symbolic) and the figures are measured afresh, again equal to a fresh
capture; a trace that pins the batch size serves that size only. Then what must miss: any change a
trace could see.
"""
from __future__ import annotations

import gc
import os
import warnings
import weakref

import pytest
import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

import whalelike as wl
from hf_models import TRANSFORMERS
from whalelike.graphs import capture_cache
from whalelike.graphs.capture import capture
from whalelike.graphs.costs import fake_copy


class Scoped(nn.Module):
    """fx-traceable: a split region, a plain tensor constant, a forward-time scope."""

    def __init__(self, eps: float = 1e-5, scale: float = 2.0, two_scopes: bool = False):
        super().__init__()
        with wl.split(2):
            self.up = nn.Linear(8, 16)
            self.down = nn.Linear(16, 8)
            if not two_scopes:   # one split region of three Linears
                self.more = nn.Linear(8, 8)
        if two_scopes:           # the same settings, a second region
            with wl.split(2):
                self.more = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8, eps=eps)
        self.scale = torch.full((8,), scale)   # a plain attribute: a constant of the trace
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        x = self.down(torch.relu(self.up(x))) * self.scale
        x = self.more(x)
        with wl.replicate(1):
            x = self.norm(x)
        return self.head(x)


def _scoped(**kwargs):
    torch.manual_seed(0)
    return Scoped(**kwargs), (torch.randn(4, 8),)


def _hf(name: str):
    def build():
        torch.manual_seed(0)
        real = TRANSFORMERS[name]()
        inputs, _ = real.make_batch(2, torch.Generator().manual_seed(0))
        return real.model, inputs
    return build


CASES = {"gpt2": _hf("gpt2"), "llama": _hf("llama"), "scoped": _scoped}


def _facts(graphs, model) -> dict:
    gm = graphs.graph_module
    own = {id(t) for t in list(model.parameters()) + list(model.buffers())}
    return {
        "graphs": graphs.to_dict(),
        "code": gm.code,
        "state": list(gm.state_dict()),
        "params": [n for n, _ in gm.named_parameters(remove_duplicate=False)],
        "buffers": [n for n, _ in gm.named_buffers(remove_duplicate=False)],
        "hooks": (len(gm._forward_pre_hooks), len(gm._forward_hooks)),
        "the model's tensors": all(id(t) in own for t in gm.parameters()),
    }


def _outputs(graphs, inputs) -> list:
    return [t for t in pytree.tree_leaves(graphs.graph_module(*inputs)) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("name", list(CASES))
def test_a_hit_is_a_fresh_capture_of_the_new_model(name, monkeypatch):
    capture_cache.clear()
    first_model, inputs = CASES[name]()
    capture(first_model, inputs)
    first = weakref.ref(first_model)
    del first_model
    gc.collect()
    assert first() is None, "the cache keeps the first model alive"

    before = capture_cache.stats()
    model, inputs = CASES[name]()
    hit = capture(model, inputs)
    after = capture_cache.stats()
    assert after["hits"] == before["hits"] + 1 and after["rejected"] == before["rejected"], (before, after)

    monkeypatch.setenv("WHALELIKE_CAPTURE_CACHE", "0")
    fresh_model, fresh_inputs = CASES[name]()
    fresh = capture(fresh_model, fresh_inputs)
    assert capture_cache.stats()["hits"] == after["hits"], "the cache answered while switched off"

    got, want = _facts(hit, model), _facts(fresh, fresh_model)
    assert got["the model's tensors"] and want["the model's tensors"]
    assert got == want
    for a, b in zip(_outputs(hit, inputs), _outputs(fresh, fresh_inputs), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_changed_graph_module_leaves_the_entry_alone():
    capture_cache.clear()
    model, inputs = _scoped()
    graphs = capture(model, inputs)
    gm = graphs.graph_module
    for node in list(gm.graph.nodes):   # what a pass may do to the graph it was handed
        node.meta["wl_path"] = "changed"
    gm.graph.erase_node(next(n for n in reversed(gm.graph.nodes) if n.op == "output"))
    hits = capture_cache.stats()["hits"]
    again_model, again_inputs = _scoped()
    again = capture(again_model, again_inputs)
    assert capture_cache.stats()["hits"] == hits + 1
    want_model, want_inputs = _scoped()
    os.environ["WHALELIKE_CAPTURE_CACHE"] = "0"
    try:
        want = capture(want_model, want_inputs)
    finally:
        del os.environ["WHALELIKE_CAPTURE_CACHE"]
    assert _facts(again, again_model) == _facts(want, want_model)


def _with_hook():
    model, inputs = _scoped()
    model.head.register_forward_hook(lambda m, i, o: o * 2)
    return model, inputs


MISSES = {   # what a trace could see differ: each must be a miss (or not cached at all)
    "a LayerNorm's eps": lambda: _scoped(eps=1e-3),
    "a constant's value": lambda: _scoped(scale=3.0),
    "the scope pattern (two split regions, not one)": lambda: _scoped(two_scopes=True),
    "a forward hook": _with_hook,
    "training mode": lambda: (_scoped()[0].eval(), _scoped()[1]),
}


@pytest.mark.parametrize("change", list(MISSES))
def test_what_a_trace_could_see_is_in_the_key(change):
    capture_cache.clear()
    capture(*_scoped())
    before = capture_cache.stats()
    model, inputs = MISSES[change]()
    capture(model, inputs)
    after = capture_cache.stats()
    assert after["hits"] == before["hits"], f"{change}: a hit"


class PinnedBatch(nn.Module):
    """Code that reads the batch size as a number: torch.fx cannot trace it, torch.export pins the
    batch dimension to the example's (its trace serves that batch size only)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if x.shape[0] == 4:
            x = x * 2
        return self.lin(x)


def _gpt2_at(batch: int):
    def build():
        model, inputs = _hf("gpt2")()
        return model, (torch.cat([inputs[0]] * 3)[:batch],)
    return build


AT_OTHER_SHAPES = {   # the trace serves (a trace hit), the figures are measured at the new shapes
    "fx, another batch size": (_scoped, lambda: (_scoped()[0], (torch.randn(6, 8),))),
    "torch.export, another batch size": (_gpt2_at(2), _gpt2_at(3)),
}


@pytest.mark.parametrize("case", list(AT_OTHER_SHAPES))
def test_another_batch_size_reuses_the_trace_and_equals_a_fresh_capture(case, monkeypatch):
    """A rank's share, a new micro-batch size: capture at another batch size reuses the trace when it
    keeps the batch dimension symbolic, measures the costs afresh, and gives what a fresh capture
    gives. The optimizer and the loss are not in the key either: a hit with other ones too."""
    first, second = AT_OTHER_SHAPES[case]
    capture_cache.clear()
    capture(*first())
    before = capture_cache.stats()
    model, inputs = second()
    got = capture(model, inputs, optimizer="sgd", loss_fn=lambda out, y: out.sum() if torch.is_tensor(out) else
                  out.logits.sum())
    after = capture_cache.stats()
    assert after["trace_hits"] == before["trace_hits"] + 1 and after["misses"] == before["misses"], (before, after)
    again_model, again_inputs = second()
    again = capture(again_model, again_inputs, optimizer="adam")
    assert capture_cache.stats()["hits"] == after["hits"] + 1

    monkeypatch.setenv("WHALELIKE_CAPTURE_CACHE", "0")
    for hit, hit_model, kwargs in ((got, model, dict(optimizer="sgd", loss_fn=lambda out, y: out.sum()
                                                   if torch.is_tensor(out) else out.logits.sum())),
                                   (again, again_model, dict(optimizer="adam"))):
        fresh_model, fresh_inputs = second()
        fresh = capture(fresh_model, fresh_inputs, **kwargs)
        assert _facts(hit, hit_model) == _facts(fresh, fresh_model)
        for a, b in zip(_outputs(hit, inputs), _outputs(fresh, fresh_inputs), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_trace_that_pins_the_batch_size_serves_that_size_only():
    capture_cache.clear()
    torch.manual_seed(0)
    capture(PinnedBatch(), (torch.randn(4, 8),))
    before = capture_cache.stats()
    capture(PinnedBatch(), (torch.randn(6, 8),))
    after = capture_cache.stats()
    assert after["misses"] == before["misses"] + 1 and after["trace_hits"] == before["trace_hits"], (before, after)
    capture(PinnedBatch(), (torch.randn(4, 8),))
    assert capture_cache.stats()["hits"] == after["hits"] + 1


def test_a_pipeline_splits_fake_values_serve_the_next_capture_and_hold_no_model(monkeypatch):
    """What stage_split derives from the graph alone (every node's fake value, per input shapes) is
    kept with the cache entry: the next capture of the architecture (the next Engine's model) splits
    without running the graph again and gets the same value specs, and the first model is freed."""
    from runtime.parallel import stage_split

    capture_cache.clear()   # a GPT-2 split earlier in this process would have left its values
    runs = []
    real_run = stage_split._fake_run
    monkeypatch.setattr(stage_split, "_fake_run", lambda *a, **k: runs.append(a[2]) or real_run(*a, **k))

    def specs(model):
        graphs = capture(model, inputs)
        half = len(graphs.layers) // 2
        stages = {n: int(i >= half) for i, layer in enumerate(graphs.layers) for n in layer.nodes}
        return stage_split.split_stages(graphs.graph_module, stages).value_specs(inputs)

    torch.manual_seed(0)
    real = TRANSFORMERS["gpt2"]()
    inputs, _ = real.make_batch(2, torch.Generator().manual_seed(0))
    first_model = real.model
    first = weakref.ref(next(first_model.parameters()))
    before = specs(first_model)
    assert runs == [2, 3]
    second_model = TRANSFORMERS["gpt2"]().model
    assert specs(second_model) == before and runs == [2, 3], runs
    # a fake copy of the graph (what capture measures on, e.g. under autocast for a bf16 re-plan) shares
    # them: copying their fake tensors warned (torch's deepcopy reads a fake tensor's data pointer)
    module = capture(second_model, inputs).graph_module
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*data pointer of FakeTensor")
        copied = fake_copy(module, FakeTensorMode(allow_non_fake_inputs=True))
    assert copied.meta[capture_cache.DERIVED_META] is module.meta[capture_cache.DERIVED_META]
    del real, first_model
    gc.collect()
    assert first() is None, "the kept fake values refer to the first model"
