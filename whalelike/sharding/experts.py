"""Mixture-of-experts layers in a ``split`` region: which are recognised for expert parallelism, as plain data.

Today's ``transformers`` MoE layers (Mixtral's sparse MoE block, OLMoE's, Qwen2/3-MoE's, and every
class decorated with ``transformers.integrations.moe.use_experts_implementation``) keep their
experts as one module with stacked 3-D weights (``gate_up_proj`` ``[E, 2I, H]`` and ``down_proj``
``[E, H, I]``, or transposed, or ``up_proj`` without a gate, biases optional) called as
``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`` after a router
that every rank of a ``split`` group computes whole on the same tokens. Capture inlines that call
(``torch.export``: a sort, gathers, grouped or batched matmuls), so the projection analysis
(:mod:`whalelike.sharding.analysis`) sees no projection there and, without this module, every rank
would run every expert on every token: correct, but no faster than one device.

:func:`find_experts` recognises such a module from the captured graph alone, so capture (the
planner's :class:`~whalelike.sharding.groups.ShardGroup`) and the runtime's shard pass
(:mod:`runtime.tensor.experts`, which replays it on each stage graph) decide alike: the plan-time
and the run-time answers are the same function of the same graph. A module is recognised when

* its class (export's ``nn_module_stack``) dispatches its forward through
  ``use_experts_implementation`` and gates with the default ``_apply_gate`` (``act(gate) * up``
  of the two halves of ``gate_up_proj``'s output): then its math is fixed by its weights;
* it reads only its own stacked weights (and biases), with one leading expert dimension ``E``,
  and a layout its shapes tell apart (transposed or not; a square expert without a gate cannot);
* its operators form one closed unit: the three inputs above (the index an integer tensor), one
  output ``[T, H]``, every operator inside the ``split`` region;
* its activation is a submodule ``act_fn`` whose operators take one tensor and give one
  (the runtime re-runs exactly those operators).

Anything else with stacked 3-D expert weights (a custom ``_apply_gate``, a norm after each expert,
a hand-written MoE) is named in the second result with the reason, and stays as captured: every
expert whole on every rank of the group, exact, and logged (at capture and by the runtime).

Why not ``transformers``' own expert parallelism (``distributed.expert_parallel``): it shards the
experts evenly over a DTensor mesh (``E % ep_size == 0``) and installs itself on the eager module;
here the planner gives each rank its own number of experts, by speed, and the model runs as the
captured graph. The planner sees a recognised layer as one shard group of kind ``"experts"`` whose
units are the experts (one member, the experts module's path, ``per_unit`` 1: a rank's
``StagePlan.shard_sizes`` entry is its expert count), whose FLOPs are the experts' matmuls (counted
here from the shapes: ``FlopCounterMode`` has no formula for the grouped matmul transformers uses
under export) and whose divided activations are what the experts' operators saved at capture.

Invariant: pure, reads the graph (node meta recorded at capture: ``wl_path``, ``nn_module_stack``,
``val``, ``wl_shapes``) and never modifies it.
"""
from __future__ import annotations

import dataclasses
import logging
import sys
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
import torch.fx as fx

from whalelike.graphs.nodes import attribute
from whalelike.sharding.groups import ShardGroup, ShardMember
from whalelike.sharding.propagation import full_shapes

log = logging.getLogger(__name__)

KIND = "experts"
_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")
_BIASES = ("gate_up_proj_bias", "up_proj_bias", "down_proj_bias")


@dataclass(frozen=True)
class ExpertsLayout:
    """A recognised experts module: its path, ``experts`` (E), ``top_k``, ``hidden`` (H),
    ``intermediate`` (I), whether it gates (``gate_up_proj``), keeps its weights transposed
    (``[E, in, out]``) or has biases."""

    path: str
    experts: int
    top_k: int
    hidden: int
    intermediate: int
    gated: bool
    transposed: bool
    biased: bool

    @property
    def up_name(self) -> str:
        return "gate_up_proj" if self.gated else "up_proj"

    @property
    def param_names(self) -> tuple[str, ...]:
        """The parameters the runtime passes the experts, in its argument order."""
        names = (self.up_name, "down_proj")
        return names + ((f"{self.up_name}_bias", "down_proj_bias") if self.biased else ())

    def flops_per_pair(self) -> float:
        """Forward FLOPs of one (token, expert) pair: its two matmuls."""
        up = (2 if self.gated else 1) * self.intermediate
        return 2.0 * self.hidden * up + 2.0 * self.intermediate * self.hidden


@dataclass
class FoundExperts:
    """Where a recognised layout sits in one graph: its operators (``nodes``, the activation's
    ``act`` among them), its inputs ``hidden``, ``index`` and ``weights``, its ``output`` and the
    ``get_attr`` node of each parameter (by name)."""

    layout: ExpertsLayout
    nodes: list[fx.Node]
    act: list[fx.Node]
    hidden: fx.Node
    index: fx.Node
    weights: fx.Node
    output: fx.Node
    params: dict[str, fx.Node]


class _NotRecognised(Exception):
    """An experts module whose layout expert parallelism does not follow (the message says why)."""


# -- recognition ------------------------------------------------------------------------------------
def find_experts(gm: fx.GraphModule, region: Iterable[str]) -> tuple[list[FoundExperts], dict[str, str]]:
    """The experts modules of ``gm`` inside ``region`` (a split TaskGraph's node names): the
    recognised ones, and ``{module path: why not}`` for each module with stacked 3-D weights that
    is not (the module docstring). Pure."""
    region = set(region)
    by_path: dict[str, list[fx.Node]] = {}
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    for node in gm.graph.nodes:
        path = node.meta.get("wl_path", "")
        if path and node.op not in ("placeholder", "output", "get_attr") and not _is_shape(node):
            by_path.setdefault(path, []).append(node)
    found, skipped = [], {}
    for path in _candidates(gm, by_path):
        nodes = sorted((n for p, ns in by_path.items() if p == path or p.startswith(path + ".") for n in ns),
                       key=position.get)   # graph order
        readers = [n for n in nodes if any(_stacked(gm, a) for a in n.all_input_nodes)]
        if not any(n.name in region for n in readers):
            continue      # its weights live outside the split region (an un-annotated or replicated layer)
        try:
            found.append(_recognise(gm, path, nodes, region))
        except _NotRecognised as e:
            skipped[path] = str(e)
    return found, skipped


def _candidates(gm: fx.GraphModule, by_path: dict[str, list[fx.Node]]) -> list[str]:
    """Module paths whose own operators read a 3-D parameter (stacked expert weights) and that
    take an integer tensor (a routing index) or whose class or name says experts (or MoE);
    outermost first. A Conv1d's 3-D weight alone does not make a candidate."""
    out = []
    for path, nodes in by_path.items():
        inside = set(nodes)
        stacked = any(_stacked(gm, a) for n in nodes for a in n.all_input_nodes)
        routed = any(a not in inside and _dtype(a) is not None and not _dtype(a).is_floating_point
                     and not _is_shape(a) for n in nodes for a in n.all_input_nodes)
        named = any(word in f"{_class_name(path, nodes)} {path.rpartition('.')[2]}".lower() for word in ("expert", "moe"))
        if stacked and (routed or named):
            out.append(path)
    return sorted((p for p in out if not any(p.startswith(q + ".") for q in out if q != p)), key=len)


def _class_name(path: str, nodes: list[fx.Node]) -> str:
    """The qualified class name of the module at ``path`` (export's ``nn_module_stack``), or ""."""
    for node in nodes:
        for value in (node.meta.get("nn_module_stack") or {}).values():
            if isinstance(value, tuple) and value[0] == path:
                return value[1] if isinstance(value[1], str) else f"{value[1].__module__}.{value[1].__qualname__}"
    return ""


def _stacked(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` reads a 3-D parameter (stacked expert weights)."""
    value = _param(gm, node)
    return value is not None and value.dim() == 3


def _param(gm: fx.GraphModule, node: fx.Node) -> Optional[torch.Tensor]:
    if node.op != "get_attr":
        return None
    value = attribute(gm, node.target)
    return value if isinstance(value, torch.Tensor) else None


def _recognise(gm: fx.GraphModule, path: str, nodes: list[fx.Node], region: set[str]) -> FoundExperts:
    _check_class(path, nodes)
    outside = [n.name for n in nodes if n.name not in region]
    if outside:
        raise _NotRecognised(f"its operators {outside[:3]} lie outside the split region")
    inside = set(nodes)
    params: dict[str, fx.Node] = {}
    inputs: list[fx.Node] = []
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg in inside or _is_shape(arg):
                continue
            if arg.op == "get_attr":
                name = _own_name(path, arg.target)
                if _param(gm, arg) is None or name is None or params.get(name, arg) is not arg:
                    raise _NotRecognised(f"it reads {arg.target!r}, which is not one of its stacked expert weights "
                                         f"({', '.join(_WEIGHTS)}) or their biases (a norm after each expert, or "
                                         "another module's tensor)")
                params[name] = arg
            elif arg not in inputs:
                inputs.append(arg)
    layout_kw = _weights_layout(gm, params)
    hidden, index, weights = _inputs(inputs)
    (t, h), (_, k) = _shape(hidden, 2, "hidden states"), _shape(index, 2, "top-k index")
    if _shape(weights, 2, "top-k weights") != (t, k):
        raise _NotRecognised(f"its routing weights have shape {_shape(weights, 2, '')}, not [{t}, {k}] like its index")
    escaping = [n for n in nodes if any(u not in inside for u in n.users)]
    if len(escaping) != 1 or _shape(escaping[0], 2, "output") != (t, h):
        raise _NotRecognised(f"its operators give {len(escaping)} values to the rest of the model; expected one [T, H]")
    layout = ExpertsLayout(path, top_k=k, hidden=h, **_oriented(layout_kw, h))
    act = [n for n in nodes if n.meta.get("wl_path", "").startswith(path + ".act_fn")]
    act_inputs(act)
    return FoundExperts(layout, nodes, act, hidden, index, weights, escaping[0],
                        {name: params[name] for name in layout.param_names})


def _own_name(path: str, target: str) -> Optional[str]:
    """Which of the module's weights ``target`` is: ``<path>.<name>`` in the captured graph, or
    ``_<path with dots as underscores>_<name>`` in a stage graph (``split_module`` flattens
    targets); None for another module's tensor."""
    flat = path.replace(".", "_")
    for name in sorted(_WEIGHTS + _BIASES, key=len, reverse=True):
        if target == f"{path}.{name}" or target.endswith(f"{flat}_{name}") and target[:-len(name) - 1].lstrip("_") == flat:
            return name
    return None


def _check_class(path: str, nodes: list[fx.Node]) -> None:
    """The module's class must be a ``use_experts_implementation`` experts class with the default gate."""
    qualname = _class_name(path, nodes)
    if not qualname:
        raise _NotRecognised("its class is not recorded in the graph (capture with torch.export records it)")
    module, _, name = qualname.rpartition(".")
    cls = getattr(sys.modules.get(module), name, None)
    moe = sys.modules.get("transformers.integrations.moe")
    forward = getattr(getattr(cls, "forward", None), "__code__", None)
    if cls is None or moe is None or forward is None or forward.co_filename != moe.__file__:
        raise _NotRecognised(f"{qualname} is not a transformers experts class (decorated with "
                             "use_experts_implementation), so its math is not known here")
    if getattr(cls, "_apply_gate", None) is not getattr(moe, "_default_apply_gate", None):
        raise _NotRecognised(f"{qualname} gates with its own _apply_gate, not act(gate) * up")


def _is_shape(node: fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, (torch.SymInt, int)) or (node.op == "call_function" and "sym_size" in str(node.target))


def _weights_layout(gm: fx.GraphModule, params: dict[str, fx.Node]) -> dict[str, Any]:
    gated = "gate_up_proj" in params
    if gated == ("up_proj" in params) or "down_proj" not in params:
        raise _NotRecognised(f"its weights are {sorted(params)}; expected gate_up_proj (or up_proj) and down_proj")
    up_name = "gate_up_proj" if gated else "up_proj"
    biases = {f"{up_name}_bias", "down_proj_bias"} & set(params)
    if biases and len(biases) != 2:
        raise _NotRecognised(f"it has the bias {sorted(biases)} alone; expected both or none")
    if set(params) - {up_name, "down_proj"} - biases:
        raise _NotRecognised(f"its weights are {sorted(params)}; expected {up_name}, down_proj and their biases")
    shapes = {name: tuple(_param(gm, node).shape) for name, node in params.items()}
    if len({s[0] for s in shapes.values()}) != 1 or len(shapes[up_name]) != 3 or len(shapes["down_proj"]) != 3:
        raise _NotRecognised(f"its weights {shapes} do not share one leading expert dimension")
    return {"experts": shapes[up_name][0], "up": shapes[up_name][1:], "down": shapes["down_proj"][1:],
            "gated": gated, "biased": bool(biases)}


def _oriented(kw: dict[str, Any], hidden: int) -> dict[str, Any]:
    """Transposed or not, from the weights' shapes against the hidden size (exactly one must fit)."""
    up, down, factor = kw["up"], kw["down"], 2 if kw["gated"] else 1
    fits = {}
    if up[1] == hidden and down[0] == hidden and up[0] == factor * down[1]:
        fits[False] = down[1]     # [E, factor*I, H] and [E, H, I]
    if up[0] == hidden and down[1] == hidden and up[1] == factor * down[0]:
        fits[True] = down[0]      # [E, H, factor*I] and [E, I, H]
    if len(fits) != 1:
        why = "fit both orientations" if fits else "fit neither [E, out, in] nor [E, in, out]"
        raise _NotRecognised(f"its weights ({'gate_up_proj' if kw['gated'] else 'up_proj'} {list(up)}, down_proj "
                             f"{list(down)} after the expert dimension) {why} for hidden size {hidden}")
    (transposed, intermediate), = fits.items()
    return {"experts": kw["experts"], "intermediate": intermediate, "gated": kw["gated"], "transposed": transposed,
            "biased": kw["biased"]}


def _dtype(node: fx.Node) -> Optional[torch.dtype]:
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor):
        return value.dtype
    meta = node.meta.get("tensor_meta")
    return getattr(meta, "dtype", None)


def _inputs(inputs: list[fx.Node]) -> tuple[fx.Node, fx.Node, fx.Node]:
    """(hidden, index, weights): the floating [T, H], the integer [T, k] and the floating [T, k]."""
    if len(inputs) != 3:
        raise _NotRecognised(f"it takes {len(inputs)} tensors from the rest of the model "
                             f"({[n.name for n in inputs]}); expected hidden states, top-k index and top-k weights")
    dtypes = [_dtype(n) for n in inputs]
    if any(d is None for d in dtypes):
        raise _NotRecognised("the dtypes of its inputs are not recorded in the graph")
    integer = [n for n, d in zip(inputs, dtypes) if not d.is_floating_point]
    floating = [n for n, d in zip(inputs, dtypes) if d.is_floating_point]
    if len(integer) != 1 or len(floating) != 2:
        raise _NotRecognised("its inputs are not two floating tensors and one integer index")
    (index,) = integer
    k = _shape(index, 2, "top-k index")[1]
    weights = [n for n in floating if _shape(n, 2, "input")[1] == k]
    if len(weights) != 1:
        raise _NotRecognised("its floating inputs are not hidden states [T, H] and routing weights [T, k]")
    (hidden,) = [n for n in floating if n is not weights[0]]
    return hidden, index, weights[0]


def _shape(node: fx.Node, ndim: int, what: str) -> tuple:
    shapes = full_shapes(node)
    if not shapes or len(shapes) != 1 or len(shapes[0]) != ndim or any(d is None for d in shapes[0]):
        raise _NotRecognised(f"its {what} ({node.name}) is not a recorded {ndim}-D tensor")
    return shapes[0]


def act_inputs(act: list[fx.Node]) -> tuple[fx.Node, fx.Node]:
    """(input, output) of the activation's operators, which must take one tensor and give one."""
    if not act:
        raise _NotRecognised("its activation is not a submodule act_fn (nothing to re-run on this rank's experts)")
    inside = set(act)
    inputs = {a for n in act for a in n.all_input_nodes if a not in inside and not _is_shape(a)}
    outputs = [n for n in act if any(u not in inside for u in n.users)]
    if len(inputs) != 1 or len(outputs) != 1 or any(a.op == "get_attr" for a in inputs):
        raise _NotRecognised(f"its activation act_fn takes {len(inputs)} tensors and gives {len(outputs)}; "
                             "expected one of each, without parameters")
    return next(iter(inputs)), outputs[0]


# -- the planner's view -----------------------------------------------------------------------------
def experts_groups(found: list[FoundExperts], costs=None, batch: int = 1, autocast_costs=None) -> tuple[ShardGroup, ...]:
    """One :class:`ShardGroup` of kind ``"experts"`` per recognised layout: units = experts, one
    member (its path, ``per_unit`` 1), the experts' matmul FLOPs per sample (forward and
    backward: 3x the forward), and the activations its operators saved at capture."""
    out = []
    for f in found:
        lay = f.layout
        pairs = _shape(f.index, 2, "top-k index")
        flops = 3.0 * pairs[0] * pairs[1] * lay.flops_per_pair() / batch
        group = ShardGroup(lay.experts, (ShardMember(lay.path, "column", 1),), KIND, flops)
        out.append(dataclasses.replace(group, activation_bytes_per_sample=_saved(f, costs, batch),
                                       autocast_activation_bytes_per_sample=_saved(f, autocast_costs, batch)))
    return tuple(out)


def _saved(found: FoundExperts, costs, batch: int) -> float:
    """Bytes per sample the experts' operators saved at capture, except their inputs (whole on every rank)."""
    if costs is None:
        return 0.0
    inside = {n.name for n in found.nodes}
    return sum(nbytes for _, producer, _, nbytes in costs.saved if producer in inside) / batch


def log_skipped(skipped: dict[str, str], where: str) -> None:
    """One line per experts module left whole on every rank, naming it and why."""
    for path, why in skipped.items():
        log.warning("%s: the mixture-of-experts layer %s is not recognised for expert parallelism (%s); every "
                    "rank of its split group runs all its experts (exact, not faster)", where, path, why)
