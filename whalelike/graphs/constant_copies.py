"""Values derived only from constants are recomputed in every Layer that uses them, never sent.

Real models compute a few tensors once in their own ``forward`` and use them in every block: the
position ids (``arange``), the causal mask, a rotary embedding's ``cos``/``sin`` tables (from the
``inv_freq`` buffer). They depend on no parameter and on no input *value* (at most on an input's
shape, e.g. the batch size that a mask is expanded to). Sent between pipeline stages they would be
boundary values like any other, but most have no batch dimension (``[1, seq, dim]``), so they
cannot be split by sample like activations, and they cost bandwidth for what is a few cheap
operators. Each Layer that uses one gets its own copy of the operators that compute it. Layer,
not TaskGraph: the planner may cut a pipeline stage between any two Layers (it moves Layers
between stages to balance them), so every Layer must be able to stand alone.

Invariant: after :func:`recompute_constants`, no constant-derived value crosses a Layer boundary
(hence no TaskGraph or stage boundary), and the graph computes exactly what it computed before
(the copies are the same operators on the same buffers).
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn

from whalelike.graphs.nodes import attribute, mutates
from whalelike.graphs.regions import Regions


def constant_derived(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes whose value depends on no parameter and on no input value (shape reads allowed)."""
    derived: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            if not isinstance(attribute(gm, node.target), nn.Parameter):
                derived.add(node)
        elif node.op == "call_function" and _reads_shape_of_input(node):
            derived.add(node)
        elif node.op in ("call_function", "call_method") and not mutates(node):
            if all(a in derived for a in node.all_input_nodes):
                derived.add(node)
    return derived


def recompute_constants(gm: fx.GraphModule, regions: Regions) -> int:
    """Copy the constant-derived operators each Layer uses from another Layer into it (before its
    first use); updates ``regions`` in place and returns the number of copies."""
    derived = constant_derived(gm)
    layer_of = regions.node_layer
    position = {n: i for i, n in enumerate(gm.graph.nodes)}  # copies are inserted, originals keep their order
    copies = 0
    for node in list(gm.graph.nodes):
        if node not in derived or node.name not in layer_of:
            continue
        foreign: dict[int, list[fx.Node]] = {}
        for user in node.users:
            if user.name in layer_of and layer_of[user.name] != layer_of[node.name]:
                foreign.setdefault(layer_of[user.name], []).append(user)
        for users in foreign.values():
            copies += _copy_into(gm, regions, node, min(users, key=position.get), users, derived)
    if copies:
        gm.graph.eliminate_dead_code()
        for name in set(layer_of) - {n.name for n in gm.graph.nodes}:
            del layer_of[name]
            regions.node_taskgraph.pop(name, None)
        gm.graph.lint()
        gm.recompile()
    return copies


def _copy_into(gm: fx.GraphModule, regions: Regions, value: fx.Node, first: fx.Node, users: list[fx.Node],
               derived: set[fx.Node]) -> int:
    """Copy ``value`` and its constant-derived ancestors before ``first``, the first of ``users``
    (all in one Layer), and make ``users`` read the copy."""
    closure: set[fx.Node] = set()
    stack = [value]
    while stack:
        node = stack.pop()
        if node in closure:
            continue
        closure.add(node)
        stack.extend(a for a in node.all_input_nodes if a in derived)
    order = [n for n in gm.graph.nodes if n in closure]
    taskgraph, layer = regions.node_taskgraph[first.name], regions.node_layer[first.name]
    mapping: dict[fx.Node, fx.Node] = {}
    with gm.graph.inserting_before(first):
        for node in order:
            copy = gm.graph.node_copy(node, lambda a: mapping.get(a, a))
            mapping[node] = copy
            derived.add(copy)   # a later copy of a user of ``value`` must copy this copy too
            regions.node_taskgraph[copy.name] = taskgraph
            regions.node_layer[copy.name] = layer
    for user in users:
        user.replace_input_with(value, mapping[value])
    return len(order)


def _reads_shape_of_input(node: fx.Node) -> bool:
    """``aten.sym_size(x, d)`` / ``x.size(d)`` of a model input: its shape, not its value."""
    if not node.args or not isinstance(node.args[0], fx.Node) or node.args[0].op != "placeholder":
        return False
    return isinstance(node.meta.get("val"), torch.SymInt) or "sym_size" in str(node.target)
