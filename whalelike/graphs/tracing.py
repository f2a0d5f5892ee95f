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

Both are deferred (:class:`DeferredGraphModule`): a graph module's Python code is generated when it is first
called (or its ``code`` read), not on every ``recompile()``. Why: every fx pass ends by regenerating
and compiling the whole module's code (and its graph submodules'), and capture's passes and the
stage split run a dozen of them on graphs that are then cut up, interpreted on fake tensors or
dropped: 70% of capturing and cutting a small Llama into stages went to code that never ran.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import io
import logging
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.nn as nn
from torch.fx._lazy_graph_module import _LazyGraphModule, _use_lazy_graph_module
from torch.utils._pytree import tree_leaves, tree_map

from whalelike.errors import AnnotationError, CaptureError
from whalelike.graphs.leaves import is_conv1d, remove_asserts_and_dead_code, restore_leaves
from whalelike.graphs.nodes import attribute
from whalelike.graphs.output_tree import flatten_output, is_foreign_tree, rebuild_output
from whalelike.strategy import current_scope

log = logging.getLogger(__name__)


class DeferredGraphModule(_LazyGraphModule):
    """A graph module whose ``recompile()`` only marks its code stale; the code is generated when the
    module is first called, its ``code`` read, or it is printed or pickled.

    Why not torch's ``_LazyGraphModule`` as it is (what torch's own graph passes use, the same
    deferral): its first call generates the code and then calls the module again, so the hooks
    registered on the module (FSDP's unshard and reshard, a user's) would run twice on that call.
    Here the first call generates the code and runs the new ``forward`` inside the call already
    under way: hooks run once. Invariant: a deferred module computes exactly what a plain
    ``fx.GraphModule`` of the same graph computes; only when its code is made differs."""

    def _lazy_forward(self, *args: Any, **kwargs: Any) -> Any:
        self.real_recompile()
        return self.forward(*args, **kwargs)

    forward = _lazy_forward


def _defer(gm: fx.GraphModule) -> DeferredGraphModule:
    """``gm`` itself, its class swapped for a :class:`DeferredGraphModule` of its own (fx gives every
    graph module a class of its own, which its code is installed on). The instance keeps all it
    holds (every parameter and buffer with its persistence, its graph, meta and hooks): the classes
    swapped from (``fx.GraphModule``, torch's deferred one, torch.export's unlifted module) keep
    their state on the instance, and the deferred class adds none."""
    gm.__class__ = type("GraphModuleImpl", (DeferredGraphModule,), {})
    gm.recompile()
    return gm


def split_module_deferred(module: fx.GraphModule, split_callback: Callable[[fx.Node], int],
                          **kwargs: Any) -> fx.GraphModule:
    """``torch.fx.passes.split_module.split_module(module, module, split_callback, **kwargs)`` whose
    root and submodules are deferred (:class:`DeferredGraphModule`): their code is made when they first run
    (torch makes them deferred under its own switch; each is then swapped to this module's class, so
    that its first call runs its hooks once)."""
    from torch.fx.passes.split_module import split_module

    with _use_lazy_graph_module(True):
        root = split_module(module, module, split_callback, **kwargs)
    for m in root.modules():
        if isinstance(m, _LazyGraphModule) and not isinstance(m, DeferredGraphModule):
            _defer(m)
    return root


def graph_module(root: Any, graph: fx.Graph, class_name: str = "GraphModule") -> DeferredGraphModule:
    """``fx.GraphModule(root, graph, class_name)``, its code generated when first needed."""
    return DeferredGraphModule(root, graph, class_name)


def trace(model: nn.Module, args: tuple, kwargs: dict) -> tuple[fx.GraphModule, str]:
    """Capture ``model(*args, **kwargs)`` into a GraphModule; returns it and ``"fx"`` or ``"export"``."""
    traced = trace_reusable(model, args, kwargs)
    return traced.bind(model), traced.method


@dataclass
class Trace:
    """A trace with the model left out, so that it can be bound to any model of the same
    architecture (:mod:`whalelike.graphs.capture_cache`): fx's graph (its output structure
    restored), or torch.export's program whose state and the model's constants are replaced by
    meta tensors of their shapes. :meth:`bind` makes the graph module the front end makes, sharing
    the given model's parameters, buffers and constants; no reference to the traced model is kept."""

    method: str
    class_name: str
    graph: Optional[fx.Graph] = None
    program: Any = None                                     # torch.export.ExportedProgram
    model_constants: frozenset = frozenset()                # the program's constants that are model attributes

    def bind(self, model: nn.Module) -> fx.GraphModule:
        if self.method == "fx":
            return graph_module(model, _copy_graph(self.graph), self.class_name)
        program = copy.copy(self.program)
        program._state_dict = {name: attribute(model, name) for name in self.program.state_dict}
        program._constants = {name: attribute(model, name) if name in self.model_constants else value
                              for name, value in self.program.constants.items()}
        return _finish_export(program, model)


def trace_reusable(model: nn.Module, args: tuple, kwargs: dict) -> Trace:
    """:func:`trace`'s work, as a :class:`Trace` (torch.fx first, else torch.export). A scope
    misused in ``forward`` (:class:`AnnotationError`, e.g. ``replicate`` opened inside ``split``) is
    the user's error whichever tracer runs it: raised as it is, not retried with torch.export."""
    try:
        return _trace_fx(model, args, kwargs)
    except AnnotationError:
        raise
    except Exception as e:  # noqa: BLE001 - any other fx failure sends us to export
        fx_failure = f"{_failing_module(model, e)} ({_first_line(e)})"
        log.info("torch.fx could not trace %s; trying torch.export", fx_failure)
    try:
        # the first two keep the whole graphs torch prints on a failure out of the terminal
        with _quiet("torch.fx.experimental.symbolic_shapes"), _no_partial_graph(), _no_stack_traces():
            return _trace_export(model, args, kwargs)
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


def _trace_fx(model: nn.Module, args: tuple, kwargs: dict) -> Trace:
    tracer = _ScopeTracer()
    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    # Non-tensor inputs (None masks, flags) are constants of the trace, as they are of the model call.
    concrete = {k: v for k, v in bound.arguments.items() if not isinstance(v, torch.Tensor)}
    graph = tracer.trace(model, concrete_args=concrete or None)
    gm = graph_module(tracer.root, graph, type(model).__name__)
    for node in gm.graph.nodes:
        node.meta["wl_path"] = _innermost_path(node)
    rebuild_output(gm, *getattr(tracer, "output_tree", (None, None)))
    return Trace("fx", type(model).__name__, graph=gm.graph)


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
    # the program without the model's tensors (Trace): meta tensors of their shapes in their place
    program = copy.copy(exported)
    program._state_dict = {name: _meta_like(t) for name, t in exported.state_dict.items()}
    mine = frozenset(name for name, value in exported.constants.items()
                     if isinstance(value, torch.Tensor) and _attribute_or_none(model, name) is value)
    program._constants = {name: _meta_like(v) if name in mine else v for name, v in exported.constants.items()}
    return Trace("export", type(model).__name__, program=program, model_constants=mine)


def _finish_export(program, model: nn.Module) -> fx.GraphModule:
    """The graph module of an exported ``program`` of ``model``, as the rest of capture expects it."""
    # Guards re-check input shapes on every call; the runtime splits this graph, so keep it pure dataflow.
    gm = _defer(program.module(check_guards=False))
    for node in gm.graph.nodes:
        node.meta["wl_path"] = _innermost_path(node)
        node.meta["wl_scope"] = node.meta.get("custom", {}).get("wl_scope")
    restore_leaves(gm, model)
    remove_asserts_and_dead_code(gm)
    return gm


def retarget_device(gm: fx.GraphModule, old: torch.device, new: torch.device) -> int:
    """Replace the device ``old`` by ``new`` in every node's arguments of ``gm`` (``x.to(x.device)``,
    ``torch.arange(n, device=x.device)``: a trace bakes the device it ran on into the graph). A model
    built on the meta device is traced there; its graph must run where its inputs are. Returns the
    number of nodes changed."""
    old, new = torch.device(old), torch.device(new)

    def swap(value):
        if isinstance(value, torch.device) and value == old:
            return new
        if isinstance(value, str) and value == str(old):
            return str(new)
        return value

    changed = 0
    for module in gm.modules():      # the graph and those of its higher-order operators' bodies
        if not isinstance(module, fx.GraphModule):
            continue
        here = 0
        for node in module.graph.nodes:
            args, kwargs = tree_map(swap, node.args), tree_map(swap, dict(node.kwargs))
            if args != node.args or kwargs != dict(node.kwargs):
                node.args, node.kwargs = args, kwargs
                here += 1
        if here:
            module.recompile()
        changed += here
    return changed


def _copy_graph(graph: fx.Graph) -> fx.Graph:
    """``graph`` copied as ``Graph.__deepcopy__`` copies it, its code generator shared (passes replace
    a graph's code generator, never change it; copying one warns about pytree specs)."""
    new = fx.Graph(tracer_cls=graph._tracer_cls)
    value, old_output = new.graph_copy(graph, val_map={}, return_output_node=True)
    new._codegen = graph._codegen
    output = new.output(value, type_expr=getattr(old_output, "type", None))
    output.meta = copy.copy(old_output.meta)
    return new


def _meta_like(t: Any) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    meta = torch.empty_like(t, device="meta")
    return nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta


def _attribute_or_none(model: nn.Module, name: str) -> Any:
    try:
        return attribute(model, name)
    except AttributeError:
        return None


def placeholder_values(gm: fx.GraphModule, method: str, model: nn.Module, args: tuple, kwargs: dict) -> list[Any]:
    """The value of each placeholder of ``gm`` (in graph order) for the call ``model(*args, **kwargs)``."""
    if method == "export":
        from torch.export._tree_utils import reorder_kwargs

        values = tree_leaves((tuple(args), reorder_kwargs(kwargs, gm.graph._codegen.pytree_info.in_spec)))
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


@contextlib.contextmanager
def _no_stack_traces():
    """torch.export without a stack trace on every node (``torch.fx.config.do_not_emit_stack_traces``):
    it captures and symbolizes the Python stack for each of thousands of operators, 5-8% of an export,
    for ``node.meta["stack_trace"]``, which nothing here reads (errors name the failing module
    through the exception, :func:`_failing_module`). The setting is put back as it was."""
    config = torch.fx.config
    before = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = before


@contextlib.contextmanager
def _no_partial_graph():
    """Keeps the graph torch.export prints to stderr when it fails (``partial_fx_graph``: the whole
    traced prefix, hundreds of lines for a real model) out of the user's terminal: what it prints
    meanwhile is held and written out afterwards, less that graph, which goes to this module's log
    at INFO (``whalelike -v`` shows it). Warnings and everything else still reach stderr."""
    held = io.StringIO()
    try:
        with contextlib.redirect_stderr(held):
            yield
    except BaseException as e:
        partial = getattr(e, "partial_fx_graph", None)
        text = held.getvalue()
        if partial:
            text = text.replace(f"{partial}\n", "")   # printed once per wrapper it passes through
            log.info("torch.export's partial graph at its failure:\n%s", partial)
        sys.stderr.write(text)
        raise
    sys.stderr.write(held.getvalue())


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"
