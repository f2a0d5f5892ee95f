"""Turn a model into one flat ``fx.GraphModule`` whose nodes know their module path and scope.

Two front ends, tried in order:

* ``torch.fx`` symbolic tracing with a tracer that records the open forward-time scope
  (``with wl.split():`` inside ``forward``) on every node it creates. Standard ``torch.nn``
  modules stay ``call_module`` leaves, so the runtime can swap a ``split`` region's Linears for
  sharded ones.
* ``torch.export`` (non-strict) for the many models fx cannot trace (Python control flow on
  shapes, ``dim()`` checks, ...). Export records ``nn_module_stack`` on every node; we turn the
  inlined operators of ``nn.Linear`` and GPT-2 ``Conv1D`` modules back into ``call_module`` leaves
  (:mod:`whalelike.graphs.leaves`) so the result looks to later passes like an fx capture. The batch dimension is exported as dynamic
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

from whalelike.graphs.cleanup import remove_asserts_and_dead_code
from whalelike.errors import CaptureError
from whalelike.graphs.leaves import is_conv1d, restore_leaves
from whalelike.graphs.output_tree import flatten_output, is_foreign_tree, rebuild_output
from whalelike.strategy import current_scope

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
            f"{_failing_module(model, e)} ({_first_line(e)}); try: {_export_hint(e)}"
        ) from e


def _export_hint(error: BaseException) -> str:
    """The fix for the export failures real models hit, else the general advice."""
    text = str(error)
    if "Cache" in text and "not a known type" in text:
        return ("the model returns a key/value cache (a transformers Cache object), which training never uses: "
                "build it with use_cache=False in its config (or pass use_cache=False in the example kwargs)")
    return ("remove data-dependent Python control flow there (use torch.where / torch.cond), "
            "or capture a smaller part of the model")


# -- torch.fx ---------------------------------------------------------------------------------------
class _ScopeTracer(fx.Tracer):
    """An fx tracer that stamps each node with the forward-time scope open when it was created and
    keeps the modules ``split`` can shard (GPT-2's ``Conv1D`` besides torch's own) as leaves."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return is_conv1d(m) or super().is_leaf_module(m, module_qualified_name)

    def create_node(self, *args, **kwargs) -> fx.Node:
        node = super().create_node(*args, **kwargs)
        node.meta["wl_scope"] = current_scope()
        return node

    def create_arg(self, a: Any) -> Any:
        if is_foreign_tree(a):  # a returned ModelOutput: flat leaves now, its type back in _trace_fx
            self.output_tree = flatten_output(a, super().create_arg)
            return self.output_tree[0]
        return super().create_arg(a)


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
    rebuild_output(gm, *getattr(tracer, "output_tree", (None, None)))
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
    restore_leaves(gm, model)
    remove_asserts_and_dead_code(gm)
    return gm


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
    """The innermost module path in the node's ``nn_module_stack``; ``""`` for the model's own code.

    Export stamps nodes it creates outside any module call (the batch size's ``sym_size``) with a
    stack entry named after a metadata hook rather than a module: those count as the model's own code.
    """
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = next(reversed(stack.values()))[0]
    return "" if path.startswith("_empty_nn_module_stack") else path


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
