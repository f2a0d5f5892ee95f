"""Assign every node of a captured graph to a TaskGraph and a Layer.

The rule, in order of precedence, for a node's scope:

1. the forward-time scope open when the node was traced (``with wl.split():`` in ``forward``);
2. else the scope of the innermost enclosing module tagged ``_wl_scope`` (construction time or
   :func:`whalelike.annotate`);
3. else, if the node itself uses parameters (a ``call_module`` of a module that has them, or an
   operator fed by a parameter): the strategy set by :func:`whalelike.set_default_strategy` if the
   user set one; otherwise the node *attaches* to a neighbour: the scope of its latest annotated
   ancestor (code after a region belongs to it: GPT-2's final ``ln_f``, BERT's pooler, a classifier
   after the last annotated block), else of its earliest annotated descendant (code before the
   first region joins it: the embeddings), else the default ``replicate()``. In a ``split``
   region such code is never sharded (``node.meta["wl_attached"]``; the shard analysis leaves it
   out): ``split`` shards only what the user put under it, the rest runs whole on every
   tensor-parallel rank and is priced so.
   So un-annotated code never forms a pipeline stage nobody asked for; its Layer keeps its own name;
4. else the node is *glue* (reshapes, the positional ``arange``, the attention-mask arithmetic in
   a model's own ``forward``, ``getitem`` on a block's tuple output, a bias buffer added to the
   logits): it follows its data, joining the scope and layer of its first scoped consumer, else of
   its last scoped producer, through chains of glue (a buffer reshaped, then added to the head's
   output, joins the head), else the operators of its own module, else the default strategy.
   Otherwise every ``view`` between two annotated blocks, or the model's own arithmetic on its
   logits, would become a TaskGraph of its own (no FLOPs, a whole device).

Nodes are then stably re-ordered (a topological order that prefers earlier scopes and layers, and
keeps in-place operators in their original order relative to the other users of what they mutate),
so a glue node computed early (a mask built before the embeddings) sits with the region that uses
it. A TaskGraph is a maximal run of consecutive nodes of one scope, numbered in execution order; a
Layer is a maximal run of one layer name inside one TaskGraph.

Layer names: a node's module path truncated after the first numbered child of a container
(``transformer.h.3.attn.c_attn`` -> ``transformer.h.3``), else to one level below the deepest
module that holds such a container (``transformer.wte``), else to the top-level child
(``lm_head``). Code of the model's own ``forward`` is named ``<root>``.
"""
from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass
from typing import Optional

import torch.fx as fx
import torch.nn as nn

from whalelike.graphs.nodes import attribute, mutates
from whalelike.strategy import Strategy, default_strategy, default_strategy_is_set

log = logging.getLogger(__name__)

ROOT_LAYER = "<root>"
ATTACHED_META = "wl_attached"   # node meta: un-annotated parameter code placed by rule 3 (never sharded)


@dataclass(frozen=True)
class Regions:
    """The result: per node name its TaskGraph and layer index; per TaskGraph its strategy; per layer its name."""

    node_taskgraph: dict[str, int]
    node_layer: dict[str, int]
    strategies: list[Strategy]
    layer_names: list[str]
    layer_taskgraph: list[int]


def assign_regions(gm: fx.GraphModule, model: nn.Module) -> Regions:
    """Assign scopes and layers to the nodes of ``gm`` (re-ordering its graph in place, see module doc)."""
    modules = dict(model.named_modules())
    body = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    namer = _LayerNamer(modules)
    scope: dict[fx.Node, Optional[Strategy]] = {}
    layer: dict[fx.Node, str] = {}
    attached: list[fx.Node] = []
    for node in body:
        scope[node] = _explicit_scope(node, modules, gm)
        layer[node] = namer(node.meta.get("wl_path", ""))
        if scope[node] is None and _uses_parameters(node, gm):
            attached.append(node)
    _attach_parameter_code(body, attached, scope)
    explicit = [n for n in body if scope[n] is not None]
    _resolve_glue(body, scope, layer)
    _attach_root_code(body, scope, layer, gm)
    _reorder(gm, body, explicit, scope, layer)

    ordered = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    node_tg: dict[str, int] = {}
    node_layer: dict[str, int] = {}
    strategies: list[Strategy] = []
    layer_names: list[str] = []
    layer_tg: list[int] = []
    prev_scope, prev_layer = None, None
    for node in ordered:
        s, l = scope[node].scope_id, layer[node]
        if s != prev_scope:
            if any(x.scope_id == s for x in strategies):
                log.info("scope %s runs in more than one contiguous stretch; each becomes its own TaskGraph", scope[node])
            strategies.append(scope[node])
        if s != prev_scope or l != prev_layer:
            layer_names.append(l)
            layer_tg.append(len(strategies) - 1)
        node_tg[node.name] = len(strategies) - 1
        node_layer[node.name] = len(layer_names) - 1
        prev_scope, prev_layer = s, l
    return Regions(node_tg, node_layer, strategies, layer_names, layer_tg)


# -- scopes -----------------------------------------------------------------------------------------
def _explicit_scope(node: fx.Node, modules: dict[str, nn.Module], gm: fx.GraphModule) -> Optional[Strategy]:
    if node.meta.get("wl_scope") is not None:
        return node.meta["wl_scope"]
    path = node.meta.get("wl_path", "")
    parts = path.split(".") if path else []
    for k in range(len(parts), -1, -1):
        module = modules.get(".".join(parts[:k]))
        tag = getattr(module, "_wl_scope", None)
        if tag is not None:
            return tag
    return default_strategy() if default_strategy_is_set() and _uses_parameters(node, gm) else None


def _attach_parameter_code(body: list[fx.Node], attached: list[fx.Node], scope: dict) -> None:
    """Un-annotated nodes with parameters take the scope of their latest annotated ancestor, else
    of their earliest annotated descendant, else the default (rule 3 of the module docstring)."""
    position = {n: i for i, n in enumerate(body)}
    annotated = {n for n in body if scope[n] is not None}

    def nearest(node: fx.Node, step, pick) -> Optional[fx.Node]:
        found, seen, frontier = [], {node}, [node]
        while frontier:
            current = frontier.pop()
            for other in step(current):
                if other in seen or other not in position:
                    continue
                seen.add(other)
                (found if other in annotated else frontier).append(other)
        return pick(found, key=position.get) if found else None

    for node in attached:
        neighbour = (nearest(node, lambda n: n.all_input_nodes, max)
                     or nearest(node, lambda n: list(n.users), min))
        scope[node] = scope[neighbour] if neighbour is not None else default_strategy()
        node.meta[ATTACHED_META] = True


def _uses_parameters(node: fx.Node, gm: fx.GraphModule) -> bool:
    if node.op == "call_module":
        return any(True for _ in gm.get_submodule(node.target).parameters())
    if node.op == "get_attr":
        return False
    return any(a.op == "get_attr" and isinstance(attribute(gm, a.target), nn.Parameter) for a in node.all_input_nodes)


def _resolve_glue(body: list[fx.Node], scope: dict, layer: dict) -> None:
    """Glue follows its first scoped consumer, else its last scoped producer, until nothing changes;
    only glue that no scoped node reaches that way takes the other operators of its own module's
    scope (a BatchNorm's ``num_batches_tracked += 1`` has no data neighbours), else the default,
    one node at a time in graph order (what follows it may then follow it).

    Until nothing changes: glue fed only by a buffer or constant whose consumer is glue too (a bias
    buffer reshaped and scaled in the model's own ``forward`` before it is added to the logits) is
    reached through that consumer once the consumer has followed its producer (the head). Deciding
    it in one sweep instead gave it the default strategy: a TaskGraph of its own with no FLOPs,
    which took a whole device."""
    position = {n: i for i, n in enumerate(body)}
    module_scope: dict[str, fx.Node] = {}
    for node in body:
        if scope[node] is not None:
            module_scope.setdefault(node.meta.get("wl_path", ""), node)
    while True:
        _follow_data(body, scope, layer, position)
        pending = next((n for n in body if scope[n] is None and n.op != "get_attr"), None)
        if pending is None:
            break
        sibling = module_scope.get(pending.meta.get("wl_path", ""))
        if sibling is not None and pending.meta.get("wl_path"):  # a buffer update: its module's scope
            scope[pending], layer[pending] = scope[sibling], layer[sibling]
        else:
            scope[pending] = default_strategy()
    for node in body:  # a parameter or buffer read goes where it is used
        if scope[node] is None:
            users = sorted((u for u in node.users if u in position), key=position.get)
            scope[node], layer[node] = (scope[users[0]], layer[users[0]]) if users else (default_strategy(), layer[node])


def _follow_data(body: list[fx.Node], scope: dict, layer: dict, position: dict) -> None:
    """Give unscoped nodes the scope and layer of their first scoped consumer (a ``get_attr``
    too), else of their last scoped producer (not a ``get_attr``), sweeping until nothing changes."""
    changed = True
    while changed:
        changed = False
        for node in reversed(body):
            if scope[node] is not None:
                continue
            users = sorted((u for u in node.users if u in position and scope.get(u) is not None), key=position.get)
            if users:
                scope[node], layer[node] = scope[users[0]], layer[users[0]]
                changed = True
        for node in body:
            if scope[node] is not None or node.op == "get_attr":
                continue
            inputs = [a for a in node.all_input_nodes if a in position and scope[a] is not None and a.op != "get_attr"]
            if inputs:
                last = max(inputs, key=position.get)
                scope[node], layer[node] = scope[last], layer[last]
                changed = True


def _attach_root_code(body: list[fx.Node], scope: dict, layer: dict, gm: fx.GraphModule) -> None:
    """Parameter-free code of the model's own ``forward`` (a ``flatten`` between two blocks) joins
    the layer of its first consumer in the same scope, else of its last producer there."""
    position = {n: i for i, n in enumerate(body)}
    for node in reversed(body):
        if layer[node] == ROOT_LAYER and not _uses_parameters(node, gm):
            users = sorted((u for u in node.users if u in position and scope[u] is scope[node]
                            and layer[u] != ROOT_LAYER), key=position.get)
            if users:
                layer[node] = layer[users[0]]
    for node in body:
        if layer[node] == ROOT_LAYER and not _uses_parameters(node, gm):
            inputs = [a for a in node.all_input_nodes if a in position and scope[a] is scope[node]
                      and layer[a] != ROOT_LAYER]
            if inputs:
                layer[node] = layer[max(inputs, key=position.get)]


# -- ordering ---------------------------------------------------------------------------------------
def _reorder(gm: fx.GraphModule, body: list[fx.Node], explicit: list[fx.Node], scope: dict, layer: dict) -> None:
    """Topological order preferring earlier scopes, then earlier layers (both ranked by where the
    user's own code first uses them), then the original order."""
    position = {n: i for i, n in enumerate(body)}
    scope_rank: dict[int, int] = {}
    layer_rank: dict[str, int] = {}
    for n in explicit + body:
        scope_rank.setdefault(scope[n].scope_id, len(scope_rank))
        layer_rank.setdefault(layer[n], len(layer_rank))
    preds: dict[fx.Node, set[fx.Node]] = {n: {a for a in n.all_input_nodes if a in position} for n in body}
    for n in body:
        if mutates(n) and n.args and isinstance(n.args[0], fx.Node):
            for other in n.args[0].users:
                if other is n or other not in position:
                    continue
                if position[other] < position[n]:
                    preds[n].add(other)
                else:
                    preds[other].add(n)
    succs: dict[fx.Node, list[fx.Node]] = {n: [] for n in body}
    for n, ps in preds.items():
        for p in ps:
            succs[p].append(n)
    waiting = {n: len(ps) for n, ps in preds.items()}

    def key(n):
        return (scope_rank[scope[n].scope_id], layer_rank[layer[n]], position[n])

    ready = [key(n) for n in body if waiting[n] == 0]
    heapq.heapify(ready)
    order: list[fx.Node] = []
    while ready:
        n = body[heapq.heappop(ready)[2]]
        order.append(n)
        for s in succs[n]:
            waiting[s] -= 1
            if waiting[s] == 0:
                heapq.heappush(ready, key(s))
    if order == body:
        return
    anchor = next(n for n in gm.graph.nodes if n.op == "output")
    for n in order:
        anchor.prepend(n)
    gm.graph.lint()
    gm.recompile()


# -- layer names ------------------------------------------------------------------------------------
class _LayerNamer:
    """Maps a module path to the name of the layer it belongs to (see module docstring)."""

    def __init__(self, modules: dict[str, nn.Module]):
        self.containers = {
            p for p, m in modules.items()
            if isinstance(m, (nn.ModuleList, nn.Sequential)) or (m._modules and all(k.isdigit() for k in m._modules))
        }
        self.holders = {p.rpartition(".")[0] for p in self.containers}

    def __call__(self, path: str) -> str:
        if not path:
            return ROOT_LAYER
        parts = path.split(".")
        for k in range(1, len(parts)):
            if ".".join(parts[:k]) in self.containers and parts[k].isdigit():
                return ".".join(parts[:k + 1])
        for k in range(len(parts) - 1, 0, -1):
            if ".".join(parts[:k]) in self.holders:
                return ".".join(parts[:k + 1])
        return parts[0]
