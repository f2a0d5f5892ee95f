"""A pipeline stage cut into layer modules that own their parameters: ZeRO's units inside a stage.

Why. A pipeline stage is an ``fx.GraphModule`` cut from the capture (:mod:`runtime.parallel.stage_split`)
whose parameters are flat attributes of the stage itself. FSDP2 gathers a unit's parameters when
the unit's ``forward`` is called, so a stage sharded as one unit gathers *all* of its parameters at
once: under ZeRO 3 every rank then holds its rows plus the whole stage at its peak (``w = f + 1``),
which is what a rank without ZeRO holds, and a model whose stages do not fit one device whole cannot
be trained at all however many devices shard it. FSDP2's answer for eager models is one unit per
transformer block (torchtitan shards each block, then the root); this module gives a graph stage
the same structure: one submodule per layer of the capture, each holding the parameters only it
reads, so FSDP2 gathers one layer (and prefetches the next) at a time.

How. :func:`cut` splits the stage's graph by the capture's Layer marks with torch's
``split_module`` (the units of :func:`runtime.training.recompute.layer_units`: one per Layer, nodes
without a mark in the layer running when they appear, layers joined where one writes in place to
another's value), then moves each parameter that exactly one unit reads into that unit (registered
there; the unit's graph reads it as an attribute instead of an argument). A parameter several units
read (weights tied inside the stage, a relative-position table every block reads) and every buffer
stay on the layered module's root, in the stage's root unit, gathered across all their uses (FSDP2
refuses a parameter in two units, and one freed after its first use would be missing at the next).
The stage module then holds the layered module as its child ``units`` and nothing else the graph
reads (state the forward never reads, ``Layer.idle_state``, stays where it was), and its instance
``forward`` runs the layered module, so ``stage(...)`` still runs the stage's own hooks (the root
unit's, the emulator's). The same tensors are moved, never copied: identity, values and the
model's names of the state are unchanged; only the stage's own state-dict keys gain the unit's
path, so the stage worker derives its names after cutting.

Why not ``torch.distributed.pipelining``'s stage module: it takes the stage as the user wrote it
(eager submodules), which a stage cut from a traced graph does not have.

The units serve recompute too (:func:`runtime.training.recompute.wrap_layers` over
:func:`unit_paths`): each layer is then checkpointed inside its FSDP unit, the layout torchtitan
uses (activation checkpointing applied to a block, then ``fully_shard`` of the block), so a
recomputed layer runs on the parameters FSDP2 gathered for its backward.

Invariant: a cut stage computes the same values and gradients as the uncut one, operator for
operator (``split_module`` keeps the graph's order); :func:`unit_paths` lists every unit in the order
it runs; cutting registers no parameter more often than the stage did (a parameter that a module
the graph calls also registers, a tied weight, is left where it is: FSDP2's units are then chosen by
:func:`runtime.replicas.sync_parts.own_units`, which leaves such a unit to the root).
"""
from __future__ import annotations

import types
from typing import Optional

import torch.fx as fx
import torch.nn as nn

from runtime.parallel.stage_split import attribute_tensor, sink_attribute
from runtime.training.recompute import layer_units
from whalelike.graphs.tracing import split_module_deferred

UNITS = "units"   # the stage module's child that holds the layered module
_CUT = "_wl_stage_units"   # instance attribute: the unit paths of a cut stage


def cut(stage: fx.GraphModule) -> list[str]:
    """Cut ``stage`` into one module per layer, in place (module docstring); returns the units' paths
    in ``stage``, in the order they run (:func:`unit_paths`). A stage whose graph computes nothing, or
    in one layer, is left as it is (one unit: itself; returns ``[]``)."""
    if not isinstance(stage, fx.GraphModule):
        raise TypeError(f"stage_units.cut expects a pipeline stage (an fx.GraphModule), got {type(stage).__name__}")
    if _CUT in stage.__dict__:
        raise ValueError("stage_units.cut: the stage is already cut into units")
    units = layer_units(stage)
    if len(set(units.values())) < 2:
        object.__setattr__(stage, _CUT, [])
        return []
    read = _read_attributes(stage)
    # buffers kept out of the state dict (``position_ids``, rotary ``inv_freq``) stay out of it:
    # split_module registers every attribute it copies as persistent
    transient = {id(b) for m in stage.modules() for n, b in m.named_buffers(recurse=False)
                 if n in m._non_persistent_buffers_set}
    layered = split_module_deferred(stage, units.__getitem__, keep_original_order=True)   # code made when a unit first runs
    _sink_single_use_parameters(layered)
    for module in layered.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if id(buffer) in transient:
                module._non_persistent_buffers_set.add(name)
    # the stage keeps only what its graph never reads (idle state); the rest lives in the layered module
    for target in read:
        owner, _, name = target.rpartition(".")
        module = stage.get_submodule(owner)
        for table in (module._parameters, module._buffers, module._modules):
            table.pop(name, None)
    stage.add_module(UNITS, layered)
    paths = [f"{UNITS}.{name}" for name, _ in layered.named_children() if name.startswith("submod_")]
    object.__setattr__(stage, _CUT, paths)
    object.__setattr__(stage, "forward", types.MethodType(_units_forward, stage))
    return paths


def unit_paths(stage: nn.Module) -> Optional[list[str]]:
    """The unit paths of a stage :func:`cut` cut (``[]``: it computes in one unit, itself); None for a
    stage that was never cut."""
    paths = stage.__dict__.get(_CUT)
    return None if paths is None else list(paths)


def _units_forward(self: fx.GraphModule, *args, **kwargs):
    """The stage's graph, unit by unit (:func:`cut`)."""
    return self._modules[UNITS](*args, **kwargs)


def _read_attributes(stage: fx.GraphModule) -> list[str]:
    """The targets of every attribute and module the stage's graph reads."""
    return list(dict.fromkeys(n.target for n in stage.graph.nodes if n.op in ("get_attr", "call_module")))


def _sink_single_use_parameters(layered: fx.GraphModule) -> None:
    """Each parameter the layered module's root reads for exactly one unit becomes that unit's own
    attribute (:func:`runtime.parallel.stage_split.sink_attribute`, as stages get theirs); the rest
    stay at the root. Each unit changed is recompiled once."""
    changed: dict[int, fx.GraphModule] = {}
    attrs = [n for n in layered.graph.nodes if n.op == "get_attr"]
    # a tensor may be read under several names (weights tied by the model: lm_head.weight is wte.weight)
    reads: dict[int, int] = {}
    for attr in attrs:
        tensor = attribute_tensor(layered, attr.target)
        reads[id(tensor)] = reads.get(id(tensor), 0) + sum(u.args.count(attr) if u.op == "call_module" else 2
                                                           for u in attr.users)
    # a module the graph calls (a leaf module) is registered in the unit that calls it, with its parameters
    held: dict[int, set[str]] = {}
    for unit_name, unit in layered.named_children():
        for param in unit.parameters():
            held.setdefault(id(param), set()).add(unit_name)
    for attr in attrs:
        owner, _, name = attr.target.rpartition(".")
        if name not in layered.get_submodule(owner)._parameters:
            continue                                   # a buffer: the root unit keeps it
        users = list(attr.users)
        param = layered.get_parameter(attr.target)
        if reads[id(param)] != 1 or users[0].op != "call_module" or held.get(id(param), {users[0].target}) != {
                users[0].target}:
            continue                                   # read by several units (or by the root): the root's
        unit = sink_attribute(layered, attr, users[0])
        layered.graph.erase_node(attr)
        del layered.get_submodule(owner)._parameters[name]
        changed[id(unit)] = unit
    for unit in changed.values():
        unit.recompile()
    layered.recompile()

