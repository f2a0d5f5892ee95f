"""Turn a model into one flat ``fx.GraphModule`` whose nodes know their module path and scope.

Two front ends, tried in order:

* ``torch.fx`` symbolic tracing with a tracer that records the open forward-time scope
  (``with wl.split():`` inside ``forward``) on every node it creates. Standard ``torch.nn``
  modules stay ``call_module`` leaves, so the runtime can swap a ``split`` region's Linears for
  sharded ones.
* ``torch.export`` (non-strict) for the many models fx cannot trace (Python control flow on
  shapes, ``dim()`` checks, ...). Export records ``nn_module_stack`` on every node; we turn the
  ``aten.linear`` calls of ``nn.Linear`` modules back into ``call_module`` leaves so the result
  looks to later passes like an fx capture. The batch dimension is exported as dynamic
  (``Dim.AUTO``) so the graph runs at any micro-batch size.

Both graphs share the model's parameters (no copies). Each node gets ``meta["wl_path"]`` (the
innermost module path, ``""`` for the model's own code) and ``meta["wl_scope"]`` (the forward-time
scope or None).
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import traceback
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.nn as nn
from torch.utils._pytree import tree_leaves, tree_map

from .errors import CaptureError
from .strategy import current_scope

log = logging.getLogger(__name__)


def trace(model: nn.Module, args: tuple, kwargs: dict) -> tuple[fx.GraphModule, str]:
    """Capture ``model(*args, **kwargs)`` into a GraphModule; returns it and ``"fx"`` or ``"export"``."""
    try:
        return _trace_fx(model, args, kwargs), "fx"
    except Exception as e:  # noqa: BLE001 - any fx failure sends us to export
        fx_failure = f"{_failing_module(model, e)} ({_first_line(e)})"
        log.info("torch.fx could not trace %s; trying torch.export", fx_failure)
    try:
        with _quiet("torch.fx.experimental.symbolic_shapes"):  # it logs whole graphs on failure
            return _trace_export(model, args, kwargs), "export"
    except Exception as e:  # noqa: BLE001
        raise CaptureError(
            f"cannot capture {type(model).__name__}: torch.fx failed in {fx_failure} and torch.export failed in "
            f"{_failing_module(model, e)} ({_first_line(e)}); try: remove data-dependent Python control flow "
            "there (use torch.where / torch.cond), or capture a smaller part of the model"
        ) from e


# -- torch.fx ---------------------------------------------------------------------------------------
class _ScopeTracer(fx.Tracer):
    """An fx tracer that stamps each node with the forward-time scope open when it was created."""

    def create_node(self, *args, **kwargs) -> fx.Node:
        node = super().create_node(*args, **kwargs)
        node.meta["wl_scope"] = current_scope()
        return node


def _trace_fx(model: nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    tracer = _ScopeTracer()
    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    # Non-tensor inputs (None masks, flags) are constants of the trace, as they are of the model call.
    concrete = {k: v for k, v in bound.arguments.items() if not isinstance(v, torch.Tensor)}
    graph = tracer.trace(model, concrete_args=concrete or None)
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    for node in gm.graph.nodes:
        node.meta["wl_path"] = _innermost_path(node)
    return gm


# -- torch.export -----------------------------------------------------------------------------------
def _trace_export(model: nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    from torch.export import Dim

    def batch_dynamic(x):
        return {0: Dim.AUTO} if isinstance(x, torch.Tensor) and x.dim() > 0 else None

    dynamic = (tree_map(batch_dynamic, args), tree_map(batch_dynamic, kwargs))
    sig = inspect.signature(model.forward)
    names = sig.bind(*args, **kwargs).arguments
    dynamic_shapes = {name: (dynamic[0][i] if i < len(args) else dynamic[1][name]) for i, name in enumerate(names)}
    with fx_traceback.preserve_node_meta():  # lets forward-time scopes annotate nodes (see strategy.py)
        exported = torch.export.export(model, args, kwargs, strict=False, dynamic_shapes=dynamic_shapes)
    # Guards re-check input shapes on every call; the runtime splits this graph, so keep it pure dataflow.
    gm = exported.module(check_guards=False)
    for node in gm.graph.nodes:
        node.meta["wl_path"] = _innermost_path(node)
        node.meta["wl_scope"] = node.meta.get("custom", {}).get("wl_scope")
    _restore_linear_leaves(gm, model)
    return gm


def _restore_linear_leaves(gm: fx.GraphModule, model: nn.Module) -> None:
    """Turn ``aten.linear(x, W, b)`` of each ``nn.Linear`` back into a ``call_module`` of that module.

    Export inlines every module; ``split`` regions are sharded by swapping ``call_module`` Linears,
    so we restore them. The restored submodule is the user's own ``nn.Linear`` (shared parameters).
    """
    modules = dict(model.named_modules())
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.linear.default:
            continue
        path = node.meta["wl_path"]
        linear = modules.get(path)
        weights = [a for a in node.args[1:] if isinstance(a, fx.Node)]
        if not isinstance(linear, nn.Linear) or not all(w.op == "get_attr" for w in weights):
            continue
        expected = [f"{path}.weight"] + ([f"{path}.bias"] if linear.bias is not None else [])
        if [w.target for w in weights] != expected:
            continue
        if not isinstance(gm.get_submodule(path), nn.Linear):
            _set_submodule(gm, path, linear)
        with gm.graph.inserting_before(node):
            leaf = gm.graph.call_module(path, (node.args[0],))
        leaf.meta = dict(node.meta)
        node.replace_all_uses_with(leaf)
        gm.graph.erase_node(node)
        for w in weights:
            if not w.users:
                gm.graph.erase_node(w)
    gm.recompile()


def _set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, module)


def placeholder_values(gm: fx.GraphModule, method: str, model: nn.Module, args: tuple, kwargs: dict) -> list[Any]:
    """The value of each placeholder of ``gm`` (in graph order) for the call ``model(*args, **kwargs)``."""
    if method == "export":
        from torch.export._tree_utils import reorder_kwargs

        values = tree_leaves((tuple(args), reorder_kwargs(kwargs, gm._in_spec)))
    else:  # fx: one placeholder per forward parameter, defaults included
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
        bound.apply_defaults()
        values = list(bound.arguments.values())
    count = sum(1 for n in gm.graph.nodes if n.op == "placeholder")
    if len(values) != count:
        raise CaptureError(
            f"capture: {type(model).__name__}.forward got {len(values)} input(s) but its graph has {count} "
            "placeholder(s); pass example inputs as plain positional tensors and keyword arguments"
        )
    return values


# -- helpers ----------------------------------------------------------------------------------------
def _innermost_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = next(reversed(stack.values()))[0]
    return path


def _failing_module(model: nn.Module, error: BaseException) -> str:
    """Name the innermost module of ``model`` whose ``forward`` was running when ``error`` was raised."""
    paths = {id(m): p for p, m in model.named_modules()}
    where: Optional[str] = None
    tb = error.__traceback__
    for frame, lineno in traceback.walk_tb(tb):
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in paths:
            path = paths[id(owner)] or "<root>"
            where = f"module {path!r} ({type(owner).__name__}.{frame.f_code.co_name}, " \
                    f"{frame.f_code.co_filename}:{lineno})"
    return where or f"module <root> ({type(model).__name__})"


@contextlib.contextmanager
def _quiet(logger_name: str):
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"
