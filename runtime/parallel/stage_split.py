"""Split a captured fx graph into pipeline stages and describe the values that cross them.

``torch.fx.passes.split_module`` does the cutting (one submodule per stage, as
``torch.distributed.pipelining``'s ``pipe_split`` front end does). On top of it this module:

* moves tensor attributes that ``split_module`` leaves on the root (``get_attr`` of a bare
  ``nn.Parameter`` or buffer) into the stage that uses them, so every stage module owns its
  parameters (the same idea as ``pipelining._IR``'s ``move_param_to_callee``);
* records, per stage, where each input comes from: a model input (every rank holds the global
  batch, so these are read locally and never sent) or an output of an earlier stage, which need not
  be the previous one (skip connections send directly from producer stage to consumer stage);
* lets stages share a parameter (tied embeddings across the pipeline): each stage module holds the
  same ``nn.Parameter``, and :mod:`runtime.parallel.tied_weights` keeps the ranks' copies in sync. A buffer used by
  several stages is copied to each (buffers carry no gradient);
* infers each boundary value's per-sample shape, dtype and whether it carries a gradient back, by
  running the split graph on fake tensors (no real compute), so receivers can allocate buffers; a
  tensor without a batch dimension 0 (the same shape at two batch sizes: a statistic of the
  micro-batch) crosses whole (``ValueSpec.batched`` False, :mod:`runtime.parallel.boundaries`);
* routes the model outputs computed before the last stage (an encoder-decoder's
  ``encoder_last_hidden_state``) by :func:`whalelike.graphs.output_tree.route_outputs`, the rule
  ``planner.plan_checks`` applies to a plan, on the capture's record of the outputs
  (``GraphModule.meta["wl_outputs"]``) and the loss: one the loss reads (or may read) is sent on to
  the last stage (an ``aten.alias`` of it there, so it crosses like any boundary value and its
  gradient comes back), one it does not read is left out (None in the output the loss receives).
  A graph without that record (not made by ``whalelike.capture``) keeps the old rule: every model
  output must come from the last stage.

The stage modules share their parameters with the model they were split from (no copies).
"""
from __future__ import annotations

from contextlib import nullcontext

import logging
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import torch
from torch.nn.utils.stateless import _reparametrize_module
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.node import map_aggregate, map_arg
from torch.utils._pytree import TreeSpec, tree_map, tree_unflatten

from runtime.replicas.held_state import is_dtensor
from whalelike.graphs.output_tree import OUTPUTS_META, OutputRouteError, OutputRoutes, loss_reads, output_leaves, \
    route_outputs
from whalelike.graphs.capture_cache import derived
from whalelike.graphs.taskgraph import LAYER_META
from whalelike.graphs.tracing import graph_module, split_module_deferred

log = logging.getLogger(__name__)


class StageSplitError(ValueError):
    """A graph cannot be split into the requested pipeline stages."""


@dataclass(frozen=True)
class ValueId:
    """Output ``index`` of stage ``stage``; ``name`` is its node name in the captured graph."""

    stage: int
    index: int
    name: str = field(default="", compare=False)

    def __str__(self) -> str:
        return f"{self.name!r} (stage {self.stage} output {self.index})"


@dataclass(frozen=True)
class ModelInput:
    """Positional model input ``index`` (batched along dim 0, read locally on every rank)."""

    index: int
    name: str


@dataclass(frozen=True)
class ValueSpec:
    """Per-sample shape (batch dimension 0 removed), dtype, and whether a gradient flows back.
    ``batched`` False: the value has no batch dimension (its shape does not change with the batch
    size) and ``shape`` is the whole value's; it crosses whole, once per micro-batch."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    batched: bool = True


@dataclass
class Stage:
    """One pipeline stage: ``module(*args)`` with args in ``inputs`` order returns its values in
    ``outputs`` order (see :meth:`unpack`)."""

    index: int
    module: fx.GraphModule
    inputs: tuple[ValueId | ModelInput, ...]
    outputs: tuple[ValueId, ...]
    returns_single: bool

    def unpack(self, returned: Any) -> dict[ValueId, Any]:
        """The values of one call of ``module`` (or a wrapper of it, e.g. DDP), by output."""
        return dict(zip(self.outputs, (returned,) if self.returns_single else tuple(returned)))

    @property
    def received(self) -> tuple[ValueId, ...]:
        """Inputs produced by other stages (in argument order)."""
        return tuple(v for v in self.inputs if isinstance(v, ValueId))


@dataclass
class PipelineSplit:
    """A model cut into stages, with the data flow between them."""

    stages: list[Stage]
    root: fx.GraphModule        # the split graph: calling it runs every stage in one process
    output_structure: Any       # the model's output with ValueIds at its leaves
    output_spec: Optional[TreeSpec] = None   # export graphs return flat outputs; this rebuilds the model's
    source: Optional[fx.GraphModule] = None  # the captured graph the stages were cut from
    routes: OutputRoutes = OutputRoutes()    # model outputs of earlier stages sent on to the last, or left out
    # a stage output's node name in ``source`` (split_module renames the nodes it copies into a stage:
    # ``add_15`` becomes ``add_tensor_15``), for value_specs to find its fake value there
    source_names: dict = field(default_factory=dict)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def consumers(self, value: ValueId) -> list[int]:
        """Stages that take ``value`` as an input, ascending."""
        return [s.index for s in self.stages if value in s.inputs]

    def model_output(self, values: Mapping[ValueId, Any]) -> Any:
        """Rebuild the model's output structure from the last stage's values."""
        output = map_aggregate(self.output_structure, lambda x: values[x] if isinstance(x, ValueId) else x)
        return output if self.output_spec is None else tree_unflatten(list(output), self.output_spec)

    def value_specs(self, inputs: tuple) -> dict[ValueId, ValueSpec]:
        """Shape, dtype and gradient flag of every value sent between stages, for model inputs
        shaped like ``inputs`` (the batch size is free). Runs the graph on fake tensors twice,
        with two batch sizes, to tell the batch dimension apart: a value whose dimension 0 follows
        the batch size is batched; one whose shape stays the same has no batch dimension and
        crosses whole (``batched`` False); any other (a batch dimension elsewhere) is an error.

        The fake values of every node of the captured graph are kept on it (per input shapes), so
        a re-planned split of the same graph (layers moved to another stage, :mod:`runtime.balance.rebalance`)
        finds its new boundary values there without running anything again. A split whose stages
        receive nothing (one stage) runs nothing."""
        received = [(stage, value) for stage in self.stages for value in stage.received]
        known = fake_node_values(self.source, inputs) if self.source is not None and received else None
        runs = None
        specs = {}
        for stage, value in received:
            name = self.source_names.get(value, value.name)
            if known is not None and all(name in k for k in known):
                a, b = (k[name] for k in known)
            else:
                runs = runs or [_fake_stage_outputs(self.root, inputs, batch) for batch in (2, 3)]
                a, b = runs[0][value], runs[1][value]
            if not isinstance(a, torch.Tensor):
                raise StageSplitError(
                    f"value {value} is used by stage {stage.index} but is a {type(a).__name__}, not a "
                    f"tensor; only tensors can cross pipeline stages: move the code computing it into "
                    f"stage {stage.index}"
                )
            if a.dim() > 0 and a.shape[0] == 2 and b.shape[0] == 3 and a.shape[1:] == b.shape[1:]:
                specs[value] = ValueSpec(tuple(a.shape[1:]), a.dtype, a.requires_grad)
            elif a.shape == b.shape:   # no batch dimension: crosses whole
                specs[value] = ValueSpec(tuple(a.shape), a.dtype, a.requires_grad, batched=False)
            else:
                raise StageSplitError(
                    f"value {value} has shape {tuple(a.shape)} for a batch of 2 and {tuple(b.shape)} for a "
                    f"batch of 3: its batch dimension is not dimension 0; a tensor crossing pipeline stages is "
                    f"batched along dimension 0 or has no batch dimension: move the code computing it into stage "
                    f"{stage.index}, or make its batch dimension the first (e.g. .transpose(0, 1))"
                )
        return specs


_SOURCE_NAME = "whalelike_source_name"


def split_stages(gm: fx.GraphModule, node_stage: Mapping[str, int], loss_fn: Optional[Callable] = None) -> PipelineSplit:
    """Cut ``gm`` into stages 0..S-1: ``node_stage`` maps every computing node's name to its stage.

    Placeholders, ``get_attr`` and the output node need no entry. A node must not use a value
    computed in a later stage. Model outputs of earlier stages are routed (module docstring) by
    what ``loss_fn(outputs, targets)`` reads (traced, not run), else by the capture's record of it.
    """
    num_stages = 1 + max(node_stage.values(), default=-1)
    # torch.export's module returns a flat output list and unflattens it in generated code
    output_spec = getattr(getattr(gm.graph._codegen, "pytree_info", None), "out_spec", None)
    original = gm
    gm, node_stage, routes = _route_outputs(gm, node_stage, num_stages, loss_fn)
    gm, node_stage = _localize_input_sizes(gm, node_stage)

    def stage_of(node: fx.Node) -> int:
        try:
            return node_stage[node.name]
        except KeyError:
            raise StageSplitError(
                f"node {node.name!r} ({node.op} {node.target}) has no stage in node_stage; "
                f"assign every call node of the graph to a stage"
            ) from None

    for node in gm.graph.nodes:
        for used in node.all_input_nodes:
            if used.op not in ("placeholder", "get_attr") and node.op != "output" and stage_of(used) > stage_of(node):
                raise StageSplitError(
                    f"node {node.name!r} in stage {stage_of(node)} uses {used.name!r} from later stage "
                    f"{stage_of(used)}; stages must follow the graph's data flow"
                )

    for node in gm.graph.nodes:   # split_module copies meta, not names: each copy remembers its node's name
        node.meta[_SOURCE_NAME] = node.name
    try:
        root = split_module_deferred(gm, stage_of, keep_original_order=True)   # code made when a stage first runs
    finally:
        for node in gm.graph.nodes:
            node.meta.pop(_SOURCE_NAME, None)
    # the root also holds whatever its get_attr nodes reach (export graphs read nested parameters)
    present = {int(name.removeprefix("submod_")) for name, _ in root.named_children() if name.startswith("submod_")}
    missing = sorted(set(range(num_stages)) - present)
    if missing:
        raise StageSplitError(f"stage(s) {missing} have no nodes; every stage 0..{num_stages - 1} needs at least one")
    _sink_attributes(root)
    _match_buffer_persistence(root, original)
    split = _describe(root, num_stages)
    split.output_spec = output_spec
    split.source = original
    split.routes = routes
    for stage in split.stages:
        (ret,) = [n for n in stage.module.graph.nodes if n.op == "output"]
        returned = [ret.args[0]] if stage.returns_single else list(ret.args[0])
        split.source_names.update((value, node.meta[_SOURCE_NAME]) for value, node in zip(stage.outputs, returned)
                                  if isinstance(node, fx.Node) and _SOURCE_NAME in node.meta)
    for stage in split.stages:
        log.debug("stage %d: inputs %s, outputs %s", stage.index, [str(v) for v in stage.inputs],
                  [str(v) for v in stage.outputs])
    return split


def node_stages_from_plan(graphs, plan) -> dict[str, int]:
    """Node name -> stage from a Plan's ``StagePlan.layers`` and the captured ``Layer.nodes``."""
    layer_stage = {layer: sp.index for sp in plan.stages for layer in sp.layers}
    out = {}
    for layer in graphs.layers:
        if layer.index not in layer_stage:
            raise StageSplitError(f"layer {layer.index} ({layer.name}) is in no stage of the plan")
        out.update(dict.fromkeys(layer.nodes, layer_stage[layer.index]))
    return out


def stage_flops_from_plan(graphs, plan) -> list[tuple[float, float]]:
    """Per stage: (forward, backward) FLOPs per sample, summed over the stage's layers."""
    by_index = {layer.index: layer for layer in graphs.layers}
    return [
        (sum(by_index[i].forward_flops for i in sp.layers), sum(by_index[i].backward_flops for i in sp.layers))
        for sp in sorted(plan.stages, key=lambda sp: sp.index)
    ]


def stage_memory_bytes_from_plan(graphs, plan, precision: str = "fp32") -> list[tuple[float, float]]:
    """Per stage: (forward, backward) bytes per sample that the stage's non-matmul operators read
    and write (``Layer.forward_memory_bytes``/``backward_memory_bytes``, summed over the stage's
    layers as :func:`stage_flops_from_plan` sums FLOPs), for the emulator's memory-bandwidth term
    (:mod:`runtime.emulation.compute`). At ``precision`` other than ``"fp32"``, the figures captured
    under autocast (``Layer.autocast``) when every layer has them (what
    :func:`whalelike.graphs.capture.with_autocast` adds), else the float32 ones. A capture without
    the fields (a file written before they existed) gives 0: no bytes priced."""
    by_index = {layer.index: layer for layer in graphs.layers}
    measured = precision != "fp32" and all(layer.autocast is not None and "forward_memory" in layer.autocast
                                           for layer in graphs.layers)

    def of(layer) -> tuple[float, float]:
        if measured:
            return layer.autocast["forward_memory"], layer.autocast["backward_memory"]
        return layer.forward_memory_bytes, layer.backward_memory_bytes

    out = []
    for sp in sorted(plan.stages, key=lambda sp: sp.index):
        pairs = [of(by_index[i]) for i in sp.layers]
        out.append((float(sum(f for f, _ in pairs)), float(sum(b for _, b in pairs))))
    return out


# -- internals ------------------------------------------------------------------------------------
def _route_outputs(gm: fx.GraphModule, node_stage: Mapping[str, int], num_stages: int,
                   loss_fn: Optional[Callable]) -> tuple[fx.GraphModule, dict, OutputRoutes]:
    """Apply :func:`whalelike.graphs.output_tree.route_outputs` to ``gm``'s output: on a copy of the
    graph (sharing ``gm``'s modules), each leaf sent on to the last stage is read there through an
    ``aten.alias`` node of the last stage (in its last Layer, for per-layer recompute), each leaf left
    out becomes None. ``gm`` unchanged when nothing routes (or it has no capture record)."""
    record = gm.meta.get(OUTPUTS_META)
    if record is None or num_stages < 2:
        return gm, dict(node_stage), OutputRoutes()
    leaves, spec = output_leaves(gm)
    if len(leaves) != len(record.leaves):
        raise StageSplitError(f"the graph returns {len(leaves)} output leaves but its capture recorded "
                              f"{len(record.leaves)}; re-capture the model with whalelike.capture")
    reads = loss_reads(loss_fn, spec) if loss_fn is not None else record.loss_reads
    try:
        routes = route_outputs(record.leaves, lambda leaf: node_stage.get(leaf.node), num_stages, reads)
    except OutputRouteError as e:
        raise StageSplitError(str(e)) from None
    if not routes.forwarded and not routes.dropped:
        return gm, dict(node_stage), routes
    gm = graph_module(gm, _copy_graph(gm.graph))
    stages = dict(node_stage)
    nodes = {n.name: n for n in gm.graph.nodes}
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    last = num_stages - 1
    last_layer = max((n.meta[LAYER_META] for n in gm.graph.nodes
                      if stages.get(n.name) == last and LAYER_META in n.meta), default=None)
    replacement: dict[fx.Node, Any] = {nodes[leaf.node]: None for leaf, _ in routes.dropped}
    for leaf, _ in routes.forwarded:   # a node that is also a dropped leaf is forwarded: some leaf reads it
        value = nodes[leaf.node]
        if replacement.get(value) is not None:   # two leaves of one node: one alias
            continue
        with gm.graph.inserting_before(output):
            alias = gm.graph.call_function(torch.ops.aten.alias.default, (value,))
        stages[alias.name] = last
        if last_layer is not None:
            alias.meta[LAYER_META] = last_layer
        replacement[value] = alias
    output.args = (map_arg(output.args[0], lambda n: replacement.get(n, n)),)
    gm.recompile()
    for leaf, stage in routes.forwarded:
        log.debug("model output %r of stage %d is sent on to the last stage %d", leaf.name, stage, last)
    if routes.dropped:
        log.info("model output(s) %s, computed before the last stage and not read by the loss, are left out of the "
                 "output the loss receives (None in their place)",
                 ", ".join(f"{leaf.name!r} (stage {stage})" for leaf, stage in routes.dropped))
    return gm, stages, routes


def _is_input_size(node: fx.Node) -> bool:
    """``x.size(...)`` of a model input: torch.export's dynamic batch size (``aten.sym_size.int``)."""
    reads_size = ((node.op == "call_function" and node.target is torch.ops.aten.sym_size.int)
                  or (node.op == "call_method" and node.target == "size"))
    return reads_size and all(a.op == "placeholder" for a in node.all_input_nodes)


def _localize_input_sizes(gm: fx.GraphModule, node_stage: Mapping[str, int]) -> tuple[fx.GraphModule, dict]:
    """Give every stage its own copy of each size read from a model input.

    An exported graph reads the dynamic batch size once (``sym_size_int = aten.sym_size.int(mask, 0)``)
    and every later reshape uses it, but only tensors cross stages. Model inputs are sliced locally
    on every rank, so each consuming stage can read the size itself. Works on a copy of the graph
    (sharing ``gm``'s modules); returns it with ``node_stage`` extended by the copies.
    """
    if not any(_is_input_size(n) for n in gm.graph.nodes):
        return gm, dict(node_stage)
    gm = graph_module(gm, _copy_graph(gm.graph))
    stages = dict(node_stage)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in [n for n in gm.graph.nodes if _is_input_size(n)]:
        by_stage: dict[int, list[fx.Node]] = {}
        for user in node.users:
            if user.op != "output" and stages.get(user.name, stages.get(node.name)) != stages.get(node.name):
                by_stage.setdefault(stages[user.name], []).append(user)
        for stage, users in by_stage.items():
            with gm.graph.inserting_before(min(users, key=order.__getitem__)):
                local = gm.graph.node_copy(node)
            stages[local.name] = stage
            for user in users:
                user.replace_input_with(node, local)
    gm.recompile()
    return gm, stages


def _copy_graph(graph: fx.Graph) -> fx.Graph:
    new = fx.Graph()
    output = new.graph_copy(graph, {})
    new.output(output)
    return new


def _sink_attributes(root: fx.GraphModule) -> None:
    """Turn every root-level ``get_attr`` of a tensor into an attribute of the stage using it.

    Each stage changed is recompiled once, after all its attributes are sunk: regenerating a
    stage's code per attribute cost a whole-graph recompile each (tens of milliseconds apiece)."""
    changed: dict[int, fx.GraphModule] = {}
    for attr in [n for n in root.graph.nodes if n.op == "get_attr"]:
        for call in list(attr.users):
            sub = sink_attribute(root, attr, call)
            changed[id(sub)] = sub
        root.graph.erase_node(attr)
    for sub in changed.values():
        sub.recompile()
    root.recompile()
    root.delete_all_unused_submodules()


def attribute_tensor(root: nn.Module, target: str) -> torch.Tensor:
    """The parameter or buffer ``target`` (a dotted path) of ``root``."""
    return root.get_parameter(target) if _is_parameter(root, target) else root.get_buffer(target)


def sink_attribute(root: fx.GraphModule, attr: fx.Node, call: fx.Node) -> fx.GraphModule:
    """Make the tensor of ``root``'s ``get_attr`` node ``attr`` an attribute of the submodule that
    ``call`` (a ``call_module`` of ``root``, one of ``attr``'s users) runs, read there instead of
    passed in: registered under a local name, its placeholder replaced by a ``get_attr`` and the
    argument dropped from ``call``. Returns the submodule; the caller recompiles it (once, after all
    its attributes) and erases ``attr`` when no user is left."""
    tensor = attribute_tensor(root, attr.target)
    sub: fx.GraphModule = root.get_submodule(call.target)
    position = call.args.index(attr)
    placeholder = [n for n in sub.graph.nodes if n.op == "placeholder"][position]
    local = "_" + attr.target.replace(".", "_")
    if isinstance(tensor, nn.Parameter):
        sub.register_parameter(local, tensor)
    else:
        sub.register_buffer(local, tensor)
    first_op = next(n for n in sub.graph.nodes if n.op != "placeholder")
    with sub.graph.inserting_before(first_op):
        placeholder.replace_all_uses_with(sub.graph.get_attr(local))
    sub.graph.erase_node(placeholder)
    call.args = call.args[:position] + call.args[position + 1:]
    return sub


def _match_buffer_persistence(root: fx.GraphModule, original: nn.Module) -> None:
    """Keep buffers that are non-persistent in ``original`` (e.g. ``position_ids``) out of the stages'
    state dicts: ``split_module`` and attribute sinking re-register every buffer as persistent."""
    persistent = {id(t) for t in original.state_dict(keep_vars=True).values()}
    for module in root.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if id(buffer) not in persistent:
                module._non_persistent_buffers_set.add(name)


def _is_parameter(module: nn.Module, target: str) -> bool:
    owner, _, name = target.rpartition(".")
    return name in module.get_submodule(owner)._parameters


def _describe(root: fx.GraphModule, num_stages: int) -> PipelineSplit:
    placeholders = [n for n in root.graph.nodes if n.op == "placeholder"]
    source: dict[fx.Node, ValueId | ModelInput] = {n: ModelInput(i, n.name) for i, n in enumerate(placeholders)}
    calls: dict[int, fx.Node] = {}
    outputs: dict[int, tuple[ValueId, ...]] = {}
    single: dict[int, bool] = {}
    result = None
    for node in root.graph.nodes:
        if node.op == "call_module":
            s = int(node.target.removeprefix("submod_"))
            calls[s] = node
            (ret,) = [n for n in root.get_submodule(node.target).graph.nodes if n.op == "output"]
            returned = ret.args[0]
            single[s] = not isinstance(returned, (tuple, list))
            names = [returned] if single[s] else list(returned)
            outputs[s] = tuple(ValueId(s, i, getattr(r, "name", str(r))) for i, r in enumerate(names))
            if single[s]:
                source[node] = outputs[s][0]
        elif node.op == "call_function" and node.target is operator.getitem:
            producer, index = node.args
            source[node] = outputs[int(producer.target.removeprefix("submod_"))][index]
        elif node.op == "output":
            result = map_arg(node.args[0], lambda n: source[n])
    stages = [
        Stage(s, root.get_submodule(calls[s].target), tuple(source[a] for a in calls[s].args), outputs[s], single[s])
        for s in range(num_stages)
    ]
    early = []
    map_aggregate(result, lambda x: early.append(x) if isinstance(x, ValueId) and x.stage != num_stages - 1 else x)
    if early:
        raise StageSplitError(
            f"model output(s) {', '.join(map(str, early))} are computed before the last stage "
            f"{num_stages - 1}; every model output must come from the last stage (the one computing the loss) "
            "unless the graph comes from whalelike.capture, whose record of the outputs lets them be sent on "
            "to the last stage or left out when the loss does not read them"
        )
    return PipelineSplit(stages, root, result)


def fake_node_values(source: fx.GraphModule, inputs: tuple) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every node's value of ``source`` on fake inputs shaped like ``inputs`` with batch 2 and 3,
    computed once per input shapes and autocast state and kept (fake tensors hold no storage): with
    what is derived from ``source``'s graph (:func:`whalelike.graphs.capture_cache.derived`: the capture
    cache's entry of its architecture when it has one, where every later capture of the same
    architecture, e.g. the next Engine's model, finds them; else ``source``'s own). The model's own tensors (``get_attr`` values) are left out, so nothing kept
    refers to a model. A pipeline's first step asks for them (:meth:`PipelineSplit.value_specs`);
    calling it ahead on a capture (``graphs.graph_module``, with the step's micro-batch inputs or any
    batch of them: only the shapes past dimension 0, dtypes, device and autocast state count) does
    that work once for every later Engine of the architecture in the process and in processes
    forked from it."""
    device = next((x.device.type for x in inputs if isinstance(x, torch.Tensor)), "cpu")
    # autocast gives the values other dtypes (a bf16 step's boundary buffers are bf16)
    casting = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
    key = ("fake node values", tuple((tuple(x.shape[1:]), x.dtype) for x in inputs), device, casting)
    cache = derived(source)
    if key not in cache:
        cache[key] = tuple({name: tree_map(_kept, value)
                            for name, value in _fake_run(source, inputs, batch, _NodeRecorder).items()
                            if not (isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor))}
                           for batch in (2, 3))
    return cache[key]


def _kept(value: Any) -> Any:
    """A fake value as kept: detached (its autograd graph saved the real weights it met), with its
    ``requires_grad``; real tensors inside containers dropped to None."""
    if isinstance(value, FakeTensor):
        return value.detach().requires_grad_(value.requires_grad)
    return None if isinstance(value, torch.Tensor) else value


def _fake_stage_outputs(root: fx.GraphModule, inputs: tuple, batch: int) -> dict[ValueId, Any]:
    """Run the split graph on fake inputs of batch size ``batch``; return every stage output."""
    return _fake_run(root, inputs, batch, _Recorder)


def _fake_run(root: fx.GraphModule, inputs: tuple, batch: int, recorder_type) -> dict:
    """Run ``root`` under ``recorder_type`` (an fx Interpreter with ``values``) on fake inputs of
    batch size ``batch``.

    Buffers are restored afterwards: an in-place update of a real buffer from real operands alone
    (BatchNorm's ``num_batches_tracked.add_(1)``) runs for real even under ``FakeTensorMode``. Run
    under autocast, the values have the dtypes autocast gives them (the boundary buffers of a bf16
    step are bf16), and autocast's cache of weight casts, which the run filled with fake tensors,
    is emptied."""
    saved = [(b, b.detach().clone()) for b in root.buffers()]
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), torch.enable_grad():   # requires_grad as in training
            fake = [torch.empty((batch, *x.shape[1:]), dtype=x.dtype) for x in inputs]
            # parameters a ZeRO sync holds sharded (DTensors, runtime.replicas.fsdp_sync) run as whole
            # fakes, and so does what has no storage on this rank (a model built on the meta device
            # keeps the stages other ranks hold there): one device for the whole run
            whole = {name: torch.empty(t.shape, dtype=t.dtype, requires_grad=t.requires_grad)
                     for name, t in root.named_parameters(remove_duplicate=False) if is_dtensor(t) or t.is_meta}
            whole.update({name: torch.empty(t.shape, dtype=t.dtype)
                          for name, t in root.named_buffers(remove_duplicate=False) if t.is_meta})
            recorder = recorder_type(root)
            with _reparametrize_module(root, whole) if whole else nullcontext():
                recorder.run(*fake)
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)
        # under autocast (runtime.training.precision) the fake run cached fake low-precision copies of
        # the real weights; the real forwards of the same autocast region would compute with them
        torch.clear_autocast_cache()
    return recorder.values


class _NodeRecorder(fx.Interpreter):
    """Records the value of every node by name."""

    def __init__(self, root: fx.GraphModule):
        super().__init__(root)
        self.values: dict[str, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        self.values[n.name] = out
        return out


class _Recorder(fx.Interpreter):
    def __init__(self, root: fx.GraphModule):
        super().__init__(root)
        self.values: dict[ValueId, Any] = {}

    def call_module(self, target, args, kwargs):
        out = super().call_module(target, args, kwargs)
        s = int(target.removeprefix("submod_"))
        (ret,) = [n for n in self.module.get_submodule(target).graph.nodes if n.op == "output"]
        values = tuple(out) if isinstance(ret.args[0], (tuple, list)) else (out,)
        self.values.update((ValueId(s, i), v) for i, v in enumerate(values))
        return out
