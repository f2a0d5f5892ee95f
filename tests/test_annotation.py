"""Annotation: scopes at construction time, in forward, and by module path, and their errors."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import whalelike as wl
from whalelike.errors import AnnotationError


class Stack(nn.Module):
    """embed -> blocks.0..3 -> head, with glue (a reshape) in the model's own forward."""

    def __init__(self, d: int = 8, n: int = 4):
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.ReLU()) for _ in range(n))
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x.reshape(x.shape[0], -1))


def owners(graphs, prefix: str) -> set[int]:
    """TaskGraph indices of the call_module nodes whose module path starts with ``prefix``."""
    return {graphs.node_taskgraph[n.name] for n in graphs.graph_module.graph.nodes
            if n.op == "call_module" and (n.target == prefix or n.target.startswith(prefix + "."))}


def test_annotate_exact_range_and_glob_map_nodes_to_taskgraphs():
    model = Stack()
    matched = wl.annotate(model, {"embed": wl.replicate(2), "blocks.0-1": wl.replicate(2),
                                  "blocks.[23]": wl.replicate(2), "head": wl.split(4)})
    assert matched["blocks.0-1"] == ["blocks.0", "blocks.1"]
    assert matched["blocks.[23]"] == ["blocks.2", "blocks.3"]
    g = wl.capture(model, (torch.randn(4, 8),))
    assert [str(t.strategy) for t in g] == ["replicate(2)", "replicate(2)", "replicate(2)", "split(4)"]
    assert owners(g, "embed") == {0}
    assert owners(g, "blocks.0") == owners(g, "blocks.1") == {1}
    assert owners(g, "blocks.2") == owners(g, "blocks.3") == {2}
    assert owners(g, "head") == {3}
    # the reshape in the model's own forward follows its data into the head's TaskGraph
    (reshape,) = [n for n in g.graph_module.graph.nodes if n.target == "reshape"]
    assert g.node_taskgraph[reshape.name] == 3
    assert g[3].shardable == {"head": 3}
    assert all(n.name in g.node_taskgraph for n in g.graph_module.graph.nodes if n.op not in ("placeholder", "output"))


def test_annotate_star_glob_and_nested_split_inside_replicate():
    model = Stack()
    wl.annotate(model, {"blocks.*": wl.replicate(2), "blocks.3.0": wl.split(2)})
    g = wl.capture(model, (torch.randn(4, 8),))
    strategies = [str(t.strategy) for t in g]
    # the un-annotated embed joins the first annotated region after it, the un-annotated head the
    # last one before it: no stage nobody asked for
    assert strategies == ["replicate(2)", "replicate(2)+split(2)", "replicate(2)"]
    assert owners(g, "embed") == {0} and owners(g, "head") == {2}
    assert owners(g, "blocks.3.0") == {1}
    assert g[1].shardable == {"blocks.3.0": 8}


def test_one_strategy_object_in_several_entries_is_one_region():
    model = Stack()
    tail = wl.split(2)
    wl.annotate(model, {"blocks.0-1": wl.replicate(2), "blocks.3": tail, "head": tail})
    g = wl.capture(model, (torch.randn(4, 8),))
    assert [str(t.strategy) for t in g] == ["replicate(2)", "split(2)"]
    assert owners(g, "blocks.3") == owners(g, "head") == {1} and owners(g, "blocks.2.0") == {0}


def test_unannotated_parameters_join_a_split_region_unsharded():
    model = Stack()
    wl.annotate(model, {"blocks.0-3": wl.replicate(2), "head": wl.split(2)})
    g = wl.capture(model, (torch.randn(4, 8),))
    assert [str(t.strategy) for t in g] == ["replicate(2)", "split(2)"]
    assert owners(g, "embed") == {0} and owners(g, "head") == {1}
    model = Stack()
    wl.annotate(model, {"embed": wl.split(2)})   # the rest follows the split region, and is not sharded there
    g = wl.capture(model, (torch.randn(4, 8),))
    assert [str(t.strategy) for t in g] == ["split(2)"]
    assert set(g[0].shardable) == {"embed"}


def test_construction_time_scopes():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            with wl.replicate(2):
                self.a = nn.Linear(4, 4)
            with wl.replicate(2):
                self.b = nn.Linear(4, 4)
            self.c = nn.Linear(4, 4)  # un-annotated: joins the region before it
            with wl.split(2):
                self.d = nn.Linear(4, 6)

        def forward(self, x):
            return self.d(self.c(self.b(self.a(x))))

    g = wl.capture(Net(), (torch.randn(2, 4),))
    assert [str(t.strategy) for t in g] == ["replicate(2)", "replicate(2)", "split(2)"]
    assert [owners(g, p) for p in "abcd"] == [{0}, {1}, {1}, {2}]


def test_forward_time_scopes():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 5)

        def forward(self, x):
            with wl.replicate(2):
                x = torch.relu(self.a(x))
                x = self.b(x)
            with wl.split(2):
                return self.c(x)

    g = wl.capture(Net(), (torch.randn(2, 4),))
    assert [str(t.strategy) for t in g] == ["replicate(2)", "split(2)"]
    assert owners(g, "a") == owners(g, "b") == {0} and owners(g, "c") == {1}
    (relu,) = [n for n in g.graph_module.graph.nodes if n.target is torch.relu]
    assert g.node_taskgraph[relu.name] == 0


def test_set_default_strategy_applies_to_unannotated_code():
    wl.set_default_strategy(wl.replicate(3))
    try:
        g = wl.capture(Stack(), (torch.randn(2, 8),))
    finally:
        wl.set_default_strategy(None)
    assert len(g) == 1 and str(g[0].strategy) == "replicate(3)"


@pytest.mark.parametrize("outer, inner", [(wl.replicate, wl.replicate), (wl.split, wl.split), (wl.split, wl.replicate)])
def test_bad_nesting_is_one_line_error(outer, inner):
    with pytest.raises(AnnotationError, match="only allowed nesting is split inside replicate") as e:
        with outer(2):
            with inner(2):
                pass
    assert "\n" not in str(e.value)
    assert wl.strategy.current_scope() is None  # the stack unwound


class _NestedInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        with wl.split(2):
            with wl.replicate(2):
                return self.a(x)


def test_bad_nesting_inside_forward_is_the_annotation_error_not_a_capture_failure():
    """A scope misused in forward fails capture with the scope's own one-line message: not wrapped
    as both tracers failing, with advice about data-dependent control flow."""
    with pytest.raises(AnnotationError, match="cannot open replicate.2. inside split.2.") as e:
        wl.capture(_NestedInForward(), (torch.randn(4, 8),))
    assert "torch.export" not in str(e.value) and "\n" not in str(e.value)
    assert wl.strategy.current_scope() is None


def test_bad_nesting_through_annotate():
    with pytest.raises(AnnotationError, match="only allowed nesting"):
        wl.annotate(Stack(), {"blocks": wl.split(2), "blocks.1": wl.split(2)})


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_bad_device_count(bad):
    with pytest.raises(AnnotationError, match="device_count") as e:
        wl.replicate(bad)
    assert "\n" not in str(e.value)
    with pytest.raises(AnnotationError, match="device_count"):
        wl.split(bad)


def test_unknown_path_lists_close_matches():
    with pytest.raises(AnnotationError) as e:
        wl.annotate(Stack(), {"block.1": wl.replicate()})
    message = str(e.value)
    assert "\n" not in message and "'block.1'" in message and "blocks.1" in message


def test_range_with_missing_members_and_overlap_are_errors():
    with pytest.raises(AnnotationError, match="blocks.4, blocks.5"):
        wl.annotate(Stack(), {"blocks.2-5": wl.replicate()})
    with pytest.raises(AnnotationError, match="matched by both"):
        wl.annotate(Stack(), {"blocks.0-1": wl.replicate(), "blocks.1": wl.replicate()})
    with pytest.raises(AnnotationError, match="must be wl.replicate"):
        wl.annotate(Stack(), {"head": "split"})
