"""Measure per-node costs of a captured graph on fake tensors: FLOPs, memory traffic, saved activations, output shapes.

One forward and one backward of a *fake* copy of the graph (``FakeTensorMode``: tensors that know
their shape, dtype and device but own no memory, so no real compute and nothing allocated for a big
model) under ``torch.utils.flop_counter.FlopCounterMode``. Why fake and not meta tensors: a graph
from ``torch.export`` names real devices (``arange(..., device=cpu)``, ``.to(cpu)``, the CPU
attention kernel checks its inputs' device), and meta tensors are on device ``meta``, so such a
graph cannot run on them; fake tensors keep the recorded device.

FlopCounterMode has no formula for the CPU flash-attention kernels that
``F.scaled_dot_product_attention`` dispatches to on CPU (it counts only the CUDA ones), so a model
using fused attention would cost less than the same model written with explicit matmuls;
:data:`ATTENTION_FLOP_FORMULAS` adds them with torch's own shape formulas (two matmuls forward,
five backward: the kernel recomputes the scores). FlopCounterMode counts the whole run; we only
attribute its counts: a small dispatch mode reads the counter's total around every operator and
charges the difference to

* forward: the graph node the interpreter is running;
* backward: the graph node whose forward created the autograd node now executing
  (``torch._C._current_autograd_node()``; autograd sequence numbers grow in creation order, so the
  sequence number locates the creating graph node).

So the per-node numbers sum exactly to FlopCounterMode's totals.

Memory traffic: :class:`whalelike.graphs.memory_traffic.MemoryTrafficMode` runs beside the counter
(the bytes the non-matmul operators read and write: element-wise, norms, softmax, casts, gathers;
matmuls count 0 there, being priced by their FLOPs), and its running ``total`` is attributed per
node exactly as the FLOPs are, forward and backward (``NodeCosts.forward_memory_bytes``,
``backward_memory_bytes``). What runs outside every node and every autograd node is charged to
``"<unattributed>"``, as for FLOPs: the seed gradients of ones made here for the graph's outputs
(a pipeline's next stage sends those; a loss makes them), so the per-node bytes are the layers'
own traffic (``total_backward_memory_bytes`` includes the seeds). It is the emulator's bandwidth
term (:mod:`runtime.emulation.compute`), never read by the planner; why it is not derived from
the activations: :mod:`whalelike.graphs.memory_traffic`.

Activations are what autograd saves for backward (``saved_tensors_hooks``), each storage counted
once per group (TaskGraph: a tensor saved in two TaskGraphs lives on two devices) and
parameters/buffers never, charged to the node that first saved it. Each saved tensor is also
recorded with the node that produced it (``NodeCosts.saved``: the node whose output it is, or the
node inside whose operators it was made), so capture can tell a stage's inputs that its first layer
saves (a pipeline's received buffer, held by the caller whatever the stage saves) and the tensors a
``split`` group divides from the ones every tensor-parallel rank holds whole.

Mixed precision (``measure(..., autocast_dtype=torch.bfloat16)``): the same run under
``torch.autocast``, so each saved tensor and each output has the dtype autocast gives it: matmul
outputs and their inputs' casts in 2 bytes, while what autocast leaves alone (a residual stream that
starts float32, normalisations, softmax) stays float32. The casts of parameters autocast makes
(once per step: torch caches them while the autocast region is open) are not activations: they are
recorded per node in ``NodeCosts.param_copy_bytes`` and the planner counts them with the weights.

The backward's own memory (``NodeCosts.backward_live``): every tensor the run makes is counted
while it is alive (a ``weakref.finalize`` on each, fake tensors included: they are freed as real
ones are, so the saved activations autograd releases node by node leave the count), and after each
operator of the backward the count is recorded with the node it is charged to. The gradients that
end as a parameter's ``.grad`` are left out (the planner counts gradients apart), and so is every
tensor of a parameter's shape (a weight's gradient before it lands in ``.grad``: bytes that do not
grow with the batch, where the record is read per sample), so a layer's
record, read from its first operator's count to its last, is what its backward holds above what it
started with: its gradient temporaries (a float32 softmax's gradient in attention), less the saved
tensors it has already freed (``Layer.backward_temporary_bytes_per_sample``). Nothing here keeps a
tensor alive that the model would free: a saved tensor's or a node output's id is forgotten when it
dies, so a new tensor that reuses the id counts anew.

The user's model is never touched: the fake copy is a ``deepcopy`` whose memo maps every parameter
and buffer to a fake tensor of the same shape, dtype and device, so nothing real is copied.
"""
from __future__ import annotations

import bisect
import contextlib
import copy
import logging
import warnings
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from whalelike.errors import CaptureError
from whalelike.graphs.capture_cache import DERIVED_META
from whalelike.graphs.memory_traffic import FUSED_ATTENTION, MemoryTrafficMode

log = logging.getLogger(__name__)
aten = torch.ops.aten


def _attention_forward_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _attention_backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                              **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


# Fused attention kernels FlopCounterMode does not count (CPU), with torch's own shape formulas.
ATTENTION_FLOP_FORMULAS = dict(zip(FUSED_ATTENTION, (_attention_forward_flops, _attention_backward_flops)))


@dataclass(frozen=True)
class NodeOutputSpec:
    """Shape and dtype of one tensor a node produces (the whole example batch, batch dimension
    included); :class:`runtime.parallel.stage_split.ValueSpec` is the runtime's per-sample spec of
    a value crossing a pipeline stage boundary."""

    shape: tuple[int, ...]
    dtype: str


@dataclass
class NodeCosts:
    """Totals over the example batch, keyed by node name."""

    forward_flops: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    backward_flops: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    saved_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    outputs: dict[str, tuple[NodeOutputSpec, ...]] = field(default_factory=dict)
    # every saved tensor once per group: (node that saved it, node that produced it, whether it is that
    # node's output rather than a tensor made inside it, bytes); saved_bytes sums it by saver
    saved: list[tuple[str, str, bool, int]] = field(default_factory=list)
    param_copy_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))   # autocast's weight casts
    # bytes read and written by the non-matmul operators (whalelike.graphs.memory_traffic), attributed as the FLOPs
    forward_memory_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    backward_memory_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    total_forward_flops: float = 0.0
    total_backward_flops: float = 0.0
    total_forward_memory_bytes: int = 0
    total_backward_memory_bytes: int = 0
    # (node charged, bytes alive after the operator) for every operator of the backward, in order, the
    # parameters' gradients left out; and the bytes alive when the backward began (the module docstring)
    backward_live: list[tuple[str, int]] = field(default_factory=list)
    backward_start_live: int = 0


def measure(gm: fx.GraphModule, inputs: list[Any], group: dict[str, int],
            autocast_dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None) -> NodeCosts:
    """Run ``gm`` forward and backward on fake copies of itself and ``inputs``; attribute the costs.

    ``group`` maps node names to the unit (TaskGraph) within which a saved tensor is counted once.
    ``autocast_dtype``: run under ``torch.autocast`` at that dtype (the module docstring).
    ``device``: run the fake copies there instead of where ``gm`` and ``inputs`` are, a device only
    named (nothing is allocated): a graph traced on ``meta`` (a model built there) is measured under
    autocast as a device that has autocast, since ``meta`` has none.
    """
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    fake_gm = fake_copy(gm, fake_mode, device)
    fake_inputs = tree_map(lambda x: _to_fake(x, fake_mode, device), inputs)
    with fake_mode:  # factory calls in the graph (arange, ones) make fake tensors too
        return _measure(fake_gm, fake_inputs, group, autocast_dtype)


def _device_type(fake_gm: fx.GraphModule, fake_inputs: list[Any]) -> str:
    for t in [*fake_gm.parameters(), *tree_leaves(fake_inputs)]:
        if isinstance(t, torch.Tensor):
            return t.device.type
    return "cpu"


def _measure(fake_gm: fx.GraphModule, fake_inputs: list[Any], group: dict[str, int],
             autocast_dtype: Optional[torch.dtype] = None) -> NodeCosts:
    costs = NodeCosts()
    persistent = {id(t): t for t in [*fake_gm.parameters(), *fake_gm.buffers()]}
    interp = _Recorder(fake_gm, costs)
    saved: dict[tuple[int, int], bool] = {}
    param_copies: dict[int, torch.Tensor] = {}   # autocast's casts of parameters (kept alive: ids stay unique)

    def pack(t: torch.Tensor):
        root = t if t._base is None else t._base
        if interp.current is None or id(root) in persistent or id(root) in param_copies:
            return t
        key = (group.get(interp.current, -1), id(root))
        if key not in saved:
            saved[key] = True
            weakref.finalize(root, saved.pop, key, None)   # a new tensor reusing the id is saved anew
            nbytes = root.numel() * root.element_size()
            costs.saved_bytes[interp.current] += nbytes
            producer, is_output = interp.producers.get(id(root), (interp.current, False))[:2]
            costs.saved.append((interp.current, producer, is_output, nbytes))
        return t

    counter = FlopCounterMode(display=False, custom_mapping=ATTENTION_FLOP_FORMULAS)
    traffic = MemoryTrafficMode()
    alive = _Alive({tuple(p.shape) for p in fake_gm.parameters()} | {tuple(p.shape)[::-1] for p in fake_gm.parameters()})
    casting = (torch.autocast(_device_type(fake_gm, fake_inputs), dtype=autocast_dtype)
               if autocast_dtype is not None else contextlib.nullcontext())
    try:
        with counter, traffic, _Attribution(counter, interp, costs, persistent, param_copies, traffic, alive), casting, \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = interp.run(*fake_inputs, enable_io_processing=False)
            interp.current = None
            costs.total_forward_flops = counter.get_total_flops()
            costs.total_forward_memory_bytes = traffic.total
            roots = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            if roots:
                seeds = [torch.ones_like(t) for t in roots]
                costs.backward_start_live = alive.bytes
                alive.recording = True
                torch.autograd.backward(roots, seeds)
                alive.recording = False
            costs.total_backward_flops = counter.get_total_flops() - costs.total_forward_flops
            costs.total_backward_memory_bytes = traffic.total - costs.total_forward_memory_bytes
    except Exception as e:  # noqa: BLE001 - name the node that failed
        where = interp.current or "backward"
        raise CaptureError(
            f"capture: measuring costs on fake tensors failed at node {where!r} "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); operators that read tensor "
            "values (.item(), data-dependent shapes) cannot run without data, move them out of forward"
        ) from e
    costs.backward_live = alive.without_gradients([p.grad for p in fake_gm.parameters() if p.grad is not None])
    return costs


class _Alive:
    """The bytes of the tensors the run made that are alive (module docstring): each operator's
    outputs that own their storage, until each is freed; during the backward, the count after each
    operator with the node charged (``timeline``), and when each tensor was made (to leave out the
    parameters' gradients afterwards)."""

    def __init__(self, parameter_shapes: frozenset | set = frozenset()):
        self.bytes = 0
        self.recording = False
        # a tensor of a parameter's shape (or its transpose) is a weight's gradient or a copy of one: bytes that
        # do not grow with the batch, priced with the weights and the update, not per sample
        self.parameter_shapes = parameter_shapes
        self.timeline: list[tuple[str, int]] = []
        self._made: dict[int, tuple[int, int]] = {}    # id -> (timeline length when made, bytes), while alive

    def add(self, func: Any, outputs: Any, owner: Optional[str]) -> None:
        """Count ``func``'s ``outputs`` (none when it returns an alias of an input: a view, ``detach``,
        an in-place result), then record the count if the backward is being recorded."""
        aliases = any(r.alias_info is not None for r in getattr(func, "_schema", None).returns) \
            if getattr(func, "_schema", None) is not None else False
        for t in () if aliases else tree_leaves(outputs):
            if (isinstance(t, torch.Tensor) and t._base is None and id(t) not in self._made
                    and tuple(t.shape) not in self.parameter_shapes):
                nbytes = t.numel() * t.element_size()
                self.bytes += nbytes
                self._made[id(t)] = (len(self.timeline), nbytes)
                weakref.finalize(t, self._free, id(t), nbytes)
        if self.recording:
            self.timeline.append((owner or "<unattributed>", self.bytes))

    def _free(self, key: int, nbytes: int) -> None:
        self.bytes -= nbytes
        self._made.pop(key, None)

    def without_gradients(self, grads: list[torch.Tensor]) -> list[tuple[str, int]]:
        """The timeline less the bytes of ``grads`` (the parameters' gradients, alive from when each
        was made to the end) from the moment each was made."""
        roots = [g if g._base is None else g._base for g in grads]
        made = sorted(self._made[id(g)] for g in roots if id(g) in self._made)
        out, k, held = [], 0, 0
        for i, (owner, nbytes) in enumerate(self.timeline):
            while k < len(made) and made[k][0] <= i:
                held += made[k][1]
                k += 1
            out.append((owner, nbytes - held))
        return out


def fake_copy(gm: fx.GraphModule, fake_mode: FakeTensorMode, device: Optional[torch.device] = None) -> fx.GraphModule:
    """A deep copy of ``gm`` whose parameters and buffers are fake tensors of ``fake_mode`` (same
    shape, dtype, device and ``requires_grad``; tying preserved; no memory). ``device``: the fakes
    are there instead, and so is every device the graph's nodes name (the devices it was traced on).
    What is derived from the graph alone (:func:`whalelike.graphs.capture_cache.derived`: fake node
    values) is shared with ``gm``, not copied."""
    memo: dict[int, Any] = {}
    if DERIVED_META in gm.meta:
        memo[id(gm.meta[DERIVED_META])] = gm.meta[DERIVED_META]
    for p in gm.parameters():
        memo[id(p)] = nn.Parameter(_to_fake(p.detach(), fake_mode, device), requires_grad=p.requires_grad)
    for b in gm.buffers():
        memo[id(b)] = _to_fake(b, fake_mode, device)
    with warnings.catch_warnings():  # torch's own pytree specs warn about deprecated checks when copied
        warnings.simplefilter("ignore", FutureWarning)
        copied = copy.deepcopy(gm, memo)
    if device is not None:
        from whalelike.graphs.tracing import retarget_device

        for old in {t.device for t in [*gm.parameters(), *gm.buffers()]} - {torch.device(device)}:
            retarget_device(copied, old, torch.device(device))
    return copied


def _to_fake(x: Any, fake_mode: FakeTensorMode, device: Optional[torch.device] = None) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    if device is None or x.device == torch.device(device):
        return fake_mode.from_tensor(x.detach()).requires_grad_(x.requires_grad)
    with fake_mode:   # a fake tensor made on ``device``: its shape, strides and dtype, no memory
        made = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device)
    return made.requires_grad_(x.requires_grad)


class _Recorder(fx.Interpreter):
    """Runs the graph, remembering the current node, each node's output specs and, for the
    backward attribution, the highest autograd sequence number each node created."""

    def __init__(self, gm: fx.GraphModule, costs: NodeCosts):
        super().__init__(gm)
        self.costs = costs
        self.current: Optional[str] = None
        self.seq_bounds: list[int] = []  # increasing: highest sequence number created up to node i
        self.seq_nodes: list[str] = []
        # id of each node output's storage root -> (the node, True), forgotten when the root dies (ids stay unique)
        self.producers: dict[int, tuple[str, bool]] = {}

    def run_node(self, n: fx.Node) -> Any:
        self.current = n.name if n.op not in ("placeholder", "output") else None
        result = super().run_node(n)
        tensors = [t for t in tree_leaves(result) if isinstance(t, torch.Tensor)]
        if n.op != "output":
            for t in tensors:
                root = t if t._base is None else t._base
                if id(root) not in self.producers:
                    self.producers[id(root)] = (n.name, True)
                    weakref.finalize(root, self.producers.pop, id(root), None)
        self.costs.outputs[n.name] = tuple(NodeOutputSpec(tuple(t.shape), str(t.dtype).removeprefix("torch."))
                                           for t in tensors)
        seqs = [t.grad_fn._sequence_nr() for t in tensors if t.grad_fn is not None]
        if seqs and self.current is not None and (not self.seq_bounds or max(seqs) > self.seq_bounds[-1]):
            self.seq_bounds.append(max(seqs))
            self.seq_nodes.append(n.name)
        return result

    def creator(self, sequence_nr: int) -> Optional[str]:
        i = bisect.bisect_left(self.seq_bounds, sequence_nr)
        return self.seq_nodes[i] if i < len(self.seq_nodes) else None


class _Attribution(TorchDispatchMode):
    """Charges each operator's FLOPs (as FlopCounterMode counted them) and its bytes (as the
    ``traffic`` mode, a :class:`whalelike.graphs.memory_traffic.MemoryTrafficMode` entered below
    this one, counted them) to a graph node."""

    def __init__(self, counter: FlopCounterMode, interp: _Recorder, costs: NodeCosts,
                 persistent: Optional[dict] = None, param_copies: Optional[dict] = None, traffic: Any = None,
                 alive: Optional[_Alive] = None):
        super().__init__()
        self.counter, self.interp, self.costs, self.traffic, self.alive = counter, interp, costs, traffic, alive
        self.persistent = persistent if persistent is not None else {}
        self.param_copies = param_copies if param_copies is not None else {}
        self._cast: set[int] = set()   # parameters already cast (autocast casts each once per region)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.counter.get_total_flops()
        bytes_before = self.traffic.total if self.traffic is not None else 0
        out = func(*args, **(kwargs or {}))
        if (func is aten._to_copy.default and args and id(args[0]) in self.persistent
                and isinstance(out, torch.Tensor) and torch._C._current_autograd_node() is None):
            self.param_copies[id(out)] = out
            if id(args[0]) not in self._cast and self.interp.current is not None:
                self._cast.add(id(args[0]))
                self.costs.param_copy_bytes[self.interp.current] += out.numel() * out.element_size()
        delta = self.counter.get_total_flops() - before
        moved = self.traffic.total - bytes_before if self.traffic is not None else 0
        if delta or moved:
            autograd_node = torch._C._current_autograd_node()
            if autograd_node is not None:
                owner = self.interp.creator(autograd_node._sequence_nr()) or "<unattributed>"
                flops, memory = self.costs.backward_flops, self.costs.backward_memory_bytes
            else:
                owner = self.interp.current or "<unattributed>"
                flops, memory = self.costs.forward_flops, self.costs.forward_memory_bytes
            if delta:
                flops[owner] += delta
            if moved:
                memory[owner] += moved
        if self.alive is not None:
            node = torch._C._current_autograd_node()
            self.alive.add(func, out, (self.interp.creator(node._sequence_nr()) if node is not None else None)
                           if self.alive.recording else None)
        return out
