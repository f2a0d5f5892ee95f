"""Make an export graph look like an fx capture: module leaves restored, metadata asserts and dead
code removed (the two passes every ``torch.export`` graph goes through before regions are assigned).

**Leaves.** Turn the inlined operators of shardable modules back into ``call_module`` leaves.

``torch.export`` inlines every module: an ``nn.Linear`` becomes one ``aten.linear`` node, GPT-2's
``Conv1D`` (``transformers.pytorch_utils.Conv1D``: ``y = x @ W + b`` with ``W`` of shape
``[in, out]``) becomes ``view -> addmm -> view``. The ``split`` transform shards modules by swapping
``call_module`` leaves for parallel ones, and the planner reads their sizes from the leaves, so we
restore the leaves here. The restored submodule is the user's own module (shared parameters).

A module's operators are the nodes whose innermost module path (``meta["wl_path"]``) is the
module's path. They are replaced by one ``call_module`` when they form a closed unit:

* one tensor input from outside (shape reads such as ``sym_size`` do not count: the module
  recomputes them from its input);
* one node whose value is used outside;
* the tensors they read are the module's own (all its parameters; buffers such as BatchNorm's
  running statistics where it reads them), matched by *identity*, not by name: with tied
  weights export names the one tensor after its first owner (GPT-2's ``lm_head.weight`` is
  ``transformer.wte.weight``), so names cannot be trusted.

Otherwise (a module called twice, a module reading another's parameters) the operators stay
inlined and the module is simply not a leaf; nothing is guessed.

**Cleanup.** Drop metadata asserts and dead nodes before regions are assigned.

``torch.export`` leaves nodes that compute nothing the model uses: runtime checks of tensor metadata
(``aten._assert_tensor_metadata`` before each ``.to``), symbolic-shape asserts, and values the
model computed and dropped (a mask branch it did not take, a parameter read for an op that was
rewritten). Each would be given a scope like any node, and a dead node whose module is annotated
differently from its neighbours forms a TaskGraph of its own (a stage with no work). They are
removed here; the graph computes exactly what it computed before.

Why not only ``Graph.eliminate_dead_code``: it keeps impure nodes, and the asserts are impure by
definition (they may raise), so they must be named and removed first. In-place updates (a
BatchNorm's running statistics) are impure too and stay.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.fx as fx
import torch.nn as nn

from whalelike.graphs.nodes import attribute
from torch.nn.modules.batchnorm import _BatchNorm

log = logging.getLogger(__name__)


def is_conv1d(module: nn.Module) -> bool:
    """GPT-2-style ``Conv1D`` (transformers.pytorch_utils), recognised by duck typing so that
    ``transformers`` stays an optional dependency: ``nf`` outputs, weight ``[nx, nf]``."""
    if type(module).__name__ != "Conv1D":
        return False
    weight = module._parameters.get("weight")  # not getattr: fx's tracer records attribute reads as nodes
    return isinstance(weight, torch.Tensor) and weight.dim() == 2 and getattr(module, "nf", None) == weight.shape[1]


def is_leaf_module(module: nn.Module) -> bool:
    """Modules kept as ``call_module`` leaves: those ``split`` can shard (Linear, Conv1D), and
    BatchNorm, which the runtime may synchronise (``runtime.parallel.sync_batchnorm``) and whose train/eval mode
    must stay switchable (inlined, the captured mode is frozen into ``aten.batch_norm``)."""
    return isinstance(module, (nn.Linear, _BatchNorm)) or is_conv1d(module)


def restore_leaves(gm: fx.GraphModule, model: nn.Module, keep: Callable[[nn.Module], bool] = is_leaf_module) -> list[str]:
    """Collapse the inlined operators of each module of ``model`` for which ``keep`` holds into a
    ``call_module`` node of ``gm``; returns the restored paths."""
    modules = dict(model.named_modules())
    by_path: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        path = node.meta.get("wl_path", "")
        if node.op == "call_function" and path in modules and keep(modules[path]):
            by_path.setdefault(path, []).append(node)
    restored = [path for path, nodes in by_path.items() if _collapse(gm, path, modules[path], nodes)]
    if restored:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return restored


def _collapse(gm: fx.GraphModule, path: str, module: nn.Module, nodes: list[fx.Node]) -> bool:
    inside = set(nodes)
    params = {id(p) for p in module.parameters(recurse=False)}
    own = params | {id(b) for b in module.buffers(recurse=False)}   # BatchNorm's running statistics
    inputs: list[fx.Node] = []
    read: set[int] = set()
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg in inside or _is_shape_read(arg):
                continue
            if arg.op == "get_attr":
                value = attribute(gm, arg.target)
                if id(value) not in own:
                    return False
                read.add(id(value))
            elif arg not in inputs:
                inputs.append(arg)
    escaping = [n for n in nodes if any(u not in inside for u in n.users)]
    if len(inputs) != 1 or len(escaping) != 1 or not params <= read:
        log.debug("module %s stays inlined (%d inputs, %d outputs)", path, len(inputs), len(escaping))
        return False
    (result,) = escaping
    if not _has_submodule(gm, path) or gm.get_submodule(path) is not module:
        _set_submodule(gm, path, module)
    with gm.graph.inserting_before(result):
        leaf = gm.graph.call_module(path, (inputs[0],))
    leaf.meta = dict(result.meta)
    result.replace_all_uses_with(leaf)
    for node in reversed(nodes):
        if not node.users:
            gm.graph.erase_node(node)
    return True


def _is_shape_read(node: fx.Node) -> bool:
    """A symbolic size (``aten.sym_size``): an int the module recomputes from its own input."""
    value = node.meta.get("val")
    return isinstance(value, torch.SymInt) or (node.op == "call_function" and "sym_size" in str(node.target))


def _has_submodule(root: nn.Module, path: str) -> bool:
    try:
        root.get_submodule(path)
        return True
    except AttributeError:
        return False


def _set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    owner = root
    for part in parent.split(".") if parent else []:
        if not hasattr(owner, part):
            owner.add_module(part, nn.Module())
        owner = getattr(owner, part)
    setattr(owner, name, module)


# -- cleanup: metadata asserts and dead code ------------------------------------------------------
_aten = torch.ops.aten

# Operators that only check metadata; their results are never used.
ASSERT_OPERATORS = frozenset(op for op in (
    getattr(_aten, "_assert_tensor_metadata", None),
    getattr(_aten, "_assert_scalar", None),
    getattr(_aten, "_assert_async", None),
    getattr(_aten, "sym_constrain_range", None),
    getattr(_aten, "sym_constrain_range_for_size", None),
    getattr(_aten, "_functional_assert_scalar", None),
    getattr(_aten, "_functional_assert_async", None),
) if op is not None)


def _is_assert(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    target = node.target
    packet = getattr(target, "overloadpacket", target)
    return packet in ASSERT_OPERATORS or target in ASSERT_OPERATORS


def remove_asserts_and_dead_code(gm: fx.GraphModule) -> int:
    """Erase metadata asserts, then every node whose value nothing uses; returns how many went."""
    before = len(gm.graph.nodes)
    for node in reversed(list(gm.graph.nodes)):
        if _is_assert(node) and not node.users:
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return before - len(gm.graph.nodes)
