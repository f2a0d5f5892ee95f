"""The ``split`` transform: shard the projections of a captured graph with the plan's uneven shard sizes.

Given the captured ``fx.GraphModule``, which of its nodes belong to ``split`` TaskGraphs, and
``StagePlan.shard_sizes`` (module path -> size per tensor-parallel rank), :func:`shard_module`
swaps every ``call_module`` projection (``nn.Linear``, GPT-2 ``Conv1D``) in those regions for its
parallel counterpart from :mod:`runtime.tensor.layers`:

* **shard groups** (Megatron): whole attention blocks by heads and MLPs (gated ones included) by
  features, as :func:`whalelike.sharding.analysis.analyse_blocks` finds them in the dataflow: column
  projections, the operators between them localised to this rank's heads
  (:mod:`runtime.tensor.block_sharding`), row projections. The sharded activations never leave the rank;
  a group costs one all-reduce forward and one backward. Multi-query attention's k/v projections
  stay whole on every rank (no plan entry, logged as replicated).
* **column + gather**: any other projection. Its output is all-gathered (uneven, padded) so what
  follows sees the full tensor.
* **expert parallel**: a recognised mixture-of-experts layer's experts, whole, spread over the
  group by the plan's expert counts, tokens dispatched and combined by all-to-all
  (:mod:`runtime.tensor.experts`); an unrecognised one is logged and runs whole on every rank.
* **class-sharded classifier**: a lone Linear whose output is the model output, or one leaf of it
  (in a ModelOutput, tuple or dict), when the loss is a plain cross-entropy of that leaf
  (:mod:`runtime.tensor.sharded_loss`). Its logits stay sharded and the returned :class:`ShardedLoss`
  computes the cross-entropy from them, so no rank ever holds the full logits (Whale's 100k-class head).

Why a graph pass and not DTensor's ``parallelize_module``: the layouts here are uneven (DTensor
cannot shard 24/8), and pairing is decided from the dataflow of the captured graph instead of a
hand-written per-model plan.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from runtime.tensor.block_sharding import group_layout, shard_groups
from runtime.tensor.experts import experts_layers, shard_experts
from runtime.emulation.compute import Emulator
from runtime.emulation.network import price_group
from runtime.tensor.sharded_loss import OutputLayout, ShardedLoss, choose_classifier, plain_cross_entropy  # noqa: F401
from runtime.tensor.layers import ColumnParallelLinear, PaddedLinear, ParallelLinear, ProcessGroup
from whalelike.errors import WhaleError
from whalelike.graphs.regions import ATTACHED_META
from whalelike.sharding.analysis import analyse_blocks, projection_dims, taskgraph_of
from whalelike.graphs.taskgraph import TaskGraphs

log = logging.getLogger(__name__)


@dataclass
class ShardedModule:
    """What :func:`shard_module` returns. ``roles`` maps each sharded module path to
    ``"column"`` (paired), ``"row"``, ``"column+gather"``, ``"classifier"`` or ``"experts"``; ``sharded_loss`` is
    set when the model output stays class-sharded and must be fed to it instead of the loss."""

    module: fx.GraphModule
    roles: dict[str, str]
    sharded_loss: Optional[ShardedLoss] = None


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
                 output_layout: Optional[OutputLayout] = None, analysis=None) -> ShardedModule:
    """Replace the Linears of the ``split`` TaskGraphs of ``gm`` by uneven tensor-parallel ones, in place.

    ``node_taskgraph`` maps node names to TaskGraph indices (``TaskGraphs.node_taskgraph``),
    ``split_taskgraphs`` are the indices whose strategy is ``split`` (or ``replicate`` with an
    inner ``split``), ``shard_sizes`` is ``StagePlan.shard_sizes``, ``tp_index`` this rank's index in
    ``group``. Every rank of ``group`` must call this with the same arguments except ``tp_index``.
    Pass ``loss_fn`` only where ``gm`` computes the model's output (the last pipeline stage): a
    plain cross-entropy of a lone Linear's output there (:func:`runtime.tensor.sharded_loss.choose_classifier`)
    makes that Linear a class-sharded classifier, and the caller must then use
    ``ShardedModule.sharded_loss`` instead of ``loss_fn``. ``output_layout`` says how ``gm``'s
    output makes the model output (default: it is the model output).
    ``module_paths`` maps a ``call_module`` target to the model's module path that keys
    ``shard_sizes`` and ``roles``, for graphs whose targets were renamed (``split_module`` turns
    ``mlp.fc1`` into ``mlp_fc1`` inside a stage); by default a target is its own path.
    ``analysis``: :func:`whalelike.sharding.analysis.analyse_blocks` of ``gm``'s region, if the
    caller has it already (:meth:`StageSharding.analysis`), so it runs once per stage.
    Only the graph's own (leaf) Linear modules are replaced; the user's model is not modified.
    """
    splits = set(split_taskgraphs)
    names = dict(module_paths or {})

    def path_of(node: fx.Node) -> str:
        return names.get(node.target, node.target)

    region = {n.name for n in gm.graph.nodes
              if taskgraph_of(n, node_taskgraph) in splits and not n.meta.get(ATTACHED_META)}
    candidates = [n for n in gm.graph.nodes if n.name in region and n.op == "call_module"
                  and projection_dims(gm.get_submodule(n.target)) is not None]
    paths = [n.target for n in candidates]
    if len(set(paths)) != len(paths):
        raise WhaleError(
            f"split region calls a Linear more than once ({sorted(p for p in set(paths) if paths.count(p) > 1)}); "
            "weight sharing inside a split region is not supported, move the shared module out of the split scope"
        )
    analysis = analysis if analysis is not None else analyse_blocks(gm, region)
    layouts = {i: group_layout(g, shard_sizes, path_of, gm) for i, g in enumerate(analysis.groups)}
    classifier = choose_classifier(gm, analysis.lone, loss_fn, output_layout, path_of)

    sharded_loss = None
    roles = {}
    for node in analysis.lone:
        path = path_of(node)
        if path not in shard_sizes:
            raise WhaleError(
                f"split region: projection {path!r} has no entry in the plan's shard_sizes "
                f"(entries: {sorted(shard_sizes)}); re-plan with the current capture of the model"
            )
        role = "classifier" if classifier is not None and node is classifier.node else "column+gather"
        layer = ColumnParallelLinear(gm.get_submodule(node.target), shard_sizes[path], tp_index, group,
                                     gather_output=role == "column+gather", emulator=emulator, name=path)
        if role == "classifier":
            sharded_loss = ShardedLoss(tuple(layer.shard_sizes), tp_index, group, classifier.form.ignore_index,
                                       classifier.form, loss_fn)
        parent, _, leaf = node.target.rpartition(".")
        setattr(gm.get_submodule(parent) if parent else gm, leaf, layer)
        roles[path] = role
    roles.update(shard_groups(gm, analysis, layouts, tp_index, group, emulator, path_of))
    roles.update(shard_experts(gm, region, shard_sizes, tp_index, group, emulator))   # mixture-of-experts layers
    for name, reason in analysis.fallbacks.items():
        node = next((n for n in candidates if n.name == name), None)
        if node is not None and roles.get(path_of(node)) == "column+gather":
            log.info("split: %s is not sharded with a group (%s); its output is gathered", path_of(node), reason)
    for node in analysis.replicated_projections:
        log.info("split: %s stays whole on every rank (%s)", path_of(node),
                 analysis.whole_reasons.get(node.name, "replicated by the analysis"))
    log.info("tensor parallel rank %d: %s", tp_index, ", ".join(f"{p}={r}" for p, r in roles.items()) or "nothing to shard")
    return ShardedModule(gm, roles, sharded_loss)


def outputs_leaving_sharded(stage: fx.GraphModule, outputs: Iterable, captured: fx.GraphModule,
                            node_taskgraph: Mapping[str, int], split_taskgraphs: Iterable[int],
                            shard_sizes: Mapping[str, Sequence[int]], analysis=None) -> dict:
    """The ``outputs`` (:class:`runtime.parallel.stage_split.ValueId`) of pipeline stage ``stage`` that leave it as
    feature shards: each is a lone projection's output in a ``split`` region (a ``column+gather``
    of :func:`shard_module`) used by nothing in the stage, so its gather would only feed the
    boundary, which reshards it anyway (seed paper 001; :mod:`runtime.parallel.boundaries`). Value -> the
    projection's shard sizes along the last dimension. Pure, from the unsharded stage graph: every
    rank computes it for every stage, so both ends of a boundary agree on its layout. ``analysis``:
    the stage region's block analysis if the caller has it (:meth:`StageSharding.analysis`)."""
    splits = set(split_taskgraphs)
    paths = original_module_paths(captured, stage)
    nodes = {n.name: n for n in stage.graph.nodes}
    region = {n.name for n in stage.graph.nodes
              if taskgraph_of(n, node_taskgraph) in splits and not n.meta.get(ATTACHED_META)}
    if analysis is None and region:
        analysis = analyse_blocks(stage, region)
    lone = {n.name for n in analysis.lone} if region else set()   # as shard_module decides
    leaving = {}
    for value in outputs:
        node = nodes.get(value.name)
        if node is None or node.name not in lone or node.op != "call_module":
            continue
        if any(user.op != "output" for user in node.users) or projection_dims(stage.get_submodule(node.target)) is None:
            continue
        path = paths.get(node.target, node.target)
        if path in shard_sizes:
            leaving[value] = list(shard_sizes[path])
    return leaving


def keep_outputs_sharded(stage: fx.GraphModule, values: Iterable) -> None:
    """After :func:`shard_module`: the projections producing ``values`` (from
    :func:`outputs_leaving_sharded`) return their shard instead of gathering it."""
    nodes = {n.name: n for n in stage.graph.nodes}
    for value in values:
        layer = stage.get_submodule(nodes[value.name].target)
        if not (isinstance(layer, ColumnParallelLinear) and layer.gather_output):
            raise WhaleError(f"split: stage output {value} was expected to be a gathered column projection, got "
                             f"{type(layer).__name__}; the ranks would disagree on its layout (a bug: report it)")
        layer.gather_output = False


@dataclass(frozen=True)
class StageSharding:
    """What a pipeline stage needs to shard its ``split`` regions: the capture's node -> TaskGraph
    map, which TaskGraphs are ``split`` and this rank's tensor-parallel group."""

    node_taskgraph: Mapping[str, int]
    split_taskgraphs: frozenset[int]
    group: ProcessGroup = field(default=None, compare=False)
    # stage module -> its region's block analysis, taken once on the unsharded graph (both the
    # boundary layouts and the sharding read it)
    _analyses: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_graphs(cls, graphs: TaskGraphs, group: ProcessGroup) -> "StageSharding":
        return cls(dict(graphs.node_taskgraph), frozenset(split_taskgraphs(graphs)), group)

    def analysis(self, stage: fx.GraphModule):
        """:func:`whalelike.sharding.analysis.analyse_blocks` of ``stage``'s ``split`` region, computed
        once per stage module; call it before the stage is sharded."""
        if id(stage) not in self._analyses:
            region = {n.name for n in stage.graph.nodes
                      if taskgraph_of(n, self.node_taskgraph) in self.split_taskgraphs and not n.meta.get(ATTACHED_META)}
            self._analyses[id(stage)] = (stage, analyse_blocks(stage, region))
        return self._analyses[id(stage)][1]

    def apply(self, stage: fx.GraphModule, captured: fx.GraphModule, shard_sizes: Mapping[str, Sequence[int]],
              tp_index: int, loss_fn: Optional[Callable], emulator: Optional[Emulator],
              output_layout: Optional[OutputLayout] = None, *, devices: Optional[Sequence[str]] = None
              ) -> ShardedModule:
        """Shard ``stage`` (a submodule ``split_module`` cut from ``captured``) in place.

        Every plan entry must find its Linear: a ``split`` region the runtime cannot shard would
        silently run unsharded on every rank of the group. With emulation on, the stage's other
        Linears are padded matmul by matmul (a stage-wide segment would span the collectives), and
        on an emulated network the group's collectives take their ring time over ``devices`` (the
        group's devices in ``tp_index`` order; :func:`runtime.emulation.network.price_group`).
        """
        if emulator is not None and emulator.network is not None:
            if devices is None:
                raise WhaleError("StageSharding.apply: the network is emulated; pass devices (the tensor-parallel "
                                 "group's devices in tp_index order) so its collectives are priced")
            price_group(self.group, emulator.network, devices)
        sharded = shard_module(stage, self.node_taskgraph, self.split_taskgraphs, shard_sizes, tp_index, self.group,
                               loss_fn, emulator, original_module_paths(captured, stage), output_layout,
                               analysis=self.analysis(stage))
        missing = sorted(set(shard_sizes) - set(sharded.roles))
        if missing:
            raise WhaleError(
                f"the plan shards {missing} but this stage calls no projection (nn.Linear, GPT-2 Conv1D) of that "
                f"path inside a split region (sharded: {sorted(sharded.roles) or 'nothing'}): re-plan with the "
                "current model, or move other modules out of the split scope"
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
def full_state_dict(module: nn.Module, state: Optional[Mapping[str, torch.Tensor]] = None) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` (or ``state``, its tensors already gathered over a ZeRO group) with
    every tensor-parallel weight gathered back to its full shape.

    A collective over each parallel layer's group: every rank of the group must call it.
    """
    given = state is not None
    state = {k: v.detach().clone() for k, v in (state if given else module.state_dict()).items()}
    for prefix, layer in module.named_modules():
        if isinstance(layer, ParallelLinear):
            keys = {param: f"{prefix}.{param}" if prefix else param for param in ("weight", "bias")}
            values = {param: state[key] for param, key in keys.items() if given and key in state}
            for param, value in layer.full_tensors(values).items():
                state[keys[param]] = value
    for base, layer in experts_layers(module):     # expert-parallel layers: their experts' rows
        for target in layer.targets.values():
            state[base + target] = layer.full_tensor(state[base + target])
    return state


def load_full_state_dict(module: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool = True):
    """Load an unsharded state dict into a module whose Linears may be tensor-parallel (each takes its slice)."""
    return module.load_state_dict(tensor_parallel_slices(module, state_dict), strict=strict)


def tensor_parallel_slices(module: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict`` (unsharded) with each tensor-parallel weight of ``module`` cut to this rank's slice."""
    local = dict(state_dict)
    for prefix, layer in module.named_modules():
        if isinstance(layer, ParallelLinear):
            for param in ("weight", "bias"):
                key = f"{prefix}.{param}" if prefix else param
                if key in local:
                    local[key] = layer.shard_of(param, local[key])
    for base, layer in experts_layers(module):
        for target in layer.targets.values():
            if base + target in local:
                local[base + target] = layer.shard_of(local[base + target])
    return local
