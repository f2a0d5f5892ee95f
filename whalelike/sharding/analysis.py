"""Which projections of a ``split`` region shard together, found from the dataflow of the graph.

Megatron shards a transformer block by hand: q/k/v and the MLP's first projection by output
features, the attention output and the MLP's last projection by input features, every view in
between rewritten for the local head count. Here the same is *derived* from the captured graph
(fx or ``torch.export``, so ``call_method view`` and ``aten.view.default`` alike): a "sharded
dimension" is propagated forward from every column-sharded projection through the operators
between it and the next projections, and each set of projections it connects becomes a
:class:`~whalelike.sharding.groups.ShardGroup`.

:func:`analyse_blocks` is the driver: it runs the propagation (:mod:`whalelike.sharding.propagation`,
whose docstring lists the operator rules that keep a sharded value exact) over the region. Any
group the propagation breaks (a consumer outside the region, the graph output, a reduction over
the sharded dimension, a view that mixes it with another dimension, an operator without a rule),
that never reaches a row projection, or whose sizes have no common divisor above 1, falls back:
its column projections are re-analysed as lone ones (output gathered) and the propagation runs
again until no group breaks, so what cannot be proven exact falls back, never silently wrong.
Multi-query attention (one key/value head, which cannot be cut into units) breaks its group
first; the driver then retries it once the Megatron way (:func:`_replicated_kv`): the k/v
projections are *replicated* (whole on every rank, in ``BlockAnalysis.replicated_projections``,
never a group member, so no plan ``shard_sizes`` entry and no share of the group's FLOPs: the
planner prices them as unsharded work), q and o are cut by query heads (a unit is one query head),
and the repeat_kv ``expand``/``reshape`` are cut to the rank's query heads. Only if that breaks too
do q/k/v/o fall back to lone projections. Grouped-query attention whose key/value heads can be
cut never reaches the retry, so it keeps key/value heads as units.

A projection with one output feature (a gate ``Linear(d, 1)``: Qwen2-MoE's ``shared_expert_gate``)
has nothing to cut: as a group's column it would leave the group no unit (gcd 1), as a lone
projection it would cap the whole region at one device. It is replicated from the start like
multi-query k/v (``replicated_projections``, with its reason in ``whole_reasons``): every rank
computes it whole on the same input, its output a replicated value (broadcast along a sharded
dimension if it meets one, its gradient then summed over the group), priced as unsharded work.

The views: :class:`BlockAnalysis` (groups, lone projections, what the runtime rewrites),
:func:`shard_groups_of` / :func:`shardable_fields` (the TaskGraph's plain data at capture),
:func:`stamp_nodes` / :func:`taskgraph_of` (node meta the stage graphs keep).

The runtime (:mod:`runtime.tensor.block_sharding`) replays the analysis on each stage graph and
rewrites the recorded shape constants to the rank's local sizes.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional

import torch.fx as fx

from whalelike.graphs.regions import ATTACHED_META
from whalelike.sharding.experts import experts_groups, find_experts, log_skipped
from whalelike.sharding.groups import ShardGroup, ShardMember
from whalelike.sharding.propagation import SDPA, SHAPES_META, Propagation, Sharded, projection_dims, target_is
from whalelike.sharding.propagation import full_shapes  # noqa: F401 - re-exported: public here before the split

TASKGRAPH_META = "wl_taskgraph"  # node.meta key: the TaskGraph index (node names change when stages are cut)


# -- what the analysis returns ----------------------------------------------------------------------
@dataclass
class Group:
    """One valid group of a graph: its column and row projection nodes and its units."""

    columns: list[fx.Node]
    rows: list[fx.Node]
    units: int
    kind: str
    pieces: dict[fx.Node, tuple[int, ...]] = field(default_factory=dict)
    nodes: set[fx.Node] = field(default_factory=set)  # every node whose output is sharded, projections included


@dataclass
class BlockAnalysis:
    """The groups of a split region, the lone projections, and what the runtime must rewrite:
    ``state`` of every sharded value, ``reshapes`` (view/reshape/expand whose output dimension
    ``dim`` carries the full size) and ``splits`` (split of a fused output: dim, full piece sizes),
    ``replicated_operands`` (node, argument) pairs where a replicated tensor meets a sharded one
    (its gradient is partial on each rank and must be summed), ``slices`` (index slices of a
    fused projection's output) and ``cut_operands`` (per-head biases added to attention scores,
    replicated with the sharded dimension's full size, that each rank cuts to its heads; the rule
    is in :mod:`whalelike.sharding.propagation`)."""

    groups: list[Group]
    lone: list[fx.Node]
    state: dict[fx.Node, Sharded]
    reshapes: dict[fx.Node, Sharded]
    splits: dict[fx.Node, tuple[int, tuple[int, ...]]]
    replicated_operands: list[tuple[fx.Node, fx.Node]]
    fallbacks: dict[str, str]   # projection node name -> why it was not sharded with a group
    replicated_projections: list[fx.Node] = field(default_factory=list)   # whole on every rank (MQA's k/v, gates)
    whole_reasons: dict[str, str] = field(default_factory=dict)   # replicated projection node name -> why
    # index slices of a fused projection's output: slice node -> (dim, full piece sizes, which piece)
    slices: dict[fx.Node, tuple[int, tuple[int, ...], int]] = field(default_factory=dict)
    # (node, replicated operand, operand dim): a per-head bias added to attention scores, of the sharded
    # dimension's full size: each rank reads its own heads of it, and its gradient is summed over the group
    cut_operands: list[tuple[fx.Node, fx.Node, int]] = field(default_factory=list)

    def group_of(self, node: fx.Node) -> Optional[Group]:
        for g in self.groups:
            if node in g.columns or node in g.rows:
                return g
        return None


def stamp_nodes(gm: fx.GraphModule, outputs: Mapping[str, Iterable], node_taskgraph: Mapping[str, int]) -> None:
    """Record each node's full output shapes (``NodeCosts.outputs``: a ``NodeOutputSpec`` per tensor)
    and TaskGraph in ``node.meta``, where the analysis and the runtime find them again on the stage
    graphs cut from ``gm`` (which copy the meta but may rename the nodes)."""
    for node in gm.graph.nodes:
        specs = outputs.get(node.name)
        if specs is not None:
            node.meta[SHAPES_META] = [tuple(s.shape) for s in specs]
        if node.name in node_taskgraph:
            node.meta[TASKGRAPH_META] = node_taskgraph[node.name]


def taskgraph_of(node: fx.Node, node_taskgraph: Mapping[str, int]) -> Optional[int]:
    """The TaskGraph of ``node`` of a captured graph or of a stage cut from it."""
    return node.meta.get(TASKGRAPH_META, node_taskgraph.get(node.name))


# -- the driver -------------------------------------------------------------------------------------
def analyse_blocks(gm: fx.GraphModule, region: Iterable[str]) -> BlockAnalysis:
    """Shard groups of the nodes named in ``region`` (a split TaskGraph's nodes) of ``gm``.

    Runs the propagation until no group breaks: a broken group's column projections become lone
    projections and the rest is re-analysed without them. A broken group whose attention reads k/v
    that cannot be cut (multi-query attention) first gets one retry with the k/v projections
    replicated (:func:`_replicated_kv`); if that breaks too, they fall back like the rest.
    Pure: ``gm`` is not modified.
    """
    region = set(region)
    narrow = _one_output_projections(gm, region)
    demoted: set[str] = set()
    fallbacks: dict[str, str] = {}
    attempts: dict[str, set[str]] = {}   # attention node -> its k/v projections, replicated while it holds
    tried: set[str] = set()
    while True:
        prop = Propagation(gm, region, demoted, frozenset(narrow).union(*attempts.values()), frozenset(attempts))
        prop.run()
        bad = {}
        for root in {prop.find(g) for g in prop.parent}:
            units = math.gcd(*prop.sizes[root])
            if root in prop.broken:
                bad[root] = prop.broken[root]
            elif not prop.rows.get(root):
                bad[root] = "its sharded output never reaches a row projection"
            elif units < 2:
                bad[root] = "its sharded dimensions have no common divisor above 1 (nothing to cut into units)"
        for name, kv in list(attempts.items()):
            attention = next(n for n in gm.graph.nodes if n.name == name)
            root = prop.find(prop.state[attention].group) if attention in prop.state else None
            if root is None or root in bad:
                del attempts[name]
                demoted |= kv
                for column in kv:
                    fallbacks[column] = ("key/value projection of multi-query attention whose query heads could not be "
                                         f"sharded ({bad.get(root, 'the query projection fell back')})")
        if not bad:
            break
        new = _replicated_kv(prop, bad, tried)
        tried |= set(new)
        attempts.update(new)
        # the groups of the retried queries and k/v projections are re-analysed, not demoted, this round
        retried_nodes = [a.args[0] for a in _nodes(gm, new)] + _nodes(gm, set().union(*new.values()))
        retried = {prop.find(prop.state[n].group) for n in retried_nodes if n in prop.state}
        for root, reason in bad.items():
            if root in retried:
                continue
            for column in prop.columns[root]:
                demoted.add(column.name)
                fallbacks[column.name] = reason
    whole = {name: "one output feature: nothing to cut, computed whole on every rank" for name in narrow}
    whole.update({name: "key/value of multi-query attention" for name in set().union(*attempts.values())})
    return _result(prop, fallbacks, whole)


def _one_output_projections(gm: fx.GraphModule, region: set[str]) -> set[str]:
    """Projections of the region with one output feature (a gate ``Linear(d, 1)``): as a column
    projection of a group its single feature leaves the group no unit to cut (gcd 1), and as a
    lone projection it caps the whole region at one device. It stays whole instead: every rank of
    the group computes it on the same input (a replicated value), which is exact, and it is
    priced as unsharded work. One that reads a sharded value as its input features is still a
    row projection of that value's group (:meth:`Propagation.visit_projection` checks that first)."""
    out = set()
    for node in gm.graph.nodes:
        if node.name in region and node.op == "call_module":
            dims = projection_dims(gm.get_submodule(node.target))
            if dims is not None and dims[1] == 1:
                out.add(node.name)
    return out


def _nodes(gm: fx.GraphModule, names: Iterable[str]) -> list[fx.Node]:
    names = set(names)
    return [n for n in gm.graph.nodes if n.name in names]


def _replicated_kv(prop: Propagation, bad: Mapping[int, str], tried: set[str]) -> dict[str, set[str]]:
    """Multi-query attention to retry: ``scaled_dot_product_attention`` nodes whose query is sharded
    in a broken group, with the column projections that feed only its key and value (not its query)
    to replicate. Megatron's answer to one key/value head: q and o sharded by query heads, k and v
    whole on every rank."""
    out = {}
    columns = {c.name for cs in prop.columns.values() for c in cs}
    for node in prop.gm.graph.nodes:
        if node.name not in prop.region or node.name in tried or not target_is(node, SDPA):
            continue
        q, k, v = node.args[:3]
        if q not in prop.state or prop.find(prop.state[q].group) not in bad:
            continue
        kv = _projections_above(prop, [k, v]) - _projections_above(prop, [q])
        if kv and kv <= columns:
            out[node.name] = kv
    return out


def _projections_above(prop: Propagation, values: list) -> set[str]:
    """Names of the nearest projections of the region that ``values`` are computed from."""
    found, seen, todo = set(), set(), [v for v in values if isinstance(v, fx.Node)]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.name in prop.region and prop.projection(node) is not None:
            found.add(node.name)
        else:
            todo.extend(node.all_input_nodes)
    return found


def _result(prop: Propagation, fallbacks: dict[str, str], replicated: Mapping[str, str]) -> BlockAnalysis:
    groups: dict[int, Group] = {}
    for root in sorted({prop.find(g) for g in prop.parent}):
        kind = "attention" if "attention" in prop.kinds[root] else "mlp"
        groups[root] = Group(list(prop.columns[root]), list(prop.rows[root]), math.gcd(*prop.sizes[root]), kind,
                             {c: prop.pieces[c] for c in prop.columns[root] if c in prop.pieces})
    state = {n: Sharded(prop.find(s.group), s.dim, s.size, s.pieces) for n, s in prop.state.items()}
    for node, s in state.items():
        groups[s.group].nodes.add(node)
    for root, g in groups.items():
        g.nodes.update(g.rows)
    projections = [n for n in prop.gm.graph.nodes if n.name in prop.region and prop.projection(n) is not None]
    members = {n for g in groups.values() for n in g.columns + g.rows}
    reshapes = {n: state[n] for n in prop.reshapes}
    whole = [n for n in projections if n.name in replicated and n not in members]
    return BlockAnalysis(list(groups.values()), [n for n in projections if n not in members and n not in whole],
                         state, reshapes, dict(prop.splits), list(dict.fromkeys(prop.replicated)),
                         {k: v for k, v in fallbacks.items()}, whole, {n.name: replicated[n.name] for n in whole},
                         dict(prop.slices), list(dict.fromkeys(prop.cut)))


# -- the TaskGraph view -----------------------------------------------------------------------------
def shard_groups_of(gm: fx.GraphModule, analysis: BlockAnalysis, path_of: Callable[[fx.Node], str],
                    flops_of: Callable[[fx.Node], float] = lambda n: 0.0) -> tuple[ShardGroup, ...]:
    """The analysis as plain :class:`ShardGroup` s (lone projections: one-member groups of their
    output features). ``flops_of`` gives a node's forward + backward FLOPs per sample."""
    out = []
    for g in analysis.groups:
        members = []
        for c in g.columns:
            _, features = projection_dims(gm.get_submodule(c.target))
            pieces = len(g.pieces.get(c, ())) or 1
            members.append(ShardMember(path_of(c), "column", features // g.units, pieces))
        for r in g.rows:
            features, _ = projection_dims(gm.get_submodule(r.target))
            members.append(ShardMember(path_of(r), "row", features // g.units))
        out.append(ShardGroup(g.units, tuple(members), g.kind, sum(flops_of(n) for n in g.nodes)))
    for node in analysis.lone:
        _, features = projection_dims(gm.get_submodule(node.target))
        out.append(ShardGroup(features, (ShardMember(path_of(node), "column", 1),), "lone", flops_of(node)))
    return tuple(out)


def _divided_bytes(group: Group, costs, batch: int) -> float:
    """Saved bytes per sample (``NodeCosts.saved``) that ``group`` divides among its ranks: made by
    its nodes, except a column projection's input cast (made inside it, whole on every rank) and a
    row projection's output (all-reduced: whole)."""
    if costs is None:
        return 0.0
    inside = {n.name for n in group.nodes} | {n.name for n in group.columns} | {n.name for n in group.rows}
    columns, rows = {n.name for n in group.columns}, {n.name for n in group.rows}
    total = 0
    for _, producer, is_output, nbytes in costs.saved:
        if producer not in inside or (producer in columns and not is_output) or (producer in rows and is_output):
            continue
        total += nbytes
    return total / batch


def shardable_fields(gm: fx.GraphModule, node_taskgraph: Mapping[str, int], index: int, strategy,
                     costs=None, batch: int = 1, autocast_costs=None) -> dict[str, Any]:
    """``TaskGraph.shardable`` and ``TaskGraph.shard_groups`` of TaskGraph ``index`` at capture
    (the projections' groups, then one ``"experts"`` group per recognised mixture-of-experts layer).

    Records every node's full output shapes in its meta first (from ``costs.outputs``), for this
    analysis and for the runtime's replay on the stage graphs. ``autocast_costs``: the same graph
    measured under autocast (:func:`whalelike.graphs.costs.measure`), for the groups' bytes there.
    """
    if strategy.kind != "split" and strategy.inner is None:
        return {"shardable": {}, "shard_groups": ()}
    if costs is not None and not any(SHAPES_META in n.meta for n in gm.graph.nodes):
        stamp_nodes(gm, costs.outputs, node_taskgraph)
    attached = {n.name for n in gm.graph.nodes if n.meta.get(ATTACHED_META)}  # never sharded (regions rule 3)
    region = [name for name, t in node_taskgraph.items() if t == index and name not in attached]
    analysis = analyse_blocks(gm, region)

    def flops(node: fx.Node) -> float:
        if costs is None:
            return 0.0
        return (costs.forward_flops.get(node.name, 0.0) + costs.backward_flops.get(node.name, 0.0)) / batch

    groups = shard_groups_of(gm, analysis, lambda n: n.target, flops)
    # the activations each group divides (lone projections: none; their outputs are gathered or feed the loss)
    groups = tuple(dataclasses.replace(g, activation_bytes_per_sample=_divided_bytes(a, costs, batch),
                                       autocast_activation_bytes_per_sample=_divided_bytes(a, autocast_costs, batch))
                   for g, a in zip(groups, analysis.groups)) + groups[len(analysis.groups):]
    # mixture-of-experts layers: their experts as units (whalelike.sharding.experts), the rest logged
    found, skipped = find_experts(gm, region)
    log_skipped(skipped, "capture")
    groups += experts_groups(found, costs, batch, autocast_costs)
    shardable = {m.path: g.dim(m) * 1 for g in groups for m in g.members}
    return {"shardable": shardable, "shard_groups": groups}