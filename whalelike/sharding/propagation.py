"""The sharded-dimension propagation behind :func:`whalelike.sharding.analysis.analyse_blocks`: per-operator
rules that prove a tensor-parallel block computes exactly its share of the full block.

One forward pass over the graph (fx or ``torch.export``, so ``call_method view`` and
``aten.view.default`` alike): every column projection (``nn.Linear`` or Conv1D, cut by output
features) of the region starts a group with a "sharded dimension", and each operator that reads a
sharded value maps it to its output's sharded dimension by a rule, or raises :class:`_Unsafe`,
which breaks the group. Groups that meet in one operator merge (union-find). An operator without a
rule is never assumed exact.

A sharded value is cut along one dimension into ``K`` equal consecutive blocks (the group's
units; rank ``i`` holds ``n_i`` of them). An operator keeps that exact when it maps blocks to
blocks:

* elementwise operators, with replicated operands broadcast along the sharded dimension (a mask
  over heads, rotary ``cos``/``sin``) and products of two sharded values (SwiGLU, ``q @ k^T``);
* **a per-head additive bias** (the one case where a replicated operand with the sharded
  dimension's *full* size is cut, ``cut``): an operand *added to attention scores*, i.e. added
  to a value laid out ``[..., heads, q, k]`` that comes from ``q @ k^T`` of two values sharded by
  heads (through scaling, other additions, casts and views that keep that layout: ``scores``)
  and goes on to a softmax over its last dimension, or the ``attn_mask`` of
  ``scaled_dot_product_attention`` (added to the scores inside it). T5's relative position bias
  and Swin's bias table with its shifted-window mask, ``[.., heads, q, k]``, are such operands:
  each rank reads its own heads of them (its gradient summed over the group), which pairs the
  same elements as the unsharded operator. Any other replicated operand of the full size (a
  residual added to a lone projection's output, an operand of a matmul) breaks the group, even
  where cutting it would be exact: the rule is for attention biases and masks, not for pulling
  unrelated projections into a group;
* ``view``/``reshape`` that split the dimension into ``[heads, head_dim]`` or merge it back
  (the sharded dimension is the first of its group of dimensions: blocks stay consecutive);
* ``transpose``/``permute``/``unsqueeze``/``contiguous``/``clone``/dtype casts, dropout;
* softmax, slices and ``cat`` along *another* dimension (rotate_half on ``head_dim``);
* ``expand`` that leaves the sharded dimension alone (``repeat_kv`` of grouped-query attention);
* batched ``matmul`` and ``scaled_dot_product_attention`` whose q, k, v are sharded along the
  heads dimension (with ``enable_gqa``, k and v have fewer heads: one unit is one key/value head
  and its query heads, which is what the block structure gives);
* multi-query attention, only for the attention nodes the driver names (``broadcast_kv``) with
  their k/v projections replicated (``replicated_projections``): q sharded by heads, k and v
  whole. One key/value head under ``enable_gqa`` broadcasts as it is; a repeat_kv (``expand`` of
  a size-1 dimension, then views, used by nothing else) becomes sharded like q, because every
  block of a broadcast dimension is the same data. Either way k/v are replicated operands: their
  gradient covers this rank's query heads and is summed over the group;
* ``split``/``chunk`` of a projection's own output along the sharded dimension: a fused
  projection (GPT-2's ``c_attn``), each piece cut into the same units; likewise index slices
  (``aten.slice``, Phi-3's ``qkv[..., :d]``) when every user of the output is such a slice and
  they cover it once in equal pieces (``slices``; unequal pieces break the group: the parallel
  projection holds equal pieces only);
* ``roll`` along dimensions other than the sharded one (a window shift, a token shift): each
  rank's units move alike; a roll along the sharded dimension (or of the flattened tensor) breaks.

The propagation ends in a *row* projection whose input features are the sharded dimension.
``K`` is the gcd of every sharded dimension size the group passes through (heads, for attention;
key/value heads under grouped-query attention). Anything else that touches a sharded value (a
consumer outside the region, the graph output, a reduction over the sharded dimension, a view
that mixes it with another dimension) breaks the group; :mod:`whalelike.sharding.analysis` then re-analyses
without its column projections.

Invariant: the pass only reads the graph (shapes recorded at capture under ``SHAPES_META``, or
``meta["val"]``) and never modifies it; this module does not import :mod:`whalelike.sharding.analysis`
(the driver, which decides what a broken group falls back to and builds the views).
"""
from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from whalelike.graphs.leaves import is_conv1d

aten = torch.ops.aten
SHAPES_META = "wl_shapes"   # node.meta key: the full (unsharded) shapes of a node's tensor outputs


# -- projections ------------------------------------------------------------------------------------
def projection_dims(module: nn.Module) -> Optional[tuple[int, int]]:
    """``(in_features, out_features)`` of a shardable projection (``nn.Linear`` or Conv1D), else None."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if is_conv1d(module):
        return module.weight.shape[0], module.nf
    return None


# -- the sharded state -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Sharded:
    """A value cut along ``dim`` (full size ``size``) into the units of group ``group``; ``pieces``
    are the full sizes of the parts of a fused projection's output (empty: one part)."""

    group: int
    dim: int
    size: int
    pieces: tuple[int, ...] = ()


class _Unsafe(Exception):
    """The propagation cannot prove an operator exact on sharded inputs."""


# -- operator tables --------------------------------------------------------------------------------
_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, torch.reshape}
_RESHAPE_METHODS = {"view", "reshape"}
_SAME_ATEN = {aten.contiguous.default, aten.clone.default, aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default,
              aten.alias.default, aten.dropout.default, aten.lift_fresh_copy.default, aten.to.device}
_SAME_FUNCTIONS = {F.dropout, torch.clone}
_SAME_METHODS = {"contiguous", "clone", "to", "float", "double", "half", "bfloat16", "type_as", "type"}
_ELEMENTWISE_FUNCTIONS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow,
    torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.relu, torch.tanh, torch.sigmoid, torch.exp,
    torch.where, torch.rsqrt, torch.pow, torch.erf, torch.masked_fill,
    F.relu, F.gelu, F.silu, F.tanh, F.sigmoid, F.leaky_relu, F.elu, F.mish, F.hardswish,
}
_ELEMENTWISE_METHODS = {"add", "sub", "mul", "div", "neg", "relu", "tanh", "sigmoid", "exp", "pow", "rsqrt",
                        "masked_fill", "__add__", "__mul__", "__sub__", "__truediv__", "__radd__", "__rmul__"}
_ELEMENTWISE_MODULES = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Dropout, nn.Identity,
                        nn.LeakyReLU, nn.ELU, nn.Mish, nn.Hardswish)
_SOFTMAX = {aten._softmax.default, aten.softmax.int, aten._log_softmax.default, aten.log_softmax.int,
            F.softmax, F.log_softmax, torch.softmax}
_MATMUL = {aten.matmul.default, aten.bmm.default, torch.matmul, torch.bmm, operator.matmul}
# fused attention; public: the analysis looks for it too (multi-query retries, analysis._replicated_kv)
SDPA = {aten.scaled_dot_product_attention.default, F.scaled_dot_product_attention}
_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, torch.split, torch.chunk, aten.chunk.default}
_CATS = {aten.cat.default, torch.cat}
_IGNORED = {aten._assert_tensor_metadata.default}
_ROLLS = {aten.roll.default, torch.roll}
_ADDS = {aten.add.Tensor, operator.add, torch.add}
_ADD_METHODS = {"add", "__add__", "__radd__"}


def target_is(node: fx.Node, functions: set, methods: set = frozenset()) -> bool:
    """Whether ``node`` calls one of ``functions`` (``call_function``: fx's torch functions or
    export's aten overloads) or one of ``methods`` (``call_method`` names): the one operator test of
    the propagation and of :mod:`whalelike.sharding.analysis`."""
    if node.op == "call_function":
        return node.target in functions
    return node.op == "call_method" and node.target in methods


def _pointwise(node: fx.Node) -> bool:
    if node.op == "call_function":
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            return torch.Tag.pointwise in target.tags
        return target in _ELEMENTWISE_FUNCTIONS
    return node.op == "call_method" and node.target in _ELEMENTWISE_METHODS


def _arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def full_shapes(node: Any) -> Optional[list[tuple]]:
    """The unsharded shapes of ``node``'s tensor outputs (``None`` entries: dynamic sizes)."""
    if not isinstance(node, fx.Node):
        return None
    shapes = node.meta.get(SHAPES_META)
    if shapes is not None:
        return [tuple(s) for s in shapes]
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return [tuple(int(d) if isinstance(d, int) else None for d in val.shape)]
    return None


def _shape(node: Any) -> Optional[tuple]:
    shapes = full_shapes(node)
    return shapes[0] if shapes and len(shapes) == 1 else None


# -- the propagation --------------------------------------------------------------------------------
class Propagation:
    """One forward pass of the sharded-dimension rules over a region of ``gm`` (module docstring):
    groups of projections merged by union-find, each with its units, members and the reason it
    broke, if it did. :func:`whalelike.sharding.analysis.analyse_blocks` builds one per attempt and
    reads its groups."""

    def __init__(self, gm: fx.GraphModule, region: set[str], demoted: set[str],
                 replicated_projections: frozenset[str] = frozenset(), broadcast_kv: frozenset[str] = frozenset()):
        self.gm, self.region, self.demoted = gm, region, demoted
        self.replicated_projections = replicated_projections   # computed whole on every rank (MQA's k/v)
        self.broadcast_kv = broadcast_kv   # attention nodes that may read replicated k/v (multi-query)
        self.state: dict[fx.Node, Sharded] = {}
        self.split_state: dict[fx.Node, tuple[Sharded, int, tuple[int, ...]]] = {}
        self.parent: dict[int, int] = {}
        self.columns: dict[int, list[fx.Node]] = {}
        self.rows: dict[int, list[fx.Node]] = defaultdict(list)
        self.sizes: dict[int, list[int]] = defaultdict(list)
        self.kinds: dict[int, set[str]] = defaultdict(set)
        self.pieces: dict[fx.Node, tuple[int, ...]] = {}
        self.broken: dict[int, str] = {}
        self.reshapes: dict[fx.Node, Sharded] = {}
        self.splits: dict[fx.Node, tuple[int, tuple[int, ...]]] = {}
        self.replicated: list[tuple[fx.Node, fx.Node]] = []
        self.slices: dict[fx.Node, tuple[int, tuple[int, ...], int]] = {}   # fused output slice: dim, pieces, index
        self.cut: list[tuple[fx.Node, fx.Node, int]] = []   # (node, replicated operand, its dim cut with the units)
        self.scores: set[fx.Node] = set()   # attention scores [..., heads, q, k] from q @ k^T, sharded by heads

    # union-find over groups
    def find(self, g: int) -> int:
        while self.parent[g] != g:
            self.parent[g] = self.parent[self.parent[g]]
            g = self.parent[g]
        return g

    def union(self, a: int, b: int) -> int:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra
            self.columns[ra] += self.columns.pop(rb)
            self.rows[ra] += self.rows.pop(rb, [])
            self.sizes[ra] += self.sizes.pop(rb, [])
            self.kinds[ra] |= self.kinds.pop(rb, set())
            if rb in self.broken:
                self.broken.setdefault(ra, self.broken.pop(rb))
        return ra

    def projection(self, node: fx.Node) -> Optional[tuple[int, int]]:
        if node.op != "call_module":
            return None
        return projection_dims(self.gm.get_submodule(node.target))

    def run(self) -> None:
        for node in self.gm.graph.nodes:
            sharded_inputs = [a for a in node.all_input_nodes if a in self.state or a in self.split_state]
            if node.op == "output" or node.name not in self.region:
                for a in sharded_inputs:
                    self.break_group(self._group_of(a), f"its sharded value {a.name!r} is used by {node.name!r}, "
                                     "outside the split region")
                continue
            dims = self.projection(node)
            if dims is not None:
                self.visit_projection(node, dims)
                continue
            if not sharded_inputs:
                continue
            try:
                out = self.rule(node)
            except _Unsafe as e:
                for a in sharded_inputs:
                    self.break_group(self._group_of(a), f"{node.name!r} ({_describe(node)}): {e}")
                continue
            if isinstance(out, Sharded):
                self.state[node] = out
                self.sizes[self.find(out.group)].append(out.size)

    def _group_of(self, node: fx.Node) -> int:
        s = self.state.get(node) or self.split_state[node][0]
        return s.group

    def break_group(self, group: int, reason: str) -> None:
        self.broken.setdefault(self.find(group), reason)

    def visit_projection(self, node: fx.Node, dims: tuple[int, int]) -> None:
        x = node.args[0] if node.args else None
        in_state = self.state.get(x)
        shape = _shape(node)
        if in_state is not None:
            if (len(node.all_input_nodes) == 1 and shape is not None and in_state.dim == len(shape) - 1
                    and not in_state.pieces and in_state.size == dims[0]):
                self.rows[self.find(in_state.group)].append(node)
            else:
                self.break_group(in_state.group, f"projection {node.name!r} reads the sharded value {x.name!r} "
                                 "but not as its input features")
            return
        if (node.name in self.demoted or node.name in self.replicated_projections or shape is None
                or len(node.all_input_nodes) != 1):
            return
        g = len(self.parent)
        self.parent[g] = g
        self.columns[g] = [node]
        self.state[node] = Sharded(g, len(shape) - 1, dims[1])
        self.sizes[g].append(dims[1])

    # -- operator rules: return the output's Sharded state, None (replicated), or raise _Unsafe ----------
    def rule(self, node: fx.Node) -> Optional[Sharded]:
        if node.op == "call_function" and node.target in _IGNORED:
            return None
        if node.op == "call_function" and node.target is operator.getitem and node.args[0] in self.split_state:
            return self.piece(node)
        if node.op == "call_function" and node.target is aten.sym_size.int:
            s = self.state[node.args[0]]
            if _norm(node.args[1], len(_shape(node.args[0]) or ())) == s.dim:
                raise _Unsafe("reads the size of the sharded dimension")
            return None
        x = node.args[0] if node.args else None
        if target_is(node, _RESHAPES, _RESHAPE_METHODS):
            return self.reshape(node)
        if target_is(node, {aten.expand.default}, {"expand"}):
            return self.expand(node)
        if target_is(node, {aten.transpose.int, torch.transpose}, {"transpose"}):
            s = self.only_sharded(node)
            ndim = len(self.shape(x))
            a, b = _norm(node.args[1], ndim), _norm(node.args[2], ndim)
            return _moved(s, {a: b, b: a}.get(s.dim, s.dim))
        if target_is(node, {aten.permute.default, torch.permute}, {"permute"}):
            s = self.only_sharded(node)
            perm = node.args[1] if isinstance(node.args[1], (list, tuple)) else node.args[1:]
            perm = [_norm(p, len(perm)) for p in perm]
            return _moved(s, perm.index(s.dim))
        if target_is(node, {aten.unsqueeze.default, torch.unsqueeze}, {"unsqueeze"}):
            s = self.only_sharded(node)
            d = _norm(node.args[1], len(self.shape(x)) + 1)
            return _moved(s, s.dim + 1 if d <= s.dim else s.dim)
        if target_is(node, _SAME_ATEN | _SAME_FUNCTIONS, _SAME_METHODS) or (
                node.op == "call_module" and isinstance(self.gm.get_submodule(node.target), _ELEMENTWISE_MODULES)):
            s = self.state.get(x)
            if s is None:
                raise _Unsafe("a sharded value is used only for its dtype or device")
            self.keep_scores(node, s)
            return s
        if target_is(node, _SOFTMAX, {"softmax", "log_softmax"}):
            s = self.only_sharded(node)
            if _norm(_arg(node, 1, "dim"), len(self.shape(x))) == s.dim:
                raise _Unsafe("softmax over the sharded dimension")
            return s
        if target_is(node, {aten.slice.Tensor}):
            if node in self.slices:
                return self.fused_slice(node)
            s = self.only_sharded(node)
            shape = self.shape(x)
            dim = _norm(_arg(node, 1, "dim", 0), len(shape))
            if dim == s.dim and tuple(self.shape(node)) != tuple(shape):
                self.slice_fused(x, s)
                return self.fused_slice(node)
            return s
        if target_is(node, _ROLLS, {"roll"}):
            s = self.only_sharded(node)
            ndim = len(self.shape(x))
            dims = _arg(node, 2, "dims", ())
            dims = [dims] if isinstance(dims, int) else list(dims or ())
            if not dims or s.dim in [_norm(d, ndim) for d in dims]:
                raise _Unsafe("rolls along the sharded dimension (or over the flattened tensor)")
            return s
        if target_is(node, _CATS, {"cat"}):
            return self.cat(node)
        if target_is(node, _SPLITS, {"split", "chunk"}):
            return self.split(node)
        if target_is(node, SDPA):
            return self.attention(node)
        if target_is(node, _MATMUL, {"matmul", "bmm", "__matmul__"}):
            return self.matmul(node)
        if _pointwise(node) or (node.op == "call_module"
                                and isinstance(self.gm.get_submodule(node.target), _ELEMENTWISE_MODULES)):
            return self.elementwise(node)
        raise _Unsafe("an operator the tensor-parallel analysis does not know")

    def shape(self, node: Any) -> tuple:
        shape = _shape(node)
        if shape is None:
            raise _Unsafe(f"the shape of {getattr(node, 'name', node)!r} was not recorded at capture")
        return shape

    def only_sharded(self, node: fx.Node) -> Sharded:
        s = self.state.get(node.args[0])
        if s is None or any(a in self.state for a in node.all_input_nodes if a is not node.args[0]):
            raise _Unsafe("a sharded value in an unexpected position")
        if s.pieces:
            raise _Unsafe("the fused output of a projection before it is split into its parts")
        return s

    def merge(self, states: list[Sharded], dims: list[int], what: str) -> int:
        if len(set(dims)) != 1:
            raise _Unsafe(f"{what} with operands sharded along different dimensions {dims}")
        group = states[0].group
        for s in states[1:]:
            group = self.union(group, s.group)
        return group

    def broadcast_check(self, node: fx.Node, tensors: list[fx.Node], out_dim: int, out_ndim: int,
                        scores_bias: bool = False) -> None:
        """Replicated tensor operands must broadcast along the sharded output dimension; only where
        ``node`` adds them to attention scores (``scores_bias``, see the module docstring) may they
        have its full size there (a per-head bias): then each rank reads its own units of them
        (``cut``), which is the same element-for-element pairing as the unsharded operator."""
        full = self.shape(node)[out_dim]
        for t in tensors:
            if t in self.state:
                continue
            shape = self.shape(t)
            aligned = out_dim - (out_ndim - len(shape))
            if 0 <= aligned < len(shape) and shape[aligned] != 1:
                if scores_bias and full is not None and shape[aligned] == full:
                    self.cut.append((node, t, aligned))
                    continue
                raise _Unsafe(f"the replicated operand {t.name!r} has the size {shape[aligned]} along the sharded "
                              f"dimension of size {full} (only a per-head bias added to attention scores is cut "
                              "with the heads)")
            self.replicated.append((node, t))

    def adds_to_scores(self, node: fx.Node, out: Sharded, out_shape: tuple) -> bool:
        """``node`` adds replicated operands to attention scores: an addition of a ``scores`` value
        sharded along its heads dimension (``[..., heads, q, k]``) whose sum reaches a softmax over
        the last (key) dimension through further additions, scaling, casts and views."""
        return (target_is(node, _ADDS, _ADD_METHODS) and out.dim == len(out_shape) - 3
                and any(a in self.scores for a in node.all_input_nodes) and _feeds_softmax(node))

    def keep_scores(self, node: fx.Node, out: Sharded) -> None:
        """Scores stay scores through elementwise operators, casts and views that keep the layout
        ``[..., heads, q, k]`` (the heads third from last, the last two dimensions unchanged)."""
        source = [a for a in node.all_input_nodes if a in self.scores]
        out_shape = _shape(node)
        if (source and out_shape is not None and out.dim == len(out_shape) - 3
                and tuple(out_shape[-2:]) == tuple(self.shape(source[0])[-2:])):
            self.scores.add(node)

    def elementwise(self, node: fx.Node) -> Sharded:
        out_shape = self.shape(node)
        tensors = [a for a in node.all_input_nodes if _shape(a) is not None or a in self.state]
        states = [self.state[a] for a in tensors if a in self.state]
        if any(s.pieces for s in states):
            raise _Unsafe("the fused output of a projection before it is split into its parts")
        dims = [s.dim + len(out_shape) - len(self.shape(a)) for a, s in
                ((a, self.state[a]) for a in tensors if a in self.state)]
        group = self.merge(states, dims, "an elementwise operator")
        if len({s.size for s in states}) != 1:
            raise _Unsafe("operands sharded with different sizes")
        out = Sharded(group, dims[0], out_shape[dims[0]])
        self.broadcast_check(node, tensors, dims[0], len(out_shape), self.adds_to_scores(node, out, out_shape))
        self.keep_scores(node, out)
        return out

    def reshape(self, node: fx.Node) -> Sharded:
        s = self.only_sharded(node)
        in_shape, out_shape = self.shape(node.args[0]), self.shape(node)
        out_dim = _reshaped_dim(in_shape, out_shape, s.dim)
        if out_dim is None:
            raise _Unsafe(f"a view {list(in_shape)} -> {list(out_shape)} that does not keep the sharded "
                          f"dimension {s.dim} whole and leading")
        out = Sharded(s.group, out_dim, out_shape[out_dim])
        if out.size != s.size:
            self.kinds[self.find(s.group)].add("attention")
        self.reshapes[node] = out
        self.keep_scores(node, out)
        return out

    def expand(self, node: fx.Node) -> Sharded:
        s = self.only_sharded(node)
        in_shape, out_shape = self.shape(node.args[0]), self.shape(node)
        out_dim = s.dim + len(out_shape) - len(in_shape)
        if out_shape[out_dim] != in_shape[s.dim]:
            raise _Unsafe("expands the sharded dimension")
        out = Sharded(s.group, out_dim, s.size)
        self.reshapes[node] = out
        return out

    def cat(self, node: fx.Node) -> Sharded:
        tensors = list(node.args[0])
        out_shape = self.shape(node)
        dim = _norm(_arg(node, 1, "dim", 0), len(out_shape))
        if not all(t in self.state for t in tensors):
            raise _Unsafe("concatenates sharded and replicated values")
        states = [self.state[t] for t in tensors]
        group = self.merge(states, [s.dim for s in states], "cat")
        if states[0].dim == dim or any(s.pieces for s in states):
            raise _Unsafe("concatenates along the sharded dimension")
        return Sharded(group, states[0].dim, out_shape[states[0].dim])

    def split(self, node: fx.Node) -> None:
        x = node.args[0]
        s = self.state[x]
        shape = self.shape(x)
        chunk = node.target in (torch.chunk, aten.chunk.default) or node.target == "chunk"
        dim = _norm(_arg(node, 2, "dim", 0), len(shape))
        if dim != s.dim:
            self.split_state[node] = (s, -1, ())
            return None
        arg = _arg(node, 1, "chunks" if chunk else "split_size")
        size = shape[dim]
        if chunk:
            pieces = (size // arg,) * arg if isinstance(arg, int) and size % arg == 0 else None
        elif isinstance(arg, int):
            pieces = (arg,) * (size // arg) if size % arg == 0 else None
        else:
            pieces = tuple(arg) if all(isinstance(p, int) for p in arg) else None
        column = self.columns.get(self.find(s.group), [])
        if pieces is None or x not in column or s.pieces or len([u for u in x.users if u.target not in _IGNORED]) != 1:
            raise _Unsafe("splits the sharded dimension of something other than a projection's own output")
        self.pieces[x] = pieces
        self.state[x] = Sharded(s.group, s.dim, s.size, pieces)
        self.sizes[self.find(s.group)] += list(pieces)
        self.splits[node] = (dim, pieces)
        self.split_state[node] = (self.state[x], dim, pieces)
        return None

    def slice_fused(self, x: fx.Node, s: Sharded) -> None:
        """Index slices (``qkv[..., :d]``, Phi-3's ``qkv_proj``) that cut a column projection's own
        output along its sharded dimension into consecutive pieces: like ``split``, when every user
        of the output is such a slice and together they cover it exactly once, in equal pieces (the
        parallel projection holds its units of each of equal pieces). Each slice then becomes this
        rank's piece (:mod:`runtime.tensor.block_sharding` narrows it to the local offsets)."""
        shape = self.shape(x)
        size, ndim = shape[s.dim], len(shape)
        column = self.columns.get(self.find(s.group), [])
        if x not in column or s.pieces:
            raise _Unsafe("slices the sharded dimension of something other than a projection's own output")
        intervals = []
        for user in x.users:
            if user.op == "call_function" and user.target in _IGNORED:
                continue
            if not target_is(user, {aten.slice.Tensor}) or user.name not in self.region:
                raise _Unsafe(f"slices the sharded dimension of {x.name!r}, which {user.name!r} also reads whole")
            dim, start, end = _norm(_arg(user, 1, "dim", 0), ndim), _arg(user, 2, "start"), _arg(user, 3, "end")
            step = _arg(user, 4, "step", 1)
            if dim != s.dim or step != 1 or not all(isinstance(v, int) or v is None for v in (start, end)):
                raise _Unsafe(f"{user.name!r} slices {x.name!r} other than along its sharded dimension in one step")
            start, end = _bound(start, 0, size), _bound(end, size, size)
            intervals.append((start, end, user))
        intervals.sort(key=lambda i: (i[0], i[1]))
        edges = [0] + [e for _, e, _ in intervals]
        if [a for a, _, _ in intervals] != edges[:-1] or edges[-1] != size or any(e <= a for a, e, _ in intervals):
            raise _Unsafe(f"the slices {[(a, e) for a, e, _ in intervals]} of {x.name!r} do not cover its "
                          f"{size} features once, in order")
        pieces = tuple(e - a for a, e, _ in intervals)
        if len(set(pieces)) != 1:
            raise _Unsafe(f"slices a fused projection into unequal pieces {list(pieces)} (a parallel projection "
                          "holds equal pieces only)")
        self.pieces[x] = pieces
        self.state[x] = Sharded(s.group, s.dim, s.size, pieces)
        self.sizes[self.find(s.group)] += list(pieces)
        for index, (_, _, user) in enumerate(intervals):
            self.slices[user] = (s.dim, pieces, index)

    def fused_slice(self, node: fx.Node) -> Sharded:
        dim, pieces, index = self.slices[node]
        return Sharded(self.state[node.args[0]].group, dim, pieces[index])

    def piece(self, node: fx.Node) -> Sharded:
        s, dim, pieces = self.split_state[node.args[0]]
        if dim < 0:
            return Sharded(s.group, s.dim, s.size)
        return Sharded(s.group, s.dim, pieces[node.args[1]])

    def attention(self, node: fx.Node) -> Sharded:
        q, k, v = node.args[:3]
        if node.name in self.broadcast_kv and q in self.state and k not in self.state and v not in self.state:
            return self.attention_replicated_kv(node)
        if not all(t in self.state for t in (q, k, v)):
            raise _Unsafe("attention whose query, key and value are not all sharded by heads")
        ndim = len(self.shape(q))
        states = [self.state[t] for t in (q, k, v)]
        if any(s.pieces for s in states):
            raise _Unsafe("the fused output of a projection before it is split into its parts")
        heads = ndim - 3
        group = self.merge(states, [s.dim for s in states], "attention")
        if states[0].dim != heads:
            raise _Unsafe(f"attention sharded along dimension {states[0].dim}, not the heads dimension {heads}")
        if (states[1].size != states[0].size or states[2].size != states[0].size) and not _arg(node, 7, "enable_gqa"):
            raise _Unsafe("key/value heads differ from query heads without enable_gqa")
        self.mask_check(node, heads)
        self.kinds[self.find(group)].add("attention")
        return Sharded(group, heads, states[0].size)

    def attention_replicated_kv(self, node: fx.Node) -> Sharded:
        """Multi-query attention: q sharded by heads, k and v replicated (their projections whole on
        every rank). Each rank's query heads read the one key/value head: under ``enable_gqa`` k/v
        of one head broadcast as they are; after ``repeat_kv`` (expand of the one head to every
        query head, then reshape) the expand and reshape are cut to this rank's heads. Either way
        k/v enter the sharded attention as replicated operands (gradient summed over the group)."""
        q, k, v = node.args[:3]
        s = self.state[q]
        heads = len(self.shape(q)) - 3
        if s.pieces or s.dim != heads:
            raise _Unsafe(f"attention sharded along dimension {s.dim}, not the heads dimension {heads}")
        for t in (k, v):
            kv_heads = self.shape(t)[heads]
            if kv_heads == 1 and _arg(node, 7, "enable_gqa"):
                self.replicated.append((node, t))
            elif kv_heads == self.shape(q)[heads]:
                self.adopt_repeated(t, s)
            else:
                raise _Unsafe(f"replicated key/value with {kv_heads} heads for {self.shape(q)[heads]} query heads "
                              "(only one key/value head, broadcast or repeated, can stay whole)")
        self.mask_check(node, heads)
        self.kinds[self.find(s.group)].add("attention")
        return s

    def mask_check(self, node: fx.Node, heads: int) -> None:
        """The ``attn_mask`` of a sharded attention is added to its scores: replicated, broadcast
        over the heads or a per-head bias cut with them."""
        mask = _arg(node, 3, "attn_mask")
        if isinstance(mask, fx.Node):
            if mask in self.state:
                raise _Unsafe("a sharded attention mask")
            self.broadcast_check(node, [mask], heads, len(self.shape(node)), scores_bias=True)

    def adopt_repeated(self, value: fx.Node, query: Sharded) -> None:
        """Shard ``value`` (a replicated k or v of full query heads) like ``query`` when it is one
        head repeated: ``expand`` of a size-1 dimension, then views, each used only by the next.
        Any block of a broadcast dimension is the same data, so cutting the expand and the views to
        this rank's heads is exact; the expand's input enters the region (its gradient, partial
        over this rank's heads, is summed over the group)."""
        chain = [value]
        while not target_is(chain[-1], {aten.expand.default}, {"expand"}):
            if not target_is(chain[-1], _RESHAPES, _RESHAPE_METHODS):
                raise _Unsafe(f"replicated key/value {value.name!r} is not one head repeated (expand, then views)")
            chain.append(chain[-1].args[0])
        for n in chain:
            if n.name not in self.region or len([u for u in n.users if u.target not in _IGNORED]) != 1:
                raise _Unsafe(f"the repeated key/value {n.name!r} is used by more than the attention")
        expand = chain[-1]
        source = expand.args[0]
        in_shape, out_shape = self.shape(source), self.shape(expand)
        offset = len(out_shape) - len(in_shape)
        grown = [d for d in range(len(out_shape)) if out_shape[d] not in (1, None)
                 and (d < offset or in_shape[d - offset] == 1)]
        if len(grown) != 1:
            raise _Unsafe(f"{expand.name!r} does not repeat exactly one size-1 dimension")
        states = {expand: Sharded(query.group, grown[0], out_shape[grown[0]])}
        previous = expand
        for n in reversed(chain[:-1]):
            dim = _reshaped_dim(self.shape(previous), self.shape(n), states[previous].dim)
            if dim is None:
                raise _Unsafe(f"the view {n.name!r} of the repeated key/value mixes the repeated dimension")
            states[n] = Sharded(query.group, dim, self.shape(n)[dim])
            previous = n
        if states[value].dim != query.dim or states[value].size != query.size:
            raise _Unsafe(f"the repeated key/value {value.name!r} does not line up with the query heads")
        self.state.update(states)
        self.reshapes.update(states)
        self.sizes[self.find(query.group)] += [st.size for st in states.values()]
        self.replicated.append((expand, source))

    def matmul(self, node: fx.Node) -> Sharded:
        a, b = node.args[:2]
        out_shape = self.shape(node)
        sharded = [t for t in (a, b) if t in self.state]
        for t in sharded:
            s = self.state[t]
            if s.pieces or len(self.shape(t)) != len(out_shape) or s.dim >= len(out_shape) - 2:
                raise _Unsafe("a matmul that contracts or mixes the sharded dimension")
        states = [self.state[t] for t in sharded]
        group = self.merge(states, [s.dim for s in states], "matmul")
        self.broadcast_check(node, [t for t in (a, b) if isinstance(t, fx.Node)], states[0].dim, len(out_shape))
        self.kinds[self.find(group)].add("attention")
        if len(sharded) == 2 and states[0].dim == len(out_shape) - 3:
            self.scores.add(node)   # q @ k^T: [..., heads, q, k]
        return Sharded(group, states[0].dim, out_shape[states[0].dim])


def _describe(node: fx.Node) -> str:
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    return f"{node.op} {target}"


def _norm(dim: Any, ndim: int) -> int:
    if not isinstance(dim, int):
        raise _Unsafe(f"a dimension that is not a constant ({dim!r})")
    return dim % ndim if ndim else dim


def _bound(value: Optional[int], default: int, size: int) -> int:
    """A slice bound as Python clamps it (``None``: ``default``; negative: from the end)."""
    if value is None:
        return default
    if value < 0:
        value += size
    return min(max(value, 0), size)


def _feeds_softmax(node: fx.Node, steps: int = 8) -> bool:
    """``node``'s value reaches a softmax over its last dimension within ``steps`` elementwise
    operators, casts and views (the scores' path: scaling, more biases and masks, a dtype cast)."""
    frontier = [node]
    for _ in range(steps):
        following = []
        for n in frontier:
            for user in n.users:
                if target_is(user, _SOFTMAX, {"softmax", "log_softmax"}):
                    shape = _shape(n)
                    dim = _arg(user, 1, "dim")
                    if shape is not None and isinstance(dim, int) and dim % len(shape) == len(shape) - 1:
                        return True
                elif _pointwise(user) or target_is(user, _RESHAPES | _SAME_ATEN | _SAME_FUNCTIONS,
                                                    _RESHAPE_METHODS | _SAME_METHODS):
                    following.append(user)
        frontier = following
    return False


def _moved(s: Sharded, dim: int) -> Sharded:
    return Sharded(s.group, dim, s.size, s.pieces)


def _reshaped_dim(in_shape: tuple, out_shape: tuple, dim: int) -> Optional[int]:
    """The output dimension that carries the blocks of input dimension ``dim`` through a reshape,
    or None when the blocks do not stay consecutive along one dimension.

    Dimensions are grouped where the running products of both shapes meet; within its group the
    sharded dimension must be preceded by size-1 dimensions only, and the blocks land on the
    group's first output dimension of size > 1.
    """
    i = j = 0
    while i < len(in_shape) or j < len(out_shape):
        gi, gj = [i], [j]
        if i >= len(in_shape) or j >= len(out_shape):
            return None
        pa, pb = in_shape[i], out_shape[j]
        if pa is None or pb is None:
            if pa is not None or pb is not None:
                return None
            i, j = i + 1, j + 1
            if dim == gi[0]:
                return None
            continue
        while pa != pb:
            if pa < pb:
                i += 1
                if i >= len(in_shape) or in_shape[i] is None:
                    return None
                gi.append(i)
                pa *= in_shape[i]
            else:
                j += 1
                if j >= len(out_shape) or out_shape[j] is None:
                    return None
                gj.append(j)
                pb *= out_shape[j]
        i, j = i + 1, j + 1
        # absorb trailing size-1 dims into this group (keeps the first non-1 dimension leading)
        if dim in gi:
            if any(in_shape[k] != 1 for k in gi if k < dim):
                return None
            firsts = [k for k in gj if out_shape[k] != 1]
            return firsts[0] if firsts else None
    return None
