"""Shard whole transformer blocks of a stage graph: the projections of each shard group and the
operators between them.

:func:`whalelike.sharding.analysis.analyse_blocks` finds the groups (attention by heads, MLPs by features)
and every operator between a group's column and row projections. Swapping the projections for
parallel ones is not enough: the views in between carry the *full* head count or hidden size
(``view(b, s, 4, 16)``, ``expand(b, 2, 2, s, 16)``, ``split(x, 64, dim=2)``), and would fail or
silently mix heads on a rank holding 3 of 4 heads. So each such operator gets its shape argument
localised at run time (:func:`local_shape`: the entry of the sharded dimension, if it is the full
size, becomes this rank's size; ``-1`` and the symbolic batch sizes stay), and a fused
projection's ``split`` gets this rank's piece sizes (its index slices, ``qkv[..., :d]``, become
``narrow`` at this rank's offsets in its pieces). A per-head bias added to attention scores (the
one replicated operand with the full size of the sharded dimension that the propagation cuts)
enters the region and is narrowed to this rank's heads.

The invariant: rank ``i`` computes exactly the slice of units ``[u_i, u_i + n_i)`` of every
sharded value that the unsharded block would compute, so the row projections' partial sums add up
to the unsharded output, forward and backward. A replicated tensor that meets a sharded one (a
mask broadcast over heads, rotary ``cos``/``sin``) contributes to only this rank's units, so its
gradient, if it has one, is summed over the group (:class:`EnterRegion`). Multi-query attention's
k/v projections stay whole (``BlockAnalysis.replicated_projections``, plain layers) and enter the
attention that way: at its repeat_kv ``expand`` (cut, like its ``reshape``, to this rank's query
heads) or at ``scaled_dot_product_attention(enable_gqa=True)``; the group sum of their per-rank
gradients is the full gradient, once.

Emulation: the parallel projections are emulation segments as before (their local FLOPs); the
attention and other operators between them run at the machine's real speed, unpadded.

Why not DTensor: its shardings are even, and it cannot rewrite the shape constants of a traced
graph; and why not a per-model plan (Megatron, ``parallelize_module`` plans): the graph tells us.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from runtime.emulation.compute import Emulator
from runtime.tensor.layers import ColumnParallelLinear, ProcessGroup, RowParallelLinear, copy_to_region
from whalelike.errors import WhaleError
from whalelike.sharding.analysis import BlockAnalysis, Group, projection_dims


@dataclass(frozen=True)
class GroupLayout:
    """A group's units and how many of them each rank holds."""

    units: int
    per_rank: tuple[int, ...]

    def local(self, full: int, tp_index: int) -> int:
        """This rank's part of a sharded dimension of full size ``full``."""
        return full // self.units * self.per_rank[tp_index]


def group_layout(group: Group, shard_sizes: Mapping[str, Sequence[int]], path_of: Callable[[fx.Node], str],
                 gm: fx.GraphModule) -> GroupLayout:
    """The units per rank that the plan's sizes give ``group``. Every column projection must have
    an entry (rows may be left out: they follow their columns); all entries must be whole units and agree."""
    per_rank = None
    for node in group.columns + group.rows:
        path = path_of(node)
        if path not in shard_sizes:
            if node in group.rows:
                continue
            raise WhaleError(
                f"split region: {path!r} has no entry in the plan's shard_sizes (it is a column of "
                f"{_describe_group(group, path_of)}; entries: {sorted(shard_sizes)}); re-plan with the current "
                "capture of the model"
            )
        features_in, features_out = projection_dims(gm.get_submodule(node.target))
        features = features_out if node in group.columns else features_in
        per_unit = features // group.units
        sizes = [int(n) for n in shard_sizes[path]]
        if sum(sizes) != features or any(n % per_unit for n in sizes):
            raise WhaleError(
                f"split region: the plan's shard_sizes[{path!r}] = {sizes} are not whole units of "
                f"{_describe_group(group, path_of)}: each rank needs a multiple of {per_unit} of its {features} "
                f"features ({group.units} units); re-plan, or give sizes n * {per_unit}"
            )
        units = tuple(n // per_unit for n in sizes)
        if per_rank is not None and units != per_rank:
            raise WhaleError(
                f"split region: the plan's shard_sizes cut {_describe_group(group, path_of)} inconsistently: "
                f"{path!r} holds {list(units)} units per rank, another member {list(per_rank)}; every member "
                "of a group needs the same units (heads) per rank"
            )
        per_rank = units
    if any(n < 1 for n in per_rank):
        raise WhaleError(f"split region: {_describe_group(group, path_of)} gives a rank no unit ({list(per_rank)})")
    return GroupLayout(group.units, per_rank)


def _describe_group(group: Group, path_of: Callable[[fx.Node], str]) -> str:
    unit = "heads" if group.kind == "attention" else "features"
    return f"the {group.kind} group [{', '.join(path_of(n) for n in group.columns + group.rows)}] ({group.units} {unit})"


def local_shape(shape: Sequence, dim: int, full: int, local: int, where: str) -> list:
    """``shape`` with its entry ``dim`` (the full size ``full`` of a sharded dimension) replaced by
    ``local``; ``-1`` stays (the size is inferred from the local tensor)."""
    sizes = list(shape)
    entry = sizes[dim]
    if entry == full:
        sizes[dim] = local
    elif entry != -1:
        raise WhaleError(f"{where}: expected the full size {full} (or -1) at sharded dimension {dim} of the shape "
                         f"{sizes}; the shape is computed from already sharded sizes, which this rewrite cannot follow")
    return sizes


class EnterRegion(nn.Module):
    """A replicated tensor entering a sharded computation: identity forward, gradient summed over
    the tensor-parallel group backward (each rank's gradient covers only its units)."""

    def __init__(self, group: ProcessGroup):
        super().__init__()
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return copy_to_region(x, self.group)


def shard_groups(gm: fx.GraphModule, analysis: BlockAnalysis, layouts: dict[int, GroupLayout], tp_index: int,
                 group: ProcessGroup, emulator: Optional[Emulator], path_of: Callable[[fx.Node], str]) -> dict[str, str]:
    """Swap each group's projections for parallel ones and localise the operators between them, in
    place. ``layouts`` is indexed like ``analysis.groups``. Returns ``{module path: role}``."""
    roles = {}
    group_index = {id(g): i for i, g in enumerate(analysis.groups)}
    state_layout = {}
    for g in analysis.groups:
        layout = layouts[group_index[id(g)]]
        for node in g.nodes:
            state_layout[node] = layout
        for node in g.columns:
            pieces = len(g.pieces.get(node, ())) or 1
            _, features = projection_dims(gm.get_submodule(node.target))
            sizes = [n * features // g.units for n in layout.per_rank]
            _replace(gm, node, ColumnParallelLinear(gm.get_submodule(node.target), sizes, tp_index, group,
                                                    gather_output=False, emulator=emulator, name=path_of(node),
                                                    pieces=pieces))
            roles[path_of(node)] = "column"
        for node in g.rows:
            features, _ = projection_dims(gm.get_submodule(node.target))
            sizes = [n * features // g.units for n in layout.per_rank]
            _replace(gm, node, RowParallelLinear(gm.get_submodule(node.target), sizes, tp_index, group,
                                                 emulator=emulator, name=path_of(node)))
            roles[path_of(node)] = "row"
    for node, state in analysis.reshapes.items():
        _localise_reshape(gm, node, state.dim, state.size, state_layout[node].local(state.size, tp_index))
    for node, (dim, pieces) in analysis.splits.items():
        layout = state_layout[node.args[0]]
        _localise_split(gm, node, dim, [layout.local(p, tp_index) for p in pieces])
    for node, (dim, pieces, index) in analysis.slices.items():
        layout = state_layout[node.args[0]]
        local = [layout.local(p, tp_index) for p in pieces]
        _localise_slice(gm, node, dim, sum(local[:index]), local[index])
    if analysis.replicated_operands or analysis.cut_operands:
        gm.add_module("_wl_enter_region", EnterRegion(group))
    for node, operand in analysis.replicated_operands:
        node.replace_input_with(operand, _entered(gm, node, operand))
    _cut_operands(gm, analysis, state_layout, tp_index)
    gm.graph.lint()
    gm.recompile()
    return roles


def _replace(gm: fx.GraphModule, node: fx.Node, layer: nn.Module) -> None:
    parent, _, leaf = node.target.rpartition(".")
    setattr(gm.get_submodule(parent) if parent else gm, leaf, layer)


def _localise_reshape(gm: fx.GraphModule, node: fx.Node, dim: int, full: int, local: int) -> None:
    """``view``/``reshape``/``expand``: shape argument through :func:`local_shape`."""
    x, rest = node.args[0], node.args[1:]
    shape = rest[0] if len(rest) == 1 and isinstance(rest[0], (list, tuple, fx.Node)) else list(rest)
    if not rest:
        shape = node.kwargs.get("shape", node.kwargs.get("size"))
    with gm.graph.inserting_before(node):
        fixed = gm.graph.call_function(local_shape, (shape, dim, full, local, f"node {node.name!r}"))
    node.args = (x, fixed)
    node.kwargs = {k: v for k, v in node.kwargs.items() if k not in ("shape", "size")}


def _localise_split(gm: fx.GraphModule, node: fx.Node, dim: int, local_pieces: list[int]) -> None:
    """A fused projection's ``split``/``chunk``: this rank's piece sizes."""
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(torch.split, (node.args[0], local_pieces, dim))
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)


def _localise_slice(gm: fx.GraphModule, node: fx.Node, dim: int, start: int, length: int) -> None:
    """An index slice of a fused projection's output (``qkv[..., :d]``): this rank's piece, at its
    local offset (the parallel projection holds its units of each piece, piece after piece)."""
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(torch.narrow, (node.args[0], dim, start, length))
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)


def _cut_operands(gm: fx.GraphModule, analysis: BlockAnalysis, state_layout: Mapping, tp_index: int) -> None:
    """A per-head bias added to attention scores (the propagation's ``cut``: the only replicated
    operand with the full size of the sharded dimension) enters the region (gradient summed over
    the group) and is narrowed to this rank's units: rank ``i`` pairs its heads with the same heads
    of the bias, as the unsharded operator does."""
    for node, operand, dim in analysis.cut_operands:
        layout = state_layout[node]
        per_unit = analysis.state[node].size // layout.units
        entered = _entered(gm, node, operand)
        with gm.graph.inserting_before(node):
            cut = gm.graph.call_function(torch.narrow, (entered, dim, per_unit * sum(layout.per_rank[:tp_index]),
                                                        per_unit * layout.per_rank[tp_index]))
        node.replace_input_with(operand, cut)


def _entered(gm: fx.GraphModule, node: fx.Node, operand: fx.Node) -> fx.Node:
    """``operand`` through the graph's :class:`EnterRegion` (identity forward, gradient summed over
    the group), inserted before ``node``."""
    with gm.graph.inserting_before(node):
        return gm.graph.call_module("_wl_enter_region", (operand,))
