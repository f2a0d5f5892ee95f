"""Reuse a capture within one process when the same model architecture is captured again.

Why: tracing (``torch.export`` for most ``transformers`` models) and measuring the costs on fake
tensors take seconds for a small model and minutes for a large one, and one process often
captures the same architecture more than once: a script captures to plan and then builds the
Engine (which captures again, to check the plan and build its executor), ``train.py
--compare-naive`` plans twice, a benchmark builds one Engine per configuration, every rank of a
test builds one per optimizer. The second capture of an identical model keeps the first one's
trace (:class:`whalelike.graphs.tracing.Trace`, which holds no tensor of the first model: it is
bound to the new model's parameters, buffers and constants, as the front end binds a fresh trace)
and its measured figures (costs, output record: keyed by node name); the cheap passes after the
trace (regions, constant copies) run again on the new graph module, and must give the cached
regions, else the capture runs afresh.

Why not torch's caches: ``torch.compile``'s cache keys compiled code on guards over one module
object, and ``torch.export`` has none; neither carries our regions, costs and output record.

Two levels. The trace (and the regions the passes give it) depends on the model and on the
inputs' structure, never on the batch size when the trace holds the batch dimension symbolic
(torch.fx never sees a shape; torch.export is asked for a dynamic batch dimension and keeps it so
unless the model's code pins it, which :func:`batch_generic` reads off the program): such a
trace is kept under a key in which the batch dimension of the inputs is a symbol, and serves a
capture of any batch of 2 or more. What capture measures on it (costs, the output record) depends
on the example batch: kept per exact input shapes within the entry. So a capture at a new batch
size (a rank's share after a plan made at the global batch, a new micro-batch size) reuses the
trace and measures afresh: :func:`stats` counts it a ``trace_hit``, a capture reusing both a ``hit``.
The optimizer (which sets only the optimizer-state bytes, computed after the cache) and the loss
(which only decides which outputs it reads, traced anew on every capture) are in neither key.

Invariant: a hit is indistinguishable from a fresh capture of the new model. So the key holds
everything a trace can depend on, and a model the key cannot describe is never cached:

* every module (path; class, kept alive by the entry so that its identity stays unique) and every
  plain attribute in its ``__dict__``: numbers, strings, dtypes, containers, dataclasses
  (``Strategy``; a field outside equality, ``scope_id``, by the pattern of its values: which
  modules share a scope), ``transformers`` configs (their ``to_dict()``), functions without a
  closure, plain tensors by content (a trace copies them in as constants);
* every parameter and buffer by name, shape, dtype and device, and ``requires_grad`` (their
  values never enter a trace: both front ends lift or reference them);
* the example inputs' structure, tensor shapes (the batch dimension as a symbol for a
  batch-generic trace), dtypes, devices and ``requires_grad``, and their non-tensor values (fx
  bakes those in); the forward-time scope open at capture; the default dtype.

A forward or backward hook (on a module, or global), a bound method or a closure stored on a
module, or an attribute of any other type makes a model undescribable: it is captured afresh
every time. At most :data:`MAX_ENTRIES` entries, least recently used evicted (and
:data:`MAX_MEASURED` input shapes measured per entry); no entry refers to a captured model or its
tensors. ``WHALELIKE_CAPTURE_CACHE=0`` in the environment turns it off.
"""
from __future__ import annotations

import dataclasses
import enum
import hashlib
import os
import types
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from whalelike.strategy import current_scope

MAX_ENTRIES = 32
MAX_MEASURED = 8   # input shapes whose measured figures an entry keeps
# a plain tensor attribute larger than this is not hashed: the model is captured afresh
MAX_HASHED_BYTES = 64 << 20


class _Undescribable(Exception):
    """The model holds something the key cannot describe: no caching."""


@dataclass(frozen=True)
class Keys:
    """:func:`key_of`'s answer: the trace's key at these exact input shapes, the key with the batch
    dimension a symbol (None for a batch of 1), the exact inputs (the measured figures' key within
    an entry), and what the keys name by identity (kept alive by the entry)."""

    exact: tuple
    generic: Optional[tuple]
    inputs: tuple
    alive: tuple


@dataclass
class Entry:
    """One trace's reusable parts: the trace without the model, the regions the passes after it
    gave (the check on a hit), whether it serves any batch of 2 or more, and per exact input
    shapes what capture measured on it (node-name keyed: ``(NodeCosts, output leaves)``)."""

    trace: Any          # whalelike.graphs.tracing.Trace
    regions: Any        # whalelike.graphs.regions.Regions
    generic: bool = False
    measured: "OrderedDict[tuple, tuple]" = field(default_factory=OrderedDict)
    alive: tuple = ()   # the classes and functions the key names by identity
    # what later steps derive from the graph alone (no tensor of any model: fake values, shapes), shared
    # by every graph module bound from this entry through its meta[DERIVED_META]; e.g. the fake value of
    # every node that runtime.parallel.stage_split keeps per input shapes
    derived: dict = field(default_factory=dict)


DERIVED_META = "whalelike_capture_derived"


def derived(gm: Any) -> dict:
    """What later steps derive from ``gm``'s graph alone (fake values, shapes), kept with it under
    ``gm.meta[DERIVED_META]``: its cache entry's :attr:`Entry.derived` when it came from the cache
    (shared by every graph module bound from that entry), else a dict of its own. A copy of ``gm``
    that keeps its graph (``whalelike.graphs.costs.fake_copy``) shares it rather than copying it."""
    return gm.meta.setdefault(DERIVED_META, {})


_entries: "OrderedDict[tuple, Entry]" = OrderedDict()
_stats = {"hits": 0, "trace_hits": 0, "misses": 0, "undescribable": 0, "rejected": 0}


def enabled() -> bool:
    return os.environ.get("WHALELIKE_CAPTURE_CACHE", "1") != "0"


def clear() -> None:
    _entries.clear()


def stats() -> dict[str, int]:
    """In this process: hits (trace and measured figures reused), trace hits (the trace reused, the
    figures measured at new input shapes), misses, undescribable models and rejected hits (regions
    differed)."""
    return dict(_stats)


def key_of(model: nn.Module, args: tuple, kwargs: dict, batch: int) -> Optional[Keys]:
    """The :class:`Keys` of this capture (``batch``: the example's batch size, the first dimension
    of its first tensor), or None when the cache is off or the model undescribable."""
    if not enabled():
        return None
    alive: list = []
    try:
        _global_hooks()
        modules = tuple((path, _describe_module(m, alive)) for path, m in model.named_modules(remove_duplicate=False))
        params = tuple((name, _tensor_kind(t), t.requires_grad)
                       for name, t in model.named_parameters(remove_duplicate=False))
        buffers = tuple((name, _tensor_kind(t)) for name, t in model.named_buffers(remove_duplicate=False))
        leaves, spec = tree_flatten((args, kwargs))
        described = [None if isinstance(x, torch.Tensor) else _describe(x, alive) for x in leaves]
        rest = (_describe(current_scope(), alive), str(torch.get_default_dtype()))
    except _Undescribable:
        _stats["undescribable"] += 1
        return None

    def inputs(symbolic: bool) -> tuple:
        return (repr(spec), tuple(_tensor_kind(x, batch if symbolic else None) + (x.requires_grad,)
                                  if isinstance(x, torch.Tensor) else d for x, d in zip(leaves, described)))

    base = (modules, params, buffers, rest)
    exact = inputs(False)
    return Keys((base, exact), (base, inputs(True)) if batch >= 2 else None, exact, tuple(alive))


def lookup(keys: Keys) -> Optional[Entry]:
    """The entry whose trace serves these inputs: one traced at exactly these shapes, else a
    batch-generic one."""
    for key in (keys.exact, keys.generic):
        entry = _entries.get(key) if key is not None else None
        if entry is not None and (key is keys.exact or entry.generic):
            _entries.move_to_end(key)
            return entry
    _stats["misses"] += 1
    return None


def measured(entry: Entry, keys: Keys) -> Optional[tuple]:
    """What capture measured on this entry's trace at these exact inputs, or None (counted: a hit,
    or a trace hit)."""
    found = entry.measured.get(keys.inputs)
    _stats["hits" if found is not None else "trace_hits"] += 1
    if found is not None:
        entry.measured.move_to_end(keys.inputs)
    return found


def remember(entry: Entry, keys: Keys, figures: tuple) -> None:
    entry.measured[keys.inputs] = figures
    while len(entry.measured) > MAX_MEASURED:
        entry.measured.popitem(last=False)


def reject(keys: Keys) -> None:
    """A hit whose passes gave other regions than the cached ones: dropped, captured afresh."""
    _stats["rejected"] += 1
    for key in (keys.exact, keys.generic):
        if key is not None:
            _entries.pop(key, None)


def store(keys: Keys, entry: Entry) -> None:
    """Keep a fresh capture's entry: under the batch-generic key when its trace is, else the exact one."""
    key = keys.generic if entry.generic and keys.generic is not None else keys.exact
    _entries[key] = entry
    _entries.move_to_end(key)
    while len(_entries) > MAX_ENTRIES:
        _entries.popitem(last=False)


def batch_generic(trace: Any, batch: int) -> bool:
    """Whether ``trace`` (:class:`whalelike.graphs.tracing.Trace`) serves any batch of 2 or more:
    torch.fx's always (it never sees a shape); torch.export's when every user input whose first
    dimension was the batch kept it symbolic (an int there: the model's code pinned the size)."""
    if batch < 2:
        return False
    if trace.method == "fx":
        return True
    from torch.fx.experimental.symbolic_shapes import is_concrete_int

    program = trace.program
    names = set(program.graph_signature.user_inputs)
    for node in program.graph_module.graph.nodes:
        if node.op != "placeholder" or node.name not in names:
            continue
        value = node.meta.get("val")
        # a size the trace specialised stays a SymInt whose expression is the number
        if isinstance(value, torch.Tensor) and value.dim() > 0 and is_concrete_int(value.shape[0]) \
                and int(value.shape[0]) == batch:
            return False
    return True


# -- describing ---------------------------------------------------------------------------------------
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
# what nn.Module keeps in __dict__ that is not the module's own configuration (the state dict's hooks
# do not run in forward; the forward and backward hooks make a model undescribable)
_MODULE_MACHINERY = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set",
                     "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                     "_load_state_dict_post_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                     "_forward_pre_hooks_with_kwargs", "_is_full_backward_hook", *_HOOKS}


def _global_hooks() -> None:
    from torch.nn.modules import module as torch_module

    for name in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks"):
        if getattr(torch_module, name, None):
            raise _Undescribable(name)


def _describe_module(m: nn.Module, alive: list) -> tuple:
    if any(getattr(m, name, None) for name in _HOOKS):
        raise _Undescribable("a forward or backward hook")
    alive.append(type(m))
    attrs = tuple(sorted((k, _describe(v, alive)) for k, v in vars(m).items() if k not in _MODULE_MACHINERY))
    return (id(type(m)), type(m).__qualname__, attrs)


def _tensor_kind(t: torch.Tensor, batch: Optional[int] = None) -> tuple:
    """Shape, dtype and device; with ``batch``, a first dimension of that size is the symbol ``"B"``."""
    shape = tuple(t.shape)
    if batch is not None and shape and shape[0] == batch:
        shape = ("B", *shape[1:])
    return (shape, str(t.dtype), str(t.device))


def _describe(v: Any, alive: list, depth: int = 0) -> Any:
    if depth > 20:
        raise _Undescribable("nested too deep")
    if v is None or isinstance(v, (bool, int, float, complex, str, bytes)):
        return (type(v).__name__, repr(v))
    if isinstance(v, (torch.dtype, torch.device, torch.Size, torch.layout, torch.memory_format, enum.Enum)):
        return (type(v).__name__, repr(v))
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(_describe(x, alive, depth + 1) for x in v))
    if isinstance(v, dict):
        return (type(v).__name__, tuple(sorted((repr(k), _describe(x, alive, depth + 1)) for k, x in v.items())))
    if isinstance(v, (set, frozenset)):
        return (type(v).__name__, tuple(sorted(repr(_describe(x, alive, depth + 1)) for x in v)))
    if isinstance(v, torch.Tensor):
        return ("tensor", _tensor_kind(v), v.requires_grad, _content(v))
    if isinstance(v, nn.Module):
        raise _Undescribable("a module referenced outside the module tree")
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        # a field left out of equality is an identity (Strategy.scope_id: which modules share one
        # scope): numbered in order of first appearance, so that the key holds the pattern, not the ids
        alive.append(type(v))
        return ("dataclass", id(type(v)), tuple(
            (f.name, _describe(getattr(v, f.name), alive, depth + 1) if f.compare
             else _identity(alive, type(v), f.name, getattr(v, f.name))) for f in dataclasses.fields(v)))
    if type(v).__name__.endswith("Config") and callable(getattr(v, "to_dict", None)):   # transformers' configs
        alive.append(type(v))
        return ("config", id(type(v)), _describe(v.to_dict(), alive, depth + 1))
    if isinstance(v, types.FunctionType):
        if v.__closure__:
            raise _Undescribable("a function with a closure")
        alive.append(v)
        return ("function", id(v))
    if isinstance(v, (types.BuiltinFunctionType, torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        alive.append(v)
        return ("builtin", id(v))
    if isinstance(v, type):
        alive.append(v)
        return ("type", id(v))
    raise _Undescribable(type(v).__name__)


class _Identities(dict):
    """The numbering of identity fields within one key (kept at the head of ``alive``)."""


def _identity(alive: list, owner: type, name: str, value: Any) -> tuple:
    if not alive or not isinstance(alive[0], _Identities):
        alive.insert(0, _Identities())
    numbers = alive[0]
    return ("identity", numbers.setdefault((owner, name, value), len(numbers)))


def _content(t: torch.Tensor) -> str:
    if t.device.type == "meta" or type(t) not in (torch.Tensor, nn.Parameter):
        raise _Undescribable("a tensor subclass or meta tensor")
    if t.numel() * t.element_size() > MAX_HASHED_BYTES:
        raise _Undescribable("a large plain tensor attribute")
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"").hexdigest()
