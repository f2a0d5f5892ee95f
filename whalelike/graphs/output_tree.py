"""Keep the type of a model output that torch.fx would turn into a plain dict (Hugging Face ``ModelOutput``).

``fx.Tracer`` stores a returned container as a plain ``dict``/``tuple``: a model returning
``CausalLMOutput(logits=...)`` comes out of ``symbolic_trace`` returning ``{'logits': ...}``, and a
loss written as ``out.logits`` then fails on the captured graph. ``torch.export`` keeps the type
through pytree: its graph returns the flat leaves and its codegen rebuilds the structure with the
``out_spec``. This module does the same for fx captures: :func:`flatten_output` turns such an
output into its leaves while tracing and records the spec; :func:`rebuild_output` makes the graph
module return the original type again. Downstream passes (``runtime.parallel.stage_split`` reading
``pytree_info.out_spec``) then see one convention for both front ends.

Only containers registered with ``torch.utils._pytree`` outside Python and torch themselves are
flattened (ModelOutput registers every subclass); tuples, lists, dicts and named tuples keep fx's own
handling.

**Where each model output goes in a pipeline.** The loss runs on the last stage, on the model's
whole output; a leaf of that output may be computed earlier (an encoder-decoder's
``encoder_last_hidden_state``). :func:`record_outputs` (capture) notes each leaf's Layer and whether
it is a batched tensor; :func:`loss_reads` finds which leaves the loss reads; :func:`route_outputs`
decides, the one rule the plan checks (``planner.plan_checks``) and the stage split
(``runtime.parallel.stage_split``) both apply, so a plan that is accepted runs:

* a leaf computed in the last stage stays there;
* an earlier leaf the loss is known not to read is left out: the loss receives ``None`` in its
  place (a ``ModelOutput`` then lacks that key), and it crosses no stage for the loss's sake;
* an earlier leaf the loss reads, or may read (the loss was not given, or could not be traced), is
  sent on to the last stage like any boundary value (its gradient comes back), so the loss gets the
  object the model returns; it must be a tensor batched along dimension 0, else the plan is refused
  with the fix (move the layer computing it into the last stage's region, or stop reading it).

Why a trace of the loss and not running it: the targets' shape is not known before the first
batch, and the trace sees every read, shape reads included. A loss fx cannot trace (Python control
flow on a value) reads, for this rule, every leaf. So that leaving leaves out cannot change what
the loss reads (``out[1]`` of a ``ModelOutput`` counts only the fields that are not None), the loss
is traced again with every unread leaf None, and must read the same leaves, else none is left out.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Collection, Mapping, Optional, Sequence

import torch.fx as fx
import torch.nn as nn
from torch.fx.graph import CodeGen, _PyTreeCodeGen, _PyTreeInfo
from torch.fx.immutable_collections import immutable_dict, immutable_list
from torch.utils._pytree import (SUPPORTED_NODES, GetAttrKey, MappingKey, SequenceKey, TreeSpec, tree_flatten,
                                 tree_flatten_with_path, tree_unflatten)

from whalelike.graphs.taskgraph import ModelOutputLeaf

log = logging.getLogger(__name__)

_BUILTIN_MODULES = ("builtins", "collections", "torch")


def is_foreign_tree(value: Any) -> bool:
    """A pytree container fx would not keep: registered by a library other than Python and torch."""
    kind = type(value)
    return kind in SUPPORTED_NODES and kind.__module__.split(".")[0] not in _BUILTIN_MODULES


def flatten_output(value: Any, create_arg: Callable[[Any], Any]) -> tuple[tuple, TreeSpec]:
    """The fx argument for ``value``'s leaves (``create_arg`` of each) and ``value``'s spec."""
    leaves, spec = tree_flatten(value)
    return tuple(create_arg(leaf) for leaf in leaves), spec


class _OutputTreeCodeGen(_PyTreeCodeGen):
    """Plain positional inputs (as fx traced them), the output rebuilt from ``out_spec``."""

    def gen_fn_def(self, *args, **kwargs):
        return CodeGen.gen_fn_def(self, *args, **kwargs)

    def process_inputs(self, *inputs: Any) -> Any:
        return inputs


def rebuild_output(gm: fx.GraphModule, flat: Optional[tuple], out_spec: Optional[TreeSpec]) -> None:
    """Make ``gm`` return the structure ``out_spec`` when its output is ``flat`` (what
    :func:`flatten_output` gave for the returned value; a tree passed to an operator inside the
    model is left alone)."""
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    if out_spec is None or output.args[0] != flat:
        return
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    gm.graph._codegen = _OutputTreeCodeGen(_PyTreeInfo(names, None, out_spec))
    gm.recompile()


# -- the model output's leaves, what the loss reads, and where each goes in a pipeline ---------------
OUTPUTS_META = "wl_outputs"   # GraphModule.meta key: the capture's OutputRecord, read by the stage split


@dataclass(frozen=True)
class OutputRecord:
    """What capture knows about a graph's output: its leaves and which the loss reads (None: unknown)."""

    leaves: tuple[ModelOutputLeaf, ...]
    loss_reads: Optional[frozenset[int]] = None


class OutputRouteError(ValueError):
    """A model output computed before the last stage cannot reach the loss; the message says which and the fix."""


@dataclass(frozen=True)
class OutputRoutes:
    """:func:`route_outputs`'s answer: ``(leaf, stage)`` of each leaf computed before the last
    stage that is sent on to it (``forwarded``) or left out of the loss's output (``dropped``)."""

    forwarded: tuple[tuple[ModelOutputLeaf, int], ...] = ()
    dropped: tuple[tuple[ModelOutputLeaf, int], ...] = ()


def output_leaves(gm: fx.GraphModule) -> tuple[list[Any], TreeSpec]:
    """The leaves of ``gm``'s output (graph nodes, or constants) in ``tree_flatten`` order, and the
    spec that rebuilds the model's output from them: an exported (or :func:`rebuild_output`) graph's
    ``out_spec`` over its flat output, else the plain containers fx keeps."""
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    structure = output.args[0]
    out_spec = getattr(getattr(gm.graph._codegen, "pytree_info", None), "out_spec", None)
    if out_spec is not None:
        return (list(structure) if isinstance(structure, (tuple, list)) else [structure]), out_spec
    leaves, spec = tree_flatten(plain_containers(structure))
    return leaves, spec


def plain_containers(structure: Any) -> Any:
    """fx's immutable containers as the plain ones the model returns (their pytree types differ)."""
    if isinstance(structure, (dict, immutable_dict)):
        return {k: plain_containers(v) for k, v in structure.items()}
    if isinstance(structure, (list, immutable_list)):
        return [plain_containers(v) for v in structure]
    if isinstance(structure, tuple) and not hasattr(structure, "_fields"):
        return tuple(plain_containers(v) for v in structure)
    return structure


def record_outputs(gm: fx.GraphModule, node_layer: Mapping[str, int], layer_names: Sequence[str],
                   node_outputs: Mapping[str, Sequence[Any]], batch: int) -> tuple[ModelOutputLeaf, ...]:
    """Every leaf of ``gm``'s output with its Layer (``node_layer``; a placeholder or parameter
    has none) and its tensor spec (``node_outputs``: each node's ``NodeOutputSpec``s at the example
    ``batch``; batched when its first dimension is the batch)."""
    leaves, spec = output_leaves(gm)
    names = _leaf_names(spec, len(leaves))
    out = []
    for k, leaf in enumerate(leaves):
        if not isinstance(leaf, fx.Node):
            out.append(ModelOutputLeaf(k, names[k]))
            continue
        layer = node_layer.get(leaf.name) if leaf.op not in ("placeholder", "get_attr") else None
        specs = list(node_outputs.get(leaf.name, ()))
        shape, dtype, batched = (), "", False
        if len(specs) == 1:
            whole = tuple(specs[0].shape)
            batched = len(whole) > 0 and whole[0] == batch
            shape, dtype = (whole[1:] if batched else whole), str(specs[0].dtype).removeprefix("torch.")
        out.append(ModelOutputLeaf(k, names[k], leaf.name, layer, layer_names[layer] if layer is not None else "",
                                   shape, dtype, batched))
    return tuple(out)


def _leaf_names(spec: TreeSpec, count: int) -> list[str]:
    """Readable paths of the leaves (``logits``, ``[1]``, ``hidden.[0]``); ``output`` for a lone tensor."""
    try:
        paths = [path for path, _ in tree_flatten_with_path(tree_unflatten(list(range(count)), spec))[0]]
    except Exception:  # noqa: BLE001 - a container without key paths: positions will do
        return [f"[{k}]" for k in range(count)]
    if len(paths) != count:
        return [f"[{k}]" for k in range(count)]

    def name(path) -> str:
        parts = []
        for key in path:
            if isinstance(key, MappingKey):
                parts.append(str(key.key))
            elif isinstance(key, GetAttrKey):
                parts.append(key.name)
            elif isinstance(key, SequenceKey):
                parts.append(f"[{key.idx}]")
            else:
                parts.append(str(key))
        return ".".join(parts) or "output"

    return [name(p) for p in paths]


def loss_reads(loss_fn: Optional[Callable], spec: TreeSpec) -> Optional[frozenset[int]]:
    """The leaves (indices, ``tree_flatten`` order of ``spec``) that ``loss_fn(outputs, targets)``
    reads, found by tracing it with ``torch.fx`` on proxies: a leaf is read when anything (an
    operator, a shape or dtype read) uses its proxy. None when there is no loss or fx cannot trace
    it (then every leaf may be read). Leaving the unread leaves out (None in their place) must not
    change what is read (module docstring), else every leaf counts as read."""
    if loss_fn is None:
        return None
    count = spec.num_leaves
    reads = _traced_reads(loss_fn, spec, frozenset())
    if reads is None:
        return None
    unread = frozenset(range(count)) - reads
    if unread and _traced_reads(loss_fn, spec, unread) != reads:
        log.info("the loss reads other outputs when those it does not read are None; every output is kept")
        return frozenset(range(count))
    return reads


def _traced_reads(loss_fn: Callable, spec: TreeSpec, absent: frozenset[int]) -> Optional[frozenset[int]]:
    tracer = fx.Tracer()
    tracer.root, tracer.graph, tracer.tensor_attrs = nn.Module(), fx.Graph(), {}
    proxies = {k: tracer.create_proxy("placeholder", f"output_{k}", (), {})
               for k in range(spec.num_leaves) if k not in absent}
    targets = tracer.create_proxy("placeholder", "targets", (), {})
    try:
        loss_fn(tree_unflatten([proxies.get(k) for k in range(spec.num_leaves)], spec), targets)
    except Exception as e:  # noqa: BLE001 - a loss fx cannot trace may read anything
        first = str(e).strip().splitlines()
        log.info("torch.fx cannot trace the loss (%s: %s); every model output counts as read", type(e).__name__,
                 first[0] if first else "")
        return None
    return frozenset(k for k, proxy in proxies.items() if proxy.node.users)


def route_outputs(leaves: Sequence[ModelOutputLeaf], stage_of: Callable[[ModelOutputLeaf], Optional[int]],
                  num_stages: int, reads: Optional[Collection[int]]) -> OutputRoutes:
    """Where each leaf computed before the last of ``num_stages`` stages goes (module docstring):
    ``stage_of(leaf)`` is the stage computing it (None: no stage does, a model input or constant),
    ``reads`` the leaves the loss reads (None: unknown). Raises :class:`OutputRouteError` for a
    leaf the loss reads, or may read, that is not a tensor batched along dimension 0."""
    last = num_stages - 1
    forwarded, dropped = [], []
    for leaf in leaves:
        stage = stage_of(leaf) if leaf.layer is not None else None
        if stage is None or stage >= last:
            continue
        if reads is not None and leaf.index not in reads:
            dropped.append((leaf, stage))
        elif leaf.batched:
            forwarded.append((leaf, stage))
        else:
            what = f"a tensor of shape {list(leaf.shape)}" if leaf.dtype else "not a single tensor"
            why = ("the loss reads it" if reads is not None else
                   "the loss may read it (the capture was not given loss_fn, so whalelike cannot tell)")
            stop = ("or stop reading it in the loss" if reads is not None else
                    "or pass loss_fn to whalelike.capture so that an output the loss does not read is left out")
            raise OutputRouteError(
                f"model output {leaf.name!r} ({what}, computed by layer {leaf.layer}, {leaf.layer_name}) comes from "
                f"stage {stage}, before the last stage {last}, and {why}; it cannot be sent on to the last stage, "
                "where the loss runs: only tensors batched along dimension 0 cross pipeline stages. Put layer "
                f"{leaf.layer_name} in the last stage's region, {stop}")
    return OutputRoutes(tuple(forwarded), tuple(dropped))
