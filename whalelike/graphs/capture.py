"""``wl.capture``: a model and example inputs in, costed :class:`~whalelike.graphs.taskgraph.TaskGraphs` out.

The pipeline, one module per step:

1. :mod:`whalelike.graphs.tracing` turns the model into one flat ``fx.GraphModule`` (torch.fx, else
   torch.export) whose nodes know their module path and forward-time scope;
2. :mod:`whalelike.graphs.regions` assigns every node a TaskGraph and a Layer, and
   :mod:`whalelike.graphs.constant_copies` copies the values that depend on no input value (from
   constants, buffers, parameters and input shapes: position ids, masks, rotary tables) into each
   Layer that uses them;
3. :mod:`whalelike.graphs.costs` measures FLOPs, the non-matmul operators' memory traffic
   (:mod:`whalelike.graphs.memory_traffic`), saved activations and value shapes on fake tensors;
4. this module sums those per Layer (FLOPs and activations per TaskGraph too; the memory traffic
   stays per Layer: the emulator prices it per stage, the planner never reads it), attributes
   parameters (each shared parameter once, to the first Layer that uses it), and finds the tensors
   crossing TaskGraph boundaries (batched along dimension 0 or not: a cut's batched bytes per
   sample, ``Layer.cut_bytes_per_sample``, and the whole bytes of those without a batch dimension,
   ``Layer.cut_bytes_unbatched``, which cross once per micro-batch);
5. :mod:`whalelike.graphs.output_tree` records the model output's leaves (their Layers, batched or
   not) and, given the loss, which of them it reads: ``TaskGraphs.outputs``/``loss_reads``, also
   kept on the graph module (``meta["wl_outputs"]``) for the stage split, so that plan checks and
   the runtime decide where each output goes from the same record. A leaf the loss is known not to
   read is not live to the end of the model in the cut bytes.

Steps 1-3 run once per architecture in a process: capturing an identical model again (same
classes, configuration, inputs; :mod:`whalelike.graphs.capture_cache`) copies the first capture's
graph and binds it to the new model's parameters, and its measured figures where the input shapes
are the same (at another batch size, the trace serves and step 3 measures afresh).
"""
from __future__ import annotations

import hashlib
import logging
import re
from collections import defaultdict
from typing import Any, Callable, Optional

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from whalelike.graphs import capture_cache
from whalelike.graphs.batchnorm_layers import training_batchnorms
from whalelike.config import OPTIMIZERS
from whalelike.graphs.costs import NodeCosts, measure
from whalelike.errors import CaptureError
from whalelike.graphs.nodes import attribute
from whalelike.graphs.constant_copies import recompute_constants
from whalelike.graphs.output_tree import OUTPUTS_META, OutputRecord, loss_reads, output_leaves, record_outputs
from whalelike.graphs.regions import ROOT_LAYER, Regions, assign_regions
from whalelike.sharding.analysis import shardable_fields
from whalelike.graphs.taskgraph import LAYER_META, Boundary, Layer, TaskGraph, TaskGraphs, TensorSpec
from whalelike.graphs.tracing import placeholder_values, retarget_device, trace_reusable

log = logging.getLogger(__name__)

# Optimizer state kept per trainable parameter, in multiples of the parameter's own bytes.
OPTIMIZER_STATE_FACTOR = {"sgd": 0, "sgd_momentum": 1, "adam": 2, "adamw": 2}
assert set(OPTIMIZER_STATE_FACTOR) == set(OPTIMIZERS)


# ``share(key, measure)``: the figures ``measure()`` returns, or the same figures measured by another
# process for the same ``key`` (:func:`measure_key`). runtime.rank.RankRuntime.measured_once passes
# one, so that the ranks of a job capturing the same model at once measure it once.
MeasureShare = Callable[[str, Callable[[], Any]], Any]


def capture(model: nn.Module, example_args: Any, example_kwargs: Optional[dict] = None,
            optimizer: str = "adamw", loss_fn: Optional[Callable] = None,
            share: Optional[MeasureShare] = None) -> TaskGraphs:
    """Capture ``model(*example_args, **example_kwargs)`` into costed TaskGraphs.

    ``example_args``: a tensor or tuple of inputs whose first dimension is the batch; costs are
    reported per sample (totals over this batch divided by its size). ``optimizer`` is one of
    ``sgd``, ``sgd_momentum``, ``adam``, ``adamw`` and sets the optimizer-state bytes. ``loss_fn``
    (``loss_fn(outputs, targets)``, optional) is traced, never run, to record which model outputs
    it reads (``TaskGraphs.loss_reads``): a pipeline then leaves out an output computed before its
    last stage that the loss does not read, where it would otherwise send it on to the loss. The
    model is not modified; the returned ``graph_module`` shares its parameters.

    ``share`` (optional, :data:`MeasureShare`): how step 3's figures are obtained when this process
    has not measured them before; called at most once, with :func:`measure_key`'s key and the
    measuring function. The figures are a pure function of the key's contents, so figures another
    process measured under an equal key are the ones this one would measure.
    """
    if not isinstance(model, nn.Module):
        raise CaptureError(f"capture: model must be an nn.Module, got {type(model).__name__}")
    if optimizer not in OPTIMIZER_STATE_FACTOR:
        raise CaptureError(f"capture: optimizer must be one of {', '.join(OPTIMIZER_STATE_FACTOR)}, got {optimizer!r}")
    args = example_args if isinstance(example_args, tuple) else (example_args,)
    kwargs = dict(example_kwargs or {})
    batch = _batch_size(args, kwargs)
    device = _input_device(args, kwargs)
    args, kwargs = _on_model_device(model, args, kwargs)

    keys = capture_cache.key_of(model, args, kwargs, batch)
    entry = capture_cache.lookup(keys) if keys is not None else None
    if entry is not None:   # the same architecture traced before in this process (capture_cache)
        gm, method = entry.trace.bind(model), entry.trace.method
        regions = assign_regions(gm, model)
        recompute_constants(gm, regions)
        if regions != entry.regions:
            capture_cache.reject(keys)
            entry = None
    figures = None
    if entry is None:
        traced = trace_reusable(model, args, kwargs)
        gm, method = traced.bind(model), traced.method
        regions = assign_regions(gm, model)
        recompute_constants(gm, regions)
        if keys is not None:
            entry = capture_cache.Entry(traced, regions, capture_cache.batch_generic(traced, batch), alive=keys.alive)
            capture_cache.store(keys, entry)
    else:
        figures = capture_cache.measured(entry, keys)
    values = placeholder_values(gm, method, model, args, kwargs)
    if figures is None:   # measured at these input shapes: per sample, from totals over this batch
        def run() -> tuple:
            costs = measure(gm, values, regions.node_taskgraph, device=_measured_on(gm))
            return costs, record_outputs(gm, regions.node_layer, regions.layer_names, costs.outputs, batch)

        figures = run() if share is None else share(measure_key(gm, values, regions), run)
        unattributed = figures[0].forward_flops.get("<unattributed>", 0) + \
            figures[0].backward_flops.get("<unattributed>", 0)
        if unattributed:
            log.warning("capture: %.0f FLOPs ran outside any graph node and are not in any TaskGraph", unattributed)
        if entry is not None:
            capture_cache.remember(entry, keys, figures)
    costs = figures[0]
    # which outputs the loss reads: traced for this capture's loss (cheap), never cached
    outputs = OutputRecord(figures[1], loss_reads(loss_fn, output_leaves(gm)[1]))
    if entry is not None:   # what is derived from this graph alone is shared by its later captures too
        gm.meta[capture_cache.DERIVED_META] = entry.derived
    gm.meta[OUTPUTS_META] = outputs
    if device is not None and any(p.is_meta for p in model.parameters()):
        # traced on meta, run where the inputs are: the device the trace baked in goes there
        retarget_device(gm, torch.device("meta"), device)
    graphs = _assemble(gm, model, method, regions, costs, batch, optimizer, outputs=outputs)
    # the autocast figures (what a bf16 or fp16 plan holds) cost a second run of the whole graph,
    # doubling capture's time: measured when a plan first asks for them (with_autocast)
    graphs._autocast_source = (gm, model, method, regions, costs, batch, optimizer, values, outputs)
    return graphs


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def measure_key(gm: fx.GraphModule, values: list, regions: Regions) -> str:
    """A digest of everything step 3's figures depend on, equal in two processes exactly when
    they would measure the same figures: the graph (every node's name, operator and arguments, as
    fx prints it, object addresses left out), the graph's input values (shape, stride, dtype,
    device), the graph module's parameters and buffers (name, shape, dtype, device), the node to
    TaskGraph map, the device measured on (with a GPU's name and compute capability, which pick its
    attention kernels) and the default dtype."""
    def tensor(t) -> str:
        if not isinstance(t, torch.Tensor):
            return repr(t)
        return f"{tuple(t.shape)}/{t.stride() if t.layout == torch.strided else ''}/{t.dtype}/{t.device}"

    device = _measured_on(gm) or next((v.device for v in values if isinstance(v, torch.Tensor)), None)
    if device is not None and device.type == "cuda":
        device = (str(device), torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device))
    parts = [repr(device), str(torch.get_default_dtype())]
    parts += [_ADDRESS.sub("", node.format_node() or node.name) for node in gm.graph.nodes]
    parts += [tensor(v) for v in values]
    parts += [f"{name}:{tensor(t)}" for name, t in (*gm.named_parameters(), *gm.named_buffers())]
    parts += [f"{name}:{group}" for name, group in sorted(regions.node_taskgraph.items())]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def with_autocast(graphs: TaskGraphs) -> TaskGraphs:
    """``graphs`` with the figures measured under autocast (``Layer.autocast``, the shard groups'
    low-precision bytes), which bf16 and fp16 plans price memory with: measured on the first call
    and kept (the capture's graph run again on fake tensors, under bf16 autocast). Graphs that
    have them, or that did not come from :func:`capture` in this process (loaded from a dict), are
    returned as they are (the planner then scales the float32 bytes)."""
    cached = getattr(graphs, "_with_autocast", None)
    if cached is not None:
        return cached
    source = getattr(graphs, "_autocast_source", None)
    if source is None or all(layer.autocast is not None for layer in graphs.layers):
        return graphs
    gm, model, method, regions, costs, batch, optimizer, values, outputs = source
    autocast_costs = _measure_autocast(gm, values, regions)
    result = graphs if autocast_costs is None else \
        _assemble(gm, model, method, regions, costs, batch, optimizer, autocast_costs, outputs)
    graphs._with_autocast = result
    return result


def _measure_autocast(gm: fx.GraphModule, values: list, regions: Regions) -> Optional[NodeCosts]:
    """The costs under bf16 autocast (the dtypes a bf16 or fp16 plan's activations have: both are
    2 bytes, and autocast casts the same operators for both), or None when the graph cannot run
    under autocast on fake tensors (then the planner scales the float32 bytes). A graph of a model
    built on ``meta`` runs as fake CPU tensors (:func:`_measured_on`)."""
    try:
        return measure(gm, values, regions.node_taskgraph, autocast_dtype=torch.bfloat16, device=_measured_on(gm))
    except (CaptureError, RuntimeError) as e:
        log.warning("capture: measuring under autocast failed (%s); bf16/fp16 plans will price activations as "
                    "half the float32 bytes", str(e).splitlines()[0] if str(e) else type(e).__name__)
        return None


def _measured_on(gm: fx.GraphModule) -> Optional[torch.device]:
    """Where the costs of ``gm`` are measured: a graph of a model built on ``meta`` runs as fake CPU
    tensors (still nothing allocated), where it is where its parameters are. On ``meta`` operators
    take their generic paths (attention through the math path, which saves the whole score matrix,
    where the fused kernels of a real device save a row statistic) and there is no autocast; fake
    CPU tensors measure what the same model built with storage measures, float32 and autocast alike."""
    return torch.device("cpu") if any(t.is_meta for t in [*gm.parameters(), *gm.buffers()]) else None


def _backward_temporaries(regions: Regions, costs: NodeCosts, batch: int) -> list[float]:
    """Per layer, per sample: the most its backward holds above what it started with (its gradient
    temporaries less the saved tensors it has freed by then; ``NodeCosts.backward_live``): the
    highest count from its first operator to its last, less the count it started with.

    It starts once the layer after it is done: what that layer's backward leaves is freed as this
    one's first operators run (the partial gradients of the residual stream once summed, the later
    layer's last saved tensors), before this layer allocates anything, so the start is the lowest
    count up to its first allocation. Counted from the count before its first operator instead,
    those bytes, freed and not this layer's, hid as much of its temporaries: two hidden-size
    tensors a block of a Llama (``bench/memory.py``'s, sequence 64: 57 of its 90 KB a sample
    measured at fp32, 12 of 45 at bf16; ``tests/test_memory_model.py`` compares every block with
    a real backward)."""
    temporaries = [0.0] * len(regions.layer_names)
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, (owner, _) in enumerate(costs.backward_live):
        layer = regions.node_layer.get(owner)
        if layer is not None:
            first.setdefault(layer, i)
            last[layer] = i
    for layer, start in first.items():
        live = [count for _, count in costs.backward_live[start:last[layer] + 1]]
        begin = costs.backward_live[start - 1][1] if start else costs.backward_start_live
        for count in live:
            if count > begin:   # the layer's first allocation (the counts only fell until it)
                break
            begin = count
        temporaries[layer] = max(0.0, max(live) - begin) / batch
    return temporaries


def _layer_bytes(gm: fx.GraphModule, regions: Regions, costs: NodeCosts, batch: int) -> dict[str, list[float]]:
    """Per layer, per sample: bytes its inputs take among its saved activations (made before the
    layer: a model input or an earlier layer's output), bytes of the model outputs it returns, and
    what its backward holds above its start (:func:`_backward_temporaries`)."""
    count = len(regions.layer_names)
    inputs, outputs = [0.0] * count, [0.0] * count
    for saver, producer, _, nbytes in costs.saved:
        layer = regions.node_layer.get(saver)
        made = regions.node_layer.get(producer)
        if layer is not None and (made is None or made < layer):
            inputs[layer] += nbytes / batch
    for node in gm.graph.nodes:
        if node.op != "output":
            continue
        for value in dict.fromkeys(node.all_input_nodes):
            layer = regions.node_layer.get(value.name)
            if layer is not None:
                outputs[layer] += sum(_tensor_bytes(spec) for spec in costs.outputs.get(value.name, ())) / batch
    return {"input_activation": inputs, "output": outputs,
            "backward_temporary": _backward_temporaries(regions, costs, batch)}


def _input_device(args: tuple, kwargs: dict) -> Optional[torch.device]:
    """The device of the first tensor input (None when none has one other than meta)."""
    for t in tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor) and not t.is_meta:
            return t.device
    return None


def _on_model_device(model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The example inputs on the meta device when the model's parameters are there (a model built
    on ``meta`` to be materialised rank by rank): capture runs on fake tensors and needs one device,
    while examples are written with ordinary CPU inputs. Otherwise the inputs as given."""
    if not any(p.is_meta for p in model.parameters()):
        return args, kwargs
    from torch.utils._pytree import tree_map

    move = lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t  # noqa: E731
    return tree_map(move, args), tree_map(move, kwargs)


def _batch_size(args: tuple, kwargs: dict) -> int:
    """The example batch size: every cost is reported per sample, as a total over it divided by it."""
    for t in tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            if t.shape[0] == 0:
                raise CaptureError(
                    f"capture: the example batch is empty (an input of shape {tuple(t.shape)}): costs are "
                    "measured per sample, so it needs at least one; give example inputs with a batch of "
                    "1 or more, e.g. torch.randn(8, ...)"
                )
            return int(t.shape[0])
    raise CaptureError("capture: example_args must contain a tensor whose first dimension is the batch")


def _assemble(gm: fx.GraphModule, model: nn.Module, method: str, regions: Regions, costs: NodeCosts,
              batch: int, optimizer: str, autocast_costs: Optional[NodeCosts] = None,
              outputs: OutputRecord = OutputRecord(())) -> TaskGraphs:
    layer_nodes: dict[int, list[fx.Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        if node.name in regions.node_layer:
            layer_nodes[regions.node_layer[node.name]].append(node)
            # survives the cutting into stages (split_module copies meta): per-layer recompute reads it
            node.meta[LAYER_META] = regions.node_layer[node.name]
    params, borrowed, idle, idle_params = _parameter_owners(gm, regions, model)
    batchnorms = training_batchnorms(gm)
    unread = _unread_outputs(outputs)
    cuts, whole_cuts = _cut_bytes(gm, regions, costs, batch, unread)
    extra = _layer_bytes(gm, regions, costs, batch)
    low = None
    if autocast_costs is not None:
        low = dict(zip(("cut", "cut_unbatched"), _cut_bytes(gm, regions, autocast_costs, batch, unread)),
                   **_layer_bytes(gm, regions, autocast_costs, batch))
    factor = OPTIMIZER_STATE_FACTOR[optimizer]

    registered: dict[int, set] = defaultdict(set)     # parameter -> every name it has in the model
    for source in (gm, model):
        for pname, p in source.named_parameters(remove_duplicate=False):
            registered[id(p)].add(pname)
    layers = []
    for i, name in enumerate(regions.layer_names):
        nodes = layer_nodes[i]
        owned = params.get(i, []) + idle_params.get(i, [])   # the idle ones are held too, never trained
        outside = [p for p in owned if not any(n.startswith(name + ".") for n in registered[id(p)])]
        layers.append(Layer(
            index=i, name=name, taskgraph=regions.layer_taskgraph[i],
            forward_flops=sum(costs.forward_flops.get(n.name, 0) for n in nodes) / batch,
            backward_flops=sum(costs.backward_flops.get(n.name, 0) for n in nodes) / batch,
            forward_memory_bytes=sum(costs.forward_memory_bytes.get(n.name, 0) for n in nodes) / batch,
            backward_memory_bytes=sum(costs.backward_memory_bytes.get(n.name, 0) for n in nodes) / batch,
            param_bytes=sum(p.numel() * p.element_size() for p in owned),
            param_count=sum(p.numel() for p in owned),
            max_param_bytes=max((p.numel() * p.element_size() for p in owned), default=0),
            param_tensors=len(owned),
            activation_bytes_per_sample=sum(costs.saved_bytes.get(n.name, 0) for n in nodes) / batch,
            cut_bytes_per_sample=cuts[i],
            cut_bytes_unbatched=whole_cuts[i],
            nodes=tuple(n.name for n in nodes),
            batchnorm=tuple(dict.fromkeys(batchnorms[n.name] for n in nodes if n.name in batchnorms)),
            borrowed_params=tuple((owner, name, size) for name, (owner, size) in borrowed.get(i, {}).items()),
            idle_state=tuple(idle.get(i, ())),
            outside_param_bytes=sum(p.numel() * p.element_size() for p in outside),
            input_activation_bytes_per_sample=extra["input_activation"][i],
            output_bytes_per_sample=extra["output"][i],
            backward_temporary_bytes_per_sample=extra["backward_temporary"][i],
            autocast=None if low is None else {
                "activation": sum(autocast_costs.saved_bytes.get(n.name, 0) for n in nodes) / batch,
                "input_activation": low["input_activation"][i], "cut": low["cut"][i], "output": low["output"][i],
                "backward_temporary": low["backward_temporary"][i],
                "cut_unbatched": low["cut_unbatched"][i],
                "param_copy": float(sum(autocast_costs.param_copy_bytes.get(n.name, 0) for n in nodes)),
                "forward_memory": sum(autocast_costs.forward_memory_bytes.get(n.name, 0) for n in nodes) / batch,
                "backward_memory": sum(autocast_costs.backward_memory_bytes.get(n.name, 0) for n in nodes) / batch},
        ))

    graphs = []
    for t, strategy in enumerate(regions.strategies):
        mine = [l for l in layers if l.taskgraph == t]
        trainable = sum(p.numel() * p.element_size() for l in mine for p in params.get(l.index, []) if p.requires_grad)
        graphs.append(TaskGraph(
            index=t, strategy=strategy,
            module_paths=tuple(dict.fromkeys(l.name for l in mine)),
            layers=tuple(l.index for l in mine),
            forward_flops=sum(l.forward_flops for l in mine),
            backward_flops=sum(l.backward_flops for l in mine),
            param_bytes=sum(l.param_bytes for l in mine),
            param_count=sum(l.param_count for l in mine),
            optimizer_state_bytes=factor * trainable,
            activation_bytes_per_sample=sum(l.activation_bytes_per_sample for l in mine),
            **shardable_fields(gm, regions.node_taskgraph, t, strategy, costs, batch, autocast_costs),
        ))
    return TaskGraphs(
        graphs=graphs, layers=layers, boundaries=_boundaries(gm, regions, costs, batch), optimizer=optimizer,
        example_batch_size=batch, method=method, graph_module=gm, node_taskgraph=dict(regions.node_taskgraph),
        outputs=outputs.leaves, loss_reads=None if outputs.loss_reads is None else tuple(sorted(outputs.loss_reads)),
    )


def _unread_outputs(outputs: OutputRecord) -> frozenset[str]:
    """Nodes whose every leaf of the model output the loss is known not to read."""
    if outputs.loss_reads is None:
        return frozenset()
    read = {leaf.node for leaf in outputs.leaves if leaf.index in outputs.loss_reads}
    return frozenset(leaf.node for leaf in outputs.leaves if leaf.node and leaf.node not in read)


def _parameter_owners(gm: fx.GraphModule, regions: Regions, model: nn.Module) -> tuple[
        dict[int, list[nn.Parameter]], dict[int, dict], dict[int, list[str]], dict[int, list[nn.Parameter]]]:
    """Layer index -> the parameters it owns: each parameter once, in the first layer that uses it;
    layer index -> ``{name: (owner layer, bytes)}`` of the parameters it uses that an earlier
    layer owns (tied weights: GPT-2's ``lm_head`` reads ``transformer.wte.weight``); and layer index
    -> the names, then the parameters among them, of the state the forward never reads that the
    layer holds (:func:`_idle_state`)."""
    names = {id(p): n for n, p in gm.named_parameters(remove_duplicate=True)}
    owner_of: dict[int, int] = {}
    owners: dict[int, list[nn.Parameter]] = defaultdict(list)
    borrowed: dict[int, dict] = defaultdict(dict)
    for node in gm.graph.nodes:
        if node.name not in regions.node_layer:
            continue
        layer = regions.node_layer[node.name]
        if node.op == "call_module":
            used = list(gm.get_submodule(node.target).parameters())
        elif node.op in ("call_function", "call_method"):
            used = [value for value in (attribute(gm, a.target) for a in node.all_input_nodes if a.op == "get_attr")
                    if isinstance(value, nn.Parameter)]
        else:
            continue
        for p in used:
            if id(p) not in owner_of:
                owner_of[id(p)] = layer
                owners[layer].append(p)
            elif owner_of[id(p)] != layer:
                borrowed[layer][names[id(p)]] = (owner_of[id(p)], p.numel() * p.element_size())
    idle, idle_params = _idle_state(gm, regions, model, set(owner_of))
    return owners, borrowed, idle, idle_params


def _idle_state(gm: fx.GraphModule, regions: Regions, model: nn.Module, used: set[int]) -> tuple[
        dict[int, list[str]], dict[int, list[nn.Parameter]]]:
    """The parameters (ids not in ``used``) and persistent buffers of ``model`` the captured forward
    never reads (DINOv2's ``mask_token``, read only when masked positions are passed; a head kept
    for later), each given to one layer that holds it (``Layer.idle_state``, the model's names):
    the layer named by the longest module path that contains it, else the first. Such state is
    still the model's: the stage holding that layer keeps it (no gradient reaches it, no sync
    reduces it), and the state dict, checkpoints and exports carry it. The model is asked, not the
    graph: an fx graph module keeps only what its nodes reference, while ``torch.export``'s keeps
    everything (under the model's names, sharing its tensors either way). Returns layer -> names,
    and layer -> the parameters among them (their bytes count with the layer's)."""
    read = {id(attribute(gm, node.target)) for node in gm.graph.nodes if node.op == "get_attr"}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            read.update(id(t) for t in gm.get_submodule(node.target).buffers())
    in_graph = dict(gm.named_parameters(remove_duplicate=False))
    found: list[tuple[str, Any]] = []
    for name, p in model.named_parameters():
        if id(p) not in used and id(in_graph.get(name, p)) not in used:
            found.append((name, p))
    graph_buffers = dict(gm.named_buffers(remove_duplicate=False))
    for name, buf in model.named_buffers():
        owner, _, leaf = name.rpartition(".")
        if leaf in model.get_submodule(owner)._non_persistent_buffers_set:
            continue
        if id(buf) not in read and id(graph_buffers.get(name, buf)) not in read:
            found.append((name, buf))
    names, params = defaultdict(list), defaultdict(list)
    if not found or not regions.layer_names:
        return names, params
    for name, tensor in found:
        path = name.rpartition(".")[0]
        holders = [(len(layer), i) for i, layer in enumerate(regions.layer_names)
                   if layer != ROOT_LAYER and (path == layer or path.startswith(layer + "."))]
        index = min(holders, key=lambda h: (-h[0], h[1]))[1] if holders else 0
        names[index].append(name)
        if isinstance(tensor, nn.Parameter):
            params[index].append(tensor)
    log.info("capture: state the forward never reads, held with a layer: %s",
             ", ".join(f"{n} ({regions.layer_names[i]})" for i, ns in sorted(names.items()) for n in ns))
    return names, params


def _tensor_bytes(spec) -> int:
    return TensorSpec("", spec.shape, spec.dtype, batched=False).bytes_per_sample


def _value_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """Nodes whose values can cross a cut: computed values (not inputs, parameters or buffers)."""
    return [n for n in gm.graph.nodes if n.op in ("call_module", "call_function", "call_method")]


def _cut_bytes(gm: fx.GraphModule, regions: Regions, costs: NodeCosts, batch: int,
               unread: frozenset[str] = frozenset()) -> tuple[list[float], list[float]]:
    """Per layer: the values produced at or before it and used after it (a model output by the
    last layer, where the loss runs, unless the loss does not read it), as two figures: bytes per
    sample of the batched ones (dimension 0 the batch), and whole bytes of those without a batch
    dimension (a statistic of the batch; data-free ones were recomputed per Layer and never cross),
    which cross whole, once per micro-batch."""
    count = len(regions.layer_names)
    delta, whole = [0.0] * (count + 1), [0.0] * (count + 1)
    for node in _value_nodes(gm):
        produced = regions.node_layer[node.name]
        consumers = [regions.node_layer.get(u.name, count - 1) for u in node.users
                     if u.op != "output" or node.name not in unread]
        last = max(consumers, default=produced)
        if last > produced:
            for s in costs.outputs.get(node.name, ()):
                batched = len(s.shape) > 0 and s.shape[0] == batch
                size = _tensor_bytes(s) / batch if batched else float(_tensor_bytes(s))
                kept = delta if batched else whole
                kept[produced] += size
                kept[last] -= size
    cuts, whole_cuts, running, running_whole = [], [], 0.0, 0.0
    for i in range(count):
        running += delta[i]
        running_whole += whole[i]
        cuts.append(running)
        whole_cuts.append(running_whole)
    return cuts, whole_cuts


def _boundaries(gm: fx.GraphModule, regions: Regions, costs: NodeCosts, batch: int) -> list[Boundary]:
    crossing: dict[tuple[int, int], list[TensorSpec]] = defaultdict(list)
    for node in _value_nodes(gm):
        src = regions.node_taskgraph[node.name]
        dsts = sorted({regions.node_taskgraph[u.name] for u in node.users if u.name in regions.node_taskgraph} - {src})
        specs = costs.outputs.get(node.name, ())
        for dst in dsts:
            for k, s in enumerate(specs):
                name = node.name if len(specs) == 1 else f"{node.name}.{k}"
                batched = len(s.shape) > 0 and s.shape[0] == batch
                crossing[(src, dst)].append(TensorSpec(name, s.shape[1:] if batched else s.shape, s.dtype, batched))
    return [Boundary(src, dst, tuple(specs)) for (src, dst), specs in sorted(crossing.items())]
