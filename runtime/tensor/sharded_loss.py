"""Keep a ``split`` classifier's logits class-sharded under the cross-entropy the user actually wrote.

Whale's 100k-class head never gathers its logits: each tensor-parallel rank computes the softmax
cross-entropy from its own class shard (:func:`runtime.tensor.layers.sharded_cross_entropy`). That is
only allowed when the loss *is* a plain cross-entropy of those logits. Users rarely pass
``F.cross_entropy`` itself; they write

    lambda out, y: F.cross_entropy(out.logits.view(-1, out.logits.size(-1)), y.view(-1))
    def loss_fn(logits, y): return F.cross_entropy(logits.reshape(-1, V), y.reshape(-1), ignore_index=-100)

on a Hugging Face ``ModelOutput``, a tuple or a dict. :func:`recognise_cross_entropy` traces
``loss_fn`` with ``torch.fx`` on proxies standing for the model output's leaves and the targets
and accepts exactly ``F.cross_entropy(<reshapes and indexes of> leaf, <anything computed from the
targets and from sizes>, ignore_index=<int>)`` with mean reduction, no class weights and no label
smoothing, the cross-entropy being the returned value (indexes with slices and ints only, such as
Hugging Face's shift ``logits[:, :-1, :]``). Anything else (extra terms, a dtype change or a mask
of the logits, control flow on them, other reductions) is rejected with a reason, and the head then
gathers its logits for the user's own loss (correct, only slower); :func:`choose_classifier` logs
that once at INFO.

Why a trace and not a list of known loss objects: a lambda or a ``def`` hides the cross-entropy
from an identity check, and running the loss on example tensors cannot tell ``.view(-1, V)`` from
an operator that mixes the class dimension with others. The trace sees every operator.

The invariant: :class:`ShardedLoss` returns exactly ``loss_fn(outputs with full logits, targets)``.
Reshapes (view, reshape, flatten, unflatten, squeeze, unsqueeze, contiguous) keep the row-major
element order, and the logits leaf, a Linear's output, has its classes last. So a run of reshapes
that ends with the classes last, ``[..., V]``, maps row ``r`` to row ``r`` of its input flattened
to ``[-1, V]``: on each rank ``local.reshape(..., V_local)`` holds those rows' class shard. An
index that leaves the last dimension whole picks the same rows of the shard as of the full
logits. Each call replays the traced loss with a storage-free ``meta`` tensor of the full logits'
shape in place of the logits (their reshapes and size reads cost nothing), the real targets and
the other real output leaves, applies the logits' steps to the shard, and stops at the
cross-entropy, which becomes the sharded one. If the replay fails, the input is not ``[N, V]``
(``F.cross_entropy`` on ``[B, T, V]`` logits means classes in dimension 1) or an index may address
the classes, every rank of the group alike gathers the logits and calls the user's ``loss_fn``
instead, and says so once.
"""
from __future__ import annotations

import inspect
import logging
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.immutable_collections import immutable_dict, immutable_list
from torch.utils._pytree import TreeSpec, tree_flatten, tree_structure, tree_unflatten

from runtime.parallel.stage_split import PipelineSplit, Stage, ValueId
from runtime.tensor.layers import ProcessGroup, gather_from_region, sharded_cross_entropy
from whalelike.losses import IGNORE_INDEX

log = logging.getLogger(__name__)

# operators that keep the row-major order of the elements (so the classes stay last and unmixed)
_RESHAPE_METHODS = {"view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "contiguous"}
_RESHAPE_FUNCTIONS = {torch.reshape, torch.flatten, torch.unflatten, torch.squeeze, torch.unsqueeze}
_SIZE_METHODS = {"size", "dim", "numel"}
_SIZE_ATTRIBUTES = {"shape", "ndim"}
_CROSS_ENTROPY = inspect.signature(F.cross_entropy)


class UnrecognisedLoss(Exception):
    """The loss is not a plain cross-entropy of one output leaf; ``str(e)`` says why."""


@dataclass(frozen=True)
class CrossEntropyForm:
    """A loss recognised as ``F.cross_entropy(<reshapes of> leaves[leaf], <from targets>, ignore_index)``.

    ``graph`` is the traced loss: one placeholder per leaf of the model output (in ``tree_flatten``
    order), then one for the targets; ``call`` its cross-entropy node, the graph's output, whose
    input and target arguments are ``logits`` and ``target``.
    """

    leaf: int
    num_leaves: int
    ignore_index: int
    chain: tuple[fx.Node, ...] = field(compare=False, repr=False)   # leaf's users to the cross-entropy's input
    graph: fx.GraphModule = field(compare=False, repr=False)
    call: fx.Node = field(compare=False, repr=False)
    logits: fx.Node = field(compare=False, repr=False)
    target: Any = field(compare=False, repr=False)

    def cross_entropy_args(self, leaves: Sequence[Any], targets: torch.Tensor,
                           num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the loss up to its cross-entropy with a meta tensor of the full logits' shape;
        returns this rank's class shard of the cross-entropy's input ``[N, shard]`` and the
        targets the cross-entropy is given.

        ``leaves`` are the model output's leaves with this rank's class shard at ``leaf``. Raises
        :class:`UnrecognisedLoss` when the replay fails, the input is not ``[N, num_classes]`` or
        an index would touch the classes.
        """
        if len(leaves) != self.num_leaves:
            raise UnrecognisedLoss(f"the model output has {len(leaves)} leaves, the loss was traced with {self.num_leaves}")
        local = leaves[self.leaf]
        full = torch.empty((*local.shape[:-1], num_classes), dtype=local.dtype, device="meta")
        replay = fx.Interpreter(self.graph)
        replay.args_iter = iter([*leaves[:self.leaf], full, *leaves[self.leaf + 1:], targets])
        try:
            for node in self.graph.graph.nodes:
                if node is self.call:
                    break
                replay.env[node] = replay.run_node(node)
            logits, target = (replay.env[n] if isinstance(n, fx.Node) else n for n in (self.logits, self.target))
        except Exception as e:  # noqa: BLE001 - any failure means: not the traced form, gather instead
            raise UnrecognisedLoss(f"replaying it failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e
        if logits.dim() != 2 or logits.shape[1] != num_classes:
            raise UnrecognisedLoss(f"its cross-entropy gets logits of shape {tuple(logits.shape)}, not "
                                   f"[rows, {num_classes}] with the classes last")
        return self._local_input(local, replay.env, num_classes), target

    def _local_input(self, local: torch.Tensor, env: dict, num_classes: int) -> torch.Tensor:
        """The chain from the leaf to the cross-entropy's input, applied to this rank's shard.

        A run of reshapes becomes one ``reshape`` to the run's last full shape with the local class
        count (row-major order is kept); an index is applied as written, once it is known not to
        address the class dimension, which must be last and whole before it.
        """
        classes_last = True
        for node in self.chain:
            full = env[node]
            if node.op == "call_function" and node.target is operator.getitem:
                index = fx.node.map_arg(node.args[1], lambda n: env[n])
                if not classes_last or not _keeps_last_dim(index, local.dim()):
                    raise UnrecognisedLoss(f"its index {index!r} of the logits may address the classes")
                local = local[index]
            elif full.dim() > 0 and full.shape[-1] == num_classes:
                local = local.reshape(*full.shape[:-1], local.shape[-1])
            classes_last = full.dim() > 0 and full.shape[-1] == num_classes
            if classes_last and local.shape[:-1] != full.shape[:-1]:
                raise UnrecognisedLoss(f"the logits' shard has shape {tuple(local.shape)} where the full logits "
                                       f"have {tuple(full.shape)}")
        return local


def recognise_cross_entropy(loss_fn: Callable, output_spec: TreeSpec) -> CrossEntropyForm:
    """Trace ``loss_fn(outputs, targets)`` for a model output of structure ``output_spec``; the form
    if it is a plain mean cross-entropy of one leaf (see the module docstring), else raises
    :class:`UnrecognisedLoss`."""
    graph, leaves = _trace(loss_fn, output_spec)
    (result,) = [n for n in graph.graph.nodes if n.op == "output"]
    call = result.args[0]
    if not (isinstance(call, fx.Node) and call.op == "call_function" and call.target is F.cross_entropy):
        raise UnrecognisedLoss(f"it returns {_describe(call)}, not the value of F.cross_entropy")
    try:
        bound = _CROSS_ENTROPY.bind(*call.args, **call.kwargs)
    except TypeError as e:
        raise UnrecognisedLoss(f"F.cross_entropy is called with arguments it does not take ({e})") from None
    bound.apply_defaults()
    arguments = bound.arguments
    for name, plain, what in (("weight", None, "class weights"), ("size_average", None, "size_average"),
                              ("reduce", None, "reduce"), ("reduction", "mean", "reduction"),
                              ("label_smoothing", 0.0, "label smoothing")):
        if arguments[name] != plain or isinstance(arguments[name], fx.Node):
            raise UnrecognisedLoss(f"F.cross_entropy has {what} {_describe(arguments[name])} (only {plain!r} is sharded)")
    if not isinstance(arguments["ignore_index"], int):
        raise UnrecognisedLoss(f"its ignore_index is {_describe(arguments['ignore_index'])}, not a constant int")
    chain = _logits_chain(arguments["input"], leaves)
    return CrossEntropyForm(leaves.index(chain[0]), len(leaves), arguments["ignore_index"], tuple(chain[1:]), graph,
                            call, arguments["input"], arguments["target"])


def _trace(loss_fn: Callable, output_spec: TreeSpec) -> tuple[fx.GraphModule, list[fx.Node]]:
    """``loss_fn`` traced on proxies: placeholders ``output_0..`` (the leaves) and ``targets``."""
    tracer = fx.Tracer()
    tracer.root, tracer.graph, tracer.tensor_attrs = nn.Module(), fx.Graph(), {}
    proxies = [tracer.create_proxy("placeholder", f"output_{i}", (), {}) for i in range(output_spec.num_leaves)]
    targets = tracer.create_proxy("placeholder", "targets", (), {})
    try:
        result = loss_fn(tree_unflatten(proxies, output_spec), targets)
        tracer.create_node("output", "output", (tracer.create_arg(result),), {})
    except Exception as e:  # noqa: BLE001 - whatever fails to trace is not a form we can shard
        first = str(e).strip().splitlines()
        raise UnrecognisedLoss(f"torch.fx cannot trace it ({type(e).__name__}: {first[0] if first else ''})") from None
    tracer.graph.eliminate_dead_code()
    return fx.GraphModule(tracer.root, tracer.graph), [p.node for p in proxies]


def _logits_chain(logits: Any, leaves: list[fx.Node]) -> list[fx.Node]:
    """The leaf the cross-entropy's input is reshaped or indexed from, then each step to that
    input. The leaf's values (as opposed to its sizes) must reach nothing but that input."""
    chain = [logits]
    while isinstance(chain[-1], fx.Node) and chain[-1] not in leaves:
        node = chain[-1]
        if node.op in ("placeholder", "get_attr"):
            raise UnrecognisedLoss("the cross-entropy's input is not computed from the model output")
        if not (_is_reshape(node) or _is_plain_index(node)):
            raise UnrecognisedLoss(f"{_describe(node)} stands between the logits and F.cross_entropy "
                                   "(only view, reshape, flatten, unflatten, squeeze, unsqueeze, contiguous and "
                                   "indexing with slices and ints keep the classes last and unmixed)")
        chain.append(node.args[0])
    if not isinstance(chain[-1], fx.Node):
        raise UnrecognisedLoss("the cross-entropy's input is not computed from the model output")
    for node, consumer in zip(chain[1:], chain):
        others = [u for u in node.users if u is not consumer and not _reads_size(u)]
        if others:
            raise UnrecognisedLoss(f"the logits are also used by {_describe(others[0])}")
    if any(not _reads_size(u) for u in logits.users if u.target is not F.cross_entropy):
        raise UnrecognisedLoss("the cross-entropy's input is used elsewhere too")
    return chain[::-1]


def _is_reshape(node: fx.Node) -> bool:
    if node.op == "call_method" and node.target in _RESHAPE_METHODS:
        # Tensor.view(dtype) reinterprets the bits: not a reshape
        return not (node.target == "view" and any(isinstance(a, torch.dtype) for a in node.args[1:]))
    return node.op == "call_function" and node.target in _RESHAPE_FUNCTIONS


def _is_plain_index(node: fx.Node) -> bool:
    """``x[...]`` with slices, ints, None and Ellipsis only (no tensor or list: they gather rows)."""
    if node.op != "call_function" or node.target is not operator.getitem:
        return False
    items = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    return all(item is None or item is Ellipsis or isinstance(item, (int, slice, fx.Node)) and not isinstance(item, bool)
               and not (isinstance(item, fx.Node) and not _reads_size_value(item)) for item in items)


def _reads_size_value(node: fx.Node) -> bool:
    """A value computed from sizes only (``logits.size(1) - 1``), usable as an index bound."""
    if _reads_size(node):
        return True
    return node.op == "call_function" and node.target in (operator.sub, operator.add, operator.getitem, operator.mul,
                                                          operator.floordiv, operator.neg) and \
        all(_reads_size_value(a) for a in node.all_input_nodes)


def _keeps_last_dim(index: Any, ndim: int) -> bool:
    """Whether indexing a tensor of ``ndim`` dimensions with ``index`` leaves its last dimension whole."""
    items = index if isinstance(index, tuple) else (index,)
    if Ellipsis in items:
        return all(item == slice(None) for item in items[items.index(Ellipsis) + 1:])
    consumed = [item for item in items if item is not None]
    return len(consumed) < ndim or (len(consumed) == ndim and consumed[-1] == slice(None))


def _reads_size(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _SIZE_METHODS
    return node.op == "call_function" and node.target is getattr and node.args[1] in _SIZE_ATTRIBUTES


def _describe(value: Any) -> str:
    if not isinstance(value, fx.Node):
        return repr(value)
    if value.op == "call_method":
        return f"Tensor.{value.target}"
    if value.op == "get_attr":
        return "a tensor"
    if value.op == "call_function":
        return getattr(value.target, "__qualname__", None) or getattr(value.target, "__name__", str(value.target))
    return f"{value.op} {value.target}"


# -- which leaf of the model output a graph node is --------------------------------------------------
@dataclass(frozen=True)
class OutputLayout:
    """The model output's pytree structure and, per leaf (``tree_flatten`` order), the node of the
    graph being sharded that computes it (None: computed elsewhere, or a constant)."""

    spec: TreeSpec
    sources: tuple[Optional[fx.Node], ...]

    @classmethod
    def of_graph(cls, gm: fx.GraphModule) -> "OutputLayout":
        """``gm``'s own output is the model output (a whole captured model, or a last stage returning it)."""
        (output,) = [n for n in gm.graph.nodes if n.op == "output"]
        return cls.of_structure(output.args[0], _out_spec(gm), lambda leaf: leaf if isinstance(leaf, fx.Node) else None)

    @classmethod
    def of_stage(cls, split: PipelineSplit, stage: Stage) -> "OutputLayout":
        """The last pipeline ``stage``'s outputs (its ``module``'s output node) within the model
        output that ``split`` rebuilds from the stages' values."""
        (output,) = [n for n in stage.module.graph.nodes if n.op == "output"]
        returned = [output.args[0]] if stage.returns_single else list(output.args[0])
        nodes = dict(zip(stage.outputs, returned))
        return cls.of_structure(split.output_structure, split.output_spec,
                                lambda leaf: nodes.get(leaf) if isinstance(leaf, ValueId) else None)

    @classmethod
    def of_structure(cls, structure: Any, out_spec: Optional[TreeSpec], source: Callable[[Any], Optional[fx.Node]]):
        """From an output structure whose leaves ``source`` maps to nodes; ``out_spec`` (an exported
        graph's) rebuilds the model output from a flat ``structure``."""
        if out_spec is not None:
            leaves = list(structure) if isinstance(structure, (tuple, list)) else [structure]
            spec = out_spec
        else:
            leaves, spec = tree_flatten(_plain(structure))
        return cls(spec, tuple(source(leaf) for leaf in leaves))


def _out_spec(gm: fx.GraphModule) -> Optional[TreeSpec]:
    return getattr(getattr(gm.graph._codegen, "pytree_info", None), "out_spec", None)


def _plain(structure: Any) -> Any:
    """fx's immutable containers as the plain ones the model returns (their pytree types differ)."""
    if isinstance(structure, (dict, immutable_dict)):
        return {k: _plain(v) for k, v in structure.items()}
    if isinstance(structure, (list, immutable_list)):
        return [_plain(v) for v in structure]
    if isinstance(structure, tuple) and not hasattr(structure, "_fields"):
        return tuple(_plain(v) for v in structure)
    return structure


@dataclass(frozen=True)
class Classifier:
    """The Linear node whose logits stay class-sharded, and how the loss reads them."""

    node: fx.Node
    form: CrossEntropyForm


_logged: set = set()


def choose_classifier(gm: fx.GraphModule, candidates: Sequence[fx.Node], loss_fn: Optional[Callable],
                      layout: Optional[OutputLayout] = None, path: Callable[[fx.Node], str] = str) -> Optional[Classifier]:
    """The candidate Linear that can stay class-sharded under ``loss_fn``, or None.

    A candidate qualifies when its output is one leaf of the model output (directly, or inside a
    ModelOutput, tuple or dict), is used by nothing else, and ``loss_fn`` is a plain cross-entropy
    of exactly that leaf. ``layout`` says how ``gm``'s output makes the model output (default: it
    is the model output). Why a qualifying head is gathered instead is logged once at INFO.
    """
    if loss_fn is None:
        return None
    layout = layout or OutputLayout.of_graph(gm)
    heads = [n for n in candidates if layout.sources.count(n) == 1
             and all(u.op == "output" for u in n.users) and len(n.users) == 1]
    if not heads:
        return None
    names = ", ".join(repr(path(n)) for n in heads)
    try:
        form = recognise_cross_entropy(loss_fn, layout.spec)
    except UnrecognisedLoss as e:
        _log_once(f"split head {names} gathers its logits: loss_fn {_name(loss_fn)} is not a plain "
                  f"cross-entropy of them ({e})")
        return None
    node = layout.sources[form.leaf]
    if node not in heads:
        _log_once(f"split head {names} gathers its logits: loss_fn {_name(loss_fn)} takes the "
                  f"cross-entropy of output leaf {form.leaf}, which is not a split head's output")
        return None
    return Classifier(node, form)


def _log_once(message: str, key: Any = None) -> None:
    """Log ``message`` at INFO the first time it (or anything under ``key``) is said."""
    key = message if key is None else key
    if key not in _logged:
        _logged.add(key)
        log.info(message)


def _name(loss_fn: Callable) -> str:
    return getattr(loss_fn, "__qualname__", None) or type(loss_fn).__name__


def plain_cross_entropy(loss_fn: Any) -> Optional[int]:
    """The ``ignore_index`` if ``loss_fn(logits, targets)`` is a plain mean cross-entropy of the
    logits tensor (``F.cross_entropy``, :func:`whalelike.token_cross_entropy`, a plain
    ``nn.CrossEntropyLoss`` or a function of the forms in the module docstring), else None."""
    try:
        return recognise_cross_entropy(loss_fn, tree_structure(0)).ignore_index
    except UnrecognisedLoss:
        return None


# -- the loss the runtime calls ----------------------------------------------------------------------
@dataclass(frozen=True)
class ShardedLoss:
    """The user's cross-entropy computed from class-sharded logits: ``loss(outputs, targets)``.

    Without ``form``, ``outputs`` are this rank's logits shard ``[..., shard]`` and the loss is the
    mean cross-entropy over every row of them (``IGNORE_INDEX``-style ``ignore_index``). With a
    ``form`` (from :func:`choose_classifier`), ``outputs`` is the model output holding the shard at
    ``form.leaf`` and the result equals ``loss_fn`` on the full logits; where the form does not
    apply, the logits are gathered and ``loss_fn`` itself is called.
    """

    shard_sizes: tuple[int, ...]
    tp_index: int
    group: ProcessGroup = field(default=None, compare=False)
    ignore_index: int = IGNORE_INDEX
    form: Optional[CrossEntropyForm] = field(default=None, compare=False)
    loss_fn: Optional[Callable] = field(default=None, compare=False)

    def __call__(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        if self.form is None:
            return sharded_cross_entropy(outputs, targets, self.shard_sizes, self.tp_index, self.group,
                                         self.ignore_index)
        leaves, spec = tree_flatten(outputs)
        try:
            local_input, target = self.form.cross_entropy_args(leaves, targets, sum(self.shard_sizes))
        except UnrecognisedLoss as e:
            _log_once(f"loss_fn {_name(self.loss_fn)}: gathering the class-sharded logits because {e} "
                      "(said once)", key=id(self))
            local = leaves[self.form.leaf]
            leaves[self.form.leaf] = gather_from_region(local, self.shard_sizes, self.tp_index, self.group)
            return self.loss_fn(tree_unflatten(leaves, spec), targets)
        return sharded_cross_entropy(local_input, target, self.shard_sizes, self.tp_index, self.group,
                                     self.form.ignore_index)
