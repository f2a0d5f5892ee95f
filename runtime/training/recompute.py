"""Activation checkpointing of a stage, one layer at a time, under torch's non-reentrant checkpoint.

Why. A stage keeps every in-flight micro-batch's saved activations until its backward; recomputing
them in the backward trades a second forward for that memory. The planner decides which stages do it
(``StagePlan.recompute``: asked by a region's ``recompute=True``, or chosen because the stage does not
fit otherwise) and prices both sides: memory in :mod:`planner.devices.memory`, the extra forward in
:func:`planner.devices.cost_model.backward_flops`.

Why per layer (the capture's :class:`~whalelike.graphs.taskgraph.Layer`: one transformer block, one
run of the model's own code), as torchtitan and every training recipe checkpoint per block, and not
the whole stage at once: a whole-stage checkpoint keeps only the stage's inputs per micro-batch in
flight, but its backward recomputes the whole stage and so brings back all of one micro-batch's
activations. With one micro-batch in flight (every data-parallel plan, gradient accumulation running
its micro-batches one after another, the last stage of 1F1B) that is exactly what it saved: nothing.
Checkpointing each layer on its own keeps each layer's input per micro-batch in flight, and the
backward recomputes one layer at a time, so the peak is (the inputs of every layer) + (one layer's
activations) whatever the number in flight. The whole-stage form (:func:`wrap` of the stage) stays
for the one case that needs it: with dozens of micro-batches in flight (GPipe) every one's layer
inputs outweigh one micro-batch's activations, and the planner says so per stage
(``StagePlan.recompute_unit``, :func:`planner.devices.memory.recompute_unit`); it is also what a
graph without layer marks or a model without module layers gets (their one layer).

How, per executor:

* a pipeline stage (an ``fx.GraphModule`` cut from the capture, :mod:`runtime.parallel.stage_split`):
  :func:`wrap_graph_layers` cuts it once more, by the Layer index capture stamps on every node
  (``LAYER_META``; node names change when graphs are cut, meta is copied), with torch's
  ``split_module``, and checkpoints each layer's submodule. The layered module holds the *same*
  submodules and tensors (``split_module`` references, never copies, them), so parameter and buffer
  identity, names and the state dict are unchanged; it is kept off the module tree and the stage's
  instance ``forward`` runs it, so ``stage(...)`` still runs the stage's hooks (DDP, emulation). Call
  it after everything that rewrites the stage (tensor-parallel sharding swaps Linears, BatchNorm
  sync, sharded outputs): what runs is the graph as it is then. Nodes such passes add carry no
  mark and join the layer running when they appear; a node that writes in place to a value another
  layer made joins that layer with every layer between (recomputing it would write twice). A stage
  sharded under ZeRO is already cut into the same units, each owning its parameters
  (:mod:`runtime.parallel.stage_units`): the stage worker then checkpoints each unit in place
  (:func:`wrap_layers` over their paths), inside its FSDP unit;
* the data-parallel executor runs the user's eager module: :func:`wrap_layers` checkpoints the
  submodule of each Layer whose name is a module path (``model.layers.3``), leaving code layers (the
  model's own ``forward``, ``<root>``, and any module whose subtree holds another layer) to run
  plainly: they hold little, and recomputing an ancestor would bring its whole subtree back at once.

Why torch's ``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)`` and not
``torch.distributed.algorithms._checkpoint.checkpoint_wrapper`` or the reentrant variant: the
wrapper module inserts ``_checkpoint_wrapped_module`` into every parameter's name, and the
runtime's state names (checkpoints, re-plans, the replica sync's buckets) are the model's own; the
reentrant variant drops gradients of inputs that do not require them, needs at least one input
that does (a first stage's token ids do not), and does not support ``torch.autograd.grad``.
So :func:`wrap` replaces the *instance's* ``forward`` attribute (the class's ``forward`` stays):
``module(...)`` still runs every hook, parameters and buffers keep their names, and
:func:`unwrap` restores what was there. The RNG state is preserved (``preserve_rng_state``), so
dropout draws the same masks in the recompute and training stays exact.

Under ``torch.no_grad()`` (evaluation) the forward runs plainly: nothing is saved to recompute.

Invariant: a wrapped module or stage computes the same values and gradients as the unwrapped one,
bit for bit (same operators in the same order, same RNG draws); only what is kept between forward
and backward changes. :func:`unwrap_layers` leaves the module exactly as it was.
"""
from __future__ import annotations

import logging
import types
from typing import Iterable, Optional

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from whalelike.graphs.nodes import mutates
from whalelike.graphs.taskgraph import LAYER_META
from whalelike.graphs.tracing import split_module_deferred

log = logging.getLogger(__name__)

_SAVED = "_wl_recompute_forward"   # the instance's own forward before wrapping (None: the class's)
_LAYERS = "_wl_recompute_layers"   # a layered module: what recomputes (module paths, or the layered graph)


def _checkpointed_forward(self: nn.Module, *args, **kwargs):
    """The module's own forward, under non-reentrant checkpoint when autograd records."""
    own = self.__dict__[_SAVED]
    forward = own if own is not None else types.MethodType(type(self).forward, self)
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


def wrap(module: nn.Module) -> nn.Module:
    """Make ``module``'s forward recompute its activations in the backward, in place (its
    parameters, buffers and hooks untouched); returns it. Wrapping twice is an error, so each
    :func:`unwrap` undoes exactly one wrap."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"recompute.wrap expects an nn.Module, got {type(module).__name__}")
    if is_wrapped(module):
        raise ValueError(f"recompute.wrap: {type(module).__name__} already recomputes its activations; "
                         "call recompute.unwrap(module) first")
    object.__setattr__(module, _SAVED, module.__dict__.get("forward"))
    # a bound method (deep copies of the module rebind it to the copy)
    object.__setattr__(module, "forward", types.MethodType(_checkpointed_forward, module))
    return module


def unwrap(module: nn.Module) -> nn.Module:
    """Undo :func:`wrap` (no-op on a module that is not wrapped); returns the module."""
    if not is_wrapped(module):
        return module
    own = module.__dict__.pop(_SAVED)
    del module.__dict__["forward"]
    if own is not None:
        object.__setattr__(module, "forward", own)
    return module


def is_wrapped(module: nn.Module) -> bool:
    """Whether :func:`wrap` applies to ``module`` now."""
    return _SAVED in module.__dict__


# -- per layer: the eager module of the data-parallel executor ------------------------------------------
def layer_module_paths(model: nn.Module, layer_names: Iterable[str]) -> list[str]:
    """The module paths of ``model`` that are layers among ``layer_names`` (``Layer.name`` of the
    capture, in order): each a submodule (code layers are not), none inside another (a module whose
    subtree holds another layer is code around blocks: its blocks are the layers), each module once.
    The one answer to "which submodules are the model's layers", for recompute's units and ZeRO's
    (:mod:`runtime.replicas.fsdp_sync`)."""
    modules = dict(model.named_modules())
    paths = [n for n in dict.fromkeys(layer_names) if n and n in modules]
    paths = [p for p in paths if not any(q.startswith(p + ".") for q in paths)]
    chosen, seen = [], set()
    for path in paths:
        if id(modules[path]) not in seen:
            seen.add(id(modules[path]))
            chosen.append(path)
    return chosen


def wrap_layers(model: nn.Module, layer_names: Iterable[str]) -> list[str]:
    """Checkpoint, in place, the submodule of each layer in ``layer_names`` (``Layer.name`` of the
    capture, in order) that is a module path of ``model``; code layers run plainly (module docstring).
    A model with no such layer recomputes whole (its one layer). Returns the module paths
    checkpointed (``[""]``: the model itself); :func:`unwrap_layers` undoes it."""
    _check_not_layered(model)
    chosen = [p for p in layer_module_paths(model, layer_names) if not is_wrapped(model.get_submodule(p))]
    if not chosen:
        log.info("recompute: %s has no module layers among %s; it recomputes whole", type(model).__name__,
                 list(layer_names))
        chosen = [""]
    for path in chosen:
        wrap(model.get_submodule(path))
    object.__setattr__(model, _LAYERS, tuple(chosen))
    return chosen


# -- per layer: a pipeline stage's graph ------------------------------------------------------------------
def layer_units(gm: fx.GraphModule) -> dict[fx.Node, int]:
    """Every computing node of ``gm`` -> the index of the checkpointed unit it runs in (0, 1, ... in
    graph order): one unit per Layer mark (``LAYER_META``), unmarked nodes in the unit running when
    they appear, marks never going back (so units follow the graph's order and ``split_module``
    finds no cycle), and layers joined from a value's producer to any node that writes to it in
    place (module docstring)."""
    body = [n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    layer_of: dict[fx.Node, int] = {}
    current: Optional[int] = None
    for node in body:
        mark = node.meta.get(LAYER_META)
        if isinstance(mark, int) and (current is None or mark > current):
            current = mark
        layer_of[node] = current if current is not None else -1
    # an in-place write to another layer's value: that layer through this one become one unit
    layers = sorted(set(layer_of.values()))
    with_previous = set()   # layers that run in the unit of the layer before them
    for node in body:
        target = node.args[0] if node.args else None
        if mutates(node) and isinstance(target, fx.Node) and layer_of.get(target, layer_of[node]) < layer_of[node]:
            with_previous.update(l for l in layers if layer_of[target] < l <= layer_of[node])
    unit_of, unit = {}, -1
    for layer in layers:
        if layer not in with_previous or unit < 0:
            unit += 1
        unit_of[layer] = unit
    return {node: unit_of[layer_of[node]] for node in body}


def wrap_graph_layers(stage: fx.GraphModule) -> int:
    """Checkpoint each layer of the stage module ``stage`` on its own, in place (module docstring):
    its forward runs the stage cut by :func:`layer_units`, each unit under :func:`wrap`, sharing
    every submodule and tensor. Returns the number of checkpointed units; :func:`unwrap_layers`
    undoes it."""
    if not isinstance(stage, fx.GraphModule):
        raise TypeError(f"recompute.wrap_graph_layers expects an fx.GraphModule (a pipeline stage), got "
                        f"{type(stage).__name__}; for an eager module use recompute.wrap_layers(model, layer_names)")
    _check_not_layered(stage)
    if is_wrapped(stage):
        raise ValueError("recompute.wrap_graph_layers: the stage already recomputes whole; "
                         "call recompute.unwrap(stage) first")
    units = layer_units(stage)
    if not units:   # nothing computes (a stage that only forwards its inputs): nothing to keep or recompute
        object.__setattr__(stage, _LAYERS, None)
        return 0
    layered = split_module_deferred(stage, units.__getitem__, keep_original_order=True)   # code made when a unit first runs
    count = 0
    for name, sub in layered.named_children():
        if name.startswith("submod_"):
            wrap(sub)
            count += 1
    object.__setattr__(stage, _LAYERS, layered)
    object.__setattr__(stage, "forward", types.MethodType(_layered_forward, stage))
    return count


def _layered_forward(self: fx.GraphModule, *args, **kwargs):
    """The stage's graph, layer by layer, each layer under checkpoint (:func:`wrap_graph_layers`)."""
    return self.__dict__[_LAYERS](*args, **kwargs)


def unwrap_layers(module: nn.Module) -> nn.Module:
    """Undo :func:`wrap_layers` or :func:`wrap_graph_layers` (no-op when neither applies); returns
    the module, exactly as it was before."""
    if _LAYERS not in module.__dict__:
        return module
    done = module.__dict__.pop(_LAYERS)
    if isinstance(done, tuple):   # eager: the wrapped module paths
        for path in done:
            unwrap(module.get_submodule(path))
    elif done is not None:        # a graph: the layered module runs through the instance forward
        del module.__dict__["forward"]
    return module


def recomputed_layers(module: nn.Module) -> Optional[list[str]]:
    """What recomputes in ``module`` one layer at a time: the checkpointed module paths (eager), or
    the layered graph's unit names (``submod_<i>``); None when neither applies."""
    if _LAYERS not in module.__dict__:
        return None
    done = module.__dict__[_LAYERS]
    if isinstance(done, tuple):
        return list(done)
    return [] if done is None else [n for n, _ in done.named_children() if n.startswith("submod_")]


def _check_not_layered(module: nn.Module) -> None:
    if _LAYERS in module.__dict__:
        raise ValueError(f"recompute: {type(module).__name__} already recomputes layer by layer; "
                         "call recompute.unwrap_layers(module) first")


# -- the executors' entry points ---------------------------------------------------------------------------
def wrap_stage(module: nn.Module, unit: str = "layer", layer_names: Optional[Iterable[str]] = None) -> nn.Module:
    """Make a recomputing stage's ``module`` checkpoint in the plan's ``unit``
    (``StagePlan.recompute_unit``): ``"layer"``, each layer on its own (a graph stage:
    :func:`wrap_graph_layers`; an eager module: :func:`wrap_layers` over ``layer_names``), or
    ``"stage"``, all of it at once (:func:`wrap`). Returns the module; :func:`unwrap_stage` undoes it."""
    if unit == "stage":
        return wrap(module)
    if unit != "layer":
        raise ValueError(f"recompute.wrap_stage: unit must be 'layer' or 'stage' (StagePlan.recompute_unit), got {unit!r}")
    if isinstance(module, fx.GraphModule) and layer_names is None:
        wrap_graph_layers(module)
    else:
        wrap_layers(module, layer_names or ())
    return module


def unwrap_stage(module: nn.Module) -> nn.Module:
    """Undo :func:`wrap_stage`, whichever unit it used (no-op on a module it did not wrap)."""
    return unwrap(unwrap_layers(module))
