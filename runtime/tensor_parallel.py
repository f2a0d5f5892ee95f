"""The ``split`` transform: shard the Linears of a captured graph with the plan's uneven shard sizes.

Given the captured ``fx.GraphModule``, which of its nodes belong to ``split`` TaskGraphs, and
``StagePlan.shard_sizes`` (module path -> size per tensor-parallel rank), :func:`shard_module`
swaps every ``call_module`` ``nn.Linear`` in those regions for its parallel counterpart from
:mod:`runtime.tp_layers`:

* **column + row pair** (Megatron): a Linear whose output reaches another Linear of the region
  through elementwise operators only (activations, dropout, arithmetic with scalars, products with
  other column-sharded Linears as in SwiGLU) and nowhere else. The sharded activations never leave
  the rank; the pair costs one all-reduce forward and one backward.
* **column + gather**: any other Linear. Its output is all-gathered (uneven, padded) so what
  follows sees the full tensor.
* **class-sharded classifier**: a lone Linear whose output is the model output, or one leaf of it
  (in a ModelOutput, tuple or dict), when the loss is a plain cross-entropy of that leaf
  (:mod:`runtime.sharded_loss`). Its logits stay sharded and the returned :class:`ShardedLoss`
  computes the cross-entropy from them, so no rank ever holds the full logits (Whale's 100k-class head).

Why a graph pass and not DTensor's ``parallelize_module``: the layouts here are uneven (DTensor
cannot shard 24/8), and pairing is decided from the dataflow of the captured graph instead of a
hand-written per-model plan.
"""
from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from runtime.emulation import Emulator
from runtime.sharded_loss import OutputLayout, ShardedLoss, choose_classifier, plain_cross_entropy  # noqa: F401
from runtime.tp_layers import ColumnParallelLinear, PaddedLinear, ProcessGroup, RowParallelLinear, _ParallelLinear
from whalelike.errors import WhaleError
from whalelike.taskgraph import TaskGraphs

log = logging.getLogger(__name__)

_ELEMENTWISE_FUNCTIONS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg,
    torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.relu, torch.tanh, torch.sigmoid,
    F.relu, F.gelu, F.silu, F.tanh, F.sigmoid, F.dropout, F.leaky_relu, F.elu, F.mish, F.hardswish,
}
_ELEMENTWISE_METHODS = {"add", "sub", "mul", "div", "neg", "relu", "tanh", "sigmoid", "__add__", "__mul__"}
_ELEMENTWISE_MODULES = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Dropout, nn.Identity,
                        nn.LeakyReLU, nn.ELU, nn.Mish, nn.Hardswish)


@dataclass
class ShardedModule:
    """What :func:`shard_module` returns. ``roles`` maps each sharded module path to
    ``"column"`` (paired), ``"row"``, ``"column+gather"`` or ``"classifier"``; ``sharded_loss`` is
    set when the model output stays class-sharded and must be fed to it instead of the loss."""

    module: fx.GraphModule
    roles: dict[str, str]
    sharded_loss: Optional[ShardedLoss] = None


# -- analysis: which Linear plays which role -------------------------------------------------------
def _is_elementwise(gm: fx.GraphModule, node: fx.Node) -> bool:
    if node.op == "call_function":
        return node.target in _ELEMENTWISE_FUNCTIONS
    if node.op == "call_method":
        return node.target in _ELEMENTWISE_METHODS
    if node.op == "call_module":
        return isinstance(gm.get_submodule(node.target), _ELEMENTWISE_MODULES)
    return False


class _Analysis:
    """Decides the role of every candidate Linear (``call_module`` nn.Linear in a split region)."""

    def __init__(self, gm: fx.GraphModule, candidates: list[fx.Node], shard_sizes: Mapping[str, Sequence[int]],
                 module_paths: dict[str, str]):
        self.gm = gm
        self.candidates = candidates
        self.is_candidate = set(candidates)
        self.shard_sizes = shard_sizes
        self.module_paths = module_paths
        self.assigned: dict[fx.Node, str] = {}
        self.row_sizes: dict[fx.Node, list[int]] = {}

    def linear(self, node: fx.Node) -> nn.Linear:
        return self.gm.get_submodule(node.target)

    def path(self, node: fx.Node) -> str:
        return self.module_paths.get(node.target, node.target)

    def sizes(self, node: fx.Node) -> list[int]:
        path = self.path(node)
        if path not in self.shard_sizes:
            raise WhaleError(
                f"split region: Linear {path!r} has no entry in the plan's shard_sizes "
                f"(entries: {sorted(self.shard_sizes)}); re-plan with the current capture of the model"
            )
        return list(self.shard_sizes[path])

    def free_column(self, node: fx.Node, sizes: list[int]) -> bool:
        return (node in self.is_candidate and node not in self.assigned
                and self.linear(node).out_features == sum(sizes) and self.sizes(node) == sizes)

    def pair_group(self, seed: fx.Node) -> Optional[tuple[list[fx.Node], list[fx.Node]]]:
        """Column Linears and row Linears of the Megatron group seeded at ``seed``, or None when the
        sharded activations would escape to a consumer that needs the full tensor."""
        sizes = self.sizes(seed)
        columns, rows, closure, queue = [seed], [], {seed}, [seed]
        while queue:
            node = queue.pop()
            for user in node.users:
                if user in closure or user in rows:
                    continue
                if (user in self.is_candidate and user not in self.assigned and user.args[0] is node
                        and len(user.all_input_nodes) == 1 and self.linear(user).in_features == sum(sizes)):
                    rows.append(user)
                    continue
                if not _is_elementwise(self.gm, user):
                    return None
                for arg in user.all_input_nodes:
                    if arg in closure:
                        continue
                    if not self.free_column(arg, sizes):
                        return None
                    columns.append(arg)
                    closure.add(arg)
                    queue.append(arg)
                closure.add(user)
                queue.append(user)
        return (columns, rows) if rows else None

    def run(self, classifier: Optional[fx.Node]) -> None:
        output = next(n for n in self.gm.graph.nodes if n.op == "output")
        for node in self.candidates:
            if node in self.assigned:
                continue
            group = self.pair_group(node)
            if group is not None:
                columns, rows = group
                sizes = self.sizes(node)
                for c in columns:
                    self.assigned[c] = "column"
                for r in rows:
                    self.assigned[r] = "row"
                    self.row_sizes[r] = sizes
            elif node is classifier and list(node.users) == [output]:
                self.assigned[node] = "classifier"
            else:
                self.assigned[node] = "column+gather"


# -- the transform ---------------------------------------------------------------------------------
def split_taskgraphs(graphs: TaskGraphs) -> set[int]:
    """Indices of the TaskGraphs whose operators are sharded: ``split``, or ``split`` inside ``replicate``."""
    return {tg.index for tg in graphs if tg.strategy.kind == "split"
            or (tg.strategy.inner is not None and tg.strategy.inner.kind == "split")}


def original_module_paths(captured: fx.GraphModule, stage: fx.GraphModule) -> dict[str, str]:
    """``call_module`` target in ``stage`` -> module path in the ``captured`` graph it was split from.

    ``split_module`` renames nested targets (``mlp.fc1`` becomes ``mlp_fc1``) but keeps node
    names, so the original node of the same name knows the path; pass the result to
    :func:`shard_module` as ``module_paths``.
    """
    original = {n.name: n.target for n in captured.graph.nodes if n.op == "call_module"}
    return {n.target: original[n.name] for n in stage.graph.nodes if n.op == "call_module" and n.name in original}


def shard_module(gm: fx.GraphModule, node_taskgraph: Mapping[str, int], split_taskgraphs: Iterable[int],
                 shard_sizes: Mapping[str, Sequence[int]], tp_index: int, group: ProcessGroup = None,
                 loss_fn: Optional[Callable] = None, emulator: Optional[Emulator] = None,
                 module_paths: Optional[Mapping[str, str]] = None,
                 output_layout: Optional[OutputLayout] = None) -> ShardedModule:
    """Replace the Linears of the ``split`` TaskGraphs of ``gm`` by uneven tensor-parallel ones, in place.

    ``node_taskgraph`` maps node names to TaskGraph indices (``TaskGraphs.node_taskgraph``),
    ``split_taskgraphs`` are the indices whose strategy is ``split`` (or ``replicate`` with an
    inner ``split``), ``shard_sizes`` is ``StagePlan.shard_sizes``, ``tp_index`` this rank's index in
    ``group``. Every rank of ``group`` must call this with the same arguments except ``tp_index``.
    Pass ``loss_fn`` only where ``gm`` computes the model's output (the last pipeline stage): a
    plain cross-entropy of a lone Linear's output there (:func:`runtime.sharded_loss.choose_classifier`)
    makes that Linear a class-sharded classifier, and the caller must then use
    ``ShardedModule.sharded_loss`` instead of ``loss_fn``. ``output_layout`` says how ``gm``'s
    output makes the model output (default: it is the model output).
    ``module_paths`` maps a ``call_module`` target to the model's module path that keys
    ``shard_sizes`` and ``roles``, for graphs whose targets were renamed (``split_module`` turns
    ``mlp.fc1`` into ``mlp_fc1`` inside a stage); by default a target is its own path.
    Only the graph's own (leaf) Linear modules are replaced; the user's model is not modified.
    """
    splits = set(split_taskgraphs)
    candidates = [
        n for n in gm.graph.nodes
        if n.op == "call_module" and node_taskgraph.get(n.name) in splits
        and isinstance(gm.get_submodule(n.target), nn.Linear)
    ]
    paths = [n.target for n in candidates]
    if len(set(paths)) != len(paths):
        raise WhaleError(
            f"split region calls a Linear more than once ({sorted(p for p in set(paths) if paths.count(p) > 1)}); "
            "weight sharing inside a split region is not supported, move the shared module out of the split scope"
        )
    analysis = _Analysis(gm, candidates, shard_sizes, dict(module_paths or {}))
    classifier = choose_classifier(gm, candidates, loss_fn, output_layout, analysis.path)
    analysis.run(classifier.node if classifier is not None else None)

    sharded_loss = None
    for node, role in analysis.assigned.items():
        path = analysis.path(node)
        linear = analysis.linear(node)
        if role == "row":
            layer = RowParallelLinear(linear, analysis.row_sizes[node], tp_index, group, emulator, name=path)
        else:
            layer = ColumnParallelLinear(linear, analysis.sizes(node), tp_index, group,
                                         gather_output=role == "column+gather", emulator=emulator, name=path)
        if role == "classifier":
            sharded_loss = ShardedLoss(tuple(layer.shard_sizes), tp_index, group, classifier.form.ignore_index,
                                       classifier.form, loss_fn)
        parent, _, leaf = node.target.rpartition(".")
        setattr(gm.get_submodule(parent), leaf, layer)
    roles = {analysis.path(n): r for n, r in analysis.assigned.items()}
    log.info("tensor parallel rank %d: %s", tp_index, ", ".join(f"{p}={r}" for p, r in roles.items()) or "nothing to shard")
    return ShardedModule(gm, roles, sharded_loss)


@dataclass(frozen=True)
class StageSharding:
    """What a pipeline stage needs to shard its ``split`` regions: the capture's node -> TaskGraph
    map, which TaskGraphs are ``split`` and this rank's tensor-parallel group."""

    node_taskgraph: Mapping[str, int]
    split_taskgraphs: frozenset[int]
    group: ProcessGroup = field(default=None, compare=False)

    @classmethod
    def from_graphs(cls, graphs: TaskGraphs, group: ProcessGroup) -> "StageSharding":
        return cls(dict(graphs.node_taskgraph), frozenset(split_taskgraphs(graphs)), group)

    def apply(self, stage: fx.GraphModule, captured: fx.GraphModule, shard_sizes: Mapping[str, Sequence[int]],
              tp_index: int, loss_fn: Optional[Callable], emulator: Optional[Emulator],
              output_layout: Optional[OutputLayout] = None) -> ShardedModule:
        """Shard ``stage`` (a submodule ``split_module`` cut from ``captured``) in place.

        Every plan entry must find its Linear: a ``split`` region the runtime cannot shard would
        silently run unsharded on every rank of the group. With emulation on, the stage's other
        Linears are padded matmul by matmul (a stage-wide segment would span the collectives).
        """
        sharded = shard_module(stage, self.node_taskgraph, self.split_taskgraphs, shard_sizes, tp_index, self.group,
                               loss_fn, emulator, original_module_paths(captured, stage), output_layout)
        missing = sorted(set(shard_sizes) - set(sharded.roles))
        if missing:
            raise WhaleError(
                f"the plan shards {missing} but this stage calls no nn.Linear of that path inside a split "
                f"region (sharded: {sorted(sharded.roles) or 'nothing'}); only nn.Linear modules are sharded: "
                "re-plan with the current model, or move other modules out of the split scope"
            )
        if emulator is not None and emulator.enabled:
            pad_plain_linears(stage, emulator)
        return sharded


def pad_plain_linears(module: nn.Module, emulator: Emulator) -> list[str]:
    """Make every remaining unsharded ``nn.Linear`` of ``module`` a :class:`PaddedLinear`, so a stage
    with tensor-parallel layers is emulated matmul by matmul throughout. Returns the padded paths."""
    padded = []
    for path, child in list(module.named_modules()):
        if type(child) is nn.Linear:
            parent, _, leaf = path.rpartition(".")
            setattr(module.get_submodule(parent), leaf, PaddedLinear(child, emulator))
            padded.append(path)
    return padded


# -- full (unsharded) state dicts ------------------------------------------------------------------
def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with every tensor-parallel weight gathered back to its full shape.

    A collective over each parallel layer's group: every rank of the group must call it.
    """
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    for prefix, layer in module.named_modules():
        if isinstance(layer, _ParallelLinear):
            for param, value in layer.full_tensors().items():
                state[f"{prefix}.{param}" if prefix else param] = value
    return state


def load_full_state_dict(module: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool = True):
    """Load an unsharded state dict into a module whose Linears may be tensor-parallel (each takes its slice)."""
    local = dict(state_dict)
    for prefix, layer in module.named_modules():
        if isinstance(layer, _ParallelLinear):
            for param in ("weight", "bias"):
                key = f"{prefix}.{param}" if prefix else param
                if key in local:
                    local[key] = layer.shard_of(param, local[key])
    return module.load_state_dict(local, strict=strict)
