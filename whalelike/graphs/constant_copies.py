"""Values that depend on no input value are recomputed in every Layer that uses them, never sent.

Real models compute a few tensors once in their own ``forward`` and use them in every block: the
position ids (``arange``), the causal mask, a rotary embedding's ``cos``/``sin`` tables (from the
``inv_freq`` buffer), DeBERTa's relative-position buckets (``arange`` of the sequence length, then
log buckets) and its normalised relative embeddings (``LayerNorm(rel_embeddings.weight)``). They
depend on constants, buffers, parameters and input *shapes* (the sequence length; the batch size a
mask is expanded to), never on an input's values. Sent between pipeline stages they would be
boundary values like any other, but most have no batch dimension (``[1, seq, seq]``), so they
cannot be split by sample like activations, and they cost bandwidth for what is a few cheap
operators. Each Layer that uses one gets its own copy of the operators that compute it. Layer,
not TaskGraph: the planner may cut a pipeline stage between any two Layers (it moves Layers
between stages to balance them), so every Layer must be able to stand alone. A copy that reads a
parameter makes the stages holding it share that parameter: the stage split gives each the same
``nn.Parameter`` and :mod:`runtime.parallel.tied_weights` sums their gradients, exactly as for tied
embeddings, so the gradient equals the single-process one.

What counts as data-free (:func:`data_free`): ``get_attr`` (constants, buffers, parameters), a
shape read of a model input (``aten.sym_size``, ``x.size(d)``, ``x.shape``), and an operator all of
whose inputs are data-free, unless it draws random numbers (``dropout``, ``rand``: a copy would draw
other numbers than the original) or writes to a value someone else can see. Writing in place to a
fresh value that only this operator reads is allowed (``torch.export`` turns ``torch.tensor(3)``
into ``lift_fresh_copy`` followed by ``detach_``: the copy is private, so copying both keeps the
value). A submodule call (``call_module``) counts when the module has no buffers (a BatchNorm
would update its statistics once per copy) and is not a dropout. Values computed from an input's
*values* with no batch dimension (a statistic of the batch) are data: they cross stages whole,
once per micro-batch (:mod:`runtime.parallel.boundaries`).

Invariant: after :func:`recompute_constants`, no data-free computed value crosses a Layer boundary
(hence no TaskGraph or stage boundary), and the graph computes exactly what it computed before
(the copies are the same operators on the same buffers and parameters).
"""
from __future__ import annotations

import logging

import torch
import torch.fx as fx
import torch.nn as nn

from whalelike.graphs.nodes import attribute, mutates
from whalelike.graphs.regions import Regions

log = logging.getLogger(__name__)

_SHAPE_METHODS = {"size", "dim"}
_SHAPE_ATTRIBUTES = {"shape", "ndim", "dtype", "device"}


def data_free(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes whose value depends on no input value: on constants, buffers, parameters and input
    shapes only (the rules in the module docstring)."""
    derived: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            derived.add(node)
        elif _reads_shape_of_input(node):
            derived.add(node)
        elif node.op in ("call_function", "call_method", "call_module"):
            if all(a in derived for a in node.all_input_nodes) and _repeatable(gm, node):
                derived.add(node)
    return derived


def recompute_constants(gm: fx.GraphModule, regions: Regions) -> int:
    """Copy the data-free operators each Layer uses from another Layer into it (before its first
    use); updates ``regions`` in place and returns the number of copies. A parameter read directly
    by several Layers (tied weights) is left alone: the stage split shares a bare parameter itself."""
    derived = data_free(gm)
    layer_of = regions.node_layer
    position = {n: i for i, n in enumerate(gm.graph.nodes)}  # copies are inserted, originals keep their order
    copies = 0
    for node in list(gm.graph.nodes):
        if node not in derived or node.name not in layer_of or _is_parameter(gm, node):
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
        _drop_empty(regions)
        gm.graph.lint()
        gm.recompile()
    return copies


def _drop_empty(regions: Regions) -> None:
    """Remove the Layers, and then the TaskGraphs, left without a node (a module that only computed
    values every user now recomputes, a learned position table say), renumbering the rest in
    order: an empty Layer would otherwise become a pipeline stage that computes nothing."""
    kept_layers = sorted(set(regions.node_layer.values()))
    if len(kept_layers) == len(regions.layer_names):
        return
    log.info("capture: layer(s) %s only computed values their users now recompute; dropped",
             ", ".join(repr(regions.layer_names[i]) for i in range(len(regions.layer_names)) if i not in kept_layers))
    kept_graphs = sorted({regions.layer_taskgraph[i] for i in kept_layers})
    layer_index = {old: new for new, old in enumerate(kept_layers)}
    graph_index = {old: new for new, old in enumerate(kept_graphs)}
    regions.node_layer.update((name, layer_index[i]) for name, i in regions.node_layer.items())
    regions.node_taskgraph.update((name, graph_index[t]) for name, t in regions.node_taskgraph.items())
    regions.layer_names[:] = [regions.layer_names[i] for i in kept_layers]
    regions.layer_taskgraph[:] = [graph_index[regions.layer_taskgraph[i]] for i in kept_layers]
    regions.strategies[:] = [regions.strategies[t] for t in kept_graphs]


def _copy_into(gm: fx.GraphModule, regions: Regions, value: fx.Node, first: fx.Node, users: list[fx.Node],
               derived: set[fx.Node]) -> int:
    """Copy ``value`` and its data-free ancestors before ``first``, the first of ``users`` (all in
    one Layer), and make ``users`` read the copy."""
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


def _repeatable(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether running a copy of ``node`` gives its value and changes nothing else: no random
    numbers, no write to a value another node reads, no module state."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        return not any(True for _ in module.buffers()) and not isinstance(module, nn.modules.dropout._DropoutNd)
    if _random(node):
        return False
    if not mutates(node):
        return True
    written = _written_inputs(node)
    return all(w.op not in ("get_attr", "placeholder") and len(w.users) == 1 for w in written)


def _random(node: fx.Node) -> bool:
    """Whether ``node`` draws random numbers (an aten operator tagged ``nondeterministic_seeded``:
    ``rand``, ``dropout``, ``bernoulli_``; a Python function or method is looked up by name)."""
    target = node.target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        packet = target.overloadpacket if isinstance(target, torch._ops.OpOverload) else target
    else:
        name = target if isinstance(target, str) else getattr(target, "__name__", "")
        packet = getattr(torch.ops.aten, name, None) if name else None
    if packet is None:
        return False
    return any(torch.Tag.nondeterministic_seeded in getattr(packet, o).tags for o in packet.overloads())


def _written_inputs(node: fx.Node) -> list[fx.Node]:
    """The inputs ``node`` writes to: its schema's ``(a!)`` arguments, else (an in-place method or
    Python operator) its first argument."""
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        written = []
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
                if isinstance(value, fx.Node):
                    written.append(value)
        return written
    return [node.args[0]] if node.args and isinstance(node.args[0], fx.Node) else []


def _is_parameter(gm: fx.GraphModule, node: fx.Node) -> bool:
    return node.op == "get_attr" and isinstance(attribute(gm, node.target), nn.Parameter)


def _reads_shape_of_input(node: fx.Node) -> bool:
    """A shape read of a model input, not its value: ``aten.sym_size(x, d)`` (export), ``x.size(d)``,
    ``x.dim()`` or ``x.shape`` (fx)."""
    if not node.args or not isinstance(node.args[0], fx.Node) or node.args[0].op != "placeholder":
        return False
    if node.op == "call_method":
        return node.target in _SHAPE_METHODS
    if node.op != "call_function":
        return False
    if node.target is getattr:
        return len(node.args) > 1 and node.args[1] in _SHAPE_ATTRIBUTES
    return isinstance(node.meta.get("val"), torch.SymInt) or "sym_size" in str(node.target)
